"""Hugging Face T5 directories (`config.json` + `*.safetensors`) as T5X-named parameters.

Reads `T5ForConditionalGeneration` checkpoints (t5-small … t5-11b, google/t5-v1_1-*,
google/flan-t5-*, …). v1.0 vs v1.1 is read from the config: `feed_forward_proj` ('relu' or
'gated-gelu') and the output layer (see the end of this docstring). Torch `.bin` files
are pickles and are refused.

Name mapping (HF `nn.Linear` weights are `[out, in]`; T5X kernels `[in, out]`, so every
kernel is transposed; the relative attention table is `[buckets, heads]` in HF, `[heads,
buckets]` in T5X):
  shared.weight                             token_embedder/embedding
  {coder}.block.0.layer.0.SelfAttention.relative_attention_bias.weight
                                            {coder}/relpos_bias/rel_embedding (transposed)
  encoder.block.{i}.layer.0.layer_norm      encoder/layers_i/pre_attention_layer_norm/scale
  encoder.block.{i}.layer.0.SelfAttention.{q,k,v,o}
                                            encoder/layers_i/attention/{query,key,value,out}
  encoder.block.{i}.layer.1.layer_norm      encoder/layers_i/pre_mlp_layer_norm/scale
  encoder.block.{i}.layer.1.DenseReluDense.{wi | wi_0, wi_1; wo}
                                            encoder/layers_i/mlp/{…}/kernel
  encoder.final_layer_norm                  encoder/encoder_norm/scale
  decoder.block.{i}.layer.0 (SelfAttention) decoder/layers_i/pre_self_attention_layer_norm,
                                            decoder/layers_i/self_attention
  decoder.block.{i}.layer.1 (EncDecAttention)
                                            decoder/layers_i/pre_cross_attention_layer_norm,
                                            decoder/layers_i/encoder_decoder_attention
  decoder.block.{i}.layer.2 (DenseReluDense) decoder/layers_i/pre_mlp_layer_norm, …/mlp
  decoder.final_layer_norm                  decoder/decoder_norm/scale
  lm_head.weight                            decoder/logits_dense/kernel (transposed; v1.1
                                            only; shared.weight when lm_head is not saved)

v1.0 vs v1.1: transformers < 5 wrote `tie_word_embeddings: false` for v1.1; transformers ≥ 5
always writes `tie_word_embeddings: true` and marks v1.0 by `scale_decoder_outputs: true`.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

from speclm import protocol
from speclm import trees
from speclm.checkpoints import errors
from speclm.checkpoints import safetensors_io
from speclm.checkpoints.errors import CheckpointError
from speclm.checkpoints.validate import check_finite
from speclm.models import t5

_ATTN = {'q': 'query', 'k': 'key', 'v': 'value', 'o': 'out'}


def config_from_hf(hf_config: dict, *, dtype: str = 'float32',
                   param_dtype: str | None = None) -> t5.T5Config:
  """A `T5Config` from a Hugging Face T5 `config.json` dict."""
  proj = hf_config.get('feed_forward_proj', 'relu')
  gated = proj.startswith('gated-')
  act = proj[len('gated-'):] if gated else proj
  act = {'gelu_new': 'gelu', 'gelu': 'gelu' if gated else 'gelu_exact', 'relu': 'relu',
         'silu': 'silu'}.get(act)
  if act is None:
    raise CheckpointError(f'Unsupported T5 feed_forward_proj {proj!r}; expected relu, gelu,'
                          ' gated-gelu, gated-relu or gated-silu.')
  # Output scaling marks v1.0 (logits = embedding / √D). transformers ≥ 5 records it as
  # `scale_decoder_outputs` (and always sets tie_word_embeddings); older configs used
  # tie_word_embeddings=False for v1.1.
  if 'scale_decoder_outputs' in hf_config:
    tied = bool(hf_config['scale_decoder_outputs'])
  else:
    tied = bool(hf_config.get('tie_word_embeddings', True))
  num_layers = int(hf_config['num_layers'])
  return t5.T5Config(
      vocab_size=int(hf_config['vocab_size']), emb_dim=int(hf_config['d_model']),
      num_heads=int(hf_config['num_heads']), head_dim=int(hf_config['d_kv']),
      num_encoder_layers=num_layers,
      num_decoder_layers=int(hf_config.get('num_decoder_layers') or num_layers),
      mlp_dim=int(hf_config['d_ff']),
      mlp_activations=(act, 'linear') if gated else (act,),
      logits_via_embedding=tied,
      relative_attention_num_buckets=int(hf_config.get('relative_attention_num_buckets', 32)),
      relative_attention_max_distance=int(hf_config.get('relative_attention_max_distance', 128)),
      layer_norm_epsilon=float(hf_config.get('layer_norm_epsilon', 1e-6)),
      decoder_start_token_id=int(hf_config.get('decoder_start_token_id') or 0),
      pad_id=int(hf_config.get('pad_token_id') or 0),
      eos_id=int(hf_config.get('eos_token_id') if hf_config.get('eos_token_id') is not None
                 else 1),
      dtype=dtype, param_dtype=param_dtype or dtype)


def config_to_hf(config: t5.T5Config) -> dict[str, Any]:
  """The Hugging Face `T5Config` keyword arguments of a `T5Config` (`config_from_hf` inverted).

  Raises ValueError for MLP wirings Hugging Face's T5 has no name for.
  """
  acts = config.mlp_activations
  if len(acts) == 2 and acts[1] == 'linear' and acts[0] in ('gelu', 'relu', 'silu'):
    proj = f'gated-{acts[0]}'  # HF's gated-gelu is the tanh approximation, as ours
  elif len(acts) == 1 and acts[0] in ('relu', 'gelu_exact', 'gelu', 'silu'):
    proj = {'relu': 'relu', 'gelu_exact': 'gelu', 'gelu': 'gelu_new', 'silu': 'silu'}[acts[0]]
  else:
    raise ValueError(f'Hugging Face T5 has no feed_forward_proj for mlp_activations {acts!r}.')
  return dict(
      vocab_size=config.vocab_size, d_model=config.emb_dim, d_kv=config.head_dim,
      d_ff=config.mlp_dim, num_layers=config.num_encoder_layers,
      num_decoder_layers=config.num_decoder_layers, num_heads=config.num_heads,
      relative_attention_num_buckets=config.relative_attention_num_buckets,
      relative_attention_max_distance=config.relative_attention_max_distance,
      layer_norm_epsilon=config.layer_norm_epsilon, feed_forward_proj=proj,
      # Read by transformers as "v1.0: scale the decoder output by 1/√D and tie the head".
      tie_word_embeddings=config.logits_via_embedding, dropout_rate=0.0,
      decoder_start_token_id=config.decoder_start_token_id, pad_token_id=config.pad_id,
      eos_token_id=config.eos_id, is_encoder_decoder=True)


def to_transformers(model: protocol.Model):
  """A float32 `transformers.T5ForConditionalGeneration` (eval mode) with this T5's weights.

  For side-by-side comparisons with Hugging Face `generate()`; needs the `hf` extra.
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  config = model.definition.config
  hf_model = transformers.T5ForConditionalGeneration(
      transformers.T5Config(**config_to_hf(config)))
  flat = trees.flatten(model.params)
  weights = {}
  for ours, (hf_name, transpose) in _mapping(config).items():
    array = np.asarray(flat[ours], np.float32)
    weights[hf_name] = torch.from_numpy(np.array(array.T if transpose else array))  # a copy
  head = weights.pop('lm_head.weight', None)
  missing, unexpected = hf_model.load_state_dict(weights, strict=False)
  tied = {'encoder.embed_tokens.weight', 'decoder.embed_tokens.weight', 'lm_head.weight'}
  missing = [k for k in missing if k not in tied]
  if missing or unexpected:
    raise ValueError(f'Weights do not fit T5ForConditionalGeneration: missing {missing[:5]},'
                     f' unexpected {unexpected[:5]}.')
  if head is not None:
    # transformers >= 5 always ties lm_head to the embedding; T5 1.1 has a head of its own.
    hf_model.lm_head.weight = torch.nn.Parameter(head)
  return hf_model.float().eval()


