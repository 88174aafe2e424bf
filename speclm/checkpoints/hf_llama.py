"""Reads Hugging Face Llama checkpoint directories (`config.json` + `*.safetensors`).

A directory as `LlamaForCausalLM.save_pretrained` writes it (one file or shards with a
`model.safetensors.index.json`) becomes a `speclm.protocol.Model` whose logits equal
Hugging Face's. Safetensors files are read with the `safetensors` library
(`safetensors_io.Tensors`: each tensor when it is converted), so nothing is unpickled and
bfloat16 needs no torch. `*.bin` (pickle) checkpoints are refused, and so are weights holding
NaN/Inf (`validate.check_finite`).

Name mapping (HF weights are `[out, in]`; our kernels `[in, out]`):
  model.embed_tokens.weight                 -> embedder/embedding
  model.layers.{i}.input_layernorm          -> layers_{i}/pre_attention_norm/scale
  model.layers.{i}.self_attn.{q,k,v}_proj   -> layers_{i}/attention/{query,key,value}/kernel
  model.layers.{i}.self_attn.o_proj         -> layers_{i}/attention/out/kernel
  model.layers.{i}.post_attention_layernorm -> layers_{i}/pre_mlp_norm/scale
  model.layers.{i}.mlp.{gate,up,down}_proj  -> layers_{i}/mlp/{gate,up,down}/kernel
  model.norm.weight                         -> final_norm/scale
  lm_head.weight                            -> lm_head/kernel (absent when tied)

`params_to_hf` / `config_to_hf` / `to_transformers` go the other way, for comparisons with
Hugging Face `generate()` (scripts/benchmark.py).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Mapping

import numpy as np

from speclm import protocol
from speclm.checkpoints import safetensors_io
from speclm.checkpoints.validate import check_finite
from speclm.models import llama


# ----------------------------------------------------------------------------------------------
# Safetensors


def read_directory_weights(directory: str | os.PathLike) -> Mapping[str, np.ndarray]:
  """All weights of a HF checkpoint directory (single file or shards): a mapping name -> numpy
  array that reads each tensor when it is used (`safetensors_io.Tensors`)."""
  directory = os.fspath(directory)
  files = sorted(glob.glob(os.path.join(directory, '*.safetensors')))
  if not files:
    pickled = glob.glob(os.path.join(directory, '*.bin')) + glob.glob(
        os.path.join(directory, '*.pt'))
    hint = (' It holds only pickled PyTorch weights, which speclm never loads (unpickling runs'
            ' arbitrary code); convert them to safetensors first.') if pickled else ''
    raise FileNotFoundError(f'No *.safetensors files in {directory!r}.{hint}')
  return safetensors_io.Tensors(files)


# ----------------------------------------------------------------------------------------------
# Config


def _rope_scaling(rope: Mapping[str, Any] | None) -> llama.RopeScaling | None:
  if not rope:
    return None
  kind = rope.get('rope_type', rope.get('type', 'default'))
  if kind == 'default':
    return None
  if kind == 'linear':
    return llama.RopeScaling(kind='linear', factor=float(rope['factor']))
  if kind == 'llama3':
    return llama.RopeScaling(
        kind='llama3', factor=float(rope['factor']),
        low_freq_factor=float(rope['low_freq_factor']),
        high_freq_factor=float(rope['high_freq_factor']),
        original_max_position=int(rope['original_max_position_embeddings']))
  raise ValueError(f"Unsupported RoPE scaling {kind!r}; speclm supports 'linear' and 'llama3'.")


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = 'float32',
                   tie_embeddings: bool | None = None) -> llama.LlamaConfig:
  """A `LlamaConfig` from a HF `config.json` dictionary (transformers 4.x or 5.x keys);
  `max_position_embeddings` is the model's context length (None when absent)."""
  model_type = hf.get('model_type', 'llama')
  if model_type not in ('llama', 'mistral') and 'LlamaForCausalLM' not in hf.get(
      'architectures', []):
    raise ValueError(f'config.json describes a {model_type!r} model; this reader handles Llama'
                     ' checkpoints (model_type "llama").')
  for flag in ('attention_bias', 'mlp_bias'):
    if hf.get(flag):
      raise ValueError(f'config.json sets {flag}; speclm\'s Llama has no projection biases.')
  if hf.get('hidden_act', 'silu') != 'silu':
    raise ValueError(f'Unsupported activation {hf["hidden_act"]!r}; Llama uses silu.')
  if hf.get('sliding_window'):
    raise ValueError('Sliding-window attention is not supported.')
  num_heads = int(hf['num_attention_heads'])
  embed_dim = int(hf['hidden_size'])
  rope = hf.get('rope_parameters') or {}  # transformers >= 5 keeps theta and scaling here
  theta = float(rope.get('rope_theta', hf.get('rope_theta', 10_000.0)))
  scaling = _rope_scaling(rope if rope else hf.get('rope_scaling'))
  tie = bool(hf.get('tie_word_embeddings', False)) if tie_embeddings is None else tie_embeddings
  max_positions = hf.get('max_position_embeddings')
  return llama.LlamaConfig(
      vocab_size=int(hf['vocab_size']),
      num_layers=int(hf['num_hidden_layers']),
      embed_dim=embed_dim,
      num_heads=num_heads,
      num_kv_heads=int(hf.get('num_key_value_heads') or num_heads),
      head_dim=int(hf.get('head_dim') or embed_dim // num_heads),
      mlp_dim=int(hf['intermediate_size']),
      rope_theta=theta,
      rope_scaling=scaling,
      norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      tie_embeddings=tie,
      max_position_embeddings=int(max_positions) if max_positions else None,
      param_dtype=dtype,
      dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Parameters


def params_from_hf(weights: Mapping[str, np.ndarray], config: llama.LlamaConfig) -> dict:
  """HF Llama weights (names as `LlamaForCausalLM.state_dict()`) -> our parameter tree."""
  c = config
  d, n, nkv, h, f = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim
  used = set()
  if c.param_dtype == 'bfloat16':
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    target = np.dtype(ml_dtypes.bfloat16)
  else:
    target = np.dtype(c.param_dtype)

  def get(name, shape):
    if name not in weights:
      raise ValueError(f'The checkpoint lacks {name!r}.')
    x = np.asarray(weights[name])
    if x.shape != shape:
      raise ValueError(f'{name!r} has shape {x.shape}, the config expects {shape}.')
    used.add(name)
    return x.astype(np.float32)

  def cast(x):
    return np.ascontiguousarray(x).astype(target)

  params: dict[str, Any] = {
      'embedder': {'embedding': cast(get('model.embed_tokens.weight', (c.vocab_size, d)))},
      'final_norm': {'scale': cast(get('model.norm.weight', (d,)))},
  }
  if not c.tie_embeddings:
    params['lm_head'] = {'kernel': cast(get('lm_head.weight', (c.vocab_size, d)).T)}
  for i in range(c.num_layers):
    p = f'model.layers.{i}.'
    params[f'layers_{i}'] = {
        'pre_attention_norm': {'scale': cast(get(p + 'input_layernorm.weight', (d,)))},
        'attention': {
            'query': {'kernel': cast(get(p + 'self_attn.q_proj.weight', (n * h, d)).T
                                     .reshape(d, n, h))},
            'key': {'kernel': cast(get(p + 'self_attn.k_proj.weight', (nkv * h, d)).T
                                   .reshape(d, nkv, h))},
            'value': {'kernel': cast(get(p + 'self_attn.v_proj.weight', (nkv * h, d)).T
                                     .reshape(d, nkv, h))},
            'out': {'kernel': cast(get(p + 'self_attn.o_proj.weight', (d, n * h)).T
                                   .reshape(n, h, d))},
        },
        'pre_mlp_norm': {'scale': cast(get(p + 'post_attention_layernorm.weight', (d,)))},
        'mlp': {
            'gate': {'kernel': cast(get(p + 'mlp.gate_proj.weight', (f, d)).T)},
            'up': {'kernel': cast(get(p + 'mlp.up_proj.weight', (f, d)).T)},
            'down': {'kernel': cast(get(p + 'mlp.down_proj.weight', (d, f)).T)},
        },
    }
  ignorable = ('rotary_emb.inv_freq',)
  extra = sorted(k for k in set(weights) - used
                 if not k.endswith(ignorable) and not (c.tie_embeddings and k == 'lm_head.weight'))
  if extra:
    raise ValueError(f'The checkpoint has weights a Llama model does not use: {extra[:5]}.')
  return params


def config_to_hf(config: llama.LlamaConfig) -> dict[str, Any]:
  """The `config.json` dictionary of a HF `LlamaForCausalLM` equal to `config` (the inverse
  of `config_from_hf`)."""
  c = config
  hf: dict[str, Any] = dict(
      architectures=['LlamaForCausalLM'], model_type='llama', vocab_size=c.vocab_size,
      num_hidden_layers=c.num_layers, hidden_size=c.embed_dim, num_attention_heads=c.num_heads,
      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.mlp_dim,
      hidden_act='silu', rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
      attention_bias=False, mlp_bias=False, rope_theta=c.rope_theta)
  if c.max_position_embeddings is not None:
    hf['max_position_embeddings'] = c.max_position_embeddings
  if c.rope_scaling is not None:
    r = c.rope_scaling
    hf['rope_scaling'] = (
        {'rope_type': 'linear', 'factor': r.factor} if r.kind == 'linear' else
        {'rope_type': 'llama3', 'factor': r.factor, 'low_freq_factor': r.low_freq_factor,
         'high_freq_factor': r.high_freq_factor,
         'original_max_position_embeddings': r.original_max_position})
  return hf


def params_to_hf(params: Mapping[str, Any], config: llama.LlamaConfig) -> dict[str, np.ndarray]:
  """Our parameter tree -> HF Llama weights (float32, `LlamaForCausalLM.state_dict()` names);
  the inverse of `params_from_hf`."""
  c = config
  d, n, nkv, h = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim

  def hf(x, shape):  # our [in, ...] kernel -> HF [out, in]
    return np.ascontiguousarray(np.asarray(x, np.float32).reshape(shape).T)

  out = {'model.embed_tokens.weight': np.asarray(params['embedder']['embedding'], np.float32),
         'model.norm.weight': np.asarray(params['final_norm']['scale'], np.float32)}
  if not c.tie_embeddings:
    out['lm_head.weight'] = hf(params['lm_head']['kernel'], (d, c.vocab_size))
  for i in range(c.num_layers):
    p, layer = f'model.layers.{i}.', params[f'layers_{i}']
    attention, mlp = layer['attention'], layer['mlp']
    out.update({
        p + 'input_layernorm.weight': np.asarray(layer['pre_attention_norm']['scale'],
                                                 np.float32),
        p + 'self_attn.q_proj.weight': hf(attention['query']['kernel'], (d, n * h)),
        p + 'self_attn.k_proj.weight': hf(attention['key']['kernel'], (d, nkv * h)),
        p + 'self_attn.v_proj.weight': hf(attention['value']['kernel'], (d, nkv * h)),
        p + 'self_attn.o_proj.weight': hf(attention['out']['kernel'], (n * h, d)),
        p + 'post_attention_layernorm.weight': np.asarray(layer['pre_mlp_norm']['scale'],
                                                          np.float32),
        p + 'mlp.gate_proj.weight': hf(mlp['gate']['kernel'], (d, c.mlp_dim)),
        p + 'mlp.up_proj.weight': hf(mlp['up']['kernel'], (d, c.mlp_dim)),
        p + 'mlp.down_proj.weight': hf(mlp['down']['kernel'], (c.mlp_dim, d)),
    })
  return out


def to_transformers(model: protocol.Model, model_class=None):
  """A float32 `transformers.LlamaForCausalLM` (eval mode) with this Llama's weights.

  For side-by-side comparisons with Hugging Face `generate()`; needs the `hf` extra.
  `model_class` may name a subclass of `LlamaForCausalLM` to build instead.
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  config = model.definition.config
  model_class = model_class or transformers.LlamaForCausalLM
  hf_model = model_class(transformers.LlamaConfig(**config_to_hf(config)))
  weights = {k: torch.from_numpy(np.array(v)) for k, v in params_to_hf(model.params, config).items()}
  missing, unexpected = hf_model.load_state_dict(weights, strict=False)
  missing = [k for k in missing if not (config.tie_embeddings and k == 'lm_head.weight')]
  if missing or unexpected:
    raise ValueError(f'Weights do not fit LlamaForCausalLM: missing {missing[:5]},'
                     f' unexpected {unexpected[:5]}.')
  if config.tie_embeddings:
    hf_model.tie_weights()
  return hf_model.float().eval()


def subset_draft_to_transformers(draft: protocol.Model):
  """A subset-vocabulary draft (`speclm.models.subset_vocab`, inner Llama) as a full-vocabulary
  HF `LlamaForCausalLM`, e.g. as `generate(assistant_model=…)`.

  Input ids outside the subset embed as the inner model's "other" row, as `SubsetVocabModel`
  maps them; the head's rows off the subset are zero and masked to −inf by a buffer added to
  the logits after the forward pass, so the exported model's q̃ is ours.
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  inner_config = draft.definition.inner.config
  inner_params = draft.params['inner']
  to_subset = np.asarray(draft.params['to_subset'])
  from_subset = np.asarray(draft.params['from_subset'])
  vocab = draft.vocab_size
  inner_embedding = np.asarray(inner_params['embedder']['embedding'], np.float32)
  inner_head = (inner_embedding.T if inner_config.tie_embeddings else
                np.asarray(inner_params['lm_head']['kernel'], np.float32))  # [D, S+1]
  head = np.zeros((inner_config.embed_dim, vocab), np.float32)
  head[:, from_subset] = inner_head[:, :len(from_subset)]
  params = {**{k: v for k, v in inner_params.items() if k not in ('embedder', 'lm_head')},
            'embedder': {'embedding': inner_embedding[to_subset]}, 'lm_head': {'kernel': head}}
  config = dataclasses.replace(inner_config, vocab_size=vocab, tie_embeddings=False)
  mask = np.full((vocab,), -np.inf, np.float32)
  mask[from_subset] = 0.0

  class SubsetHeadLlama(transformers.LlamaForCausalLM):
    """`LlamaForCausalLM` whose logits are −inf outside the draft's token subset."""

    def __init__(self, hf_config):
      super().__init__(hf_config)
      self.register_buffer('logit_mask', torch.from_numpy(mask), persistent=False)

    def forward(self, *args, **kwargs):
      out = super().forward(*args, **kwargs)
      out.logits = out.logits + self.logit_mask
      return out

  return to_transformers(protocol.Model(llama.Llama(config), params),
                         model_class=SubsetHeadLlama)


def read_config(directory: str | os.PathLike) -> dict:
  """`config.json` of a HF checkpoint directory as a dictionary."""
  path = os.path.join(os.fspath(directory), 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No config.json in {os.fspath(directory)!r}: not a Hugging Face'
                            ' checkpoint directory.')
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def load_model(directory: str | os.PathLike, *, dtype: str = 'float32') -> protocol.Model:
  """Reads a HF Llama checkpoint directory into a `speclm.protocol.Model` (a `llama.Llama`).

  Embeddings count as tied when `config.json` says so or when `lm_head.weight` is absent.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  hf = read_config(directory)
  config = config_from_hf(hf, dtype=dtype)  # validates before any weight is read
  weights = read_directory_weights(directory)
  if not config.tie_embeddings and 'lm_head.weight' not in weights:
    config = dataclasses.replace(config, tie_embeddings=True)
  params = params_from_hf(weights, config)
  check_finite(params, os.fspath(directory), error=ValueError)
  params = _to_jax(params, jnp)
  definition = llama.Llama(config)
  definition.validate_params(params)
  return protocol.Model(definition, params)


def _to_jax(tree, jnp):
  if isinstance(tree, dict):
    return {k: _to_jax(v, jnp) for k, v in tree.items()}
  return jnp.asarray(tree)
