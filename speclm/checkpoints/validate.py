"""Checks every checkpoint loader runs on the parameters it restored.

`check_finite(params, source)` raises, naming the first parameter (its full slash-joined name)
that holds NaN or ±Inf values and how many it holds, e.g.

    CheckpointError: target parameter 'decoder/layers_0/mlp/wi_0/kernel' in /ckpt/checkpoint
    has 3 NaN/Inf values (of 65536); the checkpoint is corrupt.

One pass over each floating-point leaf: numpy arrays on the host in blocks (no full-size
temporary), `jax.Array`s (sharded or not) where they live, one small reduction per leaf.
Integer and boolean leaves (token-id maps, steps) are skipped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


from speclm.checkpoints.errors import CheckpointError  # the one checkpoint error

_BLOCK = 1 << 22  # elements per host block (16 MiB of float32)


def _name(key_path) -> str:
  parts = []
  for key in key_path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return '/'.join(parts)


@jax.jit
def _device_non_finite(x: jax.Array) -> jax.Array:
  return jnp.sum(~jnp.isfinite(x), dtype=jnp.int32)


def _non_finite(leaf: Any) -> tuple[int, int]:
  """(NaN/Inf entries, entries) of one leaf; (0, n) for non-floating leaves."""
  if isinstance(leaf, jax.Array):
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      return 0, int(leaf.size)
    return int(_device_non_finite(leaf)), int(leaf.size)
  arr = np.asarray(leaf)
  if not jnp.issubdtype(arr.dtype, jnp.inexact):  # (jnp's test also knows bfloat16)
    return 0, int(arr.size)
  flat = arr.reshape(-1)
  bad = 0
  for start in range(0, flat.size, _BLOCK):
    block = flat[start:start + _BLOCK]
    bad += int(block.size - np.count_nonzero(np.isfinite(block)))
  return bad, int(arr.size)


def check_finite(params, source: str, *, role: str | None = None,
                 error: type[Exception] | None = None) -> None:
  """Raises `error` if any floating-point leaf of `params` holds NaN or ±Inf.

  Args:
    params: the restored parameter tree (nested dicts of numpy or jax arrays).
    source: the file or directory they came from (named in the message).
    role: 'target', 'draft', … to start the message with; 'Parameter' alone when None.
    error: the exception type the calling loader raises for a bad checkpoint (default
      `speclm.checkpoints.CheckpointError`).
  """
  if error is None:
    error = CheckpointError
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    bad, total = _non_finite(leaf)
    if bad:
      what = f'{role} parameter' if role else 'Parameter'
      raise error(f"{what} '{_name(key_path)}' in {source} has {bad} NaN/Inf values (of"
                  f' {total}); the checkpoint is corrupt.')


__all__ = ['check_finite']
