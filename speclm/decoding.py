"""Compiled decode loops: `autoregressive_decode` (the baseline) and `speculative_decode`.

Each generation is one `jax.lax.while_loop` under `jax.jit`. The loop state is a frozen pytree
dataclass; γ, the sampling rule and the model definitions are static, everything that varies
per call (prompts, lengths, seeds, limits) is an array, so new prompts of the same shapes do
not recompile. Rows advance independently: every row accepts its own n ∈ [0, γ] each round.

Models are seen only through `speclm.protocol` (this module imports no model code).

Bookkeeping (both loops). A row's sequence is s_0 … s_{C−1}: the prefix that `prefill`
consumed (prompt, or decoder start token) followed by the generated tokens. The newest token
s_{C−1} ("pending") is not yet in the target's cache: the target cache holds C−1 positions.
  * Start: each loop prefills its models (a feature-conditioned draft with the target's prompt
    features, `_prefill_feature_draft`), then `_start` draws s_{C−1}, the first new token,
    from the target's prefill p̃ and builds the loop state.
  * Baseline step: extend the target with [pending] -> p̃ -> sample the next pending token.
  * Speculative round (Algorithm 1), one `round_` of `_speculative_loop`:
      1. draft (`_draft_tokens`): roll its cache back to C−2 positions and extend with
         [s_{C−2}, s_{C−1}] (the re-fed s_{C−2} is what lets the draft catch up after a round
         where all γ were kept, without a branch); then γ−1 single-token steps. γ draft calls
         give q̃_1…q̃_γ, x_1…x_γ. A `protocol.FeatureConditionedDraft` (EAGLE-style) also gets
         the target's features of positions C−3 and C−2 with that re-feed, and its own
         predicted ones after it.
      2. verify (`_verify_and_accept`): one target extend with [s_{C−1}, x_1, …, x_γ]
         -> p̃_1 … p̃_{γ+1} (and its features of those positions for a feature-conditioned
         draft).
      3. accept (`speculative.speculative_round`) -> n accepted and one more token t. At
         temperature 0, where every p̃ and q̃ is one-hot, `speculative.greedy_round` makes
         the same decisions from the argmax ids (`sampling.greedy_ids`) alone.
      4. append: the target cache keeps C−1+n+1 positions (rollback = lowering a length);
         x_1…x_n, t are appended and t becomes pending.
  * Adaptive γ (`gamma=adaptive.AdaptiveGamma(...)`): before step 1 the rule picks the round's
    γ ∈ [0, γ_max] from each row's running α (`speclm.adaptive`). The draft then proposes
    k ≤ γ_max tokens (a while loop), and the target verifies k+1 tokens and Algorithm 1
    accepts among the k, one of γ_max+1 compiled widths chosen by `lax.switch`. When γ = 0
    the draft sits the round out (`lax.cond`; unless `max_skip` = 0). The loop keeps the last
    W = max_skip + 2 tokens (`recent`); when the draft next runs it rolls back to C−g and
    re-feeds the g = skipped+2 tokens it has not read instead of [s_{C−2}, s_{C−1}], or,
    after more than max_skip rounds out, re-reads the whole sequence (`_reread_draft`). A
    batch that stopped speculating therefore runs the draft not at all.
    Two bookkeeping helpers finish the round: `_count_round` adds it to the statistics (β sums
    and counts, the acceptance histogram, call counts) and `_hand_off_features` gives a
    feature-conditioned draft the target's features for the next round's re-feed.

Shape letters: B batch, P prompt length, T output buffer, G γ, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from speclm import adaptive
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import speculative


class StopReason(enum.IntEnum):
  """Why a row stopped; `DecodeResult.stop_reasons` holds these values."""

  RUNNING = 0  # never returned for a finished decode
  END_OF_SEQUENCE = 1  # generated `eos_id` (included in the output)
  MAX_NEW_TOKENS = 2  # reached its `max_new_tokens`
  CACHE_FULL = 3  # the next call would not fit in the cache (only with an explicit cache_length)
  BAD_LOGITS = 4  # a model returned NaN or +inf logits (no token drawn from them is output)


@struct.dataclass
class DecodeStats:
  """Counters gathered inside the loop. Batched calls count once, whatever the batch size.

  Attributes:
    target_calls: `[]` calls of the target (prefill included).
    draft_calls: `[]` calls of the draft (prefill included); 0 for the baseline.
    target_calls_per_row: `[B]` target calls during which the row was still generating.
    accepted_per_row: `[B]` drafted tokens accepted.
    accepted_histogram: `[G+1]` how many (row, round) pairs accepted n = 0 … γ drafted tokens.
    beta_sum, beta_count: `[]` Σ and count of β = Σ_x min(p̃, q̃) over every drafted position
      that the row's committed sequence reached (position i of a round counts if the first
      i−1 drafts were accepted): the exact acceptance probabilities, so α = beta_sum /
      beta_count has no sampling noise (Corollary 3.6 along the decoded sequences).
    beta_sum_per_row, beta_count_per_row: `[B]` the same per row.
    gamma_histogram: `[G+1]` how many rounds drafted (and verified) γ = 0 … G tokens; with a
      fixed γ every round counts at G, with `adaptive.AdaptiveGamma` G is its γ_max. For a
      token tree (`speclm.tree_decoding`) G is the tree's depth and n the accepted depth.
    rank_offered, rank_accepted: `[R]` token trees only (None for chains): at the reached
      nodes with children, how many had more than r children, and how often the kept child
      was the one of rank r (0 = the draft's first choice).
  """

  target_calls: jax.Array
  draft_calls: jax.Array
  target_calls_per_row: jax.Array
  accepted_per_row: jax.Array
  accepted_histogram: jax.Array
  beta_sum: jax.Array
  beta_count: jax.Array
  beta_sum_per_row: jax.Array
  beta_count_per_row: jax.Array
  gamma_histogram: jax.Array
  rank_offered: jax.Array | None = None
  rank_accepted: jax.Array | None = None

  @property
  def alpha(self) -> float:
    """Measured α = E[β] = beta_sum / beta_count (Corollary 3.6; NaN when nothing was drafted).

    β is the exact acceptance probability at every drafted position the committed sequences
    reached, so this α has no sampling noise from the accept/reject coin flips.
    """
    count = int(self.beta_count)
    return float(self.beta_sum) / count if count else float('nan')

  @classmethod
  def zeros(cls, batch_size: int, gamma: int) -> 'DecodeStats':
    zero = jnp.zeros((), jnp.int32)
    zeros_b = jnp.zeros((batch_size,), jnp.int32)
    return cls(target_calls=zero, draft_calls=zero, target_calls_per_row=zeros_b,
               accepted_per_row=zeros_b,
               accepted_histogram=jnp.zeros((gamma + 1,), jnp.int32),
               beta_sum=jnp.zeros((), jnp.float32), beta_count=zero,
               beta_sum_per_row=jnp.zeros((batch_size,), jnp.float32),
               beta_count_per_row=zeros_b,
               gamma_histogram=jnp.zeros((gamma + 1,), jnp.int32))


@struct.dataclass
class DecodeResult:
  """Output of a decode.

  Attributes:
    tokens: `[B, max_new_tokens]` int32 generated tokens (not including the prompt); entries
      at or past `lengths[b]` are `pad_id`.
    lengths: `[B]` int32 number of generated tokens per row (an end token included).
    stop_reasons: `[B]` int32 `StopReason` values.
    stats: `DecodeStats`.
  """

  tokens: jax.Array
  lengths: jax.Array
  stop_reasons: jax.Array
  stats: DecodeStats

  @property
  def tokens_per_target_call(self) -> float:
    """Mean generated tokens per target call, over rows (1.0 for the baseline)."""
    calls = np.asarray(self.stats.target_calls_per_row, dtype=np.float64)
    return float(np.sum(np.asarray(self.lengths)) / max(np.sum(calls), 1.0))

  def to_lists(self) -> list[list[int]]:
    """Each row's generated tokens as a Python list."""
    tokens, lengths = np.asarray(self.tokens), np.asarray(self.lengths)
    return [tokens[b, :lengths[b]].tolist() for b in range(tokens.shape[0])]


@struct.dataclass
class _LoopState:
  """State carried by both decode loops (the draft fields are unused by the baseline)."""

  tokens: jax.Array  # [B, T] generated so far; T leaves room for one round's overflow
  num_generated: jax.Array  # [B]
  prev_token: jax.Array  # [B] s_{C-2}
  pending_token: jax.Array  # [B] s_{C-1}, not yet in the target cache
  stop_reasons: jax.Array  # [B] StopReason, RUNNING while generating
  target_cache: protocol.Cache
  draft_cache: protocol.Cache
  rng: jax.Array
  stats: DecodeStats
  # [B, 2, D] the target's features before prev_token and pending_token, for a
  # FeatureConditionedDraft; None for other drafts.
  draft_features: jax.Array | None = None
  # [B] each row's decayed β sum and count, for `adaptive.AdaptiveGamma`; None otherwise.
  evidence_sum: jax.Array | None = None
  evidence_count: jax.Array | None = None
  # Adaptive γ with skipping: `[]` consecutive rounds the draft sat out (γ = 0), and `[B, W]`
  # the row's last W tokens s_{C−W} … s_{C−1} (entries before s_0 are never read).
  skipped: jax.Array | None = None
  recent: jax.Array | None = None

  @property
  def active(self) -> jax.Array:
    return self.stop_reasons == StopReason.RUNNING


# ----------------------------------------------------------------------------------------------
# Public API


def autoregressive_decode(
    model: protocol.Model,
    prompt_tokens,
    prompt_lengths,
    *,
    sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY,
    max_new_tokens: int | Sequence[int] = 32,
    seed: int = 0,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    cache_length: int | None = None,
    partitioner=None,
) -> DecodeResult:
  """Plain sampling from `model`, one target call per token: the baseline.

  Args:
    model: the target, a `speclm.protocol.Model`.
    prompt_tokens: `[B, P]` int, right-padded prompts (encoder inputs for encoder-decoders).
    prompt_lengths: `[B]` int, real lengths (1 … P).
    sampling: how logits become the distribution sampled from.
    max_new_tokens: the generation limit, one for all rows or one per row.
    seed: random seed (unused by greedy sampling).
    eos_id: a token that ends a row (kept in the output), a list of such tokens (e.g. a chat
      model's end-of-turn and end-of-text ids), or None.
    pad_id: the value written past each row's length in the result.
    cache_length: cache positions per row; by default exactly enough for the prompt and every
      new token. A smaller value stops rows with `StopReason.CACHE_FULL`.
    partitioner: a `speclm.partitioning.Partitioner` to compile the loop with its mesh and
      shardings (parameters as `partitioner.shard_model` placed them); None for one device.
  """
  prompts, lengths, limits = _validate_common(model, prompt_tokens, prompt_lengths,
                                              sampling, max_new_tokens, seed, eos_id)
  _check_context(model.definition, 'model', lengths, limits)
  capacity = _capacity(model.definition, prompts.shape[1], int(limits.max()), 0, cache_length)
  loop = (_autoregressive_jit if partitioner is None else
          partitioner.jit_decode_loop(_autoregressive_loop, num_models=1))
  result = loop(
      model.definition, model.params, prompts, lengths, limits, jax.random.key(seed),
      end_tokens(eos_id), jnp.int32(pad_id), sampling=sampling,
      buffer_length=int(limits.max()) + 1, capacity=capacity)
  return _trim(result, int(limits.max()))


def speculative_decode(
    target: protocol.Model,
    draft: protocol.Model,
    prompt_tokens,
    prompt_lengths,
    *,
    gamma: int | adaptive.AdaptiveGamma,
    sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY,
    max_new_tokens: int | Sequence[int] = 32,
    seed: int = 0,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    cache_length: int | None = None,
    partitioner=None,
) -> DecodeResult:
  """Speculative decoding (Algorithm 1): samples exactly from `target`, γ drafts per round.

  Same arguments as `autoregressive_decode`, plus the `draft` model (same vocabulary) and
  `gamma`: the number of tokens the draft proposes per target call (an integer ≥ 1), or an
  `adaptive.AdaptiveGamma` rule that chooses it every round, 0 … γ_max. With greedy sampling
  the output equals `autoregressive_decode(target, …)` token for token. With a `partitioner`
  the draft's parameters follow its draft rules (replicated by default).

  A rule that chooses γ = 0 before it has any evidence never drafts (`adaptive.never_drafts`):
  the decode is then `autoregressive_decode(target, …)` itself, which runs a plain step faster
  than the adaptive loop runs a γ = 0 round. Its statistics count every step as a γ = 0 round.
  """
  return _speculative_decode(
      target, draft, prompt_tokens, prompt_lengths, gamma=gamma, sampling=sampling,
      max_new_tokens=max_new_tokens, seed=seed, eos_id=eos_id, pad_id=pad_id,
      cache_length=cache_length, partitioner=partitioner, baseline_if_never_drafting=True)


def _speculative_decode(target, draft, prompt_tokens, prompt_lengths, *, gamma,
                        sampling=sampling_lib.GREEDY, max_new_tokens=32, seed=0, eos_id=None,
                        pad_id=0, cache_length=None, partitioner=None,
                        baseline_if_never_drafting: bool) -> DecodeResult:
  """`speculative_decode`. With `baseline_if_never_drafting` False an adaptive rule that never
  drafts still runs its loop of γ = 0 rounds (`speclm.analysis.measure` times those)."""
  prompts, lengths, limits = _validate_common(target, prompt_tokens, prompt_lengths,
                                              sampling, max_new_tokens, seed, eos_id)
  rule = gamma if isinstance(gamma, adaptive.AdaptiveGamma) else None
  gamma = rule.max_gamma if rule is not None else check_gamma(gamma)
  check_pair(target, draft)
  if rule is not None and isinstance(draft.definition, protocol.FeatureConditionedDraft):
    rule = dataclasses.replace(rule, max_skip=0)  # it reads the target's features every round
  _check_context(draft.definition, 'draft', lengths, limits)
  if rule is not None and baseline_if_never_drafting and adaptive.never_drafts(rule):
    baseline = autoregressive_decode(
        target, prompts, lengths, sampling=sampling, max_new_tokens=max_new_tokens, seed=seed,
        eos_id=eos_id, pad_id=pad_id, cache_length=cache_length, partitioner=partitioner)
    return _as_rounds_without_drafts(baseline, rule.max_gamma)
  target = protocol.target_for_feature_draft(target, draft)
  _check_context(target.definition, 'target', lengths, limits)
  width = prompts.shape[1]
  if int(draft.definition.prefix_length(width)) != int(target.definition.prefix_length(width)):
    raise ValueError(
        'The draft and target continue different sequences: after prefill the target holds'
        f' {target.definition.prefix_length(width)} positions, the draft'
        f' {draft.definition.prefix_length(width)}. Pair decoder-only models with decoder-only'
        ' drafts, encoder-decoders with encoder-decoder drafts.')
  max_new = int(limits.max())
  target_capacity = _capacity(target.definition, prompts.shape[1], max_new, gamma, cache_length)
  draft_capacity = _capacity(draft.definition, prompts.shape[1], max_new, gamma, cache_length)
  loop = (_speculative_jit if partitioner is None else
          partitioner.jit_decode_loop(_speculative_loop, num_models=2))
  # An adaptive rule's costs travel as an array: rules that differ only in them share a loop.
  costs = jnp.asarray(rule.cost_vector() if rule is not None else np.zeros(0, np.float32))
  result = loop(
      target.definition, draft.definition, target.params, draft.params, prompts, lengths,
      limits, jax.random.key(seed), end_tokens(eos_id), jnp.int32(pad_id), costs,
      gamma=gamma, rule=None if rule is None else rule.structure(), sampling=sampling,
      buffer_length=max_new + gamma + 1,
      target_capacity=target_capacity, draft_capacity=draft_capacity)
  return _trim(result, max_new)


# ----------------------------------------------------------------------------------------------
# Validation (plain Python, before anything is traced)


def _validate_common(model, prompt_tokens, prompt_lengths, sampling, max_new_tokens, seed,
                     eos_id):
  if not isinstance(model, protocol.Model):
    raise TypeError(f'model must be a speclm.protocol.Model, got {type(model).__name__}.')
  if not isinstance(sampling, sampling_lib.SamplingConfig):
    raise TypeError(f'sampling must be a speclm.SamplingConfig, got {type(sampling).__name__}.')
  prompts = np.asarray(prompt_tokens)
  lengths = np.asarray(prompt_lengths)
  if prompts.ndim != 2:
    raise ValueError(f'prompt_tokens must be [batch, length], got shape {prompts.shape}.')
  if prompts.shape[0] == 0 or prompts.shape[1] == 0:
    raise ValueError(f'The batch is empty: prompt_tokens has shape {prompts.shape}.')
  if not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(f'prompt_tokens must be integers, got {prompts.dtype}.')
  batch, width = prompts.shape
  if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
    raise ValueError(f'prompt_lengths must be {batch} integers, got {lengths.dtype} of shape'
                     f' {lengths.shape}.')
  if lengths.min() < 1 or lengths.max() > width:
    raise ValueError(f'prompt_lengths must lie in [1, {width}] (the prompt width), got'
                     f' {lengths.tolist()}.')
  if prompts.min() < 0 or prompts.max() >= model.vocab_size:
    raise ValueError(f'prompt_tokens must lie in [0, {model.vocab_size}), got values in'
                     f' [{prompts.min()}, {prompts.max()}].')
  limits = np.broadcast_to(np.asarray(max_new_tokens), (batch,)).astype(np.int64)
  if not np.issubdtype(np.asarray(max_new_tokens).dtype, np.integer) or limits.min() < 1:
    raise ValueError(f'max_new_tokens must be integers >= 1, got {max_new_tokens!r}.')
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise ValueError(f'seed must be an integer, got {seed!r}.')
  ends = [] if eos_id is None else np.ravel(np.asarray(eos_id)).tolist()
  if eos_id is not None and (not ends or not all(
      isinstance(e, int) and 0 <= e < model.vocab_size for e in ends)):
    raise ValueError(f'eos_id must be a token id in [0, {model.vocab_size}), several of them,'
                     f' or None, got {eos_id!r}.')
  return (jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32),
          jnp.asarray(limits, jnp.int32))


