"""A feature-conditioned draft in the style of EAGLE (Li et al., 2024) for Llama targets.

The draft reads the target's own final hidden states ("features": the inputs of the target's
output head), which the target computes anyway while verifying. At the position of token
s_k it fuses the token's embedding with the feature of the position before, h_{k−1}:

    x_k = W_fuse [e(s_k); h_{k−1}]  ->  a few decoder layers  ->  ĥ_k ≈ h_k
    q̃(· | s_≤k) = softmax(ĥ_k E_S^T)   over a subset S of tokens (q̃ = 0 elsewhere)

so it predicts the target's next feature and reads its token distribution through the
target's own (tied) embeddings E restricted to S. During a speculative round the first
proposal uses a true feature h from the last verification; the following γ−1 use the draft's
own ĥ. Any q̃ keeps speculative sampling exact (paper §3.6); the features only raise α. The
decode loop (`speclm.decoding`) feeds the features; `scripts/train_smollm2_eagle.py` trains
the SmolLM2 one.

EAGLE-3 (Li et al., 2025), `EagleDraft(feature_layers=…)`: the features are the target's
hidden states after a low, a middle and a high layer, concatenated `[n·D]` and projected to D
(`reduce`) before the fusion; past a round's first proposal the draft reads its own last hidden
state, which a final norm maps to the head; it is trained on tokens only, with "training-time
test" (`training_time_test`: unrolled on its own features, with the attention masks its cache
has while drafting).

Parameters: `{'fuse': {'kernel': [2D, D]}, 'layers_{i}': <llama.DecoderLayer>,
'head': {'kernel': [D, S]}, 'embedding': [V, D], 'head_ids': [S] int32}`, and for EAGLE-3
`'reduce': {'kernel': [n·D, D]}, 'final_norm': {'scale': [D]}` (and with `input_norms`
`'embedding_norm'`, `'feature_norm'`: `{'scale': [D]}`); `embedding` and the head are
the target's embedding table and its rows for S (borrowed, not trained).

Shape letters: B batch, K new tokens, D width, S head tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from speclm import protocol
from speclm import trees
from speclm.models import layers
from speclm.models import llama
from speclm.models import subset_vocab


class EagleModule(nn.Module):
  """The draft's trainable part; `config.vocab_size` is the head's size S.

  `target_layers` = 0: EAGLE's draft, reading the target's final hidden states (width D) and
  predicting them. n ≥ 2: EAGLE-3's, reading n target layers' hidden states (width n·D),
  which `reduce` projects to D; its own "features" are its last layer's outputs (width D),
  normalised before the head, and features of width D are taken to be those.
  """

  config: llama.LlamaConfig
  target_layers: int = 0
  input_norms: bool = False

  @nn.compact
  def __call__(self, embedded, features, cache: llama.KVCache, positions=None, visible=None):
    """embedded `[B, K, D]`, features `[B, K, D or n·D]` -> (predicted features `[B, K, D]`,
    logits `[B, K, S]`, cache with K more entries). `positions` `[B, K]` and `visible`
    `[B, K, L]` (the cache slots each query attends to) default to a chain after
    `cache.lengths`; training-time test (`training_time_test`) sets them."""
    c = self.config
    pd, dt = jnp.dtype(c.param_dtype), jnp.dtype(c.dtype)
    d = c.embed_dim
    if positions is None:
      positions = cache.lengths[:, None] + jnp.arange(embedded.shape[1])[None, :]
    features = features.astype(dt)
    if self.target_layers and features.shape[-1] == self.target_layers * d:
      features = llama.Kernel((self.target_layers * d, d), 'BKE,ED->BKD', self.target_layers * d,
                              pd, dt, name='reduce')(features)
    embedded = embedded.astype(dt)
    if self.input_norms:  # EAGLE-3's: both inputs at one scale (SmolLM2's features reach 1e3+)
      embedded = layers.RMSNorm(c.norm_eps, pd, c.norm_offset, name='embedding_norm')(embedded)
      features = layers.RMSNorm(c.norm_eps, pd, c.norm_offset, name='feature_norm')(features)
    fused = jnp.concatenate([embedded, features], axis=-1)
    x = llama.Kernel((2 * d, d), 'BKE,ED->BKD', 2 * d, pd, dt, name='fuse')(fused)
    keys, values = cache.keys, cache.values
    for i in range(c.num_layers):
      x, keys, values = llama.DecoderLayer(c, name=f'layers_{i}')(
          x, positions, keys, values, cache.lengths, visible, slot=i)
    normed = x
    if self.target_layers:
      normed = layers.RMSNorm(c.norm_eps, pd, c.norm_offset, name='final_norm')(x)
    logits = llama.Kernel((d, c.vocab_size), 'BKD,DS->BKS', d, pd, jnp.float32,
                          name='head')(normed)
    cache = llama.KVCache(keys=keys, values=values, lengths=cache.lengths + embedded.shape[1])
    return x, logits, cache


@dataclasses.dataclass(frozen=True)
class EagleDraft(protocol.FeatureConditionedDraft):
  """`speclm.protocol.FeatureConditionedDraft` over a `full_vocab_size` vocabulary."""

  config: llama.LlamaConfig  # the draft's layers; vocab_size = head tokens S
  full_vocab_size: int
  # None: EAGLE's draft (the target's final hidden states); else EAGLE-3's, reading the hidden
  # states after these target layers (at least two, e.g. a low, a middle and a high one).
  feature_layers: tuple[int, ...] | None = None
  # RMSNorms on the token embedding and the (projected) features before the fusion, as
  # EAGLE-3 has them (`embedding_norm`, `feature_norm`); drafts trained before have none.
  input_norms: bool = False

  def __post_init__(self):
    if self.feature_layers is not None and len(self.feature_layers) < 2:
      raise ValueError(f'feature_layers={self.feature_layers}: an EAGLE-3 draft reads at least'
                       ' two target layers (None reads the final hidden states).')

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    """V, the target's vocabulary (the head's S tokens are scattered into it)."""
    return self.full_vocab_size

  @property
  def feature_dim(self) -> int:  # type: ignore[override]
    """The width of the target features it reads: D, or D per feature layer."""
    return self.config.embed_dim * len(self.feature_layers or (None,))

  @property
  def max_context_length(self) -> int | None:
    """The draft layers' trained context, or None."""
    return self.config.max_position_embeddings

  @property
  def module(self) -> EagleModule:
    """The Flax module (feature fusion, the draft's layers, the subset head)."""
    return EagleModule(self.config, len(self.feature_layers or ()), self.input_norms)

  @property
  def _layers(self) -> llama.Llama:
    """A Llama of the draft's layers: the same cache, and prefill fills one position a token."""
    return llama.Llama(self.config)

  def init_cache(self, batch_size, max_length):
    """The cache of a Llama of the draft's layers; see
    `speclm.protocol.LanguageModel.init_cache`."""
    return self._layers.init_cache(batch_size, max_length)

  def apply(self, params, tokens, features, cache, positions=None, visible=None):
    """The module on full-vocabulary `tokens` `[B, K]` -> (ĥ `[B, K, D]`, logits `[B, K, S]`,
    cache); what training differentiates."""
    embedded = jnp.take(params['embedding'], tokens, axis=0)
    return self.module.apply({'params': self.trained(params)}, embedded, features, cache,
                             positions, visible)

  def extend_with_features(self, params, tokens, features, cache):
    """Logits over the full vocabulary (q̃ = 0 outside the head's tokens) and the predicted
    features ĥ `[B, K, D]`; see `speclm.protocol.FeatureConditionedDraft.extend_with_features`.
    """
    predicted, logits, cache = self.apply(params, tokens, features, cache)
    logits = subset_vocab.to_full_vocab(logits, params['head_ids'], self.full_vocab_size)
    return logits, predicted, cache

  def extend_tree_with_features(self, params, tokens, features, tree, cache):
    """Tree attention masks over the cache (as `speclm.models.llama.Llama.extend_tree`); see
    `speclm.protocol.FeatureConditionedDraft.extend_tree_with_features`."""
    positions = cache.lengths[:, None] + tree.depths
    visible = layers.tree_visibility(cache.lengths, cache.capacity, tree.ancestors)
    predicted, logits, cache = self.apply(params, tokens, features, cache, positions, visible)
    logits = subset_vocab.to_full_vocab(logits, params['head_ids'], self.full_vocab_size)
    return logits, predicted, cache

  def keep_tree_path(self, cache, start, path):
    """The Llama cache's; see `speclm.protocol.LanguageModel.keep_tree_path`."""
    return self._layers.keep_tree_path(cache, start, path)

  def prefill_with_features(self, params, inputs, input_lengths, features, cache):
    """See `speclm.protocol.FeatureConditionedDraft.prefill_with_features`."""
    cache = cache.replace(lengths=jnp.zeros_like(cache.lengths))
    _, _, cache = self.apply(params, inputs, features, cache)
    return cache.replace(lengths=input_lengths.astype(jnp.int32))

  def prefix_length(self, input_lengths):
    """The prompt lengths (one cache position per token)."""
    return self._layers.prefix_length(input_lengths)

  def last_prefix_token(self, inputs, input_lengths):
    """`[B]` the last real token of each prompt `[B, P]`."""
    return self._layers.last_prefix_token(inputs, input_lengths)

  @staticmethod
  def trained(params) -> dict:
    """The module's parameters (everything but the borrowed embedding table and head ids)."""
    return {k: v for k, v in params.items() if k not in ('embedding', 'head_ids')}

  def init_params(self, rng, embedding, head_ids) -> dict:
    """Random module parameters with the target's `embedding` `[V, D]`, head = its rows
    `head_ids`."""
    c = self.config
    cache = self.init_cache(1, 1)
    embedded = jnp.zeros((1, 1, c.embed_dim), c.dtype)
    features = jnp.zeros((1, 1, self.feature_dim), c.dtype)  # the target's: every part is used
    params = dict(self.module.init(rng, embedded, features, cache)['params'])
    return self.with_target_embedding(params, embedding, head_ids)

  def with_target_embedding(self, trained, embedding, head_ids) -> dict:
    """Full parameters from the trained ones and the target's embedding table."""
    head_ids = jnp.asarray(head_ids, jnp.int32)
    params = dict(trained)
    params['head'] = {'kernel': jnp.take(embedding, head_ids, axis=0).T.astype(
        self.config.param_dtype)}
    params['embedding'] = embedding
    params['head_ids'] = head_ids
    return params


