r"""Times SmolLM2-sized layer products for 1–64 rows: XLA's CPU dot against cpu_matmul.

The 30 [576, 1536] matrices (106 MB in float32, more than the caches hold; their values are
bfloat16 values) are multiplied by the same rows, interleaved round by round; medians in ms.
XLA's one-row product is its matrix-vector kernel; from two rows on it is a matrix-matrix
kernel (docs/performance.md). The kernel runs over float32 and over bfloat16 panels.

With `--format=Q4_1` (or another of `speclm.kernels.quantized.FORMATS`) it times instead the
product kernel on GGUF blocks kept as stored, over matrices of the shapes of SmolLM2's 210
layer products (per layer: query 576, key 192, value 192 and output 576 rows over 576 inputs;
gate and up 1,536 rows over 576; down 576 rows over 1,536), random blocks of that format.

  python scripts/matmul_rows.py
  python scripts/matmul_rows.py --format=Q4_1 --rows=1,2,5
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from speclm.kernels import cpu_matmul
from speclm.kernels import quantized

_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Interleaved rounds.')
_ROWS = flags.DEFINE_list('rows', ['1', '2', '4', '5', '8', '16', '32', '64'],
                          'Row counts to time.')
_FORMAT = flags.DEFINE_string('format', None, 'Time the stored-block kernel in this GGUF'
                              ' format on SmolLM2-135M\'s layer shapes instead.')


def _timed_ms(fn, *args) -> float:
  """The median of 10 calls, in ms, after one to warm up."""
  fn(*args).block_until_ready()
  samples = []
  for _ in range(10):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    samples.append(time.perf_counter() - start)
  return statistics.median(samples) * 1e3


# Byte offsets of each format's float16 scales in its block (d, and m or dmin).
_HALVES = {'Q8_0': (0,), 'Q4_0': (0,), 'Q4_1': (0, 2), 'Q4_K': (0, 2), 'Q5_K': (0, 2),
           'Q6_K': (208,)}


def stored_blocks(fmt: str) -> None:
  """The stored-block kernel over SmolLM2-135M's 210 layer products, per row count."""
  if fmt not in quantized.FORMATS:
    raise SystemExit(f'--format must be one of {", ".join(quantized.FORMATS)}, got {fmt!r}.')
  weights, size = quantized.FORMATS[fmt]
  d, f = 576, 1536
  shapes = [(d, d), (192, d), (192, d), (d, d), (f, d), (f, d), (d, f)] * 30  # [out, in]
  if any(k % weights for _, k in shapes):
    raise SystemExit(f'{fmt} blocks of {weights} weights do not divide SmolLM2\'s widths.')
  rng = np.random.default_rng(0)
  mats = []
  for n, k in shapes:
    raw = rng.integers(0, 256, (n, k // weights, size), dtype=np.uint8)
    # the block's float16 scales (d, and m or dmin): finite values of about 0.01; random bits
    # there would make some of them subnormal or NaN, which the CPU computes far more slowly
    for offset in _HALVES[fmt]:
      halves = (rng.standard_normal((n, k // weights)) * 0.01).astype(np.float16)
      raw[:, :, offset:offset + 2] = halves.view(np.uint8).reshape(n, k // weights, 2)
    mats.append(jnp.asarray(raw.reshape(n, -1)))
  narrow = [m for m, (_, k) in zip(mats, shapes) if k == d]
  wide = [m for m, (_, k) in zip(mats, shapes) if k == f]
  products = jax.jit(lambda x, y, a, b: sum(quantized.matmul(x, m, fmt).sum() for m in a) +
                     sum(quantized.matmul(y, m, fmt).sum() for m in b))
  times = {}
  for _ in range(_ROUNDS.value):
    for rows in map(int, _ROWS.value):
      x = jnp.asarray(rng.standard_normal((rows, d)).astype(np.float32))
      y = jnp.asarray(rng.standard_normal((rows, f)).astype(np.float32))
      times.setdefault(rows, []).append(_timed_ms(products, x, y, narrow, wide))
  one_row = statistics.median(times[min(times)])
  print(f'| rows | {fmt} blocks, ms for 210 products | / {min(times)} row(s) |')
  print('| --- | --- | --- |')
  for rows in map(int, _ROWS.value):
    ms = statistics.median(times[rows])
    print(f'| {rows} | {ms:.2f} | {ms / one_row:.2f} |')


def main(argv):
  del argv
  if not cpu_matmul.available():
    raise SystemExit('The CPU kernel could not be built here (see the log).')
  if _FORMAT.value:
    return stored_blocks(_FORMAT.value)
  d, n, count = 576, 1536, 30
  rng = np.random.default_rng(0)
  weights = [rng.standard_normal((d, n)).astype(jnp.bfloat16).astype(np.float32)
             for _ in range(count)]
  plain = [jnp.asarray(w) for w in weights]
  packed = [jnp.asarray(cpu_matmul.pack(w)) for w in weights]
  packed_bf16 = [jnp.asarray(cpu_matmul.pack(w, 'bfloat16')) for w in weights]
  xla = jax.jit(lambda x, ws: sum((x @ w).sum() for w in ws))
  kernel = jax.jit(lambda x, ws: sum(cpu_matmul.matmul(x, p, n).sum() for p in ws))
  times = {}
  for _ in range(_ROUNDS.value):
    for rows in map(int, _ROWS.value):
      x = jnp.asarray(rng.standard_normal((rows, d)).astype(np.float32))
      for name, fn, ws in (('xla', xla, plain), ('kernel', kernel, packed),
                           ('bf16', kernel, packed_bf16)):
        times.setdefault((name, rows), []).append(_timed_ms(fn, x, ws))
  one_row = statistics.median(times[('xla', 1)])
  print('| rows | XLA ms | kernel ms | kernel / XLA one row | kernel, bfloat16 panels, ms |')
  print('| --- | --- | --- | --- | --- |')
  for rows in map(int, _ROWS.value):
    a, b, c = (statistics.median(times[(k, rows)]) for k in ('xla', 'kernel', 'bf16'))
    print(f'| {rows} | {a:.2f} | {b:.2f} | {b / one_row:.2f} | {c:.2f} |')


if __name__ == '__main__':
  app.run(main)
