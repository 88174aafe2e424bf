"""Unigram and bigram drafts (paper §3.6 and Table 3): drafts that cost almost nothing, c ≈ 0.

Both implement `speclm.protocol.LanguageModel`; their logits are log-probabilities, and a
token the draft never proposes may have probability zero (logit -inf): speculative sampling
stays exact for any q, only α changes.

* Unigram: q(x) = P(x), the same for every position.
* Bigram: q(x | t) with t the previous token. A full V×V table is out of the question for
  real vocabularies (49,152² floats), so each context token keeps only its `max_successors`
  most frequent successors, and the remaining mass is spread by the unigram ("backoff"):

      q(x | t) = c(t, x)·[x kept] / (n_t + a) + (n_t − Σ_kept c(t, ·) + a) / (n_t + a) · P(x)

  with n_t the number of times t was followed by anything, and a = `backoff` ≥ 0 pseudo-counts
  reserved for the unigram. Tokens seen after t keep their exact empirical share.

The cache is the token history (`TokenHistory`): `extend` writes the K new tokens at each row's
position, and the logits at position k depend on tokens[:, k] only, so rollback is a length
change like any other model's.

Parameter trees:
  unigram: log_probs [V]
  bigram:  unigram_log_probs [V], backoff_log_weight [V], next_tokens [V, S] int32,
           next_log_probs [V, S]   (S = max_successors; unused slots are token 0 with -inf)

`estimate_unigram` / `estimate_bigram` count token sequences; `save` / `load` store a draft
as safetensors (with its kind and vocabulary size in the file's metadata).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from speclm import protocol
from speclm.models import layers


@struct.dataclass
class TokenHistory:
  """The cache of history-based drafts: tokens `[B, L]` and each row's length `[B]`."""

  tokens: jax.Array
  lengths: jax.Array

  @property
  def capacity(self) -> int:
    """L, the tokens each row can hold (static)."""
    return self.tokens.shape[1]


def init_history(batch_size: int, max_length: int) -> TokenHistory:
  """An empty history: tokens `[B, L]` zeros for B = `batch_size`, L = `max_length`; lengths 0."""
  return TokenHistory(tokens=jnp.zeros((batch_size, max_length), jnp.int32),
                      lengths=jnp.zeros((batch_size,), jnp.int32))


def write_prompt(history: TokenHistory, inputs, input_lengths) -> TokenHistory:
  """The history holding `inputs[b, :input_lengths[b]]` (entries past a length are ignored).

  Args:
    history: the history to write into (its tokens `[B, L]`).
    inputs: `[B, P]` int right-padded prompts; positions past L are dropped.
    input_lengths: `[B]` int, the new lengths.
  """
  width = min(inputs.shape[1], history.capacity)
  tokens = history.tokens.at[:, :width].set(inputs[:, :width].astype(jnp.int32))
  return TokenHistory(tokens=tokens, lengths=input_lengths.astype(jnp.int32))


def append_tokens(history: TokenHistory, new_tokens) -> TokenHistory:
  """`new_tokens` `[B, K]` written at each row's own length; lengths grow by K."""
  write = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))
  tokens = write(history.tokens, new_tokens.astype(jnp.int32), history.lengths)
  return TokenHistory(tokens=tokens, lengths=history.lengths + new_tokens.shape[1])


def history_keep_path(history: TokenHistory, start, path) -> TokenHistory:
  """`protocol.LanguageModel.keep_tree_path` for a token history."""
  return history.replace(tokens=layers.keep_path(history.tokens, start, path, batch_axis=0,
                                                 position_axis=0))


class HistoryModel(protocol.LanguageModel):
  """Shared protocol plumbing of drafts whose cache is the token history."""

  def init_cache(self, batch_size: int, max_length: int) -> TokenHistory:
    """An empty `TokenHistory`; see `speclm.protocol.LanguageModel.init_cache`."""
    return init_history(batch_size, max_length)

  def prefix_length(self, input_lengths):
    """The prompt lengths (the history holds the whole prompt)."""
    return input_lengths

  def last_prefix_token(self, inputs, input_lengths):
    """`[B]` the last real token of each prompt `[B, P]`."""
    return jnp.take_along_axis(inputs, (input_lengths - 1)[:, None], axis=1)[:, 0]

  def keep_tree_path(self, cache, start, path):
    """`history_keep_path`; see `speclm.protocol.LanguageModel.keep_tree_path`."""
    return history_keep_path(cache, start, path)


class NodeLocalModel(HistoryModel):
  """A history model whose logits at a position depend on that position's token alone
  (unigram, bigram): a token tree's logits are then `extend`'s, node by node."""

  def extend_tree(self, params, tokens, tree, cache):
    """`extend` on the nodes (the tree does not matter); see
    `speclm.protocol.LanguageModel.extend_tree`."""
    del tree
    return self.extend(params, tokens, cache)


