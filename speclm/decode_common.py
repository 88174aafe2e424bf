"""What the decode loops share: results, the loop state, validation, start, append, finish.

`speclm.decoding` (the baseline and the speculative chain) and `speclm.tree_decoding` (token
trees) build their loops from these pieces; `speclm.decoding` re-exports the result types
(`StopReason`, `DecodeStats`, `DecodeResult`) and the job-side checks (`check_gamma`,
`check_pair`, `end_tokens`, `add_round`). The bookkeeping is the one the module docstring of
`speclm.decoding` walks through: a row's sequence is s_0 … s_{C−1}, the target's cache holds
C−1 positions and s_{C−1} is pending.

Validation (`validate_inputs`, `check_context`, `check_gamma`, `check_pair`,
`check_same_prefix`, `cache_capacity`) is plain Python that runs before anything is traced;
the rest runs inside the compiled loops: a round's frame (`begin_round`, `round_tokens`,
`commit_round`, built on `start`, `append`, `bad_rows`, `stop_if_full`, `finish`), its
statistics (`add_round`, `reached_beta`, `count_chain_round`), and the draft calls of the
chain loops (`prefill_feature_draft`, `draft_extender`, `reread_draft`).

Shape letters: B batch, P prompt length, T output buffer, G γ (or a tree's depth), K tokens
per extend, E end tokens, V vocabulary, D feature width, W recent tokens.
"""

from __future__ import annotations

import enum
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

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
    """All counters at zero for `batch_size` rows and histograms of γ+1 bins (no ranks)."""
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
class LoopState:
  """State carried by every decode loop (the draft fields are unused by the baseline).

  The chain loops (`speclm.decoding`) and the tree loop (`speclm.tree_decoding`) carry it
  through their `jax.lax.while_loop`; `start` builds it after prefill and `finish` turns it
  into a `DecodeResult`.
  """

  tokens: jax.Array  # [B, T] generated so far; T leaves room for one round's overflow
  num_generated: jax.Array  # [B]
  prev_token: jax.Array  # [B] s_{C-2}
  pending_token: jax.Array  # [B] s_{C-1}, not yet in the target cache
  stop_reasons: jax.Array  # [B] StopReason, RUNNING while generating
  target_cache: protocol.Cache
  draft_cache: protocol.Cache
  rng: jax.Array
  stats: DecodeStats
  # For a FeatureConditionedDraft (None for other drafts), the block it re-reads at the next
  # round's start (`next_feature_block`): the last round's appended tokens `feature_tokens`
  # [B, W] (W = G+1 for a chain, the depth + 1 for a tree), of which the first
  # `feature_count` [B] are real, and the target's features before each [B, W, D].
  draft_features: jax.Array | None = None
  feature_tokens: jax.Array | None = None
  feature_count: jax.Array | None = None
  # [B] each row's decayed β sum and count, for `adaptive.AdaptiveGamma`; None otherwise.
  evidence_sum: jax.Array | None = None
  evidence_count: jax.Array | None = None
  # Adaptive γ with skipping: `[]` consecutive rounds the draft sat out (γ = 0), and `[B, W]`
  # the row's last W tokens s_{C−W} … s_{C−1} (entries before s_0 are never read).
  skipped: jax.Array | None = None
  recent: jax.Array | None = None

  @property
  def active(self) -> jax.Array:
    """`[B]` rows still generating (`stop_reasons` is RUNNING)."""
    return self.stop_reasons == StopReason.RUNNING


# ----------------------------------------------------------------------------------------------
# Validation (plain Python, before anything is traced)


