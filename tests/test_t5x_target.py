"""The public reader of legacy T5X checkpoints, one parameter at a time (t5x.open_t5x_target):
what speclm.checkpoints.sharded builds on."""

import os

import ml_dtypes
import numpy as np
import pytest

from speclm import trees
from speclm.checkpoints import t5x
from speclm.models import t5


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """(checkpoint directory, flat parameters) of a tiny T5 with zarr and inline arrays."""
  model = t5.random_model(vocab_size=48, emb_dim=16, seed=0)
  directory = tmp_path_factory.mktemp('t5x') / 'checkpoint_0'
  t5x.save_t5x_checkpoint(directory, model.params, zarr_min_bytes=2048)
  return directory, trees.flatten(model.params)


def test_the_target_indexes_every_parameter_and_reads_each_whole(saved):
  directory, flat = saved
  target = t5x.open_t5x_target(directory)
  assert target.prefix == 'target'
  assert target.source == os.path.join(directory, 'checkpoint')
  assert set(target.leaves) == set(flat)
  zarr = [name for name in flat if target.is_zarr(name)]
  assert zarr and len(zarr) < len(flat)  # both kinds are present
  for name, value in flat.items():
    if target.is_zarr(name):
      assert target.stored_shape(name) == value.shape  # from the spec: nothing read
    np.testing.assert_array_equal(target.read(name), value)
  target.check_names(flat)
  target.check_locations()


def test_a_zarr_store_reads_one_region(saved):
  directory, flat = saved
  target = t5x.open_t5x_target(directory)
  name = next(n for n in flat if target.is_zarr(n) and flat[n].ndim == 2)
  store = target.open_zarr(name)
  region = store[1:3, :4].read().result()
  np.testing.assert_array_equal(region, flat[name][1:3, :4])


def test_checks_name_what_differs(saved):
  directory, flat = saved
  target = t5x.open_t5x_target(directory)
  fewer = dict(list(flat.items())[1:])
  with pytest.raises(t5x.CheckpointError, match=r'unexpected \[.' + list(flat)[0][:8]):
    target.check_names(fewer)
  with pytest.raises(t5x.CheckpointError, match=r'has shape \(2, 3\), the model config expects'
                                                 r' \(3, 2\)'):
    target.check_shape('x', (2, 3), (3, 2))


def test_cast_array_reads_uint16_as_bfloat16_bits():
  bits = np.array([0x3F80, 0x4000], np.uint16)  # 1.0 and 2.0 as bfloat16
  np.testing.assert_array_equal(t5x.cast_array(bits, np.float32), [1.0, 2.0])
  assert t5x.cast_array(bits, None) is bits
  assert t5x.cast_array(bits, ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
