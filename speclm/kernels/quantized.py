"""Products with weight matrices kept in GGUF's quantized blocks (`quantized_matmul.cc`).

A GGUF file stores a matrix `[out, in]` row by row, each row a run of blocks of 32 or 256
weights with their scales. `speclm.checkpoints.gguf.load_model(path, quantized=True)` keeps
such rows as they are (a `uint8 [N, row_bytes]` array under the format's name, e.g.
`{'Q4_K': rows}` where a float model holds `{'kernel': …}`), and these functions multiply
with them, widening each block to float32 in registers:

    quantized.matmul(x, rows, 'Q4_K')      # x [M, K] float32 -> x @ W^T [M, N]
    quantized.dequantize(rows, 'Q4_K')     # [N, K] float32 (tests; embedding lookups)
    quantized.product(x, rows, 'Q4_K')     # matmul for up to kernel_rows() rows, else
                                           # dequantize once and XLA's GEMM (prompts)
    quantized.loaded('Q4_K', rows)         # ('Q4_K_x16', interleaved rows) where that route
                                           # is taken, else the arguments (load time)
    quantized.products(x, [wq, wk, wv], fmt)  # several matrices over one x: a single call
                                              # (`matmul_many`) on interleaved rows

Formats: Q8_0, Q4_0, Q4_1 (32 weights a block) and the K-quants Q4_K, Q5_K, Q6_K (256); the
other GGUF types load as float32 (`gguf.load_model` says so in one line). A row's product is
summed in one fixed order whatever the number of rows in the call, so speculative
verification gives the numbers of a single-row decode step bit for bit (greedy speculative
output equals the baseline's). Where the CPU has AVX512-VNNI, every format takes integer products
instead of widening (`integer_blocks.h`: each block of 32 inputs split into three int8 digits,
23 bits of its largest value; 1.3-2.7x faster); `SPECLM_QUANTIZED_FLOAT=1` in the environment
keeps the float route (read once a process).

On that route a matrix loads with its rows interleaved sixteen at a time (`interleave`, format
name + '_x16', same shape and bytes): the kernel then reads each block of a group of sixteen
rows with a few plain vector loads, front to back, instead of gathering it from sixteen rows
in turn (2-3x faster a decode step on 2 cores; docs/performance.md). Products are the same
bit for bit; `dequantize` and `take_rows` undo the interleaving first.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from speclm.kernels import cpu_matmul

# format -> (weights a block, bytes a block), as ggml lays them out.
FORMATS = cpu_matmul.QUANTIZED_FORMATS
# Rows a group of an interleaved matrix; the format name's suffix.
GROUP = 16
SUFFIX = cpu_matmul.INTERLEAVED_SUFFIX
# Every name a module's stored rows may have: the file's format, or it interleaved.
STORED_FORMATS = tuple(FORMATS) + tuple(fmt + SUFFIX for fmt in FORMATS)
# How `interleave` cuts each format's block: fields (first byte, end, unit), a unit of 4 bytes
# (or 2, for a float16 scale that does not fill four) kept whole. In a group's run for one
# block, byte o of row l's block lands at 16·o + unit·l: each 4-byte word of the sixteen rows
# is one 64-byte vector (integer_blocks.h's `Interleaved`).
_FIELDS = {'Q8_0': ((0, 2, 2), (2, 34, 4)), 'Q4_0': ((0, 2, 2), (2, 18, 4)),
           'Q4_1': ((0, 20, 4),), 'Q4_K': ((0, 144, 4),), 'Q5_K': ((0, 176, 4),),
           'Q6_K': ((0, 192, 4), (192, 210, 2))}
# Up to this many rows (batch × tokens) a product takes the block kernel; above it, a prompt's
# product dequantizes the matrix once (a temporary float32 copy, freed after the call) and
# takes XLA's matrix-matrix kernel. The float route (no VNNI) crossed at 64 rows on
# SmolLM2's whole prefill (2 cores, tokens/s, kernel vs widened + GEMM: 64 rows 269 vs 247,
# 128 rows 273 vs 313); the integer route on interleaved rows was as fast or faster up to
# 1,024 rows (AMD EPYC: 128 rows 750 vs 297, 512 rows 556 vs 488, 1,024 rows 516 vs 498;
# docs/performance.md), and needs no float copy.
MAX_KERNEL_ROWS = 64
MAX_INTEGER_KERNEL_ROWS = 1024
# Matrices one `matmul_many` call takes (quantized_matmul.cc's kMaxMatrices).
MAX_MATRICES_A_CALL = 4


def kernel_rows() -> int:
  """The most rows a product takes through the block kernel on this process's route."""
  return MAX_INTEGER_KERNEL_ROWS if interleaving() else MAX_KERNEL_ROWS


