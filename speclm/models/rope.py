"""Rotary position embeddings (RoPE) of the Llama family, in the "rotate half" layout Hugging
Face uses: the inverse frequencies of a layer (with Llama 3.1's or linear scaling, and Gemma 3's
own base for sliding-window layers) and the rotation. `speclm.models.llama` uses both under the
same names.

Shape letters: B batch, K new tokens, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from speclm.models.llama_config import LlamaConfig


def rope_frequencies(config: LlamaConfig, layer: int | None = None) -> np.ndarray:
  """Inverse frequencies `[H/2]` of the rotary embedding of decoder layer `layer`, with
  optional scaling (sliding layers of a model with `local_rope_theta` use that base, unscaled)."""
  theta, scaling = config.rope_theta, config.rope_scaling
  if (layer is not None and config.local_rope_theta is not None
      and config.is_sliding(layer)):
    theta, scaling = config.local_rope_theta, None
  exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
  inv_freq = 1.0 / (theta ** exponents)
  if scaling is None:
    return inv_freq.astype(np.float32)
  if scaling.kind == 'linear':
    return (inv_freq / scaling.factor).astype(np.float32)
  if scaling.kind == 'llama3':
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    in_between = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
    return np.where(in_between, blended, out).astype(np.float32)
  raise ValueError(f"Unsupported RoPE scaling kind {scaling.kind!r}; expected 'linear' or"
                   " 'llama3'.")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotates `x` `[B, K, heads, H]` by its absolute `positions` `[B, K]` (rotate-half layout)."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, K, H/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
