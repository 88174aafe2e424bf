"""Adaptive γ: how many tokens to draft, decided every round from the paper's own theory.

The paper (§3.5) picks one γ for a whole run from α and c, maximising Theorem 3.8's walltime
improvement. `speculative_decode(..., gamma=AdaptiveGamma(...))` makes that choice again before
every round, and the draft may stop early within a round:

* **Per round, from α.** Each row keeps a running α: an exponentially weighted mean of the
  exact β = Σ_x min(p̃, q̃) the loop measures at every drafted position its sequence reached
  (Corollary 3.6), pulled towards `prior_alpha` while it has little evidence. The round's
  γ ∈ {0, 1, …, γ_max} maximises the batch's expected tokens per unit of time,

      Σ_b (1 − α_b^{γ+1}) / (1 − α_b)   /   (γ·c + r(γ))                    (Theorem 3.8)

  over the rows still generating: the numerator is Equation (1) per row, the denominator the
  round's cost in target steps, with r(γ) the round's verification and its other work over a
  one-token baseline step (measured on whole rounds, see below). γ = 0 is a plain target
  step: the draft sits the round out, so it costs r(0). When the draft next runs it first
  reads the tokens it missed: in the same call as its first proposal after up to `max_skip`
  rounds out, else by re-reading the sequence (its prompt prefill and the generated tokens,
  in chunks). That one-off cost is not priced; it buys a γ = 0 round that runs no draft at
  all, which is what a batch too wide to gain from speculation needs. (With `max_skip` = 0
  the draft reads every round: γ = 0 then costs c + r(0).)
  Since the running α forgets old rounds (`decay`) and drifts back to the prior, a batch that
  stopped speculating tries again later. A rule that chooses γ = 0 at the prior itself never
  drafts at all (`never_drafts`: no round adds evidence), so `speculative_decode` runs the
  baseline loop for it (on a 2-core CPU, batch 8 at prior α 0.5: docs/benchmarks.md).
* **Within a round, from the draft's confidence** (`draft_stopping`). After proposing x_j the
  draft proposes x_{j+1} only if that raises the round's expected tokens per unit of cost.
  With a_{b,i} the draft's confidence in x_i (the largest probability of its distribution;
  at temperature 0 of its softmax), P_{b,j} = Π_{i≤j} a_{b,i} estimates that x_1 … x_j are
  all accepted, E_j = Σ_b Σ_{i≤j} P_{b,i} the tokens the round yields and
  C_j = j·c + r(j) its cost; the next proposal, predicted to be accepted with a_{b,j}, is
  made iff (E_j + Σ_b P_{b,j} a_{b,j}) / (C_j + c + r(j+1) − r(j)) > E_j / C_j. The count is
  then bounded by γ_max alone, so a run of confident proposals (prompt lookup inside a
  repeated passage, which is one-hot) grows to γ_max, and the per-round choice above only
  decides whether to speculate at all. Without draft-side stopping the draft makes exactly
  the per-round γ.

In a batch, one γ serves all rows (the verification is one call of one width): the rule sums
the rows' expected tokens. Any γ keeps speculative sampling exact (Algorithm 1 is exact for
every γ: the round verifies and accepts at the width of the γ drafted), so the output
distribution is the target's whatever the rule decides; only the speed changes.

c and r(γ) come from timing the models (`speclm.run.calibration.measure_adaptive_gamma`,
which times whole rounds of this loop and caches them per machine, model pair and batch
size). The loop takes them as an array (`AdaptiveGamma.cost_vector`) beside the static
`AdaptiveGamma.structure()`, so rules that differ only in their costs share one compilation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class AdaptiveGamma:
  """The adaptive-γ rule and the costs it weighs. Hashable: a static argument of the loop.

  Attributes:
    max_gamma: γ_max ≥ 1, the most tokens drafted in one round (static: buffers and the
      verification widths compiled are sized by it).
    draft_cost: c, one draft call over one target step, for this batch size.
    verify_costs: r(0) … r(γ_max): what a round at γ costs beyond its draft calls (the
      (γ+1)-token verification and the round's other work) over a one-token baseline step,
      for this batch size.
    prior_alpha: the α a row is assumed to have before any evidence.
    prior_weight: how many drafted positions of evidence the prior is worth.
    decay: per round, the weight old evidence keeps (0 < decay ≤ 1; 1 never forgets).
    draft_stopping: whether the draft may stop (or go on up to γ_max) from its confidence.
    max_skip: most rounds in a row the draft may sit out (γ = 0) and still read the tokens it
      missed with its next proposal call (a window of max_skip + 2 recent tokens); after
      more it re-reads the sequence when it next drafts. 0 makes it read the newest tokens
      every round (feature-conditioned drafts always do: they need the target's features of
      every position).
  """

  max_gamma: int
  draft_cost: float
  verify_costs: tuple[float, ...]
  prior_alpha: float = 0.5
  prior_weight: float = 2.0
  decay: float = 0.9
  draft_stopping: bool = False
  max_skip: int = 3

  def __post_init__(self):
    if (isinstance(self.max_gamma, bool) or not isinstance(self.max_gamma, int)
        or self.max_gamma < 1):
      raise ValueError(f'AdaptiveGamma.max_gamma must be an integer >= 1, got'
                       f' {self.max_gamma!r}.')
    costs = tuple(float(r) for r in self.verify_costs)
    if len(costs) != self.max_gamma + 1:
      raise ValueError(f'AdaptiveGamma.verify_costs needs r(0) … r({self.max_gamma}), that is'
                       f' {self.max_gamma + 1} values; got {len(costs)}.')
    if not all(math.isfinite(r) and r > 0 for r in costs):
      raise ValueError(f'AdaptiveGamma.verify_costs must be positive and finite, got {costs}.')
    object.__setattr__(self, 'verify_costs', costs)
    checks = {'draft_cost': (self.draft_cost, 0.0, math.inf, True),
              'prior_alpha': (self.prior_alpha, 0.0, 1.0, True),
              'prior_weight': (self.prior_weight, 0.0, math.inf, False),
              'decay': (self.decay, 0.0, 1.0, False)}
    for name, (value, low, high, low_inclusive) in checks.items():
      value = float(value)
      above = value >= low if low_inclusive else value > low
      if not (math.isfinite(value) and above and value <= high):
        bound = '[' if low_inclusive else '('
        raise ValueError(f'AdaptiveGamma.{name} must lie in {bound}{low}, {high}], got'
                         f' {value!r}.')
      object.__setattr__(self, name, value)
    object.__setattr__(self, 'draft_stopping', bool(self.draft_stopping))
    if (isinstance(self.max_skip, bool) or not isinstance(self.max_skip, int)
        or self.max_skip < 0):
      raise ValueError(f'AdaptiveGamma.max_skip must be an integer >= 0, got {self.max_skip!r}.')

  @classmethod
  def from_costs(cls, max_gamma: int, draft_cost: float, verify_costs: Sequence[float],
                 **kwargs) -> 'AdaptiveGamma':
    """The rule for measured costs; `verify_costs` may start at r(0) or at r(1)."""
    costs = tuple(verify_costs)
    if len(costs) == max_gamma:
      costs = (1.0,) + costs
    return cls(max_gamma=int(max_gamma), draft_cost=float(draft_cost), verify_costs=costs,
               **kwargs)

  def cost_vector(self) -> np.ndarray:
    """`[γ_max + 2]` float32: c, then r(0) … r(γ_max). The decode loop takes this as an
    array, not as part of the static rule, so rules that differ only in their costs share one
    compiled loop (`structure`)."""
    return np.asarray((self.draft_cost,) + self.verify_costs, np.float32)

  def structure(self) -> 'AdaptiveGamma':
    """This rule without its costs (c = 0, r = 1): what the compiled loop depends on."""
    return dataclasses.replace(self, draft_cost=0.0,
                               verify_costs=(1.0,) * (self.max_gamma + 1))

  def round_cost(self, gamma, costs=None) -> jax.Array:
    """γ·c + r(γ) in target steps; for γ = 0, r(0), or c + r(0) when max_skip = 0 (γ may be
    a traced integer). `costs` (`cost_vector()`, possibly traced) replaces the rule's own."""
    costs = jnp.asarray(self.cost_vector() if costs is None else costs, jnp.float32)
    draft_calls = jnp.where(gamma > 0, gamma, 0.0 if self.max_skip else 1.0)
    return draft_calls * costs[0] + costs[1:][gamma]


def running_alpha(beta_sum: jax.Array, beta_count: jax.Array, rule: AdaptiveGamma) -> jax.Array:
  """`[B]` each row's α estimate from its decayed β sum and count, with the prior."""
  return ((beta_sum + rule.prior_weight * rule.prior_alpha)
          / (beta_count + rule.prior_weight)).clip(0.0, 1.0)


def update_evidence(beta_sum, beta_count, round_sum, round_count,
                    rule: AdaptiveGamma) -> tuple[jax.Array, jax.Array]:
  """The decayed β sum and count after a round that reached `round_count` drafted positions."""
  return (rule.decay * beta_sum + round_sum,
          rule.decay * beta_count + round_count.astype(jnp.float32))


def expected_tokens(alpha: jax.Array, gamma: jax.Array) -> jax.Array:
  """(1 − α^{γ+1}) / (1 − α), Equation (1), elementwise (γ + 1 where α = 1).

  Args:
    alpha: `[...]` α per row (or a scalar).
    gamma: γ, broadcastable against `alpha` (`choose_gamma`: `[G+1, 1]` against `[1, B]`).

  Returns:
    The expected tokens per round, broadcast shape, float32.
  """
  gamma = jnp.asarray(gamma, jnp.float32)
  safe = jnp.where(alpha < 1.0, alpha, 0.5)
  return jnp.where(alpha < 1.0, (1.0 - safe ** (gamma + 1.0)) / (1.0 - safe), gamma + 1.0)


def choose_gamma(alpha: jax.Array, active: jax.Array, rule: AdaptiveGamma,
                 costs=None) -> jax.Array:
  """The round's γ ∈ [0, γ_max]: argmax of Σ_b active (1 − α_b^{γ+1})/(1 − α_b) over the
  round's cost (`AdaptiveGamma.round_cost`, from `costs` when given; ties go to the smaller
  γ). int32 scalar."""
  gammas = jnp.arange(rule.max_gamma + 1)
  tokens = jnp.sum(jnp.where(active[None, :], expected_tokens(alpha[None, :], gammas[:, None]),
                             0.0), axis=1)  # [γ_max + 1]
  return jnp.argmax(tokens / rule.round_cost(gammas, costs)).astype(jnp.int32)


def never_drafts(rule: AdaptiveGamma) -> bool:
  """Whether a loop under `rule` would choose γ = 0 in every round, whatever the prompts.

  Before any evidence every row's α is the prior. If `choose_gamma` picks γ = 0 there, the
  round drafts nothing and so adds no evidence (decay keeps a zero sum and count at zero), so
  every row's α is still the prior in the next round, and the choice is the same: the rows
  still generating contribute equal terms, so their number does not move the argmax. The
  draft then never runs (draft-side stopping included: it only continues a round that drafts)
  and `speculative_decode` runs the baseline loop instead.
  """
  prior = jnp.full((1,), rule.prior_alpha, jnp.float32)
  return int(choose_gamma(prior, jnp.ones((1,), bool), rule)) == 0


def draft_confidence(logits: jax.Array, probs: jax.Array, greedy: bool) -> jax.Array:
  """`[B]` the draft's own estimate that its proposal will be accepted: the largest probability
  of the distribution it drew from (of its softmax when sampling is greedy, since the argmax
  distribution is one-hot whatever the draft believes)."""
  if greedy:
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
  return jnp.max(probs, axis=-1)


def keep_drafting(num_drafted, expected, all_accepted, confidence, active,
                  rule: AdaptiveGamma, costs=None) -> jax.Array:
  """Whether proposal j+1 = `num_drafted` + 1 raises the round's expected tokens per cost.

  Args:
    num_drafted: j ≥ 1, proposals made so far (traced int).
    expected: E_j, the batch's expected tokens if x_1 … x_j are verified (scalar).
    all_accepted: `[B]` P_{b,j}, the estimated chance that x_1 … x_j are all accepted.
    confidence: `[B]` a_{b,j}, the draft's confidence in x_j (the next one's predicted
      acceptance).
    active: `[B]` rows still generating.
    costs: the rule's `cost_vector()` (possibly traced); None uses the rule's own.
  """
  gain = jnp.sum(jnp.where(active, all_accepted * confidence, 0.0))
  cost = rule.round_cost(num_drafted, costs)
  more = rule.round_cost(jnp.minimum(num_drafted + 1, rule.max_gamma), costs)
  return (num_drafted < rule.max_gamma) & ((expected + gain) * cost > expected * more)
