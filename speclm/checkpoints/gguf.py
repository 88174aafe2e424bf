"""Reads GGUF checkpoints (the llama.cpp file format) of the Llama family into speclm.

The `gguf` package parses the file (a memory map: nothing is unpickled; its metadata arrays
through `gguf_reader`'s one-pass reader). This module turns its
metadata into a `LlamaConfig` and its tensors into our parameter tree (`speclm.models.llama`'s
docstring), for the architectures llama.cpp's converter writes for the families speclm runs
(`SUPPORTED_ARCHITECTURES`; any other is refused with that list):

  architecture  family            what the reader does beyond Llama's
  llama         llama, mistral    undoes the Q/K row interleaving (below); a file carrying
                                  `llama.attention.sliding_window` is a Mistral
  qwen2         qwen2             query/key/value biases `blk.{i}.attn_{q,k,v}.bias`
  qwen3         qwen3             per-head q/k norms `blk.{i}.attn_{q,k}_norm.weight`
  gemma2        gemma2            norm weights minus 1; post-attention and post-MLP norms;
                                  soft-caps; alternate sliding layers (layer i iff i is even)
  gemma3        gemma3            norm weights minus 1; q/k norms; 5 sliding layers before each
                                  global one, with RoPE base 10000 (llama.cpp's constant)

* Tensor names: `GGUF_NAMES` maps Hugging Face names to GGUF's (llama.cpp's converter, as in
  the `gguf` package's `TensorNameMap`); `hf_llama.weight_names` then gives our names and
  layouts, so one table serves both readers.
* Dequantization to float32 of every type in `SUPPORTED_TYPES` (floats, the 32-value blocks
  Q4_0 … Q8_0, the 256-value K-quants Q2_K … Q6_K, the IQ, TQ and FP4 types) by the `gguf`
  package; any other type is a clear ValueError listing these.
* llama.cpp's converter interleaves the rows of the query and key projections of the 'llama'
  architecture only, per head, so that its RoPE can rotate adjacent pairs (x0, x1), (x2, x3), …;
  Hugging Face and speclm rotate the two halves (x_i, x_{i+H/2}). `unpermute_rows` restores
  the half layout. Qwen and Gemma files keep Hugging Face's order.
* Gemma's norms scale by (1 + w) and the converter stores 1 + w in every `*norm.weight`
  tensor; the reader subtracts the 1 again (our parameter is w, as in Hugging Face).
* GGUF does not store Gemma's `query_pre_attn_scalar`; like llama.cpp, the reader uses the
  head size, except for the 27B models (46 layers for Gemma 2, 62 for Gemma 3), which use
  embedding_length / head_count.
* GGUF stores a matrix `[out, in]` (numpy row-major, the reverse of the file's listed shape);
  our kernels are `[in, out]`, with the heads axis split out for attention.
* `{arch}.context_length` becomes `LlamaConfig.max_position_embeddings` (the model's
  `max_context_length`); parameters holding NaN/Inf are refused (`validate.check_finite`).

* The tokenizer in the metadata (`tokenizer.ggml.*`: byte-level BPE vocabulary, merges,
  token types, special ids, the pre-tokenizer name, and `tokenizer.chat_template`) becomes a
  `speclm.tokenizer.Tokenizer` (`load_tokenizer`). SentencePiece vocabularies ('llama': Gemma's,
  Llama 2's) are refused: load the model's Hugging Face tokenizer.json instead.

Typical use:

    model = gguf.load_model(path)            # a speclm.protocol.Model, float32
    config = gguf.read_config(path)          # only the LlamaConfig
    tok = gguf.load_tokenizer(path)          # text <-> ids, chat template
"""

from __future__ import annotations

import dataclasses
import os
from collections import abc
from typing import Any, Mapping

import numpy as np
from absl import logging

from speclm import protocol
from speclm import tokenizer
from speclm.checkpoints import errors
from speclm.checkpoints import gguf_reader
from speclm.checkpoints import hf_llama
from speclm.checkpoints.validate import check_finite
from speclm.models import llama

_SETUP_HINT = 'Install it with `pip install gguf` (speclm extra: `pip install speclm[gguf]`).'

