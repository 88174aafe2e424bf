"""The persistent compilation cache: a job's compiled programs kept on disk for its next run.

Every job compiles the same handful of programs (prefill per length bucket, the draft's steps,
the target's verification call); without a cache, a rerun of the same gin file pays minutes of
XLA compiling again. `enable()` turns on JAX's persistent cache in a directory of the user's
cache (`$SPECLM_COMPILATION_CACHE`, else `$XDG_CACHE_HOME/speclm/xla`, else
`~/.cache/speclm/xla`), one subdirectory per machine key. JAX keys each entry by the program
(its HLO), the compile options, the backend and the jax/jaxlib versions; the machine key adds
what JAX's key leaves out on a CPU: the processor's model and instruction-set flags (a program
compiled for AVX-512 must not run where there is none) and the source of speclm's CPU kernels
(the custom calls a program names). `JAX_COMPILATION_CACHE_DIR`, when set, is used as it is.

`python -m speclm.run` enables it unless `--nocompilation_cache`; `summary()` is the line the
job prints at its end: how many programs came from the cache and how many were compiled.
"""

from __future__ import annotations

import hashlib
import os
import platform
import stat
import threading

import jax
from jax._src import monitoring  # JAX's event listeners: the only way to count cache hits

ENV_DIRECTORY = 'SPECLM_COMPILATION_CACHE'
_MIN_COMPILE_SECONDS = 0.2  # programs faster to compile than this are not worth a file

_lock = threading.Lock()
_counts = {'hits': 0, 'misses': 0, 'saved_seconds': 0.0}
_state = {'directory': None, 'listening': False}


def _kernel_sources_digest() -> str:
  """The digest of speclm's CPU kernel sources (the custom calls compiled programs name)."""
  kernels = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'kernels')
  digest = hashlib.sha256()
  for name in sorted(os.listdir(kernels)):
    if name.endswith(('.cc', '.h')):
      with open(os.path.join(kernels, name), 'rb') as f:
        digest.update(name.encode() + b'\0' + f.read())
  return digest.hexdigest()


def _cpu_identity() -> str:
  """The processor's model name and instruction-set flags (Linux), else the platform's name."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      lines = f.read().splitlines()
  except OSError:
    return platform.processor() or platform.machine()
  fields = {}
  for line in lines:
    key, _, value = line.partition(':')
    key = key.strip()
    if key in ('model name', 'flags', 'Features', 'CPU implementer', 'CPU part'):
      fields.setdefault(key, ' '.join(sorted(value.split())))
  return repr(sorted(fields.items())) or platform.machine()


def machine_key() -> str:
  """A short key for everything JAX's own cache key leaves out (see the module docstring)."""
  import jaxlib  # pylint: disable=import-outside-toplevel
  parts = [_cpu_identity(), jax.__version__, jaxlib.__version__, _kernel_sources_digest()]
  return hashlib.sha256('\n'.join(parts).encode()).hexdigest()[:16]


def default_directory() -> str:
  """`$SPECLM_COMPILATION_CACHE`, else the user's cache directory, then the machine key."""
  root = os.environ.get(ENV_DIRECTORY)
  if not root:
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    root = os.path.join(base, 'speclm', 'xla')
  return os.path.join(root, machine_key())


def _private_directory(path: str) -> None:
  """Creates `path` (mode 0700) or checks that an existing one belongs to this user and is not
  writable by others: a cached program is code that this process will run."""
  os.makedirs(path, mode=0o700, exist_ok=True)
  info = os.stat(path)
  if hasattr(os, 'getuid') and info.st_uid != os.getuid():
    raise PermissionError(f'{path} belongs to another user')
  if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    raise PermissionError(f'{path} is writable by other users')


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  with _lock:
    if event == '/jax/compilation_cache/cache_hits':
      _counts['hits'] += 1
    elif event == '/jax/compilation_cache/cache_misses':
      _counts['misses'] += 1


def _on_duration(event: str, duration: float, **kwargs) -> None:
  del kwargs
  if event == '/jax/compilation_cache/compile_time_saved_sec':
    with _lock:
      _counts['saved_seconds'] += max(float(duration), 0.0)


def enable(on: bool = True, directory: str | None = None) -> str | None:
  """Turns JAX's persistent compilation cache on (in `directory`, else `JAX_COMPILATION_CACHE_DIR`,
  else `default_directory()`) or off; returns the directory, or None when off or unusable (a
  cache that cannot be used is a warning, never a failed job). Call before anything compiles."""
  _state['directory'] = None
  if not on:
    jax.config.update('jax_enable_compilation_cache', False)
    return None
  path = directory or os.environ.get('JAX_COMPILATION_CACHE_DIR') or default_directory()
  try:
    _private_directory(path)
  except OSError as e:
    print(f'speclm.run: warning: compilation cache off: {e}.', flush=True)
    jax.config.update('jax_enable_compilation_cache', False)
    return None
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', path)
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', _MIN_COMPILE_SECONDS)
  if not _state['listening']:
    monitoring.register_event_listener(_on_event)
    monitoring.register_event_duration_secs_listener(_on_duration)
    _state['listening'] = True
  _state['directory'] = path
  return path


def counts() -> dict[str, float]:
  """Programs loaded from the cache (`hits`), compiled because absent (`misses`), and the
  compile seconds the hits saved, since this process started."""
  with _lock:
    return dict(_counts)


def summary() -> str:
  """One line: what the cache did in this process (or that it is off)."""
  if _state['directory'] is None:
    return 'Compilation cache: off.'
  c = counts()
  return (f"Compilation cache: {c['hits']} program(s) loaded (about {c['saved_seconds']:.0f} s"
          f" of compiling saved), {c['misses']} compiled and stored ({_state['directory']}).")
