"""T5 v1.0 and v1.1 encoder-decoders in Flax, with T5X's parameter tree.

Implements `speclm.protocol.LanguageModel`: `prefill` runs the encoder once, stores every
decoder layer's cross-attention keys and values in the cache, and feeds the decoder start
token; `extend` appends K ≥ 1 decoder tokens at each row's own position (causal within the K),
so the same call decodes one token or verifies γ drafted ones.

The two versions differ only in the MLP and the output layer:
  * v1.0: ReLU MLP (`mlp/wi`, `mlp/wo`); logits through the shared embedding divided by √D.
  * v1.1: gated GELU (tanh approximation) MLP (`mlp/wi_0`, `mlp/wi_1`, `mlp/wo`); untied
    `decoder/logits_dense`.
Both: RMS layer norm without bias or mean subtraction (ε 1e-6, computed in float32), no
1/√H scaling of attention logits, relative position biases (32 buckets, max distance 128;
bidirectional in the encoder, causal in the decoder; one table per stack, shared by its layers).

Parameter tree, named and shaped exactly as T5X's (kernels are 2-D `[in, out]`):
  token_embedder/embedding                                  [V, D]
  encoder/relpos_bias/rel_embedding                         [N, buckets]
  encoder/layers_{i}/pre_attention_layer_norm/scale         [D]
  encoder/layers_{i}/attention/{query,key,value}/kernel     [D, N*H]
  encoder/layers_{i}/attention/out/kernel                   [N*H, D]
  encoder/layers_{i}/pre_mlp_layer_norm/scale               [D]
  encoder/layers_{i}/mlp/{wi | wi_0, wi_1}/kernel           [D, F]
  encoder/layers_{i}/mlp/wo/kernel                          [F, D]
  encoder/encoder_norm/scale                                [D]
  decoder/relpos_bias/rel_embedding                         [N, buckets]
  decoder/layers_{i}/pre_self_attention_layer_norm/scale    [D]
  decoder/layers_{i}/self_attention/…                       (as attention above)
  decoder/layers_{i}/pre_cross_attention_layer_norm/scale   [D]
  decoder/layers_{i}/encoder_decoder_attention/…            (as attention above)
  decoder/layers_{i}/pre_mlp_layer_norm/scale, mlp/…        (as above)
  decoder/decoder_norm/scale                                [D]
  decoder/logits_dense/kernel                               [D, V]   (v1.1 only)

Shape letters: B batch, P encoder (input) length, K new decoder tokens, L decoder cache
positions, D model width, N heads, H head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from speclm import protocol
from speclm import trees
from speclm.models import layers
# The configuration lives in its own module; the names are this module's as well.
from speclm.models.t5_config import DEFAULT_VOCABULARY_PATH
from speclm.models.t5_config import T5Config


@struct.dataclass
class T5Cache:
  """Decoder state: self-attention keys/values `[layers, B, L, N, H]` and each row's length.

  The cross-attention keys/values `[layers, B, P, N, H]` and the encoder lengths `[B]` are
  written by `prefill` (before it, P is 0); `extend` and rollback never change them.
  """

  keys: jax.Array
  values: jax.Array
  cross_keys: jax.Array
  cross_values: jax.Array
  encoder_lengths: jax.Array
  lengths: jax.Array

  @property
  def capacity(self) -> int:
    """L, the decoder positions each row can hold (static)."""
    return self.keys.shape[2]


# ----------------------------------------------------------------------------------------------
# Building blocks


def relative_position_bucket(relative_position, *, bidirectional: bool, num_buckets: int,
                             max_distance: int):
  """T5's bucket of `relative_position` = key position − query position (jnp or np ints).

  Half the buckets (per direction, when bidirectional) hold exact small distances; the rest
  grow logarithmically up to `max_distance`, beyond which everything shares the last bucket.
  """
  xp = jnp if isinstance(relative_position, jax.Array) else np
  n = -relative_position
  bucket = 0
  if bidirectional:
    num_buckets //= 2
    bucket = (n < 0).astype(np.int32) * num_buckets
    n = xp.abs(n)
  else:
    n = xp.maximum(n, 0)
  max_exact = num_buckets // 2
  is_small = n < max_exact
  # The ε keeps log(0) finite; small distances take the other branch anyway.
  scaled = (xp.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps)
            / math.log(max_distance / max_exact) * (num_buckets - max_exact))
  large = xp.minimum(max_exact + scaled.astype(np.int32), num_buckets - 1)
  return bucket + xp.where(is_small, n, large).astype(np.int32)


def _activation(name: str, x: jax.Array) -> jax.Array:
  if name == 'relu':
    return jax.nn.relu(x)
  if name == 'gelu':
    return jax.nn.gelu(x, approximate=True)
  if name == 'gelu_exact':
    return jax.nn.gelu(x, approximate=False)
  if name == 'silu':
    return jax.nn.silu(x)
  return x  # 'linear'


class Dense(nn.Module):
  """A bias-free projection with a 2-D `[in, out]` kernel (T5X's flattened DenseGeneral)."""

  features: int
  stddev: float
  param_dtype: Any
  dtype: Any

  @nn.compact
  def __call__(self, x):
    from speclm.kernels import cpu_matmul  # pylint: disable=import-outside-toplevel
    # See `pack_for_cpu`: few rows stream the packed copy, long inputs take XLA's product.
    if self.has_variable('params', 'packed') and cpu_matmul.serves(math.prod(x.shape[:-1])):
      return cpu_matmul.packed_product(x, self.get_variable('params', 'packed'),
                                       (self.features,), self.dtype)
    kernel = self.param('kernel', nn.initializers.normal(self.stddev),
                        (x.shape[-1], self.features), self.param_dtype)
    return layers.dot('...i,io->...o', x, kernel, self.dtype)


class RelativePositionBiases(nn.Module):
  """Learned per-head bias for each position bucket; `rel_embedding` is `[N, buckets]`."""

  config: T5Config
  bidirectional: bool

  @nn.compact
  def __call__(self, relative_position):
    """relative_position (key − query) `[..., Q, L]` ints -> float32 bias `[..., N, Q, L]`."""
    c = self.config
    table = self.param('rel_embedding', nn.initializers.normal(0.1),
                       (c.num_heads, c.relative_attention_num_buckets), jnp.dtype(c.param_dtype))
    bucket = relative_position_bucket(
        relative_position, bidirectional=self.bidirectional,
        num_buckets=c.relative_attention_num_buckets,
        max_distance=c.relative_attention_max_distance)
    bias = jnp.take(table.astype(jnp.float32), bucket, axis=1)  # [N, ..., Q, L]
    return jnp.moveaxis(bias, 0, -3)


class Attention(nn.Module):
  """Multi-head attention without 1/√H scaling (T5 folds it into the query initialisation)."""

  config: T5Config

  def setup(self):
    """The query, key, value and output projections (T5X initialisation scales)."""
    c = self.config
    pd, dt = jnp.dtype(c.param_dtype), jnp.dtype(c.dtype)
    inner = c.num_heads * c.head_dim
    self.query = Dense(inner, (c.emb_dim * c.head_dim) ** -0.5, pd, dt)
    self.key = Dense(inner, c.emb_dim ** -0.5, pd, dt)
    self.value = Dense(inner, c.emb_dim ** -0.5, pd, dt)
    self.out = Dense(c.emb_dim, inner ** -0.5, pd, dt)

  def _heads(self, x):
    return x.reshape(*x.shape[:-1], self.config.num_heads, self.config.head_dim)

  def project_query(self, x):
    """`[B, Q, D]` -> `[B, Q, N, H]`."""
    return self._heads(self.query(x))

  def project_key_value(self, x):
    """`[B, S, D]` -> keys, values `[B, S, N, H]`."""
    return self._heads(self.key(x)), self._heads(self.value(x))

  def attend(self, q, keys, values, bias, visible):
    """q `[B, Q, N, H]`, keys/values `[B, S, N, H]`, bias broadcastable to `[B, N, Q, S]`,
    visible a boolean broadcastable to `[B, N, Q, S]` -> `[B, Q, D]`."""
    dt = jnp.dtype(self.config.dtype)
    scores = jnp.einsum('BQNH,BSNH->BNQS', q, keys.astype(dt),
                        preferred_element_type=jnp.float32)
    if bias is not None:
      scores = scores + bias
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum('BNQS,BSNH->BQNH', weights, values.astype(dt),
                     preferred_element_type=jnp.float32).astype(dt)
    return self.out(out.reshape(*out.shape[:2], -1))


class MLP(nn.Module):
  """T5's MLP: one activation (v1.0: ReLU) or a gated product of several (v1.1: GeGLU).

  `__call__`: x `[B, K, D]` -> `[B, K, D]` through width F.
  """
  config: T5Config

  @nn.compact
  def __call__(self, x):
    c = self.config
    pd, dt = jnp.dtype(c.param_dtype), jnp.dtype(c.dtype)
    acts = c.mlp_activations
    hidden = None
    for i, act in enumerate(acts):
      name = 'wi' if len(acts) == 1 else f'wi_{i}'
      h = _activation(act, Dense(c.mlp_dim, c.emb_dim ** -0.5, pd, dt, name=name)(x)
                      .astype(jnp.float32))
      hidden = h if hidden is None else hidden * h
    return Dense(c.emb_dim, c.mlp_dim ** -0.5, pd, dt, name='wo')(hidden.astype(dt))


class EncoderLayer(nn.Module):
  """One pre-norm encoder block: bidirectional self-attention, then the MLP.

  `__call__`: x `[B, P, D]`, the relative-position bias and the visibility mask -> `[B, P, D]`.
  """
  config: T5Config

  def setup(self):
    """The two norms, the self-attention and the MLP."""
    c = self.config
    pd = jnp.dtype(c.param_dtype)
    self.pre_attention_layer_norm = layers.RMSNorm(c.layer_norm_epsilon, pd)
    self.attention = Attention(c)
    self.pre_mlp_layer_norm = layers.RMSNorm(c.layer_norm_epsilon, pd)
    self.mlp = MLP(c)

  def __call__(self, x, bias, visible):
    h = self.pre_attention_layer_norm(x)
    k, v = self.attention.project_key_value(h)
    x = x + self.attention.attend(self.attention.project_query(h), k, v, bias, visible)
    return x + self.mlp(self.pre_mlp_layer_norm(x))


class Encoder(nn.Module):
  """The encoder stack: shared bidirectional relative-position biases, layers, final norm."""
  config: T5Config

  def setup(self):
    """The relative-position biases, the layers and the final norm."""
    c = self.config
    self.relpos_bias = RelativePositionBiases(c, bidirectional=True)
    self.layers = [EncoderLayer(c) for _ in range(c.num_encoder_layers)]
    self.encoder_norm = layers.RMSNorm(c.layer_norm_epsilon, jnp.dtype(c.param_dtype))

  def __call__(self, x, input_lengths):
    """Embedded inputs `[B, P, D]` -> encoded `[B, P, D]`; keys past a row's length are masked."""
    width = x.shape[1]
    positions = np.arange(width)
    bias = self.relpos_bias(positions[None, :] - positions[:, None])[None]  # [1, N, P, P]
    visible = (jnp.arange(width)[None, :] < input_lengths[:, None])[:, None, None, :]
    for layer in self.layers:
      x = layer(x, bias, visible)
    return self.encoder_norm(x)


class DecoderLayer(nn.Module):
  """One pre-norm decoder block: causal self-attention over the cache, cross-attention to
  the encoder's output, then the MLP.
  """
  config: T5Config

  def setup(self):
    """The three norms, the self- and cross-attention and the MLP."""
    c = self.config
    pd = jnp.dtype(c.param_dtype)
    self.pre_self_attention_layer_norm = layers.RMSNorm(c.layer_norm_epsilon, pd)
    self.self_attention = Attention(c)
    self.pre_cross_attention_layer_norm = layers.RMSNorm(c.layer_norm_epsilon, pd)
    self.encoder_decoder_attention = Attention(c)
    self.pre_mlp_layer_norm = layers.RMSNorm(c.layer_norm_epsilon, pd)
    self.mlp = MLP(c)

  def cross_key_value(self, encoded):
    """Encoded `[B, P, D]` -> this layer's cross keys, values `[B, P, N, H]`."""
    return self.encoder_decoder_attention.project_key_value(encoded)

  def __call__(self, x, self_bias, self_visible, keys, values, lengths, cross_keys,
               cross_values, cross_visible):
    """x `[B, K, D]`; keys/values `[B, L, N, H]` of this layer; lengths `[B]` before x."""
    h = self.pre_self_attention_layer_norm(x)
    k, v = self.self_attention.project_key_value(h)
    # Write the K new entries at each row's own offset (a scatter across rows).
    write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice(
        cache, new.astype(cache.dtype), (start, 0, 0)))
    keys = write(keys, k, lengths)
    values = write(values, v, lengths)
    x = x + self.self_attention.attend(self.self_attention.project_query(h), keys, values,
                                       self_bias, self_visible)
    h = self.pre_cross_attention_layer_norm(x)
    x = x + self.encoder_decoder_attention.attend(
        self.encoder_decoder_attention.project_query(h), cross_keys, cross_values, None,
        cross_visible)
    x = x + self.mlp(self.pre_mlp_layer_norm(x))
    return x, keys, values


