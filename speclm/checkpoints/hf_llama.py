"""Reads Hugging Face checkpoint directories (`config.json` + `*.safetensors`) of the Llama
family and its relatives: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 2 and Gemma 3 (`MODEL_TYPES`).

A directory as `{Family}ForCausalLM.save_pretrained` writes it (one file or shards with a
`model.safetensors.index.json`) becomes a `speclm.protocol.Model` whose logits equal
Hugging Face's. Safetensors files are read with the `safetensors` library
(`safetensors_io.Tensors`: each tensor when it is converted), so nothing is unpickled and
bfloat16 needs no torch. `*.bin` (pickle) checkpoints are refused, and so are weights holding
NaN/Inf (`validate.check_finite`). Any other model type is refused with the list of supported
ones. A multimodal Gemma 3 directory (model_type "gemma3") loads its language model.

Name mapping (`weight_names`; HF weights are `[out, in]`; our kernels `[in, out]`):
  model.embed_tokens.weight                 -> embedder/embedding
  model.layers.{i}.input_layernorm          -> layers_{i}/pre_attention_norm/scale
  model.layers.{i}.self_attn.{q,k,v}_proj   -> layers_{i}/attention/{query,key,value}/kernel
                                               (and …/bias for Qwen2)
  model.layers.{i}.self_attn.{q,k}_norm     -> layers_{i}/attention/{query,key}_norm/scale
  model.layers.{i}.self_attn.o_proj         -> layers_{i}/attention/out/kernel
  model.layers.{i}.post_attention_layernorm -> layers_{i}/pre_mlp_norm/scale
                                               (Gemma: layers_{i}/post_attention_norm/scale)
  model.layers.{i}.pre_feedforward_layernorm  -> layers_{i}/pre_mlp_norm/scale     (Gemma)
  model.layers.{i}.post_feedforward_layernorm -> layers_{i}/post_mlp_norm/scale    (Gemma)
  model.layers.{i}.mlp.{gate,up,down}_proj  -> layers_{i}/mlp/{gate,up,down}/kernel
  model.norm.weight                         -> final_norm/scale
  lm_head.weight                            -> lm_head/kernel (absent when tied)

`params_to_hf` / `config_to_hf` / `to_transformers` go the other way, for comparisons with
Hugging Face `generate()` (scripts/benchmark.py).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, Mapping

import numpy as np

from speclm import protocol
from speclm import trees
from speclm.checkpoints import errors
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
  return safetensors_io.Tensors(files, error=errors.CheckpointError)


# ----------------------------------------------------------------------------------------------
# Config

# model_type in config.json -> speclm family; 'gemma3' is the multimodal checkpoint, whose text
# model (text_config, weights under language_model) is read.
MODEL_TYPES = {'llama': 'llama', 'mistral': 'mistral', 'qwen2': 'qwen2', 'qwen3': 'qwen3',
               'gemma2': 'gemma2', 'gemma3_text': 'gemma3', 'gemma3': 'gemma3'}
# Hugging Face's defaults for keys a family's config.json may leave out.
_FAMILY_DEFAULTS = {
    'mistral': dict(sliding_window=4096),
    'qwen3': dict(head_dim=128),
    'gemma2': dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   tie_word_embeddings=True),
    'gemma3': dict(head_dim=256, query_pre_attn_scalar=256, sliding_window=4096,
                   rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   tie_word_embeddings=True),
}
_ACTIVATIONS = {'silu': 'silu', 'swish': 'silu', 'gelu_pytorch_tanh': 'gelu_tanh',
                'gelu_tanh': 'gelu_tanh', 'gelu_new': 'gelu_tanh'}
_HF_CLASSES = {'llama': 'LlamaForCausalLM', 'mistral': 'MistralForCausalLM',
               'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM',
               'gemma2': 'Gemma2ForCausalLM', 'gemma3': 'Gemma3ForCausalLM'}


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


def family_of(hf: Mapping[str, Any]) -> str:
  """The speclm family of a config.json dictionary; ValueError naming the supported ones."""
  model_type = hf.get('model_type', 'llama')
  if model_type in MODEL_TYPES:
    return MODEL_TYPES[model_type]
  if 'LlamaForCausalLM' in hf.get('architectures', []):
    return 'llama'
  raise ValueError(f'config.json describes a {model_type!r} model; speclm reads the model types'
                   f' {", ".join(sorted(MODEL_TYPES))} (families {", ".join(llama.FAMILIES)}).')


def _layer_types(hf: Mapping[str, Any], family: str, num_layers: int,
                 sliding_window: int | None) -> tuple[str, ...] | None:
  """'full'/'sliding' per layer, from `layer_types` (transformers >= 4.53) or the family's
  rule in older configs."""
  if sliding_window is None:
    return None
  names = hf.get('layer_types')
  if names:
    kinds = {'full_attention': 'full', 'sliding_attention': 'sliding'}
    unknown = sorted(set(names) - set(kinds))
    if unknown:
      raise ValueError(f'Unsupported attention layer types {unknown}; speclm supports'
                       ' full_attention and sliding_attention.')
    return tuple(kinds[name] for name in names)
  if family == 'gemma2':
    return tuple('full' if (i + 1) % 2 == 0 else 'sliding' for i in range(num_layers))
  if family == 'gemma3':
    every = int(hf.get('sliding_window_pattern', hf.get('_sliding_window_pattern', 6)))
    return tuple('full' if (i + 1) % every == 0 else 'sliding' for i in range(num_layers))
  if family in ('qwen2', 'qwen3'):
    first = int(hf.get('max_window_layers', num_layers))
    return tuple('sliding' if i >= first else 'full' for i in range(num_layers))
  return None  # Mistral: every layer


def config_from_hf(hf: Mapping[str, Any], *, dtype: str = 'float32',
                   tie_embeddings: bool | None = None) -> llama.LlamaConfig:
  """A `LlamaConfig` from a HF `config.json` dictionary (transformers 4.x or 5.x keys) of any
  family in `MODEL_TYPES`; `max_position_embeddings` is the model's context length (None
  when absent). A key the family needs and `hf` lacks is a `CheckpointError` naming it."""
  if not isinstance(hf, Mapping):
    raise errors.CheckpointError(f'config.json holds a {type(hf).__name__}, not a JSON object.')
  try:
    return _config_from_hf(hf, dtype=dtype, tie_embeddings=tie_embeddings)
  except KeyError as e:
    key = e.args[0] if e.args else '?'
    raise errors.CheckpointError(
        f'config.json lacks {key!r}, which a {hf.get("model_type", "llama")} model needs; the'
        ' file is incomplete (compare it with the original checkpoint).', key=key) from None
  except (TypeError, ValueError) as e:
    if isinstance(e, errors.CheckpointError):
      raise
    raise errors.CheckpointError(errors.describe(e)) from e


def _config_from_hf(hf: Mapping[str, Any], *, dtype: str,
                    tie_embeddings: bool | None) -> llama.LlamaConfig:
  """`config_from_hf` without its error translation (a KeyError for a missing key)."""
  family = family_of(hf)
  if hf.get('model_type') == 'gemma3':  # multimodal: the language model's own config
    hf = {'model_type': 'gemma3_text', **hf.get('text_config', {})}
  hf = {**_FAMILY_DEFAULTS.get(family, {}), **{k: v for k, v in hf.items() if v is not None
                                               or k in ('sliding_window', 'attn_logit_softcapping',
                                                        'final_logit_softcapping')}}
  if hf.get('attention_bias') and family != 'qwen2':
    raise ValueError(f'config.json sets attention_bias; speclm\'s {family} model has biases'
                     ' only where Qwen2 has them (query, key, value).')
  if hf.get('mlp_bias'):
    raise ValueError('config.json sets mlp_bias; speclm\'s models have no MLP biases.')
  if hf.get('use_bidirectional_attention'):
    raise ValueError('config.json sets use_bidirectional_attention (an embedding model); speclm'
                     ' decodes causal language models only.')
  act_name = hf.get('hidden_activation') or hf.get('hidden_act') or 'silu'
  if act_name not in _ACTIVATIONS:
    raise ValueError(f'Unsupported activation {act_name!r}; speclm supports'
                     f' {", ".join(sorted(_ACTIVATIONS))}.')
  num_heads = int(hf['num_attention_heads'])
  num_layers = int(hf['num_hidden_layers'])
  embed_dim = int(hf['hidden_size'])
  rope = hf.get('rope_parameters') or {}  # transformers >= 5 keeps theta and scaling here
  local_theta = None
  if 'full_attention' in rope:  # Gemma 3: one entry per layer type
    local = rope.get('sliding_attention') or {}
    if _rope_scaling(local) is not None:
      raise ValueError('RoPE scaling on sliding-window layers is not supported.')
    local_theta = float(local.get('rope_theta', hf['rope_local_base_freq']))
    rope = rope['full_attention']
  elif family == 'gemma3':
    local_theta = float(hf['rope_local_base_freq'])
  theta = float(rope.get('rope_theta', hf.get('rope_theta', 10_000.0)))
  scaling = _rope_scaling(rope if rope else hf.get('rope_scaling'))
  if family == 'llama' or (family in ('qwen2', 'qwen3')
                           and not hf.get('use_sliding_window', False)):
    window = None  # HF's Llama has no sliding window; Qwen's is off unless switched on
  else:
    window = hf.get('sliding_window')
    window = int(window) if window else None
  tie = bool(hf.get('tie_word_embeddings', False)) if tie_embeddings is None else tie_embeddings
  max_positions = hf.get('max_position_embeddings')
  gemma = family in ('gemma2', 'gemma3')
  return llama.LlamaConfig(
      vocab_size=int(hf['vocab_size']),
      num_layers=num_layers,
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
      dtype=dtype,
      family=family,
      qkv_bias=family == 'qwen2',
      qk_norm=family in ('qwen3', 'gemma3'),
      post_norms=gemma,
      norm_offset=1.0 if gemma else 0.0,
      activation=_ACTIVATIONS[act_name],
      scale_embeddings=gemma,
      query_pre_attn_scalar=float(hf['query_pre_attn_scalar']) if gemma else None,
      attn_logit_softcap=_cap(hf.get('attn_logit_softcapping')) if gemma else None,
      final_logit_softcap=_cap(hf.get('final_logit_softcapping')) if gemma else None,
      sliding_window=window,
      layer_types=_layer_types(hf, family, num_layers, window),
      local_rope_theta=local_theta)


def _cap(value) -> float | None:
  return float(value) if value else None


# ----------------------------------------------------------------------------------------------
# Parameters

# How an HF tensor becomes ours (HF weights are `[out, in]`, our kernels `[in, out]`):
#   same        as stored (embeddings, norm scales)
#   transposed  [out, in] -> [in, out]
#   heads_in    [heads·H, D] -> [D, heads, H] (query, key, value)
#   heads_out   [D, N·H] -> [N, H, D] (attention output)
#   heads_bias  [heads·H] -> [heads, H]
LAYOUTS = ('same', 'transposed', 'heads_in', 'heads_out', 'heads_bias')


def weight_names(config: llama.LlamaConfig, prefix: str = 'model.'
                 ) -> dict[str, tuple[str, str, tuple[int, ...]]]:
  """Our flat parameter name -> (HF tensor name, layout, HF shape), for `config`'s family.

  `prefix` is where the decoder's weights live (`model.`; a multimodal Gemma 3 keeps its
  language model under `model.language_model.`). Shared by `params_from_hf`, `params_to_hf`
  and the shard-by-shard reader (`speclm.checkpoints.sharded`)."""
  c = config
  d, n, nkv, h, f = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim
  names = {'embedder/embedding': (prefix + 'embed_tokens.weight', 'same', (c.vocab_size, d)),
           'final_norm/scale': (prefix + 'norm.weight', 'same', (d,))}
  if not c.tie_embeddings:
    names['lm_head/kernel'] = ('lm_head.weight', 'transposed', (c.vocab_size, d))
  for i in range(c.num_layers):
    p, q = f'{prefix}layers.{i}.', f'layers_{i}/'
    layer = {
        'pre_attention_norm/scale': ('input_layernorm.weight', 'same', (d,)),
        'attention/query/kernel': ('self_attn.q_proj.weight', 'heads_in', (n * h, d)),
        'attention/key/kernel': ('self_attn.k_proj.weight', 'heads_in', (nkv * h, d)),
        'attention/value/kernel': ('self_attn.v_proj.weight', 'heads_in', (nkv * h, d)),
        'attention/out/kernel': ('self_attn.o_proj.weight', 'heads_out', (d, n * h)),
        'mlp/gate/kernel': ('mlp.gate_proj.weight', 'transposed', (f, d)),
        'mlp/up/kernel': ('mlp.up_proj.weight', 'transposed', (f, d)),
        'mlp/down/kernel': ('mlp.down_proj.weight', 'transposed', (d, f)),
    }
    if c.post_norms:  # Gemma: four norms per layer
      layer.update({
          'post_attention_norm/scale': ('post_attention_layernorm.weight', 'same', (d,)),
          'pre_mlp_norm/scale': ('pre_feedforward_layernorm.weight', 'same', (d,)),
          'post_mlp_norm/scale': ('post_feedforward_layernorm.weight', 'same', (d,))})
    else:
      layer['pre_mlp_norm/scale'] = ('post_attention_layernorm.weight', 'same', (d,))
    if c.qkv_bias:
      layer.update({
          'attention/query/bias': ('self_attn.q_proj.bias', 'heads_bias', (n * h,)),
          'attention/key/bias': ('self_attn.k_proj.bias', 'heads_bias', (nkv * h,)),
          'attention/value/bias': ('self_attn.v_proj.bias', 'heads_bias', (nkv * h,))})
    if c.qk_norm:
      layer.update({'attention/query_norm/scale': ('self_attn.q_norm.weight', 'same', (h,)),
                    'attention/key_norm/scale': ('self_attn.k_norm.weight', 'same', (h,))})
    names.update({q + ours: (p + theirs, layout, shape)
                  for ours, (theirs, layout, shape) in layer.items()})
  return names


def _to_ours(x: np.ndarray, layout: str, config: llama.LlamaConfig) -> np.ndarray:
  h = config.head_dim
  if layout == 'same':
    return x
  if layout == 'transposed':
    return x.T
  if layout == 'heads_in':
    return x.T.reshape(x.shape[1], x.shape[0] // h, h)
  if layout == 'heads_out':
    return x.T.reshape(x.shape[1] // h, h, x.shape[0])
  return x.reshape(-1, h)  # heads_bias


def _to_hf(x: np.ndarray, layout: str, shape: tuple[int, ...]) -> np.ndarray:
  if layout in ('same', 'heads_bias'):
    return x.reshape(shape)
  return x.reshape(shape[::-1]).T  # transposed, heads_in, heads_out


def decoder_prefix(names) -> str:
  """Where a checkpoint keeps its decoder: `model.`, or a multimodal Gemma 3's language model."""
  for prefix in ('model.', 'model.language_model.', 'language_model.model.'):
    if prefix + 'embed_tokens.weight' in names:
      return prefix
  return 'model.'


