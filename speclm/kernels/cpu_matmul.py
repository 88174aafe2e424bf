"""A CPU matrix product that streams the weights once for any number of rows (XLA FFI).

On CPU, XLA multiplies one row by a weight matrix at memory bandwidth but 2–8 rows at about
half of it (docs/performance.md), so a speculative verification call of γ + 1 tokens costs
r ≈ 1.4 single-token calls instead of ≈ 1. `skinny_matmul.cc` is a small kernel over weights
packed in 64-column panels: about the same time for 1 to 8 rows, both cores through XLA's own
thread pool, and a float64 running total, so it is more accurate than XLA's product.

    if cpu_matmul.available():
      packed = cpu_matmul.pack(w)          # [K, N] -> [ceil(N/64), K, 64], once, at load time
      y = cpu_matmul.matmul(x, packed, n)  # x [M, K] float32 -> [M, N]

The panels are float32, or bfloat16 (`pack(w, 'bfloat16')`): half the bytes to stream, widened
to float32 as they are read, so the sums are those of the float32 kernel on the same values.
`pack(w, 'auto')` takes bfloat16 exactly when that loses nothing (every weight is a bfloat16
value, as in a draft trained and stored in bfloat16).

The kernel is compiled with the system C++ compiler on first use (for this machine's CPU:
-march=native) into a cache directory, `$SPECLM_KERNEL_CACHE` or ~/.cache/speclm/kernels, and
registered with `jax.ffi`. `available()` is False, with the reason logged once, where that is
impossible (no compiler, or JAX's default backend is not the CPU), and callers keep XLA's
product. `pack_tree` adds packed copies to a whole parameter tree; `llama.pack_for_cpu` and
`t5.pack_for_cpu` apply it to a model.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

PANEL = 64
TARGET_NAME = 'speclm_skinny_matmul'
_TARGETS = {'float32': (TARGET_NAME, 'SkinnyMatmul'),
            'bfloat16': (TARGET_NAME + '_bf16', 'SkinnyMatmulBf16')}
_SOURCE = os.path.join(os.path.dirname(__file__), 'skinny_matmul.cc')


def _cache_dir() -> str:
  return os.environ.get('SPECLM_KERNEL_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'speclm', 'kernels')


def _compiler() -> str | None:
  return os.environ.get('CXX') or shutil.which('c++') or shutil.which('g++')


def library_path() -> str:
  """Where the compiled kernel for this source, JAX version and machine lives (or will)."""
  with open(_SOURCE, 'rb') as f:
    key = hashlib.sha256(f.read() + jax.__version__.encode() + platform.machine().encode()
                         + platform.node().encode()).hexdigest()[:16]
  return os.path.join(_cache_dir(), f'skinny_matmul_{key}.so')


def build() -> str:
  """Compiles the kernel if it is not cached yet; returns the shared library's path."""
  path = library_path()
  if os.path.exists(path):
    return path
  compiler = _compiler()
  if compiler is None:
    raise RuntimeError('no C++ compiler found (set CXX, or install g++)')
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as tmp:
    out = os.path.join(tmp, 'kernel.so')
    command = [compiler, '-O3', '-march=native', '-fopenmp-simd', '-std=c++17', '-shared', '-fPIC',
               f'-I{jax.ffi.include_dir()}', _SOURCE, '-o', out]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
      raise RuntimeError(f'compiling {_SOURCE} failed:\n{result.stderr[-2000:]}')
    os.replace(out, path)  # atomic: concurrent builders never load a half-written file
  return path


@functools.lru_cache(maxsize=1)
def available() -> bool:
  """Whether the kernel is built and registered (builds it on first call)."""
  if jax.default_backend() != 'cpu':
    logging.info('cpu_matmul: the default backend is %s; using XLA products.',
                 jax.default_backend())
    return False
  try:
    library = ctypes.cdll.LoadLibrary(build())
  except (OSError, RuntimeError) as e:
    logging.warning('cpu_matmul: kernel unavailable, using XLA products (%s)', e)
    return False
  for name, symbol in _TARGETS.values():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)),
                                platform='cpu')
  return True


