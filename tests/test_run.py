"""The gin-configured job (speclm.run) on tiny random models: modes, metrics, CLI, errors."""

import io
import json
import os
import subprocess
import sys

import gin
import pytest

from speclm import outputs
from speclm import run

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tiny(output_dir, *bindings, gin_files=('test_tiny.gin',)):
  """Parses gin files plus bindings and runs the job in this process; returns the metrics."""
  gin.clear_config()
  try:
    run.parse_gin(gin_files, [f"OUTPUT_DIR = '{output_dir}'", *bindings])
    return run.run_job(progress_stream=io.StringIO())  # pylint: disable=missing-kwoa
  finally:
    gin.clear_config()


def subprocess_env():
  env = dict(os.environ)
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  env.setdefault('JAX_PLATFORMS', 'cpu')
  return env


def test_rewrite_gin_args():
  assert run.rewrite_gin_args(['prog', '--gin.GAMMA=5', "--gin.run_job.mode='baseline'",
                               '--gin_file=x.gin']) == [
                                   'prog', '--gin_bindings=GAMMA = 5',
                                   "--gin_bindings=run_job.mode = 'baseline'", '--gin_file=x.gin']
  with pytest.raises(run.JobError, match='has no value'):
    run.rewrite_gin_args(['--gin.GAMMA'])


def test_configs_dir_is_on_the_search_path():
  assert run.search_paths(['/extra'])[0] == '/extra'
  assert run.CONFIGS_DIR in run.search_paths()
  assert os.path.isfile(os.path.join(run.CONFIGS_DIR, 'test_tiny.gin'))


def test_compare_job_reports_everything(tmp_path):
  metrics = run_tiny(tmp_path)
  records = outputs.read_predictions(str(tmp_path / 'predictions.jsonl'))
  assert sorted(r['index'] for r in records) == list(range(12))
  # Greedy: speculative decoding reproduces the baseline token for token.
  assert all(r['identical'] for r in records)
  assert metrics['identical_output_rate'] == 1.0
  for record in records:
    assert record['speculative']['tokens'] == record['baseline']['tokens']
    assert record['output'] == record['speculative']['output']
    assert record['speculative']['target_calls'] <= record['baseline']['target_calls']
  # α is the job's β sum over its β count, from the per-row counters.
  beta_sum = sum(r['speculative']['beta_sum'] for r in records)
  beta_count = sum(r['speculative']['beta_count'] for r in records)
  assert metrics['alpha'] == pytest.approx(beta_sum / beta_count)
  assert 0.0 <= metrics['alpha'] <= 1.0
  assert metrics['tokens_per_target_call'] >= 1.0
  assert metrics['mode'] == 'compare' and metrics['gamma'] == 3
  assert metrics['speedup'] == pytest.approx(metrics['baseline']['decode_time_s']
                                             / metrics['speculative']['decode_time_s'])
  assert metrics['c'] > 0
  alpha, gamma, c = metrics['alpha'], 3, metrics['c']
  expected = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))
  assert metrics['predicted_speedup_theorem_3_8'] == pytest.approx(expected)
  assert 'bleu' in metrics['speculative'] and 'rougeLsum' in metrics['baseline']
  assert metrics['baseline']['tokens_per_target_call'] == 1.0
  on_disk = json.loads((tmp_path / 'metrics.json').read_text())
  assert on_disk['alpha'] == pytest.approx(metrics['alpha'])
  config = (tmp_path / 'config.gin').read_text()
  assert "OUTPUT_DIR = '" in config and 'run_job.mode' in config


