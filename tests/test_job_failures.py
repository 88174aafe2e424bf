"""A job never mixes, loses or silently corrupts results; each bad input or fault is one line.

Every case asserts the exit status (or the error the command turns into one), that the message
names what to change on one short line, and that outputs already in the directory are
untouched. The fault-injection test kills a job at seeded random points and checks the resumed
result equals an uninterrupted run.
"""

import io
import json
import os
import random
import signal
import subprocess
import sys
import time

import gin
import jax
import numpy as np
import pytest

from speclm import outputs
from speclm import protocol
from speclm import run
from speclm.models import llama

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ('--gin_file=test_tiny.gin', '--gin.run_job.show_progress=False',
        '--gin.run_job.measure_cost=False')


def _env(tmp_path=None):
  env = dict(os.environ)
  env['PYTHONPATH'] = os.pathsep.join(
      [REPO] + ([str(tmp_path)] if tmp_path else []) + [env.get('PYTHONPATH', '')])
  env.setdefault('JAX_PLATFORMS', 'cpu')
  # Compiled programs shared by the runs: the session's cache (tests/conftest.py), else one
  # for the runs of this test.
  if tmp_path is not None and not env.get('JAX_COMPILATION_CACHE_DIR'):
    env['JAX_COMPILATION_CACHE_DIR'] = str(tmp_path / 'jax_cache')
    env['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
    env['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'
  return env


def cli(tmp_path, output_dir, *args, timeout=300):
  """Runs `python -m speclm.run` on the tiny job; returns the completed process."""
  return subprocess.run(
      [sys.executable, '-m', 'speclm.run', *TINY, f"--gin.OUTPUT_DIR='{output_dir}'", *args],
      cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)


def error_line(proc) -> str:
  """The command's one error line (asserting there is exactly one and no traceback)."""
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  lines = [line for line in proc.stderr.splitlines() if line.startswith('speclm.run:')]
  assert len(lines) == 1, proc.stderr[-3000:]
  return lines[0]


def snapshot(directory) -> dict[str, tuple[bytes, int]]:
  """Every file's bytes and modification time (ns): an unchanged directory compares equal."""
  result = {}
  for name in sorted(os.listdir(directory)):
    path = os.path.join(directory, name)
    if os.path.isfile(path) and name != outputs.LOCK:  # the lock is not an output
      with open(path, 'rb') as f:
        result[name] = (f.read(), os.stat(path).st_mtime_ns)
  return result


def run_tiny(output_dir, *bindings, gin_files=('test_tiny.gin',)):
  gin.clear_config()
  try:
    run.parse_gin(gin_files, [f"OUTPUT_DIR = '{output_dir}'", 'run_job.measure_cost = False',
                              *bindings])
    return run.run_job(progress_stream=io.StringIO())  # pylint: disable=missing-kwoa
  finally:
    gin.clear_config()


@pytest.fixture(scope='module')
def finished_job(tmp_path_factory):
  """A finished tiny compare job (γ=3, T=0, 12 tokens), through the command line."""
  tmp_path = tmp_path_factory.mktemp('finished')
  proc = cli(tmp_path, tmp_path / 'out')
  assert proc.returncode == 0, proc.stderr[-3000:]
  return tmp_path, tmp_path / 'out'


# ----------------------------------------------------------------------------------------------
# 1-2. A resume with other settings is refused, before anything in the directory changes.


def test_resume_with_other_settings_is_refused_and_changes_nothing(finished_job):
  tmp_path, out = finished_job
  before = snapshot(out)
  proc = cli(tmp_path, out, '--gin.GAMMA=2', '--gin.TEMPERATURE=1.0', '--gin.MAX_NEW_TOKENS=4')
  assert proc.returncode == 2
  line = error_line(proc)
  for change in ('settings.gamma: 3 -> 2', 'settings.temperature: 0.0 -> 1.0',
                 'settings.max_new_tokens: 12 -> 4'):
    assert change in line
  assert '--gin.OUTPUT_DIR' in line and '--gin.run_job.overwrite=True' in line
  assert snapshot(out) == before  # config.gin included: nothing written before acceptance


@pytest.mark.parametrize('binding, changed', [
    ('target/random_llama.num_layers = 3', 'gin.target/random_llama.num_layers: 2 -> 3'),
    ('synthetic_dataset.seed = 1', 'dataset.hash'),
    ("run_job.on_too_long = 'skip'", 'settings.on_too_long'),
    ('draft/random_llama.seed = 5', 'gin.draft/random_llama.seed: unset -> 5'),
])
def test_every_output_setting_is_in_the_fingerprint(tmp_path, binding, changed):
  run_tiny(tmp_path, 'synthetic_dataset.num_examples = 4')
  before = snapshot(tmp_path)
  with pytest.raises(run.JobError, match='holds outputs of a different job') as info:
    run_tiny(tmp_path, 'synthetic_dataset.num_examples = 4', binding)
  assert changed in info.value.message and '\n' not in info.value.message
  assert snapshot(tmp_path) == before


def test_model_entry_sees_other_weights_of_the_same_shapes():
  from speclm.run import fingerprint  # pylint: disable=g-import-not-at-top
  first, again, other = run.random_llama(seed=0), run.random_llama(seed=0), run.random_llama(seed=1)
  assert fingerprint.model_entry(first) == fingerprint.model_entry(again)
  assert fingerprint.model_entry(first) != fingerprint.model_entry(other)
  assert fingerprint.model_entry(first).startswith('Llama, 26880 parameters, ')


def test_settings_that_change_no_output_resume(tmp_path):
  run_tiny(tmp_path, 'synthetic_dataset.num_examples = 4')
  metrics = run_tiny(tmp_path, 'synthetic_dataset.num_examples = 4',
                     'run_job.show_progress = False', "run_job.reference_metrics = []")
  assert metrics['job']['resumed_from'] == 4 and metrics['job']['decoded_this_run'] == 0


def test_a_changed_checkpoint_file_is_noticed(tmp_path):
  from speclm.models import ngram  # pylint: disable=g-import-not-at-top
  path = str(tmp_path / 'unigram.npz')
  ngram.save(path, ngram.estimate_unigram([[1, 2, 3]], 259))
  bindings = ('DRAFT = @ngram_draft', f"ngram_draft.path = '{path}'",
              'synthetic_dataset.num_examples = 2')
  out = tmp_path / 'out'
  run_tiny(out, *bindings)
  ngram.save(path, ngram.estimate_unigram([[1, 2, 3, 3]], 259))
  os.utime(path, ns=(time.time_ns() + 10**9,) * 2)  # a later modification time, for sure
  with pytest.raises(run.JobError, match=f'file {path}'):
    run_tiny(out, *bindings)


def test_overwrite_discards_the_old_outputs(tmp_path):
  run_tiny(tmp_path, 'synthetic_dataset.num_examples = 4')
  metrics = run_tiny(tmp_path, 'synthetic_dataset.num_examples = 4', 'GAMMA = 2',
                     'run_job.overwrite = True')
  assert metrics['gamma'] == 2 and metrics['job']['resumed_from'] == 0
  assert len(outputs.read_predictions(str(tmp_path / outputs.PREDICTIONS))) == 4
  assert json.loads((tmp_path / outputs.JOB).read_text())['settings.gamma'] == 2


def test_a_refused_directory_of_an_older_job_format(tmp_path):
  (tmp_path / outputs.JOB).write_text(json.dumps({'mode': 'compare', 'dataset': 'x',
                                                  'num_examples': 12}))
  (tmp_path / outputs.PREDICTIONS).write_text('{"index": 0}\n')
  before = snapshot(tmp_path)
  with pytest.raises(run.JobError, match='written by an earlier speclm'):
    run_tiny(tmp_path)
  assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------------------------
# 3. A misspelled macro stops the job with the nearest known name.


def test_misspelled_macro_on_the_command_line(tmp_path):
  out = tmp_path / 'out'
  proc = cli(tmp_path, out, '--gin.GAMA=5')
  assert proc.returncode == 2
  assert error_line(proc) == ('speclm.run: error: --gin.GAMA sets a macro that no configuration'
                              ' uses. Did you mean GAMMA?')
  assert not out.exists()


def test_unused_macro_in_a_file_is_a_warning(tmp_path, capsys):
  (tmp_path / 'extra.gin').write_text("include 'test_tiny.gin'\nGAMMAA = 4\n")
  gin.clear_config()
  try:
    run.parse_gin([str(tmp_path / 'extra.gin')], ["OUTPUT_DIR = '/unused'"])
  finally:
    gin.clear_config()
  assert ('speclm.run: warning: the gin macro GAMMAA is set but no configuration uses it. Did'
          ' you mean GAMMA?') in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# 4. Non-finite logits: no token from them, counted, warned about, and a failing exit status.


@gin.configurable
def nan_row_llama(seed: int = 0) -> protocol.Model:
  """A tiny Llama whose logits are NaN wherever the input holds token 120 ('x')."""
  model = llama.random_model(vocab_size=259, embed_dim=32, num_layers=2, seed=seed,
                             tie_embeddings=False)  # the NaN row is an input, never an output
  params = jax.tree.map(lambda x: x, model.params)
  embedding = params['embedder']['embedding']
  params['embedder']['embedding'] = embedding.at[ord('x') + 3].set(np.nan)  # bytes from 3
  return protocol.Model(model.definition, params)


def _nan_dataset_file(tmp_path):
  path = tmp_path / 'inputs.txt'
  path.write_text('the cat sat\nan x marks the spot\nbirds sang\n')
  return path


def _nan_bindings(tmp_path):
  return ('TARGET = @nan_row_llama', 'DATASET = @file_dataset',
          f"file_dataset.path = '{_nan_dataset_file(tmp_path)}'")


def test_bad_logits_rows_fail_the_job_after_writing_everything(tmp_path):
  out = tmp_path / 'out'
  with pytest.raises(run.BadLogitsError) as info:
    run_tiny(out, *_nan_bindings(tmp_path))
  assert info.value.message.startswith('1 of 3 examples stopped on non-finite (NaN/inf) logits')
  assert "run_job.on_bad_logits = 'warn'" in info.value.message
  metrics = json.loads((out / outputs.METRICS).read_text())
  assert metrics['num_bad_logits'] == 1
  records = {r['id']: r for r in outputs.read_predictions(str(out / outputs.PREDICTIONS))}
  bad = records['2']  # text files number examples by line
  for method in ('baseline', 'speculative'):
    assert bad[method]['stop_reason'] == 'BAD_LOGITS'
    assert bad[method]['num_tokens'] == 0  # no token drawn from NaN logits is kept
    assert records['1'][method]['stop_reason'] != 'BAD_LOGITS'
  assert 'WARNING' in run.summary(metrics)


def test_bad_logits_can_be_made_a_warning(tmp_path, capsys):
  metrics = run_tiny(tmp_path / 'out', *_nan_bindings(tmp_path), "run_job.on_bad_logits = 'warn'")
  assert metrics['num_bad_logits'] == 1
  assert 'speclm.run: warning: 1 of 3 examples stopped on non-finite' in capsys.readouterr().err


def test_bad_logits_exit_status(tmp_path):
  module = tmp_path / 'nan_provider.py'
  module.write_text('import gin\nimport jax\nimport numpy as np\n'
                    'from speclm.models import llama\n\n'
                    '@gin.configurable\ndef nan_llama():\n'
                    '  m = llama.random_model(vocab_size=259, embed_dim=32, num_layers=2)\n'
                    '  return m.replace(params=jax.tree.map(lambda x: x * np.nan, m.params))\n')
  (tmp_path / 'nan.gin').write_text("import nan_provider\ninclude 'test_tiny.gin'\n"
                                    'TARGET = @nan_llama\nsynthetic_dataset.num_examples = 2\n')
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=nan.gin', '--gin.run_job.show_progress=False',
       '--gin.run_job.measure_cost=False', f"--gin.OUTPUT_DIR='{tmp_path / 'out'}'"],
      cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert error_line(proc).startswith('speclm.run: error: 2 of 2 examples stopped on non-finite')
  assert 'WARNING' in proc.stdout and 'BAD_LOGITS' in proc.stdout
  assert (tmp_path / 'out' / outputs.METRICS).exists()


def test_a_nan_in_a_t5x_checkpoint_stops_the_job_naming_the_array(tmp_path):
  # The case: one NaN zarr chunk in a T5X checkpoint. The loader refuses it, naming
  # the array, before anything is decoded or written.
  import gzip  # pylint: disable=g-import-not-at-top
  from speclm.checkpoints import t5x  # pylint: disable=g-import-not-at-top
  from speclm.models import t5  # pylint: disable=g-import-not-at-top
  config = t5.T5Config(vocab_size=32128, emb_dim=8, num_heads=4, num_encoder_layers=2,
                       num_decoder_layers=2, head_dim=3, mlp_dim=16)
  params = t5.T5(config).init_params(jax.random.key(0))
  t5x.save_t5x_checkpoint(str(tmp_path / 'target'), params, zarr_min_bytes=256)
  chunk = tmp_path / 'target' / 'target.decoder.layers_0.mlp.wi_0.kernel' / '0.0'
  values = np.frombuffer(gzip.decompress(chunk.read_bytes()), '<f4').copy()
  values[5] = np.nan
  chunk.write_bytes(gzip.compress(values.tobytes()))
  bindings = ["include 'models/t5_1_1/tiny.gin'", 'TARGET = @target/t5_checkpoint_model',
              'target/t5_checkpoint_model.config = %T5_1_1_TINY',
              f"target/t5_checkpoint_model.checkpoint_path = '{tmp_path / 'target'}'",
              "run_job.mode = 'baseline'", 'synthetic_dataset.num_examples = 2']
  out = tmp_path / 'out'
  with pytest.raises(run.JobError) as info:
    run_tiny(out, *bindings)
  assert ("target parameter 'decoder/layers_0/mlp/wi_0/kernel' in"
          in info.value.message)
  assert 'has 1 NaN/Inf values (of 128); the checkpoint is corrupt.' in info.value.message
  assert not (out / outputs.PREDICTIONS).exists() and not (out / outputs.CONFIG).exists()


# ----------------------------------------------------------------------------------------------
# 8. A local gin file that shadows a repository one is named.


def test_a_local_file_shadowing_a_repository_config_is_named(tmp_path, monkeypatch, capsys):
  (tmp_path / 'runs').mkdir()
  with open(os.path.join(run.CONFIGS_DIR, 'runs', 'compare.gin'), encoding='utf-8') as f:
    (tmp_path / 'runs' / 'compare.gin').write_text(f.read())
  monkeypatch.chdir(tmp_path)
  gin.clear_config()
  try:
    run.parse_gin(['test_tiny.gin'], ["OUTPUT_DIR = '/unused'"])
  finally:
    gin.clear_config()
  err = capsys.readouterr().err
  assert (f"speclm.run: warning: {tmp_path / 'runs' / 'compare.gin'} shadows the repository's"
          " configs/runs/compare.gin") in err
  assert err.count('warning') == 1  # speculative.gin, included from it, is not shadowed


# ----------------------------------------------------------------------------------------------
# 9. A prompt longer than the model's context.


def test_inputs_are_held_to_the_context_less_the_new_tokens(tmp_path):
  if 'max_position_embeddings' not in llama.LlamaConfig.__dataclass_fields__:
    pytest.fail('llama.LlamaConfig has no max_position_embeddings field')
  bindings = ('target/random_llama.max_position_embeddings = 40', 'MAX_NEW_TOKENS = 12',
              'synthetic_dataset.min_words = 10', 'synthetic_dataset.max_words = 12',
              'synthetic_dataset.num_examples = 4')
  metrics = run_tiny(tmp_path / 'truncate', *bindings)
  assert metrics['job']['input_limit'] == 28 and metrics['num_truncated'] == 4
  records = outputs.read_predictions(str(tmp_path / 'truncate' / outputs.PREDICTIONS))
  assert all(r['input_tokens'] == 28 for r in records)
  with pytest.raises(run.JobError, match=r"longer than max_input_length=28") as info:
    run_tiny(tmp_path / 'error', *bindings, "run_job.on_too_long = 'error'")
  assert '\n' not in info.value.message
  with pytest.raises(run.JobError, match='leaves no room for an input'):
    run_tiny(tmp_path / 'none', *bindings, 'MAX_NEW_TOKENS = 40')


# ----------------------------------------------------------------------------------------------
# 10. Non-UTF-8 input, Ctrl-C, an output path that is a file, a missing checkpoint, permissions.


def test_non_utf8_input_names_the_file_and_line(tmp_path):
  path = tmp_path / 'inputs.txt'
  path.write_bytes(b'fine\nalso fine\nbad \xff byte\n')
  with pytest.raises(run.JobError) as info:
    run_tiny(tmp_path / 'out', 'DATASET = @file_dataset', f"file_dataset.path = '{path}'")
  assert f'{path}:3 is not UTF-8 (byte 0xff at column 5)' in info.value.message


def test_output_dir_that_is_a_file(tmp_path):
  blocker = tmp_path / 'taken'
  blocker.write_text('keep me')
  proc = cli(tmp_path, blocker)
  assert proc.returncode == 2
  assert 'exists and is not a directory' in error_line(proc)
  assert blocker.read_text() == 'keep me'


def test_missing_checkpoint_is_reported_before_the_vocabulary(tmp_path):
  # ende_small.gin as a user runs it: its SentencePiece vocabulary (on GCS) is built by gin when
  # the job starts, so the checkpoints are checked first.
  out = tmp_path / 'out'
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=ende_small.gin',
       "--gin.TARGET_CHECKPOINT='/nonexistent/t5_xxl'",
       "--gin.DRAFT_CHECKPOINT='/nonexistent/t5_small'", f"--gin.OUTPUT_DIR='{out}'"],
      cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert error_line(proc).startswith(
      'speclm.run: error: The target checkpoint (t5_checkpoint_model.checkpoint_path) path'
      ' /nonexistent/t5_xxl does not exist')
  assert not out.exists()


