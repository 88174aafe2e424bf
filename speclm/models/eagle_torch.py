"""The EAGLE-3 draft's training-time test in PyTorch, for training where bfloat16 is fast.

`speclm.models.eagle` is the draft speclm decodes with (Flax). This module is the same
computation for training only: on CPUs with AMX, PyTorch's bfloat16 products (oneDNN) run
about 8x its float32 ones and XLA's float32 ones (docs/drafts.md), while XLA's CPU backend
has no bfloat16 path for every product of the draft's backward pass. The parameters are the
Flax tree's, flattened ('layers_0/attention/query/kernel' …), so a draft trained here is
written and loaded by the Flax code unchanged; `tests/test_eagle_torch.py` checks that
`training_time_test` gives `eagle.training_time_test`'s logits for the same parameters.

Only what SmolLM2's drafts use is built: Llama layers with grouped-query attention, RoPE,
SwiGLU and RMSNorm, no biases, QK norms, soft-capping, post-norms or sliding windows; other
configurations raise.

Shape letters: B batch, T positions, D width, N query heads, M key-value heads, H head width,
S head tokens, L cache slots.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import torch.nn.functional as F

from speclm import trees
from speclm.models import eagle
from speclm.models import llama

# The frozen entries (the target's embedding table, the head's rows of it and their ids).
FROZEN = ('embedding', 'head', 'head_ids')


def _check_supported(config: llama.LlamaConfig) -> None:
  unsupported = {name: getattr(config, name) for name in (
      'qkv_bias', 'qk_norm', 'post_norms', 'attn_logit_softcap', 'query_pre_attn_scalar',
      'sliding_window') if getattr(config, name, None)}
  if config.activation != 'silu':
    unsupported['activation'] = config.activation
  if unsupported:
    raise NotImplementedError(f'eagle_torch builds plain Llama layers only; this draft has'
                              f' {unsupported}.')


@functools.lru_cache(maxsize=64)
def _visibility(length: int, step: int) -> torch.Tensor:
  """`eagle.ttt_visibility` over the slots of steps 0 … `step` `[T, (step + 1)·T]`."""
  return torch.from_numpy(np.array(eagle.ttt_visibility(length, step, (step + 1) * length)))


class TorchEagle(torch.nn.Module):
  """An `eagle.EagleDraft`'s trainable parameters as torch Parameters (float32 masters), the
  borrowed embedding table and head as buffers."""

  def __init__(self, definition: eagle.EagleDraft, params: dict):
    super().__init__()
    c = definition.config
    _check_supported(c)
    if definition.feature_layers is None:
      raise NotImplementedError('eagle_torch trains EAGLE-3 drafts (feature_layers set).')
    self.definition = definition
    self._paths = []
    for path, value in trees.flatten(definition.trained(params)).items():
      if path.split('/')[0] in FROZEN:
        continue
      self._paths.append(path)
      self.register_parameter(path.replace('/', '__'),
                              torch.nn.Parameter(torch.tensor(np.asarray(value, np.float32))))
    self.register_buffer('embedding', torch.tensor(np.asarray(params['embedding'], np.float32)))
    self.register_buffer('head', torch.tensor(np.asarray(params['head']['kernel'], np.float32)))
    self.inv_freq = torch.tensor(np.asarray(llama.rope_frequencies(c, 0), np.float32))

  def p(self, path: str) -> torch.Tensor:
    """The parameter at a Flax path."""
    return getattr(self, path.replace('/', '__'))

  def trained_tree(self) -> dict:
    """The trainable parameters as the Flax tree of numpy float32 arrays."""
    return trees.unflatten({path: self.p(path).detach().float().numpy().copy()
                            for path in self._paths})

  def load_trained_tree(self, trained: dict) -> None:
    """Sets the trainable parameters from a Flax tree (e.g. a resumed state)."""
    with torch.no_grad():
      for path, value in trees.flatten(trained).items():
        if path in self._paths:
          self.p(path).copy_(torch.tensor(np.asarray(value, np.float32)))

  def _norm(self, x, path):
    c = self.definition.config
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + c.norm_eps)
    return (normed * (c.norm_offset + self.p(path + '/scale').float())).to(x.dtype)

  def _rope(self, x, positions):
    angles = positions[:, None].float() * self.inv_freq  # [T, H/2]
    cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

  def _layer(self, i, x, positions, keys, values, visible):
    """One decoder layer; keys/values `[B, M, L, H]` hold the earlier steps' entries, to which
    this step's are appended (the slots `ttt_visibility` counts)."""
    c = self.definition.config
    base = f'layers_{i}'
    b, t, _ = x.shape
    n, m, h = c.num_heads, c.num_kv_heads, c.head_dim
    normed = self._norm(x, f'{base}/pre_attention_norm')
    kernel = lambda name: self.p(f'{base}/attention/{name}/kernel')
    q = (normed @ kernel('query').reshape(c.embed_dim, n * h)).reshape(b, t, n, h)
    k = (normed @ kernel('key').reshape(c.embed_dim, m * h)).reshape(b, t, m, h)
    v = (normed @ kernel('value').reshape(c.embed_dim, m * h)).reshape(b, t, m, h)
    q, k = self._rope(q, positions), self._rope(k, positions)
    keys = torch.cat([keys, k.transpose(1, 2).to(keys.dtype)], dim=2)
    values = torch.cat([values, v.transpose(1, 2).to(values.dtype)], dim=2)
    groups = n // m  # query head j reads key-value head j // groups, as in llama.Attention
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.repeat_interleave(groups, 1).to(q.dtype),
        values.repeat_interleave(groups, 1).to(q.dtype), attn_mask=visible,
        scale=h ** -0.5)  # [B, N, T, H]
    out = out.transpose(1, 2).reshape(b, t, n * h) @ kernel('out').reshape(n * h, c.embed_dim)
    x = x + out
    normed = self._norm(x, f'{base}/pre_mlp_norm')
    mlp = lambda name: self.p(f'{base}/mlp/{name}/kernel')
    hidden = F.silu((normed @ mlp('gate')).float()) * (normed @ mlp('up')).float()
    return x + hidden.to(x.dtype) @ mlp('down'), keys, values

  def step(self, embedded, features, positions, cache, visible):
    """`EagleModule.__call__` for one unrolled step, up to the head -> (its last layer's
    output `[B, T, D]`, the head's input (the final norm's output) `[B, T, D]`, the cache with
    this step's entries)."""
    c = self.definition.config
    d = c.embed_dim
    if features.shape[-1] != d:
      features = features @ self.p('reduce/kernel')
    if self.definition.input_norms:
      embedded = self._norm(embedded, 'embedding_norm')
      features = self._norm(features, 'feature_norm')
    x = torch.cat([embedded, features], dim=-1) @ self.p('fuse/kernel')
    new_cache = []
    for i in range(c.num_layers):
      x, keys, values = self._layer(i, x, positions, *cache[i], visible)
      new_cache.append((keys, values))
    return x, self._norm(x, 'final_norm'), new_cache

  def unrolled_head_inputs(self, tokens: torch.Tensor, features: torch.Tensor, steps: int):
    """The head's inputs `[B, T, D]` at each unrolled step of `eagle.training_time_test`."""
    c = self.definition.config
    batch, length = tokens.shape
    positions = torch.arange(length)
    embedded = self.embedding[tokens]
    shift = lambda x: F.pad(x[:, :-1], (0, 0, 1, 0))  # position t reads t − 1's
    inputs, out = shift(features), []
    empty = features.new_zeros((batch, c.num_kv_heads, 0, c.head_dim))
    cache = [(empty, empty)] * c.num_layers
    for step in range(steps):
      # the slots filled so far: steps 0 … step, as ttt_visibility numbers them
      visible = _visibility(length, step)
      x, head_input, cache = self.step(embedded, inputs, positions, cache, visible)
      out.append(head_input)
      inputs = shift(x)
    return out

  def training_time_test(self, tokens: torch.Tensor, features: torch.Tensor, steps: int):
    """`eagle.training_time_test` -> logits `[steps, B, T, S]` (float32)."""
    return torch.stack([(h @ self.head.to(h.dtype)).float()
                        for h in self.unrolled_head_inputs(tokens, features, steps)])


