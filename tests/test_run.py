"""The gin-configured job (speclm.run) on tiny random models: modes, metrics, CLI, errors."""

import io
import json
import os
import subprocess
import sys
import time

import gin
import jax
import pytest

from speclm import outputs
from speclm import run
from speclm import sampling
from speclm.checkpoints import t5x
from speclm.models import t5
from speclm.testing import scripts

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
  metrics = run_tiny(tmp_path, 'run_job.measure_cost = False')  # c: see the Table 2 test
  records = outputs.read_predictions(str(tmp_path / 'predictions.jsonl'))
  assert sorted(r['index'] for r in records) == list(range(12))
  # Rows decoded together share a batch key: the index of the batch's first example.
  members = {}
  for r in records:
    members.setdefault(r['batch'], []).append(r['index'])
  assert all(key in rows and len(rows) <= 4 for key, rows in members.items())  # BATCH_SIZE 4
  assert len(members) >= 3
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
  # Identical outputs, the same tokens: the ratio of rates is the ratio of decode times.
  assert metrics['speedup'] == pytest.approx(metrics['baseline']['decode_time_s']
                                             / metrics['speculative']['decode_time_s'])
  assert metrics['time_ratio'] == pytest.approx(metrics['speedup'])
  assert metrics['c'] is None and metrics['predicted_speedup_theorem_3_8'] is None
  assert any('c was not measured' in note for note in metrics['notes'])
  assert 'bleu' in metrics['speculative'] and 'rougeLsum' in metrics['baseline']
  assert metrics['baseline']['tokens_per_target_call'] == 1.0
  on_disk = json.loads((tmp_path / 'metrics.json').read_text())
  assert on_disk['alpha'] == pytest.approx(metrics['alpha'])
  config = (tmp_path / 'config.gin').read_text()
  # (gin breaks a binding longer than 80 characters after its '=')
  assert 'OUTPUT_DIR =' in config and f"'{tmp_path}'" in config and 'run_job.mode' in config
  assert 'random_llama.num_layers' in (tmp_path / 'operative_config.gin').read_text()


def test_compare_job_with_a_token_tree(tmp_path):
  metrics = run_tiny(tmp_path, 'run_job.tree = @token_tree', 'token_tree.branching = [2, 1]',
                     'synthetic_dataset.num_examples = 8')
  records = outputs.read_predictions(str(tmp_path / 'predictions.jsonl'))
  assert all(r['identical'] for r in records) and metrics['identical_output_rate'] == 1.0
  assert metrics['tree'] == 'tree of 4 nodes, depth 2, candidates top_k'
  assert metrics['gamma'] == metrics['tree'] and metrics['tree_nodes'] == 4
  assert len(metrics['rank_acceptance']) == 2 and metrics['rank_offered'][0] > 0
  assert metrics['predicted_tokens_per_call_tree'] >= 1.0
  assert metrics['c'] > 0 and metrics['predicted_speedup_tree'] > 0  # r for the tree's rows
  fingerprint = json.loads((tmp_path / 'job.json').read_text())
  assert 'settings.tree' in fingerprint and 'gin.token_tree.branching' in fingerprint
  # A tree and adaptive γ exclude each other.
  with pytest.raises(run.JobError, match='exclude each other'):
    run_tiny(tmp_path / 'b', 'run_job.tree = @token_tree', 'token_tree.branching = [2]',
             "GAMMA = 'adaptive'")
  with pytest.raises(run.JobError, match='exactly one of paths'):
    run_tiny(tmp_path / 'c', 'run_job.tree = @token_tree')


