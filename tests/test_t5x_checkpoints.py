"""T5X checkpoints: the shared real fixtures, our writer, Orbax, and clear errors."""

import gzip
import json
import os
import shutil
from pathlib import Path

import flax.serialization
import jax
import ml_dtypes
import numpy as np
import pytest

from speclm import checkpoints
from speclm.run import providers
from speclm import trees
from speclm.checkpoints import storage
from speclm.checkpoints import t5x
from speclm.models import t5
from speclm.presets import t5 as t5_presets

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / '..' / 'shared' / 'fixtures' / 't5x'
TINY_CHECKPOINT = FIXTURES / 'test_t5_tiny.checkpoint_0'
ZARR_CHECKPOINT = FIXTURES / 'tiny_t5' / 'checkpoint_1'

needs_fixtures = pytest.mark.skipif(not TINY_CHECKPOINT.exists(),
                                    reason='shared T5X fixtures not present')


def _tiny_gin_config() -> t5.T5Config:
  return providers.t5_config_from_gin(
      str(REPO / 'configs' / 'models' / 't5_1_1' / 'tiny.gin'), 't5_1_1_tiny')


def _flat(tree):
  return trees.flatten(tree)


@pytest.fixture(scope='module')
def model():
  # The same config as test_t5.py's cache model: its compiled init is shared in one process.
  return t5.random_model(vocab_size=48, emb_dim=16, seed=0)


# ----------------------------------------------------------------------------------------------
# The shared fixtures (real T5X files)


@needs_fixtures
def test_restore_test_t5_tiny_into_tiny_config_and_run():
  definition = t5.T5(_tiny_gin_config())
  params = checkpoints.load_t5x_checkpoint(TINY_CHECKPOINT, expected=definition.param_shapes())
  definition.validate_params(params)
  # Independent decoding of the same file with Flax's own msgpack reader.
  reference = flax.serialization.msgpack_restore(TINY_CHECKPOINT.read_bytes())
  reference = _flat(reference['optimizer']['target'])
  ours = _flat(params)
  assert set(ours) == set(reference) and len(ours) == 52
  for name, value in reference.items():
    assert ours[name].dtype == np.float32
    np.testing.assert_array_equal(ours[name], value, err_msg=name)
  # The restored model runs: cached decoding agrees with the teacher-forced pass.
  inputs = np.array([[37, 8, 1, 0], [9, 4, 17, 1]], np.int32)
  lengths = np.array([3, 4], np.int32)
  decoder = np.array([[0, 5, 6], [0, 7, 8]], np.int32)
  full = np.asarray(definition.forward(params, inputs, lengths, decoder))
  assert full.shape == (2, 3, 32128) and np.all(np.isfinite(full))
  first, cache = jax.jit(definition.prefill)(params, inputs, lengths,
                                              definition.init_cache(2, 3))
  np.testing.assert_allclose(first, full[:, 0], atol=1e-5)
  rest, _ = jax.jit(definition.extend)(params, decoder[:, 1:], cache)
  np.testing.assert_allclose(rest, full[:, 1:], atol=1e-5)


def _gunzip(path: Path, dtype) -> np.ndarray:
  return np.frombuffer(gzip.decompress(path.read_bytes()), dtype)


@needs_fixtures
def test_read_zarr_arrays_of_tiny_t5_checkpoint_1():
  state = t5x.read_t5x_state(ZARR_CHECKPOINT)
  assert state['version'] == 3
  param_states = state['optimizer']['state']['param_states']
  np.testing.assert_array_equal(param_states['bias'], np.ones(5, np.float32))
  assert param_states['bias'].dtype == np.float32
  kernel = param_states['kernel']
  assert kernel.shape == (10, 5) and kernel.dtype == np.float64
  np.testing.assert_array_equal(
      kernel.ravel(), _gunzip(ZARR_CHECKPOINT / 'state.param_states.kernel' / '0.0', '<f8'))
  np.testing.assert_allclose(kernel[0], [0.15038408, 0.70071733, 0.50233229, 0.6763428,
                                         0.41820543], rtol=1e-7)
  assert int(param_states['step']) == 1 and int(state['optimizer']['state']['step']) == 1
  # Its target is empty: restoring parameters yields nothing, and the optimizer is not read.
  assert checkpoints.load_t5x_checkpoint(ZARR_CHECKPOINT) == {}


