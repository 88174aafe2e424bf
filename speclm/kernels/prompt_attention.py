"""A prompt's causal attention among its own tokens in one kernel call (`prompt_attention.cc`).

A prefill attends each of a prompt's K tokens over the ones before it. XLA runs
`speclm.models.attention.prompt_attention` (flash attention's tiles) as many small batched
products and elementwise passes; at a thousand tokens that was about a third of SmolLM2's
prefill on two cores (docs/performance.md, change 21). The kernel runs the same loop on the
vector registers: keys 16 at a time, a running maximum, denominator and weighted sum per query
row. Models whose products go through `speclm.kernels.cpu_matmul` (`llama.pack_for_cpu`, GGUF
blocks kept quantized) take it for their prompts where it `serves`.

    prompt_attention.attend(q, keys, values, scale=0.125)

A query's numbers do not depend on the prompt's length or the batch: a prompt's outputs are
those of any longer prompt it begins, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from speclm.kernels import cpu_matmul

# The widest head the kernel's registers take (16 chunks of 16 lanes).
MAX_HEAD_DIM = 256


def serves(head_dim: int, dtype, *, cap: float | None, window: int | None) -> bool:
  """Whether the kernel takes this attention: float32 activations, a head dimension of a
  multiple of 16 up to `MAX_HEAD_DIM`, scores not soft-capped and no sliding window (Gemma's
  and Mistral's prompts keep XLA's loop)."""
  return (jnp.dtype(dtype) == jnp.float32 and head_dim % 16 == 0
          and head_dim <= MAX_HEAD_DIM and cap is None and window is None)


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, *, scale: float) -> jax.Array:
  """Causal softmax attention of q `[B, K, Nkv, G, H]` over keys and values `[B, Nkv, K, H]`
  (query k sees keys 0 … k) -> `[B, K, Nkv, G, H]`, float32, the scores times `scale`: what
  `speclm.models.attention.prompt_attention` computes without a cap or window, up to float32
  rounding (other sums' order; e^x a polynomial within 2 ulp). Needs `serves`."""
  if not cpu_matmul.available():
    raise RuntimeError("prompt_attention needs speclm's CPU kernels (see the cpu_matmul"
                       ' warning).')
  return jax.ffi.ffi_call(cpu_matmul.PROMPT_ATTENTION_TARGET,
                          jax.ShapeDtypeStruct(q.shape, jnp.float32))(
                              q.astype(jnp.float32), keys.astype(jnp.float32),
                              values.astype(jnp.float32), scale=np.float32(scale))
