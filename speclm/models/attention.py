"""Attention for the decoder models: over a cache, a prompt's causal attention in tiles, and
the cache's writes (`write_cache`).

Shape letters as in `speclm.models.llama`: B batch, K queries, L keys, Nkv key/value heads,
G = N / Nkv query heads per key/value head, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """cap·tanh(x / cap) (Gemma 2's soft-capping of scores and logits); x itself if cap is None.

  `x` is any shape (scores `[B, N, G, K, L]`, logits `[B, K, V]`); the result has its shape.
  """
  return x if cap is None else cap * jnp.tanh(x / cap)


# The most queries (and keys) per tile of a prompt's attention (`prompt_attention`).
PROMPT_BLOCK = 256


def _scores(q, keys, visible, scale: float, cap: float | None, q_layout: str = 'BKNGH'):
  """float32 scores `[B, Nkv, G, K, L]` of q (`[B, K, Nkv, G, H]`, or as `q_layout` names its
  axes) against keys `[B, Nkv, L, H]` (same dtype): times `scale`, soft-capped at `cap`, the
  lowest float32 where `visible` (broadcast against the scores) is false; None: all visible."""
  scores = jnp.einsum(f'{q_layout},BNLH->BNGKL', q, keys,
                      preferred_element_type=jnp.float32) * scale
  scores = softcap(scores, cap)
  return scores if visible is None else jnp.where(visible, scores, jnp.finfo(jnp.float32).min)


def attend(q, keys, values, visible, *, scale: float, cap: float | None, dtype):
  """Softmax attention in `dtype` (scores in float32, times `scale`, soft-capped at `cap`): q
  `[B, K, Nkv, G, H]` over keys and values `[B, Nkv, L, H]` where `visible` `[B or 1, K, L]`
  -> `[B, K, Nkv, G, H]`."""
  dt = jnp.dtype(dtype)
  scores = _scores(q, keys.astype(dt), visible[:, None, None], scale, cap)
  weights = jax.nn.softmax(scores, axis=-1).astype(dt)
  return jnp.einsum('BNGKL,BNLH->BKNGH', weights, values.astype(dt),
                    preferred_element_type=jnp.float32).astype(dt)


def prompt_attention(q, keys, values, *, scale: float, cap: float | None, window: int | None,
                     dtype, cpu_kernel: bool = False):
  """Causal attention of K prompt tokens among themselves, the cache empty before them: q
  `[B, K, Nkv, G, H]`, keys and values `[B, Nkv, K, H]` -> `[B, K, Nkv, G, H]`.

  Tiled as flash attention is: the K positions split into n tiles of at most `PROMPT_BLOCK`;
  query tile i (a `lax.scan`) visits the key tiles before its own (a `lax.fori_loop`; none that
  a sliding `window` leaves wholly behind), then its own, keeping a running maximum, softmax
  denominator and weighted sum in float32. Against every query over the whole cache (`attend`)
  that skips the cache's empty slots and the masked half of the causal square, keeps each
  tile's scores in the CPU's caches, and compiles to one loop whatever K is. A key tile before
  the query tile is wholly visible, so only the diagonal tile (and, with a window, every tile)
  is masked. Masked keys weigh exactly zero either way; the sums run in another order, and the
  weights are not rounded to `dtype` before the product with the values. `scale`, `cap`,
  `dtype`: as for `attend`; `window`: a sliding window's length, or None.

  `cpu_kernel`: the same loop as one kernel call (`speclm.kernels.prompt_attention`, for
  models on the CPU kernels) where that kernel serves this attention; these tiles elsewhere.
  """
  if cpu_kernel:
    from speclm.kernels import prompt_attention as kernel  # pylint: disable=g-import-not-at-top
    if kernel.serves(q.shape[-1], dtype, cap=cap, window=window):
      return kernel.attend(q, keys, values, scale=scale).astype(dtype)
  batch, length, nkv, groups, h = q.shape
  tiles = -(-length // PROMPT_BLOCK)
  tile = -(-length // tiles)  # tiles of equal size, padding fewer than `tiles` positions
  pad = tiles * tile - length
  dt = jnp.dtype(dtype)
  lowest = jnp.finfo(jnp.float32).min
  # Tiles first, each laid out as its products read it: q [n, B, Nkv, G, tile, H], keys and
  # values [n, B, Nkv, tile, H]; one transpose each here instead of one per tile pair.
  q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
  q_tiles = q.reshape(batch, tiles, tile, nkv, groups, h).transpose(1, 0, 3, 4, 2, 5)

  def key_tiles(x):
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))).astype(dt)
    return x.reshape(batch, nkv, tiles, tile, h).transpose(2, 0, 1, 3, 4)

  k_tiles, v_tiles = key_tiles(keys), key_tiles(values)
  offsets = jnp.arange(tile)

  def add_tile(carry, q_tile, i, j, masked: bool):
    """The running sums after key tile j, for query tile i."""
    top, total, weighted = carry  # [B, Nkv, G, tile], same, [B, Nkv, G, tile, H]
    visible = None
    if masked:
      query_positions, key_positions = i * tile + offsets, j * tile + offsets
      visible = key_positions[None, :] <= query_positions[:, None]  # [tile, tile]
      if window is not None:
        visible &= key_positions[None, :] > query_positions[:, None] - window
    scores = _scores(q_tile, k_tiles[j], visible, scale, cap, q_layout='BNGKH')
    new_top = jnp.maximum(top, scores.max(axis=-1))
    weights = jnp.exp(scores - new_top[..., None])
    rescale = jnp.exp(top - new_top)  # earlier tiles' sums, to the new maximum
    total = total * rescale + weights.sum(axis=-1)
    weighted = weighted * rescale[..., None] + jnp.einsum(
        'BNGKL,BNLH->BNGKH', weights, v_tiles[j], preferred_element_type=jnp.float32)
    return new_top, total, weighted

  def query_tile(_, inputs):
    i, q_tile = inputs  # q_tile [B, Nkv, G, tile, H]
    first = 0 if window is None else jnp.maximum(0, i * tile - window + 1) // tile
    start = (jnp.full((batch, nkv, groups, tile), lowest), jnp.zeros((batch, nkv, groups, tile)),
             jnp.zeros((batch, nkv, groups, tile, h)))
    carry = jax.lax.fori_loop(
        first, i, lambda j, carry: add_tile(carry, q_tile, i, j, masked=window is not None),
        start)
    # Every query sees its own position, in tile i: its total is positive at the end.
    _, total, weighted = add_tile(carry, q_tile, i, i, masked=True)
    return None, (weighted / total[..., None]).astype(dt)  # [B, Nkv, G, tile, H]

  _, out = jax.lax.scan(query_tile, None, (jnp.arange(tiles), q_tiles))
  out = out.transpose(1, 0, 4, 2, 3, 5)  # [B, n, tile, Nkv, G, H]
  return out.reshape(batch, tiles * tile, nkv, groups, h)[:, :length]


# Up to this many rows a cache write is one `dynamic_update_slice` per row; above it, one
# scatter (the same values; measured on this CPU the per-row updates are faster, the scatter
# compiles to one operation whatever the batch).
_ROW_WRITES_UP_TO = 8


def write_cache(cache: jax.Array, slot: int, new: jax.Array, starts: jax.Array) -> jax.Array:
  """The stacked cache `[layers, B, Nkv, L, H]` with `new` `[B, Nkv, K, H]` written into layer
  `slot`, row b at positions starts[b] … starts[b] + K − 1.

  The whole cache goes in and comes out, so that inside a decode loop XLA updates the loop's
  buffer in place: slicing out one layer, writing it and stacking the layers again copied the
  whole cache about five times a step (72 ms a step at 1,152 cached positions, against 27 ms
  at 192; docs/performance.md)."""
  new = new.astype(cache.dtype)
  batch, _, count, _ = new.shape
  if batch <= _ROW_WRITES_UP_TO:
    zero = jnp.zeros((), starts.dtype)  # index dtypes must agree (also under jax_enable_x64)
    for b in range(batch):
      cache = jax.lax.dynamic_update_slice(cache, new[b][None, None],
                                           (slot, b, zero, starts[b], zero))
    return cache
  slots = starts[:, None] + jnp.arange(count, dtype=starts.dtype)[None, :]  # [B, K]
  rows = jnp.arange(batch)[:, None]
  return cache.at[slot, rows, :, slots].set(jnp.swapaxes(new, 1, 2), unique_indices=True,
                                            mode='drop')
