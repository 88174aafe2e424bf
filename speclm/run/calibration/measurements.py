"""Decodes run to measure a (target, draft) pair: α on the target's text, a timed speedup, and
the Table-4 report that puts them beside the theory.

  generate_reference  the target's own text (`autoregressive_decode`, batch by batch)
  estimate_alpha      α by Corollary 3.6 on that text (`speclm.analysis.measure.beta_along`)
  measure_speedup     the baseline against `speculative_decode` on one batch, interleaved
  run_report          all three with c and r (`costs.measure_costs`): one Table-4 row

These run decode loops, so they live beside the job, not in `speclm.analysis`, which explains
their records (`AlphaEstimate`, `SpeedupMeasurement`, `report.RunReport`) and formats them.
`python -m speclm.analysis alpha|cost|report` and the benchmark scripts call them.

Shape letters: R rows, B batch, P prompt length, T generated tokens.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from speclm import decoding
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm.analysis import benchmarking
from speclm.analysis import measure
from speclm.analysis import report
from speclm.analysis.measure import AlphaEstimate
from speclm.analysis.measure import Reference
from speclm.analysis.measure import SpeedupMeasurement
from speclm.run.calibration import costs as costs_lib


def generate_reference(target: protocol.Model, prompts, prompt_lengths, *,
                       tokens_per_row: int, sampling: sampling_lib.SamplingConfig,
                       seed: int = 0, batch_size: int = 8, eos_id: int | None = None
                       ) -> Reference:
  """Lets the target continue every prompt by `tokens_per_row` tokens, `batch_size` rows a call.

  Uses `speclm.autoregressive_decode` with the given sampling, so the text follows M_p. Each
  batch gets its own seed (seed + batch index).

  Args:
    target: M_p.
    prompts: `[R, P]` right-padded prompt token ids.
    prompt_lengths: `[R]` prompt lengths.
    tokens_per_row: T, new tokens per row (fewer where a row writes `eos_id`).
    sampling: how the target samples (its standardization, §2.2).
    seed: the first batch's seed.
    batch_size: B, rows per decode call (the last batch is padded to B).
    eos_id: the end token, or None.

  Returns:
    The `Reference`: prompts, generated tokens `[R, T]` and lengths `[R]`.
  """
  def decode(batch_prompts, batch_lengths, index):
    return decoding.autoregressive_decode(
        target, batch_prompts, batch_lengths, sampling=sampling, max_new_tokens=tokens_per_row,
        seed=seed + index, eos_id=eos_id)

  return measure.collect_reference(decode, prompts, prompt_lengths, batch_size=batch_size)


def estimate_alpha(target: protocol.Model, draft: protocol.Model, prompts, prompt_lengths, *,
                   tokens_per_row: int, sampling: sampling_lib.SamplingConfig,
                   seed: int = 0, batch_size: int = 8, bins: int = 20, max_lag: int = 10,
                   eos_id: int | None = None) -> AlphaEstimate:
  """α per Corollary 3.6: the target writes the text, both models are scored on all of it.

  The amount of text is rows × tokens_per_row; the paper uses 10,000 tokens.

  Args:
    target, draft: M_p and M_q (the same vocabulary).
    prompts: `[R, P]` right-padded prompt token ids.
    prompt_lengths: `[R]` prompt lengths.
    tokens_per_row: T, tokens the target writes per row (`generate_reference`).
    sampling: the decode's sampling; p̃ and q̃ are standardized with it.
    seed, batch_size, eos_id: as in `generate_reference` (batch_size also for the scoring).
    bins, max_lag: the β histogram's bins and the autocorrelation's lags
      (`measure.summarize_beta`).

  Returns:
    The `AlphaEstimate`: the β summary and the reference text, β `[R, T]` and mask `[R, T]`.
  """
  reference = generate_reference(target, prompts, prompt_lengths, tokens_per_row=tokens_per_row,
                                 sampling=sampling, seed=seed, batch_size=batch_size,
                                 eos_id=eos_id)
  beta, mask = measure.beta_along(target, draft, reference, sampling=sampling,
                                  batch_size=batch_size)
  return AlphaEstimate(summary=measure.summarize_beta(beta, mask, bins=bins, max_lag=max_lag),
                       reference=reference, beta=beta, mask=mask, sampling=sampling)


def measure_speedup(target: protocol.Model, draft: protocol.Model, prompts, prompt_lengths, *,
                    gamma: int, sampling: sampling_lib.SamplingConfig, max_new_tokens: int,
                    seed: int = 0, repeats: int = 3) -> SpeedupMeasurement:
  """Times `autoregressive_decode` and `speculative_decode` on the same batch of prompts.

  Both are compiled and run once first; then each repeat times one call of each, in turn
  (`benchmarking.interleaved_rounds`).

  Args:
    target, draft: M_p and M_q.
    prompts: `[B, P]` right-padded prompt token ids (one batch).
    prompt_lengths: `[B]` prompt lengths.
    gamma: γ of the speculative decode.
    sampling, max_new_tokens, seed: as in both decodes.
    repeats: timed calls of each; the medians are kept.

  Returns:
    The `SpeedupMeasurement` (walltimes, α and tokens per target call of the speculative
    decode, whether the two outputs match).
  """
  kwargs = dict(sampling=sampling, max_new_tokens=max_new_tokens, seed=seed)
  run_baseline = lambda: decoding.autoregressive_decode(target, prompts, prompt_lengths, **kwargs)
  run_speculative = lambda: decoding.speculative_decode(target, draft, prompts, prompt_lengths,
                                                        gamma=gamma, **kwargs)
  baseline = jax.block_until_ready(run_baseline())  # compile and warm up
  spec = jax.block_until_ready(run_speculative())
  ar_seconds, spec_seconds = (
      costs_lib.median_per_step(s) for s in benchmarking.interleaved_rounds(
          [lambda _: run_baseline(), lambda _: run_speculative()], repeats))
  return SpeedupMeasurement(
      autoregressive_seconds=ar_seconds, speculative_seconds=spec_seconds,
      num_tokens=int(np.sum(np.asarray(spec.lengths))), alpha=spec.stats.alpha,
      tokens_per_target_call=spec.tokens_per_target_call,
      accepted_histogram=np.asarray(spec.stats.accepted_histogram),
      outputs_match=baseline.to_lists() == spec.to_lists())


def run_report(target: protocol.Model, draft: protocol.Model, *, name: str, gamma: int,
               sampling: sampling_lib.SamplingConfig, alpha_tokens: int = 10_000,
               tokens_per_row: int = 128, batch_size: int = 8, prompt_length: int = 8,
               max_new_tokens: int = 128, repeats: int = 3, seed: int = 0, bins: int = 20,
               max_lag: int = 10, prompts: tuple[np.ndarray, np.ndarray] | None = None,
               eos_id: int | None = None) -> report.RunReport:
  """Measures α (Cor. 3.6), c, r and the real speedup for one (target, draft, γ, sampling).

  Without `prompts`, α uses ceil(alpha_tokens / tokens_per_row) random prompts and the speedup
  is timed on one batch of `batch_size` random prompts (seeded differently). With `prompts`
  (e.g. a gin job's dataset), α uses all of them and the speedup their first `batch_size`.
  Each row gets `max_new_tokens` new tokens; c and r are timed at the same batch size, after
  prompt_length + max_new_tokens/2 positions (a typical mid-generation context).

  Args:
    target, draft: M_p and M_q.
    name: the report row's label.
    gamma: γ of the timed speculative decode and of r.
    sampling: the decodes' sampling (and α's standardization).
    alpha_tokens, tokens_per_row: how much target text α is measured on, and per row.
    batch_size: B, rows per decode call (α, c and r, the speedup).
    prompt_length: P of the random prompts (ignored with `prompts`).
    max_new_tokens: new tokens per row in the timed decodes.
    repeats: timed repeats of the speedup (at least 3 for c and r).
    seed: seeds prompts, sampling and timing inputs.
    bins, max_lag: of the β summary.
    prompts: optional (tokens `[N, P]`, lengths `[N]`) to use instead of random prompts.
    eos_id: the end token of the α text, or None.

  Returns:
    The `report.RunReport`: the Table-4 row and the measurements behind it.
  """
  if prompts is None:
    rows = math.ceil(alpha_tokens / tokens_per_row)
    alpha_prompts = measure.random_prompts(target.vocab_size, rows, prompt_length, seed)
    speed_prompts = measure.random_prompts(target.vocab_size, batch_size, prompt_length,
                                           seed + 1)
  else:
    alpha_prompts = prompts
    speed_prompts = tuple(np.asarray(x)[:batch_size] for x in prompts)
    prompt_length = int(np.max(prompts[1]))
  alpha = estimate_alpha(target, draft, *alpha_prompts, tokens_per_row=tokens_per_row,
                         sampling=sampling, seed=seed, batch_size=batch_size, bins=bins,
                         max_lag=max_lag, eos_id=eos_id)
  costs = costs_lib.measure_costs(target, draft, gamma=gamma, batch_size=batch_size,
                                  context_length=prompt_length + max_new_tokens // 2,
                                  repeats=max(repeats, 3), seed=seed)
  speed = measure_speedup(target, draft, *speed_prompts, gamma=gamma, sampling=sampling,
                          max_new_tokens=max_new_tokens, seed=seed, repeats=repeats)
  row = report.ReportRow.from_numbers(
      name, gamma=gamma, alpha=alpha.alpha, c=costs.c, r=costs.r,
      sampling=report.describe_sampling(sampling), alpha_loop=speed.alpha,
      tokens_per_target_call=speed.tokens_per_target_call, measured_speedup=speed.speedup,
      alpha_positions=alpha.summary.num_positions, batch_size=batch_size)
  return report.RunReport(row=row, alpha=alpha, costs=costs, speed=speed)
