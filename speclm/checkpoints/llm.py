"""Any decoder-only checkpoint speclm reads, by path: a Hugging Face directory or a GGUF file.

    model = llm.load_llm(path)              # a speclm.protocol.Model (llama.Llama, any family)
    config = llm.read_llm_config(path)      # its LlamaConfig, without reading the weights
    tok = llm.load_llm_tokenizer(path)      # a speclm.tokenizer.Tokenizer (chat template too)

`path` is a directory holding `config.json` and `*.safetensors` (`hf_llama`: Llama, Mistral,
Qwen2/2.5, Qwen3, Gemma 2, Gemma 3) or a `.gguf` file (`gguf`: the same families under
llama.cpp's architecture names). Anything else is a clear error naming both. A missing path is a
FileNotFoundError; a broken file (truncated, corrupt, inconsistent) is a
`speclm.checkpoints.errors.CheckpointError` naming the file, and the tensor or key.
"""

from __future__ import annotations

import os

from speclm import protocol
from speclm import tokenizer as tokenizer_lib
from speclm.checkpoints import errors


def checkpoint_kind(path: str | os.PathLike) -> str:
  """'hf' (a directory with config.json) or 'gguf' (a GGUF file); errors name what was found."""
  path = os.fspath(path)
  if os.path.isdir(path):
    if os.path.isfile(os.path.join(path, 'config.json')):
      return 'hf'
    raise FileNotFoundError(f'{path!r} is a directory without config.json: not a Hugging Face'
                            ' checkpoint (give the directory holding config.json and'
                            ' *.safetensors, or a .gguf file).')
  if os.path.isfile(path):
    with open(path, 'rb') as f:
      if f.read(4) == b'GGUF':
        return 'gguf'
    raise errors.CheckpointError(f'{path!r} is neither a GGUF file nor a Hugging Face checkpoint'
                                 ' directory.', path=path)
  raise FileNotFoundError(f'No checkpoint at {path!r} (expected a Hugging Face directory or a'
                          ' .gguf file).')


def load_llm(path: str | os.PathLike, *, dtype: str = 'float32',
             quantized: bool = False) -> protocol.Model:
  """The decoder-only model at `path` (Hugging Face directory or GGUF file). `quantized`: a
  GGUF file's quantized matrices stay as stored (`gguf.load_model`); no effect on a Hugging
  Face directory."""
  if checkpoint_kind(path) == 'hf':
    from speclm.checkpoints import hf_llama  # pylint: disable=import-outside-toplevel
    return hf_llama.load_model(path, dtype=dtype)
  from speclm.checkpoints import gguf  # pylint: disable=import-outside-toplevel
  return gguf.load_model(path, dtype=dtype, quantized=quantized)


def read_llm_config(path: str | os.PathLike):
  """The `speclm.models.llama.LlamaConfig` of the checkpoint at `path`, no weight read."""
  if checkpoint_kind(path) == 'hf':
    from speclm.checkpoints import hf_llama  # pylint: disable=import-outside-toplevel
    return hf_llama.read_model_config(path)
  from speclm.checkpoints import gguf  # pylint: disable=import-outside-toplevel
  return gguf.read_config(path)


def load_llm_tokenizer(path: str | os.PathLike) -> tokenizer_lib.Tokenizer:
  """The tokenizer that ships with the checkpoint at `path`: `tokenizer.json` (+ its
  `tokenizer_config.json` chat template) in a Hugging Face directory, the metadata of a GGUF
  file."""
  if checkpoint_kind(path) == 'hf':
    try:
      return tokenizer_lib.Tokenizer.from_pretrained_dir(path)
    except tokenizer_lib.TokenizerFileError as e:  # a broken tokenizer file, named
      raise errors.CheckpointError(str(e), path=e.path, key=e.key) from e
  from speclm.checkpoints import gguf  # pylint: disable=import-outside-toplevel
  with errors.reading(path, what='GGUF file'):
    return gguf.load_tokenizer(path)
