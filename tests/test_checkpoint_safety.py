"""Checkpoint readers refuse what they must not trust: T5X zarr paths leading outside the
checkpoint directory, and parameters holding NaN/Inf (T5X legacy, sharded, Orbax, drafts)."""

import gzip
import os
import re
import shutil
from pathlib import Path

import flax.serialization
import jax
import numpy as np
import pytest

from speclm import checkpoints
from speclm.run import providers
from speclm import partitioning
from speclm.checkpoints import sharded
from speclm.checkpoints import t5x
from speclm.checkpoints import validate
from speclm.checkpoints import zarr_v2
from speclm.models import t5

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / '..' / 'shared' / 'fixtures' / 't5x'
TINY_CHECKPOINT = FIXTURES / 'test_t5_tiny.checkpoint_0'  # the complete tiny T5 1.1 (inline)
ZARR_CHECKPOINT = FIXTURES / 'tiny_t5' / 'checkpoint_1'  # legacy msgpack + zarr arrays

needs_fixtures = pytest.mark.skipif(not TINY_CHECKPOINT.exists(),
                                    reason='shared T5X fixtures not present')


def _copy(src: Path, dst: Path) -> Path:
  """A writable copy (the shared fixtures are read-only)."""
  shutil.copytree(src, dst)
  for directory, _, files in os.walk(dst):
    os.chmod(directory, 0o755)
    for name in files:
      os.chmod(os.path.join(directory, name), 0o644)
  return dst


def _rewrite(checkpoint_dir: Path, edit) -> None:
  path = checkpoint_dir / 'checkpoint'
  state = flax.serialization.msgpack_restore(path.read_bytes())
  edit(state)
  path.write_bytes(flax.serialization.msgpack_serialize(state))


def _spec(state, name):
  return state['optimizer']['state']['param_states'][name]


def _outside_message(name, shown):
  return (rf"array '{re.escape(name)}' points outside the checkpoint directory \({shown}\);"
          r' refusing to read it\.$')


@pytest.fixture()
def legacy(tmp_path, monkeypatch):
  """(copy of the zarr fixture, a directory beside it holding valid copies of its arrays, the
  list of array directories the numpy zarr reader opened)."""
  checkpoint = _copy(ZARR_CHECKPOINT, tmp_path / 'run' / 'checkpoint_1')
  outside = tmp_path / 'outside'
  _copy(ZARR_CHECKPOINT / 'state.param_states.kernel', outside / 'kernel')
  _copy(ZARR_CHECKPOINT / 'state.param_states.bias', outside / 'bias')
  reads = []
  real = zarr_v2.read_numpy

  def recording(array_dir, *args):
    reads.append(str(array_dir))
    return real(array_dir, *args)

  monkeypatch.setattr(zarr_v2, 'read_numpy', recording)
  return checkpoint, outside, reads


@needs_fixtures
def test_outside_arrays_are_valid_zarr_that_would_load(legacy, tmp_path):
  """The control: with the same specs, paths inside their checkpoint directory load (also an
  absolute one), so the refusals below are the confinement, not a broken array."""
  checkpoint, outside, _ = legacy
  want = t5x.read_t5x_state(ZARR_CHECKPOINT)['optimizer']['state']['param_states']['kernel']

  def inside(state):
    spec = dict(_spec(state, 'kernel'))
    spec['kvstore'] = {'driver': 'file', 'path': 'outside/kernel'}
    state['optimizer']['target'] = {'kernel': spec}

  shutil.copy(checkpoint / 'checkpoint', tmp_path / 'checkpoint')
  _rewrite(tmp_path, inside)  # tmp_path/checkpoint: outside/ is inside *its* directory
  np.testing.assert_array_equal(checkpoints.load_t5x_checkpoint(tmp_path)['kernel'], want)

  def absolute_inside(state):
    spec = dict(_spec(state, 'kernel'))
    spec['kvstore'] = {'driver': 'file', 'path': str(checkpoint / 'state.param_states.kernel')}
    state['optimizer']['target'] = {'kernel': spec}

  _rewrite(checkpoint, absolute_inside)
  np.testing.assert_array_equal(checkpoints.load_t5x_checkpoint(checkpoint)['kernel'], want)