# Tensors a checkpoint may carry that a language model does not use.
_IGNORED_SUFFIXES = ('rotary_emb.inv_freq',)
_IGNORED_PREFIXES = ('model.vision_tower.', 'vision_tower.', 'model.multi_modal_projector.',
                     'multi_modal_projector.')


def params_from_hf(weights: Mapping[str, np.ndarray], config: llama.LlamaConfig,
                   stored: Mapping[str, tuple[str, Any]] | None = None) -> dict:
  """HF weights (names as `{Family}ForCausalLM.state_dict()`) -> our parameter tree.

  `stored`: our parameter names ('layers_0/mlp/up/kernel') whose weights stay as a checkpoint
  stores them, each `(format, rows)` (`speclm.kernels.quantized`): the rows go in the
  module's dict under the format's name ('layers_0/mlp/up/Q4_K') in place of the float
  parameter, and `weights` need not hold them."""
  stored = stored or {}
  if config.param_dtype == 'bfloat16':
    import ml_dtypes  # pylint: disable=import-outside-toplevel
    target = np.dtype(ml_dtypes.bfloat16)
  else:
    target = np.dtype(config.param_dtype)
  names = weight_names(config, decoder_prefix(weights))
  if 'lm_head/kernel' in names and names['lm_head/kernel'][0] not in weights:
    alternative = 'language_model.lm_head.weight'  # multimodal Gemma 3, transformers 4.x
    names['lm_head/kernel'] = (alternative,) + names['lm_head/kernel'][1:]
  flat = {}
  for ours, (theirs, layout, shape) in names.items():
    if ours in stored:
      fmt, rows = stored[ours]
      flat[ours.rsplit('/', 1)[0] + '/' + fmt] = rows
      continue
    if theirs not in weights:
      raise errors.CheckpointError(f'The checkpoint lacks the tensor {theirs!r}.', key=theirs)
    x = np.asarray(weights[theirs])
    if x.shape != shape:
      raise errors.CheckpointError(f'Tensor {theirs!r} has shape {x.shape}, but config.json'
                                   f' implies {shape}; the weights and the config do not'
                                   ' belong together.', key=theirs)
    flat[ours] = np.ascontiguousarray(_to_ours(x.astype(np.float32), layout, config)
                                      ).astype(target)
  used = {theirs for theirs, _, _ in names.values()}
  heads = ('lm_head.weight', 'language_model.lm_head.weight')
  extra = sorted(k for k in set(weights) - used
                 if not k.endswith(_IGNORED_SUFFIXES) and not k.startswith(_IGNORED_PREFIXES)
                 and not (config.tie_embeddings and k in heads))
  if extra:
    raise ValueError(f'The checkpoint has weights a {config.family} model does not use:'
                     f' {extra[:5]}.')
  return trees.unflatten(flat)


