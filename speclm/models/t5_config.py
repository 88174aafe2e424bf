"""`T5Config`: a T5 model's sizes and switches, with T5X's field names (see `speclm.models.t5`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


DEFAULT_VOCABULARY_PATH = 'gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model'
_ACTIVATIONS = ('relu', 'gelu', 'gelu_exact', 'silu', 'linear')


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Hyperparameters of a T5 model; field names follow T5X's `network.T5Config`.

  A plain dataclass (this module imports no gin): the job layer registers it with gin under
  the name `speclm.models.t5.T5Config`, which the gin files in configs/models/ bind.

  Attributes:
    vocab_size: embedding rows (32128 for the public T5 checkpoints: 32000 SentencePiece
      pieces, 100 sentinels, padding to a multiple of 128).
    emb_dim: model width D.
    num_heads, head_dim: N and H; the attention kernels are `[D, N*H]`.
    num_encoder_layers, num_decoder_layers: depth of each stack.
    mlp_dim: F.
    mlp_activations: ('relu',) for v1.0; ('gelu', 'linear') for v1.1 — one input kernel per
      activation (`wi` when there is one, else `wi_0`, `wi_1`, …), multiplied together.
      'gelu' is the tanh approximation (as T5X's `nn.gelu` and Hugging Face's 'gelu_new').
    logits_via_embedding: v1.0 ties the output layer to the embedding (and divides by √D).
    relative_attention_num_buckets, relative_attention_max_distance: position buckets.
    layer_norm_epsilon: RMS norm ε.
    dtype: activations and the cache. param_dtype: how parameters are created and restored.
    decoder_start_token_id, pad_id, eos_id: T5's conventions (0, 0, 1).
    vocabulary_path: the SentencePiece model matching the embedding (a gin binding; the
      model does not read it, the data pipeline does).
  """

  vocab_size: int = 32128
  emb_dim: int = 512
  num_heads: int = 6
  num_encoder_layers: int = 8
  num_decoder_layers: int = 8
  head_dim: int = 64
  mlp_dim: int = 1024
  mlp_activations: tuple[str, ...] = ('gelu', 'linear')
  logits_via_embedding: bool = False
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  decoder_start_token_id: int = 0
  pad_id: int = 0
  eos_id: int = 1
  vocabulary_path: str = DEFAULT_VOCABULARY_PATH

  def __post_init__(self):
    # gin passes lists; keep the dataclass hashable.
    object.__setattr__(self, 'mlp_activations', tuple(self.mlp_activations))
    for name in ('vocab_size', 'emb_dim', 'num_heads', 'num_encoder_layers',
                 'num_decoder_layers', 'head_dim', 'mlp_dim', 'relative_attention_num_buckets',
                 'relative_attention_max_distance'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'T5Config.{name} must be a positive integer, got {value!r}.')
    if not self.mlp_activations:
      raise ValueError('T5Config.mlp_activations must name at least one activation.')
    for act in self.mlp_activations:
      if act not in _ACTIVATIONS:
        raise ValueError(f'Unknown T5Config.mlp_activations entry {act!r}; expected one of'
                         f' {_ACTIVATIONS}.')
    for name in ('dtype', 'param_dtype'):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError as e:
        raise ValueError(f'T5Config.{name} is not a dtype: {getattr(self, name)!r}.') from e
    if not 0 <= self.decoder_start_token_id < self.vocab_size:
      raise ValueError(f'T5Config.decoder_start_token_id must lie in [0, {self.vocab_size}),'
                       f' got {self.decoder_start_token_id}.')

  @property
  def version(self) -> str:
    """'1.0' for a ReLU MLP with tied logits, '1.1' for a gated MLP with untied logits."""
    if self.mlp_activations == ('relu',) and self.logits_via_embedding:
      return '1.0'
    if self.mlp_activations == ('gelu', 'linear') and not self.logits_via_embedding:
      return '1.1'
    return 'custom'