def check_gamma(gamma) -> int:
  """γ as an int; ValueError unless it is an integer >= 1. (Jobs call it before loading.)"""
  if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
    raise ValueError(f'gamma (tokens drafted per round) must be an integer >= 1, got {gamma!r}.')
  return int(gamma)


def check_pair(target: protocol.Model, draft: protocol.Model) -> None:
  """ValueError unless `draft` can draft for `target`: one shared vocabulary (Algorithm 1
  compares p and q token by token). Jobs call it before they write anything."""
  if not isinstance(draft, protocol.Model):
    raise TypeError(f'draft must be a speclm.protocol.Model, got {type(draft).__name__}.')
  if draft.vocab_size != target.vocab_size:
    raise ValueError(
        f'The draft and target vocabularies differ: draft has {draft.vocab_size} tokens, target'
        f' {target.vocab_size}. Speculative sampling compares their distributions token by'
        ' token, so they must share one vocabulary.')


def _check_context(definition: protocol.LanguageModel, role: str, lengths, limits) -> None:
  """Refuses rows whose prompt plus new tokens run past the model's context (the positions
  its training covered), when the definition declares one as `max_context_length`."""
  context = getattr(definition, 'max_context_length', None)
  if context is None:
    return
  lengths, limits = np.asarray(lengths, np.int64), np.asarray(limits, np.int64)
  worst = int(np.argmax(lengths + limits))
  if lengths[worst] + limits[worst] > context:
    raise ValueError(
        f'prompt of {lengths[worst]} tokens + max_new_tokens {limits[worst]} exceeds the'
        f' {role}\'s context of {context} tokens; shorten the prompt or lower max_new_tokens.')