def read_hf_config(directory: str | os.PathLike) -> dict:
  """The parsed config.json of a Hugging Face model directory.

  Raises:
    CheckpointError: the file is missing or is not valid JSON.
  """
  path = os.path.join(os.fspath(directory), 'config.json')
  if not os.path.isfile(path):
    raise CheckpointError(f'Not a Hugging Face model directory (no config.json): {path}')
  return errors.read_json(path, what='config.json')


def _open_tensors(directory: str) -> safetensors_io.Tensors:
  """name -> tensor (read when used) over every safetensors shard of `directory`."""
  index_path = os.path.join(directory, 'model.safetensors.index.json')
  if os.path.isfile(index_path):
    with errors.reading(index_path, what='safetensors index'):
      weight_map = errors.read_json(index_path, what='safetensors index')['weight_map']
    files = sorted(set(weight_map.values()))
  else:
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory,
                                                                       '*.safetensors')))
  if not files:
    pickles = [p for p in os.listdir(directory) if p.endswith(('.bin', '.pt', '.pth'))]
    hint = (f' It has {pickles[0]}, a pickle, which speclm never loads; re-save the model with'
            ' save_pretrained(..., safe_serialization=True).' if pickles else '')
    raise CheckpointError(f'No *.safetensors files in {directory}.{hint}')
  return safetensors_io.Tensors([os.path.join(directory, name) for name in files],
                                error=CheckpointError)


