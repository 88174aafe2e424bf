"""A Llama target's own replies, generated in PyTorch bfloat16 for training drafts (CPU).

Training a draft on the text its target writes teaches it the distribution it meets while
drafting (docs/drafts.md). `speclm.autoregressive_decode` writes such replies exactly, in
float32, at 60–130 reply tokens/s on 2 CPU cores; Hugging Face's `generate` in bfloat16 ran at
240–290 (batch 64–128), most of a step going to its attention for one query and to growing
its cache. `generate` here runs the same weights (`hf_llama.to_transformers`) with a
preallocated cache and the attention of one query written as two products, in bfloat16 where
oneDNN has AVX512-BF16/AMX: 530–590 reply tokens/s on short prompts (docs/drafts.md). Its
replies are the model's within bfloat16 rounding, which is all a training set needs.

`generate_with_features` also keeps what an EAGLE draft learns from, in the same pass: the
hidden states of chosen layers at every position of prompt and reply, and the top-k of the
temperature-1 distribution wherever a reply token is predicted. Computing them afterwards from
the text is a second forward pass over every token (scripts/train_smollm2_eagle.py
--stage=features).

Shape letters: B rows, P prompt width, N new tokens, L cache length, H query heads, G key/value
heads, E head width, D model width.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import torch


class _Weights:
  """The tensors of a transformers `LlamaForCausalLM` (plain Llama layers only) in `dtype`."""

  def __init__(self, hf_model, dtype=torch.bfloat16):
    self.dtype = dtype
    config = hf_model.config
    self.num_heads = config.num_attention_heads
    self.num_kv_heads = config.num_key_value_heads
    self.head_dim = config.hidden_size // config.num_attention_heads
    self.eps = config.rms_norm_eps
    inner = hf_model.model
    rotary = inner.rotary_emb
    if float(getattr(rotary, 'attention_scaling', 1.0)) != 1.0:
      raise NotImplementedError('generate() supports plain RoPE only.')
    self.inv_freq = rotary.inv_freq.float()
    cast = lambda w: w.detach().to(dtype)
    self.layers = []
    for layer in inner.layers:
      a, m = layer.self_attn, layer.mlp
      if any(p.bias is not None for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)):
        raise NotImplementedError('generate() supports Llama layers without biases only.')
      self.layers.append(dict(
          qkv=cast(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])).T.contiguous(),
          o=cast(a.o_proj.weight).T.contiguous(),
          gate_up=cast(torch.cat([m.gate_proj.weight, m.up_proj.weight])).T.contiguous(),
          down=cast(m.down_proj.weight).T.contiguous(),
          norm1=layer.input_layernorm.weight.detach().float(),
          norm2=layer.post_attention_layernorm.weight.detach().float()))
    self.final_norm = inner.norm.weight.detach().float()
    self.embedding = cast(inner.embed_tokens.weight)
    self.head = cast(hf_model.lm_head.weight).T.contiguous()


def _rms_norm(x, scale, eps):
  dtype, x = x.dtype, x.float()
  return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale).to(dtype)


def _rotate(x, cos, sin):
  """RoPE in the rotate-half convention (transformers' Llama): x `[B, H, T, E]`, float32."""
  x = x.float()
  half = x.shape[-1] // 2
  return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _forward(w: _Weights, tokens, positions, keys, values, start: int, key_ok,
             feature_layers=None, last_only: bool = False):
  """(logits float32, features) of `tokens` `[B, T]` at `positions` `[B, T]`, written into
  the caches `keys` `[layers, B, G, E, L]` (transposed) and `values` `[layers, B, G, L, E]`
  at slots start … start+T−1; `key_ok` `[B, T, L]` says which cache slots each query attends
  to. Logits are `[B, T, V]`, or `[B, 1, V]` of the last position with `last_only` (a
  prompt's other positions need no vocabulary-wide product). Features `[B, T, F]` (None
  without `feature_layers`): the outputs of those decoder layers (counted from 0), side by
  side, or with `feature_layers='final'` the final norm's output (the head's input).

  The attention's products read the whole cache, masked: oneDNN's batched product copies an
  operand that is not contiguous, and a slice of the cache is not, so slicing to the filled
  slots cost more (a copy of the cache per layer and step) than the masked ones."""
  batch, length = tokens.shape
  h, g, e = w.num_heads, w.num_kv_heads, w.head_dim
  angles = positions.float()[..., None] * w.inv_freq  # [B, T, E/2]
  angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, E]
  cos, sin = angles.cos(), angles.sin()
  bias = torch.zeros(key_ok.shape, dtype=torch.float32).masked_fill(~key_ok, float('-inf'))
  bias = bias[:, None].repeat(1, 1, h // g, 1)  # [B, 1, (H/G)·T, S], as the queries below
  x = w.embedding[tokens]
  end = start + length
  kept = {}
  for i, layer in enumerate(w.layers):
    qkv = _rms_norm(x, layer['norm1'], w.eps) @ layer['qkv']
    q, k, v = qkv.split([h * e, g * e, g * e], dim=-1)
    q = _rotate(q.view(batch, length, h, e).transpose(1, 2), cos, sin)
    keys[i, :, :, :, start:end] = _rotate(k.view(batch, length, g, e).transpose(1, 2), cos,
                                          sin).transpose(-1, -2).to(keys.dtype)
    values[i, :, :, start:end] = v.view(batch, length, g, e).transpose(1, 2)
    # The query heads that share a key/value head as rows of one product (no copy of the cache).
    q = q.reshape(batch, g, h // g * length, e)
    scores = (q.to(keys.dtype) @ keys[i]).float() * e**-0.5 + bias
    attended = torch.softmax(scores, dim=-1).to(values.dtype) @ values[i]
    attended = attended.view(batch, h, length, e).transpose(1, 2).reshape(batch, length, h * e)
    x = x + attended.to(w.dtype) @ layer['o']
    gate, up = (_rms_norm(x, layer['norm2'], w.eps) @ layer['gate_up']).chunk(2, dim=-1)
    x = x + (torch.nn.functional.silu(gate) * up) @ layer['down']
    if feature_layers is not None and feature_layers != 'final' and i in feature_layers:
      kept[i] = x
  normed = _rms_norm(x, w.final_norm, w.eps)
  features = None
  if feature_layers == 'final':
    features = normed
  elif feature_layers is not None:
    features = torch.cat([kept[i] for i in feature_layers], dim=-1)
  logits = ((normed[:, -1:] if last_only else normed) @ w.head).float()
  return logits, features


@dataclasses.dataclass(frozen=True)
class ReplyWithFeatures:
  """One row of `generate_with_features`: the reply, and over the whole sequence (prompt +
  reply, S positions) the target's features and soft labels.

  features: `[S, F]` bfloat16 bits as uint16 (scripts/train_smollm2_eagle.py's format).
  probs, ids: `[S, k]` float16 / int32, the top k of the temperature-1 distribution at each
    position that predicts a reply token or follows the last one (the prompt's last position
    onwards); the prompt's earlier positions hold zeros (no reply token follows them).
  """
  reply: list[int]
  features: np.ndarray
  probs: np.ndarray
  ids: np.ndarray


def generate(hf_model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             end_ids: Sequence[int], temperature: float = 0.0, seed: int = 0,
             threads: int | None = None, dtype=torch.bfloat16) -> list[list[int]]:
  """Each prompt's reply (token ids, ending with its end token if one came), batched.

  hf_model: a transformers `LlamaForCausalLM` (e.g. `hf_llama.to_transformers(target)`).
  prompts: token ids, left-padded together (sort them by length first for little padding).
  temperature: 0 for greedy replies, else samples at that temperature.
  dtype: of the weights, activations and cache (float32 for tests against transformers).
  """
  replies, _, _ = _generate(_Weights(hf_model, dtype), prompts, max_new_tokens, end_ids,
                            temperature, seed, threads)
  return replies


def generate_with_features(hf_model, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                           end_ids: Sequence[int], feature_layers, top_k: int,
                           temperature: float = 0.0, seed: int = 0, threads: int | None = None,
                           dtype=torch.bfloat16) -> list[ReplyWithFeatures]:
  """`generate`'s replies with the features and soft labels of every position, from the same
  forward passes (the replies are the same as `generate`'s).

  feature_layers: decoder layers (counted from 0) whose outputs are kept side by side, as
    EAGLE-3 reads them, or 'final' for the final norm's output (EAGLE).
  top_k: soft-label tokens kept per position.
  """
  if feature_layers != 'final':
    feature_layers = tuple(int(i) for i in feature_layers)
    num_layers = hf_model.config.num_hidden_layers
    if not feature_layers or any(not 0 <= i < num_layers for i in feature_layers):
      raise ValueError(f'feature_layers={feature_layers}: decoder layers 0 … {num_layers - 1}'
                       " or 'final'.")
  if top_k < 1:
    raise ValueError(f'top_k={top_k}: at least 1.')
  replies, features, labels = _generate(_Weights(hf_model, dtype), prompts, max_new_tokens,
                                        end_ids, temperature, seed, threads, feature_layers,
                                        top_k)
  width = max(len(p) for p in prompts)  # the common (left-padded) prompt width
  bits = features.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
  out = []
  for row, (prompt, reply) in enumerate(zip(prompts, replies)):
    first, last = width - len(prompt), width + len(reply)  # the row's slots
    probs = np.zeros((last - first, top_k), np.float16)
    ids = np.zeros((last - first, top_k), np.int32)
    # labels[.][:, s] belong to slot width − 1 + s: the prompt's last position onwards
    probs[len(prompt) - 1:] = labels[0][row, :len(reply) + 1]
    ids[len(prompt) - 1:] = labels[1][row, :len(reply) + 1]
    out.append(ReplyWithFeatures(reply, bits[row, first:last].copy(), probs, ids))
  return out


def teacher_forced_features(hf_model, feature_layers, top_k: int):
  """A function tokens `[B, T]` -> (features `[B, T, F]` bfloat16 bits as uint16, top-k
  probabilities float16, their ids int32) of text already written, from one forward pass of
  transformers' model (the second pass `generate_with_features` saves). feature_layers:
  decoder layers counted from 0, or None for the final norm's output."""

  def forward(tokens):
    with torch.inference_mode():
      out = hf_model(torch.from_numpy(np.asarray(tokens, np.int64)), output_hidden_states=True)
      if feature_layers is None:
        features = out.hidden_states[-1]  # after the final norm: the head's input
      else:  # hidden_states[i + 1] is the output of decoder layer i (counted from 0)
        features = torch.cat([out.hidden_states[i + 1] for i in feature_layers], dim=-1)
      probs, ids = torch.topk(torch.softmax(out.logits.float(), dim=-1), top_k, dim=-1)
    features = features.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return features, probs.to(torch.float16).numpy(), ids.numpy().astype(np.int32)

  return forward


def _top_k(logits, k: int):
  """Top k of softmax(logits) `[B, V]` -> (float16 probabilities, int32 ids) `[B, k]`."""
  probs, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
  return probs.to(torch.float16).numpy(), ids.numpy().astype(np.int32)


def _generate(w: _Weights, prompts, max_new_tokens: int, end_ids, temperature: float, seed: int,
              threads: int | None, feature_layers=None, top_k: int = 0):
  """The decode loop of `generate` -> (replies; with `feature_layers`, features `[B, P + N,
  F]` over every slot and the soft labels (probabilities, ids) `[B, N + 1, k]` of slots
  P − 1 … P + N − 1; else None, None)."""
  if threads:
    torch.set_num_threads(threads)
  dtype = w.dtype
  batch, width = len(prompts), max(len(p) for p in prompts)
  pad = torch.tensor([width - len(p) for p in prompts])
  tokens = torch.zeros((batch, width), dtype=torch.long)
  for row, prompt in enumerate(prompts):
    tokens[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
  capacity = width + max_new_tokens
  shape = (len(w.layers), batch, w.num_kv_heads, capacity, w.head_dim)
  keys = torch.zeros(shape[:3] + shape[4:] + shape[3:4], dtype=dtype)  # [layers, B, G, E, L]
  values = torch.zeros(shape, dtype=dtype)
  slots = torch.arange(capacity)
  real = slots[None, :] >= pad[:, None]  # [B, L]: not left padding
  causal = slots[:width, None] >= slots[None, :]  # [P, L]
  generator = torch.Generator().manual_seed(seed)
  end = torch.tensor(sorted(set(int(i) for i in end_ids)), dtype=torch.long)
  replies = torch.zeros((batch, max_new_tokens), dtype=torch.long)
  done = torch.zeros(batch, dtype=torch.bool)
  features, labels = [], []

  def step(tokens, positions, start, key_ok):
    logits, kept = _forward(w, tokens, positions, keys, values, start, key_ok, feature_layers,
                            last_only=True)
    logits = logits[:, -1]
    if feature_layers is not None:
      features.append(kept)
      labels.append(_top_k(logits, top_k))
    return logits

  with torch.inference_mode():
    positions = (slots[None, :width] - pad[:, None]).clamp(min=0)
    # A padding query attends to itself only (a row of no keys would be NaN, and its NaN
    # values would reach the real queries through zero weights).
    key_ok = (causal[None] & real[:, None]) | (slots[:width, None] == slots[None, :])[None]
    logits = step(tokens, positions, 0, key_ok)
    for n in range(max_new_tokens):
      if temperature > 0:
        probs = torch.softmax(logits / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)[:, 0]
      else:
        token = logits.argmax(-1)
      token = torch.where(done, torch.zeros_like(token), token)
      replies[:, n] = token
      done |= torch.isin(token, end)
      last = bool(done.all()) or n + 1 == max_new_tokens
      if last and feature_layers is None:
        break
      slot = width + n  # with features, the last tokens are fed too: their features
      logits = step(token[:, None], (slot - pad)[:, None], slot,
                    (real & (slots <= slot)[None])[:, None])
      if last:
        break
  out, end_set = [], set(end.tolist())
  for row in replies.tolist():
    stop = next((i + 1 for i, t in enumerate(row) if t in end_set), len(row))
    out.append(row[:stop])
  if feature_layers is None:
    return out, None, None
  return (out, torch.cat(features, dim=1),
          tuple(np.stack(part, axis=1) for part in zip(*labels)))
