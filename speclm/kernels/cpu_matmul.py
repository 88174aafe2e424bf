"""A CPU matrix product that streams the weights once for any number of rows (XLA FFI).

On CPU, XLA multiplies one row by a weight matrix at memory bandwidth but 2–8 rows at about
half of it (docs/performance.md), so a speculative verification call of γ + 1 tokens costs
r ≈ 1.4 single-token calls instead of ≈ 1. `skinny_matmul.cc` is a small kernel over weights
packed in 64-column panels: about the same time for 1 to 8 rows, both cores through XLA's own
thread pool, and a float64 running total, so it is more accurate than XLA's product.

    if cpu_matmul.available():
      packed = cpu_matmul.pack(w)          # [K, N] -> [ceil(N/64), K, 64], once, at load time
      y = cpu_matmul.matmul(x, packed, n)  # x [M, K] float32 -> [M, N]

The kernel is compiled with the system C++ compiler on first use (for this machine's CPU:
-march=native) into a cache directory, `$SPECLM_KERNEL_CACHE` or ~/.cache/speclm/kernels, and
registered with `jax.ffi`. `available()` is False, with the reason logged once, where that is
impossible (no compiler, or JAX's default backend is not the CPU), and callers keep XLA's
product. `llama.pack_for_cpu` applies it to a whole model.
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

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

PANEL = 64
TARGET_NAME = 'speclm_skinny_matmul'
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
  jax.ffi.register_ffi_target(TARGET_NAME, jax.ffi.pycapsule(library.SkinnyMatmul),
                              platform='cpu')
  return True


def pack(w) -> np.ndarray:
  """`[K, N]` weights -> `[ceil(N / 64), K, 64]` float32 panels (zero padded on the right)."""
  w = np.asarray(w, np.float32)
  if w.ndim != 2:
    raise ValueError(f'pack expects a 2-D weight matrix, got shape {w.shape}.')
  k, n = w.shape
  panels = -(-n // PANEL)
  padded = np.zeros((k, panels * PANEL), np.float32)
  padded[:, :n] = w
  return np.ascontiguousarray(padded.reshape(k, panels, PANEL).transpose(1, 0, 2))


def matmul(x: jax.Array, packed: jax.Array, n: int) -> jax.Array:
  """`x [M, K] @ W` for `packed = pack(W)`, `W` of shape `[K, n]`; float32 in and out."""
  if not available():
    raise RuntimeError('cpu_matmul.matmul needs the kernel; check cpu_matmul.available().')
  if x.dtype != jnp.float32 or packed.dtype != jnp.float32:
    raise TypeError(f'cpu_matmul works in float32, got {x.dtype} and {packed.dtype}.')
  m = x.shape[0]
  out = jax.ffi.ffi_call(TARGET_NAME,
                         jax.ShapeDtypeStruct((m, packed.shape[0] * PANEL), jnp.float32))(
                             x, packed)
  return out if out.shape[1] == n else out[:, :n]
