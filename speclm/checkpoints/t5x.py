"""T5X checkpoints: the legacy msgpack + TensorStore format (read and write) and Orbax (read).

Legacy layout of `checkpoint_<step>/`:
  checkpoint                 msgpack of {'version': 3, 'target': {...}, 'state': {...}} (older
                             checkpoints nest them as {'optimizer': {'target', 'state'}}).
                             Small arrays are inline as msgpack extension types (code 1: array,
                             code 3: numpy scalar), each the msgpack of (shape, dtype name, C-order
                             bytes); dtype names include 'bfloat16'. Arrays above 1 GiB may be
                             split by Flax into {'__msgpack_chunked_array__': True, ...}.
  target.encoder.layers_0…   large arrays as zarr v2 (gzip chunks), referenced in the msgpack by
                             a TensorStore spec whose kvstore path is relative to the directory.
                             A path that leads outside the directory (absolute, `..`, another
                             bucket, or a symbolic link out of it) is refused, never read.

Only `target` (the parameters) is read: the optimizer state's inline arrays are never decoded
and its zarr arrays never opened. Nothing is unpickled. Restored parameters holding NaN or Inf
are refused (`speclm.checkpoints.validate.check_finite`). Local paths and `gs://` paths work (the
latter through TensorStore's GCS kvstore, with the usual Google credentials).

Public functions:
  load_t5x_checkpoint(path, expected=None, dtype=None) -> nested dict of numpy arrays
  open_t5x_target(path) -> T5XTarget: the parameters indexed by name, read one at a time
                           (checks, whole reads, TensorStore handles for region reads)
  cast_array(arr, dtype)                               -> the cast every reader applies
  save_t5x_checkpoint(directory, params, step=0)       -> writes the legacy format
  save_t5x_train_state(directory, params, step=0)      -> the same as T5X's Checkpointer lays it
                                                          out (optimizer/target + Adafactor state)
  load_orbax_checkpoint(path, expected=None, dtype=None)
  load_checkpoint(path, …)                             -> detects legacy vs Orbax
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import posixpath
from typing import Any, Mapping

import jax
import ml_dtypes
import msgpack
import numpy as np

from speclm import trees
from speclm.checkpoints import errors
from speclm.checkpoints import storage
from speclm.checkpoints import zarr_v2
from speclm.checkpoints.validate import CheckpointError
from speclm.checkpoints.validate import check_finite

SUPPORTED_VERSIONS = (1, 2, 3)
WRITE_VERSION = 3
_EXT_ARRAY = 1
_EXT_SCALAR = 3
# Arrays at least this large go to zarr when writing (T5X keeps only tiny ones inline).
DEFAULT_ZARR_MIN_BYTES = 1 << 16
_CHUNK_TARGET_BYTES = 64 << 20
_READ_THREADS = 8


# ----------------------------------------------------------------------------------------------
# msgpack decoding


class _Inline:
  """An inline array kept as bytes until (unless) it is needed."""

  __slots__ = ('code', 'data')

  def __init__(self, code: int, data: bytes):
    self.code, self.data = code, data


def _dtype_from_name(name) -> np.dtype:
  if isinstance(name, bytes):
    name = name.decode()
  if name == 'bfloat16':
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def _decode_inline(leaf: _Inline, name: str, source: str) -> np.ndarray:
  try:
    shape, dtype_name, buffer = msgpack.unpackb(leaf.data, raw=True)
    dtype = _dtype_from_name(dtype_name)
    shape = tuple(int(d) for d in shape)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(buffer) != expected:
      raise ValueError(f'{len(buffer)} bytes for shape {shape} of {dtype} ({expected} needed)')
    arr = np.frombuffer(buffer, dtype=dtype).reshape(shape)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'Corrupt inline array {name} in {source}: {e}') from e
  return arr


def _parse_msgpack(data: bytes, source: str) -> dict:
  try:
    state = msgpack.unpackb(data, ext_hook=_Inline, raw=False, strict_map_key=False)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'Corrupt or truncated T5X checkpoint file {source}: {e}') from e
  if not isinstance(state, dict):
    raise CheckpointError(f'{source} is not a T5X checkpoint (top level is not a map).')
  version = state.get('version')
  if version not in SUPPORTED_VERSIONS:
    raise CheckpointError(f'{source}: unsupported T5X checkpoint version {version!r} (expected'
                          f' one of {SUPPORTED_VERSIONS}).')
  return state


def _target(state: dict, source: str) -> dict:
  if isinstance(state.get('target'), dict):
    return state['target']
  optimizer = state.get('optimizer')
  if isinstance(optimizer, dict) and isinstance(optimizer.get('target'), dict):
    return optimizer['target']
  raise CheckpointError(f'{source} holds no parameters: neither "target" nor'
                        ' "optimizer/target" is present.')


def _target_prefix(state: dict) -> str:
  """The msgpack path of the tree `_target` returns ('target' or 'optimizer/target')."""
  return 'target' if isinstance(state.get('target'), dict) else 'optimizer/target'


def _is_ts_spec(node) -> bool:
  return isinstance(node, dict) and 'driver' in node and ('kvstore' in node or 'path' in node)


def _is_chunked(node) -> bool:
  return isinstance(node, dict) and '__msgpack_chunked_array__' in node


def _flatten(tree: dict) -> dict[str, Any]:
  """A msgpack tree by parameter name; TensorStore specs and chunked arrays stay whole."""
  return trees.flatten(tree, is_leaf=lambda node: _is_ts_spec(node) or _is_chunked(node))


# ----------------------------------------------------------------------------------------------
# zarr arrays


def _spec_shape(spec: dict, name: str, source: str) -> tuple[int, ...]:
  try:
    return tuple(int(d) for d in spec['metadata']['shape'])
  except (KeyError, TypeError) as e:
    raise CheckpointError(f'TensorStore spec of {name} in {source} has no metadata.shape:'
                          f' {spec!r}') from e


def _relative_path(spec: dict) -> str:
  kvstore = spec.get('kvstore')
  if isinstance(kvstore, dict) and 'path' in kvstore:
    return kvstore['path']
  return spec['path']  # tensorstore < 0.1.14 wrote the path at the top level


def _outside(message_rel: str, name: str, source: str) -> CheckpointError:
  return CheckpointError(f"T5X checkpoint {source}: array '{name}' points outside the checkpoint"
                         f' directory ({message_rel}); refusing to read it.')


def _within(path: str, root: str) -> bool:
  """Whether `path` lies strictly below `root` (both normalised, same kind of path)."""
  return path != root and path.startswith(root.rstrip('/') + '/')


def _array_location(spec: dict, base_dir: str, name: str, source: str) -> str:
  """Where the zarr array `spec` points, confined to the checkpoint directory `base_dir`.

  The spec's kvstore path is resolved against `base_dir` and must stay inside it after
  normalisation (no absolute paths elsewhere, no `..` out of it, no other bucket); locally,
  symbolic links are resolved too (`os.path.realpath`), the array directory's and those of
  the files in it. Anything else is a CheckpointError naming the array and the path.
  """
  try:
    rel = _relative_path(spec)
  except (KeyError, TypeError) as e:
    raise CheckpointError(f"T5X checkpoint {source}: the TensorStore spec of array '{name}' has"
                          ' no kvstore path.') from e
  if not isinstance(rel, str) or not rel.strip('/'):
    raise _outside(repr(rel), name, source)
  if storage.is_gcs(base_dir):
    bucket, prefix = storage.split_gcs(base_dir)
    root = posixpath.normpath('/' + prefix)
    if storage.is_gcs(rel):  # counts only if it names an object under this very directory
      rel_bucket, rel_key = storage.split_gcs(rel)
      if rel_bucket != bucket:
        raise _outside(rel, name, source)
      key = posixpath.normpath('/' + rel_key)
    elif rel.startswith('/') or os.path.isabs(rel):
      raise _outside(rel, name, source)  # a local path from a GCS checkpoint
    else:
      key = posixpath.normpath(posixpath.join(root, rel))
    if not _within(key, root):
      raise _outside(rel, name, source)
    return f'gs://{bucket}{key}'
  if storage.is_gcs(rel):
    raise _outside(rel, name, source)
  root = os.path.normpath(os.path.abspath(base_dir))
  where = os.path.normpath(os.path.join(root, rel))  # an absolute `rel` replaces `root`
  if not _within(where, root):
    raise _outside(rel, name, source)
  real_root = os.path.realpath(root)
  real = os.path.realpath(where)
  if not _within(real, real_root):
    raise _outside(f'{rel}, a link to {real}', name, source)
  if os.path.isdir(where):  # links among its files (chunks, .zarray) must stay inside too
    for directory, subdirs, files in os.walk(where):
      for entry in subdirs + files:
        path = os.path.join(directory, entry)
        if os.path.islink(path) and not _within(os.path.realpath(path), real_root):
          raise _outside(f'{os.path.relpath(path, root)}, a link to {os.path.realpath(path)}',
                         name, source)
  return where


def _read_zarr(spec: dict, base_dir: str, name: str, source: str) -> np.ndarray:
  where = _array_location(spec, base_dir, name, source)
  if storage.is_gcs(where):
    kvstore = storage.kvstore_spec(where)
  else:
    array_dir = where
    if not os.path.isdir(array_dir):
      raise CheckpointError(f'Missing zarr array for {name}: {array_dir} (referenced by'
                            f' {source}).')
    metadata = zarr_v2.local_metadata(array_dir, spec)
    separator = metadata.get('dimension_separator', '.')
    shape = tuple(int(d) for d in metadata['shape'])
    for key in zarr_v2.chunk_keys(shape, metadata.get('chunks') or shape, separator):
      if not os.path.isfile(os.path.join(array_dir, key)):
        raise CheckpointError(f'Missing zarr chunk of {name}: {os.path.join(array_dir, key)}')
    if not os.path.isfile(os.path.join(array_dir, '.zarray')):
      dtype_name = spec.get('dtype') or metadata.get('dtype')
      if not dtype_name:
        raise CheckpointError(f'Zarr array {name} has neither .zarray nor a dtype in its spec:'
                              f' {array_dir}')
      return zarr_v2.read_numpy(array_dir, metadata, zarr_v2.dtype_of(dtype_name), name)
    kvstore = storage.kvstore_spec(array_dir)
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  try:
    store = ts.open({'driver': 'zarr', 'kvstore': kvstore}, open=True, read=True).result()
    arr = np.asarray(store.read().result())
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'Cannot read zarr array {name} at {where}: {e}') from e
  return arr


# ----------------------------------------------------------------------------------------------
# Reading


def cast_array(arr: np.ndarray, dtype) -> np.ndarray:
  """`arr` as `dtype` (unchanged when None); a uint16 array read as bfloat16 is reinterpreted.

  Args:
    arr: an array of any shape, as stored.
    dtype: the wanted dtype, or None to keep the stored one.
  """
  if dtype is None:
    return arr
  dtype = np.dtype(dtype)
  if arr.dtype == np.uint16 and dtype != np.uint16:
    # Old T5X checkpoints stored bfloat16 in zarr as its uint16 bit pattern.
    arr = arr.view(ml_dtypes.bfloat16)
  return arr if arr.dtype == dtype else arr.astype(dtype)


def _check_names(flat_expected: Mapping[str, Any], flat_actual: Mapping[str, Any],
                 source: str) -> None:
  missing = sorted(set(flat_expected) - set(flat_actual))
  extra = sorted(set(flat_actual) - set(flat_expected))
  if missing or extra:
    raise CheckpointError(
        f'The parameters in {source} do not match the model: missing {missing[:5]}'
        f'{" …" if len(missing) > 5 else ""}, unexpected {extra[:5]}'
        f'{" …" if len(extra) > 5 else ""}.')


def _expected_flat(expected) -> dict[str, Any] | None:
  return None if expected is None else trees.flatten(expected)


def _check_shape(name: str, got, want, source: str) -> None:
  if tuple(got) != tuple(want):
    raise CheckpointError(f'Parameter {name} in {source} has shape {tuple(got)}, the model'
                          f' config expects {tuple(want)}.')


def load_t5x_checkpoint(path: str | os.PathLike, expected=None, dtype=None) -> dict:
  """Reads the parameters (`target`) of a legacy T5X checkpoint as a nested dict of numpy.

  Args:
    path: a `checkpoint_<step>` directory (local or gs://) or the msgpack file itself.
    expected: optional tree of arrays or `jax.ShapeDtypeStruct`s (e.g. `T5(config)
      .param_shapes()`): names and shapes are checked before any large array is read, and
      arrays are cast to its dtypes unless `dtype` is given.
    dtype: cast every array to this dtype while reading.
  """
  target = open_t5x_target(path)
  flat_expected = _expected_flat(expected)
  if flat_expected is not None:  # names, then shapes, before reading big arrays
    target.check_names(flat_expected)
    for name in target.leaves:
      got = target.stored_shape(name)
      if got is not None:
        target.check_shape(name, got, flat_expected[name].shape)
  target.check_locations()  # every zarr path inside the directory, before any is read
  # zarr arrays are read concurrently (I/O bound, and GCS has high latency per request).
  with concurrent.futures.ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
    pending = {name: pool.submit(target.read, name)
               for name in target.leaves if target.is_zarr(name)}
    zarr_arrays = {name: future.result() for name, future in pending.items()}
  out = {}
  for name in target.leaves:
    arr = zarr_arrays.pop(name) if target.is_zarr(name) else target.read(name)
    want = dtype
    if flat_expected is not None:
      target.check_shape(name, arr.shape, flat_expected[name].shape)
      want = dtype if dtype is not None else flat_expected[name].dtype
    out[name] = cast_array(arr, want)
  check_finite(out, target.source, role=target.prefix)
  return trees.unflatten(out)


def _decode_leaf(leaf, name: str, source: str) -> np.ndarray:
  """An inline array, a Flax chunked array, or a plain msgpack value, as numpy."""
  if isinstance(leaf, _Inline):
    arr = _decode_inline(leaf, name, source)
    return arr.reshape(()) if leaf.code == _EXT_SCALAR else arr
  if _is_chunked(leaf):
    pieces = [leaf['chunks'][str(i)] for i in range(len(leaf['chunks']))]
    pieces = [_decode_inline(p, name, source) if isinstance(p, _Inline) else p for p in pieces]
    shape = tuple(int(leaf['shape'][str(i)]) for i in range(len(leaf['shape'])))
    return np.concatenate([np.ravel(p) for p in pieces]).reshape(shape)
  return np.asarray(leaf)


def read_t5x_state(path: str | os.PathLike) -> dict:
  """The whole state of a legacy checkpoint (target and optimizer state), every array read.

  For inspection and tests; `load_t5x_checkpoint` is what restores parameters.
  """
  msgpack_path, base_dir = storage.checkpoint_file(os.fspath(path))
  state = _parse_msgpack(storage.read_bytes(msgpack_path), msgpack_path)

  def load(node, prefix):
    if isinstance(node, _Inline) or _is_chunked(node):
      return _decode_leaf(node, prefix, msgpack_path)
    if _is_ts_spec(node):
      return _read_zarr(node, base_dir, prefix, msgpack_path)
    if isinstance(node, dict):
      return {k: load(v, f'{prefix}/{k}' if prefix else str(k)) for k, v in node.items()}
    return node

  return load(state, '')


# ----------------------------------------------------------------------------------------------
# The parameters one array at a time (what the sharded reader builds on)


@dataclasses.dataclass(frozen=True)
class T5XTarget:
  """The parameters (`target`) of a legacy checkpoint, indexed by name, no array read yet.

  Attributes:
    source: the msgpack file, named in every error.
    base_dir: the directory that relative zarr paths start from (local or gs://).
    prefix: where the parameters sit in the msgpack, 'target' or 'optimizer/target'.
    leaves: parameter name ('/'-joined) -> its msgpack leaf (an inline array, a TensorStore
      spec, a Flax chunked array or a plain value), in file order.
  """
  source: str
  base_dir: str
  prefix: str
  leaves: dict[str, Any]

  def check_names(self, flat_expected: Mapping[str, Any]) -> None:
    """Raises a CheckpointError listing missing and unexpected names against `flat_expected`
    (name -> array or `jax.ShapeDtypeStruct`)."""
    _check_names(flat_expected, self.leaves, self.source)

  def check_shape(self, name: str, got, want) -> None:
    """Raises a CheckpointError if the shape `got` of parameter `name` is not `want`."""
    _check_shape(name, got, want, self.source)

  def check_locations(self) -> None:
    """Raises a CheckpointError if any zarr array points outside `base_dir`; reads nothing."""
    for name, leaf in self.leaves.items():
      if _is_ts_spec(leaf):
        _array_location(leaf, self.base_dir, f'{self.prefix}/{name}', self.source)

  def is_zarr(self, name: str) -> bool:
    """Whether parameter `name` is a zarr array (else it is held in the msgpack itself)."""
    return _is_ts_spec(self.leaves[name])

  def stored_shape(self, name: str) -> tuple[int, ...] | None:
    """The shape of parameter `name` read from the msgpack alone; None for an inline array
    (known once decoded, which is cheap)."""
    leaf = self.leaves[name]
    if isinstance(leaf, _Inline):
      return None
    if _is_ts_spec(leaf):
      return _spec_shape(leaf, name, self.source)
    if _is_chunked(leaf):
      return tuple(int(leaf['shape'][str(i)]) for i in range(len(leaf['shape'])))
    return np.shape(leaf)

  def read(self, name: str) -> np.ndarray:
    """Parameter `name` whole, in its stored dtype (zarr or inline)."""
    if self.is_zarr(name):
      return _read_zarr(self.leaves[name], self.base_dir, f'{self.prefix}/{name}', self.source)
    return _decode_leaf(self.leaves[name], name, self.source)

  def open_zarr(self, name: str):
    """A TensorStore handle on zarr parameter `name` that reads any region (`store[index]`),
    or None for a local array without `.zarray` (copied without hidden files: `read` it)."""
    import tensorstore as ts  # pylint: disable=g-import-not-at-top
    where = _array_location(self.leaves[name], self.base_dir, f'{self.prefix}/{name}',
                            self.source)
    if not storage.is_gcs(where) and not os.path.isfile(os.path.join(where, '.zarray')):
      return None
    try:
      return ts.open({'driver': 'zarr', 'kvstore': storage.kvstore_spec(where)},
                     open=True, read=True).result()
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'Cannot open zarr array {self.prefix}/{name} at {where}: {e}') from e


def open_t5x_target(path: str | os.PathLike) -> T5XTarget:
  """The parameters of the legacy checkpoint at `path` (a `checkpoint_<step>` directory, local
  or gs://, or its msgpack file), indexed: only the msgpack file is read."""
  msgpack_path, base_dir = storage.checkpoint_file(os.fspath(path))
  state = _parse_msgpack(storage.read_bytes(msgpack_path), msgpack_path)
  return T5XTarget(msgpack_path, base_dir, _target_prefix(state),
                   _flatten(_target(state, msgpack_path)))


# ----------------------------------------------------------------------------------------------
# Writing


def _encode_inline(arr: np.ndarray, code: int = _EXT_ARRAY) -> msgpack.ExtType:
  arr = np.asarray(arr)  # (np.ascontiguousarray would turn a scalar into shape (1,))
  payload = msgpack.packb((list(arr.shape), arr.dtype.name, arr.tobytes('C')), use_bin_type=True)
  return msgpack.ExtType(code, payload)


def _zarr_chunks(shape: tuple[int, ...], itemsize: int) -> list[int]:
  """One chunk unless it would exceed ~64 MiB; then split the leading axis."""
  if not shape:
    return []
  row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
  rows = max(1, min(shape[0], _CHUNK_TARGET_BYTES // max(row_bytes, 1)))
  return [rows, *shape[1:]]


def _write_zarr(arr: np.ndarray, directory: str, rel: str) -> dict:
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  dtype_name = 'bfloat16' if arr.dtype == ml_dtypes.bfloat16 else arr.dtype.name
  metadata = {'chunks': _zarr_chunks(arr.shape, arr.dtype.itemsize),
              'compressor': {'id': 'gzip', 'level': 1}, 'shape': list(arr.shape)}
  kvstore = storage.kvstore_spec(storage.join(directory, rel))
  stored_driver = 'gcs' if storage.is_gcs(directory) else 'file'
  store = ts.open({'driver': 'zarr', 'dtype': dtype_name, 'kvstore': kvstore,
                   'metadata': metadata}, create=True, delete_existing=True).result()
  store.write(arr).result()
  # The msgpack holds the spec with a path relative to the checkpoint directory, as T5X's.
  return {'driver': 'zarr', 'dtype': dtype_name,
          'kvstore': {'driver': stored_driver, 'path': rel}, 'metadata': metadata}


def save_t5x_checkpoint(directory: str | os.PathLike, params, step: int = 0, *,
                        zarr_min_bytes: int = DEFAULT_ZARR_MIN_BYTES) -> str:
  """Writes `params` as a legacy T5X checkpoint directory (msgpack + zarr); returns its path.

  Arrays of at least `zarr_min_bytes` bytes are written as gzip-compressed zarr arrays named
  `target.<dotted parameter path>`; smaller ones are inline in the msgpack. It is a
  parameters-only checkpoint: the optimizer state holds just the step (`param_states` is
  empty). The msgpack file is written last, so a directory with a `checkpoint` file is
  complete.
  """
  directory = os.fspath(directory)
  if not storage.is_gcs(directory):
    os.makedirs(directory, exist_ok=True)
  flat = trees.flatten(params)
  target = {}
  for name, value in flat.items():
    arr = np.asarray(jax.device_get(value))
    if arr.nbytes >= zarr_min_bytes and arr.ndim > 0:
      target[name] = _write_zarr(arr, directory, 'target.' + name.replace('/', '.'))
    else:
      target[name] = _encode_inline(arr)
  state = {'version': WRITE_VERSION, 'target': trees.unflatten(target),
           'state': {'step': _encode_inline(np.asarray(step, np.int32), _EXT_SCALAR),
                     'param_states': {}}}
  storage.write_bytes(storage.join(directory, 'checkpoint'), msgpack.packb(state, use_bin_type=True))
  return directory


# T5X's Adafactor factors the second moment of a parameter whose two largest axes both have at
# least this many entries (`min_dim_size_to_factor`); other parameters keep it whole.
ADAFACTOR_MIN_DIM_TO_FACTOR = 128


def _adafactor_slots(shape: tuple[int, ...]) -> dict[str, np.ndarray]:
  """Zeroed Adafactor slots of one parameter, as T5X's optimizer state holds them.

  Args:
    shape: the parameter's shape (e.g. [D, N*H] for an attention kernel).

  Returns:
    {'m', 'v', 'v_row', 'v_col'} float32 arrays: `m` is (1,) (no momentum); a factored
    parameter has `v_row` = shape less its last axis, `v_col` = shape less its second-to-last
    and `v` (1,); an unfactored one has `v` = shape and (1,) factors.
  """
  unused = np.zeros((1,), np.float32)
  if len(shape) >= 2 and min(shape[-2:]) >= ADAFACTOR_MIN_DIM_TO_FACTOR:
    return {'m': unused, 'v': unused, 'v_col': np.zeros(shape[:-2] + shape[-1:], np.float32),
            'v_row': np.zeros(shape[:-1], np.float32)}
  return {'m': unused, 'v': np.zeros(shape, np.float32), 'v_col': unused, 'v_row': unused}


def _encode_for_t5x(flat: Mapping[str, Any], directory: str, prefix: str,
                    zarr_min_bytes: int) -> dict:
  """A flat tree as the msgpack holds it: zarr specs for large arrays, inline for the rest.

  Zarr arrays are named `<prefix>.<dotted name>`, and their kvstore path is relative to the
  checkpoint directory with a trailing slash, as T5X's TensorStore specs serialise it.
  """
  out = {}
  for name, value in flat.items():
    arr = np.asarray(jax.device_get(value))
    if arr.nbytes >= zarr_min_bytes and arr.ndim > 0:
      spec = _write_zarr(arr, directory, f'{prefix}.' + name.replace('/', '.'))
      spec['kvstore']['path'] += '/'
      out[name] = spec
    else:
      out[name] = _encode_inline(arr)
  return trees.unflatten(out)


def save_t5x_train_state(directory: str | os.PathLike, params, step: int = 0, *,
                         zarr_min_bytes: int = DEFAULT_ZARR_MIN_BYTES) -> str:
  """Writes `params` as T5X's own Checkpointer lays out a `checkpoint_<step>` directory.

  Unlike `save_t5x_checkpoint` (a parameters-only file), this is the whole train state of a
  T5X run with Adafactor, freshly initialised: the msgpack `checkpoint` holds
  {'version': 3, 'optimizer': {'target': parameters, 'state': {'step', 'param_states'}}},
  where `param_states` has each parameter's zeroed Adafactor slots (`_adafactor_slots`).
  Arrays of at least `zarr_min_bytes` bytes are gzip zarr directories
  `target.<dotted name>` and `state.param_states.<dotted name>.<slot>`; smaller ones are
  inline in the msgpack. The msgpack file is written last, so a directory holding a
  `checkpoint` file is complete. The readers restore `optimizer/target` only.

  Args:
    directory: the checkpoint directory to create (local or gs://), e.g. `…/checkpoint_0`.
    params: nested dict of arrays (T5X parameter names, e.g. `T5(config).init_params(…)`).
    step: the training step recorded in the state.
    zarr_min_bytes: arrays at least this large go to zarr.

  Returns:
    `directory`.
  """
  directory = os.fspath(directory)
  if not storage.is_gcs(directory):
    os.makedirs(directory, exist_ok=True)
  flat = trees.flatten(params)
  slots = {f'{name}/{slot}': value for name, leaf in flat.items()
           for slot, value in _adafactor_slots(tuple(np.shape(leaf))).items()}
  optimizer = {
      'target': _encode_for_t5x(flat, directory, 'target', zarr_min_bytes),
      'state': {'step': _encode_inline(np.asarray(step, np.int32)),
                'param_states': _encode_for_t5x(slots, directory, 'state.param_states',
                                                zarr_min_bytes)}}
  state = {'version': WRITE_VERSION, 'optimizer': optimizer}
  storage.write_bytes(storage.join(directory, 'checkpoint'), msgpack.packb(state, use_bin_type=True))
  return directory


# ----------------------------------------------------------------------------------------------
# Orbax


_ORBAX_MARKERS = ('_METADATA', '_CHECKPOINT_METADATA', 'manifest.ocdbt', 'state/_METADATA',
                  'state/manifest.ocdbt', 'state/checkpoint', 'state/_sharding')


def is_orbax_checkpoint(path: str | os.PathLike) -> bool:
  """Whether `path` looks like an Orbax checkpoint (or a T5X CheckpointManager step with a
  `state` item) rather than a legacy one (whose msgpack `checkpoint` sits in the directory)."""
  path = os.fspath(path)
  return any(storage.exists(storage.join(path, marker)) for marker in _ORBAX_MARKERS)


def load_orbax_checkpoint(path: str | os.PathLike, expected=None, dtype=None) -> dict:
  """Reads the parameters of a T5X Orbax checkpoint (a PyTree checkpoint) as numpy arrays.

  The parameters are the tree's `target` (T5X), `params`, or `optimizer/target` entry, or
  the whole tree if none exists; only that subtree is restored.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  if not storage.is_gcs(path):
    path = os.path.abspath(path)
    if os.path.isdir(os.path.join(path, 'state')) and not os.path.exists(
        os.path.join(path, '_METADATA')):
      path = os.path.join(path, 'state')  # a CheckpointManager step with a 'state' item
    if not os.path.isdir(path):
      raise CheckpointError(f'Orbax checkpoint directory not found: {path}')
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    metadata = checkpointer.metadata(path)
    tree = getattr(metadata, 'item_metadata', None) or metadata
    tree = getattr(tree, 'tree', tree)
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'Cannot read Orbax checkpoint metadata at {path}: {e}') from e
  tree = dict(tree)
  for keys in (('target',), ('params',), ('optimizer', 'target')):
    node, prefix = tree, []
    for k in keys:
      node = node.get(k) if isinstance(node, Mapping) else None
      prefix.append(k)
    if isinstance(node, Mapping):
      break
  else:
    node, prefix = tree, []
  flat_meta = trees.flatten(node)
  flat_expected = _expected_flat(expected)
  if flat_expected is not None:
    _check_names(flat_expected, flat_meta, path)
    for name, meta in flat_meta.items():
      if hasattr(meta, 'shape'):
        _check_shape(name, meta.shape, flat_expected[name].shape, path)
  restore_args = jax.tree_util.tree_map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), trees.unflatten(flat_meta))
  item = trees.unflatten({name: np.zeros((), np.float32) for name in flat_meta})
  for k in reversed(prefix):
    restore_args, item = {k: restore_args}, {k: item}
  try:
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        item=item, restore_args=restore_args, partial_restore=True))
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f'Cannot restore Orbax checkpoint at {path}: {e}') from e
  for k in prefix:
    restored = restored[k]
  out = {}
  for name, arr in trees.flatten(restored).items():
    want = dtype if dtype is not None else (
        flat_expected[name].dtype if flat_expected is not None else None)
    out[name] = cast_array(np.asarray(arr), want)
  check_finite(out, path, role='/'.join(prefix) or None)
  return trees.unflatten(out)


def load_checkpoint(path: str | os.PathLike, expected=None, dtype=None) -> dict:
  """A T5X checkpoint in either format: Orbax if its metadata is there, else legacy msgpack.
  Any failure reading it is a `CheckpointError` naming `path` (`errors.reading`)."""
  path = os.fspath(path)
  with errors.reading(path, what='T5X checkpoint'):
    if not storage.exists(storage.join(path, 'checkpoint')) and is_orbax_checkpoint(path):
      return load_orbax_checkpoint(path, expected=expected, dtype=dtype)
    return load_t5x_checkpoint(path, expected=expected, dtype=dtype)