# Quantization types this reader dequantizes (names of gguf.GGMLQuantizationType): every type
# `gguf.quants.dequantize` decodes (gguf 0.19).
SUPPORTED_TYPES = ('F32', 'F16', 'BF16', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0', 'Q2_K', 'Q3_K',
                   'Q4_K', 'Q5_K', 'Q6_K', 'IQ1_S', 'IQ1_M', 'IQ2_XXS', 'IQ2_XS', 'IQ2_S',
                   'IQ3_XXS', 'IQ3_S', 'IQ4_NL', 'IQ4_XS', 'TQ1_0', 'TQ2_0', 'MXFP4', 'NVFP4')
# GGUF `general.architecture` -> speclm family ('llama' files holding a sliding window are
# Mistrals: llama.cpp converts Mistral as 'llama').
ARCHITECTURE_FAMILIES = {'llama': 'llama', 'qwen2': 'qwen2', 'qwen3': 'qwen3',
                         'gemma2': 'gemma2', 'gemma3': 'gemma3'}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURE_FAMILIES)
_GEMMA = ('gemma2', 'gemma3')
# Hugging Face tensor name -> GGUF's, as llama.cpp's converter names them. Per layer,
# `model.layers.{i}.{hf}.{weight,bias}` is `blk.{i}.{gguf}.{weight,bias}`.
GGUF_NAMES = {'model.embed_tokens.weight': 'token_embd.weight',
              'model.norm.weight': 'output_norm.weight', 'lm_head.weight': 'output.weight'}
_LAYER_NAMES = {
    'input_layernorm': 'attn_norm', 'self_attn.q_proj': 'attn_q', 'self_attn.k_proj': 'attn_k',
    'self_attn.v_proj': 'attn_v', 'self_attn.o_proj': 'attn_output',
    'self_attn.q_norm': 'attn_q_norm', 'self_attn.k_norm': 'attn_k_norm',
    'post_attention_layernorm': 'ffn_norm', 'mlp.gate_proj': 'ffn_gate',
    'mlp.up_proj': 'ffn_up', 'mlp.down_proj': 'ffn_down'}
# Gemma has four norms per layer; its HF post-attention norm is not the MLP's input norm.
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, 'post_attention_layernorm': 'post_attention_norm',
                      'pre_feedforward_layernorm': 'ffn_norm',
                      'post_feedforward_layernorm': 'post_ffw_norm'}
# llama.cpp's constants for what Gemma files do not store: the sliding layers' pattern (every
# n-th layer global), Gemma 3's local RoPE base, Gemma 2's window and soft-caps, and the layer
# counts of the 27B models (whose query scale uses embedding_length / head_count).
_SLIDING_PATTERN = {'gemma2': 2, 'gemma3': 6}
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
_GEMMA2_DEFAULTS = {'attention.sliding_window': 4096, 'attn_logit_softcapping': 50.0,
                    'final_logit_softcapping': 30.0}
_LAYERS_27B = {'gemma2': 46, 'gemma3': 62}
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
  _gguf()  # the setup hint where the package is missing
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No GGUF file at {path!r}.')
  try:
    reader = gguf_reader.fast_reader_class()(path, 'r')
  except Exception as e:  # the reader raises ValueError/IndexError/… on a bad file
    raise errors.CheckpointError(f'{path} is not a readable GGUF file: {_diagnose(path, e)}',
                                 path=path) from e
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


def _diagnose(path: str, error: Exception) -> str:
  """Why `gguf.GGUFReader` could not open `path`, in the file's terms: the tensor whose data
  runs past the end of a truncated file, or a header that ends early, rather than the numpy
  message the reader fails with ('cannot reshape array of size …')."""
  size = os.path.getsize(path)
  try:
    extents = _tensor_extents(path)
  except Exception:  # pylint: disable=broad-except  # the header itself is unreadable
    if isinstance(error, ValueError) and 'reshape' not in str(error):
      return errors.describe(error)  # the reader's own words: bad magic, unknown version, …
    return (f'the file ends (at {size:,} bytes) inside its header (metadata or tensor list):'
            ' it is truncated or corrupt; download it again.')
  for name, start, length in extents:
    if start + length > size:
      return (f'tensor {name!r} needs bytes {start:,} to {start + length:,}, but the file ends'
              f' at {size:,}: it is truncated; download it again.')
  return errors.describe(error)


