"""Helpers for tests: exact sequence distributions, goodness-of-fit checks, greedy replays.

With a vocabulary of a handful of tokens and a few new tokens, the probability a model's
standardized sampling assigns to *every* continuation can be enumerated from teacher-forced
logits. Speculative samples must then fit that distribution (paper, Appendix A.1).

`check_greedy_replay` checks a greedy decode's statistics against Corollary 3.6 along its own
text; `speclm.testing.scripts` runs the repository's scripts from tests.
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import scipy.stats

from speclm import sampling as sampling_lib


def exact_continuation_distribution(
    teacher_forced_logits: Callable[[np.ndarray], np.ndarray],
    vocab_size: int,
    num_tokens: int,
    sampling: sampling_lib.SamplingConfig,
) -> tuple[np.ndarray, np.ndarray]:
  """Probability of each of the V^n continuations under standardized sampling.

  Args:
    teacher_forced_logits: maps continuations `[N, n]` to the logits `[N, n, V]` that predict
      each continuation token (position i predicts token i from the prompt and tokens < i).
    vocab_size: V.
    num_tokens: n.
    sampling: the standardization applied at every position.

  Returns:
    (continuations `[V^n, n]`, probabilities `[V^n]` summing to 1).
  """
  continuations = np.array(list(itertools.product(range(vocab_size), repeat=num_tokens)),
                           dtype=np.int32)
  logits = teacher_forced_logits(continuations)
  probs = np.asarray(sampling_lib.standardize(logits, sampling), dtype=np.float64)
  token_probs = np.take_along_axis(probs, continuations[..., None], axis=-1)[..., 0]
  sequence_probs = np.prod(token_probs, axis=-1)
  return continuations, sequence_probs / sequence_probs.sum()


def sequence_ids(sequences: np.ndarray, vocab_size: int) -> np.ndarray:
  """Index of each sequence in the lexicographic order of `exact_continuation_distribution`.

  Args:
    sequences: `[N, n]` token ids, each in [0, V).
    vocab_size: V.

  Returns:
    `[N]` int64 indices into that function's `[V^n]` probabilities.
  """
  weights = vocab_size ** np.arange(sequences.shape[1] - 1, -1, -1)
  return sequences.astype(np.int64) @ weights


def chi_square_pvalue(sample_ids: np.ndarray, probs: np.ndarray,
                      min_expected: float = 5.0) -> float:
  """Pearson chi-square goodness-of-fit p-value of samples against exact cell probabilities.

  Cells with expected count below `min_expected` are pooled into one cell, as usual, so the
  chi-square approximation holds. A sample in a cell of probability 0 gives p-value 0.

  Args:
    sample_ids: `[S]` the cell of each of S samples (e.g. `sequence_ids` of sampled sequences).
    probs: `[C]` the exact probability of each of C cells (normalized here).
    min_expected: the expected count below which cells are pooled.

  Returns:
    The p-value (0 to 1); small values reject that the samples follow `probs`.
  """
  n = len(sample_ids)
  probs = np.asarray(probs, np.float64) / np.sum(probs)
  observed = np.bincount(sample_ids, minlength=len(probs)).astype(np.float64)
  if np.any(observed[probs == 0] > 0):
    return 0.0
  expected = probs * n
  small = expected < min_expected
  obs = np.append(observed[~small], observed[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  keep = exp > 0
  exp = exp * (obs[keep].sum() / exp[keep].sum())  # remove float rounding in the totals
  return float(scipy.stats.chisquare(obs[keep], exp[keep]).pvalue)


def check_greedy_replay(target, draft, prompts, lengths, *, gamma: int, max_new_tokens: int,
                        batch_size: int = 8):
  """Greedy speculative decoding vs Corollary 3.6 along the same text; returns (replay, beta).

  At temperature 0 speculative decoding writes the target's own greedy text, so β computed
  teacher-forced along it (`speclm.analysis.measure.beta_along`) is β at exactly the prefixes
  the loop drafted from. Replaying Algorithm 1's rounds on that β must give the loop's β count,
  β sum, acceptance histogram, target calls and α; this asserts all of them.

  A feature-conditioned (EAGLE-style) draft needs γ = 1: teacher-forced β reads the target's
  true features everywhere, as the loop does only for a round's first proposal. The replay then
  checks that the loop hands over the right features in every round, whatever it accepted.

  Args:
    target: the target `speclm.Model`.
    draft: the draft `speclm.Model` (a feature-conditioned one with `gamma` 1 only).
    prompts: `[B, P]` int32 right-padded prompts.
    lengths: `[B]` int32 prompt lengths.
    gamma: γ of the speculative decode.
    max_new_tokens: tokens each row generates.
    batch_size: rows per call of the teacher-forced reference.

  Returns:
    (the `measure.greedy_round_replay` result, β `[B, max_new_tokens + gamma]` along the
    target's greedy text).

  Raises:
    AssertionError: a statistic of the loop differs from the replay's.
  """
  import speclm  # pylint: disable=import-outside-toplevel
  from speclm import protocol  # pylint: disable=import-outside-toplevel
  from speclm.analysis import measure  # pylint: disable=import-outside-toplevel
  with_features = isinstance(draft.definition, protocol.FeatureConditionedDraft)
  if with_features and gamma != 1:
    raise ValueError('A feature-conditioned draft replays at γ = 1 only: its later proposals'
                     ' read its own predicted features, which teacher forcing does not see.')
  spec = speclm.speculative_decode(target, draft, prompts, lengths, gamma=gamma,
                                   max_new_tokens=max_new_tokens)
  # The target's greedy text, batch by batch (as `speclm.run.calibration.generate_reference`
  # writes it at temperature 0), a seed per batch.
  reference = measure.collect_reference(
      lambda batch, batch_lengths, index: speclm.autoregressive_decode(
          target, batch, batch_lengths, sampling=speclm.GREEDY,
          max_new_tokens=max_new_tokens + gamma, seed=index),
      prompts, lengths, batch_size=batch_size)
  np.testing.assert_array_equal(np.asarray(spec.tokens), reference.tokens[:, :max_new_tokens])
  beta, mask = measure.beta_along(target, draft, reference, sampling=speclm.GREEDY,
                                  batch_size=batch_size)
  # Every position counts, but token 0 of a feature-conditioned draft (never drafted).
  assert mask[:, int(with_features):].all()
  assert set(np.unique(beta[mask])) <= {0.0, 1.0}  # one-hot p̃, q̃
  replay = measure.greedy_round_replay(beta, max_new_tokens, gamma)
  stats = spec.stats
  assert replay.beta_count == int(stats.beta_count)
  assert abs(replay.beta_sum - float(stats.beta_sum)) <= 1e-4
  assert replay.accepted_histogram.tolist() == np.asarray(stats.accepted_histogram).tolist()
  assert replay.target_calls == int(np.sum(stats.target_calls_per_row))
  assert abs(replay.alpha - stats.alpha) <= 1e-6
  return replay, beta
