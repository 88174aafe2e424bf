"""The persistent compilation cache of `python -m speclm.run`: a second process running the same
job loads its programs instead of compiling them; `--nocompilation_cache` turns it off; the
directory is keyed by the machine and kept private."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

from speclm.run import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SUMMARY = re.compile(r'Compilation cache: (\d+) program\(s\) loaded \(about (\d+) s of compiling'
                      r' saved\), (\d+) compiled and stored \((.+)\)\.')


def _env(cache_root):
  env = dict(os.environ)
  env.pop('JAX_COMPILATION_CACHE_DIR', None)  # the suite's own cache would answer instead
  env[compile_cache.ENV_DIRECTORY] = str(cache_root)
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


def _job(tmp_path, cache_root, name, *flags):
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin', *flags,
       '--gin.run_job.show_progress=False', '--gin.run_job.measure_cost=False',
       '--gin.synthetic_dataset.num_examples=2', f"--gin.OUTPUT_DIR='{tmp_path / name}'"],
      cwd=tmp_path, env=_env(cache_root), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def test_a_second_process_loads_the_programs_the_first_compiled(tmp_path):
  root = tmp_path / 'cache'
  first_run = _job(tmp_path, root, 'first')
  # the job's memory report, beside the cache's line
  assert re.search(r'Weights as held: target [0-9.]+ kB, draft [0-9.]+ kB\.', first_run.stderr)
  first = _search(first_run.stderr)
  hits, _, stored, directory = first.groups()
  assert int(hits) == 0 and int(stored) >= 1
  assert os.path.dirname(directory) == str(root)
  assert os.path.basename(directory) == compile_cache.machine_key()
  assert oct(os.stat(directory).st_mode & 0o777) == oct(0o700)
  files = set(os.listdir(directory))
  assert len(files) >= int(stored)

  second = _search(_job(tmp_path, root, 'second').stderr)
  assert int(second.group(1)) >= int(stored)  # every program stored was loaded back
  assert second.group(4) == directory
  assert _tokens(tmp_path / 'first') == _tokens(tmp_path / 'second')


def _tokens(out):
  rows = [json.loads(line) for line in (out / 'predictions.jsonl').read_text().splitlines()]
  return [(row['baseline']['tokens'], row['speculative']['tokens']) for row in rows]


def test_nocompilation_cache_compiles_afresh_and_writes_nothing(tmp_path):
  root = tmp_path / 'cache'
  proc = _job(tmp_path, root, 'out', '--nocompilation_cache')
  assert 'Compilation cache: off.' in proc.stderr
  assert not root.exists()


def test_a_directory_others_can_write_is_refused(tmp_path, monkeypatch):
  shared = tmp_path / 'shared'
  shared.mkdir()
  os.chmod(shared, 0o777)
  monkeypatch.delenv('JAX_COMPILATION_CACHE_DIR', raising=False)
  before = jax.config.jax_enable_compilation_cache  # the suite's own cache, restored after
  try:
    assert compile_cache.enable(True, str(shared)) is None
    assert compile_cache.summary() == 'Compilation cache: off.'
    assert not jax.config.jax_enable_compilation_cache
  finally:
    jax.config.update('jax_enable_compilation_cache', before)


def _search(stderr):
  match = _SUMMARY.search(stderr)
  if match is None:
    pytest.fail(f'no cache summary in: {stderr[-2000:]}')
  return match
