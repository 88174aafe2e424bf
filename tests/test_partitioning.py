"""Sharding (speclm.partitioning): rules, logical axes, meshes 1x8 / 8x1 / 2x4, sharded reads.

Checks that need 8 devices run tests/multidevice_checks.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (JAX fixes its device count at start-up, and
the rest of the suite runs on one device). Mesh names are data x model.

Logit tolerance: 1e-5 absolute, in float32. Sharding a contraction over the 'model' axis
splits its sum into per-device partial sums added by an all-reduce, so the summation order
differs from one device; with |logits| < 5 and a few hundred terms per sum the difference
is a few float32 ulps (measured about 2e-6), far below anything that changes an argmax
unless two logits tie within 1e-5 — and the greedy tokens are compared exactly as well.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from speclm import partitioning
from speclm import trees
from speclm.models import llama
from speclm.models import t5

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGITS_ATOL = 1e-5
MESHES = ('1x8', '8x1', '2x4')


def _xla_flags(devices: int) -> str:
  """The session's XLA_FLAGS (tests/conftest.py) with `devices` host CPU devices."""
  return (os.environ.get('XLA_FLAGS', '')
          + f' --xla_force_host_platform_device_count={devices}').strip()


def run_checks(*checks, devices=8, timeout=900):
  env = dict(os.environ)
  env['XLA_FLAGS'] = _xla_flags(devices)
  env['JAX_PLATFORMS'] = 'cpu'
  env['PYTHONPATH'] = REPO + os.pathsep + env.get('PYTHONPATH', '')
  proc = subprocess.run([sys.executable, os.path.join(REPO, 'tests', 'multidevice_checks.py'),
                         *checks], env=env, capture_output=True, text=True, timeout=timeout,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = {}
  for line in proc.stdout.splitlines():
    if line.startswith('RESULT '):
      results.update(json.loads(line[len('RESULT '):]))
  return results


# ----------------------------------------------------------------------------------------------
# One device: rules and logical axes


def test_standard_rules_map_like_t5x():
  mesh = {'data': 2, 'model': 4}
  rules = partitioning.standard_logical_axis_rules()
  spec = partitioning.logical_to_spec
  assert spec(('batch', 'length'), (8, 5), rules, mesh) == jax.sharding.PartitionSpec('data')
  assert spec(('vocab', 'embed'), (64, 32), rules, mesh) == jax.sharding.PartitionSpec('model')
  assert spec(('embed', 'mlp'), (32, 64), rules, mesh) == jax.sharding.PartitionSpec(
      None, 'model')
  assert spec(('embed', 'joined_kv'), (32, 32), rules, mesh)[1] == 'model'
  assert spec(('heads', 'relpos_buckets'), (8, 32), rules, mesh) == jax.sharding.PartitionSpec(
      'model')
  for replicated in ('embed', 'kv', 'length', 'relpos_buckets', 'layers', 'unknown'):
    assert spec((replicated,), (8,), rules, mesh) == jax.sharding.PartitionSpec()
  # A dimension the mesh axis does not divide is replicated; one mesh axis per array.
  assert spec(('heads',), (6,), rules, mesh) == jax.sharding.PartitionSpec()
  assert spec(('vocab', 'mlp'), (64, 64), rules, mesh) == jax.sharding.PartitionSpec('model')


def test_rules_are_overridable():
  rules = partitioning.standard_logical_axis_rules(additional_rules=[('kv', 'model'),
                                                                    ('vocab', None)])
  mesh = {'data': 1, 'model': 4}
  assert partitioning.logical_to_spec(('vocab', 'embed'), (64, 8), rules, mesh) == (
      jax.sharding.PartitionSpec())
  assert partitioning.logical_to_spec(('embed', 'kv'), (8, 8), rules, mesh) == (
      jax.sharding.PartitionSpec(None, 'model'))
  with pytest.raises(ValueError, match='mesh axes are'):
    partitioning.standard_logical_axis_rules(additional_rules=[('kv', 'tensor')])


def test_mesh_shape_errors_are_clear():
  with pytest.raises(ValueError, match='does not divide'):
    partitioning.create_mesh(num_partitions=3, devices=jax.devices() * 2)
  with pytest.raises(ValueError, match='>= 1'):
    partitioning.create_mesh(num_partitions=0)
  mesh = partitioning.create_mesh(1)
  assert mesh.axis_names == ('data', 'model') and mesh.devices.size == jax.local_device_count()


@pytest.mark.parametrize('tie', [True, False])
def test_llama_logical_axes_cover_params_and_cache(tie):
  definition = llama.Llama(llama.LlamaConfig(vocab_size=32, num_layers=2, embed_dim=16,
                                             num_heads=4, num_kv_heads=2, head_dim=4,
                                             mlp_dim=32, tie_embeddings=tie))
  shapes = jax.eval_shape(definition.init_params, jax.random.key(0))
  axes = definition.param_logical_axes()
  flat_shapes, flat_axes = trees.flatten(shapes), trees.flatten(axes)
  assert set(flat_shapes) == set(flat_axes)
  for name, shape in flat_shapes.items():
    assert len(flat_axes[name]) == len(shape.shape), name
  cache = definition.init_cache(2, 8)
  cache_axes = definition.cache_logical_axes()
  jax.tree.map(lambda x, a: None if len(a) == x.ndim else pytest.fail(str(a)), cache,
               cache_axes)


def test_t5_cache_axes_and_param_axes_alias():
  definition = t5.T5(t5.tiny_config())
  assert definition.param_logical_axes() == definition.logical_axes()
  cache = definition.init_cache(2, 8, input_length=5)
  jax.tree.map(lambda x, a: None if len(a) == x.ndim else pytest.fail(str(a)), cache,
               definition.cache_logical_axes())


def test_one_device_partitioner_decodes_like_plain_jit():
  """The sharded path on a 1x1 mesh (the whole suite's device count) gives the same tokens."""
  from speclm import decoding  # pylint: disable=g-import-not-at-top
  target = llama.random_model(num_layers=2, seed=0)
  draft = llama.random_model(num_layers=1, seed=0)
  prompts = np.array([[5, 6, 7], [8, 9, 0]], np.int32)
  lengths = np.array([3, 2], np.int32)
  plain = decoding.speculative_decode(target, draft, prompts, lengths, gamma=2,
                                      max_new_tokens=6)
  partitioner = partitioning.Partitioner(num_partitions=1)
  sharded = decoding.speculative_decode(
      partitioner.shard_model(target), partitioner.shard_model(draft, 'draft'), prompts,
      lengths, gamma=2, max_new_tokens=6, partitioner=partitioner)
  assert sharded.to_lists() == plain.to_lists()
  base = decoding.autoregressive_decode(partitioner.shard_model(target), prompts, lengths,
                                        max_new_tokens=6, partitioner=partitioner)
  assert base.to_lists() == plain.to_lists()


# ----------------------------------------------------------------------------------------------
# Eight devices (subprocess)


@pytest.fixture(scope='module')
def eight_device_results():
  """Both 8-device checks, in one subprocess (one start-up, one JAX initialisation)."""
  return run_checks('decode', 'checkpoints')


@pytest.fixture(scope='module')
def decode_results(eight_device_results):
  return eight_device_results['decode']


@pytest.mark.slow
@pytest.mark.parametrize('kind,mesh', [(kind, mesh) for kind in ('llama', 't5')
                                       for mesh in MESHES] + [('gemma3', '2x4')])
def test_sharded_speculative_decoding_matches_one_device(decode_results, kind, mesh):
  entry = decode_results[kind]
  got = entry[mesh]
  data, model = (int(x) for x in mesh.split('x'))
  assert got['mesh'] == {'data': data, 'model': model}
  assert got['tokens'] == entry['reference_tokens']  # greedy: exactly the same tokens
  assert got['logits_max_abs_diff'] <= LOGITS_ATOL, got['logits_max_abs_diff']
  assert got['draft_params_replicated']  # the draft's default rules replicate it
  assert got['result_sharding'] == 'P()'  # every device (and process) holds the result


@pytest.mark.slow
def test_parameters_are_really_split(decode_results):
  """Per-device shard shapes are the expected fractions of the large matrices."""
  def shard(kind, mesh, name):
    full, per_device, _ = decode_results[kind][mesh]['params'][name]
    return tuple(full), tuple(per_device)

  for mesh, m in (('1x8', 8), ('2x4', 4), ('8x1', 1)):
    assert shard('llama', mesh, 'embedder/embedding') == ((64, 32), (64 // m, 32))
    assert shard('llama', mesh, 'layers_0/attention/query/kernel') == ((32, 8, 4),
                                                                       (32, 8 // m, 4))
    assert shard('llama', mesh, 'layers_0/attention/out/kernel') == ((8, 4, 32),
                                                                     (8 // m, 4, 32))
    assert shard('llama', mesh, 'layers_0/mlp/gate/kernel') == ((32, 64), (32, 64 // m))
    assert shard('llama', mesh, 'layers_0/mlp/down/kernel') == ((64, 32), (64 // m, 32))
    assert shard('llama', mesh, 'final_norm/scale') == ((32,), (32,))  # 'embed' replicated
    assert shard('t5', mesh, 'token_embedder/embedding') == ((64, 32), (64 // m, 32))
    assert shard('t5', mesh, 'encoder/layers_0/attention/query/kernel') == ((32, 32),
                                                                             (32, 32 // m))
    assert shard('t5', mesh, 'encoder/layers_0/attention/out/kernel') == ((32, 32),
                                                                           (32 // m, 32))
    assert shard('t5', mesh, 'decoder/layers_0/mlp/wi_0/kernel') == ((32, 64), (32, 64 // m))
    assert shard('t5', mesh, 'decoder/layers_0/mlp/wo/kernel') == ((64, 32), (64 // m, 32))
    assert shard('t5', mesh, 'decoder/logits_dense/kernel') == ((32, 64), (32, 64 // m))
    assert shard('t5', mesh, 'decoder/relpos_bias/rel_embedding') == ((8, 32), (8 // m, 32))
  # A new family's extra parameters: q/k norm scales replicated ('kv' is not split).
  assert shard('gemma3', '2x4', 'layers_0/attention/query/kernel') == ((32, 8, 4), (32, 2, 4))
  assert shard('gemma3', '2x4', 'layers_0/attention/query_norm/scale') == ((4,), (4,))
  assert shard('gemma3', '2x4', 'layers_0/post_mlp_norm/scale') == ((32,), (32,))
  # 4 key/value heads: split 4 ways on 2x4, replicated on 1x8 (8 does not divide 4).
  assert shard('llama', '2x4', 'layers_0/attention/key/kernel') == ((32, 4, 4), (32, 1, 4))
  assert shard('llama', '1x8', 'layers_0/attention/key/kernel') == ((32, 4, 4), (32, 4, 4))
  # Caches [layers, B, L, N, H]: batch over 'data', heads over 'model'.
  assert decode_results['t5']['2x4']['cache_keys'] == [[2, 8, 15, 8, 4], [2, 4, 15, 2, 4]]
  assert decode_results['t5']['8x1']['cache_keys'][1] == [2, 1, 15, 8, 4]
  assert decode_results['llama']['2x4']['cache_keys'][1] == [2, 4, 1, 15, 4]


def test_checkpoints_load_straight_into_shards(eight_device_results):
  """T5X (TensorStore zarr and inline msgpack) and HF safetensors read slice by slice."""
  got = eight_device_results['checkpoints']
  assert got['t5x_equal'] and got['t5x_shardings_match'] and got['hf_equal']
  for reads in (got['t5x_reads'], got['hf_reads']):
    # Every read is exactly one device's shard; no split array was ever read whole.
    assert reads['reads_not_shard_shaped'] == []
    assert reads['num_split_arrays'] > 10
    assert reads['max_fraction_of_split_array_read'] == 0.25  # 2x4 mesh: a quarter
  # Split arrays are read once per model-axis slice (the 'data' replicas share one read).
  assert got['t5x_reads']['num_reads'] < 8 * got['t5x_zarr_arrays']
  if 'fixture_equal' in got:  # the shared real T5X checkpoint
    assert got['fixture_equal']
    assert got['fixture_embedding'] == [[32128, 8], [8032, 8]]


# ----------------------------------------------------------------------------------------------
# Two processes (jax.distributed on localhost, 4 CPU devices each)


def _free_port() -> int:
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _two_process_env() -> dict[str, str]:
  """The environment of each of two processes with 4 CPU devices. Without the session's
  compilation cache (tests/conftest.py): a process that loaded its programs from it while the
  other compiled would wait at the first collective past gloo's 30 s deadline."""
  env = dict(os.environ)
  env.update(XLA_FLAGS=_xla_flags(4), JAX_PLATFORMS='cpu',
             PYTHONPATH=REPO + os.pathsep + env.get('PYTHONPATH', ''),
             JAX_ENABLE_COMPILATION_CACHE='false')
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  return env


def _wait_for_all(procs, timeout: int = 600) -> list[str]:
  """Each process's output once all have exited 0 (any still running is killed on failure)."""
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=timeout)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for proc, log in zip(procs, logs):
    assert proc.returncode == 0, log[-4000:]
  return logs


@pytest.mark.slow
def test_two_processes_split_the_dataset_and_merge_one_report(tmp_path):
  """`python -m speclm.run` in 2 processes: each decodes its share on a 2x2 mesh of its own
  4 devices; process 0 merges, and the report has every example exactly once. The processes
  write to different directories (as hosts of a TPU slice write to their own disks): the
  records reach process 0 over JAX's collectives, not a shared file system."""
  port = _free_port()
  env = _two_process_env()
  out = tmp_path / 'job'
  procs = []
  for process_id in range(2):
    args = [sys.executable, '-m', 'speclm.run', '--gin_file=test_tiny.gin',
            '--gin_file=runs/sharded.gin', '--gin.NUM_PARTITIONS=2', '--gin.MULTI_HOST=True',
            f"--gin.partitioning.initialize_distributed.coordinator_address='localhost:{port}'",
            '--gin.partitioning.initialize_distributed.num_processes=2',
            f'--gin.partitioning.initialize_distributed.process_id={process_id}',
            '--gin.synthetic_dataset.num_examples=13',  # uneven: 7 and 6 examples
            '--gin.run_job.measure_cost=False', '--gin.run_job.show_progress=False',
            f"--gin.OUTPUT_DIR='{out if process_id == 0 else tmp_path / 'host_1'}'"]
    procs.append(subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True))
  _wait_for_all(procs)

  from speclm import outputs  # pylint: disable=g-import-not-at-top
  parts = [outputs.read_predictions(str(directory / f'process_{p:03d}' / 'predictions.jsonl'))
           for p, directory in enumerate([out, tmp_path / 'host_1'])]
  assert not (out / 'process_001').exists()
  assert sorted(r['index'] for r in parts[0]) == list(range(0, 13, 2))
  assert sorted(r['index'] for r in parts[1]) == list(range(1, 13, 2))
  merged = outputs.read_predictions(str(out / 'predictions.jsonl'))
  indices = [r['index'] for r in merged]
  assert sorted(indices) == list(range(13)) and len(set(indices)) == 13  # each exactly once
  assert all(r['identical'] for r in merged)  # greedy: speculative == baseline, sharded
  metrics = json.loads((out / 'metrics.json').read_text())
  assert metrics['num_examples'] == 13 and metrics['num_decoded'] == 13
  assert metrics['identical_output_rate'] == 1.0
  assert metrics['job']['process_count'] == 2 and metrics['job']['mesh'] == {'data': 2,
                                                                             'model': 2}
  assert len(metrics['job']['merged_from']) == 2


@pytest.mark.slow
def test_one_mesh_across_two_processes_decodes_like_one_device():
  """devices='global': a 2x4 mesh over both processes' devices (GSPMD collectives cross the
  process boundary over gloo); the replicated result equals one device's in each process."""
  port = _free_port()
  env = _two_process_env()
  script = os.path.join(REPO, 'tests', 'multidevice_checks.py')
  procs = [subprocess.Popen([sys.executable, script, 'global', str(port), str(p)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for p in range(2)]
  for log in _wait_for_all(procs):
    line = [l for l in log.splitlines() if l.startswith('RESULT ')][-1]
    got = json.loads(line[len('RESULT '):])['global']
    assert got == {'process_count': 2, 'devices': 8, 'local_devices': 4,
                   'mesh': {'data': 2, 'model': 4}, 'same_tokens': True}
