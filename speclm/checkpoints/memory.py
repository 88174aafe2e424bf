"""How many bytes a model's weights take as held, and whether they fit before anything loads.

A 7B checkpoint dequantized to float32 and packed for the CPU kernel needs 8 bytes a weight
(56 GB); loading it on a 24 GB machine ends in the kernel's OOM killer minutes later, with no
message. The providers call `check_fits` first, from the config alone (no weight read), and
refuse with one line that says what would fit; the job prints `describe` of what it holds.

    estimate_bytes(config, dtype='float32', cpu_kernels=True)   # bytes as the job would hold
    check_fits('the target', estimate)                          # MemoryLimitError if too big
    held_bytes(model.params)                                    # bytes actually held

The memory available is `$SPECLM_MEMORY_LIMIT` when set (e.g. `8G`, `512M`, bytes), else the
smaller of the system's MemAvailable and what this process's cgroup still allows.
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np

ENV_LIMIT = 'SPECLM_MEMORY_LIMIT'
_UNITS = {'': 1, 'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}
# Room left beside the weights: activations, the KV cache, XLA's buffers, Python itself.
_HEADROOM = 0.9


class MemoryLimitError(ValueError):
  """A model whose weights will not fit in the memory available (one-line message)."""


def format_bytes(n: float) -> str:
  """`123.4 MB`, `4.71 GB` (decimal units, as file sizes are quoted)."""
  for unit, size in (('GB', 1e9), ('MB', 1e6), ('kB', 1e3)):
    if n >= size:
      return f'{n / size:.3g} {unit}' if n < 100 * size else f'{n / size:.0f} {unit}'
  return f'{int(n)} B'


def parse_bytes(text: str) -> int:
  """`'8G'`, `'512M'`, `'12.5GB'`, `'1000000'` -> bytes (K/M/G/T are powers of 1024)."""
  match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*', text, re.IGNORECASE)
  if match is None:
    raise MemoryLimitError(f'{ENV_LIMIT}={text!r} is not a size; write e.g. 8G, 512M or a'
                           ' number of bytes.')
  return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def held_bytes(tree) -> int:
  """The bytes of every array in `tree` (a parameter tree as held)."""
  return int(sum(np.dtype(leaf.dtype).itemsize * math.prod(leaf.shape)
                 for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, 'dtype')))


def describe(name: str, tree) -> str:
  """`target 651 MB` for the job's line about the weights it holds."""
  return f'{name} {format_bytes(held_bytes(tree))}'


def estimate_bytes(config, dtype: str = 'float32', cpu_kernels: bool = False,
                   stored: dict[str, int] | None = None) -> int:
  """Bytes a `speclm.models.llama.LlamaConfig`'s weights take as the loader will hold them:
  every parameter in `dtype`; with `cpu_kernels` a second, packed copy of every matrix (and an
  untied head when the embedding table is tied). `stored` maps parameter paths
  ('layers_0/mlp/up/kernel') to the bytes they take when kept in their stored (quantized)
  form instead, with no second copy."""
  from speclm.models import llama  # pylint: disable=import-outside-toplevel
  shapes = jax.eval_shape(llama.Llama(config).init_params, jax.random.key(0))
  itemsize = np.dtype(dtype).itemsize
  stored = stored or {}
  total = 0
  for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    if name in stored:
      total += stored[name]
      continue
    size = math.prod(leaf.shape) * itemsize
    is_matrix = len(leaf.shape) >= 2
    total += size * (2 if cpu_kernels and is_matrix else 1)
    if cpu_kernels and name == 'embedder/embedding' and config.tie_embeddings:
      total += size  # the untied head `pack_for_cpu` adds (packed; the table stays too)
  return int(total)


def _meminfo_available() -> int | None:
  try:
    with open('/proc/meminfo', encoding='utf-8') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _cgroup_room() -> int | None:
  """What this process's cgroup (v2, else v1) still allows, when it has a limit."""
  for limit_file, usage_file in (('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory.current'),
                                 ('/sys/fs/cgroup/memory/memory.limit_in_bytes',
                                  '/sys/fs/cgroup/memory/memory.usage_in_bytes')):
    try:
      with open(limit_file, encoding='utf-8') as f:
        limit = f.read().strip()
      with open(usage_file, encoding='utf-8') as f:
        usage = int(f.read().strip())
    except (OSError, ValueError):
      continue
    if limit == 'max' or not limit.isdigit() or int(limit) >= 2**60:
      return None
    return max(int(limit) - usage, 0)
  return None


def available_bytes() -> tuple[int | None, str]:
  """(bytes available for weights, where the figure comes from); (None, …) when unknown."""
  if os.environ.get(ENV_LIMIT):
    return parse_bytes(os.environ[ENV_LIMIT]), f'${ENV_LIMIT}'
  figures = [(b, source) for b, source in ((_meminfo_available(), 'MemAvailable'),
                                           (_cgroup_room(), 'the cgroup limit'))
             if b is not None]
  if not figures:
    return None, 'unknown'
  return min(figures)


def check_fits(name: str, needed: int, how: str = '') -> None:
  """Raises MemoryLimitError (one line, before anything loads) when `needed` bytes of weights
  exceed 90% of `available_bytes()`; `how` says how they would be held ('float32, packed for
  the CPU kernel')."""
  available, source = available_bytes()
  if available is None or needed <= _HEADROOM * available:
    return
  held = f' ({how})' if how else ''
  raise MemoryLimitError(
      f'{name} needs about {format_bytes(needed)} of memory for its weights{held}, but only'
      f' {format_bytes(available)} is available ({source}); refusing before loading. Hold them'
      " smaller (dtype='bfloat16', cpu_kernels=False, or a GGUF file with quantized=True), use"
      f' a smaller model, or set {ENV_LIMIT} if the figure is wrong.')