def config_to_hf(config: llama.LlamaConfig) -> dict[str, Any]:
  """The `config.json` dictionary of the HF `{Family}ForCausalLM` equal to `config` (the
  inverse of `config_from_hf`)."""
  c = config
  hf: dict[str, Any] = dict(
      architectures=[_HF_CLASSES[c.family]],
      model_type='gemma3_text' if c.family == 'gemma3' else c.family, vocab_size=c.vocab_size,
      num_hidden_layers=c.num_layers, hidden_size=c.embed_dim, num_attention_heads=c.num_heads,
      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.mlp_dim,
      rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings, rope_theta=c.rope_theta)
  activation = 'silu' if c.activation == 'silu' else 'gelu_pytorch_tanh'
  if c.family in ('gemma2', 'gemma3'):
    scalar = c.query_pre_attn_scalar or c.head_dim
    hf.update(hidden_activation=activation,
              query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
              attn_logit_softcapping=c.attn_logit_softcap,
              final_logit_softcapping=c.final_logit_softcap)
  else:
    hf['hidden_act'] = activation
  if c.family in ('llama', 'qwen3'):
    hf.update(attention_bias=False)
  if c.family == 'llama':
    hf['mlp_bias'] = False
  hf['sliding_window'] = c.sliding_window
  if c.family in ('qwen2', 'qwen3'):
    hf['use_sliding_window'] = c.sliding_window is not None
  if c.sliding_window is not None:
    hf['layer_types'] = [('sliding' if c.is_sliding(i) else 'full') + '_attention'
                         for i in range(c.num_layers)]
  if c.local_rope_theta is not None:
    hf['rope_local_base_freq'] = c.local_rope_theta
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
  """Our parameter tree -> HF weights (float32, `{Family}ForCausalLM.state_dict()` names);
  the inverse of `params_from_hf`."""
  flat = trees.flatten(params)
  return {theirs: np.ascontiguousarray(_to_hf(np.asarray(flat[ours], np.float32), layout, shape))
          for ours, (theirs, layout, shape) in weight_names(config).items()}