@needs_fixtures
def test_zarr_fixture_through_tensorstore_with_zarray(tmp_path):
  """With `.zarray` present (as T5X writes it) the array is read by TensorStore, same values."""
  copy = tmp_path / 'checkpoint_1'
  shutil.copytree(ZARR_CHECKPOINT, copy)
  os.chmod(copy, 0o755)
  for sub in copy.iterdir():
    os.chmod(sub, 0o755)
  (copy / 'state.param_states.kernel' / '.zarray').write_text(json.dumps({
      'zarr_format': 2, 'shape': [10, 5], 'chunks': [10, 5], 'dtype': '<f8',
      'compressor': {'id': 'gzip', 'level': 1}, 'fill_value': None, 'order': 'C',
      'filters': None}))
  via_tensorstore = t5x.read_t5x_state(copy)['optimizer']['state']['param_states']['kernel']
  via_numpy = t5x.read_t5x_state(ZARR_CHECKPOINT)['optimizer']['state']['param_states']['kernel']
  np.testing.assert_array_equal(via_tensorstore, via_numpy)


# ----------------------------------------------------------------------------------------------
# Our writer


def test_writer_roundtrip_is_exact_and_t5x_shaped(tmp_path, model):
  path = tmp_path / 'checkpoint_7'
  t5x.save_t5x_checkpoint(path, model.params, step=7, zarr_min_bytes=2048)
  zarr_dirs = sorted(p.name for p in path.iterdir() if p.is_dir())
  assert 'target.token_embedder.embedding' in zarr_dirs
  assert 'target.decoder.logits_dense.kernel' in zarr_dirs
  assert 'target.encoder.encoder_norm.scale' not in zarr_dirs  # small arrays stay inline
  restored = checkpoints.load_t5x_checkpoint(path, expected=model.definition.param_shapes())
  flat_in, flat_out = _flat(model.params), _flat(restored)
  assert set(flat_in) == set(flat_out)
  for name in flat_in:
    np.testing.assert_array_equal(flat_out[name], np.asarray(flat_in[name]), err_msg=name)
  # The msgpack is what Flax/T5X read: inline arrays decode with Flax, zarr leaves are specs
  # with paths relative to the checkpoint directory.
  raw = flax.serialization.msgpack_restore((path / 'checkpoint').read_bytes())
  assert raw['version'] == 3 and int(raw['state']['step']) == 7
  np.testing.assert_array_equal(raw['target']['encoder']['encoder_norm']['scale'],
                                model.params['encoder']['encoder_norm']['scale'])
  spec = raw['target']['token_embedder']['embedding']
  assert spec['driver'] == 'zarr' and spec['kvstore']['path'] == 'target.token_embedder.embedding'
  assert spec['metadata']['compressor'] == {'id': 'gzip', 'level': 1}
  meta = json.loads((path / 'target.token_embedder.embedding' / '.zarray').read_text())
  assert meta['shape'] == [48, 16] and meta['compressor']['id'] == 'gzip'
  # The restored parameters give the same logits.
  inputs, lengths = np.array([[3, 4, 1]], np.int32), np.array([3], np.int32)
  decoder = np.array([[0, 5]], np.int32)
  np.testing.assert_array_equal(model.definition.forward(restored, inputs, lengths, decoder),
                                model.definition.forward(model.params, inputs, lengths, decoder))


def test_bfloat16_inline_and_zarr_and_cast_on_read(tmp_path, model):
  params = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16),
                                  model.params)
  t5x.save_t5x_checkpoint(tmp_path, params, zarr_min_bytes=1024)
  raw = flax.serialization.msgpack_restore((tmp_path / 'checkpoint').read_bytes())
  assert raw['target']['encoder']['encoder_norm']['scale'].dtype == ml_dtypes.bfloat16
  restored = _flat(checkpoints.load_t5x_checkpoint(tmp_path))
  for name, value in _flat(params).items():
    assert restored[name].dtype == ml_dtypes.bfloat16, name
    np.testing.assert_array_equal(restored[name].view(np.uint16), value.view(np.uint16))
  as_f32 = _flat(checkpoints.load_t5x_checkpoint(tmp_path, dtype='float32'))
  for name, value in _flat(params).items():
    assert as_f32[name].dtype == np.float32
    np.testing.assert_array_equal(as_f32[name], value.astype(np.float32))
  # With `expected`, arrays take its dtypes (here the float32 model's).
  expected = model.definition.param_shapes()
  assert all(x.dtype == np.float32 for x in jax.tree_util.tree_leaves(
      checkpoints.load_t5x_checkpoint(tmp_path, expected=expected)))


