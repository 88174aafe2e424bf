r"""Times SmolLM2's own replies with their features: one pass against two.

The draft's training data (scripts/train_sharegpt_draft.py) needs SmolLM2's replies and, at
every position, its features and soft labels. Two passes write the replies
(`torch_replies.generate`) and then run the text through the model again
(scripts/train_smollm2_eagle.py --stage=features --feature_backend=torch: batches of 8 rows
padded to a multiple of 32); one pass keeps them while the replies are written
(`torch_replies.generate_with_features`). Both run here on the same prompts, in PyTorch
bfloat16, interleaved round by round; it prints the median seconds of each and their ratio,
and checks that both passes wrote the same replies.

  python scripts/benchmark_reply_features.py --prompts=64 --new_tokens=192 --rounds=3
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
from absl import app
from absl import flags

from speclm.analysis import benchmarking
from speclm.data import builtin_prompts
from speclm.data import torch_replies
from speclm.models import eagle
from speclm.presets import smollm2

_PROMPTS = flags.DEFINE_integer('prompts', 64, 'Prompts answered together (one batch).')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 192, 'Longest reply, in tokens.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Interleaved rounds.')
_TOP_K = 16
_FEATURE_BATCH, _BUCKET = 8, 32  # the features stage's defaults


def two_passes(model, forward, prompts, end_ids):
  """Replies, then the features stage's forward pass over prompt + reply."""
  replies = torch_replies.generate(model, prompts, _NEW_TOKENS.value, end_ids)
  rows = [p + r for p, r in zip(prompts, replies)]
  width = -(-max(map(len, rows)) // _BUCKET) * _BUCKET
  tokens = np.zeros((-(-len(rows) // _FEATURE_BATCH) * _FEATURE_BATCH, width), np.int64)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  for i in range(0, len(tokens), _FEATURE_BATCH):
    forward(tokens[i:i + _FEATURE_BATCH])
  return replies


def one_pass(model, layers, prompts, end_ids):
  rows = torch_replies.generate_with_features(model, prompts, _NEW_TOKENS.value, end_ids,
                                              layers, _TOP_K)
  return [row.reply for row in rows]


def main(argv):
  del argv
  import torch  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import hf_llama  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(os.cpu_count() or 1)
  target = smollm2.load_model()
  layers = eagle.eagle3_layers(target.definition.config.num_layers)
  model = hf_llama.to_transformers(target).to(torch.bfloat16).eval()
  tokenizer = smollm2.load_tokenizer()
  texts = builtin_prompts.heldout_prompts(_PROMPTS.value)
  prompts = sorted((tokenizer.encode_chat(t) for t in texts), key=len)
  end_ids = tokenizer.end_ids
  forward = torch_replies.teacher_forced_features(model, layers, _TOP_K)
  print(benchmarking.machine_line())
  print(f'{len(prompts)} prompts of {len(prompts[0])}-{len(prompts[-1])} tokens,'
        f' up to {_NEW_TOKENS.value} new tokens, layers {layers}, top {_TOP_K}')
  seconds = {'two passes': [], 'one pass': []}
  replies = {}
  for round_index in range(_ROUNDS.value):
    for name in (seconds if round_index % 2 == 0 else reversed(list(seconds))):
      start = time.perf_counter()
      if name == 'two passes':
        replies[name] = two_passes(model, forward, prompts, end_ids)
      else:
        replies[name] = one_pass(model, layers, prompts, end_ids)
      seconds[name].append(time.perf_counter() - start)
      print(f'round {round_index + 1}: {name} {seconds[name][-1]:.1f} s', flush=True)
  tokens = sum(map(len, replies['one pass']))
  two, one = (statistics.median(seconds[n]) for n in ('two passes', 'one pass'))
  print(f'reply tokens: {tokens}; same replies: {replies["one pass"] == replies["two passes"]}')
  print(f'two passes {two:.1f} s ({tokens / two:.0f} reply tokens/s), one pass {one:.1f} s'
        f' ({tokens / one:.0f} reply tokens/s): one pass {two / one:.2f}x as fast')


if __name__ == '__main__':
  app.run(main)