class _HeadScores(torch.autograd.Function):
  """Per row of `hidden` `[N, D]`: logsumexp of its logits `hidden @ head` `[N, S]`, the
  logits at `ids` `[N, k]` and the argmax, computed `chunk` rows at a time, so that no
  `[N, S]` tensor is ever whole (a step's vocabulary-wide work then stays in cache); the
  backward pass recomputes each chunk's logits. `head` is frozen (no gradient)."""

  @staticmethod
  def forward(ctx, hidden, head, ids, chunk: int):  # pylint: disable=arguments-differ
    head = head.to(hidden.dtype)
    normalizer = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    picked = hidden.new_empty(ids.shape, dtype=torch.float32)
    argmax = torch.empty(hidden.shape[0], dtype=torch.long)
    for first in range(0, hidden.shape[0], chunk):
      rows = slice(first, first + chunk)
      logits = (hidden[rows] @ head).float()
      normalizer[rows] = torch.logsumexp(logits, -1)
      picked[rows] = logits.gather(-1, ids[rows])
      argmax[rows] = logits.argmax(-1)
    ctx.save_for_backward(hidden, head, ids, normalizer)
    ctx.chunk = chunk
    ctx.mark_non_differentiable(argmax)
    return normalizer, picked, argmax

  @staticmethod
  def backward(ctx, grad_normalizer, grad_picked, _):  # pylint: disable=arguments-differ
    hidden, head, ids, normalizer = ctx.saved_tensors
    grad_hidden = torch.empty_like(hidden)
    for first in range(0, hidden.shape[0], ctx.chunk):
      rows = slice(first, first + ctx.chunk)
      logits = (hidden[rows] @ head).float()
      # d logsumexp / d logits = softmax; d picked / d logits scatters onto the ids
      grad_logits = torch.exp(logits - normalizer[rows, None]) * grad_normalizer[rows, None]
      grad_logits.scatter_add_(1, ids[rows], grad_picked[rows])
      grad_hidden[rows] = grad_logits.to(head.dtype) @ head.T
    return grad_hidden, None, None, None


