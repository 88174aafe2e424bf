"""Prompt-lookup (copy) draft: propose what followed the latest earlier match of the context.

At each position the draft takes the last n tokens of the sequence (prompt and generated text
so far), finds the latest earlier place where the same n tokens occur, and proposes the token
that came next there. Longer matches win (n from `max_ngram` down to `min_ngram`); among
equally long matches the latest one wins. It needs no parameters and costs almost nothing
(c ≈ 0); it shines when the output copies the input (summaries, code edits, quoting).

As a `speclm.protocol.LanguageModel` it reports a distribution q peaked on the proposal:
with `confidence` = 1 (default) q is one-hot and every other logit is -inf; with
`confidence` < 1 the rest is spread evenly over the vocabulary. When nothing matches, q is
uniform. Speculative sampling is exact for any q; `confidence` only moves α at temperature > 0.

The cache is the token history (`speclm.models.ngram.TokenHistory`). Parameters: `{}`.

Shape letters: B batch, K positions queried, L history capacity, T = max_ngram, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from speclm import protocol
from speclm.models import ngram


def _history_after_prefill(history: ngram.TokenHistory, inputs, input_lengths):
  """The history holding the prompts, and the query position `[B, 1]` (each prompt's last)."""
  history = ngram.write_prompt(history, inputs, input_lengths)
  return history, (input_lengths - 1).astype(jnp.int32)[:, None]


def _history_after_extend(history: ngram.TokenHistory, tokens):
  """The history with `tokens` `[B, K]` appended, and their positions `[B, K]` as queries."""
  start = history.lengths
  history = ngram.append_tokens(history, tokens)
  return history, start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]


