"""Closed-form predictions of Leviathan, Kalman & Matias (2023), §3: speed, operations, γ.

Every function here is plain NumPy on floats or arrays (they broadcast), with no model and no
JAX, so it can be called before anything is built. Notation follows the paper:

  α   expected acceptance rate E[β], β = Σ_x min(p̃(x), q̃(x))  (Corollary 3.6)
  γ   tokens the draft proposes per iteration of Algorithm 1
  c   walltime of one draft call / walltime of one target call  (Definition 3.7)
  ĉ   arithmetic operations per token of the draft / of the target  (Definition 3.10)
  r   walltime of one target call on γ+1 tokens / on 1 token. The paper assumes r = 1 (the γ+1
      positions run in parallel for free); measured on real hardware r ≥ 1, and the generalised
      walltime factor below divides by γc + r instead of γc + 1.

All results assume the paper's simplification that the β of successive positions are i.i.d.
with mean α, and long generations (boundary effects ignored).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import numpy as np

# The six (α, γ) cells of the paper's Table 1 (c = ĉ = 0) with their printed values:
# (alpha, gamma) -> (walltime improvement, operations increase).
PAPER_TABLE1 = {
    (0.6, 2): (1.96, 1.53),
    (0.7, 3): (2.53, 1.58),
    (0.8, 2): (2.44, 1.23),
    (0.8, 5): (3.69, 1.63),
    (0.9, 2): (2.71, 1.11),
    (0.9, 10): (6.86, 1.60),
}


# Table 2 of the paper (T5-XXL target, one TPU-v4, batch size 1):
# (task, draft, temperature) -> (γ, α, walltime speedup).
PAPER_TABLE2 = {
    ('ende', 'small', 0.0): (7, 0.75, 3.4), ('ende', 'small', 1.0): (7, 0.62, 2.6),
    ('ende', 'base', 0.0): (7, 0.80, 2.8), ('ende', 'base', 1.0): (5, 0.68, 2.4),
    ('ende', 'large', 0.0): (7, 0.82, 1.7), ('ende', 'large', 1.0): (3, 0.71, 1.4),
    ('cnndm', 'small', 0.0): (5, 0.65, 3.1), ('cnndm', 'small', 1.0): (5, 0.53, 2.3),
    ('cnndm', 'base', 0.0): (5, 0.73, 3.0), ('cnndm', 'base', 1.0): (3, 0.55, 2.2),
    ('cnndm', 'large', 0.0): (3, 0.74, 2.2), ('cnndm', 'large', 1.0): (3, 0.56, 1.7),
}


def _check_alpha(alpha) -> np.ndarray:
  alpha = np.asarray(alpha, dtype=np.float64)
  if np.any(~np.isfinite(alpha)) or np.any((alpha < 0) | (alpha > 1)):
    raise ValueError(f'alpha (the expected acceptance rate) must lie in [0, 1], got {alpha}.')
  return alpha


def _check_gamma(gamma) -> np.ndarray:
  gamma_arr = np.asarray(gamma)
  if gamma_arr.dtype == bool or not np.issubdtype(gamma_arr.dtype, np.integer):
    if not (np.issubdtype(gamma_arr.dtype, np.floating)
            and np.all(np.isfinite(gamma_arr)) and np.all(gamma_arr == np.round(gamma_arr))):
      raise ValueError(f'gamma (tokens drafted per iteration) must be an integer >= 0, got'
                       f' {gamma!r}.')
  if np.any(gamma_arr < 0):
    raise ValueError(f'gamma (tokens drafted per iteration) must be >= 0, got {gamma!r}.')
  return gamma_arr.astype(np.float64)


def _check_nonnegative(name: str, value) -> np.ndarray:
  value = np.asarray(value, dtype=np.float64)
  if np.any(~np.isfinite(value)) or np.any(value < 0):
    raise ValueError(f'{name} must be a finite number >= 0, got {value}.')
  return value


def _check_r(r) -> np.ndarray:
  r = np.asarray(r, dtype=np.float64)
  if np.any(~np.isfinite(r)) or np.any(r <= 0):
    raise ValueError(f'r (target time on γ+1 tokens / on 1 token) must be > 0, got {r}.')
  return r


def _as_output(value: np.ndarray):
  """A Python float for scalar results, an array otherwise."""
  return float(value) if np.ndim(value) == 0 else value


def expected_tokens_per_iteration(alpha, gamma):
  """Eq. (1): E[tokens per iteration] = (1 − α^(γ+1)) / (1 − α), which is γ+1 at α = 1.

  Under the i.i.d. assumption the number of accepted guesses is a geometric variable capped at
  γ, and one more token (the correction, or the target's extra sample) always follows.

  Computed as expm1((γ+1)·log1p(α−1)) / (α−1), which stays accurate as α → 1 (the naive
  quotient loses all digits there); α = 1 returns the limit γ+1 exactly.
  """
  alpha = _check_alpha(alpha)
  gamma = _check_gamma(gamma)
  with np.errstate(divide='ignore', invalid='ignore'):
    delta = alpha - 1.0  # exact in floating point for α near 1
    closed_form = np.expm1((gamma + 1.0) * np.log1p(delta)) / delta
  return _as_output(np.where(alpha == 1.0, gamma + 1.0, closed_form))


def walltime_improvement(alpha, gamma, c, r=1.0):
  """Expected speedup over the baseline in walltime per token.

  Theorem 3.8 for r = 1:  (1 − α^(γ+1)) / ((1 − α)(γc + 1)).
  Generalised:            (1 − α^(γ+1)) / ((1 − α)(γc + r)),
  since an iteration costs γ draft calls (γc target-call units) plus one verification call on
  γ+1 tokens (r units), and yields Eq. (1) tokens; the baseline pays 1 unit per token.
  """
  c = _check_nonnegative('c (draft call time / target call time)', c)
  r = _check_r(r)
  tokens = np.asarray(expected_tokens_per_iteration(alpha, gamma))
  gamma = _check_gamma(gamma)
  return _as_output(tokens / (gamma * c + r))


def _tree_parents(parents) -> list[int]:
  """Validated parent indices of a token tree (node 0 the root, parents[k] < k)."""
  parents = [int(p) for p in getattr(parents, 'parents', parents)]
  if len(parents) < 1 or parents[0] != -1 or any(
      not 0 <= p < k for k, p in enumerate(parents[1:], start=1)):
    raise ValueError('parents must start with the root (-1) and list each node after its'
                     f' parent, got {parents}.')
  return parents


def tree_expected_tokens(parents, rank_acceptance) -> float:
  """Expected tokens per target call of a token-tree round (the tree's Eq. (1)).

  `rank_acceptance[r]` is the probability that, at a reached node, its child of rank r (the
  draft's (r+1)-th candidate) is the one kept — the same at every node, the tree analogue of
  the paper's i.i.d. assumption (as in Sequoia's positional acceptance vector). A node is
  reached with the product of its path's rates, and each reached drafted node adds a token,
  the round's final draw one more:

      E = 1 + Σ_{v ≠ root} Π_{edges (u→w) on the path to v} a_{rank(w)}

  For a chain, a = (α,), this is Eq. (1): 1 + α + … + α^γ. Measure the rates with
  `rank_acceptance_rates`.

  Args:
    parents: `[K+1]` each node's parent, the root's −1 first (a sequence, or a
      `speclm.token_trees.TreeShape`).
    rank_acceptance: `[R]` a_r per rank r, summing to at most 1 (ranks past R: 0).
  """
  parents = _tree_parents(parents)
  rates = np.asarray(rank_acceptance, dtype=np.float64)
  if rates.ndim != 1 or np.any(~np.isfinite(rates)) or np.any(rates < 0) or rates.sum() > 1 + 1e-9:
    raise ValueError('rank_acceptance must be probabilities (one per rank) summing to <= 1,'
                     f' got {rank_acceptance!r}.')
  reach = [1.0]
  children = [0] * len(parents)
  total = 1.0
  for node, parent in enumerate(parents[1:], start=1):
    rank = children[parent]
    children[parent] += 1
    reach.append(reach[parent] * (rates[rank] if rank < len(rates) else 0.0))
    total += reach[node]
  return total


def tree_walltime_improvement(parents, rank_acceptance, c, r=1.0) -> float:
  """Expected speedup of token-tree rounds over the baseline: E / (D·c + r), with E from
  `tree_expected_tokens`, D the tree's depth (the draft makes one call per depth) and r the
  cost of verifying all of the tree's nodes in one target call (the chain's γc + r)."""
  parents = _tree_parents(parents)
  c = float(_check_nonnegative('c (draft call time / target call time)', c))
  r = float(_check_r(r))
  depths = [0]
  for parent in parents[1:]:
    depths.append(depths[parent] + 1)
  return tree_expected_tokens(parents, rank_acceptance) / (max(depths) * c + r)


def choose_tree(candidates, rank_acceptance, c, r) -> tuple[str, dict[str, float]]:
  """The token tree (or chain) with the highest predicted speedup, and every prediction.

  `candidates` maps names to trees (parent sequences or `TreeShape`s; a chain of γ is
  `[-1, 0, …, γ−1]`), `r` maps the same names to each tree's measured verification cost (one
  target call over its nodes / one 1-token call). Each is scored by
  `tree_walltime_improvement` with the measured per-rank acceptance and c: the policy that
  picks a tree only where its extra tokens per call pay for its wider verification.
  """
  predictions = {name: tree_walltime_improvement(tree, rank_acceptance, c, r[name])
                 for name, tree in candidates.items()}
  return max(predictions, key=predictions.get), predictions


def rank_acceptance_rates(rank_accepted, rank_offered) -> np.ndarray:
  """Measured `rank_acceptance` from a tree decode's `DecodeStats`: a_r = times rank r was
  kept / reached nodes that had a rank-r child (0 where none had).

  Args:
    rank_accepted: `[R]` `DecodeStats.rank_accepted`.
    rank_offered: `[R]` `DecodeStats.rank_offered`.

  Returns:
    `[R]` float64 rates.
  """
  accepted = np.asarray(rank_accepted, dtype=np.float64)
  offered = np.asarray(rank_offered, dtype=np.float64)
  return np.where(offered > 0, accepted / np.maximum(offered, 1), 0.0)


def _check_num_tokens(num_tokens, minimum: int = 1) -> int:
  if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) \
      or num_tokens < minimum:
    raise ValueError(f'num_tokens (tokens a row generates) must be an integer >= {minimum},'
                     f' got {num_tokens!r}.')
  return int(num_tokens)


def iterations_cdf(alpha: float, gamma: int, num_tokens: int) -> np.ndarray:
  """P(R ≤ k) for k = 0 … num_tokens, R = iterations of Algorithm 1 that make num_tokens tokens.

  The finite-length version of Eq. (1): under the same i.i.d. assumption an iteration yields
  j = 1 … γ tokens with probability α^(j−1)(1 − α) and γ + 1 with probability α^γ, so the
  tokens made so far are a Markov chain, stopped at num_tokens (a row stops there: the last
  iteration may overshoot). Exact, by dynamic programming over that chain; R ≤ num_tokens,
  and R = 0 for num_tokens = 0.
  """
  alpha = float(_check_alpha(alpha))
  gamma = int(_check_gamma(gamma))
  num_tokens = _check_num_tokens(num_tokens, minimum=0)
  step = alpha ** np.arange(gamma + 1) * np.append(np.full(gamma, 1.0 - alpha), 1.0)
  made = np.zeros(num_tokens + 1)  # made[t] = P(t tokens so far), t = num_tokens absorbing
  made[0] = 1.0
  cdf = np.zeros(num_tokens + 1)
  for k in range(1, num_tokens + 1):
    moved = np.zeros_like(made)
    moved[-1] = made[-1]
    for j, probability in enumerate(step, start=1):  # this iteration makes j tokens
      if j < num_tokens:
        moved[j:-1] += probability * made[:num_tokens - j]
      moved[-1] += probability * made[max(num_tokens - j, 0):-1].sum()  # reached the end
    made = moved
    cdf[k] = made[-1]
  cdf[-1] = 1.0  # every iteration makes at least one token
  return cdf


def _row_tokens(num_tokens, rows: int) -> list[int]:
  """One token count per row: an int for all rows, or a sequence of `rows` counts."""
  if np.ndim(num_tokens) == 0:
    return [_check_num_tokens(num_tokens)] * rows
  counts = [_check_num_tokens(n, minimum=0) for n in np.asarray(num_tokens).tolist()]
  if len(counts) != rows or max(counts) < 1:
    raise ValueError(f'num_tokens must give one count per row ({rows}), at least one of them'
                     f' >= 1; got {num_tokens!r}.')
  return counts


def expected_batch_iterations(alphas, gamma: int, num_tokens) -> float:
  """E[max_b R_b]: iterations a batch runs when row b accepts at rate `alphas[b]`.

  Rows of a batch advance together, one verification call per iteration for all of them, so
  the batch runs until its slowest row has its tokens: `num_tokens` for every row, or one
  count per row (rows that stop at an end token). Rows are independent:
  P(max R_b ≤ k) = Π_b P(R_b ≤ k), and E[max] = Σ_{k ≥ 0} (1 − P(max ≤ k)). One row gives
  E[R] ≈ num_tokens / Eq. (1) for long generations.

  Args:
    alphas: `[B]` α of each row (a scalar: one row).
    gamma: γ.
    num_tokens: tokens every row makes (an int), or `[B]` one count per row.
  """
  alphas = np.atleast_1d(_check_alpha(alphas))
  if alphas.ndim != 1 or alphas.size == 0:
    raise ValueError(f'alphas must be one α per row of the batch, got {alphas!r}.')
  counts = _row_tokens(num_tokens, alphas.size)
  longest = max(counts)
  batch_cdf = np.ones(longest + 1)
  for alpha, count in zip(alphas, counts):
    batch_cdf[:count + 1] *= iterations_cdf(alpha, gamma, count)  # 1 from `count` on
  return float(np.sum(1.0 - batch_cdf[:-1]))


def batch_walltime_improvement(alphas, gamma: int, c, r=1.0, num_tokens=128) -> float:
  """The generalised Theorem 3.8 for one batch of finite generations, one α per row.

  max_b N_b / (E[max_b R_b] (γc + r)): the baseline makes as many calls as its longest row
  has tokens N_b (every row gains a token per call), speculative decoding E[max_b R_b]
  iterations of γ draft calls and one verification. For one row and long generations this is
  `walltime_improvement`; a batch is held back by its slowest row, and more so the more its
  rows' α differ. `num_tokens`: as in `expected_batch_iterations`.
  """
  c = float(_check_nonnegative('c (draft call time / target call time)', c))
  r = float(_check_r(r))
  gamma_value = int(_check_gamma(gamma))
  alphas = np.atleast_1d(alphas)
  iterations = expected_batch_iterations(alphas, gamma, num_tokens)
  return max(_row_tokens(num_tokens, alphas.size)) / (iterations * (gamma_value * c + r))


def operations_factor(alpha, gamma, c_hat=0.0):
  """Theorem 3.11: total arithmetic operations per token relative to the baseline.

  (1 − α)(γĉ + γ + 1) / (1 − α^(γ+1)): each iteration runs the draft γ times and the target on
  γ+1 positions, for Eq. (1) tokens. At α = 0 it is γĉ + γ + 1 (every iteration yields one
  token); at α = 1 it is (γĉ + γ + 1)/(γ + 1).
  """
  c_hat = _check_nonnegative('c_hat (draft operations / target operations)', c_hat)
  tokens = np.asarray(expected_tokens_per_iteration(alpha, gamma))
  gamma = _check_gamma(gamma)
  return _as_output((gamma * c_hat + gamma + 1.0) / tokens)


def speedup_exists(alpha, c):
  """Corollary 3.9: some γ ≥ 1 gives a walltime improvement > 1 iff α > c (with r = 1)."""
  alpha = _check_alpha(alpha)
  c = _check_nonnegative('c (draft call time / target call time)', c)
  result = alpha > c
  return bool(result) if np.ndim(result) == 0 else result


def speedup_lower_bound(alpha, c):
  """Corollary 3.9's guarantee (1 + α) / (1 + c): Theorem 3.8 at γ = 1.

  When α > c this exceeds 1, and the best γ does at least as well.
  """
  alpha = _check_alpha(alpha)
  c = _check_nonnegative('c (draft call time / target call time)', c)
  return _as_output((1.0 + alpha) / (1.0 + c))


def oracle_tokens_bound(alpha):
  """1 / (1 − α): expected tokens per target call with a γ-oracle (§3.5); +inf at α = 1.

  An oracle that drafts exactly until the first rejection pays one target call per rejection,
  and rejections occur at rate 1 − α, so no fixed γ can produce more tokens per target call.
  """
  alpha = _check_alpha(alpha)
  with np.errstate(divide='ignore'):
    return _as_output(np.where(alpha == 1.0, np.inf, 1.0 / (1.0 - alpha)))


@dataclasses.dataclass(frozen=True)
class OptimalGamma:
  """The best integer γ for given α, c (and r), and what it buys.

  Attributes:
    gamma: argmax over γ ∈ [1, max_gamma] of the walltime improvement (ties -> smallest γ).
    improvement: the walltime improvement at that γ.
    expected_tokens: Eq. (1) at that γ.
    beneficial: whether the improvement exceeds 1 (for r = 1 this is α > c, Corollary 3.9).
    at_limit: whether the search hit max_gamma (the true optimum may be larger).
  """

  gamma: int
  improvement: float
  expected_tokens: float
  beneficial: bool
  at_limit: bool


def optimal_gamma(alpha: float, c: float, r: float = 1.0, max_gamma: int = 64) -> OptimalGamma:
  """§3.5: γ* = argmax_{γ = 1 … max_gamma} of the (generalised) walltime improvement.

  A search over the whole integer range is exact for any r and costs nothing. `r` is held
  fixed across γ; since a real verification cost grows with γ, measure r near the γ you pick
  (`speclm.run.calibration.measure_costs`) and re-check. As α → 1 with c → 0 the optimum grows
  without bound; `at_limit` then says the search range was the binding constraint.
  """
  if isinstance(max_gamma, bool) or not isinstance(max_gamma, (int, np.integer)) or max_gamma < 1:
    raise ValueError(f'max_gamma must be an integer >= 1, got {max_gamma!r}.')
  if np.ndim(alpha) or np.ndim(c) or np.ndim(r):
    raise ValueError('optimal_gamma takes scalar alpha, c and r; use optimal_gamma_grid for'
                     ' arrays.')
  alpha, c, r = float(_check_alpha(alpha)), float(c), float(r)
  gammas = np.arange(1, int(max_gamma) + 1)
  factors = np.asarray(walltime_improvement(alpha, gammas, c, r))
  # Compare γ values through exact per-step log ratios of the improvement f:
  #   f(γ+1)/f(γ) = (1 + α^(γ+1)/E(γ)) / (1 + c/(γc + r)),  E(γ) = Eq. (1), E(γ+1) = E(γ) + α^(γ+1).
  # Once α^(γ+1) drops below float epsilon, f itself rounds to a constant and a plain argmax
  # would stop at an arbitrary γ. Instead, scanning backwards, gain[i] = the largest log gain
  # still available by moving from gammas[i] to any larger γ (0 if none); the first maximum of f
  # is the first γ from which nothing more can be gained.
  tokens = np.asarray(expected_tokens_per_iteration(alpha, gammas[:-1]), dtype=np.float64)
  steps = (np.log1p(alpha ** (gammas[:-1] + 1.0) / tokens)
           - np.log1p(c / (gammas[:-1] * c + r)))
  gain = np.zeros(len(gammas))
  for i in range(len(steps) - 1, -1, -1):
    gain[i] = max(0.0, steps[i] + gain[i + 1])
  best = int(np.argmax(gain == 0.0))  # exact ties go to the smaller, cheaper γ
  return OptimalGamma(gamma=int(gammas[best]), improvement=float(factors[best]),
                      expected_tokens=float(expected_tokens_per_iteration(alpha, gammas[best])),
                      beneficial=bool(factors[best] > 1.0), at_limit=best == len(gammas) - 1)


def optimal_gamma_grid(alphas: Iterable[float], c: float, r: float = 1.0,
                       max_gamma: int = 64) -> np.ndarray:
  """γ* for each α (int array), the curve of the paper's Figure 3 for one c."""
  return np.array([optimal_gamma(a, c, r, max_gamma).gamma for a in alphas], dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class Table1Row:
  """One (α, γ) cell of Table 1: Theorem 3.8's speed and Theorem 3.11's operations."""

  alpha: float
  gamma: int
  speed: float
  operations: float
  paper_speed: float | None = None
  paper_operations: float | None = None


def table1(cells: Iterable[tuple[float, int]] | None = None, c: float = 0.0,
           c_hat: float = 0.0) -> list[Table1Row]:
  """The paper's Table 1 regenerated from the formulas (c = ĉ = 0 by default).

  `cells` defaults to the six (α, γ) pairs the paper prints; the paper's own numbers are
  attached where the cell is one of them (and c = ĉ = 0), for comparison.
  """
  cells = list(PAPER_TABLE1) if cells is None else list(cells)
  rows = []
  for alpha, gamma in cells:
    paper = PAPER_TABLE1.get((alpha, gamma)) if c == 0 and c_hat == 0 else None
    rows.append(Table1Row(
        alpha=float(alpha), gamma=int(gamma),
        speed=float(walltime_improvement(alpha, gamma, c)),
        operations=float(operations_factor(alpha, gamma, c_hat)),
        paper_speed=paper[0] if paper else None,
        paper_operations=paper[1] if paper else None))
  return rows