@dataclasses.dataclass(frozen=True)
class Unigram(NodeLocalModel):
  """q(x) = P(x) at every position. Params: {'log_probs': [V]}."""

  vocab_size: int

  def prefill(self, params, inputs, input_lengths, cache):
    """Records the prompt; the unigram log-probabilities `[B, V]`. See
    `speclm.protocol.LanguageModel.prefill`."""
    history = write_prompt(cache, inputs, input_lengths)
    return jnp.broadcast_to(params['log_probs'], (inputs.shape[0], self.vocab_size)), history

  def extend(self, params, tokens, cache):
    """Records the tokens; the unigram log-probabilities `[B, K, V]`. See
    `speclm.protocol.LanguageModel.extend`."""
    logits = jnp.broadcast_to(params['log_probs'], tokens.shape + (self.vocab_size,))
    return logits, append_tokens(cache, tokens)

  def validate_params(self, params) -> None:
    """Raises ValueError unless `params` is {'log_probs': [V]}."""
    _check_shapes(params, {'log_probs': (self.vocab_size,)})


@dataclasses.dataclass(frozen=True)
class Bigram(NodeLocalModel):
  """q(x | previous token), with the top successors of each token and a unigram backoff."""

  vocab_size: int
  max_successors: int

  def next_token_logits(self, params, previous: jax.Array) -> jax.Array:
    """Log q(· | previous) for int `previous` `[...]` -> `[..., V]` float32."""
    shape = previous.shape
    previous = previous.reshape(-1)
    weight = jnp.exp(params['backoff_log_weight'][previous])  # [N]
    probs = weight[:, None] * jnp.exp(params['unigram_log_probs'])[None, :]  # [N, V]
    successors = params['next_tokens'][previous]  # [N, S]
    successor_probs = jnp.exp(params['next_log_probs'][previous])  # [N, S], 0 in unused slots
    probs = jax.vmap(lambda p, i, v: p.at[i].add(v))(probs, successors, successor_probs)
    logits = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)), -jnp.inf)
    return logits.reshape(shape + (self.vocab_size,))

  def prefill(self, params, inputs, input_lengths, cache):
    """Records the prompt; log q(· | the prompt's last token) `[B, V]`. See
    `speclm.protocol.LanguageModel.prefill`."""
    history = write_prompt(cache, inputs, input_lengths)
    last = self.last_prefix_token(inputs, input_lengths)
    return self.next_token_logits(params, last), history

  def extend(self, params, tokens, cache):
    """Records the tokens; log q(· | tokens[:, k]) `[B, K, V]`. See
    `speclm.protocol.LanguageModel.extend`."""
    return self.next_token_logits(params, tokens), append_tokens(cache, tokens)

  def validate_params(self, params) -> None:
    """Raises ValueError unless `params` has the bigram's keys and shapes (see the module)."""
    v, s = self.vocab_size, self.max_successors
    _check_shapes(params, {'unigram_log_probs': (v,), 'backoff_log_weight': (v,),
                           'next_tokens': (v, s), 'next_log_probs': (v, s)})


def _check_shapes(params, expected) -> None:
  if set(params) != set(expected):
    raise ValueError(f'Draft parameters have keys {sorted(params)}, expected {sorted(expected)}.')
  for name, shape in expected.items():
    if tuple(np.shape(params[name])) != shape:
      raise ValueError(f'Draft parameter {name!r} has shape {tuple(np.shape(params[name]))},'
                       f' expected {shape}.')


# ----------------------------------------------------------------------------------------------
# Estimation from token sequences


def _as_arrays(sequences: Iterable[Sequence[int]], vocab_size: int) -> list[np.ndarray]:
  arrays = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
  arrays = [a for a in arrays if a.size]
  if not arrays:
    raise ValueError('The corpus is empty: give at least one non-empty token sequence.')
  low = min(int(a.min()) for a in arrays)
  high = max(int(a.max()) for a in arrays)
  if low < 0 or high >= vocab_size:
    raise ValueError(f'Corpus token ids must lie in [0, {vocab_size}), got [{low}, {high}].')
  return arrays


def _log(x: np.ndarray) -> np.ndarray:
  with np.errstate(divide='ignore'):
    return np.log(x).astype(np.float32)


def unigram_log_probs(sequences: Iterable[Sequence[int]], vocab_size: int, *,
                      add_k: float = 0.0) -> np.ndarray:
  """Log P(x) = log (c(x) + k) / (N + kV): add-k smoothing (k = 0 leaves unseen tokens at 0)."""
  if add_k < 0:
    raise ValueError(f'add_k must be >= 0, got {add_k}.')
  counts = np.zeros(vocab_size, np.float64)
  for a in _as_arrays(sequences, vocab_size):
    counts += np.bincount(a, minlength=vocab_size)
  counts += add_k
  return _log(counts / counts.sum())


def estimate_unigram(sequences: Iterable[Sequence[int]], vocab_size: int, *,
                     add_k: float = 0.0) -> protocol.Model:
  """A unigram draft counted from token sequences (see `unigram_log_probs`)."""
  params = {'log_probs': jnp.asarray(unigram_log_probs(sequences, vocab_size, add_k=add_k))}
  return protocol.Model(Unigram(vocab_size), params)


