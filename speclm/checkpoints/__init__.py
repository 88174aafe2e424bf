"""Checkpoint readers and writers: T5X (legacy msgpack + zarr, Orbax) and Hugging Face T5.

`load_t5_params(path, definition)` detects the format:
  * a directory with `config.json` -> Hugging Face T5 (safetensors only; pickles are refused);
  * a directory with Orbax metadata and no `checkpoint` file -> T5X Orbax;
  * otherwise -> a legacy T5X `checkpoint_<step>` directory (or its msgpack file), local or gs://.
Parameters are checked against the model's config (names and shapes) and cast to its
`param_dtype` while reading.
"""

from __future__ import annotations

import os

from speclm.checkpoints.t5x import CheckpointError
from speclm.checkpoints.t5x import load_checkpoint
from speclm.checkpoints.t5x import load_orbax_checkpoint
from speclm.checkpoints.t5x import load_t5x_checkpoint
from speclm.checkpoints.t5x import save_t5x_checkpoint


def load_t5_params(path: str | os.PathLike, definition) -> dict:
  """Parameters for the T5 `definition` (a `speclm.models.t5.T5`) from any supported format."""
  path = os.fspath(path)
  expected = definition.param_shapes()
  if not path.startswith('gs://') and os.path.isfile(os.path.join(path, 'config.json')):
    from speclm.checkpoints import hf_t5  # pylint: disable=g-import-not-at-top
    _, params = hf_t5.load_hf_t5(path, config=definition.config)
    return params
  return load_checkpoint(path, expected=expected)


__all__ = [
    'CheckpointError', 'load_checkpoint', 'load_orbax_checkpoint', 'load_t5_params',
    'load_t5x_checkpoint', 'save_t5x_checkpoint',
]
