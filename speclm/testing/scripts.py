"""Running the repository's scripts from tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys


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


def load_script(script: str):
  """Imports a repository script (a path) as a module, to test its functions; its absl flags
  are defined once per process, so load each script once (a module-scoped fixture)."""
  name = os.path.splitext(os.path.basename(script))[0]
  spec = importlib.util.spec_from_file_location(name, script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