@dataclasses.dataclass(frozen=True)
class PromptLookup(ngram.HistoryModel):
  """The prompt-lookup draft. See the module docstring."""

  vocab_size: int
  max_ngram: int = 3
  min_ngram: int = 1
  confidence: float = 1.0

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f'Need 1 <= min_ngram <= max_ngram, got {self.min_ngram},'
                       f' {self.max_ngram}.')
    if not 0.0 < self.confidence <= 1.0:
      raise ValueError(f'confidence must be in (0, 1], got {self.confidence}.')

  def propose(self, history: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For each query position (the last token of the context), the proposed next token.

    Args:
      history: `[B, L]` int tokens; positions up to each query position must be valid.
      positions: `[B, K]` query positions.

    Returns:
      (proposal `[B, K]` int32, found `[B, K]` bool: whether any n-gram matched).
    """
    capacity = history.shape[1]
    t_max = self.max_ngram
    # shifted[b, i, t] = history[b, i - t] (-1 before the start).
    padded = jnp.concatenate([jnp.full((history.shape[0], t_max), -1, history.dtype), history],
                             axis=1)
    shifted = jnp.stack([padded[:, t_max - t:t_max - t + capacity] for t in range(t_max)],
                        axis=-1)  # [B, L, T]
    # query[b, k, t] = history[b, positions[b, k] - t] (-2 before the start: never matches).
    offsets = positions[:, :, None] - jnp.arange(t_max)[None, None, :]  # [B, K, T]
    query = jnp.take_along_axis(history[:, None, :], jnp.maximum(offsets, 0), axis=2)
    query = jnp.where(offsets >= 0, query, -2)
    equal = shifted[:, None, :, :] == query[:, :, None, :]  # [B, K, L, T]
    match_length = jnp.sum(jnp.cumprod(equal.astype(jnp.int32), axis=-1), axis=-1)  # [B, K, L]
    candidates = jnp.arange(capacity)[None, None, :]
    valid = (candidates < positions[:, :, None]) & (match_length >= self.min_ngram)
    # Longest match first, then the latest position.
    score = jnp.where(valid, match_length * capacity + candidates, -1)
    best = jnp.argmax(score, axis=-1)  # [B, K]
    found = jnp.max(score, axis=-1) >= 0
    proposal = jnp.take_along_axis(history, jnp.minimum(best + 1, capacity - 1), axis=1)
    return proposal.astype(jnp.int32), found

  def peaked_logits(self, history: jax.Array, positions: jax.Array
                    ) -> tuple[jax.Array, jax.Array]:
    """(float32 logits `[B, K, V]` peaked on each proposal, found `[B, K]`)."""
    proposal, found = self.propose(history, positions)
    return self.peaked(proposal), found

  def peaked(self, proposal: jax.Array) -> jax.Array:
    """float32 logits `[..., V]` peaked on each proposal (see `confidence`).

    Args:
      proposal: int32 `[...]` proposed tokens (any shape, e.g. `[B, K]`).
    """
    v = self.vocab_size
    one_hot = jax.nn.one_hot(proposal, v, dtype=jnp.bool_)
    if self.confidence >= 1.0:
      peaked = jnp.where(one_hot, 0.0, -jnp.inf)
    else:
      rest = (1.0 - self.confidence) / v
      peaked = jnp.where(one_hot, math.log(self.confidence + rest), math.log(rest))
    return peaked.astype(jnp.float32)

  def _logits(self, history: jax.Array, positions: jax.Array) -> jax.Array:
    peaked, found = self.peaked_logits(history, positions)
    return jnp.where(found[..., None], peaked, 0.0)  # uniform if no match

  def prefill(self, params, inputs, input_lengths, cache):
    """Records the prompt; logits `[B, V]` peaked on the lookup's proposal after it (uniform
    where nothing matches). See `speclm.protocol.LanguageModel.prefill`.
    """
    del params
    history, positions = _history_after_prefill(cache, inputs, input_lengths)
    return self._logits(history.tokens, positions)[:, 0], history

  def extend(self, params, tokens, cache):
    """Records the tokens; logits `[B, K, V]` as for `prefill`. See
    `speclm.protocol.LanguageModel.extend`."""
    del params
    history, positions = _history_after_extend(cache, tokens)
    return self._logits(history.tokens, positions), history

  def extend_tree(self, params, tokens, tree, cache):
    """Each node proposes from its own path's history (`path_histories`); see
    `speclm.protocol.LanguageModel.extend_tree`.
    """
    del params
    proposal, found = _propose_per_node(self, cache, tokens, tree)
    return (jnp.where(found[..., None], self.peaked(proposal), 0.0),
            ngram.append_tokens(cache, tokens))

  def validate_params(self, params) -> None:
    """Raises ValueError unless `params` is empty (the lookup has none)."""
    if params:
      raise ValueError('The prompt-lookup draft has no parameters; pass {}.')


def path_histories(history: ngram.TokenHistory, tokens, tree):
  """Each node's own history, for a token tree appended to `history` (before appending).

  Node k's context is the committed history followed by the tokens on its path (root first),
  which is what a chain would hold at that node; the lookup then proposes exactly what it
  would after the same tokens in a chain. Returns (histories `[B, K, L]`, each node's
  position `[B, K]`).
  """
  capacity = history.capacity
  positions = (history.lengths[:, None] + tree.depths).astype(jnp.int32)  # [B, K]
  # Node j's token lands at its position in the history of every node it is an ancestor of
  # (one node per position on a path): Σ_j ancestors[k, j] · one_hot(position_j) · (token_j+1).
  at_position = jax.nn.one_hot(positions, capacity, dtype=jnp.float32)  # [B, K(j), L]
  placed = jnp.einsum('bkj,bjl->bkl', tree.ancestors.astype(jnp.float32),
                      at_position * (tokens + 1).astype(jnp.float32)[:, :, None],
                      precision=jax.lax.Precision.HIGHEST)
  placed = placed.astype(jnp.int32)  # token ids are exact in float32 (< 2^24)
  histories = jnp.where(placed > 0, placed - 1, history.tokens[:, None, :])
  return histories, positions


def _propose_per_node(lookup: PromptLookup, history: ngram.TokenHistory, tokens, tree):
  """(proposal, found) `[B, K]` of `lookup` at every node of a token tree (`path_histories`)."""
  histories, positions = path_histories(history, tokens, tree)
  batch, num_nodes, capacity = histories.shape
  proposal, found = lookup.propose(histories.reshape(batch * num_nodes, capacity),
                                   positions.reshape(batch * num_nodes, 1))
  return proposal.reshape(batch, num_nodes), found.reshape(batch, num_nodes)


def prompt_lookup(vocab_size: int, *, max_ngram: int = 3, min_ngram: int = 1,
                  confidence: float = 1.0) -> protocol.Model:
  """A prompt-lookup draft as a `speclm.protocol.Model` (empty parameters)."""
  return protocol.Model(PromptLookup(vocab_size, max_ngram, min_ngram, confidence), {})


@struct.dataclass
class LookupFirstCache:
  """The fallback draft's cache and the token history, advanced and rolled back together."""

  fallback: Any
  history: ngram.TokenHistory