def to_transformers(model: protocol.Model, model_class=None):
  """A float32 Hugging Face model (eval mode) with this model's weights: the family's
  `{Family}ForCausalLM` (`LlamaForCausalLM`, `Qwen3ForCausalLM`, `Gemma2ForCausalLM`, …).

  For side-by-side comparisons with Hugging Face `generate()`; needs the `hf` extra.
  `model_class` may name a subclass of that class to build instead.
  """
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  config = model.definition.config
  model_class = model_class or getattr(transformers, _HF_CLASSES[config.family])
  eager = {'attn_implementation': 'eager'} if config.family in ('gemma2', 'gemma3') else {}
  hf_config = model_class.config_class(**config_to_hf(config), **eager)  # eager: soft-capping
  hf_model = model_class(hf_config)
  weights = {k: torch.from_numpy(np.array(v)) for k, v in params_to_hf(model.params, config).items()}
  missing, unexpected = hf_model.load_state_dict(weights, strict=False)
  missing = [k for k in missing if not (config.tie_embeddings and k == 'lm_head.weight')]
  if missing or unexpected:
    raise ValueError(f'Weights do not fit {model_class.__name__}: missing {missing[:5]},'
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
  """`config.json` of a HF checkpoint directory as a dictionary (a truncated file is a
  `CheckpointError` naming it)."""
  path = os.path.join(os.fspath(directory), 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No config.json in {os.fspath(directory)!r}: not a Hugging Face'
                            ' checkpoint directory.')
  return errors.read_json(path, what='config.json')


def read_model_config(directory: str | os.PathLike, *, dtype: str = 'float32'
                      ) -> llama.LlamaConfig:
  """`config_from_hf(read_config(directory))`; every error names the `config.json` file."""
  path = os.path.join(os.fspath(directory), 'config.json')
  hf = read_config(directory)
  try:
    return config_from_hf(hf, dtype=dtype)
  except ValueError as e:
    raise errors.at_path(e, path, name='config.json') from e


def load_model(directory: str | os.PathLike, *, dtype: str = 'float32') -> protocol.Model:
  """Reads a HF checkpoint directory of any supported family (`MODEL_TYPES`) into a
  `speclm.protocol.Model` (a `llama.Llama` with the family's switches).

  Embeddings count as tied when `config.json` says so or when `lm_head.weight` is absent.
  """
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  config = read_model_config(directory, dtype=dtype)  # validates before any weight is read
  weights = read_directory_weights(directory)
  if not config.tie_embeddings and not {'lm_head.weight', 'language_model.lm_head.weight'} & set(
      weights):
    config = dataclasses.replace(config, tie_embeddings=True)
  try:
    params = params_from_hf(weights, config)
  except ValueError as e:  # a missing, extra or misshapen tensor: say which checkpoint
    raise errors.at_path(e, directory) from e
  check_finite(params, os.fspath(directory), error=errors.CheckpointError)
  params = _to_jax(params, jnp)
  definition = llama.Llama(config)
  definition.validate_params(params)
  return protocol.Model(definition, params)


def _to_jax(tree, jnp):
  if isinstance(tree, dict):
    return {k: _to_jax(v, jnp) for k, v in tree.items()}
  return jnp.asarray(tree)