def available() -> bool:
  """Whether the kernels are built and registered (`cpu_matmul.available`)."""
  return cpu_matmul.available()


def format_of(params) -> str | None:
  """The quantized format a module's parameter dict holds (its key, '_x16' included), or
  None."""
  if not isinstance(params, dict):
    return None
  found = [key for key in params if key in STORED_FORMATS]
  return found[0] if found else None


def file_format(fmt: str) -> str:
  """The GGUF format of a stored-rows name ('Q4_K_x16' -> 'Q4_K')."""
  return fmt[:-len(SUFFIX)] if fmt.endswith(SUFFIX) else fmt


def interleaved(fmt: str) -> bool:
  """Whether rows stored under this name are interleaved (`interleave`)."""
  return fmt.endswith(SUFFIX) and file_format(fmt) in FORMATS


def interleaving() -> bool:
  """Whether matrices load interleaved here: the integer route is taken
  (`cpu_matmul.integer_route`), the only one that reads them."""
  return cpu_matmul.integer_route()


def _groups(n: int, fmt: str) -> int:
  if n % GROUP:
    raise ValueError(f'Only matrices of a multiple of {GROUP} rows interleave; {fmt} rows: {n}.')
  return n // GROUP


def interleave(rows: np.ndarray, fmt: str) -> np.ndarray:
  """The rows `uint8 [N, row_bytes]` of a matrix in the file's format `fmt`, interleaved
  sixteen at a time (N a multiple of 16): the same shape, each group of sixteen stored rows
  now one run per block of the sixteen rows' blocks, cut into fields as `_FIELDS` says. A
  permutation of the bytes, which `deinterleave` undoes."""
  rows = np.asarray(rows)
  _, size = _check(fmt)
  groups, blocks = _groups(rows.shape[0], fmt), rows.shape[1] // size
  by_row = rows.reshape(groups, GROUP, blocks, size)
  out = np.empty((groups, blocks, GROUP * size), np.uint8)
  for start, end, unit in _FIELDS[fmt]:
    count = (end - start) // unit
    field = by_row[..., start:end].reshape(groups, GROUP, blocks, count, unit)
    # Copied view to view: no temporary the size of the matrix (a 7B model's load would
    # otherwise leave freed copies in the heap, resident).
    np.copyto(out[..., GROUP * start:GROUP * end].reshape(groups, blocks, count, GROUP, unit),
              field.transpose(0, 2, 3, 1, 4))
  return out.reshape(rows.shape)


def deinterleave(rows: jax.Array, fmt: str) -> jax.Array:
  """`interleave` undone (traced: a permutation of the bytes); `fmt` the file's format."""
  _, size = _check(fmt)
  groups, blocks = _groups(rows.shape[0], fmt), rows.shape[1] // size
  runs = rows.reshape(groups, blocks, GROUP * size)
  fields = []
  for start, end, unit in _FIELDS[fmt]:
    field = runs[..., GROUP * start:GROUP * end].reshape(groups, blocks, (end - start) // unit,
                                                         GROUP, unit)
    fields.append(field.transpose(0, 3, 1, 2, 4).reshape(groups, GROUP, blocks, end - start))
  return jnp.concatenate(fields, axis=-1).reshape(rows.shape)


def interleaves(num_rows: int) -> bool:
  """Whether `loaded` interleaves a matrix of this many rows here."""
  return interleaving() and num_rows % GROUP == 0


def loaded(fmt: str, rows: np.ndarray) -> tuple[str, np.ndarray]:
  """How a loader keeps a matrix read as stored in `fmt`: interleaved under `fmt + '_x16'`
  (a copy) where `interleaves` its row count, else `rows` as read."""
  if interleaves(rows.shape[0]):
    return fmt + SUFFIX, interleave(rows, fmt)
  return fmt, rows


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
  if file_format(fmt) not in FORMATS:
    raise ValueError(f'Unknown quantized format {fmt!r}; speclm multiplies with'
                     f' {", ".join(FORMATS)} (and each with "{SUFFIX}", interleaved).')
  return FORMATS[file_format(fmt)]


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
  if interleaved(fmt):
    _groups(rows.shape[0], fmt)
    if not interleaving():
      raise ValueError(f'{fmt} rows are interleaved, which only the integer route reads (a CPU'
                       ' with AVX512-VNNI, SPECLM_QUANTIZED_FLOAT unset); load the file again'
                       ' here.')
  return jax.ffi.ffi_call(cpu_matmul.quantized_target('matmul', fmt),
                          jax.ShapeDtypeStruct((x.shape[0], rows.shape[0]), jnp.float32))(
                              x.astype(jnp.float32), rows)


