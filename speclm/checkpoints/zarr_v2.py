"""Local zarr v2 arrays read with numpy alone, for checkpoints whose `.zarray` files are gone.

A T5X checkpoint copied without its hidden files keeps every chunk but loses `.zarray`; the
TensorStore spec in its msgpack still carries the metadata (shape, chunks, compressor), so the
chunks can be read without TensorStore, which needs `.zarray` to open the array.

Public functions:
  dtype_of(name)                                   -> numpy dtype of a zarr dtype name
  local_metadata(array_dir, spec)                  -> `.zarray` if present, else the spec's
  chunk_keys(shape, chunks, separator)             -> the chunk file names, in C order
  read_numpy(array_dir, metadata, dtype, name)     -> the whole array
"""

from __future__ import annotations

import gzip
import json
import os
import zlib

import ml_dtypes
import numpy as np

from speclm.checkpoints.validate import CheckpointError

_DTYPES = {'bfloat16': np.dtype(ml_dtypes.bfloat16)}


def dtype_of(name: str) -> np.dtype:
  """The numpy dtype of the zarr dtype name `name` ('bfloat16' included)."""
  return _DTYPES.get(name) or np.dtype(name)


def local_metadata(array_dir: str, spec: dict) -> dict:
  """The zarr metadata of the array in `array_dir`: its `.zarray` file when there, else the
  `metadata` of its TensorStore `spec`."""
  zarray = os.path.join(array_dir, '.zarray')
  if os.path.isfile(zarray):
    with open(zarray) as f:
      return json.load(f)
  return dict(spec.get('metadata', {}))


def chunk_keys(shape, chunks, separator: str) -> list[str]:
  """The file names of every chunk of an array of `shape` cut in `chunks`, in C order."""
  grid = [max(1, -(-s // c)) for s, c in zip(shape, chunks)]
  if not grid:
    return ['0']
  return [separator.join(str(i) for i in idx) for idx in np.ndindex(*grid)]


def read_numpy(array_dir: str, metadata: dict, dtype: np.dtype, name: str) -> np.ndarray:
  """Reads a local zarr v2 array without TensorStore (raw, gzip or zlib chunks).

  Args:
    array_dir: the array's directory, holding one file per chunk.
    metadata: its zarr metadata (shape, chunks, compressor, order, dimension_separator).
    dtype: the dtype of its elements.
    name: the parameter's name, for errors.
  Returns:
    The array, of `metadata['shape']`.
  """
  shape = tuple(int(d) for d in metadata['shape'])
  chunks = tuple(int(d) for d in metadata.get('chunks') or shape)
  compressor = metadata.get('compressor')
  order = metadata.get('order', 'C')
  out = np.zeros(shape, dtype)
  separator = metadata.get('dimension_separator', '.')
  for key in chunk_keys(shape, chunks, separator):
    path = os.path.join(array_dir, key)
    with open(path, 'rb') as f:
      raw = f.read()
    try:
      if compressor is None:
        data = raw
      elif compressor.get('id') == 'gzip':
        data = gzip.decompress(raw)
      elif compressor.get('id') == 'zlib':
        data = zlib.decompress(raw)
      else:
        raise CheckpointError(f'{name}: zarr compressor {compressor!r} is not supported without'
                              f' a .zarray file (TensorStore reads it when present): {array_dir}')
      chunk = np.frombuffer(data, dtype).reshape(chunks or (), order=order)
    except CheckpointError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'Corrupt or truncated zarr chunk of {name}: {path} ({e})') from e
    index = tuple(int(i) for i in key.split(separator)) if shape else ()
    region = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(index, chunks, shape))
    out[region] = chunk[tuple(slice(0, r.stop - r.start) for r in region)]
  return out