@needs_fixtures
def test_absolute_and_dotdot_paths_are_refused(legacy):
  checkpoint, outside, reads = legacy

  def point_outside(state):
    _spec(state, 'kernel')['kvstore']['path'] = str(outside / 'kernel')
    _spec(state, 'bias')['kvstore']['path'] = '../../outside/bias/'
    state['optimizer']['target'] = {'kernel': dict(_spec(state, 'kernel'))}

  _rewrite(checkpoint, point_outside)
  source = re.escape(str(checkpoint / 'checkpoint'))
  with pytest.raises(checkpoints.CheckpointError,
                     match=f'^T5X checkpoint {source}: ' + _outside_message(
                         'optimizer/target/kernel', re.escape(str(outside / 'kernel')))):
    checkpoints.load_t5x_checkpoint(checkpoint)
  with pytest.raises(checkpoints.CheckpointError, match=_outside_message(
      'optimizer/state/param_states/bias', r'\.\./\.\./outside/bias/')):
    t5x.read_t5x_state(checkpoint)

  def only_kernel_outside(state):
    _spec(state, 'bias')['kvstore']['path'] = 'state.param_states.bias/'
    state['optimizer']['target'] = {}

  _rewrite(checkpoint, only_kernel_outside)
  with pytest.raises(checkpoints.CheckpointError, match=_outside_message(
      'optimizer/state/param_states/kernel', re.escape(str(outside / 'kernel')))):
    t5x.read_t5x_state(checkpoint)
  assert reads and not [r for r in reads if str(outside) in r or '..' in r], reads


@needs_fixtures
@pytest.mark.parametrize('kind', ['directory', 'chunk'])
def test_symbolic_links_out_of_the_directory_are_refused(legacy, kind):
  checkpoint, outside, reads = legacy
  linked = checkpoint / 'linked'
  if kind == 'directory':
    linked.symlink_to(outside / 'kernel', target_is_directory=True)
    shown = re.escape(f'linked, a link to {os.path.realpath(outside / "kernel")}')
  else:
    linked.mkdir()
    (linked / '0.0').symlink_to(outside / 'kernel' / '0.0')
    shown = re.escape(f'linked/0.0, a link to {os.path.realpath(outside / "kernel" / "0.0")}')

  def point_at_link(state):
    spec = dict(_spec(state, 'kernel'))
    spec['kvstore'] = {'driver': 'file', 'path': 'linked'}
    state['target'] = {'kernel': spec}

  _rewrite(checkpoint, point_at_link)
  with pytest.raises(checkpoints.CheckpointError,
                     match=_outside_message('target/kernel', shown)):
    checkpoints.load_t5x_checkpoint(checkpoint)
  assert not reads


def test_gcs_paths_stay_under_the_checkpoint_prefix():
  base = 'gs://bucket/models/t5/checkpoint_3'
  where = lambda path: t5x._array_location(  # pylint: disable=protected-access
      {'kvstore': {'driver': 'gcs', 'path': path}}, base, 'target/x', 'src')
  assert where('target.x/') == f'{base}/target.x'
  assert where('a/../target.x') == f'{base}/target.x'
  assert where(f'{base}/target.x') == f'{base}/target.x'
  for bad in ('../checkpoint_4/target.x', '/etc/x', 'gs://other/models/t5/checkpoint_3/x',
              'gs://bucket/models/t5/checkpoint_30/x', '.', ''):
    with pytest.raises(checkpoints.CheckpointError, match="array 'target/x' points outside"):
      where(bad)
  with pytest.raises(checkpoints.CheckpointError, match='outside.*gs://bucket/x'):
    t5x._array_location({'kvstore': {'path': 'gs://bucket/x'}},  # pylint: disable=protected-access
                        '/local/checkpoint_1', 'target/x', 'src')


@pytest.fixture(scope='module')
def model():
  return t5.random_model(vocab_size=48, emb_dim=16, seed=0)  # as test_t5x_checkpoints.py's


def test_sharded_reader_refuses_dotdot_paths(tmp_path, model):
  checkpoint = tmp_path / 'run' / 'checkpoint_0'
  t5x.save_t5x_checkpoint(checkpoint, model.params, zarr_min_bytes=2048)
  shutil.move(checkpoint / 'target.token_embedder.embedding', tmp_path / 'elsewhere')

  def edit(state):
    state['target']['token_embedder']['embedding']['kvstore']['path'] = '../../elsewhere'

  _rewrite(checkpoint, edit)
  message = _outside_message('target/token_embedder/embedding', r'\.\./\.\./elsewhere')
  with pytest.raises(checkpoints.CheckpointError, match=message):
    sharded.load_t5x_sharded(checkpoint, model.definition,
                             partitioning.Partitioner(num_partitions=1))
  with pytest.raises(checkpoints.CheckpointError, match=message):
    checkpoints.load_t5x_checkpoint(checkpoint, expected=model.definition.param_shapes())


# ----------------------------------------------------------------------------------------------
# NaN / Inf


def _tiny_definition() -> t5.T5:
  return t5.T5(providers.t5_config_from_gin(
      str(REPO / 'configs' / 'models' / 't5_1_1' / 'tiny.gin'), 't5_1_1_tiny'))


def _corrupt_message(role, name, source, bad, total):
  return re.escape(f"{role} parameter '{name}' in {source} has {bad} NaN/Inf values (of {total});"
                   ' the checkpoint is corrupt.')