def test_baseline_and_speculative_modes_on_a_file_with_truncation(tmp_path):
  data = tmp_path / 'in.jsonl'
  data.write_text(''.join(json.dumps({'id': f'e{i}', 'input': 'word ' * (i * 8 + 1),
                                      'reference': 'word'}) + '\n' for i in range(5)))
  files = ["DATASET = @file_dataset", f"file_dataset.path = '{data}'",
           'run_job.measure_cost = False']
  base = run_tiny(tmp_path / 'base', *files, "run_job.mode = 'baseline'", 'DRAFT = None')
  assert 'speculative' not in base and base['baseline']['tokens'] == 5 * 12
  assert base['num_truncated'] == 2  # inputs of 125 and 165 bytes; the limit is 96
  spec = run_tiny(tmp_path / 'spec', *files, "run_job.mode = 'speculative'")
  assert 'baseline' not in spec and spec['c'] is None
  assert any('Theorem' in note for note in spec['notes'])
  records = outputs.read_predictions(str(tmp_path / 'spec' / 'predictions.jsonl'))
  assert sorted(r['id'] for r in records) == [f'e{i}' for i in range(5)]
  assert sum(r['truncated'] for r in records) == spec['num_truncated']


def test_skip_policy_records_skipped_examples_once(tmp_path):
  metrics = run_tiny(tmp_path, "run_job.on_too_long = 'skip'", 'MAX_INPUT_LENGTH = 32',
                     'run_job.length_buckets = [32]', 'run_job.measure_cost = False')
  records = outputs.read_predictions(str(tmp_path / 'predictions.jsonl'))
  skipped = [r for r in records if 'skipped' in r]
  assert skipped and metrics['num_skipped'] == len(skipped)
  assert sorted(r['index'] for r in records) == list(range(12))


def _jobs_error(tmp_path, *bindings, gin_files=('test_tiny.gin',)):
  with pytest.raises(run.JobError) as info:
    run_tiny(tmp_path, *bindings, gin_files=gin_files)
  return info.value.message


def test_error_unknown_binding(tmp_path):
  message = _jobs_error(tmp_path, 'run_job.gama = 3')
  assert "run_job has no parameter 'gama'" in message
  message = _jobs_error(tmp_path, 'run_jb.gamma = 3')
  assert "'run_jb'" in message and 'run_job' in message  # suggests the right name


def test_error_missing_required_macro(tmp_path):
  gin.clear_config()
  with pytest.raises(run.JobError) as info:
    run.parse_gin(['ende_small.gin'], ["OUTPUT_DIR = '/tmp/x'"])
  gin.clear_config()
  message = info.value.message
  assert 'DRAFT_CHECKPOINT, TARGET_CHECKPOINT' in message
  assert '--gin.TARGET_CHECKPOINT=' in message


def test_error_nonexistent_checkpoint(tmp_path):
  message = _jobs_error(
      tmp_path / 'out', "TARGET_CHECKPOINT = '/nonexistent/t5_xxl'",
      "DRAFT_CHECKPOINT = '/nonexistent/t5_small'", 'VOCABULARY = @ByteVocabulary',
      'DATASET = @synthetic_dataset', gin_files=('ende_small.gin',))
  assert 'The checkpoint path /nonexistent/t5_xxl does not exist' in message


def test_error_empty_dataset(tmp_path):
  message = _jobs_error(tmp_path, 'synthetic_dataset.num_examples = 0')
  assert 'The dataset is empty' in message


def test_error_unwritable_output_dir(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('')
  message = _jobs_error(blocker / 'out')
  assert 'Cannot create the output directory' in message


def test_error_bad_settings(tmp_path):
  assert 'temperature must be a number >= 0' in _jobs_error(tmp_path, 'TEMPERATURE = -1.0')
  assert 'integer >= 1' in _jobs_error(tmp_path, 'GAMMA = 0')
  assert "needs a draft model" in _jobs_error(tmp_path, 'DRAFT = None')


def test_cli_from_another_directory(tmp_path):
  out = tmp_path / 'out'
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin',
       f"--gin.OUTPUT_DIR='{out}'", "--gin.run_job.mode='baseline'",
       '--gin.run_job.measure_cost=False', '--gin.synthetic_dataset.num_examples=4'],
      cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert 'speclm run summary' in proc.stdout
  assert json.loads((out / 'metrics.json').read_text())['num_examples'] == 4


def test_cli_error_is_one_paragraph_and_nonzero(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin'],
      cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert 'Traceback' not in proc.stderr
  assert 'Required setting not provided: OUTPUT_DIR' in proc.stderr