class Decoder(nn.Module):
  """The decoder stack: causal relative-position biases, layers, final norm, the head."""
  config: T5Config

  def setup(self):
    """The relative-position biases, the layers, the final norm and (untied) the head."""
    c = self.config
    pd, dt = jnp.dtype(c.param_dtype), jnp.dtype(c.dtype)
    self.relpos_bias = RelativePositionBiases(c, bidirectional=False)
    self.layers = [DecoderLayer(c) for _ in range(c.num_decoder_layers)]
    self.decoder_norm = layers.RMSNorm(c.layer_norm_epsilon, pd)
    if not c.logits_via_embedding:
      self.logits_dense = Dense(c.vocab_size, c.emb_dim ** -0.5, pd, dt)

  def cross_key_value(self, encoded):
    """Encoded `[B, P, D]` -> cross keys, values `[layers, B, P, N, H]`, computed once."""
    kv = [layer.cross_key_value(encoded) for layer in self.layers]
    return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

  def __call__(self, x, cache: T5Cache, tree=None):
    """Embedded tokens `[B, K, D]` at positions `cache.lengths + k` -> (normalised hidden
    `[B, K, D]`, cache with the new self-attention entries and lengths + K).

    With a `speclm.token_trees.TreeLayout` `tree` the K tokens are a token tree: node k at
    position lengths + depth, attending to the committed prefix and its ancestors."""
    cache_positions = jnp.arange(cache.capacity)
    if tree is None:
      positions = cache.lengths[:, None] + jnp.arange(x.shape[1])[None, :]  # [B, K]
      # Query k of row b sits at positions[b, k] and sees cache positions <= its own.
      self_visible = (cache_positions[None, None, :] <= positions[:, :, None])[:, None]
      key_positions = cache_positions[None, :]
    else:
      positions = cache.lengths[:, None] + tree.depths
      self_visible = layers.tree_visibility(cache.lengths, cache.capacity, tree.ancestors)[:, None]
      # Slot lengths + k holds node k, at position lengths + depths[k]; earlier slots are
      # committed positions (later ones are never visible).
      offset = cache_positions[None, :] - cache.lengths[:, None]  # [B, L]
      node_depth = jnp.take_along_axis(tree.depths, jnp.clip(offset, 0, x.shape[1] - 1), axis=1)
      key_positions = jnp.where((offset >= 0) & (offset < x.shape[1]),
                                cache.lengths[:, None] + node_depth, cache_positions[None, :])
    self_bias = self.relpos_bias(key_positions[:, None, :] - positions[:, :, None])
    cross_visible = (jnp.arange(cache.cross_keys.shape[2])[None, :]
                     < cache.encoder_lengths[:, None])[:, None, None, :]
    new_keys, new_values = [], []
    for i, layer in enumerate(self.layers):
      x, k, v = layer(x, self_bias, self_visible, cache.keys[i], cache.values[i], cache.lengths,
                      cache.cross_keys[i], cache.cross_values[i], cross_visible)
      new_keys.append(k)
      new_values.append(v)
    cache = cache.replace(keys=jnp.stack(new_keys), values=jnp.stack(new_values),
                          lengths=cache.lengths + x.shape[1])
    return self.decoder_norm(x), cache

  def logits(self, hidden):
    """Hidden `[B, K, D]` -> float32 logits `[B, K, V]` through the untied head."""
    return self.logits_dense(hidden).astype(jnp.float32)


