"""Device mesh, logical axis rules and shardings: running a model over many devices with GSPMD.

speclm shards with JAX's own machinery, configured the way T5X configures it:

  * a `jax.sharding.Mesh` with axes ('data', 'model'); `num_partitions` devices form the
    'model' axis (tensor parallelism), the rest the 'data' axis (batch parallelism);
  * every parameter and cache array has *logical* axis names (a model definition's
    `param_logical_axes()` and `cache_logical_axes()`, e.g. ('embed', 'mlp') for an MLP input
    kernel), and *rules* map logical names to mesh axes. The default rules are T5X's standard
    ones: batch -> data; vocab, heads, mlp, joined_kv -> model; embed, kv, length,
    relpos_buckets, layers -> replicated;
  * `jax.jit` with `in_shardings` / `out_shardings` compiles prefill, extend and the decode
    loops; XLA's SPMD partitioner (GSPMD) splits the computation and inserts the collectives.

The draft gets its own rules on the same mesh. By default it is replicated (every device holds
all of it) and only its batch is split: a small draft costs little memory, and replicating it
avoids a collective at every one of its γ steps per round.

A rule applies to an array dimension only when the mesh axis size divides it; otherwise the
dimension is replicated (e.g. 4 key/value heads on an 8-way 'model' axis). `spec()` is the one
place this decision is made, so tests and `describe()` report exactly what happens.

Multi-host: `initialize_distributed()` calls `jax.distributed.initialize()`; the Partitioner's
mesh covers the process's own devices by default (`devices='local'`), so each host decodes its
share of the dataset with model parallelism inside the host and no collective crosses hosts
during decoding. `devices='global'` builds one mesh over every process's devices (every
process must then run the same computation on the same inputs).

Shape letters: B batch, P input length, L cache positions, V vocabulary, D width, N heads,
H head dim, F MLP width.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from speclm import protocol

DATA = 'data'
MODEL = 'model'
MESH_AXES = (DATA, MODEL)

LogicalAxes = tuple  # a tuple of logical axis names (str or None), one per array dimension
Rules = tuple  # ((logical name, mesh axis or None), ...); the first rule for a name wins

# T5X's standard rules (one dimension of parameters and of activations partitioned).
STANDARD_RULES: Rules = (
    ('batch', DATA),
    ('vocab', MODEL),
    ('heads', MODEL),
    ('mlp', MODEL),
    ('joined_kv', MODEL),
    ('embed', None),
    ('kv', None),
    ('length', None),
    ('relpos_buckets', None),
    ('layers', None),
)
# A draft's default: parameters replicated on every device, its batch split like the target's.
REPLICATED_RULES: Rules = (('batch', DATA),)


def _as_rules(rules) -> Rules:
  """Gin gives lists; keep a tuple of (name, axis) pairs and check the axes exist."""
  out = []
  for rule in rules:
    if len(rule) != 2:
      raise ValueError(f'A logical axis rule is a pair (logical name, mesh axis or None), got'
                       f' {rule!r}.')
    name, axis = rule
    if axis is not None and axis not in MESH_AXES:
      raise ValueError(f'Logical axis rule {rule!r} maps to {axis!r}; mesh axes are'
                       f' {MESH_AXES} (or None for replicated).')
    out.append((str(name), axis))
  return tuple(out)


def standard_logical_axis_rules(additional_rules: Sequence[tuple[str, str | None]] = ()
                                ) -> Rules:
  """T5X's standard rules, with `additional_rules` first (so they override a standard one)."""
  return _as_rules(tuple(additional_rules) + STANDARD_RULES)


def replicated_logical_axis_rules() -> Rules:
  """Parameters replicated, batch split over 'data' (the draft's default)."""
  return REPLICATED_RULES


# ----------------------------------------------------------------------------------------------
# Multi-host start-up


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None,
                           enabled: bool = False) -> None:
  """`jax.distributed.initialize(...)` when `enabled` (once per process, before any JAX work).

  The runner calls this at start-up; gin turns it on:
    partitioning.initialize_distributed.enabled = True
  On Cloud TPU nothing else is needed (JAX discovers the slice's hosts). On CPU (tests) also
  give a coordinator 'host:port', the number of processes and this process's id.
  """
  if not enabled or _distributed_initialized():
    return
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)