def _mapping(config: t5.T5Config) -> dict[str, tuple[str, bool]]:
  """T5X name -> (HF name, transpose?)."""
  m = {'token_embedder/embedding': ('shared.weight', False),
       'encoder/encoder_norm/scale': ('encoder.final_layer_norm.weight', False),
       'decoder/decoder_norm/scale': ('decoder.final_layer_norm.weight', False),
       'encoder/relpos_bias/rel_embedding': (
           'encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight', True),
       'decoder/relpos_bias/rel_embedding': (
           'decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight', True)}
  if not config.logits_via_embedding:
    m['decoder/logits_dense/kernel'] = ('lm_head.weight', True)
  acts = config.mlp_activations
  mlp_names = ['wi'] if len(acts) == 1 else [f'wi_{i}' for i in range(len(acts))]
  mlp_names.append('wo')

  def attention(prefix, hf_prefix):
    for hf, ours in _ATTN.items():
      m[f'{prefix}/{ours}/kernel'] = (f'{hf_prefix}.{hf}.weight', True)

  def mlp(prefix, hf_prefix):
    for name in mlp_names:
      m[f'{prefix}/{name}/kernel'] = (f'{hf_prefix}.{name}.weight', True)

  for i in range(config.num_encoder_layers):
    p, h = f'encoder/layers_{i}', f'encoder.block.{i}.layer'
    m[f'{p}/pre_attention_layer_norm/scale'] = (f'{h}.0.layer_norm.weight', False)
    attention(f'{p}/attention', f'{h}.0.SelfAttention')
    m[f'{p}/pre_mlp_layer_norm/scale'] = (f'{h}.1.layer_norm.weight', False)
    mlp(f'{p}/mlp', f'{h}.1.DenseReluDense')
  for i in range(config.num_decoder_layers):
    p, h = f'decoder/layers_{i}', f'decoder.block.{i}.layer'
    m[f'{p}/pre_self_attention_layer_norm/scale'] = (f'{h}.0.layer_norm.weight', False)
    attention(f'{p}/self_attention', f'{h}.0.SelfAttention')
    m[f'{p}/pre_cross_attention_layer_norm/scale'] = (f'{h}.1.layer_norm.weight', False)
    attention(f'{p}/encoder_decoder_attention', f'{h}.1.EncDecAttention')
    m[f'{p}/pre_mlp_layer_norm/scale'] = (f'{h}.2.layer_norm.weight', False)
    mlp(f'{p}/mlp', f'{h}.2.DenseReluDense')
  return m


def load_hf_t5(directory: str | os.PathLike, *, dtype: str = 'float32',
               param_dtype: str | None = None,
               config: t5.T5Config | None = None) -> tuple[t5.T5Config, dict[str, Any]]:
  """Reads a Hugging Face T5 directory -> (`T5Config`, T5X-named nested dict of numpy arrays).

  Args:
    directory: holds `config.json` and `model.safetensors` (or shards and their index).
    dtype: activation dtype of the returned config; parameters are cast to `param_dtype`
      (default: `dtype`) while reading.
    config: check the checkpoint against this config instead of the one in config.json.
  """
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise CheckpointError(f'Hugging Face model directory not found: {directory}')
  hf_config = read_hf_config(directory)
  with errors.reading(os.path.join(directory, 'config.json'), what='config.json'):
    from_file = config_from_hf(hf_config, dtype=dtype, param_dtype=param_dtype)
  if config is None:
    config = from_file
  else:
    fields = ('mlp_activations', 'logits_via_embedding', 'num_encoder_layers',
              'num_decoder_layers', 'relative_attention_num_buckets',
              'relative_attention_max_distance')
    differ = [f'{f}: checkpoint {getattr(from_file, f)!r}, config {getattr(config, f)!r}'
              for f in fields if getattr(from_file, f) != getattr(config, f)]
    if differ:
      raise CheckpointError(f'{directory} (T5 {from_file.version}) does not match the model'
                            f' config (T5 {config.version}): {"; ".join(differ)}.')
  tensors = _open_tensors(directory)
  expected = trees.flatten(t5.T5(config).param_shapes())
  target_dtype = np.dtype(param_dtype or config.param_dtype)
  flat = {}
  for ours, (hf_name, transpose) in _mapping(config).items():
    stored = hf_name
    if stored not in tensors and hf_name in ('shared.weight', 'lm_head.weight'):
      # Tied weights are saved once, under any of their names.
      stored = next((alias for alias in ('shared.weight', 'encoder.embed_tokens.weight',
                                         'decoder.embed_tokens.weight') if alias in tensors),
                    hf_name)
    if stored not in tensors:
      raise CheckpointError(f'{directory} has no tensor {hf_name!r} (needed for {ours}).')
    arr = tensors[stored]
    if transpose:
      arr = arr.T
    want = tuple(expected[ours].shape)
    if tuple(arr.shape) != want:
      raise CheckpointError(f'Parameter {ours} (from {hf_name} in {directory}) has shape'
                            f' {tuple(arr.shape)}, the model config expects {want}.')
    flat[ours] = np.ascontiguousarray(arr, dtype=target_dtype)  # one copy at most
  check_finite(flat, directory)
  return config, trees.unflatten(flat)