def estimate_bigram(sequences: Iterable[Sequence[int]], vocab_size: int, *,
                    max_successors: int = 32, backoff: float = 1.0,
                    add_k: float = 0.0) -> protocol.Model:
  """A bigram draft counted from token sequences (pairs never cross sequence boundaries).

  Args:
    sequences: token id sequences (lists or arrays).
    vocab_size: V, the target's vocabulary size.
    max_successors: S, successors kept per context token (memory is V·S).
    backoff: a, pseudo-counts per context given to the unigram backoff (0 = none: a context
      seen in the corpus then proposes only its kept successors and tokens reached through the
      mass of dropped successors; an unseen context always uses the unigram).
    add_k: add-k smoothing of the unigram itself.
  """
  if max_successors < 1:
    raise ValueError(f'max_successors must be >= 1, got {max_successors}.')
  if backoff < 0:
    raise ValueError(f'backoff must be >= 0, got {backoff}.')
  arrays = _as_arrays(sequences, vocab_size)
  unigram = unigram_log_probs(arrays, vocab_size, add_k=add_k)
  pairs = np.concatenate([a[:-1] * vocab_size + a[1:] for a in arrays if a.size > 1] or
                         [np.zeros(0, np.int64)])
  codes, counts = np.unique(pairs, return_counts=True)
  prev, nxt = codes // vocab_size, codes % vocab_size
  # Sort by (context, count descending, token ascending) and keep the first S of each context.
  order = np.lexsort((nxt, -counts, prev))
  prev, nxt, counts = prev[order], nxt[order], counts[order]
  context_total = np.bincount(prev, weights=counts, minlength=vocab_size)
  starts = np.searchsorted(prev, np.arange(vocab_size))
  rank = np.arange(prev.size) - starts[prev]
  keep = rank < max_successors
  prev, nxt, counts, rank = prev[keep], nxt[keep], counts[keep], rank[keep]
  kept_total = np.bincount(prev, weights=counts, minlength=vocab_size)
  denominator = context_total + backoff
  seen = denominator > 0
  safe = np.where(seen, denominator, 1.0)
  backoff_weight = np.where(seen, (context_total - kept_total + backoff) / safe, 1.0)
  next_tokens = np.zeros((vocab_size, max_successors), np.int32)
  next_probs = np.zeros((vocab_size, max_successors), np.float64)
  next_tokens[prev, rank] = nxt
  next_probs[prev, rank] = counts / safe[prev]
  params = {
      'unigram_log_probs': jnp.asarray(unigram),
      'backoff_log_weight': jnp.asarray(_log(backoff_weight)),
      'next_tokens': jnp.asarray(next_tokens),
      'next_log_probs': jnp.asarray(_log(next_probs)),
  }
  return protocol.Model(Bigram(vocab_size, max_successors), params)


# ----------------------------------------------------------------------------------------------
# Files


def save(path: str | os.PathLike, model: protocol.Model) -> None:
  """Writes a unigram or bigram draft as safetensors (kind and sizes in the metadata)."""
  from safetensors import numpy as st_numpy  # pylint: disable=import-outside-toplevel
  definition = model.definition
  if isinstance(definition, Unigram):
    metadata = {'speclm_draft': 'unigram', 'vocab_size': str(definition.vocab_size)}
  elif isinstance(definition, Bigram):
    metadata = {'speclm_draft': 'bigram', 'vocab_size': str(definition.vocab_size),
                'max_successors': str(definition.max_successors)}
  else:
    raise TypeError(f'Expected a unigram or bigram draft, got {type(definition).__name__}.')
  tensors = {k: np.ascontiguousarray(np.asarray(v)) for k, v in model.params.items()}
  st_numpy.save_file(tensors, os.fspath(path), metadata=metadata)


def load(path: str | os.PathLike) -> protocol.Model:
  """Reads a draft written by `save`; ValueError if the file is not one."""
  import safetensors  # pylint: disable=import-outside-toplevel
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No n-gram draft file at {path!r}.')
  try:
    with safetensors.safe_open(path, framework='numpy') as f:
      metadata = f.metadata() or {}
      params = {k: jnp.asarray(f.get_tensor(k)) for k in f.keys()}
  except Exception as e:  # pylint: disable=broad-except  # safetensors raises its own errors
    raise ValueError(f'{path!r} is not a readable safetensors file: {e}') from e
  kind = metadata.get('speclm_draft')
  if kind == 'unigram':
    definition = Unigram(int(metadata['vocab_size']))
  elif kind == 'bigram':
    definition = Bigram(int(metadata['vocab_size']), int(metadata['max_successors']))
  else:
    raise ValueError(f'{path!r} is not a speclm n-gram draft (metadata speclm_draft={kind!r}).')
  definition.validate_params(params)
  return protocol.Model(definition, params)
