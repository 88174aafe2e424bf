"""Decode-time attention over the stacked KV cache, read in place (`cache_attention.cc`).

A decode step's few queries attend over one layer of the cache `[layers, B, Nkv, L, H]`. XLA
copies that layer out of the stacked cache before its products and reads every slot, the
empty ones too; the kernel reads only the visible slots, where they lie. Models whose
products go through `speclm.kernels.cpu_matmul` (`llama.pack_for_cpu`, GGUF weights kept
quantized) attend through it after their prompt (`speclm.models.llama.Attention`).

    cache_attention.attend(q, keys, values, visible, layer=3, scale=0.125, cap=None)

Each query is computed alone, the same way whatever the number of queries and rows in the
call, so speculative verification gets the numbers of a single-token step bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from speclm.kernels import cpu_matmul


def serves(head_dim: int, dtype) -> bool:
  """Whether the kernel takes heads of `head_dim` in activations of `dtype`: float32, and a
  head dimension of a multiple of 16 (its vectors' width; every Llama-family model we load)."""
  return jnp.dtype(dtype) == jnp.float32 and head_dim % 16 == 0


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array, *,
           layer: int, scale: float, cap: float | None) -> jax.Array:
  """Softmax attention of q `[B, K, Nkv, G, H]` over layer `layer` of keys and values
  `[layers, B, Nkv, L, H]` where `visible` `[B, K, L]` -> `[B, K, Nkv, G, H]`, all float32:
  scores times `scale`, soft-capped at `cap` (None: not capped), as
  `speclm.models.attention.attend` computes them (the same up to float32 rounding; its
  exponential is a polynomial within 2 ulp). H must be a multiple of 16 (`serves`)."""
  if not cpu_matmul.available():
    raise RuntimeError("cache_attention needs speclm's CPU kernels (see the cpu_matmul"
                       ' warning).')
  batch, queries = q.shape[:2]
  visible = jnp.broadcast_to(visible, (batch, queries, keys.shape[3]))
  return jax.ffi.ffi_call(cpu_matmul.CACHE_ATTENTION_TARGET,
                          jax.ShapeDtypeStruct(q.shape, jnp.float32))(
                              q.astype(jnp.float32), keys, values, visible.astype(jnp.bool_),
                              layer=np.int64(layer), scale=np.float32(scale),
                              cap=np.float32(cap or 0.0))
