r"""Times SmolLM2-sized layer products for 1–64 rows: XLA's CPU dot against cpu_matmul.

The 30 [576, 1536] matrices (106 MB in float32, more than the caches hold; their values are
bfloat16 values) are multiplied by the same rows, interleaved round by round; medians in ms.
XLA's one-row product is its matrix-vector kernel; from two rows on it is a matrix-matrix
kernel (docs/performance.md). The kernel runs over float32 and over bfloat16 panels.

  python scripts/matmul_rows.py
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

_ROUNDS = flags.DEFINE_integer('rounds', 5, 'Interleaved rounds.')
_ROWS = flags.DEFINE_list('rows', ['1', '2', '4', '5', '8', '16', '32', '64'],
                          'Row counts to time.')


def main(argv):
  del argv
  if not cpu_matmul.available():
    raise SystemExit('The CPU kernel could not be built here (see the log).')
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
        fn(x, ws).block_until_ready()
        samples = []
        for _ in range(10):
          start = time.perf_counter()
          fn(x, ws).block_until_ready()
          samples.append(time.perf_counter() - start)
        times.setdefault((name, rows), []).append(statistics.median(samples) * 1e3)
  one_row = statistics.median(times[('xla', 1)])
  print('| rows | XLA ms | kernel ms | kernel / XLA one row | kernel, bfloat16 panels, ms |')
  print('| --- | --- | --- | --- | --- |')
  for rows in map(int, _ROWS.value):
    a, b, c = (statistics.median(times[(k, rows)]) for k in ('xla', 'kernel', 'bf16'))
    print(f'| {rows} | {a:.2f} | {b:.2f} | {b / one_row:.2f} | {c:.2f} |')


if __name__ == '__main__':
  app.run(main)
