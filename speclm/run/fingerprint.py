"""What determines a job's outputs, recorded in job.json so a resume never mixes two jobs.

A job's fingerprint is a flat dict, name -> JSON value, of everything that decides what its
predictions hold:

  settings      γ, sampling, max_new_tokens, seed, batch size, input limits and length
                handling, mode: the values the job actually used (after gin, sweeps and
                `gamma_for_temperature` are resolved).
  dataset       a hash of every example's index, id and input, and their count.
  gin bindings  every binding of the configuration with macros substituted (`target/…`,
                `draft/…` providers, model configs, checkpoint paths, the vocabulary and dataset
                providers), less those that do not change an output (the output directory,
                progress, cost measurement, reference metrics, the device mesh).
  files         for every binding that names a local file or directory (a checkpoint, a
                vocabulary): its size and modification time (a directory: its files' count,
                total size and newest modification time).
  models        once loaded, each model's kind, parameter count and a hash of its parameter
                shapes, dtypes and first and last entries.

`speclm.outputs.OutputDir.check` compares two fingerprints and names each entry that differs.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from typing import Any

import jax
import numpy as np

from speclm.run.gin_cli import all_bindings
from speclm.run.gin_cli import resolve_macros

VERSION = 2

# Bindings of these configurables' parameters never change an output.
_IGNORED_PARAMS = {
    'run_job': {'output_dir', 'show_progress', 'measure_cost', 'exclude_compile_time',
                'reference_metrics', 'overwrite', 'on_bad_logits', 'partitioner',
                # recorded as the values the job used, under "settings":
                'mode', 'gamma', 'sampling', 'max_new_tokens', 'batch_size', 'seed',
                'max_input_length', 'length_buckets', 'on_too_long', 'add_eos_to_inputs',
                'max_examples'},
}
# Whole configurables whose bindings are recorded through the job's settings, or never change
# an output (a sweep's own settings, the mesh: sharded runs equal one device).
_IGNORED_CONFIGURABLES = {'run_sweep', 'sampling_config', 'gamma_for_temperature',
                          'job_parts'}
_IGNORED_MODULES = ('speclm.partitioning',)
_MAX_DIR_FILES = 100_000


def settings_entries(settings: dict[str, Any]) -> dict[str, Any]:
  """Fingerprint entries (`settings.NAME`) for the job's settings."""
  return {f'settings.{name}': value for name, value in settings.items()}


def dataset_entries(dataset_hash: str, num_examples: int) -> dict[str, Any]:
  """Fingerprint entries for the dataset: its content hash and number of examples."""
  return {'dataset.hash': dataset_hash, 'dataset.num_examples': num_examples}


def _canonical(value: Any) -> Any:
  """A JSON value standing for a resolved binding (references become their gin text)."""
  if isinstance(value, (bool, int, str)) or value is None:
    return value
  if isinstance(value, float):
    return value if np.isfinite(value) else repr(value)
  if isinstance(value, (list, tuple)):
    return [_canonical(v) for v in value]
  if isinstance(value, dict):
    return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
  return repr(value)


def _short_name(selector: str) -> str:
  return selector.rsplit('.', 1)[-1]


def gin_entries() -> dict[str, Any]:
  """Every parsed binding that can change an output, macros substituted: `gin.NAME` -> value."""
  entries = {}
  for (scope, selector), params in all_bindings().items():
    if selector == 'gin.macro' or selector.startswith(_IGNORED_MODULES):
      continue
    name = _short_name(selector)
    if name in _IGNORED_CONFIGURABLES:
      continue
    for param, value in params.items():
      if param in _IGNORED_PARAMS.get(name, ()):
        continue
      key = f'gin.{scope + "/" if scope else ""}{name}.{param}'
      entries[key] = _canonical(resolve_macros(value))
  return entries


def _paths_in(value: Any) -> list[str]:
  if isinstance(value, str):
    return [value] if value and '://' not in value and os.path.exists(value) else []
  if isinstance(value, list):
    return [p for v in value for p in _paths_in(v)]
  if isinstance(value, dict):
    return [p for v in value.values() for p in _paths_in(v)]
  return []


def _mtime(seconds: float) -> str:
  return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(
      timespec='seconds')


def file_signature(path: str) -> str:
  """'N bytes, modified T' for a file; for a directory its files' count, bytes and newest T."""
  if os.path.isfile(path):
    stat = os.stat(path)
    return f'{stat.st_size} bytes, modified {_mtime(stat.st_mtime)}'
  count, size, newest = 0, 0, 0.0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        stat = os.stat(os.path.join(root, name))
      except OSError:
        continue
      count, size, newest = count + 1, size + stat.st_size, max(newest, stat.st_mtime)
      if count >= _MAX_DIR_FILES:
        break
    if count >= _MAX_DIR_FILES:
      break
  return f'{count} files, {size} bytes, newest modified {_mtime(newest) if count else "never"}'


def file_entries(bindings: dict[str, Any]) -> dict[str, Any]:
  """`file PATH` -> its signature, for every local path a binding names."""
  paths = sorted({os.path.abspath(p) for value in bindings.values() for p in _paths_in(value)})
  return {f'file {path}': file_signature(path) for path in paths}


def model_entry(model: Any) -> str:
  """A model's kind, parameter count and a hash of its parameters' shapes, dtypes and first
  and last entries (cheap on any device layout: two scalars per array)."""
  definition = getattr(model, 'definition', model)
  leaves = jax.tree_util.tree_leaves_with_path(getattr(model, 'params', {}))
  digest = hashlib.sha256()
  count = 0
  for path, leaf in leaves:
    shape = tuple(getattr(leaf, 'shape', ()))
    dtype = str(getattr(leaf, 'dtype', type(leaf).__name__))
    digest.update(f'{jax.tree_util.keystr(path)}{shape}{dtype}'.encode())
    size = int(np.prod(shape)) if shape else 1
    count += size
    if hasattr(leaf, 'shape') and size:
      first = leaf[(0,) * len(shape)] if shape else leaf
      last = leaf[tuple(d - 1 for d in shape)] if shape else leaf
      digest.update(np.asarray(jax.device_get(first)).tobytes())
      digest.update(np.asarray(jax.device_get(last)).tobytes())
  return f'{type(definition).__name__}, {count} parameters, {digest.hexdigest()[:16]}'


def job_fingerprint(settings: dict[str, Any], dataset_hash: str, num_examples: int
                    ) -> dict[str, Any]:
  """Everything known before the models load; `model_entries` adds the rest."""
  bindings = gin_entries()
  return {'fingerprint_version': VERSION, **settings_entries(settings),
          **dataset_entries(dataset_hash, num_examples), **bindings, **file_entries(bindings)}


def model_entries(models: dict[str, Any]) -> dict[str, Any]:
  """`models.ROLE` -> `model_entry` for each loaded model (None entries are left out)."""
  return {f'models.{role}': model_entry(model) for role, model in models.items()
          if model is not None}