@dataclasses.dataclass(frozen=True)
class LookupFirst(protocol.LanguageModel):
  """Prompt lookup where an n-gram of at least `lookup.min_ngram` tokens matches, else a draft.

  Each proposal is the lookup's (q one-hot on the token that followed the latest longest
  match) when one is found, and the `fallback` draft's q otherwise. Paper §3.6: any M_q keeps
  speculative sampling exact; this one only changes α. On SmolLM2's demo replies (128 greedy
  tokens, teacher-forced) a 2-gram or longer match exists at 34% of positions, where the
  lookup is right 68% of the time and the trained draft 33%: T = 0 acceptance goes from 0.34
  (the draft alone) to 0.46 (docs/drafts.md). The lookup costs almost nothing, so c stays the
  fallback's. Parameters are the fallback's.

  `lookup_weight` w < 1 mixes instead of overriding where the lookup matches: q = w·δ(its
  proposal) + (1 − w)·q_fallback. A one-hot proposal's β is p(x) alone, all or nothing at
  T > 0; the mixture keeps (1 − w) of the fallback's overlap where the lookup is wrong, and
  gives up at most (1 − w)·(p(x) − q_fallback(x)) where it is right. For w ≥ 1/2 the
  mixture's argmax is still the lookup's token, so greedy decoding drafts exactly as with
  w = 1. Sampling settings (temperature, top-k, top-p) then apply to the mixture, as to any
  draft's logits; speculative sampling is exact for every w.
  """

  fallback: protocol.LanguageModel
  lookup: PromptLookup
  lookup_weight: float = 1.0

  def __post_init__(self):
    if not 0.0 < self.lookup_weight <= 1.0:
      raise ValueError(f'lookup_weight must be in (0, 1], got {self.lookup_weight}.')
    if self.fallback.prefix_length(7) != 7:
      raise ValueError('LookupFirst needs a decoder-only fallback draft: its history holds the'
                       ' prompt at the positions of the draft\'s cache.')
    if self.fallback.vocab_size != self.lookup.vocab_size:
      raise ValueError(f'The lookup\'s vocabulary ({self.lookup.vocab_size}) must be the'
                       f' draft\'s ({self.fallback.vocab_size}).')

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    """V, the fallback draft's."""
    return self.fallback.vocab_size

  @property
  def max_context_length(self) -> int | None:
    """The fallback draft's."""
    return self.fallback.max_context_length

  def _combine(self, logits, history: ngram.TokenHistory, positions) -> jax.Array:
    proposal, found = self.lookup.propose(history.tokens, positions)
    return jnp.where(found[..., None], self._over(proposal, logits),
                     logits.astype(jnp.float32))

  def _over(self, proposal, logits) -> jax.Array:
    """Logits `[..., V]` where the lookup proposes `proposal` `[...]` over the fallback's
    `logits`: its peaked logits (w = 1), or log(w·δ(proposal) + (1 − w)·softmax(logits)) up
    to a constant: the fallback's logits, the proposal's raised by w/(1 − w) of their total
    mass (one log-sum-exp, no normalised copy of the row)."""
    if self.lookup_weight >= 1.0:
      return self.lookup.peaked(proposal)
    logits = logits.astype(jnp.float32)
    boost = (math.log(self.lookup_weight / (1.0 - self.lookup_weight))
             + jax.nn.logsumexp(logits, axis=-1, keepdims=True))
    is_proposal = jax.nn.one_hot(proposal, self.vocab_size, dtype=jnp.bool_)
    return jnp.where(is_proposal, jnp.logaddexp(logits, boost), logits)

  def init_cache(self, batch_size: int, max_length: int) -> LookupFirstCache:
    """The fallback's cache and an empty token history; see
    `speclm.protocol.LanguageModel.init_cache`."""
    return LookupFirstCache(self.fallback.init_cache(batch_size, max_length),
                            ngram.init_history(batch_size, max_length))

  def prefill(self, params, inputs, input_lengths, cache):
    """The fallback's logits, the lookup's where it matches; see
    `speclm.protocol.LanguageModel.prefill`."""
    logits, fallback_cache = self.fallback.prefill(params, inputs, input_lengths, cache.fallback)
    history, positions = _history_after_prefill(cache.history, inputs, input_lengths)
    logits = self._combine(logits[:, None], history, positions)[:, 0]
    return logits, LookupFirstCache(fallback_cache, history)

  def extend(self, params, tokens, cache):
    """The fallback's logits, the lookup's where it matches; see
    `speclm.protocol.LanguageModel.extend`."""
    logits, fallback_cache = self.fallback.extend(params, tokens, cache.fallback)
    history, positions = _history_after_extend(cache.history, tokens)
    return self._combine(logits, history, positions), LookupFirstCache(fallback_cache, history)

  def extend_last(self, params, tokens, cache):
    """As `extend`, for the last position only; see `speclm.protocol.LanguageModel.extend_last`."""
    logits, fallback_cache = self.fallback.extend_last(params, tokens, cache.fallback)
    history, positions = _history_after_extend(cache.history, tokens)
    logits = self._combine(logits[:, None], history, positions[:, -1:])[:, 0]
    return logits, LookupFirstCache(fallback_cache, history)

  def extend_tree(self, params, tokens, tree, cache):
    """`extend` over a token tree. Where the lookup matches, the node's q is (nearly) its
    one-hot proposal, and the fallback's logits, far below it, keep their order: a tree's
    first candidate is the lookup's, the next ones the fallback draft's best."""
    logits, fallback_cache = self.fallback.extend_tree(params, tokens, tree, cache.fallback)
    return (self._over_tree(logits, cache, tokens, tree),
            LookupFirstCache(fallback_cache, ngram.append_tokens(cache.history, tokens)))

  def _over_tree(self, logits, cache: LookupFirstCache, tokens, tree) -> jax.Array:
    """The fallback's logits `[B, K, V]` over tree nodes, the lookup's where it matches."""
    proposal, found = _propose_per_node(self.lookup, cache.history, tokens, tree)
    logits = logits.astype(jnp.float32)
    if self.lookup_weight < 1.0:
      peaked = self._over(proposal, logits)
    elif self.lookup.confidence >= 1.0:
      # e^-80 of the fallback's probabilities: q ≈ one-hot, the order kept for later ranks.
      below = jax.nn.log_softmax(logits, axis=-1) - 80.0
      is_proposal = jax.nn.one_hot(proposal, self.vocab_size, dtype=jnp.bool_)
      peaked = jnp.where(is_proposal, 0.0, below)
    else:
      peaked = self.lookup.peaked(proposal)
    return jnp.where(found[..., None], peaked, logits)

  def keep_tree_path(self, cache, start, path):
    """Both caches keep the path; see `speclm.protocol.LanguageModel.keep_tree_path`."""
    return LookupFirstCache(self.fallback.keep_tree_path(cache.fallback, start, path),
                            ngram.history_keep_path(cache.history, start, path))

  def prefix_length(self, input_lengths):
    """The fallback's (the prompt lengths)."""
    return self.fallback.prefix_length(input_lengths)

  def last_prefix_token(self, inputs, input_lengths):
    """The fallback's: `[B]` the last real token of each prompt."""
    return self.fallback.last_prefix_token(inputs, input_lengths)

  def cache_lengths(self, cache):
    """`[B]` the fallback cache's lengths (the history's are the same)."""
    return self.fallback.cache_lengths(cache.fallback)

  def rollback(self, cache, lengths):
    """Both caches to `lengths` `[B]`; see `speclm.protocol.LanguageModel.rollback`."""
    return LookupFirstCache(self.fallback.rollback(cache.fallback, lengths),
                            cache.history.replace(lengths=lengths.astype(jnp.int32)))

  def cache_capacity(self, cache):
    """The smaller of the fallback cache's and the history's capacity."""
    return min(self.fallback.cache_capacity(cache.fallback), cache.history.capacity)

  def validate_params(self, params) -> None:
    """The fallback's check (the parameters are the fallback's)."""
    self.fallback.validate_params(params)


