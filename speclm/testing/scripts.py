"""Running the repository's scripts from tests."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import types

import absl
import absl.flags

_ABSL_FLAGS = absl.flags  # the real module


def run_script(script: str, *args: str, timeout: float = 900) -> str:
  """Runs `python script args` from the repository root (the folder above `scripts/`); fails
  with the end of its stderr if it exits non-zero, else returns its stderr (absl's log)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(script)))
  result = subprocess.run([sys.executable, script, *args], cwd=root, text=True,
                          capture_output=True, timeout=timeout, check=False)
  if result.returncode != 0:
    raise AssertionError(f'{os.path.basename(script)} exited {result.returncode}:\n'
                         f'{result.stderr[-3000:]}')
  return result.stderr


class _PrivateFlags(types.ModuleType):
  """Stands in for `absl.flags` while a script is imported: its `DEFINE_*` calls and `FLAGS`
  go to a `FlagValues` of the script's own, so scripts that define the same flag names (two
  benchmarks' --max_new_tokens) can be loaded into one test process."""

  def __init__(self, values):
    super().__init__('absl.flags')
    self.FLAGS = values  # pylint: disable=invalid-name

  def __getattr__(self, name):
    attr = getattr(_ABSL_FLAGS, name)
    if name.startswith('DEFINE') and callable(attr):
      return functools.partial(attr, flag_values=self.FLAGS)
    return attr


def load_script(script: str):
  """Imports a repository script (a path) as a module, to test its functions.

  Its absl flags are defined in a `FlagValues` of its own (the module's `flags.FLAGS`), parsed
  with their defaults, so that loading it neither touches nor collides with the process's
  flags. Load each script once per test module (a module-scoped fixture): importing is slow.
  """
  name = os.path.splitext(os.path.basename(script))[0]
  spec = importlib.util.spec_from_file_location(name, script)
  module = importlib.util.module_from_spec(spec)
  values = _ABSL_FLAGS.FlagValues()
  absl.flags = _PrivateFlags(values)  # what `from absl import flags` finds during the import
  try:
    spec.loader.exec_module(module)
  finally:
    absl.flags = _ABSL_FLAGS
  values([script])  # parse: every flag takes its default
  return module
