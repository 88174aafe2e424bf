"""`speclm.data.draft_shards`: the work-dir file names and the memory-mapped reading of
feature files."""

import numpy as np
import pytest

from speclm.data import draft_shards


def test_feature_and_label_files_sit_beside_their_shard():
  shard = '/w/gen_own_0007.npz'
  assert draft_shards.feature_file(shard, (2, 15, 27)) == '/w/feat-l2-15-27_own_0007.npz'
  assert draft_shards.feature_file(shard, None) == '/w/feat_own_0007.npz'
  assert draft_shards.label_file(shard) == '/w/label_own_0007.npz'


def test_stored_members_are_mapped_not_read(tmp_path):
  path = str(tmp_path / 'feat_x.npz')
  features = np.arange(3 * 5 * 7, dtype=np.uint16).reshape(3, 5, 7)
  fortran = np.asfortranarray(np.arange(12, dtype=np.float16).reshape(3, 4))
  draft_shards.save_npz(path, features=features, seconds=np.float64(1.5), fortran=fortran)
  mapped = draft_shards.load_array(path, 'features')
  assert isinstance(mapped, np.memmap) and not mapped.flags.writeable
  np.testing.assert_array_equal(mapped, features)
  np.testing.assert_array_equal(mapped[1, :3], features[1, :3])
  assert float(draft_shards.load_array(path, 'seconds')) == 1.5
  np.testing.assert_array_equal(draft_shards.load_array(path, 'fortran'), fortran)
  with pytest.raises(KeyError):
    draft_shards.load_array(path, 'missing')


def test_compressed_members_are_read_whole(tmp_path):
  path = str(tmp_path / 'feat_y.npz')
  features = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
  np.savez_compressed(path, features=features)
  loaded = draft_shards.load_array(path, 'features')
  assert not isinstance(loaded, np.memmap)
  np.testing.assert_array_equal(loaded, features)
