"""Decoder-only Transformers of the Llama family, implementing `speclm.protocol.LanguageModel`.

RMSNorm, rotary position embeddings (RoPE, in the "rotate half" layout Hugging Face uses),
grouped-query attention, a gated MLP, tied or untied output embeddings. The key/value cache
is a pytree argument and return value; `extend` appends K tokens at each row's own position,
so one call both decodes (K = 1) and verifies γ drafted tokens (K = γ+1).

The other open families are this network with a few switches in `LlamaConfig` (one module,
not a copy per family; `FAMILIES` names them and `family_config` fills the switches):

  family    what differs from Llama
  mistral   sliding-window attention (`sliding_window`) on every layer
  qwen2     biases on the query/key/value projections (`qkv_bias`)
  qwen3     RMSNorm over each query and key head before RoPE (`qk_norm`), explicit head_dim
  gemma2    embeddings scaled by √D, norms scaling by (1 + w), a norm after attention and after
            the MLP as well (`post_norms`), GeGLU (`activation='gelu_tanh'`), scores scaled by
            `query_pre_attn_scalar`^-½ and soft-capped, soft-capped logits, sliding-window
            layers alternating with global ones (`layer_types`)
  gemma3    Gemma 2 without soft-capping, plus q/k norms, and a RoPE base of its own for the
            sliding-window layers (`local_rope_theta`, 5 local layers per global one)

A sliding window is a mask: query position t sees key positions > t − window (Hugging Face's
rule); the cache keeps every position, so memory is as for global attention.

Parameter tree (kernels are `[in, out]`; attention kernels keep a heads axis):
  embedder/embedding                     [V, D]
  layers_{i}/pre_attention_norm/scale    [D]
  layers_{i}/attention/query/kernel      [D, N, H]    (…/query/bias [N, H] with qkv_bias)
  layers_{i}/attention/key/kernel        [D, Nkv, H]  (…/key/bias [Nkv, H])
  layers_{i}/attention/value/kernel      [D, Nkv, H]  (…/value/bias [Nkv, H])
  layers_{i}/attention/query_norm/scale  [H]          (qk_norm only)
  layers_{i}/attention/key_norm/scale    [H]          (qk_norm only)
  layers_{i}/attention/out/kernel        [N, H, D]
  layers_{i}/post_attention_norm/scale   [D]          (post_norms only)
  layers_{i}/pre_mlp_norm/scale          [D]
  layers_{i}/post_mlp_norm/scale         [D]          (post_norms only)
  layers_{i}/mlp/gate/kernel             [D, F]
  layers_{i}/mlp/up/kernel               [D, F]
  layers_{i}/mlp/down/kernel             [F, D]
  final_norm/scale                       [D]
  lm_head/kernel                         [D, V]   (absent when embeddings are tied)

Shape letters: B batch, K new tokens, L cache positions, D width, N query heads, Nkv key/value
heads, G = N / Nkv query heads per key/value head, H head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from speclm import protocol
from speclm import trees
from speclm.models import attention
from speclm.models import layers
# A projection's product (XLA, the packed CPU kernel or GGUF's blocks); also this module's.
from speclm.models.projections import Kernel
from speclm.models.projections import kernel_serves
from speclm.models.projections import on_cpu_kernels
from speclm.models.projections import sibling_products
from speclm.models.projections import stored_format
# The configuration lives in its own module; the names are this module's as well.
from speclm.models.llama_config import FAMILIES  # pylint: disable=unused-import
from speclm.models.llama_config import LlamaConfig
from speclm.models.llama_config import RopeScaling  # pylint: disable=unused-import
from speclm.models.llama_config import family_config  # pylint: disable=unused-import
from speclm.models.rope import apply_rope  # also this module's
from speclm.models.rope import rope_frequencies  # also this module's


@struct.dataclass
class KVCache:
  """Keys and values of every layer, `[layers, B, Nkv, L, H]`, and each row's length `[B]`.

  Heads before positions: attention then reads each head's `[L, H]` block as stored, with no
  transposed copy of the cache per layer and step.
  """

  keys: jax.Array
  values: jax.Array
  lengths: jax.Array

  @property
  def capacity(self) -> int:
    """L, the positions each row can hold (static)."""
    return self.keys.shape[3]


class Embedder(nn.Module):
  """The token embedding table `[V, D]` (`embedder/embedding`, as `nn.Embed` names it), or
  its rows kept quantized as the GGUF file stores them; `attend` is the tied output head."""

  num_embeddings: int
  features: int
  param_dtype: Any

  def setup(self):
    self.stored = stored_format(self)
    if self.stored is None:
      init = nn.initializers.normal(stddev=1.0 / math.sqrt(self.features))
      self.embedding = self.param('embedding', init, (self.num_embeddings, self.features),
                                  self.param_dtype)

  def __call__(self, tokens):
    """tokens (any shape) -> their rows `[*tokens.shape, D]`."""
    if self.stored is not None:
      from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
      return quantized.take_rows(self.get_variable('params', self.stored), tokens, self.stored)
    return jnp.take(self.embedding, tokens, axis=0)

  def attend(self, hidden):
    """hidden `[B, K, D]` -> float32 `[B, K, V]`: the product with the table transposed."""
    if self.stored is not None:
      from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
      flat = hidden.reshape(-1, hidden.shape[-1]).astype(jnp.float32)
      logits = quantized.product(flat, self.get_variable('params', self.stored), self.stored)
      return logits.reshape(hidden.shape[:-1] + (self.num_embeddings,))
    return jnp.einsum('BKD,VD->BKV', hidden, self.embedding.astype(hidden.dtype),
                      preferred_element_type=jnp.float32)


_INPUT_DIMS = {'out': 2}  # kernels whose leading two dims are inputs (see Attention)


class Attention(nn.Module):
  """Grouped-query self-attention over the cache: RoPE, optional QK norms, sliding windows.

  Query heads N share key-value heads Nkv in groups of N / Nkv (GQA); the K new keys and values
  are written into this layer's cache slots after each row's length."""
  config: LlamaConfig
  layer: int = 0  # which decoder layer: its RoPE base and whether its window slides

  @nn.compact
  def __call__(self, x, positions, keys, values, lengths, visible=None, key_positions=None,
               fresh=False, *, slot):
    """x `[B, K, D]`; keys/values `[layers, B, Nkv, L, H]`, the whole cache (this layer's at
    `slot`; its K new entries are written there in place, the whole cache returned); lengths
    `[B]` before x; `visible` `[B, K, L]` the slots each query attends to (None: causal, a
    chain); `key_positions` `[B, L]` the position held in each slot (None: the slot's index);
    `fresh`: the cache is empty before x, which then attends among its own K entries only
    (`speclm.models.attention.prompt_attention`, by a kernel on the CPU kernels)."""
    c = self.config
    pd, dt = jnp.dtype(c.param_dtype), jnp.dtype(c.dtype)
    d, n, nkv, h = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim
    bias = c.qkv_bias
    q, k, v = sibling_products(self, x, [  # in one kernel call where the rows allow
        Kernel((d, n, h), 'BKD,DNH->BKNH', d, pd, dt, use_bias=bias, name='query'),
        Kernel((d, nkv, h), 'BKD,DNH->BKNH', d, pd, dt, use_bias=bias, name='key'),
        Kernel((d, nkv, h), 'BKD,DNH->BKNH', d, pd, dt, use_bias=bias, name='value')])
    if c.qk_norm:  # Qwen3, Gemma 3: each head's query and key normalized before RoPE
      q = layers.RMSNorm(c.norm_eps, pd, c.norm_offset, name='query_norm')(q)
      k = layers.RMSNorm(c.norm_eps, pd, c.norm_offset, name='key_norm')(k)
    inv_freq = rope_frequencies(c, self.layer)
    q = apply_rope(q, positions, inv_freq)
    k = apply_rope(k, positions, inv_freq)

    new_keys, new_values = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, Nkv, K, H]
    keys = attention.write_cache(keys, slot, new_keys, lengths)
    values = attention.write_cache(values, slot, new_values, lengths)

    q = q.reshape(q.shape[0], q.shape[1], nkv, n // nkv, h)
    window = c.sliding_window if c.is_sliding(self.layer) else None
    scale = (c.query_pre_attn_scalar or h) ** -0.5
    on_kernels = on_cpu_kernels(self.variables.get('params', {}))
    if fresh:  # a prompt into an empty cache: causal among its own K entries, in tiles
      out = attention.prompt_attention(q, new_keys, new_values, scale=scale,
                                       cap=c.attn_logit_softcap, window=window, dtype=dt,
                                       cpu_kernel=on_kernels)
    else:
      if key_positions is None:
        key_positions = jnp.arange(keys.shape[3])[None, :]  # [1, L]: a chain, slot = position
      if visible is None:
        # Query k of row b sits at position lengths[b] + k and sees cache positions <= its own.
        visible = key_positions[:, None, :] <= positions[:, :, None]  # [B, K, L]
      if window is not None:  # and only the last `window` positions, itself included
        visible = visible & (key_positions[:, None, :] > positions[:, :, None] - window)
      from speclm.kernels import cache_attention  # pylint: disable=import-outside-toplevel
      # As the products: decode steps and verification calls, not long prompts.
      if on_kernels and kernel_serves(q, 3) and cache_attention.serves(h, keys.dtype):
        out = cache_attention.attend(q, keys, values, visible, layer=slot, scale=scale,
                                     cap=c.attn_logit_softcap)
      else:
        out = attention.attend(q, keys[slot], values[slot], visible, scale=scale,
                               cap=c.attn_logit_softcap, dtype=dt)
    out = Kernel((n, h, d), 'BKF,FD->BKD', n * h, pd, dt, merge_input_dims=2, name='out')(
        out.reshape(out.shape[0], out.shape[1], n, h))
    return out, keys, values


class MLP(nn.Module):
  """The gated MLP: down(act(gate(x)) · up(x)), SiLU (SwiGLU) or tanh-GELU (Gemma).

  `__call__`: x `[B, K, D]` -> `[B, K, D]` through width F.
  """
  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    c = self.config
    pd, dt = jnp.dtype(c.param_dtype), jnp.dtype(c.dtype)
    gate, up = sibling_products(self, x, [  # in one kernel call where the rows allow
        Kernel((c.embed_dim, c.mlp_dim), 'BKD,DF->BKF', c.embed_dim, pd, dt, name='gate'),
        Kernel((c.embed_dim, c.mlp_dim), 'BKD,DF->BKF', c.embed_dim, pd, dt, name='up')])
    gate = gate.astype(jnp.float32)
    activated = jax.nn.silu(gate) if c.activation == 'silu' else jax.nn.gelu(gate, approximate=True)
    hidden = (activated * up.astype(jnp.float32)).astype(dt)
    return Kernel((c.mlp_dim, c.embed_dim), 'BKF,FD->BKD', c.mlp_dim, pd, dt, name='down')(hidden)


class DecoderLayer(nn.Module):
  """One pre-norm decoder block: attention and MLP residuals (Gemma: also post-norms).

  `__call__` takes and returns what `Attention` does: x `[B, K, D]`, the whole stacked cache's
  keys and values `[layers, B, Nkv, L, H]`, this layer's at index `slot`.
  """
  config: LlamaConfig
  layer: int = 0

  @nn.compact
  def __call__(self, x, positions, keys, values, lengths, visible=None, key_positions=None,
               fresh=False, *, slot):
    c = self.config
    norm = lambda name: layers.RMSNorm(c.norm_eps, jnp.dtype(c.param_dtype), c.norm_offset,
                                       name=name)
    attn_out, keys, values = Attention(c, self.layer, name='attention')(
        norm('pre_attention_norm')(x), positions, keys, values, lengths, visible, key_positions,
        fresh, slot=slot)
    if c.post_norms:  # Gemma: each block's output normalized before the residual sum
      attn_out = norm('post_attention_norm')(attn_out)
    x = x + attn_out
    mlp_out = MLP(c, name='mlp')(norm('pre_mlp_norm')(x))
    if c.post_norms:
      mlp_out = norm('post_mlp_norm')(mlp_out)
    return x + mlp_out, keys, values


class LlamaModule(nn.Module):
  """The Flax module. `__call__` returns final hidden states; `logits` applies the head."""

  config: LlamaConfig

  def setup(self):
    """The embedding table, the decoder layers, the final norm and (untied) the head."""
    c = self.config
    pd = jnp.dtype(c.param_dtype)
    self.embedder = Embedder(c.vocab_size, c.embed_dim, pd)
    self.layers = [DecoderLayer(c, i) for i in range(c.num_layers)]  # layers_0, layers_1, …
    self.final_norm = layers.RMSNorm(c.norm_eps, pd, c.norm_offset)
    if not c.tie_embeddings:
      self.lm_head = Kernel((c.embed_dim, c.vocab_size), 'BKD,DV->BKV', c.embed_dim, pd,
                            jnp.float32)

  def __call__(self, tokens, cache: KVCache, tree=None, tap_layers: tuple[int, ...] = (),
               fresh: bool = False, live=None):
    """tokens `[B, K]` appended after `cache.lengths` -> (hidden `[B, K, D]`, updated cache).

    With a `speclm.token_trees.TreeLayout` `tree` the K tokens are a token tree: node k at
    position lengths + depth, attending to the committed prefix and its ancestors. With
    `tap_layers`, a third result: the hidden states after each of those decoder layers,
    concatenated `[B, K, len(tap_layers) · D]`. `fresh` promises an empty cache (every length
    0, a prompt): attention then runs among the K tokens only
    (`speclm.models.attention.prompt_attention`). `live` `[B, K]` bool (a chain): the
    positions needed (`Llama.extend_live`). The others start from a zero hidden state and see
    no slot, so they stay zero through every layer (norms, products and activations of zero
    are zero; attention that sees nothing is 0), which the CPU kernels skip (zero_rows.h)."""
    dt = jnp.dtype(self.config.dtype)
    if tree is None:
      positions = cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
      visible = key_positions = None
      if live is not None:
        slots = jnp.arange(cache.keys.shape[3])[None, None, :]
        visible = (slots <= positions[:, :, None]) & live[:, :, None]  # [B, K, L]
    else:
      positions = cache.lengths[:, None] + tree.depths
      visible = layers.tree_visibility(cache.lengths, cache.capacity, tree.ancestors)
      key_positions = layers.tree_key_positions(cache.lengths, cache.capacity, tree.depths)
    x = self.embedder(tokens).astype(dt)
    if self.config.scale_embeddings:  # Gemma: by √D, rounded to the activations' dtype first
      x = x * jnp.asarray(math.sqrt(self.config.embed_dim), dt)
    if live is not None:
      x = jnp.where(live[:, :, None], x, jnp.zeros((), dt))
    keys, values, taps = cache.keys, cache.values, []
    for i, layer in enumerate(self.layers):
      x, keys, values = layer(x, positions, keys, values, cache.lengths, visible, key_positions,
                              fresh, slot=i)
      taps.append(x)
    x = self.final_norm(x)
    cache = KVCache(keys=keys, values=values, lengths=cache.lengths + tokens.shape[1])
    if tap_layers:
      return x, cache, jnp.concatenate([taps[i] for i in tap_layers], axis=-1)
    return x, cache

  def hidden_and_logits(self, tokens, cache: KVCache):
    """tokens `[B, K]` -> (logits `[B, K, V]`, cache): both halves in one call, used to
    initialize every parameter, the head included."""
    hidden, cache = self(tokens, cache)
    return self.logits(hidden), cache

  def logits(self, hidden):
    """hidden `[B, K, D]` -> float32 logits `[B, K, V]`."""
    if self.config.tie_embeddings:
      logits = self.embedder.attend(hidden)
    else:
      logits = self.lm_head(hidden)
    return attention.softcap(logits.astype(jnp.float32), self.config.final_logit_softcap)


@dataclasses.dataclass(frozen=True)
class Llama(protocol.LanguageModel, protocol.FeatureSource):
  """`speclm.protocol.LanguageModel` for a `LlamaConfig`.

  As a `protocol.FeatureSource` its features are the final hidden states (after the final
  norm), or with `feature_layers` the hidden states after those decoder layers, concatenated.
  """

  config: LlamaConfig
  feature_layers: tuple[int, ...] | None = None

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    """V."""
    return self.config.vocab_size

  @property
  def module(self) -> LlamaModule:
    """The Flax module for this config (parameters are passed to its `apply`)."""
    return LlamaModule(self.config)

  @property
  def max_context_length(self) -> int | None:
    """The most positions (prompt + generated tokens) a sequence may use; None if unknown."""
    return self.config.max_position_embeddings

  def init_params(self, rng: jax.Array) -> dict:
    """Random parameters for this config.

    Args:
      rng: a `jax.random` key.

    Returns:
      The parameter tree (`{'embedder': …, 'layers_0': …, …}`).
    """
    cache = self.init_cache(1, 1)
    return self.module.init(rng, jnp.zeros((1, 1), jnp.int32), cache,
                            method=LlamaModule.hidden_and_logits)['params']

  def init_cache(self, batch_size: int, max_length: int) -> KVCache:
    """A `KVCache`: keys and values `[layers, B, Nkv, L, H]` in `config.dtype`, lengths 0.

    See `speclm.protocol.LanguageModel.init_cache`.
    """
    c = self.config
    shape = (c.num_layers, batch_size, c.num_kv_heads, max_length, c.head_dim)
    return KVCache(keys=jnp.zeros(shape, c.dtype), values=jnp.zeros(shape, c.dtype),
                   lengths=jnp.zeros((batch_size,), jnp.int32))

  @property
  def feature_dim(self) -> int:  # type: ignore[override]
    """D, or D times the number of `feature_layers`: the width of the features."""
    return self.config.embed_dim * len(self.feature_layers or (None,))

  def with_feature_layers(self, layers):
    """This model handing out the hidden states after decoder layers `layers` (None: the final
    norm's output). Raises ValueError for a layer it does not have.
    """
    if layers is not None:
      layers = tuple(int(i) for i in layers)
      bad = [i for i in layers if not 0 <= i < self.config.num_layers]
      if not layers or bad:
        raise ValueError(f'Feature layers {layers}: this model has decoder layers 0 …'
                         f' {self.config.num_layers - 1}.')
    return dataclasses.replace(self, feature_layers=layers)

  def _features(self, params, tokens, cache, fresh: bool = False, live=None, tree=None):
    """(final hidden `[B, K, D]`, features `[B, K, feature_dim]`, cache); `fresh`, `live`,
    `tree`: see `LlamaModule.__call__`."""
    if self.feature_layers is None:
      hidden, cache = self.module.apply({'params': params}, tokens, cache, tree, fresh=fresh,
                                        live=live)
      return hidden, hidden, cache
    hidden, cache, taps = self.module.apply({'params': params}, tokens, cache, tree,
                                            self.feature_layers, fresh, live)
    return hidden, taps, cache

  def prefill(self, params, inputs, input_lengths, cache):
    """The whole prompt in one causal pass; see `speclm.protocol.LanguageModel.prefill`."""
    logits, _, cache = self.prefill_with_features(params, inputs, input_lengths, cache)
    return logits, cache

  def extend(self, params, tokens, cache):
    """See `speclm.protocol.LanguageModel.extend`."""
    logits, _, cache = self.extend_with_features(params, tokens, cache)
    return logits, cache

  def extend_last(self, params, tokens, cache):
    """`extend` with the head applied to the last position only; see
    `speclm.protocol.LanguageModel.extend_last`."""
    hidden, cache = self.module.apply({'params': params}, tokens, cache)
    logits = self.module.apply({'params': params}, hidden[:, -1:], method=LlamaModule.logits)
    return logits[:, 0], cache

  def prefill_with_features(self, params, inputs, input_lengths, cache):
    """`prefill` that also returns the features `[B, P, feature_dim]`; see
    `speclm.protocol.FeatureSource.prefill_with_features`.
    """
    cache = cache.replace(lengths=jnp.zeros_like(cache.lengths))
    hidden, features, cache = self._features(params, inputs, cache, fresh=True)
    last = jnp.take_along_axis(hidden, (input_lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
    logits = self.module.apply({'params': params}, last, method=LlamaModule.logits)[:, 0]
    return logits, features, cache.replace(lengths=input_lengths.astype(jnp.int32))

  def extend_with_features(self, params, tokens, cache):
    """`extend` with the features; see `speclm.protocol.FeatureSource.extend_with_features`."""
    return self.extend_live_with_features(params, tokens, cache, None)

  def extend_live(self, params, tokens, cache, num_live):
    """Positions from `num_live` on held at zero (`LlamaModule.__call__`'s `live`); see
    `speclm.protocol.LanguageModel.extend_live`."""
    logits, _, cache = self.extend_live_with_features(params, tokens, cache, num_live)
    return logits, cache

  def extend_live_with_features(self, params, tokens, cache, num_live):
    """`extend_live` with the features; `num_live` None: every position. See
    `speclm.protocol.FeatureSource.extend_live_with_features`."""
    live = None if num_live is None else jnp.broadcast_to(
        jnp.arange(tokens.shape[1])[None, :] < num_live, tokens.shape)
    hidden, features, cache = self._features(params, tokens, cache, live=live)
    logits = self.module.apply({'params': params}, hidden, method=LlamaModule.logits)
    return logits, features, cache

  def skips_dead_positions(self, params, shape):
    """True when B·K rows go through the CPU kernels (`pack_for_cpu`, GGUF blocks), which skip
    zero rows; see `speclm.protocol.LanguageModel.skips_dead_positions`."""
    from speclm.kernels import cpu_matmul  # pylint: disable=import-outside-toplevel
    return (on_cpu_kernels(params.get('layers_0', {}).get('attention', {}))
            and cpu_matmul.serves(shape[0] * shape[1]))

  def extend_tree(self, params, tokens, tree, cache):
    """Tree attention masks over the cache; see `speclm.protocol.LanguageModel.extend_tree`."""
    logits, _, cache = self.extend_tree_with_features(params, tokens, tree, cache)
    return logits, cache

  def extend_tree_with_features(self, params, tokens, tree, cache):
    """See `speclm.protocol.FeatureSource.extend_tree_with_features`."""
    hidden, features, cache = self._features(params, tokens, cache, tree=tree)
    logits = self.module.apply({'params': params}, hidden, method=LlamaModule.logits)
    return logits, features, cache

  def keep_tree_path(self, cache, start, path):
    """Moves the path's keys and values; see `speclm.protocol.LanguageModel.keep_tree_path`."""
    keep = lambda x: layers.keep_path(x, start, path, batch_axis=1, position_axis=2)
    return cache.replace(keys=keep(cache.keys), values=keep(cache.values))

  def prefix_length(self, input_lengths):
    """The prompt lengths: a decoder-only model caches the whole prompt."""
    return input_lengths

  def last_prefix_token(self, inputs, input_lengths):
    """`[B]` the last real token of each prompt `[B, P]`."""
    return jnp.take_along_axis(inputs, (input_lengths - 1)[:, None], axis=1)[:, 0]

  def forward(self, params, tokens) -> jax.Array:
    """Teacher-forced logits `[B, T, V]` for full sequences `[B, T]`, without a cache."""
    cache = self.init_cache(tokens.shape[0], tokens.shape[1])
    return self.extend(params, tokens, cache)[0]

  def validate_params(self, params) -> None:
    """Raises ValueError unless `params` has this config's names and shapes."""
    expected = jax.eval_shape(self.init_params, jax.random.key(0))
    trees.check_tree_shapes(_as_stored(expected, params), params)

  def param_logical_axes(self) -> dict:
    """Logical axis names of every parameter (a tree like the params, tuples as leaves), for
    `speclm.partitioning`. Key/value heads share the 'heads' name with query heads."""
    c = self.config
    projection = {'kernel': ('embed', 'heads', 'kv')}
    if c.qkv_bias:
      projection['bias'] = ('heads', 'kv')
    attention = {'query': projection, 'key': projection, 'value': projection,
                 'out': {'kernel': ('heads', 'kv', 'embed')}}
    if c.qk_norm:
      attention.update(query_norm={'scale': ('kv',)}, key_norm={'scale': ('kv',)})
    layer = {
        'pre_attention_norm': {'scale': ('embed',)},
        'attention': attention,
        'pre_mlp_norm': {'scale': ('embed',)},
        'mlp': {'gate': {'kernel': ('embed', 'mlp')}, 'up': {'kernel': ('embed', 'mlp')},
                'down': {'kernel': ('mlp', 'embed')}},
    }
    if c.post_norms:
      layer.update(post_attention_norm={'scale': ('embed',)}, post_mlp_norm={'scale': ('embed',)})
    axes = {'embedder': {'embedding': ('vocab', 'embed')}, 'final_norm': {'scale': ('embed',)}}
    axes.update({f'layers_{i}': layer for i in range(self.config.num_layers)})
    if not self.config.tie_embeddings:
      axes['lm_head'] = {'kernel': ('embed', 'vocab')}
    return axes

  def cache_logical_axes(self) -> KVCache:
    """Logical axis names of the cache's arrays (`[layers, B, Nkv, L, H]` and lengths `[B]`)."""
    kv = ('layers', 'batch', 'heads', 'length', 'kv')
    return KVCache(keys=kv, values=kv, lengths=('batch',))


def _as_stored(expected, params):
  """`expected` (shapes of float parameters) with each float matrix that `params` keeps in a
  quantized format replaced by the shape of its stored rows (`uint8 [N, row_bytes]`)."""
  from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
  if not isinstance(expected, dict) or not isinstance(params, dict):
    return expected
  out = {k: _as_stored(v, params.get(k)) for k, v in expected.items()}
  fmt = quantized.format_of(params)
  if fmt is not None:
    name = 'kernel' if 'kernel' in out else 'embedding'
    if name in out:
      shape = out.pop(name).shape
      if name == 'embedding':
        inputs, outputs = shape[1], shape[0]
      else:
        outputs = params[fmt].shape[0]
        inputs = math.prod(shape) // max(outputs, 1)
      out[fmt] = jax.ShapeDtypeStruct((outputs, quantized.row_bytes(fmt, inputs)), jnp.uint8)
  return out


def embedding_table(model: protocol.Model) -> jax.Array:
  """The token embedding table `[V, D]` as float (widened when it is kept quantized)."""
  embedder = model.params['embedder']
  if 'embedding' in embedder:
    return embedder['embedding']
  from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
  fmt = quantized.format_of(embedder)
  return quantized.dequantize(embedder[fmt], fmt)


def untie_head(model: protocol.Model) -> protocol.Model:
  """The same model with its tied output head stored separately as `lm_head/kernel` `[D, V]`.

  Logits are unchanged bit for bit (the same numbers, multiplied in the same order); only the
  layout differs. XLA's CPU dot reads a `[D, V]` kernel about 1.5x faster than the `[V, D]`
  embedding table it would otherwise multiply transposed, and the head is the largest matrix
  of a small-vocabulary-heavy model such as SmolLM2-135M (28M of 135M parameters). Costs one
  extra copy of the table in memory. Models that are already untied, or whose table is kept
  quantized, are returned as they are.
  """
  config = model.definition.config
  if not config.tie_embeddings or 'embedding' not in model.params['embedder']:
    return model  # untied, or a quantized table (its product reads the rows as stored)
  table = model.params['embedder']['embedding']
  params = dict(model.params)
  params['lm_head'] = {'kernel': jnp.asarray(jnp.transpose(table))}
  definition = Llama(dataclasses.replace(config, tie_embeddings=False))
  return protocol.Model(definition, params)


def first_layers(model: protocol.Model, num_layers: int) -> protocol.Model:
  """The model cut to its first `num_layers` decoder layers (embedding, final norm and head
  kept): a cheap stand-in with the real weights' shapes and vocabulary, for smoke runs whose
  programs would take minutes to compile with every layer. Its outputs are not the model's."""
  config = model.definition.config
  if not 1 <= num_layers <= config.num_layers:
    raise ValueError(f'num_layers must be in 1..{config.num_layers}, got {num_layers}')
  params = {k: v for k, v in model.params.items()
            if not k.startswith('layers_') or int(k[len('layers_'):]) < num_layers}
  definition = Llama(dataclasses.replace(config, num_layers=num_layers))
  return protocol.Model(definition, params)


def pack_for_cpu(model: protocol.Model, bfloat16_head: bool = False) -> protocol.Model:
  """The same model with every projection also stored for `speclm.kernels.cpu_matmul`.

  Every projection then multiplies through the packed copy: one kernel for every row count,
  so a row's product never depends on how many rows share the call. Calls of 2–16 rows
  (speculative verification, small batches) stream the weights at the bandwidth of one row,
  where XLA's CPU matrix-matrix kernel reaches about half of it; one row runs as fast as XLA's
  matrix-vector kernel; prompts of 32+ rows run up to 1.3x slower than XLA's GEMM
  (docs/performance.md). Its float64 running total makes the products more accurate than
  XLA's: SmolLM2's logits then agree with Hugging Face's to < 1e-4 (1.5e-4 with XLA's
  products). The head is untied first
  (`untie_head`). Costs a second copy of the weights in memory. Inference only (the kernel
  has no gradient). Returns the model unchanged where the kernel is unavailable (not on CPU,
  or no C++ compiler; the reason is logged) and on more than one device.

  Panels are bfloat16 where that is exact (weights stored in bfloat16, as a trained draft's),
  float32 elsewhere. `bfloat16_head` rounds the head's panels to bfloat16 as well: half the
  bytes of the largest matrix, slightly different logits. Meant for drafts, whose q may be any
  distribution (paper §3.6); a target's logits must stay as they are.
  """
  if not cpu_kernels_usable(model.definition.config.dtype):
    return model  # several devices: leave the parameters as the sharding rules expect them
  model = untie_head(model)
  rounded = ('lm_head',) if bfloat16_head else ()
  return protocol.Model(model.definition, pack_tree_for_cpu(dict(model.params), rounded=rounded))


def cpu_kernels_usable(dtype) -> bool:
  """Whether `cpu_matmul` can serve a model of activation `dtype` here (float32, one CPU
  device, the kernel built)."""
  from speclm.kernels import cpu_matmul  # pylint: disable=import-outside-toplevel
  return cpu_matmul.usable(dtype)


def pack_tree_for_cpu(tree, rounded: tuple[str, ...] = ()):
  """A parameter tree with a `packed` copy beside every `kernel` (see `pack_for_cpu`):
  bfloat16 panels where that is exact or the module's name is in `rounded`, else float32."""
  from speclm.kernels import cpu_matmul  # pylint: disable=import-outside-toplevel
  return cpu_matmul.pack_tree(tree, input_dims=_INPUT_DIMS, rounded=rounded)


def random_model(vocab_size: int = 64, embed_dim: int = 32, num_layers: int = 2, seed: int = 0,
                 *, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None,
                 mlp_dim: int | None = None, dtype: str = 'float32',
                 tie_embeddings: bool = True, family: str = 'llama',
                 **switches) -> protocol.Model:
  """A small model of `family` (default Llama) with random weights, for tests and examples,
  in one call; `switches` set any other `LlamaConfig` field (e.g. sliding_window=8). Norm
  scales start at their identity (1, or 0 with Gemma's offset) and biases at zero."""
  config = family_config(
      family, vocab_size=vocab_size, num_layers=num_layers, embed_dim=embed_dim,
      num_heads=num_heads, num_kv_heads=num_kv_heads,
      head_dim=head_dim or max(2, embed_dim // num_heads), mlp_dim=mlp_dim or 2 * embed_dim,
      tie_embeddings=tie_embeddings, param_dtype=dtype, dtype=dtype, **switches)
  definition = Llama(config)
  return protocol.Model(definition, jax.jit(definition.init_params)(jax.random.key(seed)))