def validate_inputs(model, prompt_tokens, prompt_lengths, sampling, max_new_tokens, seed,
                    eos_id) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Checks the arguments every decode takes, and returns them as the loops' int32 arrays.

  Args:
    model: the target, a `protocol.Model`.
    prompt_tokens: `[B, P]` int prompts, right-padded, in [0, V).
    prompt_lengths: `[B]` int real lengths, 1 … P.
    sampling: a `sampling.SamplingConfig`.
    max_new_tokens: an int ≥ 1 or `[B]` of them.
    seed: a Python or NumPy integer.
    eos_id: None, a token id or several.

  Returns:
    (prompts `[B, P]`, lengths `[B]`, limits `[B]`), int32. TypeError or ValueError (saying
    what to change) on anything else.
  """
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


def check_context(definition: protocol.LanguageModel, role: str, lengths, limits) -> None:
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


def cache_capacity(definition: protocol.LanguageModel, prompt_width: int, max_new: int,
                   gamma: int, cache_length: int | None) -> int:
  """Cache positions per row: the prefix, every new token, and one round's lookahead.

  `gamma` is the lookahead past those (γ for a chain, the written slots for a tree); an
  explicit `cache_length` caps the result (rows then stop with CACHE_FULL) and must hold the
  prefix and one new token.
  """
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


def check_same_prefix(target: protocol.Model, draft: protocol.Model, width: int) -> None:
  """ValueError unless both models hold the same positions after prefilling `width`-token
  prompts (a decoder-only model paired with an encoder-decoder would continue different
  sequences)."""
  if int(draft.definition.prefix_length(width)) != int(target.definition.prefix_length(width)):
    raise ValueError(
        'The draft and target continue different sequences: after prefill the target holds'
        f' {target.definition.prefix_length(width)} positions, the draft'
        f' {draft.definition.prefix_length(width)}. Pair decoder-only models with decoder-only'
        ' drafts, encoder-decoders with encoder-decoder drafts.')


def trim(result: DecodeResult, max_new: int) -> DecodeResult:
  """`result` with its tokens `[B, T]` cut to `[B, max_new]` (the loop's buffer has room for
  one round's overflow)."""
  return result.replace(tokens=result.tokens[:, :max_new])


# ----------------------------------------------------------------------------------------------
# Inside the loops


def end_tokens(eos_id: int | Sequence[int] | None) -> jax.Array:
  """The loops' end tokens `[E]`: the ids that end a row (-1, no token, for None)."""
  return jnp.asarray(np.ravel(np.asarray(-1 if eos_id is None else eos_id)), jnp.int32)


def as_rounds_without_drafts(baseline: DecodeResult, max_gamma: int) -> DecodeResult:
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


def append(state: LoopState, new_tokens, num_new, limits, eos_id) -> tuple[jax.Array, ...]:
  """Appends `new_tokens[b, :num_new[b]]` to each active row, cut at an end token (any of
  `eos_id` `[E]`) or the limit.

  Args:
    state: the loop state; only its active rows change.
    new_tokens: `[B, K]` int32 tokens to append.
    num_new: `[B]` how many of them each row appends.
    limits: `[B]` each row's max_new_tokens.
    eos_id: `[E]` end tokens (`end_tokens`).

  Returns (tokens `[B, T]`, num_generated `[B]`, stop_reasons `[B]`) for the next state.
  """
  write = jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,)))
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


def bad_rows(logits: jax.Array) -> jax.Array:
  """`[B]` rows whose logits contain NaN or +inf (-inf is a legitimate zero probability)."""
  return jnp.any(jnp.isnan(logits) | (logits == jnp.inf), axis=tuple(range(1, logits.ndim)))


def start(target_def, prompts, lengths, limits, rng, eos_id, sampling, buffer_length, gamma,
          *, logits, target_cache, draft_cache=None, draft_features=None) -> LoopState:
  """The state after prefill: draws the first token from the target's p̃ (every loop).

  `prompts` `[B, P]`, `lengths` `[B]`, `limits` `[B]`, `eos_id` `[E]` are the loop's
  arguments; `buffer_length` is T and `gamma` G sizes the histograms. `logits` `[B, V]` and
  `target_cache` are what the target's `prefill` returned (counted here as one target call);
  the speculative loop also passes its prefilled draft cache and, for a feature-conditioned
  draft, the first round's `draft_features`. A row whose prefill logits
  are bad stops with BAD_LOGITS and no token.
  """
  batch = prompts.shape[0]
  rng, first_key = jax.random.split(rng)
  first = sampling_lib.draw(first_key, logits, sampling)
  stats = DecodeStats.zeros(batch, gamma)
  stats = stats.replace(target_calls=stats.target_calls + 1,
                        target_calls_per_row=stats.target_calls_per_row + 1)
  state = LoopState(
      tokens=jnp.zeros((batch, buffer_length), jnp.int32),
      num_generated=jnp.zeros((batch,), jnp.int32),
      prev_token=target_def.last_prefix_token(prompts, lengths).astype(jnp.int32),
      pending_token=first,
      stop_reasons=jnp.where(bad_rows(logits), StopReason.BAD_LOGITS,
                             StopReason.RUNNING).astype(jnp.int32),
      target_cache=target_cache, draft_cache=draft_cache, rng=rng, stats=stats,
      draft_features=draft_features)
  # `append` writes to running rows only: a row stopped for bad logits keeps 0 tokens.
  tokens, num_generated, reasons = append(state, first[:, None], jnp.ones((batch,), jnp.int32),
                                          limits, eos_id)
  return state.replace(tokens=tokens, num_generated=num_generated, stop_reasons=reasons)


