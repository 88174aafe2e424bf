"""α on a real model pair: SmolLM2-135M-Instruct and its shipped trained draft.

At temperature 0 greedy speculative decoding writes the target's own greedy text, so
Corollary 3.6's β computed teacher-forced along that text is β at exactly the prefixes the
loop drafted from. Replaying Algorithm 1's rounds on it must reproduce the loop's statistics
(see `test_analysis_measure.test_loop_alpha_matches_corollary_3_6_on_the_same_greedy_text`
for the argument); here with real weights, a real tokenizer and chat prompts.
"""

import pytest

from speclm import testing
from speclm.presets import smollm2
from speclm.presets import smollm2_draft

pytestmark = pytest.mark.skipif(not smollm2.is_available(),
                                reason=f'SmolLM2 is not installed: {smollm2.SETUP_COMMAND}')

# The batch of test_estimate_tree_drafts.py (the same prompts, γ and lengths): in one pytest
# process both files run the same compiled decode loops.
PROMPTS = ('Write a short poem about the sea, then repeat its first line.',
           'List the days of the week.')
GAMMA = 3
MAX_NEW = 40


def test_loop_alpha_matches_corollary_3_6_on_smollm2():
  target = smollm2.load_model()
  draft = smollm2_draft.load(target)
  tok = smollm2.load_tokenizer()
  prompts, lengths = tok.batch([tok.encode_chat(p) for p in PROMPTS])
  replay, _ = testing.check_greedy_replay(target, draft, prompts, lengths, gamma=GAMMA,
                                          max_new_tokens=MAX_NEW, batch_size=2)
  assert 0.0 < replay.alpha < 1.0
