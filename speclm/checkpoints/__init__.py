"""Checkpoint readers and writers, one module per format; models never import them.

  llm          `load_llm(path)`: any decoder-only checkpoint by path, a Hugging Face directory
               or a GGUF file (also `read_llm_config`, `load_llm_tokenizer`)
  hf_llama     Hugging Face decoder-only directories (`config.json` + `*.safetensors`): Llama,
               Mistral, Qwen2/2.5, Qwen3, Gemma 2, Gemma 3; and back to `transformers`
  gguf         llama.cpp GGUF files of the same families (dequantized on reading), and their
               tokenizers
  t5x          T5X checkpoints: legacy msgpack + zarr (reader and writer, local or gs://) and
               Orbax (reader)
  hf_t5        Hugging Face T5 directories
  sharded      the T5X and Hugging Face Llama readers for a device mesh: each device reads only
               its slice
  safetensors_io  safetensors through its library, errors naming the file, shards as one
               mapping
  validate     `CheckpointError`, and `check_finite` (every loader refuses NaN or Inf)

This package exports the T5 entry points. `load_t5_params(path, definition)` detects the
format:
  * a directory with `config.json` -> Hugging Face T5 (safetensors only; pickles are refused);
  * a directory with Orbax metadata and no `checkpoint` file -> T5X Orbax;
  * otherwise -> a legacy T5X `checkpoint_<step>` directory (or its msgpack file), local or gs://.
Parameters are checked against the model's config (names and shapes) and cast to its
`param_dtype` while reading. Decoder-only checkpoints load with `speclm.checkpoints.llm`.
"""

from __future__ import annotations

import os

from speclm.checkpoints.t5x import CheckpointError
from speclm.checkpoints.t5x import load_checkpoint
from speclm.checkpoints.t5x import load_orbax_checkpoint
from speclm.checkpoints.t5x import load_t5x_checkpoint
from speclm.checkpoints.t5x import save_t5x_checkpoint


def load_t5_params(path: str | os.PathLike, definition) -> dict:
  """Parameters for the T5 `definition` (a `speclm.models.t5.T5`) from any supported format.

  Args:
    path: a Hugging Face T5 directory, a T5X Orbax checkpoint, or a legacy T5X
      `checkpoint_<step>` directory or msgpack file (local or gs://).
    definition: the `speclm.models.t5.T5` whose parameter names and shapes the checkpoint
      must hold.

  Returns:
    The parameter tree, cast to the definition's `param_dtype`.

  Raises:
    CheckpointError: the checkpoint is not one of these formats, or does not fit.
  """
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