def _capacity(definition: protocol.LanguageModel, prompt_width: int, max_new: int, gamma: int,
              cache_length: int | None) -> int:
  """Cache positions per row: the prefix, every new token, and one round's lookahead."""
  prefix = int(definition.prefix_length(prompt_width))
  needed = prefix + max_new + gamma + 1
  if cache_length is None:
    return needed
  if cache_length < prefix + 1:
    raise ValueError(
        f'The prompt does not fit in the cache: it needs {prefix} positions plus one to'
        f' generate, but cache_length is {cache_length}. Raise cache_length or shorten the'
        ' prompts.')
  return min(int(cache_length), needed)


def _trim(result: DecodeResult, max_new: int) -> DecodeResult:
  return result.replace(tokens=result.tokens[:, :max_new])


def _as_rounds_without_drafts(baseline: DecodeResult, max_gamma: int) -> DecodeResult:
  """A baseline decode's result with the statistics an adaptive loop (γ_max = `max_gamma`)
  keeps for the same decode made of γ = 0 rounds: each baseline step is a round that drafted
  nothing (`gamma_histogram[0]`), and each round a row ended well accepted n = 0
  (`accepted_histogram[0]`): all its tokens but the first, which prefill drew."""
  stats = baseline.stats
  rounds = stats.target_calls - 1  # prefill is the first target call
  good_rounds = jnp.sum(jnp.maximum(baseline.lengths - 1, 0))
  at_zero = jnp.zeros((max_gamma + 1,), jnp.int32).at[0]
  return baseline.replace(stats=stats.replace(
      accepted_histogram=at_zero.set(good_rounds), gamma_histogram=at_zero.set(rounds)))