def bfloat16_exact(w) -> bool:
  """Whether every entry of `w` is a bfloat16 value (so storing it as bfloat16 is lossless)."""
  w = np.asarray(w, np.float32)
  return bool(np.array_equal(w.astype(jnp.bfloat16).astype(np.float32), w, equal_nan=True))


def pack(w, dtype: str = 'float32') -> np.ndarray:
  """`[K, N]` weights -> `[ceil(N / 64), K, 64]` panels (zero padded on the right).

  `dtype`: 'float32'; 'bfloat16' (rounds the weights to bfloat16); or 'auto': bfloat16 where
  that is exact (`bfloat16_exact`), float32 otherwise.
  """
  w = np.asarray(w, np.float32)
  if w.ndim != 2:
    raise ValueError(f'pack expects a 2-D weight matrix, got shape {w.shape}.')
  if dtype == 'auto':
    dtype = 'bfloat16' if bfloat16_exact(w) else 'float32'
  if dtype not in _TARGETS:
    raise ValueError(f"pack: dtype must be 'float32', 'bfloat16' or 'auto', got {dtype!r}.")
  k, n = w.shape
  panels = -(-n // PANEL)
  padded = np.zeros((k, panels * PANEL), np.float32)
  padded[:, :n] = w
  panels_first = padded.reshape(k, panels, PANEL).transpose(1, 0, 2)
  return np.ascontiguousarray(panels_first.astype(jnp.dtype(dtype)))


def matmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
  """`x [M, K] @ W` for `packed = pack(W)`, `W` of shape `[K, n]`; float32 x and result,
  float32 or bfloat16 panels."""
  if not available():
    raise RuntimeError('cpu_matmul.matmul needs the kernel; check cpu_matmul.available().')
  if x.dtype != jnp.float32 or packed.dtype.name not in _TARGETS:
    raise TypeError('cpu_matmul takes float32 x and float32 or bfloat16 panels, got '
                    f'{x.dtype} and {packed.dtype}.')
  m = x.shape[0]
  out = jax.ffi.ffi_call(_TARGETS[packed.dtype.name][0],
                         jax.ShapeDtypeStruct((m, packed.shape[0] * PANEL), jnp.float32))(
                             x, packed)
  return out if out.shape[1] == n else out[:, :n]


def usable(dtype) -> bool:
  """Whether the kernel can serve a model of activation `dtype` here: float32, one device
  (packed copies do not follow sharding rules), the kernel built."""
  return jnp.dtype(dtype) == jnp.float32 and jax.device_count() == 1 and available()


def pack_tree(tree, *, input_dims: Mapping[str, int] | None = None,
              rounded: tuple[str, ...] = (), name: str | None = None):
  """A parameter tree with a `packed` copy (`pack`) beside every `kernel`.

  A module's kernel is `[inputs…, outputs…]`; `input_dims` names the modules whose leading
  dims are inputs when there is more than one (default 1), and they are flattened to one.
  Panels are bfloat16 where that is exact, or where the module's name is in `rounded`
  (rounding its weights), float32 elsewhere.
  """
  input_dims = input_dims or {}
  if not isinstance(tree, dict):
    return tree
  out = {key: pack_tree(value, input_dims=input_dims, rounded=rounded, name=key)
         for key, value in tree.items()}
  if 'kernel' in tree and not isinstance(tree['kernel'], dict):
    kernel = np.asarray(tree['kernel'], np.float32)
    inputs = int(np.prod(kernel.shape[:input_dims.get(name, 1)]))
    dtype = 'bfloat16' if name in rounded else 'auto'
    out['packed'] = jnp.asarray(pack(kernel.reshape(inputs, -1), dtype))
  return out