def draft_config(target_config: llama.LlamaConfig, num_layers: int, head_size: int,
                 dtype: str = 'float32') -> llama.LlamaConfig:
  """The draft's layers: the target's width, heads, MLP and family switches; `num_layers` of
  them, attending globally (no sliding window: a draft's q may be any distribution)."""
  return dataclasses.replace(target_config, vocab_size=head_size, num_layers=num_layers,
                             tie_embeddings=True, param_dtype=dtype, dtype=dtype,
                             sliding_window=None, layer_types=None)


def make(target: protocol.Model, trained: dict, head_ids, num_layers: int,
         cpu_kernels: bool = False, feature_layers=None) -> protocol.Model:
  """An EAGLE draft `Model` for a Llama `target` from trained module parameters (`fuse`,
  `layers_{i}`; EAGLE-3's also `reduce` and `final_norm`, with `feature_layers`); the head is
  the target's embedding rows `head_ids`. `cpu_kernels`: pack the products for
  `speclm.kernels.cpu_matmul` (inference only, see `llama.pack_for_cpu`; the head's panels
  rounded to bfloat16)."""
  target_config = target.definition.config
  config = draft_config(target_config, num_layers, len(head_ids), target_config.dtype)
  definition = EagleDraft(config, target.vocab_size, _layer_tuple(feature_layers),
                         input_norms='feature_norm' in trained)
  trained = jax.tree_util.tree_map(lambda x: jnp.asarray(x, config.param_dtype), trained)
  params = definition.with_target_embedding(trained, llama.embedding_table(target),
                                            head_ids)
  expected = jax.eval_shape(lambda: definition.trained(definition.init_params(
      jax.random.key(0), params['embedding'], params['head_ids'])))
  trees.check_tree_shapes(expected, definition.trained(params))
  if cpu_kernels and llama.cpu_kernels_usable(config.dtype):
    params = dict(params)
    params.update(llama.pack_tree_for_cpu(definition.trained(params), rounded=('head',)))
  return protocol.Model(definition, params)


