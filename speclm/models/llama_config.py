"""`LlamaConfig`: the Llama family's sizes and the switches that make Mistral, Qwen2/2.5,
Qwen3, Gemma 2 and Gemma 3 of the same network (`family_config`; see `speclm.models.llama`).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling. `kind` is 'linear' or 'llama3' (as in Hugging Face configs)."""

  kind: str = 'llama3'
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Hyperparameters of a Llama-family model."""

  vocab_size: int
  num_layers: int
  embed_dim: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: RopeScaling | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  param_dtype: str = 'float32'
  dtype: str = 'float32'  # activations and the key/value cache
  # The longest sequence (prompt + generated tokens) the model was trained for: GGUF's
  # `{arch}.context_length`, Hugging Face's `max_position_embeddings`. None = unknown/unlimited.
  max_position_embeddings: int | None = None
  # The switches of the other families (module docstring); the defaults are Llama.
  family: str = 'llama'  # a label: which Hugging Face class `to_transformers` builds
  qkv_bias: bool = False
  qk_norm: bool = False
  post_norms: bool = False
  norm_offset: float = 0.0  # norms scale by (offset + w): Gemma stores w around 0
  activation: str = 'silu'  # of the gate: 'silu' (SwiGLU) or 'gelu_tanh' (GeGLU)
  scale_embeddings: bool = False  # embeddings multiplied by √D (Gemma)
  query_pre_attn_scalar: float | None = None  # scores scaled by its ^-½; None: head_dim
  attn_logit_softcap: float | None = None  # scores -> cap·tanh(scores / cap)
  final_logit_softcap: float | None = None  # logits -> cap·tanh(logits / cap)
  sliding_window: int | None = None
  # 'full' or 'sliding' per layer; None: every layer sliding if sliding_window is set, else full.
  layer_types: tuple[str, ...] | None = None
  local_rope_theta: float | None = None  # RoPE base of the sliding layers (unscaled); None: shared

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f'Unknown model family {self.family!r}; speclm supports'
                       f' {", ".join(FAMILIES)}.')
    if self.activation not in _ACTIVATIONS:
      raise ValueError(f'Unknown activation {self.activation!r}; expected one of'
                       f' {", ".join(_ACTIVATIONS)}.')
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers:
        raise ValueError(f'layer_types names {len(self.layer_types)} layers, the model has'
                         f' {self.num_layers}.')
      if set(self.layer_types) - {'full', 'sliding'}:
        raise ValueError(f"layer_types entries must be 'full' or 'sliding', got"
                         f' {sorted(set(self.layer_types))}.')
      if 'sliding' in self.layer_types and not self.sliding_window:
        raise ValueError('layer_types has sliding layers but sliding_window is not set.')
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f'sliding_window must be positive or None, got {self.sliding_window}.')
    if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
      raise ValueError('max_position_embeddings must be positive or None, got'
                       f' {self.max_position_embeddings}.')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads ({self.num_heads}) must be a multiple of num_kv_heads'
                       f' ({self.num_kv_heads}).')
    if self.head_dim % 2:
      raise ValueError(f'head_dim must be even for RoPE, got {self.head_dim}.')


  def is_sliding(self, layer: int) -> bool:
    """Whether decoder layer `layer` attends through the sliding window."""
    if self.sliding_window is None:
      return False
    return self.layer_types is None or self.layer_types[layer] == 'sliding'


FAMILIES = ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma2', 'gemma3')
_ACTIVATIONS = ('silu', 'gelu_tanh')


def family_config(family: str, **fields) -> LlamaConfig:
  """A `LlamaConfig` with `family`'s switches set (module docstring); `fields` give the sizes
  and may override any switch. Gemma 2's layers alternate sliding/global starting with a
  sliding one, Gemma 3's have 5 sliding layers before each global one (Hugging Face's rule)."""
  switches: dict[str, Any] = {}
  num_layers = fields.get('num_layers')
  if family == 'qwen2':
    switches = dict(qkv_bias=True)
  elif family == 'qwen3':
    switches = dict(qk_norm=True)
  elif family in ('gemma2', 'gemma3'):
    switches = dict(post_norms=True, norm_offset=1.0, activation='gelu_tanh',
                    scale_embeddings=True, tie_embeddings=True)
    every = 2 if family == 'gemma2' else 6
    if num_layers is not None and fields.get('sliding_window'):
      switches['layer_types'] = tuple('full' if (i + 1) % every == 0 else 'sliding'
                                      for i in range(num_layers))
    if family == 'gemma3':
      switches.update(qk_norm=True, local_rope_theta=10_000.0)
  elif family not in FAMILIES:
    raise ValueError(f'Unknown model family {family!r}; speclm supports {", ".join(FAMILIES)}.')
  switches.update(fields)
  return LlamaConfig(family=family, **switches)