def test_legacy_optimizer_layout_and_chunked_arrays(tmp_path, model):
  """{'optimizer': {'target': …}} checkpoints and Flax's chunked big-array form both load."""
  target = jax.tree_util.tree_map(np.asarray, model.params)
  embedding = target['token_embedder']['embedding']
  flat = embedding.ravel()
  target['token_embedder']['embedding'] = {
      '__msgpack_chunked_array__': True, 'shape': {'0': 48, '1': 16},
      'chunks': {'0': flat[:500], '1': flat[500:]}}
  state = {'version': 2, 'optimizer': {'target': target, 'state': {'step': np.int32(3)}}}
  (tmp_path / 'checkpoint').write_bytes(flax.serialization.msgpack_serialize(state))
  restored = checkpoints.load_t5x_checkpoint(tmp_path, expected=model.definition.param_shapes())
  np.testing.assert_array_equal(restored['token_embedder']['embedding'], embedding)
  np.testing.assert_array_equal(restored['decoder']['logits_dense']['kernel'],
                                target['decoder']['logits_dense']['kernel'])


# ----------------------------------------------------------------------------------------------
# Errors


def test_shape_mismatch_names_parameter_and_both_shapes(tmp_path, model):
  t5x.save_t5x_checkpoint(tmp_path, model.params, zarr_min_bytes=2048)
  other = t5.T5(t5.tiny_config(vocab_size=48, emb_dim=16, mlp_dim=24))
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'coder/layers_0/mlp/wi_0/kernel.*\(16, 32\).*\(16, 24\)'):
    checkpoints.load_t5x_checkpoint(tmp_path, expected=other.param_shapes())
  bigger_vocab = t5.T5(t5.tiny_config(vocab_size=96, emb_dim=16))  # a zarr leaf: no data read
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'(token_embedder/embedding.*\(48, 16\).*\(96, 16\)|'
                     r'logits_dense/kernel.*\(16, 48\).*\(16, 96\))'):
    checkpoints.load_t5x_checkpoint(tmp_path, expected=bigger_vocab.param_shapes())
  v1_0 = t5.T5(t5.tiny_config(vocab_size=48, emb_dim=16, version='1.0'))
  with pytest.raises(checkpoints.CheckpointError, match='missing.*mlp/wi/kernel'):
    checkpoints.load_t5x_checkpoint(tmp_path, expected=v1_0.param_shapes())