# ----------------------------------------------------------------------------------------------
# The loops


def end_tokens(eos_id: int | Sequence[int] | None) -> jax.Array:
  """The loops' end tokens `[E]`: the ids that end a row (-1, no token, for None)."""
  return jnp.asarray(np.ravel(np.asarray(-1 if eos_id is None else eos_id)), jnp.int32)


def _append(state: _LoopState, new_tokens, num_new, limits, eos_id) -> tuple[jax.Array, ...]:
  """Appends `new_tokens[b, :num_new[b]]` to each active row, cut at an end token (any of
  `eos_id` `[E]`) or the limit.

  Returns (tokens, num_generated, stop_reasons) for the next state.
  """
  write = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice(row, new, (start,)))
  tokens = write(state.tokens, new_tokens, state.num_generated)
  offsets = jnp.arange(new_tokens.shape[1])[None, :]
  is_end = jnp.any(new_tokens[..., None] == eos_id, axis=-1)
  is_eos = is_end & (offsets < num_new[:, None])
  has_eos = jnp.any(is_eos, axis=-1)
  kept = jnp.where(has_eos, jnp.argmax(is_eos, axis=-1) + 1, num_new)
  total = state.num_generated + kept
  ended = has_eos & (total <= limits)
  total = jnp.minimum(total, limits)
  reason = jnp.where(ended, StopReason.END_OF_SEQUENCE,
                     jnp.where(total >= limits, StopReason.MAX_NEW_TOKENS, StopReason.RUNNING))
  active = state.active
  return (jnp.where(active[:, None], tokens, state.tokens),
          jnp.where(active, total, state.num_generated),
          jnp.where(active, reason, state.stop_reasons).astype(jnp.int32))


def _bad(logits: jax.Array) -> jax.Array:
  """`[B]` rows whose logits contain NaN or +inf (-inf is a legitimate zero probability)."""
  return jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=tuple(range(1, logits.ndim)))


def _start(target_def, prompts, lengths, limits, rng, eos_id, sampling, buffer_length, gamma,
           *, logits, target_cache, draft_cache=None, draft_features=None) -> _LoopState:
  """The state after prefill: draws the first token from the target's p̃ (both loops).

  `logits` `[B, V]` and `target_cache` are what the target's `prefill` returned (counted here as
  one target call); the speculative loop also passes its prefilled draft cache and, for a
  feature-conditioned draft, the first round's `draft_features`. A row whose prefill logits
  are bad stops with BAD_LOGITS and no token.
  """
  batch = prompts.shape[0]
  rng, first_key = jax.random.split(rng)
  first = sampling_lib.draw(first_key, logits, sampling)
  stats = DecodeStats.zeros(batch, gamma)
  stats = stats.replace(target_calls=stats.target_calls + 1,
                        target_calls_per_row=stats.target_calls_per_row + 1)
  state = _LoopState(
      tokens=jnp.zeros((batch, buffer_length), jnp.int32),
      num_generated=jnp.zeros((batch,), jnp.int32),
      prev_token=target_def.last_prefix_token(prompts, lengths).astype(jnp.int32),
      pending_token=first,
      stop_reasons=jnp.where(_bad(logits), StopReason.BAD_LOGITS,
                             StopReason.RUNNING).astype(jnp.int32),
      target_cache=target_cache, draft_cache=draft_cache, rng=rng, stats=stats,
      draft_features=draft_features)
  # `_append` writes to running rows only: a row stopped for bad logits keeps 0 tokens.
  tokens, num_generated, reasons = _append(state, first[:, None], jnp.ones((batch,), jnp.int32),
                                           limits, eos_id)
  return state.replace(tokens=tokens, num_generated=num_generated, stop_reasons=reasons)


def _finish(state: _LoopState, pad_id) -> DecodeResult:
  positions = jnp.arange(state.tokens.shape[1])[None, :]
  tokens = jnp.where(positions < state.num_generated[:, None], state.tokens, pad_id)
  return DecodeResult(tokens=tokens, lengths=state.num_generated,
                      stop_reasons=state.stop_reasons, stats=state.stats)


def _stop_if_full(reasons, lengths, needed: int, capacity: int) -> jax.Array:
  """Rows whose cache (at `lengths`) cannot take `needed` more positions stop with CACHE_FULL."""
  full = lengths + needed > capacity
  return jnp.where((reasons == StopReason.RUNNING) & full, StopReason.CACHE_FULL, reasons)


