"""Safetensors checkpoints through the `safetensors` library, plus the little it leaves to us.

The library parses and validates the file (header, offsets, dtypes; nothing is executed,
unlike pickle-based `.bin` checkpoints, which speclm refuses), memory-maps it, and reads a
tensor, or only a region of one (`get_slice`), when asked. Writing is the library's too:
`safetensors.numpy.save_file`. What it does not do, and this module does:

  * name the file in its errors: the library's messages ('Error while deserializing header:
    incomplete metadata, file not fully covered') do not say which file of a sharded
    checkpoint failed, nor do they read as a checkpoint error. `open_file` raises
    `error(...)` (ValueError, or the caller's `CheckpointError`) naming the path;
  * bfloat16 with `framework='numpy'`: the library returns NumPy's 'bfloat16' dtype, which
    exists only once `ml_dtypes` is imported (JAX imports it, but a process may read a file
    before importing JAX). This module imports it;
  * one mapping over the shards of a checkpoint directory: `Tensors(paths)` is name ->
    tensor, each tensor read when it is used (whole: `tensors[name]`; a region:
    `tensors.read(name, index)`, which reads only the bytes of that region), so a loader
    costs the memory of the tensor it is converting, not of the checkpoint.
"""

from __future__ import annotations

import os
from typing import Iterator, Mapping, Sequence

import ml_dtypes  # pylint: disable=unused-import  # registers NumPy's 'bfloat16' for the library
import numpy as np
import safetensors


def open_file(path: str | os.PathLike, error: type[Exception] = ValueError):
  """`safetensors.safe_open(path, framework='numpy')`; a missing, truncated or corrupt file
  raises `error` with a message naming `path`."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise error(f'Safetensors file not found: {path}')
  try:
    return safetensors.safe_open(path, framework='numpy')
  except safetensors.SafetensorError as e:
    raise error(f'Truncated or corrupt safetensors file {path}: {e}') from e


class Tensors(Mapping[str, np.ndarray]):
  """Read-only mapping name -> numpy array over one or more `.safetensors` files (shards).

  Opening reads the headers only; `tensors[name]` reads that tensor, `read(name, index)` one
  region of it. A name stored in several files is read from the last of `paths`.
  """

  def __init__(self, paths: Sequence[str | os.PathLike], error: type[Exception] = ValueError):
    self._error = error
    self._files: dict[str, tuple[str, object]] = {}
    for path in paths:
      path = os.fspath(path)
      handle = open_file(path, error)
      for name in handle.keys():
        self._files[name] = (path, handle)

  def path(self, name: str) -> str:
    """The file holding `name`."""
    return self._files[name][0]

  def shape(self, name: str) -> tuple[int, ...]:
    """The tensor's shape, from the header (nothing is read)."""
    return tuple(int(d) for d in self._files[name][1].get_slice(name).get_shape())

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """The region `index` (one slice per dimension, steps of 1) of a tensor; only its bytes
    are read."""
    return self._files[name][1].get_slice(name)[tuple(index)]

  def __getitem__(self, name: str) -> np.ndarray:
    path, handle = self._files[name]
    try:
      return handle.get_tensor(name)
    except safetensors.SafetensorError as e:
      raise self._error(f'Cannot read tensor {name!r} from {path}: {e}') from e

  def __contains__(self, name) -> bool:
    return name in self._files

  def __iter__(self) -> Iterator[str]:
    return iter(self._files)

  def __len__(self) -> int:
    return len(self._files)


__all__ = ['Tensors', 'open_file']
