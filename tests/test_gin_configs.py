"""Every gin file in configs/ parses; run and task files document and mark what is required."""

import glob
import os
import re

import gin
import pytest

from speclm import run

CONFIGS = run.CONFIGS_DIR
ALL_GIN = sorted(os.path.relpath(p, CONFIGS)
                 for p in glob.glob(os.path.join(CONFIGS, '**', '*.gin'), recursive=True))
# Table 2 of the paper: (task file) -> (γ at temperature 0, γ at temperature 1).
PAPER_GAMMAS = {
    'ende_small.gin': (7, 7), 'ende_base.gin': (7, 5), 'ende_large.gin': (7, 3),
    'cnndm_small.gin': (5, 5), 'cnndm_base.gin': (5, 3), 'cnndm_large.gin': (3, 3),
}
RUN_FILES = ['runs/speculative.gin', 'runs/baseline.gin', 'runs/compare.gin']


@pytest.fixture(autouse=True)
def _clean_gin():
  gin.clear_config()
  for path in run.search_paths():
    gin.add_config_file_search_path(path)
  yield
  gin.clear_config()


def _missing_includes(relpath, seen=None):
  """Included files (transitively) that do not exist in configs/."""
  seen = set() if seen is None else seen
  missing = []
  with open(os.path.join(CONFIGS, relpath), encoding='utf-8') as f:
    for name in re.findall(r"^include\s+['\"]([^'\"]+)['\"]", f.read(), flags=re.M):
      if name in seen:
        continue
      seen.add(name)
      if os.path.isfile(os.path.join(CONFIGS, name)):
        missing += _missing_includes(name, seen)
      else:
        missing.append(name)
  return missing


def test_the_expected_files_exist():
  for name in RUN_FILES + list(PAPER_GAMMAS) + ['test_tiny.gin']:
    assert name in ALL_GIN, name


def test_the_model_files_exist():
  for name in ['models/t5_1_0/small.gin', 'models/t5_1_0/base.gin', 'models/t5_1_0/large.gin',
               'models/t5_1_0/3B.gin', 'models/t5_1_0/11B.gin', 'models/t5_1_1/tiny.gin',
               'models/t5_1_1/small.gin', 'models/t5_1_1/base.gin', 'models/t5_1_1/large.gin',
               'models/t5_1_1/xl.gin', 'models/t5_1_1/xxl.gin']:
    assert name in ALL_GIN, name


@pytest.mark.parametrize('relpath', ALL_GIN)
def test_parses(relpath):
  assert _missing_includes(relpath) == [], f'{relpath} includes files missing from configs/'
  gin.parse_config_files_and_bindings([os.path.join(CONFIGS, relpath)], [],
                                      finalize_config=False)


@pytest.mark.parametrize('relpath', RUN_FILES + list(PAPER_GAMMAS) + ['test_tiny.gin'])
def test_job_files_open_with_a_header(relpath):
  with open(os.path.join(CONFIGS, relpath), encoding='utf-8') as f:
    text = f.read()
  header = text[:text.index('\n\n')]
  assert all(line.startswith('#') for line in header.splitlines()), header
  assert 'Required' in header and 'Commonly overridden' in header
  assert 'python -m speclm.run' in header


def test_run_files_mark_required_macros():
  for relpath, required in [
      ('runs/speculative.gin', ['DATASET', 'DRAFT', 'OUTPUT_DIR', 'TARGET', 'VOCABULARY']),
      ('runs/compare.gin', ['DATASET', 'DRAFT', 'OUTPUT_DIR', 'TARGET', 'VOCABULARY']),
      ('runs/baseline.gin', ['DATASET', 'OUTPUT_DIR', 'TARGET', 'VOCABULARY']),
      ('test_tiny.gin', ['OUTPUT_DIR'])]:
    gin.clear_config()
    gin.parse_config_files_and_bindings([relpath], [], finalize_config=False)
    assert run.unset_required() == required, relpath


@pytest.mark.parametrize('relpath', sorted(PAPER_GAMMAS))
def test_table2_files_use_the_papers_gamma(relpath):
  assert _missing_includes(relpath) == [], f'{relpath} includes files missing from configs/'
  gin.parse_config_files_and_bindings([relpath], [], finalize_config=False)
  assert run.unset_required() == ['DRAFT_CHECKPOINT', 'OUTPUT_DIR', 'TARGET_CHECKPOINT']
  at_0, at_1 = PAPER_GAMMAS[relpath]
  assert run.gamma_for_temperature() == at_0  # TEMPERATURE = 0.0 by default
  gin.parse_config('TEMPERATURE = 1.0')
  assert run.gamma_for_temperature() == at_1
  gin.parse_config('TEMPERATURE = 0.5')
  with pytest.raises(run.JobError, match='--gin.GAMMA='):
    run.gamma_for_temperature()
  assert gin.query_parameter('run_job.mode') is not None
  assert gin.query_parameter('run_job.batch_size') is not None
