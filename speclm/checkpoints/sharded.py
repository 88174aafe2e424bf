"""Checkpoints read straight into their shards: each device's slice, never the whole model.

`jax.make_array_from_callback(shape, sharding, read)` asks for one index (a tuple of slices)
per local device; `read` fetches just that region from the file:
  * T5X legacy checkpoints: zarr arrays through TensorStore (`store[index].read()`), so only
    the chunks overlapping the slice are fetched and decompressed (local or gs://). Inline
    msgpack arrays are tiny (T5X keeps only small arrays inline) and are decoded whole.
  * safetensors: the `safetensors` library reads just the slice (`get_slice`) from the
    memory-mapped file, so only the slice's bytes are read.
    Hugging Face Llama weights are `[out, in]`; the slice is mapped through the transpose
    and head reshape, still reading only the rows and columns the device needs.
A region replicated on several local devices is read once. With `devices='global'` meshes
every process reads only the slices of its own devices.

Public functions:
  load_t5x_sharded(path, definition, partitioner, role='target', read_log=None)
  load_hf_llama_sharded(directory, partitioner, role='target', dtype='float32', read_log=None)
  array_from_reader(shape, dtype, sharding, read, name, read_log=None)

`read_log`, when a list, receives (name, shape read) for every read: tests use it to prove no
read covered more than a device's slice.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import numpy as np

from speclm import protocol
from speclm import trees
from speclm.checkpoints import safetensors_io
from speclm.checkpoints import t5x
from speclm.checkpoints import validate

Index = tuple  # a tuple of slices, one per dimension, as make_array_from_callback passes them


def _bounds(index: Index, shape) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def array_from_reader(shape, dtype, sharding: jax.sharding.Sharding,
                      read: Callable[[Index], np.ndarray], name: str = '',
                      read_log: list | None = None) -> jax.Array:
  """A global array whose every local shard comes from `read(index)` (one read per region)."""
  shape = tuple(int(d) for d in shape)
  dtype = np.dtype(dtype)
  cache: dict[Any, np.ndarray] = {}

  def callback(index: Index) -> np.ndarray:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    key = _bounds(index, shape)
    if key not in cache:
      index = tuple(slice(a, b) for a, b in key)
      arr = np.asarray(read(index))
      want = tuple(b - a for a, b in key)
      if arr.shape != want:
        raise t5x.CheckpointError(f'Reading {name}{list(key)} gave shape {arr.shape}, expected'
                                  f' {want}.')
      if read_log is not None:
        read_log.append((name, arr.shape))
      cache[key] = t5x.cast_array(arr, dtype)
    return cache[key]

  return jax.make_array_from_callback(shape, sharding, callback)


# ----------------------------------------------------------------------------------------------
# T5X legacy checkpoints (msgpack + zarr through TensorStore)


def load_t5x_sharded(path: str | os.PathLike, definition, partitioner, role: str = 'target',
                     read_log: list | None = None) -> dict:
  """A legacy T5X checkpoint's parameters for the T5 `definition`, placed in the shards the
  `partitioner` gives them (by `definition.param_logical_axes()`), each device reading only
  its slice. Names and shapes are checked before any array is read; values are cast to the
  config's `param_dtype`.
  """
  expected = definition.param_shapes()
  target = t5x.open_t5x_target(path)
  flat_expected = trees.flatten(expected)
  target.check_names(flat_expected)
  target.check_locations()  # every zarr path inside the directory, before any read
  shardings = trees.flatten(partitioner.param_shardings(definition, expected, role))
  out = {}
  for name in target.leaves:
    want = flat_expected[name]
    if target.is_zarr(name):
      target.check_shape(name, target.stored_shape(name), want.shape)
      store = target.open_zarr(name)
      if store is None:  # no .zarray (copied without hidden files): read whole with numpy
        whole = target.read(name)
        read = lambda index, whole=whole: whole[index]
      else:
        read = lambda index, store=store: store[index].read().result()
    else:
      whole = target.read(name)
      target.check_shape(name, whole.shape, want.shape)
      read = lambda index, whole=whole: whole[index]
    out[name] = array_from_reader(want.shape, want.dtype, shardings[name], read, name, read_log)
  validate.check_finite(out, target.source, role=role)
  return trees.unflatten(out)


# ----------------------------------------------------------------------------------------------
# Hugging Face Llama (safetensors)


def _hf_readers(config, files: safetensors_io.Tensors
                ) -> dict[str, tuple[tuple[int, ...], Callable[[Index], np.ndarray]]]:
  """Our parameter name -> (shape, read(index)) over HF's `[out, in]` tensors, for every
  family `hf_llama.weight_names` maps."""
  from speclm.checkpoints import hf_llama  # pylint: disable=g-import-not-at-top
  h = config.head_dim

  def region(name, shape, index):
    """The region `index` of HF tensor `name` (checked to have `shape`): only its bytes."""
    if name not in files:
      raise ValueError(f'The checkpoint lacks {name!r}.')
    got = files.shape(name)
    if tuple(got) != tuple(shape):
      raise ValueError(f'{name!r} has shape {tuple(got)}, the config expects {tuple(shape)}.')
    return files.read(name, index)

  def same(name, shape):
    return shape, lambda index: region(name, shape, index)

  def transposed(name, shape):  # ours [in, out] = HF [out, in].T
    return shape[::-1], lambda index: region(name, shape, index[::-1]).T

  def heads_in(name, shape):  # ours [D, heads, H] from HF [heads*H, D]
    heads, d = shape[0] // h, shape[1]
    def read(index):
      sd, sn, sh = index
      rows = region(name, shape, (slice(sn.start * h, sn.stop * h), sd))  # [n*H, d]
      return rows.reshape(sn.stop - sn.start, h, -1)[:, sh, :].transpose(2, 0, 1)
    return (d, heads, h), read

  def heads_out(name, shape):  # ours [N, H, D] from HF [D, N*H]
    d, n = shape[0], shape[1] // h
    def read(index):
      sn, sh, sd = index
      cols = region(name, shape, (sd, slice(sn.start * h, sn.stop * h)))  # [d, n*H]
      return cols.reshape(-1, sn.stop - sn.start, h)[:, :, sh].transpose(1, 2, 0)
    return (n, h, d), read

  def heads_bias(name, shape):  # ours [heads, H] from HF [heads*H]
    def read(index):
      sn, sh = index
      return region(name, shape, (slice(sn.start * h, sn.stop * h),)).reshape(-1, h)[:, sh]
    return (shape[0] // h, h), read

  layouts = {'same': same, 'transposed': transposed, 'heads_in': heads_in,
             'heads_out': heads_out, 'heads_bias': heads_bias}
  names = hf_llama.weight_names(config, hf_llama.decoder_prefix(files))
  return {ours: layouts[layout](theirs, shape) for ours, (theirs, layout, shape) in names.items()}


def load_hf_llama_sharded(directory: str | os.PathLike, partitioner, role: str = 'target',
                          dtype: str = 'float32', read_log: list | None = None
                          ) -> protocol.Model:
  """A Hugging Face directory of any `hf_llama` family as a `Model` whose parameters are read
  shard by shard."""
  from speclm.checkpoints import hf_llama  # pylint: disable=g-import-not-at-top
  from speclm.models import llama  # pylint: disable=g-import-not-at-top
  directory = os.fspath(directory)
  config = hf_llama.config_from_hf(hf_llama.read_config(directory), dtype=dtype)
  paths = sorted(p for p in os.listdir(directory) if p.endswith('.safetensors'))
  if not paths:
    raise FileNotFoundError(f'No *.safetensors files in {directory!r}.')
  files = safetensors_io.Tensors([os.path.join(directory, path) for path in paths])
  if not config.tie_embeddings and 'lm_head.weight' not in files:
    config = dataclasses.replace(config, tie_embeddings=True)
  definition = llama.Llama(config)
  expected = jax.eval_shape(definition.init_params, jax.random.key(0))
  shardings = trees.flatten(partitioner.param_shardings(definition, expected, role))
  flat_expected = trees.flatten(expected)
  readers = _hf_readers(config, files)
  out = {}
  for name, want in flat_expected.items():
    shape, read = readers[name]
    if tuple(shape) != tuple(want.shape):
      raise ValueError(f'{name}: checkpoint shape {shape}, config expects {want.shape}.')
    out[name] = array_from_reader(want.shape, want.dtype, shardings[name], read, name, read_log)
  validate.check_finite(out, directory, role=role, error=ValueError)
  return protocol.Model(definition, trees.unflatten(out))