def _autoregressive_loop(model_def, params, prompts, lengths, limits, rng, eos_id, pad_id, *,
                         sampling, buffer_length, capacity) -> DecodeResult:
  cache = model_def.init_cache(prompts.shape[0], capacity)
  logits, cache = model_def.prefill(params, prompts, lengths, cache)
  state = _start(model_def, prompts, lengths, limits, rng, eos_id, sampling, buffer_length,
                 gamma=0, logits=logits, target_cache=cache)

  def step(state: _LoopState) -> _LoopState:
    reasons = _stop_if_full(state.stop_reasons, model_def.cache_lengths(state.target_cache), 1,
                            model_def.cache_capacity(state.target_cache))
    state = state.replace(stop_reasons=reasons)
    active = state.active
    rng, key = jax.random.split(state.rng)
    logits, cache = model_def.extend(params, state.pending_token[:, None], state.target_cache)
    token = sampling_lib.draw(key, logits[:, 0], sampling)
    # Finished rows keep their cache length (their writes land past it and are never read).
    old_lengths = model_def.cache_lengths(state.target_cache)
    cache = model_def.rollback(cache, jnp.where(active, old_lengths + 1, old_lengths))
    # A row whose logits are bad stops first, so the token drawn from them is not appended.
    bad = active & _bad(logits)
    tokens, num_generated, reasons = _append(
        state.replace(stop_reasons=jnp.where(bad, StopReason.BAD_LOGITS, state.stop_reasons)),
        token[:, None], jnp.ones_like(token), limits, eos_id)
    stats = state.stats.replace(target_calls=state.stats.target_calls + 1,
                                target_calls_per_row=state.stats.target_calls_per_row + active)
    return state.replace(tokens=tokens, num_generated=num_generated, prev_token=state.pending_token,
                         pending_token=jnp.where(active & ~bad, token, state.pending_token),
                         stop_reasons=reasons, target_cache=cache, rng=rng, stats=stats)

  state = jax.lax.while_loop(lambda s: jnp.any(s.active), step, state)
  return _finish(state, pad_id)


def _prefill_feature_draft(draft_def, draft_params, prompts, lengths, features, cache):
  """Prefills a `FeatureConditionedDraft` with the target's prompt features `[B, P, D]`.

  Returns the draft's cache and the first round's `draft_features` `[B, 2, D]`: the target's
  features before prev_token (the prompt's last, position P−1) and before pending_token (the
  first new token, position P).
  """
  # Feature k of the draft's input belongs to position k−1 (zeros before the first).
  before = jnp.pad(features[:, :-1], ((0, 0), (1, 0), (0, 0)))
  cache = draft_def.prefill_with_features(draft_params, prompts, lengths, before, cache)
  last = (lengths - 1)[:, None, None]
  return cache, jnp.concatenate(
      [jnp.take_along_axis(before, last, axis=1), jnp.take_along_axis(features, last, axis=1)],
      axis=1)


def _draft_extender(draft_def, draft_params):
  """The draft's `extend` as (tokens, features, cache) -> (logits, cache, the draft's predicted
  feature `[B, 1, D]` of the last position, or None for a draft that reads no features)."""
  def extend(tokens, features, cache):
    if features is None:
      return draft_def.extend(draft_params, tokens, cache) + (None,)
    logits, predicted, cache = draft_def.extend_with_features(draft_params, tokens, features,
                                                              cache)
    return logits, cache, predicted[:, -1:]
  return extend


def _draft_tokens(draft_def, draft_params, state: _LoopState, target_lengths, gamma, sampling,
                  rng, *, rule: adaptive.AdaptiveGamma | None = None, round_gamma=None,
                  active=None, costs=None, reread=None):
  """Step 1 of a round: up to γ draft calls.

  Returns (q̃ `[B, G, V]`, x `[B, G]`, draft cache, `[B]` rows with bad draft logits, the
  number of proposals made). With a fixed γ that number is γ (a Python int). With an adaptive
  `rule` it is traced: 0 when `round_gamma` is 0, else up to `round_gamma` (or up to γ_max
  under draft-side stopping, see `speclm.adaptive`); x past it is 0 and q̃ past it is never
  read. The first call, which reads the newest tokens, is made in every round. At
  temperature 0 q̃ is None: it is one-hot on x, and `speculative.greedy_round` needs x alone.
  A draft that sat out more rounds than its window of recent tokens holds first re-reads the
  sequence with `reread()` (a cache holding C−2 positions; see `_reread_draft`).
  """
  keys = jax.random.split(rng, gamma)
  extend = _draft_extender(draft_def, draft_params)

  if state.recent is None or state.recent.shape[1] == 2:
    # Roll back to C−2 positions and re-feed [s_{C−2}, s_{C−1}] (see the module docstring),
    # with the target's features before them for a feature-conditioned draft.
    cache = draft_def.rollback(state.draft_cache, target_lengths - 1)
    newest = jnp.stack([state.prev_token, state.pending_token], axis=1)
    if state.draft_features is None:
      logits, cache = draft_def.extend_last(draft_params, newest, cache)
      feature = None
    else:
      logits, cache, feature = extend(newest, state.draft_features, cache)
      logits = logits[:, -1]
  else:
    # After `state.skipped` rounds without the draft (adaptive γ = 0), it is that many tokens
    # behind: roll back to C−g and re-feed the last g = skipped + 2 tokens (one compiled
    # width per g, chosen by `lax.switch`). Past the window (skipped = W − 1) it re-reads
    # the sequence up to C−2 first, then re-feeds [s_{C−2}, s_{C−1}].
    window = state.recent.shape[1]

    def refeed(g, cache):
      cache = draft_def.rollback(cache, target_lengths + 1 - g)
      return draft_def.extend_last(draft_params, state.recent[:, window - g:], cache)

    branches = [functools.partial(refeed, g, state.draft_cache) for g in range(2, window + 1)]
    branches.append(lambda: refeed(2, reread()))
    logits, cache = jax.lax.switch(state.skipped, branches)
    feature = None
  greedy = sampling.is_greedy

  def choose(logits, key):
    """(q̃ `[B, V]`, None at temperature 0; the token drawn from it `[B]`)."""
    if greedy:
      return None, sampling_lib.greedy_ids(logits)
    probs = sampling_lib.standardize(logits, sampling)
    return probs, sampling_lib.sample(key, probs)

  # `logits` `[B, V]`: the draft's prediction after s_{C−1}, the first proposal's.
  first_probs, first_token = choose(logits, keys[0])
  bad = _bad(logits)

  def propose(token, feature, cache, key):
    # Past the first proposal the true features are unknown: the draft reads its own.
    logits, cache, feature = extend(token[:, None], feature, cache)
    probs, next_token = choose(logits[:, 0], key)
    return logits[:, 0], probs, next_token, feature, cache

  if rule is None:
    def step(carry, key):
      token, feature, cache, bad = carry
      logits, probs, next_token, feature, cache = propose(token, feature, cache, key)
      return (next_token, feature, cache, bad | _bad(logits)), (probs, next_token)

    (_, _, cache, bad), (probs, tokens) = jax.lax.scan(step, (first_token, feature, cache, bad),
                                                       keys[1:])
    draft_probs = None if greedy else jnp.concatenate(
        [first_probs[:, None], jnp.swapaxes(probs, 0, 1)], axis=1)
    draft_tokens = jnp.concatenate([first_token[:, None], jnp.swapaxes(tokens, 0, 1)], axis=1)
    return draft_probs, draft_tokens, cache, bad, gamma

  # Adaptive: a while loop that stops at the round's γ, or by `adaptive.keep_drafting`.
  confidence = adaptive.draft_confidence(logits, first_probs, greedy)
  probs_buffer = None if greedy else jnp.zeros(
      (first_probs.shape[0], gamma) + first_probs.shape[1:],
      first_probs.dtype).at[:, 0].set(first_probs)
  token_buffer = jnp.zeros((first_token.shape[0], gamma), jnp.int32).at[:, 0].set(first_token)
  # E_1 = Σ_b (1 + P_{b,1}) over active rows, P_{b,1} = a_{b,1}.
  expected = jnp.sum(jnp.where(active, 1.0 + confidence, 0.0))
  limit = gamma if rule.draft_stopping else round_gamma

  def more(carry):
    j, _, _, _, _, _, _, all_accepted, confidence, expected = carry
    go = (round_gamma > 0) & (j < limit)
    if rule.draft_stopping:
      go &= adaptive.keep_drafting(j, expected, all_accepted, confidence, active, rule, costs)
    return go

  def step(carry):
    j, token, feature, cache, bad, probs_buffer, token_buffer, all_accepted, _, expected = carry
    logits, probs, next_token, feature, cache = propose(token, feature, cache, keys[j])
    confidence = adaptive.draft_confidence(logits, probs, greedy)
    all_accepted = all_accepted * confidence
    return (j + 1, next_token, feature, cache, bad | _bad(logits),
            None if greedy else probs_buffer.at[:, j].set(probs),
            token_buffer.at[:, j].set(next_token),
            all_accepted, confidence,
            expected + jnp.sum(jnp.where(active, all_accepted, 0.0)))

  carry = (jnp.int32(1), first_token, feature, cache, bad, probs_buffer, token_buffer,
           confidence, confidence, expected)
  j, _, _, cache, bad, probs_buffer, token_buffer, *_ = jax.lax.while_loop(more, step, carry)
  num_drafted = jnp.where(round_gamma > 0, j, 0)
  drafted = jnp.arange(gamma)[None, :] < num_drafted
  return probs_buffer, jnp.where(drafted, token_buffer, 0), cache, bad, num_drafted