def random_draft(target: protocol.Model, num_layers: int = 1, head_size: int | None = None,
                 seed: int = 0, feature_layers=None, input_norms: bool = False
                 ) -> protocol.Model:
  """An untrained EAGLE draft for a Llama `target` (tests, examples); its head covers the
  first `head_size` token ids (all by default). With `feature_layers`, an EAGLE-3 one;
  `input_norms`: with `EagleDraft.input_norms`."""
  head_ids = np.arange(head_size or target.vocab_size, dtype=np.int32)
  config = draft_config(target.definition.config, num_layers, len(head_ids),
                        target.definition.config.dtype)
  definition = EagleDraft(config, target.vocab_size, _layer_tuple(feature_layers), input_norms)
  embedding = llama.embedding_table(target)
  return protocol.Model(definition, definition.init_params(jax.random.key(seed), embedding,
                                                           head_ids))


def deepen(trained: dict, new_layers: dict) -> dict:
  """`trained` (a draft's trained parameters, `layers_0 … layers_{k−1}`) with the decoder
  layers of `new_layers` (named `layers_k …`) appended as identities: their attention output
  and MLP down projections (kernel, and bias where the family has one) are set to zero, so
  each adds nothing to the residual stream and the deeper draft's logits equal the shallower
  one's until training moves them."""
  deeper = dict(trained)
  for name, layer in new_layers.items():
    if name in trained:
      raise ValueError(f'{name} is already one of the draft\'s layers.')
    layer = {part: dict(params) for part, params in layer.items()}
    for part, projection in (('attention', 'out'), ('mlp', 'down')):
      layer[part][projection] = jax.tree_util.tree_map(jnp.zeros_like,
                                                       layer[part][projection])
    deeper[name] = layer
  return deeper


