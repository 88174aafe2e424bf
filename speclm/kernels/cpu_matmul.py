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
registered with `jax.ffi`. `available()` is False where that is impossible, with the reason
logged once: one warning line for a missing compiler, a failed compile, a library that does
not load or lacks the kernel's symbols (any exception), an info line when JAX's default
backend is not the CPU. Callers then keep XLA's product; `available()` never raises.

The cache is checked before anything in it is loaded (loading a shared object runs its code):
  * the build writes `skinny_matmul_<key>.so` and, next to it, `skinny_matmul_<key>.so.sha256`
    (`sha256sum` format: the library's SHA-256, two spaces, its file name), each written to a
    temporary file first and renamed into place, under a lock on `<cache>/.lock`;
  * the cache directory is created with mode 0700. If it exists, belongs to this user and is
    writable by group or others, it is made 0700 again and its kernel is rebuilt (what it held
    is not trusted); if it belongs to another user or cannot be made private, the kernel is
    built in a fresh private temporary directory for this process instead (compiled each run);
  * the library and its .sha256 file must be regular files (not links) owned by this user, not
    writable by group or others, and the library's SHA-256 must equal the recorded one.
    Otherwise both are deleted and the kernel is rebuilt. So a truncated or replaced library is
    never loaded, and a build that loads but lacks the kernel's symbols is deleted (the next
    run rebuilds it).