def _reread_draft(draft_def, draft_params, prompts, lengths, tokens, target_lengths, capacity,
                  chunk: int):
  """A draft cache holding the first C−2 positions of every row, rebuilt from the sequence.

  For a draft that stopped following (it sat out more rounds than its window of recent
  tokens holds): a fresh `prefill` of the prompts, then the generated tokens `tokens`
  `[B, T]` in `extend_last` calls of `chunk` tokens until every row holds C−2 =
  `target_lengths − 1` positions (rows already there write past their length, which is
  masked, and keep it). The chunk stays within one round's lookahead, which the cache has
  room for.
  """
  cache = draft_def.init_cache(prompts.shape[0], capacity)
  _, cache = draft_def.prefill(draft_params, prompts, lengths, cache)
  prefix = jnp.broadcast_to(jnp.asarray(draft_def.prefix_length(lengths), jnp.int32),
                            lengths.shape)
  needed = target_lengths - 1
  offsets = jnp.arange(chunk)[None, :]

  def read_chunk(carry):
    held, cache = carry
    positions = jnp.clip(held - prefix, 0, tokens.shape[1] - chunk)[:, None] + offsets
    _, cache = draft_def.extend_last(draft_params, jnp.take_along_axis(tokens, positions,
                                                                       axis=1),
                                     draft_def.rollback(cache, held))
    held = jnp.maximum(held, jnp.minimum(held + chunk, needed))
    return held, draft_def.rollback(cache, held)

  held = draft_def.cache_lengths(cache)
  _, cache = jax.lax.while_loop(lambda carry: jnp.any(carry[0] < needed), read_chunk,
                                (held, cache))
  return cache


def _verify_and_accept(target_def, target_params, state: _LoopState, draft_probs, drafted,
                       with_features: bool, sampling, uniforms, key, num_drafted=None):
  """Steps 2 and 3 of a round: one target call on [s_{C−1}, x_1, …, x_k] (K = k+1 tokens)
  gives p̃_1 … p̃_{k+1}, then Algorithm 1 accepts n of x_1 … x_k and draws t.

  Returns (the `speculative.RoundResult`, its β `[B, G]` zero past k; `[B]` rows whose target
  logits are bad; the target's features `[B, G+1, D]` of the verified positions for a
  feature-conditioned draft, None otherwise; the target's cache). With a fixed γ, k = G.
  With a traced `num_drafted` k, the call and the acceptance have the width k+1 (one of G+1
  compiled branches, chosen by `lax.switch`), so the round's work over the vocabulary (p̃ at
  each verified position, the residual) follows the k chosen, not γ_max. Features past position k+1 repeat the last one (never read:
  at most k drafts are accepted). At temperature 0 the acceptance is
  `speculative.greedy_round` on the argmax ids (the same decisions, no [B, K, V] arrays).
  """
  verified = jnp.concatenate([state.pending_token[:, None], drafted], axis=1)
  gamma = drafted.shape[1]

  def call(tokens):
    if with_features:
      return target_def.extend_with_features(target_params, tokens, state.target_cache)
    logits, cache = target_def.extend(target_params, tokens, state.target_cache)
    return logits, None, cache

  def verify_and_accept(k):
    logits, features, cache = call(verified[:, :k + 1])
    if sampling.is_greedy:
      result = speculative.greedy_round(drafted[:, :k], sampling_lib.greedy_ids(logits))
    else:
      result = speculative.speculative_round(
          draft_probs[:, :k], drafted[:, :k], sampling_lib.standardize(logits, sampling),
          uniforms[:, :k], key)
    if k < gamma:
      result = result.replace(beta=jnp.pad(result.beta, ((0, 0), (0, gamma - k))))
      if features is not None:
        features = jnp.concatenate(
            [features, jnp.repeat(features[:, -1:], gamma - k, axis=1)], axis=1)
    return result, _bad(logits), features, cache

  if num_drafted is None:
    return verify_and_accept(gamma)
  return jax.lax.switch(num_drafted, [functools.partial(verify_and_accept, k)
                                      for k in range(gamma + 1)])


