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

Parameters: `{'fuse': {'kernel': [2D, D]}, 'layers_{i}': <llama.DecoderLayer>,
'head': {'kernel': [D, S]}, 'embedding': [V, D], 'head_ids': [S] int32}`; `embedding` and
the head are the target's embedding table and its rows for S (borrowed, not trained).

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
from speclm.models import llama
from speclm.models import subset_vocab


class EagleModule(nn.Module):
  """The draft's trainable part; `config.vocab_size` is the head's size S."""

  config: llama.LlamaConfig

  @nn.compact
  def __call__(self, embedded, features, cache: llama.KVCache):
    """embedded, features `[B, K, D]` -> (predicted features `[B, K, D]`, logits `[B, K, S]`,
    cache with K more positions)."""
    c = self.config
    pd, dt = jnp.dtype(c.param_dtype), jnp.dtype(c.dtype)
    d = c.embed_dim
    positions = cache.lengths[:, None] + jnp.arange(embedded.shape[1])[None, :]
    fused = jnp.concatenate([embedded.astype(dt), features.astype(dt)], axis=-1)
    x = llama.Kernel((2 * d, d), 'BKE,ED->BKD', 2 * d, pd, dt, name='fuse')(fused)
    keys, values = [], []
    for i in range(c.num_layers):
      x, k, v = llama.DecoderLayer(c, name=f'layers_{i}')(
          x, positions, cache.keys[i], cache.values[i], cache.lengths)
      keys.append(k)
      values.append(v)
    logits = llama.Kernel((d, c.vocab_size), 'BKD,DS->BKS', d, pd, jnp.float32,
                          name='head')(x)
    cache = llama.KVCache(keys=jnp.stack(keys), values=jnp.stack(values),
                          lengths=cache.lengths + embedded.shape[1])
    return x, logits, cache


@dataclasses.dataclass(frozen=True)
class EagleDraft(protocol.FeatureConditionedDraft):
  """`speclm.protocol.FeatureConditionedDraft` over a `full_vocab_size` vocabulary."""

  config: llama.LlamaConfig  # the draft's layers; vocab_size = head tokens S
  full_vocab_size: int

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    return self.full_vocab_size

  @property
  def feature_dim(self) -> int:  # type: ignore[override]
    return self.config.embed_dim

  @property
  def max_context_length(self) -> int | None:
    return self.config.max_position_embeddings

  @property
  def module(self) -> EagleModule:
    return EagleModule(self.config)

  @property
  def _layers(self) -> llama.Llama:
    """A Llama of the draft's layers: the same cache, and prefill fills one position a token."""
    return llama.Llama(self.config)

  def init_cache(self, batch_size, max_length):
    return self._layers.init_cache(batch_size, max_length)

  def apply(self, params, tokens, features, cache):
    """The module on full-vocabulary `tokens` `[B, K]` -> (ĥ `[B, K, D]`, logits `[B, K, S]`,
    cache); what training differentiates."""
    embedded = jnp.take(params['embedding'], tokens, axis=0)
    return self.module.apply({'params': self.trained(params)}, embedded, features, cache)

  def extend_with_features(self, params, tokens, features, cache):
    predicted, logits, cache = self.apply(params, tokens, features, cache)
    logits = subset_vocab.to_full_vocab(logits, params['head_ids'], self.full_vocab_size)
    return logits, predicted, cache

  def prefill_with_features(self, params, inputs, input_lengths, features, cache):
    cache = cache.replace(lengths=jnp.zeros_like(cache.lengths))
    _, _, cache = self.apply(params, inputs, features, cache)
    return cache.replace(lengths=input_lengths.astype(jnp.int32))

  def prefix_length(self, input_lengths):
    return self._layers.prefix_length(input_lengths)

  def last_prefix_token(self, inputs, input_lengths):
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
    zeros = jnp.zeros((1, 1, c.embed_dim), c.dtype)
    params = dict(self.module.init(rng, zeros, zeros, cache)['params'])
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
         cpu_kernels: bool = False) -> protocol.Model:
  """An EAGLE draft `Model` for a Llama `target` from trained module parameters (`fuse`,
  `layers_{i}`); the head is the target's embedding rows `head_ids`. `cpu_kernels`: pack the
  products for `speclm.kernels.cpu_matmul` (inference only, see `llama.pack_for_cpu`; the
  head's panels rounded to bfloat16)."""
  target_config = target.definition.config
  config = draft_config(target_config, num_layers, len(head_ids), target_config.dtype)
  definition = EagleDraft(config, target.vocab_size)
  trained = jax.tree_util.tree_map(lambda x: jnp.asarray(x, config.param_dtype), trained)
  params = definition.with_target_embedding(trained, target.params['embedder']['embedding'],
                                            head_ids)
  expected = jax.eval_shape(lambda: definition.trained(definition.init_params(
      jax.random.key(0), params['embedding'], params['head_ids'])))
  trees.check_tree_shapes(expected, definition.trained(params))
  if cpu_kernels and llama.cpu_kernels_usable(config.dtype):
    params = dict(params)
    params.update(llama.pack_tree_for_cpu(definition.trained(params), rounded=('head',)))
  return protocol.Model(definition, params)


def random_draft(target: protocol.Model, num_layers: int = 1, head_size: int | None = None,
                 seed: int = 0) -> protocol.Model:
  """An untrained EAGLE draft for a Llama `target` (tests, examples); its head covers the
  first `head_size` token ids (all by default)."""
  head_ids = np.arange(head_size or target.vocab_size, dtype=np.int32)
  config = draft_config(target.definition.config, num_layers, len(head_ids),
                        target.definition.config.dtype)
  definition = EagleDraft(config, target.vocab_size)
  embedding = target.params['embedder']['embedding']
  return protocol.Model(definition, definition.init_params(jax.random.key(seed), embedding,
                                                           head_ids))