`pack_tree` adds packed copies to a whole parameter tree; `llama.pack_for_cpu` and
`t5.pack_for_cpu` apply it to a model, and `packed_product` is the product of a layer whose
parameters hold a packed copy (`llama.Kernel`, `t5.Dense`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import stat
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
# The kernels are built into one library: the packed float kernel, the GGUF-block kernel
# (`speclm.kernels.quantized`) and the decode steps' attention (`speclm.kernels.cache_attention`).
# The GGUF block formats `quantized_matmul.cc` multiplies (`speclm.kernels.quantized`):
# format -> (weights a block, bytes a block), as ggml lays them out.
QUANTIZED_FORMATS = {'Q8_0': (32, 34), 'Q4_0': (32, 18), 'Q4_1': (32, 20),
                     'Q4_K': (256, 144), 'Q5_K': (256, 176), 'Q6_K': (256, 210)}


def quantized_target(kind: str, fmt: str) -> str:
  """The registered name of `quantized_matmul.cc`'s 'matmul', 'matmul_many' (interleaved
  formats only) or 'dequantize' for `fmt`."""
  return f'{TARGET_NAME}_quantized_{kind}_{fmt.lower()}'


# The suffix of a format whose matrices are stored with sixteen rows interleaved
# (`speclm.kernels.quantized.interleave`); only their product has a target of its own.
INTERLEAVED_SUFFIX = '_x16'


def _quantized_symbols():
  for fmt in QUANTIZED_FORMATS:
    yield quantized_target('matmul', fmt), 'QuantizedMatmul_' + fmt
    yield (quantized_target('matmul', fmt + INTERLEAVED_SUFFIX),
           'QuantizedMatmul_' + fmt + INTERLEAVED_SUFFIX)
    yield (quantized_target('matmul_many', fmt + INTERLEAVED_SUFFIX),
           'QuantizedMatmulMany_' + fmt + INTERLEAVED_SUFFIX)
    yield quantized_target('dequantize', fmt), 'QuantizedDequantize_' + fmt


# The decode steps' attention over the stacked KV cache (`speclm.kernels.cache_attention`).
CACHE_ATTENTION_TARGET = 'speclm_cache_attention'
# A prompt's causal attention among its own tokens (`speclm.kernels.prompt_attention`).
PROMPT_ATTENTION_TARGET = 'speclm_prompt_attention'

_SOURCES = tuple(os.path.join(os.path.dirname(__file__), name)
                 for name in ('skinny_matmul.cc', 'quantized_matmul.cc', 'cache_attention.cc',
                              'prompt_attention.cc'))
_HEADERS = tuple(os.path.join(os.path.dirname(__file__), name)  # part of the key
                 for name in ('parallel_tasks.h', 'lanes.h', 'zero_rows.h',
                              'integer_blocks.h'))


def _cache_dir() -> str:
  return os.environ.get('SPECLM_KERNEL_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'speclm', 'kernels')


def compile_command(compiler: str, sources, out: str) -> list[str]:
  """The command that compiles kernel `sources` into the shared library `out` (also used by
  scripts/compare_cache_attention.py, so a compared kernel is built as the package builds it)."""
  return [compiler, '-O3', '-march=native', '-fopenmp-simd', '-std=c++17', '-shared', '-fPIC',
          f'-I{jax.ffi.include_dir()}', *sources, '-o', out]


def compiler() -> str | None:
  """The C++ compiler the kernels are built with: $CXX, else c++ or g++ on the PATH."""
  return os.environ.get('CXX') or shutil.which('c++') or shutil.which('g++')


def library_path() -> str:
  """Where the compiled kernel for this source, JAX version and machine lives (or will)."""
  digest = hashlib.sha256()
  for source in _SOURCES + _HEADERS:
    with open(source, 'rb') as f:
      digest.update(f.read())
  digest.update(jax.__version__.encode() + platform.machine().encode() + platform.node().encode())
  key = digest.hexdigest()[:16]
  return os.path.join(_cache_dir(), f'skinny_matmul_{key}.so')


def _hash_path(path: str) -> str:
  """The file recording the SHA-256 of the library at `path`."""
  return path + '.sha256'


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  fd = os.open(path, os.O_RDONLY | getattr(os, 'O_NOFOLLOW', 0))
  with os.fdopen(fd, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      digest.update(block)
  return digest.hexdigest()


def _unsafe_file(path: str) -> str | None:
  """Why the file at `path` may not be trusted (None: a regular file of ours, writable by us
  alone)."""
  st = os.lstat(path)
  if not stat.S_ISREG(st.st_mode):
    return 'not a regular file'
  if st.st_uid != os.getuid():
    return f'owned by uid {st.st_uid}, not {os.getuid()}'
  if st.st_mode & 0o022:
    return f'writable by group or others (mode {stat.S_IMODE(st.st_mode):o})'
  return None


def _invalid(path: str) -> str | None:
  """Why the cached library at `path` must not be loaded, or None when it can be."""
  if not os.path.lexists(path):
    return 'not built yet'
  hash_path = _hash_path(path)
  if not os.path.lexists(hash_path):
    return 'no recorded SHA-256'
  for name in (path, hash_path):
    reason = _unsafe_file(name)
    if reason:
      return f'{os.path.basename(name)} is {reason}'
  with open(hash_path, encoding='ascii', errors='replace') as f:
    recorded = (f.read(200).split() or [''])[0]
  if _sha256(path) != recorded:
    return 'its SHA-256 differs from the recorded one (truncated or replaced)'
  return None


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path)
  elif os.path.lexists(path):
    os.unlink(path)


def _discard(path: str) -> None:
  """Deletes a cached library and its recorded hash."""
  _remove(path)
  _remove(_hash_path(path))


def _private_dir(directory: str) -> str | None:
  """`directory`, created 0700 if missing, made 0700 if it is ours but writable by others
  (then its old content is discarded); None when it belongs to someone else or stays open."""
  os.makedirs(directory, mode=0o700, exist_ok=True)
  st = os.stat(directory)
  if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
    return None
  if st.st_mode & 0o022:
    try:
      os.chmod(directory, 0o700)
    except OSError:
      return None
    logging.warning('cpu_matmul: the kernel cache %s was writable by group or others (mode'
                    ' %o); made it 0700 and rebuilding its kernel.', directory,
                    stat.S_IMODE(st.st_mode))
    _discard(os.path.join(directory, os.path.basename(library_path())))
  return directory


@contextlib.contextmanager
def _locked(directory: str):
  """An exclusive lock on `directory`/.lock (concurrent builders wait for one another)."""
  try:
    import fcntl  # pylint: disable=g-import-not-at-top
  except ImportError:  # not POSIX: no lock
    yield
    return
  fd = os.open(os.path.join(directory, '.lock'), os.O_RDWR | os.O_CREAT, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)


def _compile(path: str) -> None:
  """Compiles the kernel to `path` and records its SHA-256 beside it (both renamed into place,
  so no reader sees a half-written file)."""
  cxx = compiler()
  if cxx is None:
    raise RuntimeError('no C++ compiler found (set CXX, or install g++)')
  directory = os.path.dirname(path)
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    out = os.path.join(tmp, 'kernel.so')
    command = compile_command(cxx, _SOURCES, out)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0 or not os.path.isfile(out):
      lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
      detail = ' | '.join(lines[-6:])[-1000:] or 'no output'
      raise RuntimeError(f'compiling {" and ".join(map(os.path.basename, _SOURCES))} with'
                         f' {cxx} failed (exit'
                         f' {result.returncode}): {detail}')
    os.chmod(out, 0o755)  # whatever the umask: only we may write it
    hash_tmp = os.path.join(tmp, 'kernel.so.sha256')
    with open(hash_tmp, 'w', encoding='ascii') as f:
      f.write(f'{_sha256(out)}  {os.path.basename(path)}\n')
    os.chmod(hash_tmp, 0o644)
    os.replace(hash_tmp, _hash_path(path))
    os.replace(out, path)


def build() -> str:
  """Compiles the kernel unless a valid build is cached; returns the shared library's path.

  A cached library is returned only when it passes the checks in the module docstring;
  otherwise it is deleted and rebuilt.
  """
  path = library_path()
  directory = _private_dir(os.path.dirname(path))
  if directory is None:
    directory = tempfile.mkdtemp(prefix='speclm_kernels_')  # 0700, ours, for this process
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    logging.warning('cpu_matmul: the kernel cache %s is not a private directory of this user;'
                    ' building the kernel in %s for this process instead.',
                    os.path.dirname(path), directory)
    path = os.path.join(directory, os.path.basename(path))
  with _locked(directory):
    reason = _invalid(path)
    if reason is None:
      return path
    if os.path.lexists(path) or os.path.lexists(_hash_path(path)):
      quiet = reason in ('not built yet', 'no recorded SHA-256')  # an interrupted or older build
      log = logging.info if quiet else logging.warning
      log('cpu_matmul: not loading the cached kernel %s: %s; rebuilding it.', path, reason)
      _discard(path)
    _compile(path)
  return path


@functools.lru_cache(maxsize=1)
def available() -> bool:
  """Whether the kernel is built and registered (builds it on first call). Never raises: any
  failure logs one warning and leaves XLA's products in use."""
  if jax.default_backend() != 'cpu':
    logging.info('cpu_matmul: the default backend is %s; using XLA products.',
                 jax.default_backend())
    return False
  path = None
  try:
    path = build()
    library = ctypes.CDLL(path)
    targets = (list(_TARGETS.values()) + list(_quantized_symbols())
               + [(CACHE_ATTENTION_TARGET, 'CacheAttention'),
                  (PROMPT_ATTENTION_TARGET, 'PromptAttention')])
    functions = [(name, getattr(library, symbol)) for name, symbol in targets]
    for name, function in functions:
      jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(function), platform='cpu')
  except Exception as e:  # pylint: disable=broad-except
    if isinstance(e, AttributeError) and path is not None:
      try:
        _discard(path)  # a build without the kernel: the next run compiles it again
      except OSError:
        pass
    message = ' '.join(f'{type(e).__name__}: {e}'.split())[:1500]
    logging.warning('cpu_matmul: kernel unavailable, using XLA products (%s)', message)
    return False
  return True


@functools.lru_cache(maxsize=1)
def integer_route() -> bool:
  """Whether the GGUF-block products take integer dot products in this process
  (`integer_blocks.h`: the kernel built with AVX512-VNNI, `SPECLM_QUANTIZED_FLOAT` unset)."""
  if not available():
    return False
  return bool(ctypes.CDLL(library_path()).SpeclmQuantizedIntegerRoute())


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


# Up to this many rows (batch × tokens) a product streams the packed panels; above it XLA's own
# matrix-matrix kernel is as fast or faster, so prompts (prefill) take XLA's product and
# decode steps and verification calls the kernel. On SmolLM2 (2 cores, one run, medians of 5):
# a whole prefill of 4 / 8 / 12 / 16 / 24 / 64 / 448 tokens took 68 / 83 / 68 / 149 / 228 /
# 577 / 4378 ms through the kernel and 99 / 104 / 73 / 128 / 155 / 243 / 1955 ms through XLA,
# while batch-8 verification (16 rows) is faster through the kernel (docs/benchmarks.md).
MAX_KERNEL_ROWS = 16


def serves(rows: int) -> bool:
  """Whether a product of `rows` rows (static) goes through the packed kernel."""
  return rows <= MAX_KERNEL_ROWS


def packed_product(x: jax.Array, packed: jax.Array, output_shape: tuple[int, ...], dtype,
                   input_dims: int = 1) -> jax.Array:
  """A layer's product through `matmul`: `x [..., inputs…]` times the kernel `[inputs…,
  outputs…]` that `pack_tree` packed (its input dims merged into one, as are its outputs).

  The trailing `input_dims` axes of `x` are the product's inputs; the leading ones are rows
  (any number). Returns `[..., *output_shape]` in `dtype`. `llama.Kernel` and `t5.Dense` use
  it for parameters that hold a `packed` copy.
  """
  output_shape = tuple(output_shape)
  lead = x.shape[:x.ndim - input_dims]
  inputs = math.prod(x.shape[x.ndim - input_dims:])
  y = matmul(x.reshape(-1, inputs).astype(jnp.float32), packed, math.prod(output_shape))
  return y.reshape(lead + output_shape).astype(dtype)


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