def test_every_output_file_gets_the_same_permissions(finished_job):
  _, out = finished_job
  modes = {name: os.stat(out / name).st_mode & 0o777
           for name in (outputs.PREDICTIONS, outputs.METRICS, outputs.CONFIG, outputs.JOB,
                        outputs.OPERATIVE_CONFIG)}
  assert len(set(modes.values())) == 1, modes
  assert modes[outputs.PREDICTIONS] & 0o044  # readable by others, like any file `open` makes


def _lines(path):
  try:
    with open(path, 'rb') as f:
      return f.read().count(b'\n')
  except FileNotFoundError:
    return 0


def test_ctrl_c_exits_130_with_one_line(tmp_path):
  out = tmp_path / 'out'
  # The job must start with Ctrl-C's default action even where this test runs in the
  # background of a shell, which starts it with SIGINT ignored (inherited across exec): a
  # handled signal is reset to the default in the child.
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    proc = subprocess.Popen(
        [sys.executable, '-m', 'speclm.run', *TINY, f"--gin.OUTPUT_DIR='{out}'",
         '--gin.synthetic_dataset.num_examples=400', '--gin.BATCH_SIZE=1'],
        cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
  finally:
    if previous is not None:
      signal.signal(signal.SIGINT, previous)
  deadline = time.monotonic() + 240
  while _lines(out / outputs.PREDICTIONS) < 2 and time.monotonic() < deadline:
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    time.sleep(0.01)
  proc.send_signal(signal.SIGINT)
  _, stderr = proc.communicate(timeout=120)
  assert proc.returncode == 130, stderr[-3000:]
  lines = [line for line in stderr.splitlines() if line.startswith('speclm.run:')]
  assert 'Traceback' not in stderr and len(lines) == 1
  recorded = _lines(out / outputs.PREDICTIONS)
  assert lines[0].startswith('speclm.run: interrupted after ')
  assert f'({recorded} of 400 recorded in {out}); rerun the same command to resume.' in lines[0]


# ----------------------------------------------------------------------------------------------
# Fault injection: SIGKILL at seeded random points (appends, atomic writes, metrics.json
# included), resume each time; the result equals an uninterrupted run.

_KILLER = r'''
import os, signal, sys
from speclm import outputs
from speclm.run import cli
kill_at = int(os.environ.get('KILL_AT', '0'))  # the Nth write event, or
kill_on = os.environ.get('KILL_ON', '')  # the write of a file with this name
events = [0]

def tick(before_kill=None, name=''):
  events[0] += 1
  if events[0] == kill_at or (kill_on and name == kill_on):
    if before_kill:
      before_kill()
    os.kill(os.getpid(), signal.SIGKILL)

append, write_atomic = outputs.OutputDir.append, outputs.write_atomic

def killing_append(self, records):
  records = list(records)
  def torn():  # half a batch's bytes reach the file, then the process dies
    data = ''.join(__import__('json').dumps(r) + '\n' for r in records).encode()
    os.write(self._pred_fd, data[:len(data) // 2])
  tick(torn)
  append(self, records)

def killing_write_atomic(path, text):
  def half_written():  # the temporary file exists, the rename has not happened
    with open(path + '.tmp-killed', 'w') as f:
      f.write(text[:len(text) // 2])
  tick(half_written, os.path.basename(path))
  write_atomic(path, text)
  tick()

outputs.OutputDir.append = killing_append
outputs.write_atomic = killing_write_atomic
sys.argv = ['speclm.run'] + sys.argv[1:]
cli.run_main()
'''


@pytest.mark.slow
def test_killed_at_random_points_then_resumed_equals_an_uninterrupted_run(tmp_path):
  num_examples = 10
  args = [*TINY, f'--gin.synthetic_dataset.num_examples={num_examples}', '--gin.BATCH_SIZE=2',
          '--gin.MAX_NEW_TOKENS=8', '--gin.TEMPERATURE=1.0']
  (tmp_path / 'killer.py').write_text(_KILLER)

  def job(output_dir, **kill):
    env = dict(_env(tmp_path), **{k.upper(): str(v) for k, v in kill.items()})
    return subprocess.run([sys.executable, str(tmp_path / 'killer.py'), *args,
                           f"--gin.OUTPUT_DIR='{output_dir}'"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)

  def killed(proc):
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]

  reference = job(tmp_path / 'reference')
  assert reference.returncode == 0, reference.stderr[-3000:]
  # A run writes: job.json (first run only), config.gin, one append per batch (5), metrics.json
  # and operative_config.gin; each atomic write is two events (before and after the rename),
  # an append one (killed half-way through its bytes). Every run has at least 6 events.
  out = tmp_path / 'killed'
  rng = random.Random(2026)
  kill_points = [rng.randint(1, 6) for _ in range(5)]
  for kill_at in kill_points:
    killed(job(out, kill_at=kill_at))
  killed(job(out, kill_on=outputs.METRICS))  # while metrics.json is written
  if (out / outputs.METRICS).exists():  # an earlier run's, whole: writes are atomic
    json.loads((out / outputs.METRICS).read_text())
  proc = job(out)
  assert proc.returncode == 0, proc.stderr[-3000:]

  expected = {r['index']: r for r in outputs.read_predictions(
      str(tmp_path / 'reference' / outputs.PREDICTIONS))}
  records = outputs.read_predictions(str(out / outputs.PREDICTIONS))
  assert sorted(r['index'] for r in records) == list(range(num_examples))  # each exactly once
  for record in records:
    for method in ('baseline', 'speculative'):
      assert record[method]['tokens'] == expected[record['index']][method]['tokens']
  metrics = json.loads((out / outputs.METRICS).read_text())
  assert metrics['num_examples'] == metrics['num_decoded'] == num_examples
  assert (metrics['job']['resumed_from'] + metrics['job']['decoded_this_run']) == num_examples
  reference_metrics = json.loads((tmp_path / 'reference' / outputs.METRICS).read_text())
  assert metrics['alpha'] == pytest.approx(reference_metrics['alpha'])
  assert metrics['baseline']['tokens'] == reference_metrics['baseline']['tokens']