def test_missing_and_corrupt_files_name_their_path(tmp_path, model):
  missing = tmp_path / 'nope' / 'checkpoint_5'
  with pytest.raises(checkpoints.CheckpointError, match=f'not found: {missing}'):
    checkpoints.load_t5x_checkpoint(missing)

  path = tmp_path / 'ckpt'
  t5x.save_t5x_checkpoint(path, model.params, zarr_min_bytes=2048)
  good = (path / 'checkpoint').read_bytes()

  (path / 'checkpoint').write_bytes(good[:len(good) // 2])
  with pytest.raises(checkpoints.CheckpointError, match=f'truncated.*{path / "checkpoint"}'):
    checkpoints.load_t5x_checkpoint(path)
  (path / 'checkpoint').write_bytes(b'\x93not a checkpoint')
  with pytest.raises(checkpoints.CheckpointError, match=str(path / 'checkpoint')):
    checkpoints.load_t5x_checkpoint(path)
  (path / 'checkpoint').write_bytes(good)

  chunk = path / 'target.decoder.logits_dense.kernel' / '0.0'
  data = chunk.read_bytes()
  chunk.write_bytes(data[:len(data) // 2])
  with pytest.raises(checkpoints.CheckpointError, match='target.decoder.logits_dense.kernel'):
    checkpoints.load_t5x_checkpoint(path)
  chunk.unlink()
  with pytest.raises(checkpoints.CheckpointError, match=f'Missing zarr chunk.*{chunk}'):
    checkpoints.load_t5x_checkpoint(path)
  shutil.rmtree(chunk.parent)
  with pytest.raises(checkpoints.CheckpointError, match=f'Missing zarr array.*{chunk.parent}'):
    checkpoints.load_t5x_checkpoint(path)


def test_never_unpickles(tmp_path):
  """A pickle where the msgpack should be is rejected as corrupt, not executed."""
  import pickle  # pylint: disable=g-import-not-at-top
  (tmp_path / 'checkpoint').write_bytes(pickle.dumps({'version': 3, 'target': {}}))
  with pytest.raises(checkpoints.CheckpointError):
    checkpoints.load_t5x_checkpoint(tmp_path)


# ----------------------------------------------------------------------------------------------
# Orbax and format detection


def test_orbax_checkpoint_roundtrip(tmp_path, model):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  params = jax.tree_util.tree_map(np.asarray, model.params)
  state = {'target': params,
           'state': {'step': np.int32(11),
                     'param_states': {'embedding_v': np.ones((64,), np.float32)}}}
  path = tmp_path / 'checkpoint_11'
  ocp.PyTreeCheckpointer().save(path, state)
  expected = model.definition.param_shapes()
  for restored in (checkpoints.load_orbax_checkpoint(path, expected=expected),
                   checkpoints.load_checkpoint(path),
                   checkpoints.load_t5_params(path, model.definition)):
    flat_in, flat_out = _flat(params), _flat(restored)
    assert set(flat_in) == set(flat_out)
    for name in flat_in:
      np.testing.assert_array_equal(flat_out[name], flat_in[name], err_msg=name)
  # T5X's CheckpointManager layout: checkpoint_<step>/state/ holds the PyTree.
  ocp.PyTreeCheckpointer().save(tmp_path / 'managed' / 'checkpoint_11' / 'state', state)
  restored = checkpoints.load_checkpoint(tmp_path / 'managed' / 'checkpoint_11')
  np.testing.assert_array_equal(restored['token_embedder']['embedding'],
                                params['token_embedder']['embedding'])
  with pytest.raises(checkpoints.CheckpointError,
                     match=r'(token_embedder/embedding|logits_dense/kernel)'
                     r'.*expects \((16, 96|96, 16)\)'):
    checkpoints.load_orbax_checkpoint(
        path, expected=t5.T5(t5.tiny_config(vocab_size=96, emb_dim=16)).param_shapes())


def test_load_t5_preset_restores(tmp_path, model):
  from speclm import partitioning  # pylint: disable=g-import-not-at-top
  t5x.save_t5x_checkpoint(tmp_path, model.params)
  restored = t5_presets.load_t5(model.definition.config, checkpoint_path=str(tmp_path))
  # With a partitioner, a legacy checkpoint is read shard by shard: the same values.
  placed = t5_presets.load_t5(model.definition.config, str(tmp_path), role='draft',
                              partitioner=partitioning.Partitioner(num_partitions=1))
  for name, value in _flat(model.params).items():
    np.testing.assert_array_equal(_flat(restored.params)[name], value)
    np.testing.assert_array_equal(_flat(placed.params)[name], value)
  with pytest.raises(checkpoints.CheckpointError, match='not found'):
    t5_presets.load_t5(model.definition.config, str(tmp_path / 'missing'))


def test_gcs_paths_go_through_tensorstore_kvstores(tmp_path, model, monkeypatch):
  """gs:// checkpoints: bucket/prefix handling, msgpack and zarr through TensorStore kvstores.

  No network here, so the GCS driver is swapped for the file driver under tmp_path; the
  path logic (splitting, relative zarr paths, the `checkpoint` file lookup) is the real one.
  """
  real = storage.kvstore_spec

  def fake_gcs(path):
    spec = real(path)
    if spec['driver'] == 'gcs':
      return {'driver': 'file', 'path': str(tmp_path / spec['bucket'] / spec['path'])
                                        + ('/' if path.endswith('/') else '')}
    return spec

  monkeypatch.setattr(storage, 'kvstore_spec', fake_gcs)
  url = 'gs://fake-bucket/models/t5/checkpoint_3'
  t5x.save_t5x_checkpoint(url, model.params, step=3, zarr_min_bytes=2048)
  on_disk = tmp_path / 'fake-bucket' / 'models' / 't5' / 'checkpoint_3'
  assert (on_disk / 'checkpoint').is_file()
  assert (on_disk / 'target.token_embedder.embedding' / '.zarray').is_file()
  raw = flax.serialization.msgpack_restore((on_disk / 'checkpoint').read_bytes())
  assert raw['target']['token_embedder']['embedding']['kvstore'] == {
      'driver': 'gcs', 'path': 'target.token_embedder.embedding'}
  restored = checkpoints.load_t5x_checkpoint(url, expected=model.definition.param_shapes())
  for name, value in _flat(model.params).items():
    np.testing.assert_array_equal(_flat(restored)[name], value)
  with pytest.raises(checkpoints.CheckpointError, match='gs://fake-bucket/models/absent'):
    checkpoints.load_t5x_checkpoint('gs://fake-bucket/models/absent')
