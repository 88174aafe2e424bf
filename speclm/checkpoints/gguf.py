"""Reads Llama-family GGUF checkpoints (the llama.cpp file format) into speclm parameters.

The `gguf` package parses the file (a memory map: nothing is unpickled). This module turns its
tensors into our parameter tree (`speclm.models.llama`'s docstring) and its `llama.*` metadata
into a `LlamaConfig`:

* Dequantization to float32 of F32, F16, BF16, Q4_0, Q4_1 and Q8_0 tensors (blocks of 32
  values with one or two float16 constants each); any other type is a clear ValueError.
* llama.cpp's converter interleaves the rows of the query and key projections, per head, so
  that its own RoPE can rotate adjacent pairs (x0, x1), (x2, x3), …; Hugging Face and speclm
  rotate the two halves (x_i, x_{i+H/2}). `unpermute_rows` restores the half layout.
* GGUF stores a matrix `[out, in]` (numpy row-major, the reverse of the file's listed shape);
  our kernels are `[in, out]`, with the heads axis split out for attention.
* `{arch}.context_length` becomes `LlamaConfig.max_position_embeddings` (the model's
  `max_context_length`); parameters holding NaN/Inf are refused (`validate.check_finite`).

* The tokenizer in the metadata (`tokenizer.ggml.*`: byte-level BPE vocabulary, merges,
  token types, special ids, the pre-tokenizer name, and `tokenizer.chat_template`) becomes a
  `speclm.tokenizer.Tokenizer` (`load_tokenizer`).

Typical use:

    model = gguf.load_model(path)            # a speclm.protocol.Model, float32
    config = gguf.read_config(path)          # only the LlamaConfig
    tok = gguf.load_tokenizer(path)          # text <-> ids, chat template
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import numpy as np

from speclm import protocol
from speclm import tokenizer
from speclm.checkpoints.validate import check_finite
from speclm.models import llama

_SETUP_HINT = 'Install it with `pip install gguf` (speclm extra: `pip install speclm[gguf]`).'

# Quantization types this reader dequantizes (names of gguf.GGMLQuantizationType).
SUPPORTED_TYPES = ('F32', 'F16', 'BF16', 'Q4_0', 'Q4_1', 'Q8_0')
SUPPORTED_ARCHITECTURES = ('llama',)
# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f'Reading GGUF files needs the `gguf` package. {_SETUP_HINT}') from e
  return gguf


# ----------------------------------------------------------------------------------------------
# File access


@dataclasses.dataclass
class GGUFFile:
  """An opened GGUF file: its metadata as plain Python values and its tensors by name.

  Attributes:
    path: where the file lives.
    metadata: every key/value pair (strings, numbers, lists) except the large tokenizer
      arrays, which `array` returns on demand.
    tensors: the `gguf` package's tensor records by name (memory-mapped, not yet decoded).
  """

  path: str
  metadata: dict[str, Any]
  tensors: dict[str, Any]
  _reader: Any = dataclasses.field(repr=False)

  @property
  def architecture(self) -> str:
    return str(self.metadata.get('general.architecture', ''))

  def array(self, key: str) -> list | None:
    """A metadata array (e.g. `tokenizer.ggml.tokens`) as a Python list, or None if absent."""
    field = self._reader.fields.get(key)
    if field is None:
      return None
    return field.contents()

  def tensor(self, name: str) -> np.ndarray:
    """The named tensor dequantized to float32, shaped `[out, in]` for matrices."""
    if name not in self.tensors:
      raise KeyError(f'{self.path} has no tensor {name!r}.')
    return dequantize(self.tensors[name])


# Metadata arrays that can be large; `open_gguf` leaves them out of `metadata`.
_LARGE_ARRAYS = ('tokenizer.ggml.tokens', 'tokenizer.ggml.scores', 'tokenizer.ggml.token_type',
                 'tokenizer.ggml.merges')


def open_gguf(path: str | os.PathLike) -> GGUFFile:
  """Opens a GGUF file (memory-mapped) and reads its metadata. Raises ValueError if corrupt."""
  gguf = _gguf()
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No GGUF file at {path!r}.')
  try:
    reader = gguf.GGUFReader(path, 'r')
  except Exception as e:  # the reader raises ValueError/struct.error/… on a bad file
    raise ValueError(f'{path!r} is not a readable GGUF file: {e}') from e
  metadata = {}
  for key, field in reader.fields.items():
    if key in _LARGE_ARRAYS:
      continue
    try:
      metadata[key] = field.contents()
    except Exception:  # pylint: disable=broad-except  # an exotic value type: keep going
      continue
  tensors = {t.name: t for t in reader.tensors}
  return GGUFFile(path=path, metadata=metadata, tensors=tensors, _reader=reader)


def dequantize(tensor) -> np.ndarray:
  """A `gguf` tensor record -> float32 array in numpy order (`[out, in]` for a matrix).

  Raises ValueError for quantization types outside `SUPPORTED_TYPES`.
  """
  gguf = _gguf()
  qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
  if qtype.name not in SUPPORTED_TYPES:
    raise ValueError(
        f'Tensor {tensor.name!r} uses GGUF quantization type {qtype.name}, which speclm does'
        f' not read; supported types are {", ".join(SUPPORTED_TYPES)}. Re-quantize the model'
        ' (for example to Q8_0 or F16) with llama.cpp\'s tools.')
  shape = tuple(int(n) for n in reversed(tensor.shape))  # the file lists the fastest axis first
  data = np.asarray(tensor.data)
  if qtype.name == 'F32':
    values = data.view(np.float32)
  elif qtype.name == 'F16':
    values = data.view(np.float16).astype(np.float32)
  else:
    values = gguf.quants.dequantize(data, qtype)
  return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Undoes llama.cpp's per-head row interleaving of a Q or K projection `[heads*H, in]`.

  llama.cpp stores, within each head, the rows in the order (0, H/2, 1, H/2+1, …) so that its
  RoPE rotates adjacent pairs; Hugging Face's layout (rotate half) keeps the halves together.
  """
  rows = weight.shape[0]
  half = rows // num_heads // 2
  return (weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
          .reshape(weight.shape))


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """The inverse of `unpermute_rows`: Hugging Face's layout -> llama.cpp's (for writing tests)."""
  rows = weight.shape[0]
  half = rows // num_heads // 2
  return (weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2)
          .reshape(weight.shape))