def head_scores(hidden: torch.Tensor, head: torch.Tensor, ids: torch.Tensor,
                chunk: int = 256):
  """hidden `[B, T, D]`, ids `[B, T, k]` -> (logsumexp of the logits `[B, T]`, the logits at
  `ids` `[B, T, k]`, the argmax `[B, T]`), float32, by `_HeadScores`."""
  b, t, d = hidden.shape
  normalizer, picked, argmax = _HeadScores.apply(hidden.reshape(b * t, d), head,
                                                 ids.reshape(b * t, -1), chunk)
  return normalizer.reshape(b, t), picked.reshape(b, t, -1), argmax.reshape(b, t)


# ----------------------------------------------------------------------------------------------
# Training: the loss of scripts/train_smollm2_eagle.py's EAGLE-3 steps, and AdamW


def token_loss(normalizer, picked, labels, soft_probs, mask, soft_weight: float):
  """Mean over masked positions of `soft_weight` × cross-entropy against the target's soft
  labels (its top-k probabilities over head tokens) + the rest × next-token cross-entropy
  (positions whose next token is in the head: `labels` ≥ 0), from `head_scores` of the ids
  [label, soft label 1 … k]: −log q(i) = logsumexp(logits) − logits[i]. normalizer, labels
  and mask `[B, T]`, picked `[B, T, 1 + k]`, soft_probs `[B, T, k]`."""
  nll = normalizer[..., None] - picked
  in_head = mask * (labels >= 0)
  hard = (nll[..., 0] * in_head).sum() / in_head.sum().clamp(min=1.0)
  if not soft_weight:
    return hard
  soft = ((soft_probs * nll[..., 1:]).sum(-1) * mask).sum() / mask.sum().clamp(min=1.0)
  return soft_weight * soft + (1 - soft_weight) * hard


def ttt_loss(module: TorchEagle, tokens, features, labels, soft_probs, soft_labels, mask,
             steps: int, soft_weight: float, decay: float = 0.8):
  """The draft's loss on a batch: `token_loss` at every step of the training-time test,
  step j weighted decay^j and counting positions t ≥ j only (a round's j-th proposal follows
  a verified position t − j) -> (loss, argmax accuracy at step 0, at the last step)."""
  ids = torch.cat([labels.clamp(min=0)[..., None], soft_labels], -1)
  positions = torch.arange(labels.shape[1])[None, :]
  total, weights, accuracies = 0.0, 0.0, []
  for j, hidden in enumerate(module.unrolled_head_inputs(tokens, features, steps)):
    normalizer, picked, argmax = head_scores(hidden, module.head, ids)
    counted = mask * (positions >= j)
    total = total + decay ** j * token_loss(normalizer, picked, labels, soft_probs, counted,
                                            soft_weight)
    weights += decay ** j
    accuracies.append(((argmax == labels) * counted).sum() / counted.sum().clamp(min=1.0))
  return total / weights, accuracies[0], accuracies[-1]


class Trainer:
  """AdamW on a `TorchEagle` (optax.adamw's update: the same betas, eps and decoupled weight
  decay), its products in bfloat16 under autocast when `bfloat16`, master weights float32."""

  def __init__(self, definition: eagle.EagleDraft, params: dict, *, steps: int,
               soft_weight: float, weight_decay: float = 0.01, bfloat16: bool = True):
    self.module = TorchEagle(definition, params)
    self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=0.0, betas=(0.9, 0.999),
                                       eps=1e-8, weight_decay=weight_decay)
    self.steps, self.soft_weight, self.bfloat16 = steps, soft_weight, bfloat16

  def step(self, learning_rate: float, tokens, features, labels, soft_probs, soft_labels,
           mask) -> tuple[float, float, float]:
    """One update on a batch of numpy arrays (`make_batch`'s) -> (loss, argmax accuracy at
    unrolled step 0, at the last step)."""
    as_tensor = lambda x: torch.from_numpy(np.asarray(x))
    tokens, labels, soft_labels = (as_tensor(x).long() for x in (tokens, labels, soft_labels))
    features, soft_probs, mask = (as_tensor(x).float() for x in (features, soft_probs, mask))
    for group in self.optimizer.param_groups:
      group['lr'] = float(learning_rate)  # a numpy scalar would not reload (weights_only)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=self.bfloat16):
      loss, first, last = ttt_loss(self.module, tokens, features, labels, soft_probs,
                                   soft_labels, mask, self.steps, self.soft_weight)
    self.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    self.optimizer.step()
    return float(loss.detach()), float(first), float(last)

  def save(self, path: str) -> None:
    """The optimizer's state (the parameters travel in the caller's Flax tree)."""
    torch.save(self.optimizer.state_dict(), path + '.tmp')
    os.replace(path + '.tmp', path)

  def restore(self, path: str, trained: dict) -> None:
    """Parameters from the Flax tree `trained`, the optimizer's state from `path`."""
    self.module.load_trained_tree(trained)
    self.optimizer.load_state_dict(torch.load(path))