def _hand_off_features(draft_features, features, n, good) -> jax.Array:
  """The EAGLE feature hand-off: the next round's `draft_features` `[B, 2, D]`.

  `features` `[B, K, D]` are the target's features of the verified positions C−1 … C−1+γ.
  The new prev and pending tokens sit at C−1+n and C+n, so the features before them are those
  of positions C−1+n−1 and C−1+n. When n = 0 the new prev is the old pending token, whose
  feature (`draft_features[:, 1]`) is already known. Rows that are not `good` (stopped, or
  discarded for bad logits) keep theirs.
  """
  def feature_at(i):
    return jnp.take_along_axis(features, i[:, None, None], axis=1)[:, 0]
  before_prev = jnp.where((n > 0)[:, None], feature_at(jnp.maximum(n - 1, 0)),
                          draft_features[:, 1])
  return jnp.where(good[:, None, None], jnp.stack([before_prev, feature_at(n)], axis=1),
                   draft_features)


def _reached_beta(result: speculative.RoundResult, good, num_drafted) -> tuple[jax.Array, ...]:
  """`[B]` Σ β and count over the drafted positions the committed sequence reached.

  β = Σ_x min(p̃, q̃) (Theorem 3.5) counts at drafted positions 1 … min(n+1, k) of a round
  that drafted k: position i counts if the first i−1 drafts were accepted, so the mean of β
  is α (Corollary 3.6). Only `good` rows (active, without bad logits) count.
  """
  gamma = result.beta.shape[1]
  positions = jnp.arange(gamma)[None, :]
  reached = ((positions <= result.num_accepted[:, None]) & (positions < num_drafted)
             & good[:, None])
  return (jnp.sum(jnp.where(reached, result.beta, 0.0), axis=1),
          jnp.sum(reached, axis=1).astype(jnp.int32))


def _count_round(stats: DecodeStats, result: speculative.RoundResult, active, good,
                 num_drafted, draft_runs=True) -> DecodeStats:
  """Adds one speculative round that drafted `num_drafted` tokens to the statistics (one
  target call; max(k, 1) draft calls when the draft ran, since it reads the newest tokens
  even when it proposes none, and none when it sat the round out).

  `active` rows count the target call; only `good` rows count their n and β (`_reached_beta`)
  — a round discarded for bad logits counts as a target call, nothing else.
  """
  beta_row, count_row = _reached_beta(result, good, num_drafted)
  return add_round(stats, num_accepted=result.num_accepted, active=active, good=good,
                   beta_row=beta_row, count_row=count_row, drafted=num_drafted,
                   draft_calls=jnp.where(draft_runs, jnp.maximum(num_drafted, 1), 0))


def add_round(stats: DecodeStats, *, num_accepted, active, good, beta_row, count_row, drafted,
              draft_calls) -> DecodeStats:
  """The counters every round adds (chains and token trees): one target call, its draft
  calls, the round in `gamma_histogram` at `drafted`, and for `good` rows their accepted n
  (`accepted_histogram`) and the β sums and counts of the positions they reached."""
  width = stats.accepted_histogram.shape[0]
  n = num_accepted
  return stats.replace(
      target_calls=stats.target_calls + 1,
      draft_calls=stats.draft_calls + draft_calls,
      gamma_histogram=stats.gamma_histogram + jax.nn.one_hot(drafted, width, dtype=jnp.int32),
      target_calls_per_row=stats.target_calls_per_row + active,
      accepted_per_row=stats.accepted_per_row + jnp.where(good, n, 0),
      accepted_histogram=stats.accepted_histogram + jnp.sum(
          jax.nn.one_hot(n, width, dtype=jnp.int32) * good[:, None], axis=0),
      beta_sum=stats.beta_sum + jnp.sum(beta_row),
      beta_count=stats.beta_count + jnp.sum(count_row),
      beta_sum_per_row=stats.beta_sum_per_row + beta_row,
      beta_count_per_row=stats.beta_count_per_row + count_row)


