"""Built-in prompt sets for the embedded default (SmolLM2-135M-Instruct + its trained draft).

Three disjoint sets, all user messages for a chat model:
  * `demo_prompts()` — eight varied requests the demo job decodes;
  * `training_prompts()` — instructions × topics used to distill the draft;
  * `heldout_prompts()` — the same kinds of instructions on topics never used in training,
    on which the draft's α is measured for its model card.
"""

from __future__ import annotations

import random

DEMO_PROMPTS = (
    'Explain why the sky is blue in two sentences.',
    'Write a short poem about autumn leaves.',
    'Give me three tips for staying focused while studying.',
    'What is the difference between a virus and a bacterium?',
    'Summarize the plot of Romeo and Juliet in a few sentences.',
    'How do I make a simple tomato pasta sauce?',
    'Write a Python function that returns the factorial of a number.',
    'What are the main causes of climate change?',
)

_INSTRUCTIONS = (
    'Explain {topic} in simple terms.',
    'Write a short paragraph about {topic}.',
    'Give me three interesting facts about {topic}.',
    'What are the advantages and disadvantages of {topic}?',
    'Describe the history of {topic} briefly.',
    'How would you explain {topic} to a ten-year-old?',
    'Write a short poem about {topic}.',
    'List five words related to {topic}.',
    'Why is {topic} important?',
    'Write a short story that involves {topic}.',
    'What are common misconceptions about {topic}?',
    'Give me a step-by-step guide to learning about {topic}.',
    'Compare {topic} with something similar.',
    'Write a tweet about {topic}.',
    'What questions would a student ask about {topic}?',
    'Summarize what you know about {topic} in one sentence.',
)

_TRAINING_TOPICS = (
    'photosynthesis', 'the water cycle', 'volcanoes', 'the Roman Empire', 'gravity',
    'machine learning', 'the human heart', 'electric cars', 'coffee', 'the moon',
    'recycling', 'honey bees', 'the internet', 'chess', 'rainbows', 'the Renaissance',
    'vaccines', 'solar panels', 'sleep', 'the stock market', 'dinosaurs', 'jazz music',
    'the Great Wall of China', 'earthquakes', 'democracy', 'bread baking', 'black holes',
    'the French Revolution', 'meditation', 'rainforests', 'video games', 'the printing press',
    'ocean tides', 'friendship', 'computers', 'healthy eating', 'mountains', 'the Olympic Games',
    'electricity', 'penguins', 'cloud computing', 'the Pyramids of Egypt', 'exercise',
    'public libraries', 'wind energy', 'the immune system', 'bicycles', 'time management',
    'the periodic table', 'social media', 'deserts', 'Shakespeare', 'trains', 'teamwork',
    'antibiotics', 'the Amazon river', 'robots', 'gardening', 'airplanes', 'money',
)

_HELDOUT_TOPICS = (
    'glaciers', 'the violin', 'spiders', 'nuclear power', 'the Silk Road', 'tea', 'comets',
    'basketball', 'bridges', 'the printing of newspapers', 'owls', 'batteries',
)


def demo_prompts() -> list[str]:
  """The demo's eight prompts (`DEMO_PROMPTS`), as a new list."""
  return list(DEMO_PROMPTS)


def _combine(topics, count: int, seed: int) -> list[str]:
  pairs = [(i, t) for i in _INSTRUCTIONS for t in topics]
  random.Random(seed).shuffle(pairs)
  return [instruction.format(topic=topic) for instruction, topic in pairs[:count]]


def training_prompts(count: int = 960, seed: int = 0) -> list[str]:
  """Up to 960 (16 instructions × 60 topics) distinct training requests."""
  return _combine(_TRAINING_TOPICS, count, seed)


def heldout_prompts(count: int = 16, seed: int = 1) -> list[str]:
  """Requests on topics absent from training (up to 192)."""
  return _combine(_HELDOUT_TOPICS, count, seed)