def matmul_many(x: jax.Array, matrices: Sequence[jax.Array], fmt: str) -> list[jax.Array]:
  """`[x [M, K] @ W_i^T -> [M, N_i]]` for up to four interleaved matrices over the same x (a
  layer's query, key and value): one call, x split into digits once and every matrix's groups
  shared out between the threads together, each product bitwise the one `matmul` gives."""
  if not interleaved(fmt) or not interleaving():
    raise ValueError(f'matmul_many takes interleaved rows on the integer route, not {fmt}.')
  if not 1 <= len(matrices) <= MAX_MATRICES_A_CALL:
    raise ValueError(f'matmul_many takes 1 to {MAX_MATRICES_A_CALL} matrices, got'
                     f' {len(matrices)}.')
  k = row_length(fmt, matrices[0].shape[1])
  if x.ndim != 2 or x.shape[1] != k:
    raise ValueError(f'x must be [M, {k}] for these {fmt} rows, got {x.shape}.')
  for rows in matrices:
    _require(rows)
    _groups(rows.shape[0], fmt)
    if rows.shape[1] != matrices[0].shape[1]:
      raise ValueError(f'the matrices must have the same row bytes, got {rows.shape[1]} and'
                       f' {matrices[0].shape[1]}.')
  shapes = [jax.ShapeDtypeStruct((x.shape[0], rows.shape[0]), jnp.float32) for rows in matrices]
  return list(jax.ffi.ffi_call(cpu_matmul.quantized_target('matmul_many', fmt), shapes)(
      x.astype(jnp.float32), *matrices))


def dequantize(rows: jax.Array, fmt: str) -> jax.Array:
  """The stored rows widened to float32 `[N, K]` (ggml's reference dequantization)."""
  _require(rows)
  k = row_length(fmt, rows.shape[1])
  if interleaved(fmt):
    fmt = file_format(fmt)
    rows = deinterleave(rows, fmt)
  return jax.ffi.ffi_call(cpu_matmul.quantized_target('dequantize', fmt),
                          jax.ShapeDtypeStruct((rows.shape[0], k), jnp.float32))(rows)


def take_rows(rows: jax.Array, ids: jax.Array, fmt: str) -> jax.Array:
  """Rows `ids` (any shape) of the stored matrix, widened: `[*ids.shape, K]` (an embedding
  lookup in a quantized table)."""
  shape, ids = ids.shape, ids.reshape(-1)
  if interleaved(fmt):  # each id's group of sixteen rows, undone, then its row
    fmt = file_format(fmt)
    groups = rows.reshape(-1, GROUP * rows.shape[1])[ids // GROUP]
    rows = deinterleave(groups.reshape(-1, rows.shape[1]), fmt).reshape(
        ids.shape[0], GROUP, rows.shape[1])
    picked = jnp.take_along_axis(rows, (ids % GROUP)[:, None, None], axis=1)[:, 0]
  else:
    picked = jnp.take(rows, ids, axis=0)
  return dequantize(picked, fmt).reshape(shape + (-1,))


def products(x: jax.Array, matrices: Sequence[jax.Array], fmt: str) -> list[jax.Array]:
  """`[product(x, W_i, fmt)]`: through one `matmul_many` call where it serves (interleaved
  rows, up to `kernel_rows()` rows of x), else one `product` each. The numbers are the same."""
  if (interleaved(fmt) and interleaving() and x.shape[0] <= kernel_rows()
      and len(matrices) <= MAX_MATRICES_A_CALL):
    return matmul_many(x, matrices, fmt)
  return [product(x, rows, fmt) for rows in matrices]


def product(x: jax.Array, rows: jax.Array, fmt: str) -> jax.Array:
  """`x [M, K] @ W^T`: the block kernel for up to `kernel_rows()` rows, the dequantized
  matrix through XLA's product above (the row count is static, so each call size has one
  path and its rows do not depend on each other)."""
  if x.shape[0] <= kernel_rows():
    return matmul(x, rows, fmt)
  w = dequantize(rows, fmt)
  return jnp.dot(x.astype(jnp.float32), w.T, preferred_element_type=jnp.float32)
