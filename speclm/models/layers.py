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
  """
  return jnp.einsum(spec, x.astype(dtype), kernel.astype(dtype),
                    preferred_element_type=jnp.float32).astype(dtype)


class RMSNorm(nn.Module):
  """Root-mean-square layer norm: a learned scale, no bias or mean subtraction, in float32."""

  eps: float
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)
