"""A job killed at any moment resumes without losing or duplicating an example."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from speclm import outputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_EXAMPLES = 40


def _record(index):
  return {'index': index, 'id': str(index), 'output': 'x' * 10}


def test_torn_last_line_is_dropped_and_redone(tmp_path):
  out = outputs.OutputDir(str(tmp_path))
  assert out.resume({'job': 1}) == {}
  out.append([_record(0), _record(1)])
  out.close()
  with open(tmp_path / outputs.PREDICTIONS, 'ab') as f:
    f.write(b'{"index": 2, "id": "2", "outp')  # a kill in the middle of a write
  out = outputs.OutputDir(str(tmp_path))
  done = out.resume({'job': 1})
  assert sorted(done) == [0, 1]
  out.append([_record(2)])
  out.close()
  records = outputs.read_predictions(str(tmp_path / outputs.PREDICTIONS))
  assert [r['index'] for r in records] == [0, 1, 2]


def test_a_different_job_is_refused(tmp_path):
  with outputs.OutputDir(str(tmp_path)) as out:
    out.resume({'mode': 'compare', 'dataset': 'abc'})
  with outputs.OutputDir(str(tmp_path)) as out:
    with pytest.raises(outputs.OutputError,
                       match=r'different job \(dataset: "abc" -> "xyz"\)'):
      out.resume({'mode': 'compare', 'dataset': 'xyz'})
    out.check({'mode': 'compare'}, partial=True)  # a partial check compares what it is given
    with pytest.raises(outputs.OutputError, match=r'mode: "compare" -> "baseline"'):
      out.check({'mode': 'baseline'}, partial=True)


def test_a_batch_recorded_only_in_part_is_decoded_again(tmp_path):
  rows = [dict(_record(i), batch=2 * (i // 2), batch_rows=2) for i in range(5)]
  rows[4]['batch_rows'] = 1  # a short last batch
  out = outputs.OutputDir(str(tmp_path))
  out.resume({'job': 1})
  out.append(rows[:3])  # batch 0 whole, batch 2 only its first row (a crash mid-write)
  out.close()
  out = outputs.OutputDir(str(tmp_path))
  assert sorted(out.resume({'job': 1})) == [0, 1]
  out.append(rows[2:])
  out.close()
  records = outputs.read_predictions(str(tmp_path / outputs.PREDICTIONS))
  assert [r['index'] for r in records] == [0, 1, 2, 3, 4]
  out = outputs.OutputDir(str(tmp_path))
  assert sorted(out.resume({'job': 1})) == [0, 1, 2, 3, 4]  # a whole short batch stays
  out.close()


def test_two_jobs_cannot_share_a_directory(tmp_path):
  first = outputs.OutputDir(str(tmp_path))
  with pytest.raises(outputs.OutputError, match='Another job is writing'):
    outputs.OutputDir(str(tmp_path))
  first.close()
  outputs.OutputDir(str(tmp_path)).close()  # free again once the first job is done


def _command(output_dir):
  # The programs of test_job_failures.py's Ctrl-C job (batches of 1, 12 new tokens): in one
  # session the first run here finds them compiled (tests/conftest.py).
  return [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin',
          f"--gin.OUTPUT_DIR='{output_dir}'", f'--gin.synthetic_dataset.num_examples={NUM_EXAMPLES}',
          '--gin.BATCH_SIZE=1', '--gin.run_job.measure_cost=False',
          '--gin.run_job.show_progress=False']


def _env(cache_dir):
  env = dict(os.environ)
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  env.setdefault('JAX_PLATFORMS', 'cpu')
  # Share compiled programs between the killed and the resumed process: the session's cache
  # (tests/conftest.py), else one for this test.
  if not env.get('JAX_COMPILATION_CACHE_DIR'):
    env['JAX_COMPILATION_CACHE_DIR'] = str(cache_dir)
    env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    env['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
  return env


def _num_lines(path):
  try:
    with open(path, 'rb') as f:
      return f.read().count(b'\n')
  except FileNotFoundError:
    return 0


@pytest.mark.slow
def test_sigkill_mid_run_then_resume(tmp_path):
  output_dir = tmp_path / 'out'
  predictions = output_dir / outputs.PREDICTIONS
  env = _env(tmp_path / 'jax_cache')
  proc = subprocess.Popen(_command(output_dir), cwd=tmp_path, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.monotonic() + 240
  try:
    while _num_lines(predictions) < 3:
      assert proc.poll() is None, 'the job ended before it could be killed: ' + (
          proc.stderr.read().decode()[-2000:])
      assert time.monotonic() < deadline, 'the job produced no predictions in time'
      time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # a real kill: no cleanup, no flushing
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == -signal.SIGKILL
  killed_at = _num_lines(predictions)
  assert 3 <= killed_at < NUM_EXAMPLES, killed_at
  assert not (output_dir / outputs.METRICS).exists()

  resumed = subprocess.run(_command(output_dir), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert 'Resuming' in resumed.stderr

  records = outputs.read_predictions(str(predictions))
  indices = [r['index'] for r in records]
  assert sorted(indices) == list(range(NUM_EXAMPLES))  # every example exactly once
  assert len({r['id'] for r in records}) == NUM_EXAMPLES
  assert all(r['identical'] for r in records)
  metrics = json.loads((output_dir / outputs.METRICS).read_text())
  assert metrics['num_examples'] == NUM_EXAMPLES
  assert metrics['job']['resumed_from'] >= 3
  assert metrics['job']['decoded_this_run'] == NUM_EXAMPLES - metrics['job']['resumed_from']

  # Running the finished job again decodes nothing and changes nothing.
  again = subprocess.run(_command(output_dir), cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert outputs.read_predictions(str(predictions)) == records