@needs_fixtures
def test_nan_in_a_zarr_chunk_of_the_tiny_t5_is_refused(tmp_path):
  definition = _tiny_definition()
  expected = definition.param_shapes()
  params = checkpoints.load_t5x_checkpoint(TINY_CHECKPOINT, expected=expected)
  checkpoint = tmp_path / 'checkpoint_0'
  t5x.save_t5x_checkpoint(checkpoint, params, zarr_min_bytes=256)  # (8, 16) kernels -> zarr
  chunk = checkpoint / 'target.decoder.layers_0.mlp.wi_0.kernel' / '0.0'
  values = np.frombuffer(gzip.decompress(chunk.read_bytes()), '<f4').copy()
  values[[3, 70]] = [np.nan, np.inf]
  chunk.write_bytes(gzip.compress(values.tobytes()))
  message = _corrupt_message('target', 'decoder/layers_0/mlp/wi_0/kernel',
                             checkpoint / 'checkpoint', 2, 128)
  with pytest.raises(checkpoints.CheckpointError, match=message):
    checkpoints.load_t5x_checkpoint(checkpoint, expected=expected)
  with pytest.raises(checkpoints.CheckpointError, match=message):
    checkpoints.load_t5_params(checkpoint, definition)
  with pytest.raises(checkpoints.CheckpointError, match=message.replace('target', 'draft', 1)):
    sharded.load_t5x_sharded(checkpoint, definition, partitioning.Partitioner(num_partitions=1),
                             role='draft')


@needs_fixtures
def test_nan_in_an_inline_array_of_the_tiny_t5_is_refused(tmp_path):
  state = flax.serialization.msgpack_restore(TINY_CHECKPOINT.read_bytes())
  mlp = state['optimizer']['target']['encoder']['layers_1']['mlp']
  mlp['wo']['kernel'] = np.array(mlp['wo']['kernel'])  # (a writable copy)
  mlp['wo']['kernel'][3, 4] = np.nan
  path = tmp_path / 'test_t5_tiny.checkpoint_0'
  path.write_bytes(flax.serialization.msgpack_serialize(state))
  with pytest.raises(checkpoints.CheckpointError, match=_corrupt_message(
      'optimizer/target', 'encoder/layers_1/mlp/wo/kernel', path, 1, 128)):
    checkpoints.load_t5x_checkpoint(path, expected=_tiny_definition().param_shapes())


def test_nan_in_an_orbax_checkpoint_is_refused(tmp_path, model):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  params = jax.tree_util.tree_map(np.array, model.params)
  params['decoder']['logits_dense']['kernel'][0, :5] = -np.inf
  path = tmp_path / 'checkpoint_2'
  ocp.PyTreeCheckpointer().save(path, {'target': params})
  with pytest.raises(checkpoints.CheckpointError, match=_corrupt_message(
      'target', 'decoder/logits_dense/kernel', path, 5, 16 * 48)):
    checkpoints.load_checkpoint(path, expected=model.definition.param_shapes())


def test_check_finite_helper():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  fine = {'a': np.ones(3, np.float32), 'ids': np.arange(4), 'b': jnp.zeros((2, 2)),
          'c': np.array([1.0], ml_dtypes.bfloat16)}
  validate.check_finite(fine, 'here')
  with pytest.raises(checkpoints.CheckpointError,
                     match=r"^Parameter 'x/y' in here has 1 NaN/Inf values \(of 2\)"):
    validate.check_finite({**fine, 'x': {'y': np.array([1.0, np.nan], ml_dtypes.bfloat16)}},
                          'here')
  with pytest.raises(ValueError, match=r"^draft parameter 'b' in f has 4 NaN/Inf values \(of 4"):
    validate.check_finite({'b': jnp.full((2, 2), jnp.nan)}, 'f', role='draft', error=ValueError)


def test_nan_in_a_smollm2_draft_file_is_refused(tmp_path):
  from speclm.presets import smollm2_draft  # pylint: disable=g-import-not-at-top
  trained = {'layers_0': {'mlp': {'up': {'kernel': np.ones((4, 6), np.float32)}}},
             'final_norm': {'scale': np.ones(4, np.float32)},
             'other_embedding': np.zeros(4, np.float32)}
  path = str(tmp_path / 'draft.safetensors')
  smollm2_draft.save(path, trained, np.arange(3), {'num_layers': 1})
  assert smollm2_draft.read(path)[1].tolist() == [0, 1, 2]
  trained['layers_0']['mlp']['up']['kernel'][1, 2] = np.nan
  smollm2_draft.save(path, trained, np.arange(3), {'num_layers': 1})
  with pytest.raises(ValueError, match=re.escape(
      f"Parameter 'layers_0/mlp/up/kernel' in {path} has 1 NaN/Inf values (of 24)")):
    smollm2_draft.read(path)
