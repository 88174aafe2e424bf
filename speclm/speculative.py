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
  """min(1, p(x)/q(x)) for the drafted x (Algorithm 1: "if r < p_i(x)/q_i(x), accept").

  Args:
    target_prob_of_draft: `[...]` p(x), the target's probability of each drafted token.
    draft_prob_of_draft: `[...]` q(x), the draft's (0 gives 0: a token q never proposes).

  Returns:
    `[...]` the acceptance probabilities.
  """
  safe_q = jnp.where(draft_prob_of_draft > 0, draft_prob_of_draft, 1.0)
  ratio = jnp.where(draft_prob_of_draft > 0, target_prob_of_draft / safe_q, 0.0)
  return jnp.minimum(1.0, ratio)


def residual_distribution(target_probs: jax.Array, draft_probs: jax.Array) -> jax.Array:
  """p'(x) = norm(max(0, p(x) − q(x))), Algorithm 1's distribution after a rejection.

  Its mass is 1 − β. If that is 0 (p = q), a rejection has probability 0, so the returned
  value is never used by an exact sampler; we return p to stay a valid distribution.

  Args:
    target_probs: `[..., V]` p.
    draft_probs: `[..., V]` q.

  Returns:
    `[..., V]` p', summing to 1 on the last axis.
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


def greedy_round(draft_tokens: jax.Array, target_tokens: jax.Array) -> RoundResult:
  """`speculative_round` at temperature 0, from token ids alone.

  Greedy standardization makes p̃_i one-hot on the target's first argmax a_i and q̃_i one-hot
  on the draft's x_i. Then p̃_i(x_i)/q̃_i(x_i) is 1 when x_i = a_i and 0 otherwise, so x_i is
  kept iff it equals a_i, whatever the uniform; β_i = Σ_x min(p̃_i, q̃_i) is 1 or 0 alike; and
  the correction norm(max(0, p̃_{n+1} − q̃_{n+1})) is one-hot on a_{n+1} (x_{n+1} ≠ a_{n+1},
  or n = γ and q̃ is padded with zeros). The result equals `speculative_round` on the one-hot
  arrays, which are never built (γ+1 and γ rows over the whole vocabulary).

  Args:
    draft_tokens: `[B, G]` int, x_i.
    target_tokens: `[B, G+1]` int, a_i = `sampling.greedy_ids` of the target's logits.
  """
  batch, gamma = draft_tokens.shape
  if target_tokens.shape != (batch, gamma + 1):
    raise ValueError(f'target_tokens must be [B, γ+1] = {(batch, gamma + 1)}, got'
                     f' {target_tokens.shape}.')
  match = draft_tokens == target_tokens[:, :gamma]
  num_accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)
  next_token = jnp.take_along_axis(target_tokens, num_accepted[:, None], axis=1)[:, 0]
  return RoundResult(num_accepted=num_accepted.astype(jnp.int32),
                     next_token=next_token.astype(jnp.int32), beta=match.astype(jnp.float32))


# ----------------------------------------------------------------------------------------------
# Token trees: one round over several candidates per position (shape letters as above, plus
# N tree nodes, node 0 the root, D the tree's depth).


@struct.dataclass
class TreeRoundResult:
  """What one tree round decided, per row.

  Attributes:
    path: `[B, D]` int32, the accepted nodes from the root down (entries past n are 0).
    num_accepted: `[B]` int32, n: drafted tokens kept (the accepted path's length).
    next_token: `[B]` int32, drawn after the last accepted node: from the residual left
      after all its children were rejected, or from p̃ at a leaf.
  """

  path: jax.Array
  num_accepted: jax.Array
  next_token: jax.Array


def without_replacement_proposals(node_probs: jax.Array, tokens: jax.Array,
                                  parents: jax.Array) -> jax.Array:
  """The distribution each node's token was drawn from, when siblings are drawn without
  replacement from their parent's q̃ (Jeon et al., 2024, "Recursive Speculative Decoding").

  Node k's sibling of rank r is drawn from q̃_parent with the tokens of its r earlier siblings
  removed and the rest renormalized; that is the q its acceptance test and residual must use.

  Args:
    node_probs: `[B, N, V]` q̃ at each node (the distribution of its children's tokens).
    tokens: `[B, N]` each node's token.
    parents: `[B, N]` parent indices (-1 for the root).

  Returns:
    `[B, N, V]` each node's proposal distribution (row 0, the root's, is unused).
  """
  parent_probs = jnp.take_along_axis(node_probs, jnp.maximum(parents, 0)[:, :, None], axis=1)
  num_nodes = tokens.shape[1]
  earlier = jnp.arange(num_nodes)[None, :] < jnp.arange(num_nodes)[:, None]  # [N(k), N(j)]
  siblings = (parents[:, :, None] == parents[:, None, :]) & earlier[None]  # [B, N, N]
  vocab = node_probs.shape[-1]
  removed = jnp.einsum('bkj,bjv->bkv', siblings.astype(jnp.float32),
                       jax.nn.one_hot(tokens, vocab, dtype=jnp.float32)) > 0
  kept = jnp.where(removed, 0.0, parent_probs)
  mass = jnp.sum(kept, axis=-1, keepdims=True)
  return jnp.where(mass > 0, kept / jnp.where(mass > 0, mass, 1.0), 0.0)


def tree_round(target_probs: jax.Array, tokens: jax.Array, parents: jax.Array,
               proposals: jax.Array, uniforms: jax.Array, rng: jax.Array,
               depth: int) -> TreeRoundResult:
  """Accepts a path of a token tree for every row, keeping the target's distribution exact.

  Recursive rejection over siblings (SpecInfer's multi-step speculative sampling; SpecTr):
  from the root, the children of the current node u are tried in order. A child x drawn from
  q_x (`proposals`) is kept with probability min(1, p(x)/q_x(x)), where p starts as p̃_u;
  a rejection replaces p by the residual norm(max(0, p − q_x)) (Algorithm 1's correction)
  and the next sibling is tried against it. On acceptance the walk moves to the child with
  p = p̃_child. When no child is kept, the next token is drawn from p. Each sibling test is
  one step of Algorithm 1 between p and q_x, so by Appendix A.1 the token emitted at every
  depth is distributed as p̃_u exactly, provided each child's token was drawn from its q_x
  given what came before: one-hot q_x for deterministic candidates (the draft's top
  choices), `without_replacement_proposals` for sampled siblings.

  Args:
    target_probs: `[B, N, V]` p̃ at each node (one target call over the tree).
    tokens: `[B, N]` node tokens (node 0, the root, is already committed).
    parents: `[B, N]` parent indices in topological order (parents[:, k] < k; -1 root).
    proposals: `[B, N, V]` the distribution each node's token came from.
    uniforms: `[B, N]` r ~ U[0, 1), one per node.
    rng: key for the token drawn after the accepted path.
    depth: static, the longest path (the size of `path`).
  """
  batch = tokens.shape[0]

  def step(carry, node):
    current, probs, path, num = carry
    token, parent, proposal, node_probs, uniform, index = node
    is_child = parent == current
    p_of_x = jnp.take_along_axis(probs, token[:, None], axis=-1)[:, 0]
    q_of_x = jnp.take_along_axis(proposal, token[:, None], axis=-1)[:, 0]
    kept = uniform < acceptance_probability(p_of_x, q_of_x)
    accept = is_child & kept
    reject = is_child & ~kept
    probs = jnp.where(accept[:, None], node_probs,
                      jnp.where(reject[:, None], residual_distribution(probs, proposal), probs))
    slot = jax.nn.one_hot(num, depth, dtype=jnp.bool_) & accept[:, None]
    path = jnp.where(slot, index[:, None], path)
    return (jnp.where(accept, index, current), probs, path,
            num + accept.astype(jnp.int32)), None

  nodes = (tokens.T[1:], parents.T[1:], jnp.swapaxes(proposals, 0, 1)[1:],
           jnp.swapaxes(target_probs, 0, 1)[1:], uniforms.T[1:],
           jnp.broadcast_to(jnp.arange(1, tokens.shape[1], dtype=jnp.int32)[:, None],
                            (tokens.shape[1] - 1, batch)))
  carry = (jnp.zeros((batch,), jnp.int32), target_probs[:, 0],
           jnp.zeros((batch, depth), jnp.int32), jnp.zeros((batch,), jnp.int32))
  (_, probs, path, num), _ = jax.lax.scan(step, carry, nodes)
  return TreeRoundResult(path=path, num_accepted=num, next_token=sampling.sample(rng, probs))