def finish(state: LoopState, pad_id) -> DecodeResult:
  """The loop's result: each row's tokens `[B, T]`, `pad_id` past its length."""
  positions = jnp.arange(state.tokens.shape[1])[None, :]
  tokens = jnp.where(positions < state.num_generated[:, None], state.tokens, pad_id)
  return DecodeResult(tokens=tokens, lengths=state.num_generated,
                      stop_reasons=state.stop_reasons, stats=state.stats)


def stop_if_full(reasons, lengths, needed: int, capacity: int) -> jax.Array:
  """Rows whose cache (at `lengths`) cannot take `needed` more positions stop with CACHE_FULL."""
  full = lengths + needed > capacity
  return jnp.where((reasons == StopReason.RUNNING) & full, StopReason.CACHE_FULL, reasons)


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


def begin_round(state: LoopState, target_def, draft_def, target_lookahead: int,
                draft_lookahead: int) -> tuple:
  """What every speculative round (chain or tree) does first.

  Rows whose target cache (C−1 positions) cannot take `target_lookahead` more, or whose draft
  cache (C−2) cannot take `draft_lookahead` more, stop with CACHE_FULL; then the round's keys
  are split off.

  Returns (state, target_lengths `[B]` = C−1, active `[B]`, (rng, draft_key, uniform_key,
  next_key)): rng is the next state's.
  """
  target_lengths = target_def.cache_lengths(state.target_cache)  # C−1
  reasons = stop_if_full(state.stop_reasons, target_lengths, target_lookahead,
                         target_def.cache_capacity(state.target_cache))
  reasons = stop_if_full(reasons, target_lengths - 1, draft_lookahead,
                         draft_def.cache_capacity(state.draft_cache))
  state = state.replace(stop_reasons=reasons)
  active = state.active
  rng, draft_key, uniform_key, next_key = jax.random.split(state.rng, 4)
  return state, target_lengths, active, (rng, draft_key, uniform_key, next_key)


def round_tokens(accepted_path, num_accepted, next_token) -> tuple[jax.Array, jax.Array]:
  """The tokens a round appends (Algorithm 1's output): x_1 … x_n, then t.

  Args:
    accepted_path: `[B, G]` the drafted tokens along the verified chain or tree path.
    num_accepted: `[B]` n ∈ [0, G].
    next_token: `[B]` t, drawn after the n accepted tokens.

  Returns (padded `[B, G+1]`: the path with its last token repeated, new tokens `[B, G+1]`:
  x_1 … x_n, then t repeated; a row appends its first n+1).
  """
  offsets = jnp.arange(accepted_path.shape[1] + 1)[None, :]
  padded = jnp.concatenate([accepted_path, accepted_path[:, -1:]], axis=1)
  new_tokens = jnp.where(offsets < num_accepted[:, None], padded, next_token[:, None])
  return padded, new_tokens


def commit_round(state: LoopState, active, padded, new_tokens, num_accepted, bad, limits,
                 eos_id) -> tuple[jax.Array, ...]:
  """Appends a round's n+1 tokens (`round_tokens`) to the rows that end it well.

  `active` `[B]` are the rows the round ran for (`begin_round`). A row with `bad` `[B]` logits
  anywhere in the round stops with BAD_LOGITS first and appends nothing from it: n and t were
  computed from those logits. `limits` `[B]` and `eos_id` `[E]` are `append`'s.

  Returns (tokens `[B, T]`, num_generated `[B]`, stop_reasons `[B]` for the next state; good
  `[B]`: active rows without bad logits; prev `[B]`: the token before t, x_n or the old
  pending token when n = 0, the next state's s_{C−2} for good rows).
  """
  n = num_accepted
  good = active & ~bad
  tokens, num_generated, reasons = append(
      state.replace(stop_reasons=jnp.where(bad, StopReason.BAD_LOGITS, state.stop_reasons)),
      new_tokens, n + 1, limits, eos_id)
  prev = jnp.where(n > 0, jnp.take_along_axis(padded, jnp.maximum(n - 1, 0)[:, None],
                                              axis=1)[:, 0], state.pending_token)
  return tokens, num_generated, reasons, good, prev


def reached_beta(result: speculative.RoundResult, good, num_drafted) -> tuple[jax.Array, ...]:
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


