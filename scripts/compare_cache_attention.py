r"""The decode-time attention kernel at a git revision against the working tree's, side by side.

Compiles `speclm/kernels/cache_attention.cc` twice, as `--old` (a git revision) and as the
working tree has it, each alone into its own library (headers from the same revision), and
registers both under their own names. Then, in one process and interleaved call by call, it
times 30 layers of SmolLM2-135M's attention (3 key-value heads, 3 query heads each, head width
64) over a random stacked cache, for each visible length and number of queries, and checks
that both kernels give the same outputs bit for bit. Medians in ms, and new / old.

  python scripts/compare_cache_attention.py --old=HEAD
  python scripts/compare_cache_attention.py --old=HEAD~3 --visible=258,700,1200 --queries=1,4
"""

from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from speclm.kernels import cpu_matmul

_OLD = flags.DEFINE_string('old', 'HEAD', 'The git revision whose kernel is the baseline.')
_VISIBLE = flags.DEFINE_list('visible', ['128', '700', '1200'], 'Visible slots of the cache.')
_QUERIES = flags.DEFINE_list('queries', ['1', '2', '4', '5'], 'Queries per call (γ + 1).')
_CALLS = flags.DEFINE_integer('calls', 30, 'Timed calls per kernel and case, interleaved.')

_KERNELS = os.path.join('speclm', 'kernels')
_FILES = ('cache_attention.cc', 'lanes.h', 'parallel_tasks.h')
_LAYERS, _KV_HEADS, _GROUPS, _HEAD_DIM = 30, 3, 3, 64


def _sources(revision: str | None, directory: str) -> str:
  """Writes the kernel's files at `revision` (None: the working tree) into `directory`."""
  root = subprocess.run(['git', 'rev-parse', '--show-toplevel'], capture_output=True, text=True,
                        check=True).stdout.strip()
  for name in _FILES:
    path = os.path.join(_KERNELS, name)
    if revision is None:
      with open(os.path.join(root, path), 'rb') as f:
        text = f.read()
    else:
      text = subprocess.run(['git', 'show', f'{revision}:{path}'], cwd=root, capture_output=True,
                            check=True).stdout
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(text)
  return os.path.join(directory, _FILES[0])


def _register(source: str, name: str) -> None:
  """Compiles `source` alone, as `cpu_matmul` compiles the kernels, and registers it."""
  library = os.path.join(os.path.dirname(source), 'kernel.so')
  command = cpu_matmul.compile_command(cpu_matmul.compiler() or 'c++', [source], library)
  result = subprocess.run(command, capture_output=True, text=True, check=False)
  if result.returncode != 0:
    raise SystemExit(f'compiling {source} failed:\n{result.stderr[-2000:]}')
  function = ctypes.CDLL(library).CacheAttention
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(function), platform='cpu')


def _layers(target: str):
  """30 layers of attention through `target`, each query shifted by the last output."""
  def run(q, keys, values, visible):
    for layer in range(_LAYERS):
      out = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
          q, keys, values, visible, layer=np.int64(layer), scale=np.float32(0.125),
          cap=np.float32(0.0))
      q = q + 1e-3 * out
    return q
  return jax.jit(run)


def main(argv):
  del argv
  if not cpu_matmul.available():
    raise SystemExit('The CPU kernels could not be built here (see the log).')
  old, new = _layers('speclm_compare_old'), _layers('speclm_compare_new')
  with tempfile.TemporaryDirectory() as tmp:
    for revision, name in ((_OLD.value, 'old'), (None, 'new')):
      os.makedirs(os.path.join(tmp, name))
      _register(_sources(revision, os.path.join(tmp, name)), f'speclm_compare_{name}')
  rng = np.random.default_rng(0)
  print(f'30 layers of attention, {_KV_HEADS} key-value heads × {_GROUPS} query heads of'
        f' {_HEAD_DIM}; old: {_OLD.value}, new: the working tree; median ms of {_CALLS.value}')
  print('| visible slots | queries | old ms | new ms | new / old | outputs |')
  print('| --- | --- | --- | --- | --- | --- |')
  for visible_slots in map(int, _VISIBLE.value):
    slots = visible_slots + 64
    shape = (_LAYERS, 1, _KV_HEADS, slots, _HEAD_DIM)
    keys = jnp.asarray(rng.standard_normal(shape, np.float32))
    values = jnp.asarray(rng.standard_normal(shape, np.float32))
    for queries in map(int, _QUERIES.value):
      q = jnp.asarray(rng.standard_normal((1, queries, _KV_HEADS, _GROUPS, _HEAD_DIM),
                                          np.float32))
      # Query k sees the slots before visible_slots − queries + k + 1, as verification does.
      ends = visible_slots - queries + 1 + jnp.arange(queries)
      visible = jnp.arange(slots)[None, None, :] < ends[None, :, None]
      same = bool((np.asarray(old(q, keys, values, visible)) ==
                   np.asarray(new(q, keys, values, visible))).all())
      times = {'old': [], 'new': []}
      for _ in range(_CALLS.value):
        for name, fn in (('old', old), ('new', new)):
          start = time.perf_counter()
          fn(q, keys, values, visible).block_until_ready()
          times[name].append(time.perf_counter() - start)
      a, b = (statistics.median(times[k]) * 1e3 for k in ('old', 'new'))
      print(f'| {visible_slots} | {queries} | {a:.2f} | {b:.2f} | {b / a:.2f} |'
            f' {"identical" if same else "DIFFER"} |', flush=True)


if __name__ == '__main__':
  app.run(main)
