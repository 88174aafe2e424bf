"""Products with weight matrices kept in GGUF's quantized blocks (`quantized_matmul.cc`).

A GGUF file stores a matrix `[out, in]` row by row, each row a run of blocks of 32 or 256
weights with their scales. `speclm.checkpoints.gguf.load_model(path, quantized=True)` keeps
such rows as they are (a `uint8 [N, row_bytes]` array under the format's name, e.g.
`{'Q4_K': rows}` where a float model holds `{'kernel': …}`), and these functions multiply
with them, widening each block to float32 in registers:

    quantized.matmul(x, rows, 'Q4_K')      # x [M, K] float32 -> x @ W^T [M, N]
    quantized.dequantize(rows, 'Q4_K')     # [N, K] float32 (tests; embedding lookups)
    quantized.product(x, rows, 'Q4_K')     # matmul for up to MAX_KERNEL_ROWS rows, else
                                           # dequantize once and XLA's GEMM (prompts)

Formats: Q8_0, Q4_0, Q4_1 (32 weights a block) and the K-quants Q4_K, Q5_K, Q6_K (256); the
other GGUF types load as float32 (`gguf.load_model` says so in one line). A row's product is
summed in one fixed order whatever the number of rows in the call, so speculative
verification gives the numbers of a single-row decode step bit for bit (greedy speculative
output equals the baseline's). Where the CPU has AVX512-VNNI, every format takes integer products
instead of widening (`integer_blocks.h`: each block of 32 inputs split into three int8 digits,
23 bits of its largest value; 1.3-2.7x faster); `SPECLM_QUANTIZED_FLOAT=1` in the environment
keeps the float route (read once a process).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from speclm.kernels import cpu_matmul

# format -> (weights a block, bytes a block), as ggml lays them out.
FORMATS = cpu_matmul.QUANTIZED_FORMATS
# Up to this many rows (batch × tokens) a product widens the blocks in registers; above it,
# a prompt's product dequantizes the matrix once (a temporary float32 copy, freed after the
# call) and takes XLA's matrix-matrix kernel. Measured on SmolLM2's whole prefill (2 cores,
# tokens/s, kernel vs widened + GEMM): 64 rows 269 vs 247, 128 rows 273 vs 313
# (docs/performance.md).
MAX_KERNEL_ROWS = 64


def available() -> bool:
  """Whether the kernels are built and registered (`cpu_matmul.available`)."""
  return cpu_matmul.available()


def format_of(params) -> str | None:
  """The quantized format a module's parameter dict holds (its key), or None."""
  if not isinstance(params, dict):
    return None
  found = [key for key in params if key in FORMATS]
  return found[0] if found else None


def row_bytes(fmt: str, k: int) -> int:
  """The bytes of one stored row of `k` weights."""
  weights, size = _check(fmt)
  if k % weights:
    raise ValueError(f'{fmt} rows hold a multiple of {weights} weights, got {k}.')
  return k // weights * size


def row_length(fmt: str, nbytes: int) -> int:
  """The number of weights in a stored row of `nbytes` bytes."""
  weights, size = _check(fmt)
  if nbytes % size:
    raise ValueError(f'A {fmt} row of {nbytes} bytes is not whole blocks of {size} bytes.')
  return nbytes // size * weights


def _check(fmt: str) -> tuple[int, int]:
  if fmt not in FORMATS:
    raise ValueError(f'Unknown quantized format {fmt!r}; speclm multiplies with'
                     f' {", ".join(FORMATS)}.')
  return FORMATS[fmt]


def _require(rows: jax.Array) -> None:
  if not available():
    raise RuntimeError('Quantized weights need speclm\'s CPU kernel, which is unavailable here'
                       ' (see the cpu_matmul warning); load the GGUF file with'
                       ' quantized=False.')
  if rows.dtype != jnp.uint8 or rows.ndim != 2:
    raise TypeError(f'Stored rows are uint8 [N, row_bytes], got {rows.dtype} {rows.shape}.')


def matmul(x: jax.Array, rows: jax.Array, fmt: str) -> jax.Array:
  """`x [M, K] @ W^T -> [M, N]` float32, W the `[N, K]` matrix stored as `rows`."""
  _require(rows)
  k = row_length(fmt, rows.shape[1])
  if x.ndim != 2 or x.shape[1] != k:
    raise ValueError(f'x must be [M, {k}] for these {fmt} rows, got {x.shape}.')
  return jax.ffi.ffi_call(cpu_matmul.quantized_target('matmul', fmt),
                          jax.ShapeDtypeStruct((x.shape[0], rows.shape[0]), jnp.float32))(
                              x.astype(jnp.float32), rows)


def dequantize(rows: jax.Array, fmt: str) -> jax.Array:
  """The stored rows widened to float32 `[N, K]` (ggml's reference dequantization)."""
  _require(rows)
  k = row_length(fmt, rows.shape[1])
  return jax.ffi.ffi_call(cpu_matmul.quantized_target('dequantize', fmt),
                          jax.ShapeDtypeStruct((rows.shape[0], k), jnp.float32))(rows)


def take_rows(rows: jax.Array, ids: jax.Array, fmt: str) -> jax.Array:
  """Rows `ids` (any shape) of the stored matrix, widened: `[*ids.shape, K]` (an embedding
  lookup in a quantized table)."""
  picked = jnp.take(rows, ids.reshape(-1), axis=0)
  return dequantize(picked, fmt).reshape(ids.shape + (-1,))


def product(x: jax.Array, rows: jax.Array, fmt: str) -> jax.Array:
  """`x [M, K] @ W^T`: the block kernel for up to `MAX_KERNEL_ROWS` rows, the dequantized
  matrix through XLA's product above (the row count is static, so each call size has one
  path and its rows do not depend on each other)."""
  if x.shape[0] <= MAX_KERNEL_ROWS:
    return matmul(x, rows, fmt)
  w = dequantize(rows, fmt)
  return jnp.dot(x.astype(jnp.float32), w.T, preferred_element_type=jnp.float32)
