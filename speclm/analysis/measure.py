"""Measuring what the theory needs: α (and DLK, the β distribution), c and r, real speedups.

α (Corollary 3.6). The paper lets the target M_p generate text (10,000 tokens) and averages,
over every position of it, β = Σ_x min(p̃(x), q̃(x)) = 1 − DLK(p̃, q̃), where p̃ and q̃ are the
target's and draft's *standardized* distributions (same temperature / top-k / top-p as the
decode) given the same prefix. `estimate_alpha` does exactly that: `autoregressive_decode`
generates the reference text; one teacher-forced pass of each model (through the protocol:
`prefill` of the prompt, then one `extend` with all generated tokens) gives p̃ and q̃ at every
position. The same β sequence also gives the β histogram and its autocorrelation along the
text, i.e. how far the i.i.d. assumption behind Eq. (1) holds.

c and r. `measure_costs` compiles three calls with `jax.jit` — a draft decode step (extend with
K = 1), a target decode step (K = 1) and a target verification (K = γ+1) — runs each many times
inside one compiled loop (as the decode loops do, so Python dispatch is not counted; the count
is raised until a sample lasts ≥ 50 ms, as shorter ones are mostly scheduler noise), and
reports medians over repeats after a warm-up call, timing the three in turn within each
repeat so that a busy machine slows them alike:
  c = T_draft(1) / T_target(1)   (Definition 3.7),   r = T_target(γ+1) / T_target(1).

Shape letters: R reference rows, B batch, P prompt length, T generated tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from speclm import adaptive
from speclm import decoding
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import speculative
from speclm import token_trees
from speclm.analysis import benchmarking

# ----------------------------------------------------------------------------------------------
# α from a decode's own statistics (the pooled α is `DecodeStats.alpha`)


def alpha_per_row_from_stats(stats: decoding.DecodeStats) -> np.ndarray:
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


def generate_reference(target: protocol.Model, prompts, prompt_lengths, *,
                       tokens_per_row: int, sampling: sampling_lib.SamplingConfig,
                       seed: int = 0, batch_size: int = 8, eos_id: int | None = None
                       ) -> Reference:
  """Lets the target continue every prompt by `tokens_per_row` tokens, `batch_size` rows a call.

  Uses `speclm.autoregressive_decode` with the given sampling, so the text follows M_p. Each
  batch gets its own seed (seed + batch index).
  """
  prompts = np.asarray(prompts, np.int32)
  prompt_lengths = np.asarray(prompt_lengths, np.int32)
  if batch_size < 1:
    raise ValueError(f'batch_size must be >= 1, got {batch_size}.')
  tokens, lengths = [], []
  for index, (start, stop) in enumerate(_batches(prompts.shape[0], batch_size)):
    size = min(batch_size, prompts.shape[0])
    result = decoding.autoregressive_decode(
        target, _pad_rows(prompts[start:stop], size), _pad_rows(prompt_lengths[start:stop], size),
        sampling=sampling, max_new_tokens=tokens_per_row, seed=seed + index, eos_id=eos_id)
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
  """Corollary 3.6 on target-generated text: the summary, and the data behind it."""

  summary: BetaSummary
  reference: Reference
  beta: np.ndarray  # [R, T]
  mask: np.ndarray  # [R, T]
  sampling: sampling_lib.SamplingConfig

  @property
  def alpha(self) -> float:
    return self.summary.alpha


def estimate_alpha(target: protocol.Model, draft: protocol.Model, prompts, prompt_lengths, *,
                   tokens_per_row: int, sampling: sampling_lib.SamplingConfig,
                   seed: int = 0, batch_size: int = 8, bins: int = 20, max_lag: int = 10,
                   eos_id: int | None = None) -> AlphaEstimate:
  """α per Corollary 3.6: the target writes the text, both models are scored on all of it.

  The amount of text is rows × tokens_per_row; the paper uses 10,000 tokens.
  """
  reference = generate_reference(target, prompts, prompt_lengths, tokens_per_row=tokens_per_row,
                                 sampling=sampling, seed=seed, batch_size=batch_size,
                                 eos_id=eos_id)
  beta, mask = beta_along(target, draft, reference, sampling=sampling, batch_size=batch_size)
  return AlphaEstimate(summary=summarize_beta(beta, mask, bins=bins, max_lag=max_lag),
                       reference=reference, beta=beta, mask=mask, sampling=sampling)


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
# c and r


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


def _token_calls(definition):
  """(prefill, extend) of `definition` taking tokens only, as the timed calls need them. A
  `protocol.FeatureConditionedDraft` is given zero features of its input width (those a
  round's first proposal reads, the target's; their values do not change the cost)."""
  if not isinstance(definition, protocol.FeatureConditionedDraft):
    return definition.prefill, definition.extend

  def zeros(tokens):
    return jnp.zeros(tokens.shape + (definition.feature_dim,), jnp.float32)

  def prefill(params, inputs, input_lengths, cache):
    cache = definition.prefill_with_features(params, inputs, input_lengths, zeros(inputs), cache)
    return None, cache

  def extend(params, tokens, cache):
    logits, _, cache = definition.extend_with_features(params, tokens, zeros(tokens), cache)
    return logits, cache

  return prefill, extend


@functools.partial(jax.jit, static_argnums=0)
def _prefill(definition, params, inputs, input_lengths, cache):
  """`prefill` of `definition`, compiled once per definition and shapes (a `jax.jit` made per
  call compiled it again for every measurement)."""
  return _token_calls(definition)[0](params, inputs, input_lengths, cache)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _repeated_extend(definition, params, tokens, cache, num_steps, tree_parents=None):
  """Runs `extend` num_steps times from the same cache length (the decode loops' inner call),
  or `extend_tree` over the token tree of `tree_parents` (a static tuple).

  `num_steps` is traced, so calibrating it does not recompile.
  """
  start_lengths = definition.cache_lengths(cache)
  layout = None
  if tree_parents is not None:
    layout = token_trees.layout(np.tile(np.asarray(tree_parents), (tokens.shape[0], 1)))

  _, extend = _token_calls(definition)

  def body(_, carry):
    cache, tokens, checksum = carry
    if layout is None:
      logits, cache = extend(params, tokens, cache)
    else:
      logits, cache = definition.extend_tree(params, tokens, layout, cache)
    cache = definition.rollback(cache, start_lengths)  # what a rejected round does
    tokens = (tokens + 1) % definition.vocab_size
    return cache, tokens, checksum + jnp.sum(logits)  # the sum keeps every logit live

  _, _, checksum = jax.lax.fori_loop(0, num_steps, body, (cache, tokens, jnp.float32(0)))
  return checksum


@dataclasses.dataclass(frozen=True)
class _Runner:
  """A compiled, warmed-up call of `extend`, repeated `num_steps` times per run."""

  run: Any
  num_steps: int


def _extend_runner(model: protocol.Model, *, num_new: int, batch_size: int,
                   context_length: int, num_steps: int, min_sample_seconds: float,
                   seed: int, tree_parents: tuple[int, ...] | None = None) -> _Runner:
  """Compiles and warms up `extend` on `num_new` tokens, then raises num_steps until one run
  lasts at least `min_sample_seconds` (short samples are mostly scheduler noise)."""
  if min(num_new, batch_size, context_length, num_steps) < 1:
    raise ValueError('num_new, batch_size, context_length and num_steps must all be >= 1.')
  definition = model.definition
  prompts, lengths = random_prompts(model.vocab_size, batch_size, context_length, seed)
  prefix = int(definition.prefix_length(context_length))
  cache = definition.init_cache(batch_size, prefix + num_new)
  _, cache = _prefill(definition, model.params, jnp.asarray(prompts), jnp.asarray(lengths),
                      cache)
  tokens = jnp.asarray(np.resize(prompts[:, ::-1], (batch_size, num_new)))
  run = lambda steps: _repeated_extend(definition, model.params, tokens, cache,
                                       jnp.int32(steps), tree_parents)
  run(num_steps).block_until_ready()  # compile and warm up
  for _ in range(8):
    start = time.perf_counter()
    run(num_steps).block_until_ready()
    elapsed = time.perf_counter() - start
    if elapsed >= min_sample_seconds:
      break
    num_steps = int(math.ceil(num_steps * min(16.0, 1.2 * min_sample_seconds /
                                              max(elapsed, 1e-6))))
  return _Runner(run=functools.partial(run, num_steps), num_steps=num_steps)


def _median_per_step(seconds: list[float], num_steps: int = 1) -> float:
  """The median over repeats of one sample's seconds divided by the calls it made."""
  return float(np.median([s / num_steps for s in seconds]))


def time_extend(model: protocol.Model, *, num_new: int, batch_size: int = 1,
                context_length: int = 64, num_steps: int = 20, repeats: int = 5,
                min_sample_seconds: float = 0.05, seed: int = 0, tree=None) -> float:
  """Median seconds of one `extend` call on `num_new` tokens after `context_length` positions
  (with a `token_trees.TreeShape` `tree`: one `extend_tree` call over its nodes, `num_new`
  then being their count, the root included).

  The cache is prefilled with random tokens; the call is compiled and warmed up, then timed
  `repeats` times, each sample running it at least `num_steps` times (more if needed to last
  `min_sample_seconds`) inside one compiled loop.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  if tree is not None and num_new != len(tree.parents):
    raise ValueError(f'num_new must be the tree\'s {len(tree.parents)} nodes, got {num_new}.')
  runner = _extend_runner(model, num_new=num_new, batch_size=batch_size,
                          context_length=context_length, num_steps=num_steps,
                          min_sample_seconds=min_sample_seconds, seed=seed,
                          tree_parents=None if tree is None else tree.parents)
  (seconds,) = benchmarking.interleaved_rounds([lambda _: runner.run()], repeats)
  return _median_per_step(seconds, runner.num_steps)


def time_tree_verifications(target: protocol.Model, trees, *, batch_size: int = 1,
                            context_length: int = 64, num_steps: int = 20, repeats: int = 5,
                            min_sample_seconds: float = 0.05, seed: int = 0) -> list[float]:
  """r of each `token_trees.TreeShape` in `trees`: one target `extend_tree` call over its
  nodes / one 1-token `extend` call.

  The 1-token call and every tree's call are timed in turn within each repeat
  (`benchmarking.interleaved_rounds`), and each r is the median of its per-repeat ratios, so
  a slow spell of a shared machine shifts numerator and denominator alike.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  common = dict(batch_size=batch_size, context_length=context_length, num_steps=num_steps,
                min_sample_seconds=min_sample_seconds, seed=seed)
  runners = [_extend_runner(target, num_new=1, **common)] + [
      _extend_runner(target, num_new=len(tree.parents), tree_parents=tree.parents, **common)
      for tree in trees]
  seconds = benchmarking.interleaved_rounds([lambda _, r=r: r.run() for r in runners], repeats)
  per_call = [[s / r.num_steps for s in samples] for samples, r in zip(seconds, runners)]
  return [float(np.median([t / o for t, o in zip(samples, per_call[0])]))
          for samples in per_call[1:]]


def measure_costs(target: protocol.Model, draft: protocol.Model, *, gamma: int,
                  batch_size: int = 1, context_length: int = 64, num_steps: int = 20,
                  repeats: int = 5, min_sample_seconds: float = 0.05,
                  seed: int = 0) -> CostEstimate:
  """c and r for these models, this batch size and context length, on the default device.

  The three calls are timed in turn within each repeat (`benchmarking.interleaved_rounds`);
  each sample repeats a call at least `num_steps` times and lasts at least
  `min_sample_seconds`.
  """
  if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
    raise ValueError(f'gamma must be an integer >= 1, got {gamma!r}.')
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  kwargs = dict(batch_size=batch_size, context_length=context_length, num_steps=num_steps,
                min_sample_seconds=min_sample_seconds, seed=seed)
  runners = [_extend_runner(draft, num_new=1, **kwargs),
             _extend_runner(target, num_new=1, **kwargs),
             _extend_runner(target, num_new=gamma + 1, **kwargs)]
  seconds = benchmarking.interleaved_rounds([lambda _, r=r: r.run() for r in runners], repeats)
  draft_step, target_step, target_verify = (
      _median_per_step(s, r.num_steps) for s, r in zip(seconds, runners))
  return CostEstimate(draft_step_seconds=draft_step, target_step_seconds=target_step,
                      target_verify_seconds=target_verify, gamma=int(gamma),
                      batch_size=batch_size, context_length=context_length)


def measure_verify_costs(target: protocol.Model, draft: protocol.Model, *, max_gamma: int,
                         batch_size: int = 1, context_length: int = 64, num_steps: int = 8,
                         repeats: int = 3, min_sample_seconds: float = 0.05,
                         seed: int = 0) -> tuple[float, tuple[float, ...]]:
  """c and r(0) … r(γ_max) for `adaptive.AdaptiveGamma`: one draft step, and target calls of
  1 … γ_max+1 tokens, each over a one-token target call (r(0) = 1). Timed as
  `measure_costs` times its three calls, all interleaved within each repeat."""
  if isinstance(max_gamma, bool) or not isinstance(max_gamma, (int, np.integer)) or max_gamma < 1:
    raise ValueError(f'max_gamma must be an integer >= 1, got {max_gamma!r}.')
  kwargs = dict(batch_size=batch_size, context_length=context_length, num_steps=num_steps,
                min_sample_seconds=min_sample_seconds, seed=seed)
  runners = [_extend_runner(draft, num_new=1, **kwargs)] + [
      _extend_runner(target, num_new=k, **kwargs) for k in range(1, max_gamma + 2)]
  seconds = benchmarking.interleaved_rounds([lambda _, r=r: r.run() for r in runners], repeats)
  per_call = [_median_per_step(s, r.num_steps) for s, r in zip(seconds, runners)]
  step = per_call[1]
  # A wider call never costs less: a noisy sample that says so is lifted to the one before.
  verify = np.maximum.accumulate([t / step for t in per_call[1:]])
  return per_call[0] / step, tuple(float(r) for r in verify)


# How long `measure_round_costs` times each γ by default: new tokens per decode, and
# interleaved repeats. `measure_adaptive_gamma` caches other settings under their own key.
ROUND_COST_TOKENS = 32
ROUND_COST_REPEATS = 3


def _forcing_rule(max_gamma: int, gamma: int, max_skip: int) -> adaptive.AdaptiveGamma:
  """An adaptive rule that chooses `gamma` every round: every other width is priced at 10⁶
  target steps (and drafting at nothing), so no running α can make another width win."""
  costs = [1e6] * (max_gamma + 1)
  costs[gamma] = 1.0
  return adaptive.AdaptiveGamma(max_gamma=max_gamma, draft_cost=0.0, verify_costs=tuple(costs),
                                max_skip=max_skip)


def measure_round_costs(target: protocol.Model, draft: protocol.Model, *, max_gamma: int,
                        batch_size: int = 1, context_length: int = 64,
                        num_new_tokens: int = ROUND_COST_TOKENS,
                        repeats: int = ROUND_COST_REPEATS, max_skip: int = 3,
                        seed: int = 0) -> tuple[float, tuple[float, ...]]:
  """c and r(0) … r(γ_max) for `adaptive.AdaptiveGamma`, with r timed on whole rounds.

  Timing the (γ+1)-token target call alone (`measure_verify_costs`) leaves out what else a
  round does: the draft's γ calls through the loop, the acceptance test over the vocabulary,
  sampling, appending, the width switch. Here the adaptive loop itself runs, made to choose
  γ every round (`_forcing_rule`), for γ = 0 … γ_max, beside the baseline loop, on
  `batch_size` random prompts of `context_length` tokens and `num_new_tokens` new ones, all
  interleaved within each of `repeats` rounds. The prompt's prefill (timed alone; the
  draft's, where it reads the prompt, is taken as c times the target's) is subtracted, the rest divided by the rounds
  the loop made (`DecodeStats.target_calls` − 1) and by the baseline's time per token. That
  gives each round's full cost in target steps; the rule's draft calls are taken off it (γ·c,
  and for γ = 0 nothing, or c when max_skip = 0) so that `AdaptiveGamma.round_cost(γ)`
  returns the measured round cost. r(0) > 1 then holds the γ = 0 round's overhead over a plain step.

  The forced rules differ only in their costs, which reach the loop as an array, so the
  γ_max + 1 runs share one compilation (the baseline and the prefill have their own);
  `measure_adaptive_gamma` caches the result per machine.
  """
  if isinstance(max_gamma, bool) or not isinstance(max_gamma, (int, np.integer)) or max_gamma < 1:
    raise ValueError(f'max_gamma must be an integer >= 1, got {max_gamma!r}.')
  if min(batch_size, context_length, num_new_tokens, repeats) < 1:
    raise ValueError('batch_size, context_length, num_new_tokens and repeats must all be >= 1.')
  if isinstance(draft.definition, protocol.FeatureConditionedDraft):
    max_skip = 0  # it reads the target's features every round (as `speculative_decode` sets)
  draft_runner = _extend_runner(draft, num_new=1, batch_size=batch_size,
                                context_length=context_length, num_steps=8,
                                min_sample_seconds=0.05, seed=seed)
  prompts, lengths = random_prompts(target.vocab_size, batch_size, context_length, seed)
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
  common = dict(sampling=sampling_lib.GREEDY, max_new_tokens=num_new_tokens, seed=seed)
  cache = target.definition.init_cache(batch_size,
                                       context_length + num_new_tokens + max_gamma + 2)
  prefill = jax.jit(target.definition.prefill)
  # γ = 0 too runs the adaptive loop's rounds (`speculative_decode` would run the baseline for
  # a rule that never drafts): r(0) prices a γ = 0 round between drafting ones.
  loops = [functools.partial(decoding._speculative_decode, target, draft, prompts, lengths,
                             gamma=_forcing_rule(max_gamma, gamma, max_skip),
                             baseline_if_never_drafting=False, **common)
           for gamma in range(max_gamma + 1)]
  runs = [draft_runner.run,
          lambda: prefill(target.params, prompts, lengths, cache)[0],
          lambda: decoding.autoregressive_decode(target, prompts, lengths, **common).tokens,
          *[lambda loop=loop: loop().tokens for loop in loops]]
  jax.block_until_ready(runs[1]())  # compile and warm up (the draft runner already is)
  jax.block_until_ready(runs[2]())
  rounds = [int(loop().stats.target_calls) - 1 for loop in loops]  # also warms them up
  seconds = benchmarking.interleaved_rounds([lambda _, run=run: run() for run in runs], repeats)
  draft_s, prefill_s, baseline_s, *loop_s = (float(np.median(s)) for s in seconds)
  step = max(baseline_s - prefill_s, 1e-9) / num_new_tokens  # one baseline token
  c = draft_s / draft_runner.num_steps / step
  verify = []
  for gamma, (total, num_rounds) in enumerate(zip(loop_s, rounds)):
    # The draft reads the prompt once (in its first drafting round when it may sit out).
    draft_prefill = c * prefill_s if (gamma or not max_skip) else 0.0
    round_steps = (total - prefill_s - draft_prefill) / max(num_rounds, 1) / step
    draft_calls = gamma if gamma else (0.0 if max_skip else 1.0)
    verify.append(max(round_steps - draft_calls * c, 0.05))
  # A wider round never costs less: a noisy sample that says so is lifted to the one before.
  verify = [verify[0]] + list(np.maximum.accumulate(verify[1:]))
  return c, tuple(float(r) for r in verify)


# The modules whose code the timed rounds run: an edit to any of them (a change to the loop,
# the models or the kernel) makes the cached timings stale.
_TIMED_CODE = ('decoding.py', 'adaptive.py', 'speculative.py', 'sampling.py', 'protocol.py',
               'models', 'kernels')


@functools.lru_cache(maxsize=1)
def _timed_code_digest() -> str:
  """A digest of the source of `_TIMED_CODE` (in this installed copy of speclm)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for name in _TIMED_CODE:
    path = os.path.join(root, name)
    files = ([os.path.join(path, f) for f in sorted(os.listdir(path))
              if f.endswith(('.py', '.cc'))] if os.path.isdir(path) else [path])
    for file in files:
      digest.update(os.path.relpath(file, root).encode())
      with open(file, 'rb') as f:
        digest.update(f.read())
  return digest.hexdigest()[:16]


def _cost_cache_key(target, draft, max_gamma, batch_size, context_length, max_skip=3,
                    **timing) -> str:
  """What the timings depend on: this machine, the software (speclm's timed code included:
  `_TIMED_CODE`), the models' definitions and parameter shapes, the batch size, γ_max and the
  context (and `timing`, the timing's own settings where they are not the defaults)."""
  def shapes(model):
    return [(str(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(model.params)]
  description = json.dumps({
      'machine': [platform.machine(), platform.processor(), os.cpu_count(),
                  jax.default_backend(), [d.device_kind for d in jax.devices()]],
      'software': [jax.__version__, platform.python_version(), _timed_code_digest()],
      'target': [repr(target.definition), shapes(target)],
      'draft': [repr(draft.definition), shapes(draft)],
      'batch_size': batch_size, 'max_gamma': max_gamma, 'context_length': context_length,
      'max_skip': max_skip,
      'method': 'whole rounds',  # files from isolated call timings are not reused
      **({'timing': timing} if timing else {}),
  }, sort_keys=True)
  return hashlib.sha256(description.encode()).hexdigest()[:24]


def cost_cache_dir() -> str:
  """Where measured adaptive-γ costs are kept: `$SPECLM_COST_CACHE` or ~/.cache/speclm/costs."""
  return os.environ.get('SPECLM_COST_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'speclm', 'costs')


def measure_adaptive_gamma(target: protocol.Model, draft: protocol.Model, *, max_gamma: int,
                           batch_size: int = 1, context_length: int = 64,
                           use_cache: bool = True, num_new_tokens: int = ROUND_COST_TOKENS,
                           repeats: int = ROUND_COST_REPEATS,
                           **rule_kwargs) -> adaptive.AdaptiveGamma:
  """An `adaptive.AdaptiveGamma` rule with c and r(γ) timed for these models and batch size.

  The timings are cached (`cost_cache_dir()`, one JSON file per machine, model pair, batch size,
  γ_max and context; see `_cost_cache_key`), so a job measures them once per machine. A
  cache file that does not parse is measured again and rewritten. c and r are timed on whole
  rounds of the adaptive loop (`measure_round_costs`, with `num_new_tokens` and `repeats`; a
  shorter timing than the default, e.g. for a smoke run, is cached under its own key).
  `rule_kwargs` go to `AdaptiveGamma` (prior_alpha, prior_weight, decay, draft_stopping,
  max_skip).
  """
  max_skip = rule_kwargs.get('max_skip', 3)
  timing = {} if (num_new_tokens, repeats) == (ROUND_COST_TOKENS, ROUND_COST_REPEATS) else {
      'num_new_tokens': num_new_tokens, 'repeats': repeats}
  path = os.path.join(cost_cache_dir(), _cost_cache_key(target, draft, max_gamma, batch_size,
                                                        context_length, max_skip, **timing)
                      + '.json')
  costs = None
  if use_cache and os.path.exists(path):
    try:
      with open(path) as f:
        saved = json.load(f)
      costs = (float(saved['draft_cost']), tuple(float(r) for r in saved['verify_costs']))
      adaptive.AdaptiveGamma(max_gamma=max_gamma, draft_cost=costs[0], verify_costs=costs[1])
    except (OSError, ValueError, KeyError, TypeError):
      costs = None
  if costs is None:
    costs = measure_round_costs(target, draft, max_gamma=max_gamma, batch_size=batch_size,
                                context_length=context_length, max_skip=max_skip,
                                num_new_tokens=num_new_tokens, repeats=repeats)
    if use_cache:
      os.makedirs(path.rsplit(os.sep, 1)[0], exist_ok=True)
      temporary = f'{path}.{os.getpid()}.tmp'
      with open(temporary, 'w') as f:
        json.dump({'draft_cost': costs[0], 'verify_costs': list(costs[1]),
                   'batch_size': batch_size, 'max_gamma': max_gamma,
                   'context_length': context_length}, f, indent=1)
      os.replace(temporary, path)
  return adaptive.AdaptiveGamma(max_gamma=int(max_gamma), draft_cost=costs[0],
                                verify_costs=costs[1], **rule_kwargs)


# ----------------------------------------------------------------------------------------------
# Measured speedup


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


def measure_speedup(target: protocol.Model, draft: protocol.Model, prompts, prompt_lengths, *,
                    gamma: int, sampling: sampling_lib.SamplingConfig, max_new_tokens: int,
                    seed: int = 0, repeats: int = 3) -> SpeedupMeasurement:
  """Times `autoregressive_decode` and `speculative_decode` on the same batch of prompts.

  Both are compiled and run once first; then each repeat times one call of each, in turn
  (`benchmarking.interleaved_rounds`).
  """
  kwargs = dict(sampling=sampling, max_new_tokens=max_new_tokens, seed=seed)
  run_baseline = lambda: decoding.autoregressive_decode(target, prompts, prompt_lengths, **kwargs)
  run_speculative = lambda: decoding.speculative_decode(target, draft, prompts, prompt_lengths,
                                                        gamma=gamma, **kwargs)
  baseline = jax.block_until_ready(run_baseline())  # compile and warm up
  spec = jax.block_until_ready(run_speculative())
  ar_seconds, spec_seconds = (_median_per_step(s) for s in benchmarking.interleaved_rounds(
      [lambda _: run_baseline(), lambda _: run_speculative()], repeats))
  return SpeedupMeasurement(
      autoregressive_seconds=ar_seconds, speculative_seconds=spec_seconds,
      num_tokens=int(np.sum(np.asarray(spec.lengths))), alpha=spec.stats.alpha,
      tokens_per_target_call=spec.tokens_per_target_call,
      accepted_histogram=np.asarray(spec.stats.accepted_histogram),
      outputs_match=baseline.to_lists() == spec.to_lists())
