"""A small, dependency-free reader and writer of the safetensors format.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(`{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`),
then the raw little-endian tensor bytes, offsets relative to the end of the header. Nothing is
executed while reading (unlike pickle-based `.bin` checkpoints, which we refuse).

Reading memory-maps the file, so a tensor costs memory only when it is used. bfloat16 and the
float8 types come from `ml_dtypes`, which JAX already depends on.
"""

from __future__ import annotations

import json
import os
import struct as _struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    'F64': np.dtype('<f8'), 'F32': np.dtype('<f4'), 'F16': np.dtype('<f2'),
    'BF16': np.dtype(ml_dtypes.bfloat16), 'F8_E4M3': np.dtype(ml_dtypes.float8_e4m3fn),
    'F8_E5M2': np.dtype(ml_dtypes.float8_e5m2), 'I64': np.dtype('<i8'), 'I32': np.dtype('<i4'),
    'I16': np.dtype('<i2'), 'I8': np.dtype('i1'), 'U64': np.dtype('<u8'), 'U32': np.dtype('<u4'),
    'U16': np.dtype('<u2'), 'U8': np.dtype('u1'), 'BOOL': np.dtype('?'),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 2**20


class SafetensorsError(ValueError):
  """A malformed, truncated or missing safetensors file; the message names the path."""


class SafetensorsFile(Mapping[str, np.ndarray]):
  """Read-only mapping name -> numpy array (memory-mapped) of one `.safetensors` file."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    if not os.path.isfile(self.path):
      raise SafetensorsError(f'Safetensors file not found: {self.path}')
    size = os.path.getsize(self.path)
    with open(self.path, 'rb') as f:
      head = f.read(8)
      if len(head) < 8:
        raise SafetensorsError(f'Truncated safetensors file (no header): {self.path}')
      (header_len,) = _struct.unpack('<Q', head)
      if header_len > min(_MAX_HEADER, size - 8):
        raise SafetensorsError(f'Corrupt or truncated safetensors file (header of {header_len}'
                               f' bytes in a file of {size}): {self.path}')
      try:
        header = json.loads(f.read(header_len))
      except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f'Corrupt safetensors header in {self.path}: {e}') from e
    if not isinstance(header, dict):
      raise SafetensorsError(f'Corrupt safetensors header in {self.path}: not a JSON object.')
    self.metadata = header.pop('__metadata__', None) or {}
    self._data_start = 8 + header_len
    data_size = size - self._data_start
    self._entries = {}
    for name, info in header.items():
      try:
        dtype = _DTYPES[info['dtype']]
        shape = tuple(int(d) for d in info['shape'])
        begin, end = (int(o) for o in info['data_offsets'])
      except (KeyError, TypeError, ValueError) as e:
        raise SafetensorsError(f'Corrupt safetensors entry {name!r} in {self.path}: {info!r}'
                               ) from e
      if end > data_size:
        raise SafetensorsError(f'Truncated safetensors file: tensor {name!r} needs bytes up to'
                               f' {end} of the data section, which has {data_size}:'
                               f' {self.path}')
      if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise SafetensorsError(f'Corrupt safetensors entry {name!r} in {self.path}: shape'
                               f' {shape} of {info["dtype"]} does not fill {end - begin} bytes.')
      self._entries[name] = (dtype, shape, begin)
    self._mmap = None

  def _map(self) -> np.ndarray:
    if self._mmap is None:
      if os.path.getsize(self.path) == self._data_start:
        self._mmap = np.zeros((0,), np.uint8)
      else:
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode='r', offset=self._data_start)
    return self._mmap

  def __getitem__(self, name: str) -> np.ndarray:
    dtype, shape, begin = self._entries[name]
    count = int(np.prod(shape, dtype=np.int64))
    raw = self._map()[begin:begin + count * dtype.itemsize]
    return raw.view(dtype).reshape(shape)

  def shape(self, name: str) -> tuple[int, ...]:
    return self._entries[name][1]

  def __iter__(self) -> Iterator[str]:
    return iter(self._entries)

  def __len__(self) -> int:
    return len(self._entries)


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None) -> None:
  """Writes `tensors` (name -> array) as one safetensors file."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    arr = np.ascontiguousarray(np.asarray(tensors[name]))
    dtype = arr.dtype.newbyteorder('<') if arr.dtype.byteorder == '>' else arr.dtype
    if dtype not in _NAMES:
      raise ValueError(f'Tensor {name!r} has dtype {arr.dtype}, which safetensors cannot store.')
    arr = arr.astype(dtype, copy=False)
    header[name] = {'dtype': _NAMES[dtype], 'shape': list(arr.shape),
                    'data_offsets': [offset, offset + arr.nbytes]}
    offset += arr.nbytes
    arrays.append(arr)
  if metadata:
    header['__metadata__'] = {str(k): str(v) for k, v in metadata.items()}
  blob = json.dumps(header, separators=(',', ':')).encode()
  blob += b' ' * (-len(blob) % 8)  # align the data section to 8 bytes
  with open(path, 'wb') as f:
    f.write(_struct.pack('<Q', len(blob)))
    f.write(blob)
    for arr in arrays:
      f.write(arr.tobytes())