def test_compare_job_with_a_tree_policy(tmp_path):
  """`run_job.tree = @tree_policy()`: the job times the chain and the trees on whole batches of
  its own shape (here the second of two: the middle of its list), records the table and
  decodes with the choice; a resume reuses the choice; bad settings are JobErrors."""
  policy = ('run_job.tree = @tree_policy()',
            "tree_policy.candidates = {'paths3': [[0], [1], [0, 0]]}",
            'tree_policy.calibration_rows = 4', 'tree_policy.calibration_tokens = 12',
            'tree_policy.repeats = 1', 'synthetic_dataset.num_examples = 8',
            'run_job.measure_cost = False')
  metrics = run_tiny(tmp_path, *policy)
  entry = metrics['tree_policy']
  assert [row['name'] for row in entry['candidates']] == ['baseline', 'chain', 'paths3']
  timed = entry['candidates'][1:]
  assert entry['chosen'] == min(timed, key=lambda row: row['seconds_per_token'])['name']
  assert all(row['identical_to_baseline'] and row['seconds'][0] > 0 for row in timed)
  assert entry['calibration']['rows'] == 4 and entry['calibration']['batches'] == 1
  assert len(entry['calibration']['prompt_lengths']) == 4
  records = outputs.read_predictions(str(tmp_path / 'predictions.jsonl'))
  assert all(r['identical'] for r in records) and metrics['identical_output_rate'] == 1.0
  if entry['chosen'] == 'paths3':
    assert metrics['tree'] == 'tree of 3 nodes, depth 2, candidates top_k'
  else:
    assert metrics['gamma'] == 3 and 'tree' not in metrics
  on_disk = json.loads((tmp_path / 'metrics.json').read_text())
  assert on_disk['tree_policy']['chosen'] == entry['chosen']
  assert json.loads((tmp_path / 'tree_policy.json').read_text()) == on_disk['tree_policy']
  fingerprint = json.loads((tmp_path / 'job.json').read_text())
  assert 'TreePolicy(' in fingerprint['settings.tree_policy']
  # Resumed with nothing left to decode: no calibration, the recorded choice is reported.
  again = run_tiny(tmp_path, *policy)
  assert again['tree_policy'] == entry
  # Resumed with a batch to redo: decoded with the recorded choice (same timings: no
  # second calibration).
  lines = (tmp_path / 'predictions.jsonl').read_text().splitlines(keepends=True)
  (tmp_path / 'predictions.jsonl').write_text(''.join(lines[:4]))
  again = run_tiny(tmp_path, *policy)
  assert again['tree_policy'] == entry and again['job']['decoded_this_run'] == 4
  assert again['identical_output_rate'] == 1.0
  # A different policy is a different job.
  with pytest.raises(run.JobError, match='settings.tree_policy'):
    run_tiny(tmp_path, *policy, 'tree_policy.repeats = 2')
  for binding, message in [('tree_policy.calibration_rows = 0', 'calibration_rows must be'),
                           ('tree_policy.candidates = {}', 'non-empty mapping'),
                           ("tree_policy.candidates = {'x': 3}", r"candidates\['x'\]"),
                           ("GAMMA = 'adaptive'", 'exclude each other')]:
    with pytest.raises(run.JobError, match=message):
      run_tiny(tmp_path / 'bad', 'run_job.tree = @tree_policy()', binding)


def test_a_tree_policy_that_allows_the_baseline_can_turn_speculation_off(tmp_path,
                                                                         monkeypatch):
  """`tree_policy.allow_baseline = True` with every speculative decode made slower (it
  sleeps): the job decodes its 'speculative' method without a draft, says so in metrics.json,
  and a resume keeps that choice."""
  from speclm import decoding  # pylint: disable=import-outside-toplevel
  real = decoding.speculative_decode

  def slow(*args, **kwargs):
    result = real(*args, **kwargs)
    time.sleep(0.2)
    return result

  monkeypatch.setattr(decoding, 'speculative_decode', slow)
  policy = ('run_job.tree = @tree_policy()', 'tree_policy.candidates = {"mine": None}', 'tree_policy.allow_baseline = True',
            'tree_policy.calibration_rows = 4', 'tree_policy.calibration_tokens = 12',
            'tree_policy.repeats = 1', 'synthetic_dataset.num_examples = 4',
            'run_job.measure_cost = False')  # the job's own batch shape: one compilation
  metrics = run_tiny(tmp_path, *policy)
  assert metrics['tree_policy']['chosen'] == 'baseline'
  assert metrics['speculation'].startswith('off')
  records = outputs.read_predictions(str(tmp_path / 'predictions.jsonl'))
  assert all(r['speculative']['accepted'] == 0 and r['identical'] for r in records)
  lines = (tmp_path / 'predictions.jsonl').read_text().splitlines(keepends=True)
  (tmp_path / 'predictions.jsonl').write_text(''.join(lines[:2]))
  again = run_tiny(tmp_path, *policy)
  assert again['tree_policy'] == metrics['tree_policy'] and again['speculation'] == (
      metrics['speculation'])
  with pytest.raises(run.JobError, match='allow_baseline must be True or False'):
    run_tiny(tmp_path / 'bad', 'run_job.tree = @tree_policy()',
             "tree_policy.allow_baseline = 'yes'")


