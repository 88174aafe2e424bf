"""Building blocks shared by speclm's Flax models."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp


def dot(spec: str, x: jax.Array, kernel: jax.Array, dtype) -> jax.Array:
  """`einsum(spec, x, kernel)` in `dtype`, accumulated in float32.

  float32 accumulation keeps bfloat16 models accurate, and XLA's CPU bfloat16 dots are slow
  without it.

  Args:
    spec: the einsum string, in shape letters (e.g. 'BKD,DF->BKF').
    x: the activations, e.g. `[B, K, D]`.
    kernel: the weights, e.g. `[D, F]`.
    dtype: the dtype both are cast to, and the result's.
  """
  return jnp.einsum(spec, x.astype(dtype), kernel.astype(dtype),
                    preferred_element_type=jnp.float32).astype(dtype)


class RMSNorm(nn.Module):
  """Root-mean-square layer norm: a learned scale, no bias or mean subtraction, in float32.

  The normalized vector is multiplied by `offset + scale`: offset 0 for most models, 1 for
  Gemma, which stores its scales around zero."""

  eps: float
  param_dtype: Any
  offset: float = 0.0

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.offset else nn.initializers.ones
    scale = self.param('scale', init, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)


def tree_visibility(lengths: jax.Array, capacity: int, ancestors: jax.Array) -> jax.Array:
  """`[B, K, L]` which cache slots each of K new tree nodes attends to.

  The K nodes are written to slots `lengths[b] + k` (`speclm.protocol` `extend_tree`). Node k
  sees the row's committed slots (< lengths[b]) and the slots of its ancestors and itself
  (`ancestors` `[B, K, K]`, a `speclm.token_trees.TreeLayout` field); nothing else.
  """
  batch, num_nodes = ancestors.shape[:2]
  offset = jnp.arange(capacity)[None, None, :] - lengths[:, None, None]  # [B, 1, L]
  node = jnp.broadcast_to(jnp.clip(offset, 0, num_nodes - 1), (batch, num_nodes, capacity))
  is_ancestor = jnp.take_along_axis(ancestors, node, axis=2)
  return (offset < 0) | ((offset < num_nodes) & is_ancestor)


def tree_key_positions(lengths: jax.Array, capacity: int, depths: jax.Array) -> jax.Array:
  """`[B, L]` the position of the token in each cache slot while K tree nodes sit after the
  row's committed prefix: slot l < lengths[b] holds position l, node k's slot lengths[b] + k
  holds position lengths[b] + depths[b, k] (for masks that compare positions: sliding
  windows). Slots past the nodes are never visible; they get their own index."""
  slots = jnp.arange(capacity)[None, :]
  offset = slots - lengths[:, None]
  node = jnp.clip(offset, 0, depths.shape[1] - 1)
  in_tree = (offset >= 0) & (offset < depths.shape[1])
  return jnp.where(in_tree, lengths[:, None] + jnp.take_along_axis(depths, node, axis=1), slots)


def keep_path(entries: jax.Array, start: jax.Array, path: jax.Array, *, batch_axis: int,
              position_axis: int) -> jax.Array:
  """Moves each row's entries from slots `start + path[b, i]` to `start + i` (i < M).

  `entries` has a batch axis and a cache-position axis (`position_axis` counted in a row,
  after the batch axis is removed); `start` `[B]`, `path` `[B, M]`. The protocol's
  `keep_tree_path` for key/value caches and token histories.
  """
  def row(array, first, nodes):
    taken = jnp.take(array, first + nodes, axis=position_axis, mode='clip')
    return jax.lax.dynamic_update_slice_in_dim(array, taken, first, axis=position_axis)
  return jax.vmap(row, in_axes=(batch_axis, 0, 0), out_axes=batch_axis)(
      entries, start.astype(jnp.int32), path.astype(jnp.int32))
