"""Every job setting is validated before the output directory is touched (`speclm.run.settings`).

A bad value is one `JobError` naming the binding to change, raised before the directory is
created or locked, so the corrected rerun is the same job (nothing was recorded for the bad
one). The command line turns it into one line and exit status 2.
"""

import io
import os
import subprocess
import sys

import gin
import pytest

from speclm import run
from speclm import sampling as sampling_lib
from speclm.run import settings as settings_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_tiny(output_dir, *bindings):
  gin.clear_config()
  try:
    run.parse_gin(['test_tiny.gin'], [f"OUTPUT_DIR = '{output_dir}'",
                                      'run_job.measure_cost = False', *bindings])
    return run.run_job(progress_stream=io.StringIO())  # pylint: disable=missing-kwoa
  finally:
    gin.clear_config()


@pytest.mark.parametrize('binding, named', [
    ("SEED = 'x'", 'run_job.seed must be an integer'),
    ('SEED = 1.5', 'run_job.seed must be an integer'),
    ('BATCH_SIZE = 0', 'run_job.batch_size must be an integer >= 1, got 0'),
    ("BATCH_SIZE = '4'", "run_job.batch_size must be an integer >= 1, got '4'"),
    ('MAX_NEW_TOKENS = 0', 'run_job.max_new_tokens must be an integer >= 1'),
    ('MAX_INPUT_LENGTH = -3', 'run_job.max_input_length must be an integer >= 1'),
    ('run_job.max_examples = 0', 'run_job.max_examples must be an integer >= 1'),
    ("run_job.show_progress = 'no'", 'run_job.show_progress must be True or False'),
    ('run_job.length_buckets = [0, 96]', 'run_job.length_buckets must be integers >= 1'),
    ('run_job.length_buckets = [32]', 'The largest length bucket (32) is below'),
    ('GAMMA = 0', 'run_job.gamma: gamma (tokens drafted per round) must be an integer >= 1'),
    ("run_job.mode = 'fast'", "run_job.mode must be one of ('speculative', 'baseline',"),
    ("run_job.on_too_long = 'cut'", 'run_job.on_too_long must be one of'),
])
def test_a_bad_setting_is_refused_before_the_output_dir_exists(tmp_path, binding, named):
  output_dir = tmp_path / 'out'
  with pytest.raises(run.JobError) as error:
    run_tiny(output_dir, binding)
  assert named in error.value.message
  assert '\n' not in error.value.message
  assert not output_dir.exists()  # not created, not locked: nothing to refuse on a rerun


def test_the_corrected_rerun_is_the_same_job(tmp_path):
  output_dir = tmp_path / 'out'
  with pytest.raises(run.JobError):
    run_tiny(output_dir, 'BATCH_SIZE = 0', 'synthetic_dataset.num_examples = 4')
  metrics = run_tiny(output_dir, 'BATCH_SIZE = 4', 'synthetic_dataset.num_examples = 4')
  assert metrics['num_decoded'] == 4 and metrics['identical_output_rate'] == 1.0


def test_the_command_line_prints_one_line_and_exits_2(tmp_path):
  output_dir = tmp_path / 'out'
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''),
             JAX_PLATFORMS='cpu')
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin',
       f"--gin.OUTPUT_DIR='{output_dir}'", "--gin.SEED='x'"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr
  lines = [line for line in proc.stderr.splitlines() if line.startswith('speclm.run:')]
  assert lines == ["speclm.run: error: run_job.seed must be an integer (the base seed; each"
                   " batch adds its first example's index), got 'x'."], proc.stderr[-2000:]
  assert not output_dir.exists()


def _settings(**overrides):
  kwargs = dict(mode='compare', draft=object(), output_dir='/out', gamma=3, max_gamma=4,
                draft_stopping=False, prior_alpha=0.5, tree=None, sampling=sampling_lib.GREEDY,
                max_new_tokens=12, batch_size=4, seed=0, max_input_length=96,
                length_buckets=[96], on_too_long='truncate', add_eos_to_inputs=False,
                max_examples=None, exclude_compile_time=True, measure_cost=True,
                reference_metrics=('bleu',), show_progress=True, partitioner=None,
                overwrite=False, on_bad_logits='fail')
  kwargs.update(overrides)
  return settings_lib.validate(**kwargs)


def test_fingerprint_entries_hold_what_job_json_always_held():
  # job.json of a finished job is compared key by key on resume: the names and values must
  # not change, or every existing output directory would be refused as another job.
  assert _settings().fingerprint_entries() == {
      'mode': 'compare', 'gamma': 3, 'temperature': 0.0, 'top_k': 0, 'top_p': 1.0,
      'max_new_tokens': 12, 'seed': 0, 'batch_size': 4, 'max_input_length': 96,
      'length_buckets': [96], 'on_too_long': 'truncate', 'add_eos_to_inputs': False,
      'max_examples': None}
  adaptive = _settings(gamma='adaptive', max_gamma=3, draft_stopping=True)
  assert adaptive.fingerprint_entries()['gamma'] == 'adaptive'
  assert adaptive.fingerprint_entries()['max_gamma'] == 3
  assert adaptive.fingerprint_entries()['draft_stopping'] is True
  baseline = _settings(mode='baseline', draft=None)
  assert baseline.methods == ('baseline',) and baseline.fingerprint_entries()['gamma'] is None


def test_a_speculative_mode_needs_a_draft():
  with pytest.raises(run.JobError, match="Mode 'compare' needs a draft model"):
    _settings(draft=None)