def test_per_batch_prediction_follows_each_batchs_slowest_row():
  from speclm.analysis import theory  # pylint: disable=import-outside-toplevel
  def record(batch, num_tokens, beta_sum, beta_count):
    return {'batch': batch, 'speculative': {
        'output': '', 'num_tokens': num_tokens, 'target_calls': 1, 'time_s': 1.0,
        'stop_reason': 'MAX_NEW_TOKENS', 'accepted': 0, 'beta_sum': beta_sum,
        'beta_count': beta_count}}
  records = [record(0, 11, 3.0, 6), record(0, 6, 0.0, 0), record(4, 8, 4.5, 5)]
  cost = {'c': 0.05, 'r': 1.1}
  metrics = run.compute_metrics(records, mode='speculative', gamma=3,
                                sampling=sampling.GREEDY, cost=cost,
                                reference_metrics=())
  # The rounds make each row's tokens after its first; batch 0 waits for its 10-token row.
  iterations = (theory.expected_batch_iterations([0.5, 0.0], 3, [10, 5])
                + theory.expected_batch_iterations([0.9], 3, [7]))
  assert metrics['predicted_speedup_per_batch'] == pytest.approx(
      (10 + 7) / (iterations * (3 * 0.05 + 1.1)))
  assert 'row by row, per batch' in run.summary(metrics)
  # Records from before the batch key: no such prediction, and no error.
  del records[0]['batch']
  assert run.compute_metrics(records, mode='speculative', gamma=3,
                             sampling=sampling.GREEDY, cost=cost,
                             reference_metrics=())['predicted_speedup_per_batch'] is None


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
                     'run_job.measure_cost = False')
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
  assert 'The target checkpoint (t5_checkpoint_model.checkpoint_path) path /nonexistent/t5_xxl' \
      ' does not exist' in message


def test_error_empty_dataset(tmp_path):
  message = _jobs_error(tmp_path, 'synthetic_dataset.num_examples = 0')
  assert 'The dataset is empty' in message


def test_error_unwritable_output_dir(tmp_path):
  blocker = tmp_path / 'file'
  blocker.write_text('')
  message = _jobs_error(blocker / 'out')
  assert 'Cannot create the output directory' in message
  assert 'exists and is not a directory' in _jobs_error(blocker)


def test_error_bad_settings(tmp_path):
  assert 'temperature must be a finite number >= 0' in _jobs_error(tmp_path, 'TEMPERATURE = -1.0')
  assert 'temperature must be a finite number >= 0' in _jobs_error(tmp_path,
                                                                   'TEMPERATURE = 1e999')  # inf
  assert 'integer >= 1' in _jobs_error(tmp_path, 'GAMMA = 0')
  assert "needs a draft model" in _jobs_error(tmp_path, 'DRAFT = None')


def test_cli_finds_gin_files_from_any_directory(tmp_path):
  # A bare file name resolves through configs/ from an unrelated working directory; the job
  # then stops at its first data check, before any model is built. (test_resume.py runs the
  # whole job through the command line.)
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin',
       f"--gin.OUTPUT_DIR='{tmp_path / 'out'}'", '--gin.synthetic_dataset.num_examples=0'],
      cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert 'The dataset is empty' in proc.stderr and 'Traceback' not in proc.stderr
  assert not (tmp_path / 'out' / 'config.gin').exists()  # nothing written to a refused job


def test_cli_error_is_one_paragraph_and_nonzero(tmp_path):
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin'],
      cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert 'Traceback' not in proc.stderr
  assert 'Required setting not provided: OUTPUT_DIR' in proc.stderr


def test_tpu_script_dry_run_prints_every_gcloud_command(tmp_path):
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'tpu', 'run_on_tpu.py'), '--name=vm1',
       '--zone=us-central2-b', '--gin_file=ende_small.gin',
       "--gin.TARGET_CHECKPOINT='gs://b/xxl'", '--dry-run'],
      cwd=tmp_path, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  commands = [line for line in proc.stdout.splitlines() if line.startswith('gcloud ')]
  verbs = [line.split()[4] for line in commands]
  assert verbs == ['create', 'scp', 'ssh', 'ssh', 'scp', 'delete']
  assert "--gin.TARGET_CHECKPOINT='gs://b/xxl'" in commands[3]
  assert '--gin_file=ende_small.gin' in commands[3]