def _speculative_loop(target_def, draft_def, target_params, draft_params, prompts, lengths,
                      limits, rng, eos_id, pad_id, rule_costs, *, gamma, rule, sampling,
                      buffer_length, target_capacity, draft_capacity) -> DecodeResult:
  """Algorithm 1 in a while loop. With an adaptive `rule` (its `structure()`, static),
  `rule_costs` is its `cost_vector()`; unused otherwise."""
  batch = prompts.shape[0]
  # Prefill both models; a feature-conditioned draft reads the target's prompt features. A
  # draft that may sit rounds out (adaptive γ) is not prefilled: it reads the prompt when it
  # first drafts (`_reread_draft`), so a batch that never speculates never runs it.
  draft_cache = draft_def.init_cache(batch, draft_capacity)
  target_cache = target_def.init_cache(batch, target_capacity)
  with_features = isinstance(draft_def, protocol.FeatureConditionedDraft)
  lazy_draft = rule is not None and rule.max_skip > 0 and not with_features
  if with_features:
    logits, features, target_cache = target_def.prefill_with_features(
        target_params, prompts, lengths, target_cache)
    draft_cache, draft_features = _prefill_feature_draft(draft_def, draft_params, prompts,
                                                         lengths, features, draft_cache)
  else:
    if lazy_draft:  # a cache shaped as after prefill (an encoder-decoder's holds the input)
      shaped = jax.eval_shape(draft_def.prefill, draft_params, prompts, lengths, draft_cache)[1]
      draft_cache = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shaped)
    else:
      _, draft_cache = draft_def.prefill(draft_params, prompts, lengths, draft_cache)
    logits, target_cache = target_def.prefill(target_params, prompts, lengths, target_cache)
    draft_features = None
  state = _start(target_def, prompts, lengths, limits, rng, eos_id, sampling, buffer_length,
                 gamma, logits=logits, target_cache=target_cache, draft_cache=draft_cache,
                 draft_features=draft_features)
  if not lazy_draft:
    state = state.replace(stats=state.stats.replace(draft_calls=state.stats.draft_calls + 1))
  if rule is not None:
    state = state.replace(evidence_sum=jnp.zeros((batch,), jnp.float32),
                          evidence_count=jnp.zeros((batch,), jnp.float32))
    if lazy_draft:
      # The window of recent tokens starts as [0 … 0, s_{C−2}, s_{C−1}]; the draft has read
      # nothing yet (`skipped` = W − 1: re-read before drafting).
      window = rule.max_skip + 2
      recent = jnp.zeros((batch, window), jnp.int32)
      state = state.replace(skipped=jnp.int32(window - 1), recent=recent.at[:, -2].set(
          state.prev_token).at[:, -1].set(state.pending_token))

  def round_(state: _LoopState) -> _LoopState:
    """One round of Algorithm 1 for every row: draft, verify, accept, append."""
    target_lengths = target_def.cache_lengths(state.target_cache)  # C−1
    # The target writes γ+1 positions after C−1; the draft γ+1 after C−2.
    reasons = _stop_if_full(state.stop_reasons, target_lengths, gamma + 1,
                            target_def.cache_capacity(state.target_cache))
    reasons = _stop_if_full(reasons, target_lengths - 1, gamma + 1,
                            draft_def.cache_capacity(state.draft_cache))
    state = state.replace(stop_reasons=reasons)
    active = state.active
    rng, draft_key, uniform_key, next_key = jax.random.split(state.rng, 4)

    # 0. An adaptive rule picks this round's γ from each row's running α (`speclm.adaptive`).
    round_gamma = None
    if rule is not None:
      round_gamma = adaptive.choose_gamma(
          adaptive.running_alpha(state.evidence_sum, state.evidence_count, rule), active, rule,
          rule_costs)
    # 1. Draft: γ guesses x_1 … x_γ from q̃_1 … q̃_γ (k ≤ γ under an adaptive rule, and
    #    steps 2–3 then run at the width k).
    #    When γ = 0 and the draft may fall behind (`rule.max_skip` > 0), it sits the round out.
    def draft(state):
      reread = functools.partial(
          _reread_draft, draft_def, draft_params, prompts, lengths, state.tokens,
          target_lengths, draft_def.cache_capacity(state.draft_cache), gamma + 1)
      return _draft_tokens(draft_def, draft_params, state, target_lengths, gamma, sampling,
                           draft_key, rule=rule, round_gamma=round_gamma, active=active,
                           costs=rule_costs, reread=reread)

    def sit_out(state):
      return (None if sampling.is_greedy
              else jnp.zeros((batch, gamma, target_def.vocab_size), jnp.float32),
              jnp.zeros((batch, gamma), jnp.int32), state.draft_cache,
              jnp.zeros((batch,), bool), jnp.int32(0))

    draft_runs = True
    if state.skipped is not None:
      draft_runs = round_gamma > 0
      draft_probs, drafted, draft_cache, draft_bad, num_drafted = jax.lax.cond(
          draft_runs, draft, sit_out, state)
    else:
      draft_probs, drafted, draft_cache, draft_bad, num_drafted = draft(state)
    # 2. Verify: one parallel target call on [s_{C−1}, x_1, …, x_k] gives p̃_1 … p̃_{k+1}.
    # 3. Accept n of the guesses (r < p̃(x)/q̃(x)) and draw one more token t (Algorithm 1).
    uniforms = jax.random.uniform(uniform_key, (batch, gamma))
    result, target_bad, features, target_cache = _verify_and_accept(
        target_def, target_params, state, draft_probs, drafted, with_features, sampling,
        uniforms, next_key, num_drafted=None if rule is None else num_drafted)
    n = result.num_accepted
    # 4. Keep C−1+n+1 target positions (rollback = a smaller length); append x_1 … x_n, t.
    # A row with bad logits anywhere in the round (the target's γ+1 or the draft's) stops
    # first and appends nothing from it: n and t were computed from those logits.
    target_cache = target_def.rollback(
        target_cache, jnp.where(active, target_lengths + n + 1, target_lengths))
    offsets = jnp.arange(gamma + 1)[None, :]
    padded = jnp.concatenate([drafted, drafted[:, -1:]], axis=1)
    new_tokens = jnp.where(offsets < n[:, None], padded, result.next_token[:, None])
    bad = active & (target_bad | draft_bad)
    good = active & ~bad
    tokens, num_generated, reasons = _append(
        state.replace(stop_reasons=jnp.where(bad, StopReason.BAD_LOGITS, state.stop_reasons)),
        new_tokens, n + 1, limits, eos_id)
    # t becomes pending; the token before it is x_n, or the old pending token when n = 0.
    prev = jnp.where(n > 0, jnp.take_along_axis(padded, jnp.maximum(n - 1, 0)[:, None],
                                                axis=1)[:, 0], state.pending_token)

    if rule is not None:
      evidence_sum, evidence_count = adaptive.update_evidence(
          state.evidence_sum, state.evidence_count,
          *_reached_beta(result, good, num_drafted), rule)
      state = state.replace(evidence_sum=evidence_sum, evidence_count=evidence_count)
    if state.skipped is not None:
      # The last W tokens after appending new_tokens[:, :n+1] (rows that did not append keep
      # theirs), and the count of rounds the draft sat out (W − 1: more than the window holds).
      window = state.recent.shape[1]
      joined = jnp.concatenate([state.recent, new_tokens], axis=1)
      taken = jnp.take_along_axis(joined, (n + 1)[:, None] + jnp.arange(window)[None, :], axis=1)
      state = state.replace(recent=jnp.where(good[:, None], taken, state.recent),
                            skipped=jnp.where(draft_runs, 0,
                                              jnp.minimum(state.skipped + 1, window - 1)))

    return state.replace(
        tokens=tokens, num_generated=num_generated,
        prev_token=jnp.where(good, prev, state.prev_token),
        pending_token=jnp.where(good, result.next_token, state.pending_token),
        stop_reasons=reasons, target_cache=target_cache, draft_cache=draft_cache, rng=rng,
        stats=_count_round(state.stats, result, active, good, num_drafted, draft_runs),
        draft_features=(_hand_off_features(state.draft_features, features, n, good)
                        if with_features else None))

  state = jax.lax.while_loop(lambda s: jnp.any(s.active), round_, state)
  return _finish(state, pad_id)


# `speclm.partitioning.Partitioner.jit_decode_loop` relies on the loops' argument order: the
# definitions, their parameters, then prompts, lengths, limits, rng, eos_id, pad_id (and the
# speculative loop's rule costs).
_autoregressive_jit = jax.jit(
    _autoregressive_loop, static_argnums=(0,),
    static_argnames=('sampling', 'buffer_length', 'capacity'))
_speculative_jit = jax.jit(
    _speculative_loop, static_argnums=(0, 1),
    static_argnames=('gamma', 'rule', 'sampling', 'buffer_length', 'target_capacity',
                     'draft_capacity'))