class T5Module(nn.Module):
  """The Flax module: `encode`, `cross_key_value`, `decode`; `__call__` touches every param."""

  config: T5Config

  def setup(self):
    """The shared token embedding, the encoder and the decoder."""
    c = self.config
    self.token_embedder = nn.Embed(c.vocab_size, c.emb_dim, param_dtype=jnp.dtype(c.param_dtype),
                                   embedding_init=nn.initializers.normal(stddev=1.0))
    self.encoder = Encoder(c)
    self.decoder = Decoder(c)

  def _embed(self, tokens):
    return self.token_embedder(tokens).astype(jnp.dtype(self.config.dtype))

  def encode(self, inputs, input_lengths):
    """Inputs `[B, P]` with lengths `[B]` -> encoded `[B, P, D]`."""
    return self.encoder(self._embed(inputs), input_lengths)

  def cross_key_value(self, encoded):
    """Encoded `[B, P, D]` -> cross keys, values `[layers, B, P, N, H]`."""
    return self.decoder.cross_key_value(encoded)

  def decode(self, tokens, cache: T5Cache, tree=None):
    """Decoder tokens `[B, K]` (a token tree with a `tree` layout) -> (float32 logits
    `[B, K, V]`, cache)."""
    hidden, cache = self.decoder(self._embed(tokens), cache, tree)
    if self.config.logits_via_embedding:
      table = self.token_embedder.embedding
      logits = jnp.einsum('BKD,VD->BKV', hidden, table.astype(hidden.dtype),
                          preferred_element_type=jnp.float32)
      return logits / math.sqrt(self.config.emb_dim), cache
    return self.decoder.logits(hidden), cache

  def __call__(self, inputs, input_lengths, decoder_tokens, cache: T5Cache):
    encoded = self.encode(inputs, input_lengths)
    cross_keys, cross_values = self.cross_key_value(encoded)
    cache = cache.replace(cross_keys=cross_keys.astype(cache.cross_keys.dtype),
                          cross_values=cross_values.astype(cache.cross_values.dtype),
                          encoder_lengths=input_lengths.astype(jnp.int32))
    return self.decode(decoder_tokens, cache)


