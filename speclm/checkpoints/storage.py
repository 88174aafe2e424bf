"""Paths and bytes of checkpoints, local or on Google Cloud Storage (gs://, through
TensorStore's key-value stores): reading, writing atomically, joining, existence."""

from __future__ import annotations

import os
import posixpath
import re

from speclm.checkpoints.validate import CheckpointError



def is_gcs(path: str) -> bool:
  """Whether `path` is a gs:// URL."""
  return path.startswith('gs://')


def split_gcs(path: str) -> tuple[str, str]:
  """(bucket, object prefix) of a gs:// path."""
  m = re.fullmatch(r'gs://([^/]+)/?(.*)', path, re.DOTALL)
  if m is None:
    raise CheckpointError(f'Malformed GCS path: {path}')
  return m.group(1), m.group(2)


def join(base: str, *parts: str) -> str:
  """`base`/`parts`, with / for gs:// paths and the OS separator for local ones."""
  return posixpath.join(base, *parts) if is_gcs(base) else os.path.join(base, *parts)


def kvstore_spec(path: str) -> dict:
  """TensorStore kvstore spec of a local or gs:// path (the one place drivers are chosen)."""
  if is_gcs(path):
    bucket, prefix = split_gcs(path)
    return {'driver': 'gcs', 'bucket': bucket, 'path': prefix}
  return {'driver': 'file', 'path': path}


def gcs_kvstore(path: str):
  """(KvStore of the directory holding `path`, key of `path` in it)."""
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  parent, key = posixpath.split(path.rstrip('/'))
  spec = kvstore_spec(parent + '/')
  return ts.KvStore.open(spec).result(), key


def read_bytes(path: str) -> bytes:
  """The bytes of a local or gs:// file; `CheckpointError` when it cannot be read."""
  if is_gcs(path):
    try:
      store, key = gcs_kvstore(path)
      result = store.read(key).result()
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'Cannot read {path}: {e}') from e
    if result.state != 'value':
      raise CheckpointError(f'Checkpoint file not found: {path}')
    return bytes(result.value)
  if not os.path.isfile(path):
    raise CheckpointError(f'Checkpoint file not found: {path}')
  with open(path, 'rb') as f:
    return f.read()


def write_bytes(path: str, data: bytes) -> None:
  """Writes a local file atomically (it appears only once complete), or a gs:// object."""
  if is_gcs(path):
    store, key = gcs_kvstore(path)
    store.write(key, data).result()
    return
  tmp = path + '.tmp'
  with open(tmp, 'wb') as f:
    f.write(data)
  os.replace(tmp, path)  # the msgpack appears only once complete


def exists(path: str) -> bool:
  """Whether a local path or gs:// object exists."""
  if is_gcs(path):
    try:
      store, key = gcs_kvstore(path)
      return store.read(key).result().state == 'value'
    except Exception:  # pylint: disable=broad-except
      return False
  return os.path.exists(path)


def checkpoint_file(path: str) -> tuple[str, str]:
  """(msgpack file, directory its relative zarr paths start from) for a dir or a file path."""
  path = os.fspath(path)
  if is_gcs(path):
    path = path.rstrip('/')
    candidate = join(path, 'checkpoint')
    if exists(candidate):
      return candidate, path
    return path, posixpath.dirname(path)
  if os.path.isdir(path):
    return os.path.join(path, 'checkpoint'), path
  return path, os.path.dirname(os.path.abspath(path))