def _tpu_dry_run(tmp_path, *args):
  proc = subprocess.run(
      [sys.executable, os.path.join(REPO, 'scripts', 'tpu', 'run_on_tpu.py'), '--name=vm1',
       '--zone=us-central2-b', *args, '--dry-run'],
      cwd=tmp_path, capture_output=True, text=True, timeout=60)
  commands = [line for line in proc.stdout.splitlines() if line.startswith('gcloud ')]
  return proc, dict(zip(['create', 'scp', 'install', 'run', 'copy back', 'delete'], commands))


@pytest.mark.parametrize('accelerator', ['v4-8', 'v5litepod-8', 'v5litepod-4', 'v5p-8', 'v3-8',
                                         'v2-8', 'v6e-8'])
def test_tpu_script_runs_on_worker_0_of_a_single_host_slice(tmp_path, accelerator):
  proc, steps = _tpu_dry_run(tmp_path, f'--accelerator_type={accelerator}',
                             '--gin_file=ende_small.gin')
  assert proc.returncode == 0, proc.stderr
  for step in ('scp', 'install', 'run', 'copy back'):
    assert '--worker=0' in steps[step].split() and '--worker=all' not in steps[step], step
  assert 'initialize_distributed' not in steps['run'] and 'MULTI_HOST' not in steps['run']


@pytest.mark.parametrize('gin_files,binding', [
    (['ende_small.gin'], '--gin.partitioning.initialize_distributed.enabled=True'),
    (['ende_small.gin', 'runs/sharded.gin'], '--gin.MULTI_HOST=True')])
def test_tpu_script_runs_on_every_worker_of_a_multi_host_slice(tmp_path, gin_files, binding):
  proc, steps = _tpu_dry_run(tmp_path, '--accelerator_type=v4-32',
                             *[f'--gin_file={f}' for f in gin_files])
  assert proc.returncode == 0, proc.stderr
  for step in ('scp', 'install', 'run'):  # every host gets the code and runs the program
    assert '--worker=all' in steps[step].split() and '--worker=0' not in steps[step], step
  assert binding in steps['run'] and 'python3 -m speclm.run' in steps['run']
  assert '--worker=0' in steps['copy back'].split()  # process 0 merged the results there
  assert '--recurse' in steps['copy back'].split()
  assert 'v4-32 has 4 hosts' in proc.stderr
  # The binding parses, and turns jax.distributed on, with these gin files.
  name, value = binding[len('--gin.'):].split('=', 1)
  gin.clear_config()
  try:
    run.parse_gin(gin_files, [f'{name} = {value}', "TARGET_CHECKPOINT = 'x'",
                              "DRAFT_CHECKPOINT = 'y'", "OUTPUT_DIR = '/tmp/x'"])
    enabled = gin.query_parameter('partitioning.initialize_distributed.enabled')
    if isinstance(enabled, gin.config.ConfigurableReference):  # %MULTI_HOST
      enabled = gin.query_parameter(repr(enabled))
    assert enabled is True
  finally:
    gin.clear_config()


def test_tpu_script_command_runs_on_every_worker_as_given(tmp_path):
  proc, steps = _tpu_dry_run(tmp_path, '--accelerator_type=v5litepod-16', '--command=echo hi')
  assert proc.returncode == 0, proc.stderr
  assert '--worker=all' in steps['run'].split()
  assert steps['run'].endswith('"--command=cd speclm && echo hi"')  # nothing added
  assert 'must enable multi-host itself' in proc.stderr


def test_tpu_hosts_per_accelerator_type():
  num_hosts = scripts.load_script(os.path.join(REPO, 'scripts', 'tpu', 'run_on_tpu.py')).num_hosts
  assert {t: num_hosts(t) for t in ['v2-8', 'v3-8', 'v3-32', 'v4-8', 'v4-16', 'v4-32', 'v5p-8',
                                     'v5p-16', 'v5litepod-1', 'v5litepod-4', 'v5litepod-8',
                                     'v5litepod-16', 'v5litepod-256', 'v6e-8', 'v6e-16']} == {
      'v2-8': 1, 'v3-8': 1, 'v3-32': 4, 'v4-8': 1, 'v4-16': 2, 'v4-32': 4, 'v5p-8': 1,
      'v5p-16': 2, 'v5litepod-1': 1, 'v5litepod-4': 1, 'v5litepod-8': 1, 'v5litepod-16': 4,
      'v5litepod-256': 64, 'v6e-8': 1, 'v6e-16': 4}
  with pytest.raises(ValueError, match='known generations are v2-N, v3-N, v4-N, v5p-N'):
    num_hosts('v7x-8')
  with pytest.raises(ValueError, match='multiple of 8'):
    num_hosts('v4-12')


