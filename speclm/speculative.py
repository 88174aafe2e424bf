"""One round of speculative sampling (Algorithm 1 of Leviathan et al., 2023), batched and pure.

Nothing here knows about models: inputs are standardized probability arrays (see
`speclm.sampling.standardize`), the draft's proposed tokens and random numbers. Rows of the
batch are independent; each accepts its own number of drafted tokens.

Shape letters: B batch, G γ (drafted positions), V vocabulary; G+1 = positions the target scored.

Correctness (Appendix A.1): a drafted x ~ q is kept with probability min(1, p(x)/q(x)), which
contributes min(p(x), q(x)); a rejection happens with probability 1 − β, β = Σ_x min(p, q),
and then x is drawn from norm(max(0, p − q)) = (p − min(p, q)) / (1 − β). The two add up to
p(x) exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from speclm import sampling


@struct.dataclass
class RoundResult:
  """What one round of Algorithm 1 decided, per row.

  Attributes:
    num_accepted: `[B]` int32, n ∈ [0, γ]: drafted tokens kept before the first rejection.
    next_token: `[B]` int32, the token appended after them: drawn from the residual
      norm(max(0, p̃_{n+1} − q̃_{n+1})) after a rejection, or from p̃_{γ+1} if all were kept.
    beta: `[B, G]` float32, β_i = Σ_x min(p̃_i(x), q̃_i(x)), the exact probability that the
      draft at position i would be accepted (Definition 3.1, Theorem 3.5).
  """

  num_accepted: jax.Array
  next_token: jax.Array
  beta: jax.Array


def acceptance_overlap(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
  """β = Σ_x min(p(x), q(x)) = 1 − DLK(p, q) (Lemma 3.3, Theorem 3.5). `[..., V] -> [...]`."""
  return jnp.sum(jnp.minimum(target_probs, draft_probs), axis=-1)


def acceptance_probability(target_prob_of_draft: jax.Array,
                           draft_prob_of_draft: jax.Array) -> jax.Array:
  """min(1, p(x)/q(x)) for the drafted x (Algorithm 1: "if r < p_i(x)/q_i(x), accept")."""
  safe_q = jnp.where(draft_prob_of_draft > 0, draft_prob_of_draft, 1.0)
  ratio = jnp.where(draft_prob_of_draft > 0, target_prob_of_draft / safe_q, 0.0)
  return jnp.minimum(1.0, ratio)


def residual_distribution(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
  """p'(x) = norm(max(0, p(x) − q(x))), Algorithm 1's distribution after a rejection.

  Its mass is 1 − β. If that is 0 (p = q), a rejection has probability 0, so the returned
  value is never used by an exact sampler; we return p to stay a valid distribution.
  """
  residual = jnp.maximum(target_probs - draft_probs, 0.0)
  mass = jnp.sum(residual, axis=-1, keepdims=True)
  return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), target_probs)


def speculative_round(
    draft_probs: jax.Array,
    draft_tokens: jax.Array,
    target_probs: jax.Array,
    uniforms: jax.Array,
    rng: jax.Array,
) -> RoundResult:
  """Accepts or corrects the draft's γ guesses for every row.

  Args:
    draft_probs: `[B, G, V]` q̃_i, the draft's standardized distributions the tokens came from.
    draft_tokens: `[B, G]` int, x_i ~ q̃_i.
    target_probs: `[B, G+1, V]` p̃_i from one parallel target call on prefix + x_1..x_{i-1}.
    uniforms: `[B, G]` r_i ~ U[0, 1), one per drafted position.
    rng: key for the one token drawn per row after the accepted prefix.

  Returns:
    A `RoundResult`.
  """
  batch, gamma, vocab = draft_probs.shape
  if target_probs.shape != (batch, gamma + 1, vocab):
    raise ValueError(
        f'target_probs must be [B, γ+1, V] = {(batch, gamma + 1, vocab)}, got'
        f' {target_probs.shape}.')

  # Algorithm 1: r_i ~ U(0, 1); keep x_i while r_i < p_i(x_i) / q_i(x_i).
  p_of_x = jnp.take_along_axis(target_probs[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
  q_of_x = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
  accepted = uniforms < acceptance_probability(p_of_x, q_of_x)  # [B, G]
  # n = min({i − 1 | r_i ≥ p_i(x_i)/q_i(x_i)} ∪ {γ}): the length of the all-accepted prefix.
  num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)

  # The correction at position n+1. Padding q̃ with a zero row at position γ+1 makes one
  # formula cover both cases: norm(max(0, p̃_{γ+1} − 0)) = p̃_{γ+1} when every guess was kept.
  padded_draft = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
  take_n = lambda x: jnp.take_along_axis(x, num_accepted[:, None, None], axis=1)[:, 0]
  correction = residual_distribution(take_n(target_probs), take_n(padded_draft))  # [B, V]
  next_token = sampling.sample(rng, correction)

  beta = acceptance_overlap(target_probs[:, :gamma], draft_probs)
  return RoundResult(num_accepted=num_accepted.astype(jnp.int32), next_token=next_token,
                     beta=beta)