def _layer_tuple(layers) -> tuple[int, ...] | None:
  return None if layers is None else tuple(int(i) for i in layers)


def eagle3_layers(num_target_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's low, middle and high target layers for a target of `num_target_layers`: the
  third, the middle one and the third from the top (decoder layers counted from 0)."""
  if num_target_layers < 3:
    raise ValueError(f'EAGLE-3 reads three layers; the target has {num_target_layers}.')
  return (min(2, num_target_layers - 3), num_target_layers // 2, num_target_layers - 3)


def parse_feature_layers(value: str, num_target_layers: int) -> tuple[int, ...] | None:
  """The training scripts' --feature_layers: 'eagle3' (`eagle3_layers`), 'final' (None: the
  target's final hidden states, as EAGLE reads them) or decoder layers such as '2,15,27'."""
  value = value.strip()
  if value == 'final':
    return None
  if value == 'eagle3':
    return eagle3_layers(num_target_layers)
  try:
    layers = tuple(int(v) for v in value.split(','))
  except ValueError:
    layers = ()
  if not layers or any(not 0 <= i < num_target_layers for i in layers):
    raise ValueError(f"feature layers {value!r}: 'eagle3', 'final' or decoder layers 0 …"
                     f" {num_target_layers - 1} such as '2,15,27'.")
  return layers


# ----------------------------------------------------------------------------------------------
# Training-time test (EAGLE-3): the draft trained on the features it will meet while drafting


def ttt_visibility(length: int, step: int, capacity: int) -> jax.Array:
  """`[T, L]` the cache slots each of T queries of unrolled step `step` attends to.

  Step i's entries sit in slots [i·T, (i+1)·T), one per position. A query of step j at
  position t drafts the j-th token after a verified position t − j: it sees step 0's entries
  (true target features) at positions ≤ t − j, and step i's entry at position t − j + i for
  i = 1 … j — the entries the draft's cache holds at that point of a round.
  """
  t = jnp.arange(length)[:, None]
  slot = jnp.arange(capacity)[None, :]
  i, position = slot // length, slot % length
  true_prefix = (i == 0) & (position <= t - step)
  own = (i >= 1) & (i <= step) & (position == t - step + i)
  return true_prefix | own


def training_time_test(definition: EagleDraft, params, tokens, features, steps: int):
  """Logits `[steps, B, T, S]` of the draft unrolled on its own features (EAGLE-3).

  `tokens` `[B, T]` a sequence, `features` `[B, T, feature_dim]` the target's features at
  each of its positions. Step 0 is teacher-forced: position t reads the target's feature of
  position t − 1. Step j reads, at position t, the draft's own step-(j−1) feature of position
  t − 1, and attends as `ttt_visibility` says; its logits at t are exactly those the draft
  gives for token t + 1 when it is the j-th proposal after the verified position t − j, with
  the sequence's tokens as its earlier proposals (`tests/test_eagle.py` checks this against
  the decode loop's `extend_with_features`). Positions t < j have no such round; leave them
  out of a loss.
  """
  batch, length = tokens.shape
  cache = definition.init_cache(batch, steps * length)
  positions = jnp.broadcast_to(jnp.arange(length)[None, :], (batch, length))
  shift = lambda x: jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))  # position t reads t − 1's
  inputs, out = shift(features), []
  for step in range(steps):
    visible = jnp.broadcast_to(ttt_visibility(length, step, steps * length)[None],
                               (batch, length, steps * length))
    cache = cache.replace(lengths=jnp.full((batch,), step * length, jnp.int32))
    predicted, logits, cache = definition.apply(params, tokens, inputs, cache, positions,
                                                visible)
    out.append(logits)
    inputs = shift(predicted)
  return jnp.stack(out)