def test_tpu_script_refuses_an_unknown_accelerator_type(tmp_path):
  proc, steps = _tpu_dry_run(tmp_path, '--accelerator_type=tpu-big', '--gin_file=a.gin')
  assert proc.returncode == 2 and not steps
  assert "Unknown TPU accelerator type 'tpu-big': known generations are" in proc.stderr


@pytest.mark.parametrize('cpu_kernels', [False, True])
def test_t5x_checkpoints_through_the_table2_seam(tmp_path, cpu_kernels):
  # The Table 2 files' path: T5 configs from configs/models, T5X checkpoints on disk,
  # t5_checkpoint_model as the provider (here tiny, random and byte-level).
  config = t5.T5Config(vocab_size=32128, emb_dim=8, num_heads=4, num_encoder_layers=2,
                       num_decoder_layers=2, head_dim=3, mlp_dim=16)
  definition = t5.T5(config)
  for name, seed in (('target', 0), ('draft', 1)):
    t5x.save_t5x_checkpoint(str(tmp_path / name), definition.init_params(jax.random.key(seed)))
  bindings = ["include 'models/t5_1_1/tiny.gin'"] + [
      f'{role}/t5_checkpoint_model.{key} = {value}'
      for role in ('target', 'draft')
      for key, value in (('config', '%T5_1_1_TINY'),
                         ('checkpoint_path', repr(str(tmp_path / role))))] + [
      'TARGET = @target/t5_checkpoint_model', 'DRAFT = @draft/t5_checkpoint_model',
      'synthetic_dataset.num_examples = 4', 'MAX_NEW_TOKENS = 6',
      'run_job.add_eos_to_inputs = True', 'run_job.measure_cost = False',
      'run_job.reference_metrics = []',
      f't5_checkpoint_model.cpu_kernels = {cpu_kernels}']
  metrics = run_tiny(tmp_path / 'out', *bindings)
  assert metrics['num_decoded'] == 4 and metrics['identical_output_rate'] == 1.0
  assert metrics['baseline']['tokens'] > 0
  # The provider's packing, as the job above used it (where the kernel can be built here).
  from speclm.kernels import cpu_matmul  # pylint: disable=g-import-not-at-top
  target = run.t5_checkpoint_model(config=config, checkpoint_path=str(tmp_path / 'target'),
                                   cpu_kernels=cpu_kernels)
  packed = 'packed' in target.params['decoder']['logits_dense']
  assert packed == (cpu_kernels and cpu_matmul.available())


def test_the_analysis_cli_reads_gin_flags_as_the_runner_does(capsys):
  from speclm.analysis import __main__ as analysis_cli  # pylint: disable=g-import-not-at-top
  # One implementation of --gin.NAME=VALUE: a flag without a value is an error in both.
  assert analysis_cli.main(['alpha', '--gin_file=test_tiny.gin', '--gin.GAMMA']) == 2
  assert '--gin.GAMMA has no value' in capsys.readouterr().err


def test_python_m_speclm_run_registers_each_gin_name_once(tmp_path):
  # A user's gin module may import speclm.run (e.g. to wrap random_llama) while the job runs as
  # `python -m speclm.run`: the package's names are registered once, not also under __main__.
  (tmp_path / 'my_models.py').write_text(
      'import gin\nfrom speclm import run\n\n'
      '@gin.configurable\ndef wide_llama():\n  return run.random_llama(embed_dim=48)\n')
  (tmp_path / 'mine.gin').write_text("import my_models\ninclude 'test_tiny.gin'\n"
                                     'TARGET = @wide_llama\nsynthetic_dataset.num_examples = 2\n'
                                     "run_job.mode = 'baseline'\n")
  env = subprocess_env()
  env['PYTHONPATH'] = str(tmp_path) + os.pathsep + env['PYTHONPATH']
  proc = subprocess.run(
      [sys.executable, '-m', 'speclm.run', '--gin_file=mine.gin', '--gin.run_job.show_progress=False',
       '--gin.run_job.measure_cost=False', f"--gin.OUTPUT_DIR='{tmp_path / 'out'}'"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads((tmp_path / 'out' / 'metrics.json').read_text())['num_decoded'] == 2