def count_chain_round(stats: DecodeStats, result: speculative.RoundResult, active, good,
                 num_drafted, draft_runs=True) -> DecodeStats:
  """Adds one speculative round that drafted `num_drafted` tokens to the statistics (one
  target call; max(k, 1) draft calls when the draft ran, since it reads the newest tokens
  even when it proposes none, and none when it sat the round out).

  `active` rows count the target call; only `good` rows count their n and β (`reached_beta`)
  — a round discarded for bad logits counts as a target call, nothing else.
  """
  beta_row, count_row = reached_beta(result, good, num_drafted)
  return add_round(stats, num_accepted=result.num_accepted, active=active, good=good,
                   beta_row=beta_row, count_row=count_row, drafted=num_drafted,
                   draft_calls=jnp.where(draft_runs, jnp.maximum(num_drafted, 1), 0))


# ----------------------------------------------------------------------------------------------
# Draft calls


def prefill_feature_draft(draft_def, draft_params, prompts, lengths, features, cache):
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


def first_feature_block(state: LoopState, width: int) -> LoopState:
  """The first re-read block after prefill (chain and tree loops): [s_{C−2}, s_{C−1}] with
  the features before them (`prefill_feature_draft`'s `[B, 2, D]`), padded to `width` rows."""
  batch = state.prev_token.shape[0]
  tokens = jnp.zeros((batch, width), jnp.int32)
  tokens = tokens.at[:, 0].set(state.prev_token).at[:, 1].set(state.pending_token)
  features = jnp.pad(state.draft_features, ((0, 0), (0, width - 2), (0, 0)))
  return state.replace(draft_features=features, feature_tokens=tokens,
                       feature_count=jnp.full((batch,), 2, jnp.int32))


def next_feature_block(state: LoopState, new_tokens, features, n, good) -> LoopState:
  """The next round's re-read block: the n+1 tokens this round appended, x_1 … x_n, t
  (`round_tokens`' new tokens `[B, G+1]`), with the target's features before each: those of
  the verified positions C−1 … C−1+n, `features[:, :n+1]` (`[B, G+1, D]`). Rows that are not
  `good` keep theirs.

  Re-reading every accepted token with the target's features keeps the draft's cache as
  training-time test trains it (`speclm.models.eagle.ttt_visibility`): true features at every
  position before the round. Re-reading only the newest two would leave x_1 … x_{n−1} with
  the draft's own predicted features from drafting them.
  """
  keep = good[:, None]
  return state.replace(
      feature_tokens=jnp.where(keep, new_tokens, state.feature_tokens),
      draft_features=jnp.where(keep[:, :, None], features, state.draft_features),
      feature_count=jnp.where(good, n + 1, state.feature_count))


def feature_block_lookahead(draft_def, lookahead: int, width: int) -> int:
  """Draft cache positions a round may write after C−2: `lookahead`, or more for a
  `protocol.FeatureConditionedDraft`, whose re-read block of `width` rows starts at C − count
  (C−1 at the latest) and so ends at C + width − 2: width + 1 positions after C−2."""
  if isinstance(draft_def, protocol.FeatureConditionedDraft):
    return max(lookahead, width + 1)
  return lookahead


def reread_feature_block(draft_def, draft_params, cache, tokens, features, count,
                         target_lengths):
  """A round's first draft call with the re-read block (`next_feature_block`): roll the draft
  `cache` back to C − count and extend it with the block's `tokens` `[B, W]` and `features`
  `[B, W, D]` in one call, then roll it back to C positions. Rows past `count` `[B]` come
  after the real ones, so no real row sees them. `target_lengths` is C−1. Returns (the
  draft's logits `[B, V]` after s_{C−1}, its cache, its predicted feature `[B, 1, D]` of
  s_{C−1})."""
  cache = draft_def.rollback(cache, target_lengths + 1 - count)
  logits, predicted, cache = draft_def.extend_with_features(draft_params, tokens, features,
                                                            cache)
  last = (count - 1)[:, None, None]
  return (jnp.take_along_axis(logits, last, axis=1)[:, 0],
          draft_def.rollback(cache, target_lengths + 1),
          jnp.take_along_axis(predicted, last, axis=1))


def draft_extender(draft_def, draft_params):
  """The draft's `extend` as (tokens, features, cache) -> (logits, cache, the draft's predicted
  feature `[B, 1, D]` of the last position, or None for a draft that reads no features)."""
  def extend(tokens, features, cache):
    if features is None:
      return draft_def.extend(draft_params, tokens, cache) + (None,)
    logits, predicted, cache = draft_def.extend_with_features(draft_params, tokens, features,
                                                              cache)
    return logits, cache, predicted[:, -1:]
  return extend


def reread_draft(draft_def, draft_params, prompts, lengths, tokens, target_lengths, capacity,
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
