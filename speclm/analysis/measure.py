"""Explaining a decode's results: α and the β distribution, greedy rounds replayed, the records.

α (Corollary 3.6). The paper lets the target M_p generate text (10,000 tokens) and averages,
over every position of it, β = Σ_x min(p̃(x), q̃(x)) = 1 − DLK(p̃, q̃), where p̃ and q̃ are the
target's and draft's *standardized* distributions (same temperature / top-k / top-p as the
decode) given the same prefix. Given that text (a `Reference`), `beta_along` scores it with one
teacher-forced pass of each model (through the protocol: `prefill` of the prompt, then one
`extend` with all generated tokens), which gives p̃ and q̃ at every position; `summarize_beta`
gives α, the β histogram and its autocorrelation along the text, i.e. how far the i.i.d.
assumption behind Eq. (1) holds. Nothing here runs a decode loop: the reference text comes from
one (`speclm.run.calibration.generate_reference` and `estimate_alpha`, or `collect_reference`
over any decode function), and so do the timings this module's records hold (`CostEstimate`,
`SpeedupMeasurement`: `speclm.run.calibration.measure_costs` and `measure_speedup`).

Shape letters: R reference rows, B batch, P prompt length, T generated tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import speculative
from speclm.decode_common import DecodeStats


# ----------------------------------------------------------------------------------------------
# α from a decode's own statistics (the pooled α is `DecodeStats.alpha`)


def alpha_per_row_from_stats(stats: DecodeStats) -> np.ndarray:
  """`[B]` α of each row (NaN for rows with no drafted position)."""
  sums = np.asarray(stats.beta_sum_per_row, dtype=np.float64)
  counts = np.asarray(stats.beta_count_per_row, dtype=np.float64)
  with np.errstate(invalid='ignore', divide='ignore'):
    return np.where(counts > 0, sums / counts, np.nan)


# ----------------------------------------------------------------------------------------------
# Summaries of a β sequence


@dataclasses.dataclass(frozen=True)
class BetaSummary:
  """α and the distribution of β over the measured positions.

  Attributes:
    alpha: mean β (Corollary 3.6).
    dlk: 1 − α, the mean DLK divergence (Lemma 3.3).
    num_positions: how many positions were averaged.
    stderr: σ(β)/√N, the standard error if positions were independent (see autocorrelation;
      with positive autocorrelation the true error is larger).
    histogram: counts of β per bin.
    bin_edges: len(histogram) + 1 edges over [0, 1].
    autocorrelation: ρ(k) for lags k = 1 … max_lag along each sequence (pooled over rows);
      NaN where β is constant or no pair is that far apart. Zero for i.i.d. β.
  """

  alpha: float
  dlk: float
  num_positions: int
  stderr: float
  histogram: np.ndarray
  bin_edges: np.ndarray
  autocorrelation: np.ndarray

  def to_dict(self) -> dict[str, Any]:
    return {
        'alpha': self.alpha, 'dlk': self.dlk, 'num_positions': self.num_positions,
        'stderr': self.stderr, 'histogram': self.histogram.tolist(),
        'bin_edges': self.bin_edges.tolist(),
        'autocorrelation': {str(k + 1): (None if math.isnan(v) else float(v))
                            for k, v in enumerate(self.autocorrelation)},
    }


def _as_rows(beta, mask) -> tuple[np.ndarray, np.ndarray]:
  beta = np.asarray(beta, dtype=np.float64)
  if beta.ndim == 1:
    beta = beta[None]
  if beta.ndim != 2:
    raise ValueError(f'beta must be [T] or [rows, T], got shape {beta.shape}.')
  mask = np.ones(beta.shape, bool) if mask is None else np.asarray(mask, bool).reshape(beta.shape)
  return beta, mask


def beta_autocorrelation(beta, mask=None, max_lag: int = 10) -> np.ndarray:
  """ρ(k), k = 1 … max_lag, of β along each row, pooled over rows.

  ρ(k) = mean over pairs (t, t+k) both in `mask` of (β_t − μ)(β_{t+k} − μ) / σ², with μ and σ²
  the pooled mean and variance of all masked β. Pairs never cross rows.
  """
  beta, mask = _as_rows(beta, mask)
  if max_lag < 1:
    raise ValueError(f'max_lag must be >= 1, got {max_lag}.')
  values = beta[mask]
  out = np.full(max_lag, np.nan)
  if values.size < 2:
    return out
  mean, var = values.mean(), values.var()
  if var <= 0:
    return out
  centered = np.where(mask, beta - mean, 0.0)
  for lag in range(1, min(max_lag, beta.shape[1] - 1) + 1):
    pairs = mask[:, :-lag] & mask[:, lag:]
    count = pairs.sum()
    if count:
      out[lag - 1] = np.sum(centered[:, :-lag] * centered[:, lag:] * pairs) / count / var
  return out


def summarize_beta(beta, mask=None, *, bins: int = 20, max_lag: int = 10) -> BetaSummary:
  """α, DLK, histogram and autocorrelation of β values `[T]` or `[rows, T]` (masked)."""
  beta, mask = _as_rows(beta, mask)
  values = beta[mask]
  if values.size == 0:
    raise ValueError('No β values to summarize (the mask selects nothing).')
  if np.any(values < -1e-6) or np.any(values > 1 + 1e-6):
    raise ValueError(f'β values must lie in [0, 1], got range [{values.min()}, {values.max()}].')
  histogram, edges = np.histogram(np.clip(values, 0.0, 1.0), bins=bins, range=(0.0, 1.0))
  alpha = float(values.mean())
  stderr = float(values.std(ddof=1) / math.sqrt(values.size)) if values.size > 1 else float('nan')
  return BetaSummary(alpha=alpha, dlk=1.0 - alpha, num_positions=int(values.size),
                     stderr=stderr, histogram=histogram, bin_edges=edges,
                     autocorrelation=beta_autocorrelation(beta, mask, max_lag))


def overlap(target_probs, draft_probs) -> np.ndarray:
  """β = Σ_x min(p(x), q(x)) for NumPy or JAX probability arrays `[..., V]` -> `[...]`."""
  return np.asarray(speculative.acceptance_overlap(jnp.asarray(target_probs),
                                                   jnp.asarray(draft_probs)))


# ----------------------------------------------------------------------------------------------
# Corollary 3.6 on target-generated text


@dataclasses.dataclass(frozen=True)
class Reference:
  """Text generated by the target, on which α is measured.

  Attributes:
    prompts: `[R, P]` int32 right-padded prompts.
    prompt_lengths: `[R]` int32.
    tokens: `[R, T]` int32 generated tokens.
    lengths: `[R]` int32 generated tokens per row (shorter than T after an end token).
  """

  prompts: np.ndarray
  prompt_lengths: np.ndarray
  tokens: np.ndarray
  lengths: np.ndarray

  @property
  def num_tokens(self) -> int:
    return int(self.lengths.sum())


def random_prompts(vocab_size: int, num_rows: int, length: int, seed: int = 0,
                   low: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """`num_rows` prompts of uniformly random token ids in [low, vocab_size), all `length` long."""
  rng = np.random.default_rng(seed)
  prompts = rng.integers(low, vocab_size, size=(num_rows, length), dtype=np.int64)
  return prompts.astype(np.int32), np.full((num_rows,), length, np.int32)


def _batches(num_rows: int, batch_size: int):
  """(start, stop) of each batch; the last is padded up to batch_size by the caller."""
  for start in range(0, num_rows, batch_size):
    yield start, min(start + batch_size, num_rows)


def _pad_rows(array: np.ndarray, rows: int) -> np.ndarray:
  """Repeats the last row so every batch has the same shape (one compilation)."""
  if array.shape[0] == rows:
    return array
  return np.concatenate([array, np.repeat(array[-1:], rows - array.shape[0], axis=0)])


def collect_reference(decode: Callable[[np.ndarray, np.ndarray, int], Any], prompts,
                      prompt_lengths, *, batch_size: int = 8) -> Reference:
  """The text `decode` writes for every prompt, `batch_size` rows a call, as a `Reference`.

  The last batch is padded up to `batch_size` by repeating its last row (one compilation for
  every batch); the padding rows are dropped from the result.

  Args:
    decode: `decode(prompts, prompt_lengths, index)` for batch number `index` (0, 1, …),
      taking `[B, P]` int32 prompts and `[B]` int32 lengths and returning a result with
      `tokens` `[B, T]` and `lengths` `[B]` (a `speclm.DecodeResult`).
    prompts: `[R, P]` right-padded prompt token ids.
    prompt_lengths: `[R]` prompt lengths.
    batch_size: B, rows per call.

  Returns:
    The `Reference`: the prompts and every row's generated tokens `[R, T]` and lengths `[R]`.
  """
  prompts = np.asarray(prompts, np.int32)
  prompt_lengths = np.asarray(prompt_lengths, np.int32)
  if batch_size < 1:
    raise ValueError(f'batch_size must be >= 1, got {batch_size}.')
  tokens, lengths = [], []
  for index, (start, stop) in enumerate(_batches(prompts.shape[0], batch_size)):
    size = min(batch_size, prompts.shape[0])
    result = decode(_pad_rows(prompts[start:stop], size),
                    _pad_rows(prompt_lengths[start:stop], size), index)
    tokens.append(np.asarray(result.tokens)[:stop - start])
    lengths.append(np.asarray(result.lengths)[:stop - start])
  return Reference(prompts=prompts, prompt_lengths=prompt_lengths,
                   tokens=np.concatenate(tokens).astype(np.int32),
                   lengths=np.concatenate(lengths).astype(np.int32))


def _teacher_forced_logits(definition: protocol.LanguageModel, params, prompts, prompt_lengths,
                           tokens):
  """`[B, T, V]` logits predicting tokens[:, t] from the prompt and tokens[:, :t].

  For a decoder-only model `prefill` + one `extend` is a full teacher-forced pass; for an
  encoder-decoder the same two calls run the encoder and teacher-force the decoder.
  """
  batch, num_tokens = tokens.shape
  capacity = int(definition.prefix_length(prompts.shape[1])) + num_tokens
  cache = definition.init_cache(batch, capacity)
  first, cache = definition.prefill(params, prompts, prompt_lengths, cache)
  rest, _ = definition.extend(params, tokens[:, :-1], cache) if num_tokens > 1 else (None, None)
  if rest is None:
    return first[:, None]
  return jnp.concatenate([first[:, None], rest], axis=1)


def _teacher_forced_with_features(target_def, draft_def, target_params, draft_params, prompts,
                                  prompt_lengths, tokens):
  """(target logits `[B, T, V]` predicting tokens[:, t], feature-conditioned draft logits
  `[B, T−1, V]` predicting tokens[:, 1:]).

  The draft reads the target's feature of the position before each of its input tokens, as the
  decode loop hands them over for the first proposal of a round (the loop's later proposals
  read the draft's own predicted features instead). Token 0 comes from the target's prefill and
  is never drafted, so the draft has no prediction for it.
  """
  batch, num_tokens = tokens.shape
  capacity = prompts.shape[1] + num_tokens
  cache = target_def.init_cache(batch, capacity)
  first, prompt_features, cache = target_def.prefill_with_features(target_params, prompts,
                                                                   prompt_lengths, cache)
  rest, token_features, _ = target_def.extend_with_features(target_params, tokens[:, :-1], cache)
  # The draft's input k is fed the feature of position k−1 (zeros before the prompt's first).
  before_prompt = jnp.pad(prompt_features[:, :-1], ((0, 0), (1, 0), (0, 0)))
  last_prompt = jnp.take_along_axis(prompt_features, (prompt_lengths - 1)[:, None, None], axis=1)
  before_tokens = jnp.concatenate([last_prompt, token_features[:, :-1]], axis=1)
  draft_cache = draft_def.init_cache(batch, capacity)
  draft_cache = draft_def.prefill_with_features(draft_params, prompts, prompt_lengths,
                                                before_prompt, draft_cache)
  draft_logits, _, _ = draft_def.extend_with_features(draft_params, tokens[:, :-1],
                                                      before_tokens, draft_cache)
  return jnp.concatenate([first[:, None], rest], axis=1), draft_logits


@functools.partial(jax.jit, static_argnums=(0, 1), static_argnames=('sampling',))
def _teacher_forced_beta(target_def, draft_def, target_params, draft_params, prompts,
                         prompt_lengths, tokens, *, sampling):
  """`[B, T]` β; NaN at token 0 for a feature-conditioned draft, which never drafts it."""
  if isinstance(draft_def, protocol.FeatureConditionedDraft):
    target_logits, draft_logits = _teacher_forced_with_features(
        target_def, draft_def, target_params, draft_params, prompts, prompt_lengths, tokens)
    p = sampling_lib.standardize(target_logits[:, 1:], sampling)
    q = sampling_lib.standardize(draft_logits, sampling)
    beta = speculative.acceptance_overlap(p, q)
    return jnp.pad(beta, ((0, 0), (1, 0)), constant_values=jnp.nan)
  p = sampling_lib.standardize(
      _teacher_forced_logits(target_def, target_params, prompts, prompt_lengths, tokens), sampling)
  q = sampling_lib.standardize(
      _teacher_forced_logits(draft_def, draft_params, prompts, prompt_lengths, tokens), sampling)
  return speculative.acceptance_overlap(p, q)  # [B, T]


def beta_along(target: protocol.Model, draft: protocol.Model, reference: Reference, *,
               sampling: sampling_lib.SamplingConfig, batch_size: int = 8
               ) -> tuple[np.ndarray, np.ndarray]:
  """β at every generated position of `reference`: (`[R, T]` float64, `[R, T]` bool mask).

  β[i, t] = Σ_x min(p̃(x), q̃(x)) for the distributions of token t of row i given its prompt and
  tokens[i, :t], both standardized with `sampling` exactly as the decode loops do.

  A feature-conditioned (EAGLE-style) draft reads the target's true features at every
  position: its β is that of a round's first proposal. Its token 0 is masked out (NaN), since
  the target's prefill draws that token and no draft ever proposes it.
  """
  if draft.vocab_size != target.vocab_size:
    raise ValueError(f'The draft and target vocabularies differ ({draft.vocab_size} vs'
                     f' {target.vocab_size}); β compares them token by token.')
  target = protocol.target_for_feature_draft(target, draft)
  if (isinstance(draft.definition, protocol.FeatureConditionedDraft)
      and reference.tokens.shape[1] < 2):
    raise ValueError('β of a feature-conditioned draft needs at least 2 tokens per row (token 0'
                     ' is never drafted).')
  num_rows = reference.tokens.shape[0]
  out = []
  for start, stop in _batches(num_rows, batch_size):
    size = min(batch_size, num_rows)
    beta = _teacher_forced_beta(
        target.definition, draft.definition, target.params, draft.params,
        jnp.asarray(_pad_rows(reference.prompts[start:stop], size)),
        jnp.asarray(_pad_rows(reference.prompt_lengths[start:stop], size)),
        jnp.asarray(_pad_rows(reference.tokens[start:stop], size)), sampling=sampling)
    out.append(np.asarray(beta, np.float64)[:stop - start])
  beta = np.concatenate(out)
  mask = (np.arange(beta.shape[1])[None, :] < reference.lengths[:, None]) & ~np.isnan(beta)
  return beta, mask


@dataclasses.dataclass(frozen=True)
class AlphaEstimate:
  """Corollary 3.6 on target-generated text: the summary, and the data behind it.

  Attributes:
    summary: α, DLK, the β histogram and autocorrelation (`summarize_beta`).
    reference: the target-generated text β was measured along.
    beta: `[R, T]` β = Σ_x min(p̃, q̃) at each of the R rows' T positions.
    mask: `[R, T]` True where a position holds a generated token (β there counts).
    sampling: the standardization p̃ and q̃ were computed with.
  """

  summary: BetaSummary
  reference: Reference
  beta: np.ndarray  # [R, T]
  mask: np.ndarray  # [R, T]
  sampling: sampling_lib.SamplingConfig

  @property
  def alpha(self) -> float:
    return self.summary.alpha


# ----------------------------------------------------------------------------------------------
# Greedy rounds replayed on a β sequence


@dataclasses.dataclass(frozen=True)
class GreedyReplay:
  """What `speculative_decode` must record at temperature 0, derived from β alone.

  Attributes:
    beta_sum, beta_count: Σ β and the number of drafted positions the sequence reached.
    accepted_histogram: `[γ+1]` rounds that accepted n = 0 … γ drafts.
    target_calls: prefill + one per round.
  """

  beta_sum: float
  beta_count: int
  accepted_histogram: np.ndarray
  target_calls: int

  @property
  def alpha(self) -> float:
    return self.beta_sum / self.beta_count if self.beta_count else float('nan')


def greedy_round_replay(beta, num_new_tokens, gamma: int) -> GreedyReplay:
  """Replays Algorithm 1's rounds at temperature 0 on teacher-forced β `[T]` or `[R, T]`.

  At temperature 0, p̃ and q̃ are one-hot, β ∈ {0, 1}, and the draft's guess at a position is
  accepted exactly when β = 1 there; since both models follow the target's argmax text, the
  whole run is determined by β along the target's greedy text. β[t] is the overlap for
  generated token t (token 0 comes from the target's prefill and is never drafted). Each round
  drafts positions C … C+γ−1, accepts the leading run of β = 1 (n of them), and the loop counts
  β at the positions it reached, C … C+min(n+1, γ)−1; then C advances by n+1. A row stops once
  it has `num_new_tokens` tokens, so β must cover num_new_tokens + γ − 1 positions (the last
  round may look past the limit).
  """
  beta = np.asarray(beta, np.float64)
  beta = beta[None] if beta.ndim == 1 else beta
  limits = np.broadcast_to(np.asarray(num_new_tokens), (beta.shape[0],))
  if beta.shape[1] < int(limits.max()) + gamma - 1:
    raise ValueError(f'β covers {beta.shape[1]} positions; replaying {int(limits.max())} new'
                     f' tokens with γ = {gamma} needs {int(limits.max()) + gamma - 1}.')
  accepted = beta > 0.5
  total, count, calls = 0.0, 0, 0
  histogram = np.zeros(gamma + 1, np.int64)
  for row in range(beta.shape[0]):
    calls += 1  # prefill, which yields token 0
    position = 1
    while position < limits[row]:
      run = accepted[row, position:position + gamma]
      n = int(np.argmin(run)) if not run.all() else gamma
      reached = min(n + 1, gamma)
      total += float(beta[row, position:position + reached].sum())
      count += reached
      histogram[n] += 1
      calls += 1
      position += n + 1
  return GreedyReplay(beta_sum=total, beta_count=count, accepted_histogram=histogram,
                      target_calls=calls)


# ----------------------------------------------------------------------------------------------
# Records of c and r and of a measured speedup (timed by `speclm.run.calibration`)


@dataclasses.dataclass(frozen=True)
class CostEstimate:
  """Median seconds per call and the ratios the walltime formulas take.

  Attributes:
    draft_step_seconds: one draft call on K = 1 token.
    target_step_seconds: one target call on K = 1 token (a baseline decode step).
    target_verify_seconds: one target call on K = γ+1 tokens (a verification).
    c: draft_step / target_step (Definition 3.7).
    r: target_verify / target_step (1 in the paper's idealisation).
    gamma, batch_size, context_length: what was timed.
  """

  draft_step_seconds: float
  target_step_seconds: float
  target_verify_seconds: float
  gamma: int
  batch_size: int
  context_length: int

  @property
  def c(self) -> float:
    return self.draft_step_seconds / self.target_step_seconds

  @property
  def r(self) -> float:
    return self.target_verify_seconds / self.target_step_seconds

  def to_dict(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), 'c': self.c, 'r': self.r}


@dataclasses.dataclass(frozen=True)
class SpeedupMeasurement:
  """Walltime of the baseline and of speculative decoding on the same prompts.

  Attributes:
    autoregressive_seconds, speculative_seconds: medians over repeats (after compilation).
    num_tokens: tokens generated per decode (all rows).
    alpha: α from the speculative decode's statistics (`DecodeStats.alpha`).
    tokens_per_target_call: of the speculative decode (the baseline's is 1).
    accepted_histogram: `[γ+1]` rounds that accepted n = 0 … γ drafts.
    outputs_match: whether the two decodes produced the same tokens (expected at temperature 0).
  """

  autoregressive_seconds: float
  speculative_seconds: float
  num_tokens: int
  alpha: float
  tokens_per_target_call: float
  accepted_histogram: np.ndarray
  outputs_match: bool

  @property
  def speedup(self) -> float:
    return self.autoregressive_seconds / self.speculative_seconds

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out['accepted_histogram'] = self.accepted_histogram.tolist()
    out['speedup'] = self.speedup
    return out