# ----------------------------------------------------------------------------------------------
# Config


def _get(metadata: Mapping[str, Any], key: str, path: str, default: Any = None) -> Any:
  if key in metadata:
    return metadata[key]
  if default is None:
    raise ValueError(f'{path!r} lacks the GGUF metadata key {key!r}, needed for a Llama model.')
  return default


def config_from_gguf(file: GGUFFile, *, dtype: str = 'float32') -> llama.LlamaConfig:
  """Reads the `LlamaConfig` from the file's `llama.*` metadata and tensor names."""
  arch = file.architecture
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f'{file.path!r} holds a {arch or "(unnamed)"!r} model; speclm reads GGUF architectures'
        f' {", ".join(SUPPORTED_ARCHITECTURES)} (Llama-family decoder-only models).')
  md, path = file.metadata, file.path
  embed_dim = int(_get(md, 'llama.embedding_length', path))
  num_heads = int(_get(md, 'llama.attention.head_count', path))
  num_kv_heads = int(md.get('llama.attention.head_count_kv', num_heads))
  head_dim = int(md.get('llama.attention.key_length', embed_dim // num_heads))
  if int(md.get('llama.attention.value_length', head_dim)) != head_dim:
    raise ValueError(f'{path!r}: key and value head sizes differ; speclm needs them equal.')
  rope_dims = int(md.get('llama.rope.dimension_count', head_dim))
  if rope_dims != head_dim:
    raise ValueError(f'{path!r}: RoPE covers {rope_dims} of {head_dim} head dimensions; partial'
                     ' rotary embeddings are not supported.')
  if 'token_embd.weight' not in file.tensors:
    raise ValueError(f'{path!r} has no token_embd.weight tensor.')
  embed_shape = tuple(int(n) for n in reversed(file.tensors['token_embd.weight'].shape))
  vocab_size = int(md.get('llama.vocab_size', embed_shape[0]))
  if embed_shape != (vocab_size, embed_dim):
    raise ValueError(f'{path!r}: token_embd.weight has shape {embed_shape}, expected'
                     f' ({vocab_size}, {embed_dim}).')
  if 'rope_freqs.weight' in file.tensors:
    raise ValueError(f'{path!r} carries per-dimension RoPE frequency factors (rope_freqs),'
                     ' which speclm does not read; use the Hugging Face checkpoint instead.')
  scaling = None
  scaling_type = md.get('llama.rope.scaling.type', 'none')
  if scaling_type == 'linear':
    scaling = llama.RopeScaling(kind='linear', factor=float(md['llama.rope.scaling.factor']))
  elif scaling_type not in ('none', None):
    raise ValueError(f'{path!r}: RoPE scaling {scaling_type!r} is not supported (only linear).')
  context = md.get(f'{arch}.context_length')  # the trained context, e.g. 8192
  return llama.LlamaConfig(
      vocab_size=vocab_size,
      num_layers=int(_get(md, 'llama.block_count', path)),
      embed_dim=embed_dim,
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      mlp_dim=int(_get(md, 'llama.feed_forward_length', path)),
      rope_theta=float(md.get('llama.rope.freq_base', 10_000.0)),
      rope_scaling=scaling,
      norm_eps=float(md.get('llama.attention.layer_norm_rms_epsilon', 1e-5)),
      tie_embeddings='output.weight' not in file.tensors,
      max_position_embeddings=int(context) if context else None,
      param_dtype=dtype,
      dtype=dtype)


def read_config(path: str | os.PathLike, *, dtype: str = 'float32') -> llama.LlamaConfig:
  """The `LlamaConfig` of a GGUF file, without decoding any tensor."""
  return config_from_gguf(open_gguf(path), dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Parameters


def params_from_gguf(file: GGUFFile, config: llama.LlamaConfig) -> dict:
  """All tensors of a Llama GGUF file as our parameter tree (numpy arrays, `param_dtype`)."""
  c = config
  dtype = np.dtype(c.param_dtype) if c.param_dtype != 'bfloat16' else None
  known = {'token_embd.weight', 'output_norm.weight', 'output.weight'}

  def cast(x):
    if dtype is None:
      import ml_dtypes  # pylint: disable=import-outside-toplevel  # ships with jax
      return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)

  def get(name, shape):
    x = file.tensor(name)
    if x.shape != shape:
      raise ValueError(f'{file.path!r}: tensor {name!r} has shape {x.shape}, the config expects'
                       f' {shape}.')
    return x

  d, n, nkv, h, f = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim
  params: dict[str, Any] = {
      'embedder': {'embedding': cast(get('token_embd.weight', (c.vocab_size, d)))},
      'final_norm': {'scale': cast(get('output_norm.weight', (d,)))},
  }
  if not c.tie_embeddings:
    params['lm_head'] = {'kernel': cast(get('output.weight', (c.vocab_size, d)).T)}
  for i in range(c.num_layers):
    p = f'blk.{i}.'
    names = ['attn_norm', 'attn_q', 'attn_k', 'attn_v', 'attn_output', 'ffn_norm', 'ffn_gate',
             'ffn_up', 'ffn_down']
    known.update(p + name + '.weight' for name in names)
    for bias in ('attn_q', 'attn_k', 'attn_v', 'attn_output', 'ffn_gate', 'ffn_up', 'ffn_down'):
      if p + bias + '.bias' in file.tensors:
        raise ValueError(f'{file.path!r} has projection biases ({p}{bias}.bias); speclm\'s Llama'
                         ' has none.')
    q = unpermute_rows(get(p + 'attn_q.weight', (n * h, d)), n)
    k = unpermute_rows(get(p + 'attn_k.weight', (nkv * h, d)), nkv)
    v = get(p + 'attn_v.weight', (nkv * h, d))
    o = get(p + 'attn_output.weight', (d, n * h))
    params[f'layers_{i}'] = {
        'pre_attention_norm': {'scale': cast(get(p + 'attn_norm.weight', (d,)))},
        'attention': {
            'query': {'kernel': cast(q.T.reshape(d, n, h))},
            'key': {'kernel': cast(k.T.reshape(d, nkv, h))},
            'value': {'kernel': cast(v.T.reshape(d, nkv, h))},
            'out': {'kernel': cast(o.T.reshape(n, h, d))},
        },
        'pre_mlp_norm': {'scale': cast(get(p + 'ffn_norm.weight', (d,)))},
        'mlp': {
            'gate': {'kernel': cast(get(p + 'ffn_gate.weight', (f, d)).T)},
            'up': {'kernel': cast(get(p + 'ffn_up.weight', (f, d)).T)},
            'down': {'kernel': cast(get(p + 'ffn_down.weight', (d, f)).T)},
        },
    }
  extra = sorted(set(file.tensors) - known - {'rope_freqs.weight'})
  if extra:
    raise ValueError(f'{file.path!r} has tensors a Llama model does not use: {extra[:5]}'
                     f'{" …" if len(extra) > 5 else ""}.')
  return params


def load_model(source: str | os.PathLike | GGUFFile, *, dtype: str = 'float32') -> protocol.Model:
  """Reads a Llama-family GGUF file into a `speclm.protocol.Model` (a `llama.Llama`).

  Args:
    source: the `.gguf` file, or a `GGUFFile` already opened (opening parses every metadata
      array, seconds for a large vocabulary; share one with `load_tokenizer`).
    dtype: parameter and activation dtype ('float32' or 'bfloat16'); quantized tensors are
      dequantized to float32 first.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  file = source if isinstance(source, GGUFFile) else open_gguf(source)
  config = config_from_gguf(file, dtype=dtype)
  params = params_from_gguf(file, config)
  check_finite(params, file.path, error=ValueError)
  definition = llama.Llama(config)
  params = {k: _to_jax(v, jnp) for k, v in params.items()}
  definition.validate_params(params)
  return protocol.Model(definition, params)


# ----------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(source: str | os.PathLike | GGUFFile) -> tokenizer.Tokenizer:
  """The tokenizer a GGUF file carries in its metadata, as a `speclm.tokenizer.Tokenizer`.

  Byte-level BPE ("gpt2") vocabularies only: vocabulary, merges, token types (control and
  user-defined tokens are matched whole), the pre-tokenizer name, special ids, `add_bos_token`
  and the chat template. `source` is the `.gguf` file or a `GGUFFile` already opened.
  """
  file = source if isinstance(source, GGUFFile) else open_gguf(source)
  md = file.metadata
  model = md.get('tokenizer.ggml.model')
  if model is None:
    raise ValueError(f'{file.path!r} carries no tokenizer (no tokenizer.ggml.model key).')
  if model != 'gpt2':
    raise ValueError(f'{file.path!r} has a {model!r} tokenizer; speclm builds byte-level BPE'
                     ' ("gpt2") tokenizers from GGUF. Load the model\'s tokenizer.json instead'
                     ' (Tokenizer.from_tokenizer_json).')
  tokens = file.array('tokenizer.ggml.tokens')
  merges = file.array('tokenizer.ggml.merges') or []
  types = file.array('tokenizer.ggml.token_type') or [_NORMAL] * len(tokens)
  added = [(token, kind == _CONTROL) for token, kind in zip(tokens, types)
           if kind in (_CONTROL, _USER_DEFINED)]
  backend = tokenizer.byte_level_bpe(tokens, merges, md.get('tokenizer.ggml.pre', 'default'),
                                     added_tokens=added, source=file.path)

  def special(key):
    value = md.get(f'tokenizer.ggml.{key}_token_id')
    return None if value is None else int(value)

  return tokenizer.Tokenizer(
      backend, bos_id=special('bos'), eos_id=special('eos'), pad_id=special('padding'),
      add_bos=bool(md.get('tokenizer.ggml.add_bos_token', False)),
      chat_template=md.get('tokenizer.chat_template'))


def _to_jax(tree, jnp):
  if isinstance(tree, dict):
    return {k: _to_jax(v, jnp) for k, v in tree.items()}
  return jnp.asarray(tree)