def _distributed_initialized() -> bool:
  """Whether `jax.distributed.initialize` has run (False on a jax without the query)."""
  is_initialized = getattr(jax.distributed, 'is_initialized', None)
  return bool(is_initialized is not None and is_initialized())


# ----------------------------------------------------------------------------------------------
# The mesh


def create_mesh(num_partitions: int = 1, devices: str | Sequence[jax.Device] = 'local') -> Mesh:
  """A ('data', 'model') mesh: `num_partitions` devices per model replica.

  Args:
    num_partitions: size of the 'model' axis (T5X's `num_partitions`); the 'data' axis takes
      the remaining devices.
    devices: 'local' (this process's devices), 'global' (every process's), or a list.
  """
  if devices == 'local':
    devices = jax.local_devices()
  elif devices == 'global':
    devices = jax.devices()
  elif isinstance(devices, str):
    raise ValueError(f"devices must be 'local', 'global' or a list of devices, got {devices!r}.")
  devices = list(devices)
  if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or (
      num_partitions < 1):
    raise ValueError(f'num_partitions must be an integer >= 1, got {num_partitions!r}.')
  if len(devices) % num_partitions:
    raise ValueError(
        f'num_partitions={num_partitions} does not divide the {len(devices)} devices; choose'
        f' a divisor of {len(devices)} (the mesh is data x model = devices).')
  shape = (len(devices) // num_partitions, num_partitions)
  try:  # topology-aware device order on TPU (neighbouring chips share a model replica)
    grid = mesh_utils.create_device_mesh(shape, devices=devices)
  except (ValueError, AssertionError, NotImplementedError):
    grid = np.asarray(devices, dtype=object).reshape(shape)
  auto = (jax.sharding.AxisType.Auto,) * 2  # GSPMD propagation, as T5X uses
  return Mesh(grid, MESH_AXES, axis_types=auto)


# ----------------------------------------------------------------------------------------------
# Logical axes -> PartitionSpec


def logical_to_spec(axes: LogicalAxes, shape: Sequence[int], rules: Rules,
                    mesh_shape: Mapping[str, int]) -> PartitionSpec:
  """The `PartitionSpec` of an array with logical `axes` and `shape` under `rules`.

  Each dimension takes the first rule naming its logical axis whose mesh axis is not already
  used by another dimension of the array and whose size divides the dimension; otherwise it
  is replicated. Names without a rule are replicated.
  """
  if len(axes) != len(shape):
    raise ValueError(f'Logical axes {axes} name {len(axes)} dimensions, the array has shape'
                     f' {tuple(shape)}.')
  used: set[str] = set()
  spec = []
  for name, size in zip(axes, shape):
    chosen = None
    for rule_name, mesh_axis in rules:
      if rule_name != name:
        continue
      if mesh_axis is None:
        break  # an explicit "replicate" rule ends the search
      if mesh_axis in used or size % mesh_shape[mesh_axis]:
        continue
      chosen = mesh_axis
      break
    if chosen is not None:
      used.add(chosen)
    spec.append(chosen)
  while spec and spec[-1] is None:
    spec.pop()
  return PartitionSpec(*spec)


def _tree_axes(method: str, definition: protocol.LanguageModel, *args):
  fn = getattr(definition, method, None)
  return None if fn is None else fn(*args)


# ----------------------------------------------------------------------------------------------
# The Partitioner


class Partitioner:
  """A mesh plus logical axis rules for the target and the draft; compiles with shardings.

  Gin (T5X style):
    partitioning.Partitioner.num_partitions = 4
    partitioning.Partitioner.logical_axis_rules = @partitioning.standard_logical_axis_rules()
    partitioning.standard_logical_axis_rules.additional_rules = [('kv', 'model')]
    partitioning.Partitioner.draft_logical_axis_rules = @partitioning.standard_logical_axis_rules()

  Usage:
    partitioner = Partitioner(num_partitions=4)
    target = partitioner.shard_model(target)                 # parameters placed in shards
    draft = partitioner.shard_model(draft, role='draft')
    result = speculative_decode(target, draft, prompts, lengths, gamma=4,
                                partitioner=partitioner)
  """

  def __init__(self, num_partitions: int = 1, logical_axis_rules: Sequence = STANDARD_RULES,
               draft_logical_axis_rules: Sequence = REPLICATED_RULES,
               devices: str | Sequence[jax.Device] = 'local'):
    self.num_partitions = num_partitions
    self.mesh = create_mesh(num_partitions, devices)
    self.rules = {'target': _as_rules(logical_axis_rules),
                  'draft': _as_rules(draft_logical_axis_rules)}
    self._jits: dict[Any, Callable] = {}

  def __repr__(self) -> str:
    return (f'Partitioner(mesh={dict(self.mesh.shape)}, rules={self.rules["target"]},'
            f' draft_rules={self.rules["draft"]})')

  # -- shardings -------------------------------------------------------------------------------

  @property
  def is_local(self) -> bool:
    """Whether every device of the mesh belongs to this process."""
    return all(d.process_index == jax.process_index() for d in self.mesh.devices.flat)

  @property
  def mesh_shape(self) -> dict[str, int]:
    """Mesh axis name -> size, e.g. {'data': 2, 'model': 4}."""
    return dict(self.mesh.shape)

  def _rules(self, role: str) -> Rules:
    if role not in self.rules:
      raise ValueError(f"role must be 'target' or 'draft', got {role!r}.")
    return self.rules[role]

  def spec(self, axes: LogicalAxes, shape: Sequence[int], role: str = 'target') -> PartitionSpec:
    """The `PartitionSpec` of an array with logical `axes` and `shape`, under the rules of `role`
    ('target' or 'draft'); see `logical_to_spec`.
    """
    return logical_to_spec(axes, shape, self._rules(role), self.mesh_shape)

  def sharding(self, axes: LogicalAxes, shape: Sequence[int],
               role: str = 'target') -> NamedSharding:
    """The `NamedSharding` on this mesh of `spec(axes, shape, role)`."""
    return NamedSharding(self.mesh, self.spec(axes, shape, role))

  @property
  def replicated(self) -> NamedSharding:
    """A sharding that puts a whole copy on every device."""
    return NamedSharding(self.mesh, PartitionSpec())

  def batch_sharding(self, shape: Sequence[int]) -> NamedSharding:
    """Leading dimension B over 'data' (when it divides), the rest replicated."""
    return self.sharding(('batch',) + (None,) * (len(shape) - 1), shape)

  def _tree_shardings(self, tree, axes_tree, role: str):
    if axes_tree is None:  # a model without logical axes (n-gram, lookup drafts): replicated
      return jax.tree.map(lambda _: self.replicated, tree)
    return jax.tree.map(lambda x, axes: self.sharding(axes, np.shape(x), role), tree, axes_tree)

  def param_shardings(self, definition: protocol.LanguageModel, params,
                      role: str = 'target'):
    """A `NamedSharding` per parameter, from `definition.param_logical_axes()`."""
    return self._tree_shardings(params, _tree_axes('param_logical_axes', definition), role)

  def cache_shardings(self, definition: protocol.LanguageModel, cache, role: str = 'target'):
    """A `NamedSharding` per cache array, from `definition.cache_logical_axes()`."""
    return self._tree_shardings(cache, _tree_axes('cache_logical_axes', definition), role)

  # -- placing arrays --------------------------------------------------------------------------

  def put(self, value, sharding: NamedSharding) -> jax.Array:
    """A host value (the same on every process) as a global array: each device gets its slice."""
    if isinstance(value, jax.Array) and value.sharding == sharding:
      return value
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype,
                                                              jax.dtypes.prng_key):
      data = self.put(np.asarray(jax.random.key_data(value)), sharding)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  def shard_params(self, definition: protocol.LanguageModel, params, role: str = 'target'):
    """`params` placed in their shards (each device receives only its slice)."""
    shardings = self.param_shardings(definition, params, role)
    return jax.tree.map(self.put, params, shardings)

  def shard_model(self, model: protocol.Model, role: str = 'target') -> protocol.Model:
    """The model with its parameters sharded by the `role`'s rules ('target' or 'draft')."""
    return protocol.Model(model.definition,
                          self.shard_params(model.definition, model.params, role))

  def describe(self, definition: protocol.LanguageModel, params, role: str = 'target'
               ) -> dict[str, dict[str, Any]]:
    """Per parameter: global shape, PartitionSpec and the shape each device holds."""
    out = {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    shardings = jax.tree.leaves(self.param_shardings(definition, params, role),
                                is_leaf=lambda s: isinstance(s, NamedSharding))
    for (path, leaf), sharding in zip(flat, shardings):
      name = '/'.join(str(getattr(k, 'key', k)) for k in path)
      shape = tuple(np.shape(leaf))
      out[name] = {'shape': shape, 'spec': tuple(sharding.spec),
                   'shard_shape': tuple(sharding.shard_shape(shape))}
    return out

  # -- compiling -------------------------------------------------------------------------------

  def partition(self, fn: Callable, in_shardings, out_shardings,
                static_argnums: Sequence[int] = ()) -> Callable:
    """`jax.jit(fn, in_shardings=…, out_shardings=…)` (T5X's `partitioner.partition`)."""
    return jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                   static_argnums=tuple(static_argnums))

  def sharded_definition(self, definition: protocol.LanguageModel,
                         role: str = 'target') -> protocol.LanguageModel:
    """`definition` whose caches are constrained to their shardings inside compiled code."""
    if isinstance(definition, ShardedDefinition):
      return definition
    return ShardedDefinition(definition, self, role)

  def prefill(self, model: protocol.Model, inputs, input_lengths, cache_length: int,
              role: str = 'target'):
    """Compiled, sharded `prefill` of an empty cache -> (logits `[B, V]`, cache)."""
    definition = model.definition
    inputs = np.asarray(inputs, np.int32)
    lengths = np.asarray(input_lengths, np.int32)
    batch = inputs.shape[0]
    key = ('prefill', definition, role, inputs.shape, cache_length)
    if key not in self._jits:
      def fn(params, inputs, lengths):
        cache = definition.init_cache(batch, cache_length)
        cache = jax.lax.with_sharding_constraint(
            cache, self.cache_shardings(definition, cache, role))
        return definition.prefill(params, inputs, lengths, cache)
      out_cache = jax.eval_shape(fn, model.params, inputs, lengths)[1]
      self._jits[key] = self.partition(
          fn, (self.param_shardings(definition, model.params, role),
               self.batch_sharding(inputs.shape), self.batch_sharding(lengths.shape)),
          (self.batch_sharding((batch, definition.vocab_size)),
           self.cache_shardings(definition, out_cache, role)))
    return self._jits[key](model.params, self.put(inputs, self.batch_sharding(inputs.shape)),
                           self.put(lengths, self.batch_sharding(lengths.shape)))

  def extend(self, model: protocol.Model, tokens, cache, role: str = 'target'):
    """Compiled, sharded `extend` -> (logits `[B, K, V]`, cache)."""
    definition = model.definition
    tokens = np.asarray(tokens, np.int32)
    cache_sh = self.cache_shardings(definition, cache, role)
    key = ('extend', definition, role, tokens.shape,
           tuple((x.shape, x.dtype) for x in jax.tree.leaves(cache)))
    if key not in self._jits:
      logits_shape = tokens.shape + (definition.vocab_size,)
      self._jits[key] = self.partition(
          definition.extend, (self.param_shardings(definition, model.params, role),
                              self.batch_sharding(tokens.shape), cache_sh),
          (self.batch_sharding(logits_shape), cache_sh))
    return self._jits[key](model.params, self.put(tokens, self.batch_sharding(tokens.shape)),
                           cache)

  def jit_decode_loop(self, loop: Callable, num_models: int) -> Callable:
    """A sharded compiled version of one of `speclm.decoding`'s loops.

    The loop's positional arguments are `num_models` definitions (static), their parameters,
    then prompts `[B, P]`, prompt lengths `[B]`, limits `[B]` (split over 'data'), and the rng
    key, end id, pad id and any other arrays, such as an adaptive rule's costs (replicated); the rest are static keyword arguments. The result is
    replicated, so every process can read all of it.
    """
    roles = ('target', 'draft')[:num_models]

    def call(*args, **static):
      definitions, params = args[:num_models], args[num_models:2 * num_models]
      arrays = args[2 * num_models:]
      key = ('loop', loop, definitions, tuple(sorted(static.items())))
      if key not in self._jits:
        batch_arrays, scalars = arrays[:3], arrays[3:]
        in_shardings = (
            tuple(self.param_shardings(d, p, r) for d, p, r in zip(definitions, params, roles))
            + tuple(self.batch_sharding(np.shape(a)) for a in batch_arrays)
            + (self.replicated,) * len(scalars))
        self._jits[key] = jax.jit(functools.partial(loop, **static),
                                  static_argnums=tuple(range(num_models)),
                                  in_shardings=in_shardings, out_shardings=self.replicated)
      wrapped = tuple(self.sharded_definition(d, r) for d, r in zip(definitions, roles))
      placed = tuple(self.put(a, self.batch_sharding(np.shape(a))) for a in arrays[:3])
      placed += tuple(self.put(a, self.replicated) for a in arrays[3:])
      return self._jits[key](*wrapped, *params, *placed)

    return call


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedDefinition(protocol.WrappedLanguageModel):
  """A model definition whose caches carry sharding constraints (inside `jax.jit`).

  Hashable by identity of the partitioner and equality of the inner definition, so it is a
  valid static argument; everything else is the inner model's.
  """

  inner: protocol.LanguageModel
  partitioner: Partitioner
  role: str = 'target'

  def __hash__(self):
    return hash((self.inner, id(self.partitioner), self.role))

  def __eq__(self, other):
    return (isinstance(other, ShardedDefinition) and self.inner == other.inner
            and self.partitioner is other.partitioner and self.role == other.role)

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    """V, the inner model's."""
    return self.inner.vocab_size

  def _constrain(self, cache):
    return jax.lax.with_sharding_constraint(
        cache, self.partitioner.cache_shardings(self.inner, cache, self.role))

  def init_cache(self, batch_size, max_length):
    """The inner model's, with the cache constrained to its shardings; see
    `speclm.protocol.LanguageModel.init_cache`."""
    return self._constrain(self.inner.init_cache(batch_size, max_length))

  def prefill(self, params, inputs, input_lengths, cache):
    """The inner model's, with the cache constrained to its shardings; see
    `speclm.protocol.LanguageModel.prefill`."""
    logits, cache = self.inner.prefill(params, inputs, input_lengths, cache)
    return logits, self._constrain(cache)

  def extend(self, params, tokens, cache):
    """The inner model's, with the cache constrained to its shardings; see
    `speclm.protocol.LanguageModel.extend`."""
    logits, cache = self.inner.extend(params, tokens, cache)
    return logits, self._constrain(cache)

  def extend_last(self, params, tokens, cache):
    """The inner model's, with the cache constrained to its shardings; see
    `speclm.protocol.LanguageModel.extend_last`."""
    logits, cache = self.inner.extend_last(params, tokens, cache)
    return logits, self._constrain(cache)

  def last_prefix_token(self, inputs, input_lengths):
    """The inner model's: `[B]` the last token of each prompt."""
    return self.inner.last_prefix_token(inputs, input_lengths)


# ----------------------------------------------------------------------------------------------
# Memory arithmetic (docs/scaling.md uses the same formulas)


def bytes_per_device(shapes_and_specs: Mapping[str, dict[str, Any]], itemsize: int) -> int:
  """Bytes one device holds for `Partitioner.describe()`'s output at `itemsize` bytes/value."""
  return sum(math.prod(v['shard_shape']) * itemsize for v in shapes_and_specs.values())
