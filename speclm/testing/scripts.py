"""Running the repository's scripts from tests."""

from __future__ import annotations

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