def _tensor_extents(path: str) -> list[tuple[str, int, int]]:
  """(name, first byte, byte count) of every tensor the header of `path` lists, read with the
  `gguf` package's own header parser but without touching the tensor data."""
  gguf = _gguf()
  extents = []

  class HeaderOnly(gguf_reader.fast_reader_class()):
    def _build_tensors(self, start_offs, fields):  # pylint: disable=arguments-differ
      for field in fields:
        _, name, _, dims, raw_type, offset = field.parts
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
        count = int(np.prod([int(d) for d in dims]))
        extents.append((bytes(name).decode('utf-8', 'replace'),
                        int(start_offs + offset[0]), count * type_size // block))

  HeaderOnly(path, 'r')
  return extents


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
        ' (for example to Q8_0 or Q4_K) with llama.cpp\'s tools.')
  shape = tuple(int(n) for n in reversed(tensor.shape))  # the file lists the fastest axis first
  data = np.asarray(tensor.data)
  if qtype.name == 'F32':
    values = data.view(np.float32)
  elif qtype.name == 'F16':
    values = data.view(np.float16).astype(np.float32)
  else:
    try:
      values = gguf.quants.dequantize(data, qtype)
    except NotImplementedError as e:  # an older gguf package
      raise ValueError(f'Tensor {tensor.name!r} is {qtype.name}, which the installed gguf'
                       f' package cannot dequantize ({e}); upgrade it (pip install -U gguf).'
                       ) from e
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
    raise ValueError(f'{path!r} lacks the GGUF metadata key {key!r}, needed for a'
                     f' {key.split(".")[0]} model.')
  return default


def _layer_types(md: Mapping[str, Any], arch: str, num_layers: int) -> tuple[str, ...]:
  """Gemma's 'sliding'/'full' per layer: every n-th layer global, n from llama.cpp's constant
  or an integer `{arch}.attention.sliding_window_pattern` (0: all sliding, 1: none)."""
  every = md.get(f'{arch}.attention.sliding_window_pattern', _SLIDING_PATTERN[arch])
  if isinstance(every, (list, tuple)):
    raise ValueError(f'{arch}.attention.sliding_window_pattern is a per-layer list; speclm reads'
                     ' a period (an integer) only.')
  every = int(every)
  return tuple('sliding' if every == 0 or i % every < every - 1 else 'full'
               for i in range(num_layers))


def config_from_gguf(file: GGUFFile, *, dtype: str = 'float32') -> llama.LlamaConfig:
  """Reads the `LlamaConfig` from the file's `{arch}.*` metadata and tensor names."""
  arch = file.architecture
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f'{file.path!r} holds a {arch or "(unnamed)"!r} model; speclm reads GGUF architectures'
        f' {", ".join(SUPPORTED_ARCHITECTURES)} (Llama, Mistral, Qwen2, Qwen3, Gemma 2,'
        ' Gemma 3).')
  md, path = file.metadata, file.path

  def key(name):
    return f'{arch}.{name}'

  embed_dim = int(_get(md, key('embedding_length'), path))
  num_heads = int(_get(md, key('attention.head_count'), path))
  num_layers = int(_get(md, key('block_count'), path))
  num_kv_heads = int(md.get(key('attention.head_count_kv'), num_heads))
  head_dim = int(md.get(key('attention.key_length'), embed_dim // num_heads))
  if int(md.get(key('attention.value_length'), head_dim)) != head_dim:
    raise ValueError(f'{path!r}: key and value head sizes differ; speclm needs them equal.')
  rope_dims = int(md.get(key('rope.dimension_count'), head_dim))
  if rope_dims != head_dim:
    raise ValueError(f'{path!r}: RoPE covers {rope_dims} of {head_dim} head dimensions; partial'
                     ' rotary embeddings are not supported.')
  if 'token_embd.weight' not in file.tensors:
    raise ValueError(f'{path!r} has no token_embd.weight tensor.')
  embed_shape = tuple(int(n) for n in reversed(file.tensors['token_embd.weight'].shape))
  vocab_size = int(md.get(key('vocab_size'), embed_shape[0]))
  if embed_shape != (vocab_size, embed_dim):
    raise ValueError(f'{path!r}: token_embd.weight has shape {embed_shape}, expected'
                     f' ({vocab_size}, {embed_dim}).')
  if 'rope_freqs.weight' in file.tensors:
    raise ValueError(f'{path!r} carries per-dimension RoPE frequency factors (rope_freqs),'
                     ' which speclm does not read; use the Hugging Face checkpoint instead.')
  scaling = None
  scaling_type = md.get(key('rope.scaling.type'), 'none')
  if scaling_type == 'linear':
    scaling = llama.RopeScaling(kind='linear', factor=float(md[key('rope.scaling.factor')]))
  elif scaling_type not in ('none', None):
    raise ValueError(f'{path!r}: RoPE scaling {scaling_type!r} is not supported (only linear).')
  context = md.get(key('context_length'))  # the trained context, e.g. 8192
  family = ARCHITECTURE_FAMILIES[arch]
  fields: dict[str, Any] = {}
  if arch in _GEMMA:
    fields = _gemma_fields(md, arch, num_layers, embed_dim // num_heads, head_dim)
  elif arch == 'llama' and md.get(key('attention.sliding_window')):
    family = 'mistral'
    fields['sliding_window'] = int(md[key('attention.sliding_window')])
  return llama.family_config(
      family,
      vocab_size=vocab_size,
      num_layers=num_layers,
      embed_dim=embed_dim,
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      mlp_dim=int(_get(md, key('feed_forward_length'), path)),
      rope_theta=float(md.get(key('rope.freq_base'), 10_000.0)),
      rope_scaling=scaling,
      norm_eps=float(md.get(key('attention.layer_norm_rms_epsilon'), 1e-5)),
      tie_embeddings='output.weight' not in file.tensors,
      max_position_embeddings=int(context) if context else None,
      param_dtype=dtype,
      dtype=dtype,
      **fields)


def _gemma_fields(md: Mapping[str, Any], arch: str, num_layers: int, width_per_head: int,
                  head_dim: int) -> dict[str, Any]:
  """The Gemma switches GGUF metadata sets, with llama.cpp's values where it stores none."""
  defaults = _GEMMA2_DEFAULTS if arch == 'gemma2' else {}

  def read(name):
    value = md.get(f'{arch}.{name}', defaults.get(name))
    return float(value) if value else None  # 0 (or absent) means none

  window = read('attention.sliding_window')
  local_theta = md.get(f'{arch}.rope.freq_base_swa',
                       _GEMMA3_LOCAL_ROPE_BASE if arch == 'gemma3' else None)
  return dict(
      query_pre_attn_scalar=float(width_per_head if num_layers == _LAYERS_27B[arch]
                                  else head_dim),
      attn_logit_softcap=read('attn_logit_softcapping'),
      final_logit_softcap=read('final_logit_softcapping'),
      sliding_window=int(window) if window else None,
      layer_types=_layer_types(md, arch, num_layers) if window else None,
      local_rope_theta=float(local_theta) if window and local_theta else None)


def read_config(path: str | os.PathLike, *, dtype: str = 'float32') -> llama.LlamaConfig:
  """The `LlamaConfig` of a GGUF file, without decoding any tensor."""
  file = open_gguf(path)
  with _naming(file.path):
    return config_from_gguf(file, dtype=dtype)


def _naming(path: str):
  """A context in which a ValueError or KeyError becomes a `CheckpointError` naming `path`."""
  return errors.reading(path, what='GGUF file')


# ----------------------------------------------------------------------------------------------
# Parameters


def gguf_name(hf_name: str, family: str) -> str:
  """The GGUF tensor name llama.cpp's converter gives the Hugging Face tensor `hf_name`."""
  if hf_name in GGUF_NAMES:
    return GGUF_NAMES[hf_name]
  _, _, layer, rest = hf_name.split('.', 3)  # model.layers.{i}.{module}.{weight|bias}
  module, kind = rest.rsplit('.', 1)
  names = _GEMMA_LAYER_NAMES if family in _GEMMA else _LAYER_NAMES
  return f'blk.{layer}.{names[module]}.{kind}'


def _hf_row_order(file: GGUFFile, config: llama.LlamaConfig, name: str, rows: np.ndarray
                  ) -> np.ndarray:
  """A tensor's rows (decoded or stored blocks) in Hugging Face's order: the 'llama'
  architecture's Q/K rows are interleaved per head by the converter."""
  if file.architecture == 'llama':
    if name.endswith('attn_q.weight'):
      return unpermute_rows(rows, config.num_heads)
    if name.endswith('attn_k.weight'):
      return unpermute_rows(rows, config.num_kv_heads)
  return rows


class _Decoded(abc.Mapping):
  """HF tensor name -> the GGUF tensor converted from it, decoded back to HF's values and
  layout (each when it is read, as `hf_llama.params_from_hf` converts them one by one)."""

  def __init__(self, file: GGUFFile, config: llama.LlamaConfig, names: Mapping[str, str]):
    self._file, self._config, self._names = file, config, names

  def __getitem__(self, hf_name: str) -> np.ndarray:
    name, c = self._names[hf_name], self._config
    x = _hf_row_order(self._file, c, name, self._file.tensor(name))
    if c.norm_offset and name.endswith('norm.weight'):  # Gemma: the file holds offset + w
      x = x - np.float32(c.norm_offset)
    return x

  def __contains__(self, hf_name) -> bool:
    return hf_name in self._names

  def __iter__(self):
    return iter(self._names)

  def __len__(self) -> int:
    return len(self._names)


def _stored_rows(file: GGUFFile, config: llama.LlamaConfig, name: str,
                 buffer: np.ndarray | None = None) -> np.ndarray:
  """A quantized matrix's rows as the file stores them (`uint8 [out, row_bytes]`), with the
  'llama' architecture's Q/K rows put back in Hugging Face's order; read into the start of
  `buffer` when given (the result may then be a view of it)."""
  tensor = file.tensors[name]
  # Read from the file rather than through the reader's memory map: pages of the map that
  # were touched would stay resident beside the copy (a 7B file counted twice).
  out_rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1
  shape = (out_rows, int(tensor.n_bytes) // out_rows)
  if buffer is None:
    rows = np.empty(shape, np.uint8)
  else:
    rows = buffer[:int(tensor.n_bytes)].reshape(shape)
  with open(file.path, 'rb') as f:
    f.seek(int(tensor.data_offset))
    if f.readinto(memoryview(rows).cast('B')) != rows.nbytes:
      raise ValueError(f'{file.path!r} ends inside the tensor {name!r}.')
  return np.ascontiguousarray(_hf_row_order(file, config, name, rows))


def _matrix_types(file: GGUFFile, config: llama.LlamaConfig) -> dict[str, tuple[str, str]]:
  """Our names of the matrices that could stay as stored (every kernel and the embedding
  table) -> (their GGUF tensor name, its type name)."""
  gguf = _gguf()
  out = {}
  for ours, (hf, _, shape) in hf_llama.weight_names(config).items():
    name = gguf_name(hf, config.family)
    if (len(shape) == 2 and name in file.tensors
        and ours.endswith(('/kernel', 'embedder/embedding'))):
      out[ours] = (name, gguf.GGMLQuantizationType(file.tensors[name].tensor_type).name)
  return out


def _quantized_matrices(file: GGUFFile, config: llama.LlamaConfig
                        ) -> dict[str, tuple[str, np.ndarray]]:
  """Our names of the matrices kept as stored -> (format, rows): those whose GGUF type
  `speclm.kernels.quantized` multiplies, interleaved where its products read them so
  (`quantized.loaded`: the format then named with '_x16'). Quantized matrices of other types
  are dequantized to float32, said in one warning line."""
  from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
  kept, widened = {}, {}
  types = _matrix_types(file, config)
  # Matrices that will be interleaved are read into one buffer, reused: a buffer freed after
  # each would raise glibc's threshold for memory maps, and the copies after it would come
  # from the heap, which keeps them resident after they are freed (a 7B Q4_K model's peak
  # went from 5.9 to 8.5 GB).
  interleaved = {name for name, kind in types.values() if kind in quantized.FORMATS
                 and quantized.interleaves(int(file.tensors[name].shape[-1]))}
  buffer = (np.empty(max(int(file.tensors[name].n_bytes) for name in interleaved), np.uint8)
            if interleaved else None)
  for ours, (name, kind) in types.items():
    if kind in quantized.FORMATS:
      rows = _stored_rows(file, config, name, buffer if name in interleaved else None)
      kept[ours] = quantized.loaded(kind, rows)  # interleaved: a copy, not the buffer
    elif kind not in ('F32', 'F16', 'BF16'):
      widened[kind] = widened.get(kind, 0) + 1
  if widened:
    kinds = ', '.join(f'{n} {kind}' for kind, n in sorted(widened.items()))
    logging.warning('%s: %s matrices have no quantized kernel (speclm multiplies %s); they are'
                    ' held as float32.', file.path, kinds, ', '.join(quantized.FORMATS))
  return kept


def stored_sizes(source: str | os.PathLike | GGUFFile, config: llama.LlamaConfig
                 ) -> dict[str, int]:
  """Our parameter names of the matrices `load_model(quantized=True)` keeps as stored -> their
  bytes (for `speclm.checkpoints.memory.estimate_bytes`), from the tensor records alone.
  `source`: the file, or a `GGUFFile` already opened."""
  from speclm.kernels import quantized  # pylint: disable=import-outside-toplevel
  file = source if isinstance(source, GGUFFile) else open_gguf(source)
  return {ours: int(file.tensors[name].n_bytes)
          for ours, (name, kind) in _matrix_types(file, config).items()
          if kind in quantized.FORMATS}


def params_from_gguf(file: GGUFFile, config: llama.LlamaConfig, quantized: bool = False) -> dict:
  """All tensors of a GGUF file as our parameter tree (numpy arrays, `param_dtype`); with
  `quantized`, matrices of the types `speclm.kernels.quantized` multiplies stay as stored
  (`hf_llama.params_from_hf`'s `stored`)."""
  expected = {hf: (gguf_name(hf, config.family), shape)
              for hf, _, shape in hf_llama.weight_names(config).values()}
  for name, shape in expected.values():
    if name not in file.tensors:
      raise ValueError(f'{file.path!r} lacks the tensor {name!r}, which a {config.family} model'
                       ' of this config needs.')
    stored = tuple(int(n) for n in reversed(file.tensors[name].shape))
    if stored != shape:
      raise ValueError(f'{file.path!r}: tensor {name!r} has shape {stored}, the config expects'
                       f' {shape}.')
  extra = sorted(set(file.tensors) - {name for name, _ in expected.values()})
  if extra:
    raise ValueError(f'{file.path!r} has tensors a {config.family} model does not use:'
                     f' {extra[:5]}{" …" if len(extra) > 5 else ""}.')
  stored = _quantized_matrices(file, config) if quantized else {}
  kept = {hf for hf, _, _ in (hf_llama.weight_names(config)[path] for path in stored)}
  names = {hf: name for hf, (name, _) in expected.items() if hf not in kept}
  return hf_llama.params_from_hf(_Decoded(file, config, names), config, stored=stored)


def load_model(source: str | os.PathLike | GGUFFile, *, dtype: str = 'float32',
               quantized: bool = False) -> protocol.Model:
  """Reads a GGUF file of any supported architecture into a `speclm.protocol.Model` (a
  `llama.Llama` with the family's switches).

  Args:
    source: the `.gguf` file, or a `GGUFFile` already opened (opening parses every metadata
      array, seconds for a large vocabulary; share one with `load_tokenizer`).
    dtype: parameter and activation dtype ('float32' or 'bfloat16'); quantized tensors are
      dequantized to float32 first.
    quantized: keep every matrix of type Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K as the file
      stores it, multiplied by `speclm.kernels.quantized` (no float copy: a Q4_K 7B model holds
      about 4.5 GB instead of 28 GB); other types are dequantized (one warning line). Needs
      the CPU kernel, float32 activations and one device.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  file = source if isinstance(source, GGUFFile) else open_gguf(source)
  with _naming(file.path):
    config = config_from_gguf(file, dtype=dtype)
    params = params_from_gguf(file, config, quantized=quantized)
  check_finite(params, file.path, error=errors.CheckpointError)
  definition = llama.Llama(config)
  params = _to_jax(params, jnp)
  definition.validate_params(params)
  return protocol.Model(definition, params)


# ----------------------------------------------------------------------------------------------
# Tokenizer


def load_tokenizer(source: str | os.PathLike | GGUFFile) -> tokenizer.Tokenizer:
  """The tokenizer a GGUF file carries in its metadata, as a `speclm.tokenizer.Tokenizer`.

  Byte-level BPE ('gpt2': Llama 3, Qwen, SmolLM2, …): vocabulary, merges, token types
  (control and user-defined tokens are matched whole) and the pre-tokenizer name (one
  `tokenizer.byte_level_bpe` knows; others are a ValueError). SentencePiece BPE ('llama':
  Gemma, Llama 2, Mistral v1): pieces, scores, types and `add_space_prefix`
  (`tokenizer.sentencepiece_bpe`). Both: special ids, `add_bos_token` and the chat template.
  `source` is the `.gguf` file or a `GGUFFile` already opened.
  """
  file = source if isinstance(source, GGUFFile) else open_gguf(source)
  md = file.metadata
  model = md.get('tokenizer.ggml.model')
  if model is None:
    raise ValueError(f'{file.path!r} carries no tokenizer (no tokenizer.ggml.model key).')
  tokens = file.array('tokenizer.ggml.tokens')
  types = file.array('tokenizer.ggml.token_type') or [_NORMAL] * len(tokens)
  space_prefix = False
  if model == 'gpt2':
    merges = file.array('tokenizer.ggml.merges') or []
    added = [(token, kind == _CONTROL) for token, kind in zip(tokens, types)
             if kind in (_CONTROL, _USER_DEFINED)]
    backend = tokenizer.byte_level_bpe(tokens, merges, md.get('tokenizer.ggml.pre', 'default'),
                                       added_tokens=added, source=file.path)
  elif model == 'llama':
    space_prefix = bool(md.get('tokenizer.ggml.add_space_prefix', True))
    scores = file.array('tokenizer.ggml.scores')
    if scores is None:
      raise ValueError(f'{file.path!r}: a SentencePiece vocabulary without piece scores'
                       ' (tokenizer.ggml.scores).')
    backend = tokenizer.sentencepiece_bpe(
        tokens, scores, types, source=file.path, add_space_prefix=space_prefix)
  else:
    raise ValueError(f'{file.path!r} has a {model!r} tokenizer; speclm builds byte-level BPE'
                     ' ("gpt2") and SentencePiece BPE ("llama") tokenizers from GGUF metadata.'
                     ' Load the tokenizer of the model\'s Hugging Face repository instead: its'
                     ' tokenizer.json (Tokenizer.from_pretrained_dir also reads the chat'
                     ' template).')

  def special(key):
    value = md.get(f'tokenizer.ggml.{key}_token_id')
    return None if value is None else int(value)

  return tokenizer.Tokenizer(
      backend, bos_id=special('bos'), eos_id=special('eos'), pad_id=special('padding'),
      add_bos=bool(md.get('tokenizer.ggml.add_bos_token', False)),
      chat_template=md.get('tokenizer.chat_template'), space_prefix=space_prefix,
      end_ids=[i for i in (special('eot'), special('eom')) if i is not None])


def _to_jax(tree: dict, jnp) -> dict:
  """The tree's arrays as JAX arrays, each numpy array let go as soon as it is copied (the
  tree is emptied), so the peak is the weights once plus one tensor."""
  out = {}
  for key in list(tree):
    value = tree.pop(key)
    out[key] = _to_jax(value, jnp) if isinstance(value, dict) else jnp.asarray(value)
    del value
  return out
