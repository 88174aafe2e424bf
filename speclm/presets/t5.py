"""A T5 restored from a checkpoint path: `load_t5(config, checkpoint_path)`.

The format is detected from the path (`speclm.checkpoints.load_t5_params`): a Hugging Face
directory (config.json + safetensors), a T5X Orbax checkpoint, or a legacy T5X msgpack
checkpoint, local or gs://. With a partitioner, a legacy T5X checkpoint is read straight into
its shards (`speclm.checkpoints.sharded`: each device reads its slice); other formats are read
whole, then sharded. The definition comes from `speclm.models.t5`, which knows nothing of
checkpoints.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from speclm import protocol
from speclm.checkpoints import load_t5_params
from speclm.checkpoints import sharded
from speclm.checkpoints import t5x
from speclm.models import t5


def load_t5(config: t5.T5Config, checkpoint_path: str | None = None, dtype: str | None = None,
            cpu_kernels: bool = False, *, partitioner=None,
            role: str = 'target') -> protocol.Model:
  """The T5 of `config` with parameters restored from `checkpoint_path`.

  Args:
    config: the model's `T5Config` (checked against the checkpoint's names and shapes).
    checkpoint_path: a Hugging Face directory, a T5X Orbax checkpoint or a legacy T5X
      `checkpoint_<step>` directory (local or gs://). None: random parameters (seed 0), which
      is only useful for tests.
    dtype: e.g. 'bfloat16': overrides the config's `dtype` and `param_dtype`.
    cpu_kernels: apply `t5.pack_for_cpu` (float32 decoding on one CPU; a no-op elsewhere).
      Packed copies are added after sharding: the kernel serves one-device jobs only.
    partitioner: a `speclm.partitioning.Partitioner` to place the parameters with; a legacy
      T5X checkpoint is then read shard by shard.
    role: 'target' or 'draft': which of the partitioner's rules apply (and named in errors).

  Raises:
    speclm.checkpoints.CheckpointError: a missing, corrupt or mismatched checkpoint.
  """
  if dtype is not None:
    config = dataclasses.replace(config, param_dtype=dtype, dtype=dtype)
  definition = t5.T5(config)
  if (checkpoint_path is not None and partitioner is not None
      and not os.path.isfile(os.path.join(checkpoint_path, 'config.json'))
      and not t5x.is_orbax_checkpoint(checkpoint_path)):
    params = sharded.load_t5x_sharded(checkpoint_path, definition, partitioner, role)
    model = protocol.Model(definition, params)
  else:
    if checkpoint_path is None:
      params = definition.init_params(jax.random.key(0))
    else:
      params = jax.device_put(load_t5_params(checkpoint_path, definition))
    model = protocol.Model(definition, params)
    model = model if partitioner is None else partitioner.shard_model(model, role)
  return t5.pack_for_cpu(model) if cpu_kernels else model


__all__ = ['load_t5']