@dataclasses.dataclass(frozen=True)
class LookupFirstWithFeatures(LookupFirst, protocol.FeatureConditionedDraft):
  """`LookupFirst` over a draft that reads the target's features (EAGLE-style).

  The fallback sees every token and feature as it would alone (its predicted features flow on
  to its next proposal whether or not the lookup's proposal was taken); the lookup overrides
  q where it matches, exactly as in `LookupFirst`.
  """

  fallback: protocol.FeatureConditionedDraft

  @property
  def feature_dim(self) -> int:  # type: ignore[override]
    """The fallback draft's."""
    return self.fallback.feature_dim

  @property
  def feature_layers(self):  # type: ignore[override]
    """The fallback draft's."""
    return self.fallback.feature_layers

  def prefill_with_features(self, params, inputs, input_lengths, features, cache):
    """The fallback reads the prompt and features; the history records the prompt. See
    `speclm.protocol.FeatureConditionedDraft.prefill_with_features`.
    """
    fallback_cache = self.fallback.prefill_with_features(params, inputs, input_lengths,
                                                         features, cache.fallback)
    history, _ = _history_after_prefill(cache.history, inputs, input_lengths)
    return LookupFirstCache(fallback_cache, history)

  def extend_with_features(self, params, tokens, features, cache):
    """The fallback's logits (the lookup's where it matches) and the fallback's predicted
    features; see `speclm.protocol.FeatureConditionedDraft.extend_with_features`.
    """
    logits, predicted, fallback_cache = self.fallback.extend_with_features(
        params, tokens, features, cache.fallback)
    history, positions = _history_after_extend(cache.history, tokens)
    return (self._combine(logits, history, positions), predicted,
            LookupFirstCache(fallback_cache, history))

  def extend_tree_with_features(self, params, tokens, features, tree, cache):
    """The fallback's logits over a token tree (the lookup's where it matches, as in
    `LookupFirst.extend_tree`) and its predicted features; see
    `speclm.protocol.FeatureConditionedDraft.extend_tree_with_features`.
    """
    logits, predicted, fallback_cache = self.fallback.extend_tree_with_features(
        params, tokens, features, tree, cache.fallback)
    return (self._over_tree(logits, cache, tokens, tree), predicted,
            LookupFirstCache(fallback_cache, ngram.append_tokens(cache.history, tokens)))


def lookup_first(fallback: protocol.Model, *, min_ngram: int = 2,
                 max_ngram: int | None = None, weight: float = 1.0) -> protocol.Model:
  """`fallback` with prompt lookup taking over where an n-gram of `min_ngram`+ tokens matches.

  `max_ngram` (longer matches win) defaults to max(3, min_ngram). `weight` < 1 mixes the
  lookup's proposal with the fallback's q there (`LookupFirst.lookup_weight`). A fallback that
  reads the target's features (`protocol.FeatureConditionedDraft`, e.g.
  `speclm.models.eagle`) gives a `LookupFirstWithFeatures`.
  """
  if max_ngram is None:
    max_ngram = max(3, min_ngram)
  lookup = PromptLookup(fallback.vocab_size, max_ngram=max_ngram, min_ngram=min_ngram)
  kind = (LookupFirstWithFeatures
          if isinstance(fallback.definition, protocol.FeatureConditionedDraft) else LookupFirst)
  return protocol.Model(kind(fallback.definition, lookup, weight), fallback.params)