# ----------------------------------------------------------------------------------------------
# The protocol


@dataclasses.dataclass(frozen=True)
class T5(protocol.LanguageModel):
  """`speclm.protocol.LanguageModel` for a `T5Config`.

  The autoregressive sequence is the decoder's: after `prefill` it holds the start token
  (`prefix_length` is 1 whatever the input length), so a T5 draft pairs with a T5 target.
  """

  config: T5Config

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    """V."""
    return self.config.vocab_size

  @property
  def module(self) -> T5Module:
    """The Flax module for this config (parameters are passed to its `apply`)."""
    return T5Module(self.config)

  @property
  def max_context_length(self) -> None:
    """None: T5's positions are relative (bucketed), so no length is built into the model."""
    return None

  def init_params(self, rng: jax.Array) -> dict:
    """Random parameters (compiled once per config, so repeated calls are cheap)."""
    return _init_jit(self, rng)

  def param_shapes(self) -> dict:
    """The parameter tree as `jax.ShapeDtypeStruct`s, without allocating anything (traced once
    per config: through `_init_jit`, whose traces jit keeps)."""
    return jax.eval_shape(functools.partial(_init_jit, self), jax.random.key(0))

  def init_cache(self, batch_size: int, max_length: int, input_length: int = 0) -> T5Cache:
    """An empty cache of `max_length` decoder positions; `prefill` sizes the encoder side."""
    c = self.config
    dt = jnp.dtype(c.dtype)
    shape = (c.num_decoder_layers, batch_size, max_length, c.num_heads, c.head_dim)
    cross = (c.num_decoder_layers, batch_size, input_length, c.num_heads, c.head_dim)
    return T5Cache(keys=jnp.zeros(shape, dt), values=jnp.zeros(shape, dt),
                   cross_keys=jnp.zeros(cross, dt), cross_values=jnp.zeros(cross, dt),
                   encoder_lengths=jnp.zeros((batch_size,), jnp.int32),
                   lengths=jnp.zeros((batch_size,), jnp.int32))

  def encode(self, params, inputs, input_lengths, cache: T5Cache) -> T5Cache:
    """Runs the encoder once and stores every decoder layer's cross-attention keys/values.

    Args:
      params: the model's parameters.
      inputs: `[B, P]` int32 right-padded encoder inputs.
      input_lengths: `[B]` int32.
      cache: from `init_cache(B, L, input_length=P)`.

    Returns:
      The cache with cross keys/values `[layers, B, P, N, H]`, encoder lengths, and decoder
      lengths 0.
    """
    module = self.module
    encoded = module.apply({'params': params}, inputs, input_lengths, method=T5Module.encode)
    cross_keys, cross_values = module.apply({'params': params}, encoded,
                                            method=T5Module.cross_key_value)
    dt = cache.keys.dtype
    return cache.replace(cross_keys=cross_keys.astype(dt), cross_values=cross_values.astype(dt),
                         encoder_lengths=jnp.asarray(input_lengths, jnp.int32),
                         lengths=jnp.zeros_like(cache.lengths))

  def prefill(self, params, inputs, input_lengths, cache):
    """Encodes the inputs `[B, P]`, then reads the decoder's start token: logits `[B, V]`,
    cache lengths 1. See `speclm.protocol.LanguageModel.prefill`.
    """
    cache = self.encode(params, inputs, input_lengths, cache)
    start = jnp.full((inputs.shape[0], 1), self.config.decoder_start_token_id, jnp.int32)
    logits, cache = self.extend(params, start, cache)
    return logits[:, 0], cache

  def extend(self, params, tokens, cache):
    """Decoder tokens `[B, K]`; see `speclm.protocol.LanguageModel.extend`."""
    return self.module.apply({'params': params}, tokens, cache, method=T5Module.decode)

  def extend_tree(self, params, tokens, tree, cache):
    """Decoder tree attention over the cache; see `speclm.protocol.LanguageModel.extend_tree`."""
    return self.module.apply({'params': params}, tokens, cache, tree, method=T5Module.decode)

  def keep_tree_path(self, cache, start, path):
    """Moves the path's self-attention keys and values; see
    `speclm.protocol.LanguageModel.keep_tree_path`."""
    keep = lambda x: layers.keep_path(x, start, path, batch_axis=1, position_axis=1)
    return cache.replace(keys=keep(cache.keys), values=keep(cache.values))

  def prefix_length(self, input_lengths):
    """1 for every row (the start token), whatever the input lengths."""
    if isinstance(input_lengths, (int, np.integer)):
      return 1
    return jnp.ones_like(input_lengths)

  def last_prefix_token(self, inputs, input_lengths):
    """`[B]` the decoder start token, for inputs `[B, P]`."""
    del input_lengths
    return jnp.full((inputs.shape[0],), self.config.decoder_start_token_id, jnp.int32)

  def forward(self, params, inputs, input_lengths, decoder_tokens) -> jax.Array:
    """Teacher-forced logits `[B, T, V]` for decoder inputs `[B, T]` (start token first)."""
    return _forward_jit(self, params, jnp.asarray(inputs, jnp.int32),
                        jnp.asarray(input_lengths, jnp.int32),
                        jnp.asarray(decoder_tokens, jnp.int32))

  def validate_params(self, params) -> None:
    """Raises ValueError unless `params` has this config's names and shapes."""
    trees.check_tree_shapes(self.param_shapes(), params)

  def logical_axes(self) -> dict:
    """T5X's logical axis names of every parameter: a nested dict like the params whose leaves
    are tuples, e.g. ('embed', 'joined_kv') for an attention query kernel. Map them to mesh
    axes with rules such as T5X's (`vocab`, `joined_kv`, `mlp`, `heads` -> 'model')."""
    def axes(name: str) -> tuple[str, ...]:
      if name.endswith('token_embedder/embedding'):
        return ('vocab', 'embed')
      if name.endswith('logits_dense/kernel'):
        return ('embed', 'vocab')
      if name.endswith('rel_embedding'):
        return ('heads', 'relpos_buckets')
      if name.endswith('/scale'):
        return ('embed',)
      if name.endswith('out/kernel'):
        return ('joined_kv', 'embed')
      if name.endswith(('query/kernel', 'key/kernel', 'value/kernel')):
        return ('embed', 'joined_kv')
      if name.endswith('wo/kernel'):
        return ('mlp', 'embed')
      return ('embed', 'mlp')  # mlp/wi, mlp/wi_0, mlp/wi_1

    return trees.unflatten({name: axes(name) for name in trees.flatten(self.param_shapes())})

  def param_logical_axes(self) -> dict:
    """`logical_axes()` under the name `speclm.partitioning` looks for."""
    return self.logical_axes()

  def cache_logical_axes(self) -> T5Cache:
    """Logical axis names of the cache's arrays: self- and cross-attention keys/values
    `[layers, B, L or P, N, H]`, lengths `[B]`."""
    kv = ('layers', 'batch', 'length', 'heads', 'kv')
    return T5Cache(keys=kv, values=kv, cross_keys=kv, cross_values=kv,
                   encoder_lengths=('batch',), lengths=('batch',))

  def num_params(self) -> int:
    """The number of parameters of this config (counted from shapes, nothing allocated)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(self.param_shapes()))


def _init(definition: T5, rng: jax.Array) -> dict:
  cache = definition.init_cache(1, 1, input_length=1)
  tokens = jnp.zeros((1, 1), jnp.int32)
  return definition.module.init(rng, tokens, jnp.ones((1,), jnp.int32), tokens, cache)['params']


_init_jit = jax.jit(_init, static_argnums=0)


def _forward(definition: T5, params, inputs, input_lengths, decoder_tokens):
  cache = definition.init_cache(inputs.shape[0], decoder_tokens.shape[1])
  cache = definition.encode(params, inputs, input_lengths, cache)
  return definition.extend(params, decoder_tokens, cache)[0]


_forward_jit = jax.jit(_forward, static_argnums=0)


def pack_for_cpu(model: protocol.Model) -> protocol.Model:
  """The same model with every `Dense` kernel also stored for `speclm.kernels.cpu_matmul`.

  Every projection then runs through the packed copy (as `llama.pack_for_cpu`): the weights
  are streamed once for any number of rows, so a verification call of γ + 1 tokens costs
  about one decode step on CPU where XLA's product costs about two, and a row's product never
  depends on how many rows share the call. Float32 models only; costs a second copy of the
  weights; inference only. Returns the model unchanged where the kernel is unusable (another
  dtype, another backend, several devices, no C++ compiler). A v1.0 model's output layer is
  its embedding and stays XLA's product.
  """
  from speclm.kernels import cpu_matmul  # pylint: disable=import-outside-toplevel
  if not cpu_matmul.usable(model.definition.config.dtype):
    return model
  return protocol.Model(model.definition, cpu_matmul.pack_tree(dict(model.params)))


def tiny_config(vocab_size: int = 64, emb_dim: int = 16, num_heads: int = 2,
                head_dim: int | None = None, num_layers: int = 2, mlp_dim: int | None = None,
                version: str = '1.1', dtype: str = 'float32', **overrides) -> T5Config:
  """A small `T5Config` for tests: v1.0 ('1.0') or v1.1 ('1.1') wiring."""
  if version not in ('1.0', '1.1'):
    raise ValueError(f"version must be '1.0' or '1.1', got {version!r}.")
  kwargs = dict(
      vocab_size=vocab_size, emb_dim=emb_dim, num_heads=num_heads,
      head_dim=head_dim or max(2, emb_dim // num_heads), num_encoder_layers=num_layers,
      num_decoder_layers=num_layers, mlp_dim=mlp_dim or 2 * emb_dim,
      mlp_activations=('relu',) if version == '1.0' else ('gelu', 'linear'),
      logits_via_embedding=version == '1.0', dtype=dtype, param_dtype=dtype)
  kwargs.update(overrides)
  return T5Config(**kwargs)


def random_model(vocab_size: int = 64, emb_dim: int = 16, num_layers: int = 2, seed: int = 0,
                 *, version: str = '1.1', **kwargs) -> protocol.Model:
  """A small T5 with random weights, for tests and examples, in one call."""
  config = tiny_config(vocab_size=vocab_size, emb_dim=emb_dim, num_layers=num_layers,
                       version=version, **kwargs)
  definition = T5(config)
  return protocol.Model(definition, definition.init_params(jax.random.key(seed)))


def count_params(config: T5Config) -> int:
  """Number of parameters of `config`, via `jax.eval_shape` (nothing is allocated)."""
  return T5(config).num_params()


__all__: Sequence[str] = [
    'DEFAULT_VOCABULARY_PATH', 'T5', 'T5Cache', 'T5Config', 'T5Module', 'count_params',
    'pack_for_cpu', 'random_model', 'relative_position_bucket', 'tiny_config',
]
