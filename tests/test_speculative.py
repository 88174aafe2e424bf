"""One round of Algorithm 1 on fake distributions: no models (cf. T5X's decoding_test)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speclm import speculative
from speclm import testing

V = 7


def _dirichlet(rng, shape, concentration=0.7):
  return rng.dirichlet([concentration] * V, size=shape).astype(np.float32)


def _pairs():
  """(name, p, q) pairs covering the cases the proof must handle."""
  rng = np.random.RandomState(0)
  p = _dirichlet(rng, ())
  q = _dirichlet(rng, ())
  one_hot_a, one_hot_b = np.eye(V, dtype=np.float32)[2], np.eye(V, dtype=np.float32)[5]
  disjoint_p = np.array([0.5, 0.3, 0.2, 0, 0, 0, 0], np.float32)
  disjoint_q = np.array([0, 0, 0, 0.1, 0.6, 0.3, 0], np.float32)
  sparse_q = np.array([0.9, 0.1, 0, 0, 0, 0, 0], np.float32)  # q = 0 on most tokens
  return [
      ('overlapping', p, q),
      ('identical', p, p.copy()),
      ('disjoint', disjoint_p, disjoint_q),
      ('one_hot_equal', one_hot_a, one_hot_a.copy()),
      ('one_hot_different', one_hot_a, one_hot_b),
      ('one_hot_target', one_hot_b, q),
      ('one_hot_draft', p, one_hot_a),
      ('sparse_draft', p, sparse_q),
  ]


@pytest.mark.parametrize('name,p,q', _pairs(), ids=[c[0] for c in _pairs()])
def test_round_output_distribution_is_exactly_p(name, p, q):
  """P(X = x) = q(x)·min(1, p(x)/q(x)) + (1 − Σ_y q(y)·min(1, p(y)/q(y)))·p'(x) = p(x).

  Every term comes from the implementation's own functions (Appendix A.1 with γ = 1).
  """
  del name
  tokens = jnp.arange(V)
  accept = np.asarray(speculative.acceptance_probability(p[tokens], q[tokens]))
  accepted_mass = q * accept  # P(draft x, accept)
  rejection = 1.0 - accepted_mass.sum()
  residual = np.asarray(speculative.residual_distribution(p, q))
  output = accepted_mass + rejection * residual
  np.testing.assert_allclose(output, p, atol=1e-6)
  # β = Σ min(p, q) is the acceptance probability (Theorem 3.5).
  np.testing.assert_allclose(speculative.acceptance_overlap(p, q), accepted_mass.sum(),
                             atol=1e-6)


@pytest.mark.parametrize('use_jit', [False, True])
@pytest.mark.parametrize('name,p,q', _pairs()[:3] + _pairs()[-1:],
                         ids=[c[0] for c in _pairs()[:3] + _pairs()[-1:]])
def test_round_monte_carlo(name, p, q, use_jit):
  """Full `speculative_round` with γ = 1: the emitted first token is distributed as p."""
  del name
  n = 40_000
  rng = np.random.RandomState(1)
  drafted = rng.choice(V, size=(n, 1), p=q / q.sum()).astype(np.int32)
  draft_probs = np.broadcast_to(q, (n, 1, V))
  # Position 2's target distribution is irrelevant to the first token; use p again.
  target_probs = np.broadcast_to(p, (n, 2, V))
  uniforms = rng.uniform(size=(n, 1)).astype(np.float32)
  fn = jax.jit(speculative.speculative_round) if use_jit else speculative.speculative_round
  result = fn(draft_probs, drafted, target_probs, uniforms, jax.random.key(2))
  n_acc = np.asarray(result.num_accepted)
  first = np.where(n_acc == 1, drafted[:, 0], np.asarray(result.next_token))
  assert testing.chi_square_pvalue(first, p.astype(np.float64)) > 1e-3
  np.testing.assert_allclose(n_acc.mean(), np.minimum(p, q).sum(), atol=0.015)


def test_round_counts_leading_accepts_and_samples_correction():
  # Row 0: p one-hot on the drafted tokens at positions 1, 2, not 3 -> n = 2, correction from
  # the residual at position 3 (which is p there, a one-hot on token 4).
  # Row 1: everything accepted -> the extra token comes from p̃_{γ+1}.
  gamma = 3
  drafted = np.array([[1, 2, 3], [0, 0, 0]], np.int32)
  q = np.eye(V, dtype=np.float32)[drafted]  # the draft was certain of its tokens
  p = np.zeros((2, gamma + 1, V), np.float32)
  p[0, 0, 1] = p[0, 1, 2] = p[0, 2, 4] = 1.0
  p[0, 3, 6] = 1.0
  p[1, :3, 0] = 1.0
  p[1, 3, 5] = 1.0
  result = speculative.speculative_round(q, drafted, p, np.full((2, gamma), 0.5, np.float32),
                                         jax.random.key(0))
  np.testing.assert_array_equal(result.num_accepted, [2, 3])
  np.testing.assert_array_equal(result.next_token, [4, 5])
  np.testing.assert_allclose(result.beta, [[1, 1, 0], [1, 1, 1]])


def test_acceptance_uses_the_ratio_rule():
  # p(x) = 0.2, q(x) = 0.8: accepted iff r < 0.25.
  p = np.full((3, 2, 2), 0.5, np.float32)
  p[:, 0] = [0.2, 0.8]
  q = np.tile(np.array([[[0.8, 0.2]]], np.float32), (3, 1, 1))
  drafted = np.zeros((3, 1), np.int32)
  uniforms = np.array([[0.1], [0.2499], [0.2501]], np.float32)
  result = speculative.speculative_round(q, drafted, p, uniforms, jax.random.key(0))
  np.testing.assert_array_equal(result.num_accepted, [1, 1, 0])
  # After the rejection the residual norm(max(0, p − q)) is a one-hot on token 1.
  assert int(result.next_token[2]) == 1


def test_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match='target_probs'):
    speculative.speculative_round(np.ones((1, 2, 3)) / 3, np.zeros((1, 2), np.int32),
                                  np.ones((1, 2, 3)) / 3, np.zeros((1, 2)), jax.random.key(0))


def test_greedy_round_equals_the_round_on_one_hot_distributions():
  """At temperature 0 the loop decides from argmax ids (`greedy_round`); that must be what
  `speculative_round` decides on the one-hot p̃ and q̃: n, the next token and every β, for
  rows that match everywhere, nowhere or part way."""
  rng = np.random.default_rng(0)
  batch, gamma = 64, 3
  target_tokens = rng.integers(0, 3, size=(batch, gamma + 1)).astype(np.int32)
  drafted = rng.integers(0, 3, size=(batch, gamma)).astype(np.int32)
  drafted[:8] = target_tokens[:8, :gamma]  # all match
  p = np.eye(V, dtype=np.float32)[target_tokens]
  q = np.eye(V, dtype=np.float32)[drafted]
  uniforms = rng.uniform(size=(batch, gamma)).astype(np.float32)
  general = speculative.speculative_round(q, drafted, p, uniforms, jax.random.key(1))
  greedy = jax.jit(speculative.greedy_round)(drafted, target_tokens)
  for field in ('num_accepted', 'next_token', 'beta'):
    np.testing.assert_array_equal(getattr(greedy, field), getattr(general, field))
  assert set(np.asarray(greedy.num_accepted).tolist()) == {0, 1, 2, 3}
  with pytest.raises(ValueError, match='target_tokens'):
    speculative.greedy_round(drafted, target_tokens[:, :gamma])


def test_a_round_of_no_drafts_draws_from_the_target():
  """γ = 0 (an adaptive round that drafted nothing): nothing is kept, β is empty, and the
  token comes from p̃_1, in both the general and the greedy round."""
  p = np.array([[[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]], np.float32)
  general = speculative.speculative_round(np.zeros((1, 0, V), np.float32),
                                          np.zeros((1, 0), np.int32), p,
                                          np.zeros((1, 0), np.float32), jax.random.key(0))
  greedy = speculative.greedy_round(np.zeros((1, 0), np.int32), np.array([[2]], np.int32))
  for result in (general, greedy):
    assert int(result.num_accepted[0]) == 0 and int(result.next_token[0]) == 2
    assert result.beta.shape == (1, 0)
