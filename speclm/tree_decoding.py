"""Speculative decoding over token trees: several candidates per position, one target call.

`tree_speculative_decode` is `speculative_decode` with a token tree (`speclm.token_trees`)
in place of the chain of γ drafts. The bookkeeping is the chain's (see `speclm.decoding`):
the target cache holds C−1 positions and s_{C−1} is pending. One round:

  1. draft (`_draft_static_tree`, `_draft_dynamic_tree`): the draft's cache is rolled back
     to C−2 and, depth by depth, it reads the tree so far, rooted at [s_{C−2}, s_{C−1}],
     with `extend_tree` (one call per depth, D calls). Each node's children are the draft's
     top choices after it (or draws without replacement from its q̃); a dynamic tree
     (EAGLE-2) expands the nodes of highest path probability and keeps the best N. A draft
     that reads the target's features (EAGLE, `protocol.FeatureConditionedDraft`) first
     re-reads the tokens the last round appended (its kept path and t) with the target's
     features before them, as a chain's round does (`decode_common.reread_feature_block`),
     then at each depth the nodes under the root with `extend_tree_with_features`, each with
     its parent's feature as the draft predicted it (`_feature_reader`).
  2. verify: one target `extend_tree` over [s_{C−1}, candidates…] gives p̃ at every node
     (`extend_tree_with_features` for an EAGLE draft, whose next round re-reads the kept
     path with the target's features there: `_next_path_block`).
  3. accept (`speculative.tree_round`): recursive rejection over siblings walks down the
     tree; n candidates on one path are kept and one more token t is drawn.
  4. append (`_keep_path`): `keep_tree_path` moves the kept path's keys/values together in
     both caches (compaction), the target keeps C−1+n+1 positions, x_1 … x_n, t are appended
     (`decode_common.commit_round`) and t becomes pending. The next round sees ordinary
     caches.

A chain (`TreeShape.chain(γ)`) takes the same steps and, with greedy sampling, writes the
same tokens as `speculative_decode(gamma=γ)`.

Statistics: `DecodeStats` with γ = the tree's depth (the accepted-depth histogram, β and α
over the nodes the committed path reached, as for a chain), plus per-rank counts
`rank_offered[r]` (reached nodes with more than r children) and `rank_accepted[r]` (how often
the child of rank r was the one kept), from which `speclm.analysis.theory` predicts tokens
per call for any tree.

Shape letters: B batch, N tree nodes (the root included), D depth, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from speclm import decode_common as common
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import speculative
from speclm import token_trees


def tree_speculative_decode(
    target: protocol.Model,
    draft: protocol.Model,
    prompt_tokens,
    prompt_lengths,
    *,
    tree: token_trees.TreeShape | token_trees.DynamicTree,
    sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY,
    max_new_tokens: int | Sequence[int] = 32,
    seed: int = 0,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    cache_length: int | None = None,
) -> common.DecodeResult:
  """Speculative decoding over a token tree: samples exactly from `target`.

  Args:
    target, draft: `speclm.protocol.Model`s sharing one vocabulary V; both must implement
      `extend_tree` and `keep_tree_path` (Llama, T5, n-gram and lookup drafts), or, for a
      draft that reads the target's features, `extend_tree_with_features` (a Llama target;
      EAGLE drafts, behind prompt lookup or not).
    prompt_tokens: `[B, P]` int, right-padded prompts; prompt_lengths: `[B]` int, 1 … P.
    tree: a static `token_trees.TreeShape` or an EAGLE-2 `token_trees.DynamicTree`, in place
      of `speclm.speculative_decode`'s γ.
    The rest as in `speclm.autoregressive_decode`.

  With greedy sampling the output equals `autoregressive_decode(target, …)` token for token.
  """
  tree = token_trees.check_tree(tree)
  prompts, lengths, limits = common.validate_inputs(
      target, prompt_tokens, prompt_lengths, sampling, max_new_tokens, seed, eos_id)
  common.check_pair(target, draft)
  target = protocol.target_for_feature_draft(target, draft)
  with_features = isinstance(draft.definition, protocol.FeatureConditionedDraft)
  for role, model in (('target', target), ('draft', draft)):
    definition = model.definition
    method, base = ('extend_tree', protocol.LanguageModel)
    if with_features:
      method, base = ('extend_tree_with_features', protocol.FeatureSource if role == 'target'
                      else protocol.FeatureConditionedDraft)
    if getattr(type(definition), method) is getattr(base, method):
      raise ValueError(f'The {role} ({type(definition).__name__}) does not implement {method},'
                       ' so it cannot take part in token trees; use speculative_decode (a'
                       ' chain) or models that do (Llama, T5, n-gram, lookup and EAGLE drafts).')
    common.check_context(definition, role, lengths, limits)
  width = prompts.shape[1]
  common.check_same_prefix(target, draft, width)
  if _max_children(tree) > target.vocab_size:
    raise ValueError(f'The tree gives a node {_max_children(tree)} children, more than the'
                     f' vocabulary\'s {target.vocab_size} tokens.')
  max_new = int(limits.max())
  capacity = lambda model, lookahead: common.cache_capacity(
      model.definition, width, max_new, lookahead, cache_length)
  result = _tree_jit(
      target.definition, draft.definition, target.params, draft.params, prompts, lengths,
      limits, jax.random.key(seed), common.end_tokens(eos_id),
      jnp.int32(pad_id), tree=tree, sampling=sampling,
      buffer_length=max_new + tree.depth + 1,
      target_capacity=capacity(target, tree.num_nodes),
      draft_capacity=capacity(draft, _draft_lookahead(tree, draft.definition) - 1))
  return common.trim(result, max_new)


def _draft_lookahead(tree, draft_def) -> int:
  """Draft cache positions a round may write after C−2: `token_trees.draft_lookahead`, or an
  EAGLE draft's re-read block of depth + 1 rows if that needs more."""
  return common.feature_block_lookahead(draft_def, token_trees.draft_lookahead(tree),
                                        tree.depth + 1)


def _max_children(tree) -> int:
  return tree.max_children if isinstance(tree, token_trees.TreeShape) else tree.top_k


# ----------------------------------------------------------------------------------------------
# Step 1: the draft builds the tree.


def _draft_parents(parents: jax.Array) -> jax.Array:
  """The draft's tree `[B, N+1]`: s_{C−2} as its root, then the target's tree under it."""
  batch = parents.shape[0]
  return jnp.concatenate([jnp.full((batch, 1), -1, jnp.int32), parents + 1], axis=1)


def _choose_children(key, logits, probs, count: int, rule: str):
  """`[B, M, count]` candidate tokens after M nodes: the draft's top `count` (by logits), or
  `count` draws without replacement from q̃ (Gumbel top-k)."""
  if rule == 'sample':
    gumbel = jax.random.gumbel(key, probs.shape)
    scores = jnp.where(probs > 0, jnp.log(jnp.where(probs > 0, probs, 1.0)) + gumbel, -jnp.inf)
    return sampling_lib.top_k_indices(scores, count)
  return sampling_lib.top_k_indices(logits, count)


def _token_reader(draft_def, draft_params, prev, base):
  """How a draft that reads tokens only reads the tree: `read(carry, tokens, parents, level)`
  extends its cache, rolled back to `base` (C−2) positions, with s_{C−2} (`prev` `[B]`) and
  the m nodes so far (`tokens`, `parents` `[B, m]`, the root first) in one `extend_tree`
  call, and returns (its logits `[B, M, V]` after the nodes `level` (M indices), carry).
  carry = (draft cache, `[B]` rows with bad draft logits, None)."""
  def read(carry, tokens, parents, level):
    cache, bad, _ = carry
    draft_tokens = jnp.concatenate([prev[:, None], tokens], axis=1)
    logits, cache = draft_def.extend_tree(draft_params, draft_tokens,
                                          token_trees.layout(_draft_parents(parents)),
                                          draft_def.rollback(cache, base))
    return logits[:, level + 1], (cache, bad | common.bad_rows(logits), None)
  return read


def _feature_reader(draft_def, draft_params, block: tuple, target_lengths, pool: int):
  """`_token_reader` for a `protocol.FeatureConditionedDraft` (EAGLE): each node is read with
  the feature before it, its parent's as the draft predicted it.

  The root's read (m = 1) re-reads the last round's appended tokens with the target's
  features before them (`block`: the loop state's `feature_tokens`, `draft_features` and
  `feature_count`; `common.reread_feature_block`), as a chain's round
  starts (`speclm.decoding`), and gives the root's predicted feature. Every later read rolls
  back to C = `target_lengths` + 1 and extends the m − 1 nodes under the root in one
  `extend_tree_with_features` call, each with its parent's predicted feature: the nodes'
  features depend only on their path, so re-reading the earlier ones gives the features they
  had. carry's last entry holds each node's predicted feature `[B, pool, D']` (None before the
  root's read).
  """
  def read(carry, tokens, parents, level):
    cache, bad, predicted = carry
    if tokens.shape[1] == 1:
      logits, cache, feature = common.reread_feature_block(
          draft_def, draft_params, cache, *block, target_lengths)
      predicted = jnp.zeros((feature.shape[0], pool, feature.shape[-1]), feature.dtype)
      predicted = predicted.at[:, 0].set(feature[:, 0])
      return logits[:, None], (cache, bad | common.bad_rows(logits), predicted)
    below = parents[:, 1:]  # the nodes under the root; the root's children are this tree's roots
    before = jnp.take_along_axis(predicted, below[:, :, None], axis=1)
    logits, features, cache = draft_def.extend_tree_with_features(
        draft_params, tokens[:, 1:], before, token_trees.layout(below - 1),
        draft_def.rollback(cache, target_lengths + 1))
    predicted = predicted.at[:, 1:tokens.shape[1]].set(features.astype(predicted.dtype))
    return logits[:, level - 1], (cache, bad | common.bad_rows(logits), predicted)
  return read


def drafted_nodes(tree) -> int:
  """Nodes the draft builds per round, the root included: a static tree's, or a dynamic
  tree's whole pool (before the best `num_nodes` are kept)."""
  return 1 + (tree.num_nodes if isinstance(tree, token_trees.TreeShape) else tree.pool_size)


def _draft_static_tree(read, carry, pending, tree, sampling, rng, vocab: int):
  """Builds a `TreeShape`'s candidates, depth by depth, with `read` (`_token_reader`,
  `_feature_reader`) from `carry`. Returns (tokens `[B, N]`, parents `[B, N]`, q̃ per node
  `[B, N, V]` (zero for leaves), proposals `[B, N, V]`, the reader's carry, None)."""
  batch = pending.shape[0]
  parents = np.asarray(tree.parents, np.int32)
  depths = np.asarray(tree.depths)
  ranks = np.asarray(tree.ranks)
  num = len(parents)
  rule = 'top_k' if sampling.is_greedy else tree.candidates
  tokens = jnp.zeros((batch, num), jnp.int32).at[:, 0].set(pending)
  node_probs = jnp.zeros((batch, num, vocab), jnp.float32)
  parents_b = jnp.broadcast_to(jnp.asarray(parents), (batch, num))
  keys = jax.random.split(rng, tree.depth)
  for depth in range(tree.depth):
    fed = int(np.sum(depths <= depth))  # the nodes up to this depth (breadth-first order)
    level = np.flatnonzero(depths == depth)  # the nodes at this depth
    level_logits, carry = read(carry, tokens[:, :fed], parents_b[:, :fed], level)
    level_probs = sampling_lib.standardize(level_logits, sampling)
    node_probs = node_probs.at[:, level].set(level_probs)
    children = np.flatnonzero(depths == depth + 1)
    width = max(int(ranks[c]) for c in children) + 1
    chosen = _choose_children(keys[depth], level_logits, level_probs, width, rule)
    parent_slot = np.searchsorted(level, parents[children])  # each child's parent in `level`
    tokens = tokens.at[:, children].set(chosen[:, parent_slot, ranks[children]])
  if rule == 'sample':
    proposals = speculative.without_replacement_proposals(node_probs, tokens, parents_b)
  else:
    proposals = jax.nn.one_hot(tokens, vocab, dtype=jnp.float32)
  return tokens, parents_b, node_probs, proposals, carry, None


def _draft_dynamic_tree(read, carry, pending, tree, sampling, vocab: int):
  """Builds an EAGLE-2 `DynamicTree` (see its docstring) with `read` from `carry`. Returns
  what `_draft_static_tree` does, with `[B, N]` each kept node's index in the draft's pool
  (for compaction) last."""
  batch = pending.shape[0]
  k, w = tree.top_k, tree.width
  pool = drafted_nodes(tree)
  tokens = jnp.zeros((batch, pool), jnp.int32).at[:, 0].set(pending)
  parents = jnp.full((batch, pool), -1, jnp.int32)
  scores = jnp.zeros((batch, pool), jnp.float32)  # log path probability under the draft
  node_probs = jnp.zeros((batch, pool, vocab), jnp.float32)
  level = np.arange(1)  # pool nodes of the current depth
  end = 1
  for _ in range(tree.depth):
    level_logits, carry = read(carry, tokens[:, :end], parents[:, :end], level)  # [B, M, V]
    node_probs = node_probs.at[:, level].set(sampling_lib.standardize(level_logits, sampling))
    # Expand the `width` nodes of this depth with the highest path probability (all of them
    # at the root), each with the draft's `top_k` choices.
    expand = min(w, len(level))
    best = jax.lax.top_k(scores[:, level], expand)[1]  # [B, expand] positions in `level`
    chosen_logits = jnp.take_along_axis(level_logits, best[:, :, None], axis=1)
    log_q = jax.nn.log_softmax(chosen_logits.astype(jnp.float32), axis=-1)
    top_tokens = sampling_lib.top_k_indices(log_q, k)  # [B, expand, k]
    top_log_q = jnp.take_along_axis(log_q, top_tokens, axis=-1)
    parent_index = jnp.asarray(level)[best]  # [B, expand] pool indices
    child_scores = (jnp.take_along_axis(scores, parent_index, axis=1)[:, :, None] + top_log_q)
    new = np.arange(end, end + expand * k)
    tokens = tokens.at[:, new].set(top_tokens.reshape(batch, -1).astype(jnp.int32))
    parents = parents.at[:, new].set(jnp.repeat(parent_index, k, axis=1))
    scores = scores.at[:, new].set(child_scores.reshape(batch, -1))
    level, end = new, end + expand * k
  # Keep the root and the N best drafted nodes (ties: the earlier node, so ancestors first),
  # in pool order, which is topological.
  ranked = jnp.argsort(-jnp.where(jnp.arange(pool) == 0, jnp.inf, scores), axis=1, stable=True)
  kept = jnp.sort(ranked[:, :tree.num_nodes + 1], axis=1)  # [B, N]; kept[:, 0] = 0, the root
  inverse = jax.vmap(lambda sel: jnp.zeros((pool,), jnp.int32).at[sel].set(
      jnp.arange(sel.shape[0], dtype=jnp.int32)))(kept)
  pool_parents = jnp.take_along_axis(parents, kept, axis=1)
  new_parents = jnp.where(pool_parents >= 0,
                          jnp.take_along_axis(inverse, jnp.maximum(pool_parents, 0), axis=1), -1)
  tokens = jnp.take_along_axis(tokens, kept, axis=1)
  node_probs = jnp.take_along_axis(node_probs, kept[:, :, None], axis=1)
  proposals = jax.nn.one_hot(tokens, vocab, dtype=jnp.float32)
  return tokens, new_parents, node_probs, proposals, carry, kept


# ----------------------------------------------------------------------------------------------
# Statistics


def _count_tree_round(stats: common.DecodeStats, result: speculative.TreeRoundResult,
                      parents, node_probs, target_probs, active, good, draft_calls: int,
                      max_children: int) -> common.DecodeStats:
  """Adds one tree round: the accepted depth, β along the reached nodes, per-rank counts."""
  depth = result.path.shape[1]
  n = result.num_accepted
  # The reached nodes: the root and the accepted path, in order [B, D+1].
  reached = jnp.concatenate([jnp.zeros_like(result.path[:, :1]), result.path], axis=1)
  on_path = (jnp.arange(depth + 1)[None, :] <= n[:, None]) & good[:, None]
  num_children = jnp.sum(jax.nn.one_hot(parents, parents.shape[1], dtype=jnp.int32), axis=1)
  children_of_reached = jnp.take_along_axis(num_children, reached, axis=1)  # [B, D+1]
  drafted_from = on_path & (children_of_reached > 0)
  # β = Σ_x min(p̃, q̃) at each reached node that has children (Theorem 3.5): the chain's α.
  beta = speculative.acceptance_overlap(
      jnp.take_along_axis(target_probs, reached[:, :, None], axis=1),
      jnp.take_along_axis(node_probs, reached[:, :, None], axis=1))
  beta_row = jnp.sum(jnp.where(drafted_from, beta, 0.0), axis=1)
  count_row = jnp.sum(drafted_from, axis=1).astype(jnp.int32)
  # Ranks: at reached node i (< n), the kept child is reached[i+1].
  ranks = token_trees.sibling_ranks(parents)
  kept_rank = jnp.take_along_axis(ranks, reached[:, 1:], axis=1)  # [B, D]
  kept_rank = jnp.where(jnp.arange(depth)[None, :] < n[:, None], kept_rank, -1)
  rank_axis = jnp.arange(max_children)
  offered = jnp.sum(drafted_from[:, :, None]
                    & (children_of_reached[:, :, None] > rank_axis), axis=(0, 1))
  accepted = jnp.sum((kept_rank[:, :, None] == rank_axis) & good[:, None, None], axis=(0, 1))
  stats = common.add_round(stats, num_accepted=n, active=active, good=good,
                           beta_row=beta_row, count_row=count_row, drafted=depth,
                           draft_calls=draft_calls)
  return stats.replace(rank_offered=stats.rank_offered + offered.astype(jnp.int32),
                       rank_accepted=stats.rank_accepted + accepted.astype(jnp.int32))


# ----------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass(frozen=True)
class _TreeLoop:
  """What every round of one traced `_tree_loop` reads: the models, limits `[B]`, end tokens
  `[E]`, and the static tree and sampling rule."""

  target_def: protocol.LanguageModel
  draft_def: protocol.LanguageModel
  target_params: object
  draft_params: object
  limits: jax.Array
  eos_id: jax.Array
  tree: token_trees.TreeShape | token_trees.DynamicTree
  sampling: sampling_lib.SamplingConfig

  @property
  def with_features(self) -> bool:
    """Whether the draft reads the target's features (EAGLE)."""
    return isinstance(self.draft_def, protocol.FeatureConditionedDraft)


def _tree_loop(target_def, draft_def, target_params, draft_params, prompts, lengths, limits,
               rng, eos_id, pad_id, *, tree, sampling, buffer_length, target_capacity,
               draft_capacity) -> common.DecodeResult:
  """Speculative rounds over `tree` in a while loop (the module docstring's steps 1–4)."""
  batch = prompts.shape[0]
  max_children = _max_children(tree)
  draft_cache = draft_def.init_cache(batch, draft_capacity)
  target_cache = target_def.init_cache(batch, target_capacity)
  loop = _TreeLoop(target_def=target_def, draft_def=draft_def, target_params=target_params,
                   draft_params=draft_params, limits=limits, eos_id=eos_id, tree=tree,
                   sampling=sampling)
  draft_features = None
  if loop.with_features:
    logits, features, target_cache = target_def.prefill_with_features(
        target_params, prompts, lengths, target_cache)
    draft_cache, draft_features = common.prefill_feature_draft(
        draft_def, draft_params, prompts, lengths, features, draft_cache)
  else:
    _, draft_cache = draft_def.prefill(draft_params, prompts, lengths, draft_cache)
    logits, target_cache = target_def.prefill(target_params, prompts, lengths, target_cache)
  state = common.start(
      target_def, prompts, lengths, limits, rng, eos_id, sampling, buffer_length, tree.depth,
      logits=logits, target_cache=target_cache, draft_cache=draft_cache,
      draft_features=draft_features)
  if loop.with_features:
    state = common.first_feature_block(state, tree.depth + 1)
  stats = state.stats
  state = state.replace(stats=stats.replace(
      draft_calls=stats.draft_calls + 1,
      rank_offered=jnp.zeros((max_children,), jnp.int32),
      rank_accepted=jnp.zeros((max_children,), jnp.int32)))
  state = jax.lax.while_loop(lambda s: jnp.any(s.active), functools.partial(_tree_round, loop),
                             state)
  return common.finish(state, pad_id)


def _tree_round(loop: _TreeLoop, state: common.LoopState) -> common.LoopState:
  """One round for every row: the draft builds the tree, one target call verifies it,
  recursive rejection keeps a path, both caches keep it, its tokens are appended."""
  tree, sampling = loop.tree, loop.sampling
  batch, depth, num_nodes = state.tokens.shape[0], tree.depth, tree.num_nodes + 1
  # The target writes N slots after C−1; the draft `draft_lookahead` after C−2.
  state, target_lengths, active, keys = common.begin_round(
      state, loop.target_def, loop.draft_def, num_nodes,
      _draft_lookahead(tree, loop.draft_def))
  rng, draft_key, uniform_key, next_key = keys
  # 1. The draft builds the tree under [s_{C−2}, s_{C−1}] (an EAGLE draft: under the last
  #    round's appended tokens, re-read), one call per depth.
  base = target_lengths - 1
  block = (state.feature_tokens, state.draft_features, state.feature_count)
  read = (_feature_reader(loop.draft_def, loop.draft_params, block, target_lengths,
                          drafted_nodes(tree))
          if loop.with_features else
          _token_reader(loop.draft_def, loop.draft_params, state.prev_token, base))
  carry = (loop.draft_def.rollback(state.draft_cache, base), jnp.zeros((batch,), bool), None)
  vocab = loop.draft_def.vocab_size
  if isinstance(tree, token_trees.TreeShape):
    built = _draft_static_tree(read, carry, state.pending_token, tree, sampling, draft_key,
                               vocab)
  else:
    built = _draft_dynamic_tree(read, carry, state.pending_token, tree, sampling, vocab)
  tokens, parents, node_probs, proposals, (draft_cache, draft_bad, _), pool_index = built
  # 2. One target call over the whole tree: p̃ at every node (and, for an EAGLE draft, the
  #    target's features there).
  features = None
  if loop.with_features:
    logits, features, target_cache = loop.target_def.extend_tree_with_features(
        loop.target_params, tokens, token_trees.layout(parents), state.target_cache)
  else:
    logits, target_cache = loop.target_def.extend_tree(
        loop.target_params, tokens, token_trees.layout(parents), state.target_cache)
  target_probs = sampling_lib.standardize(logits, sampling)
  # 3. Walk down the tree by recursive rejection; n kept, one more token t drawn.
  uniforms = jax.random.uniform(uniform_key, (batch, num_nodes))
  result = speculative.tree_round(target_probs, tokens, parents, proposals, uniforms,
                                  next_key, depth)
  n = result.num_accepted
  # 4. Compaction (`_keep_path`), then append x_1 … x_n, t as a chain does.
  target_cache, draft_cache = _keep_path(loop, target_cache, draft_cache, target_lengths,
                                         result, pool_index, active)
  path_tokens = jnp.take_along_axis(tokens, result.path, axis=1)  # [B, D]
  padded, new_tokens = common.round_tokens(path_tokens, n, result.next_token)
  appended, num_generated, reasons, good, prev = common.commit_round(
      state, active, padded, new_tokens, n, active & (common.bad_rows(logits) | draft_bad),
      loop.limits, loop.eos_id)
  if features is not None:
    state = _next_path_block(state, new_tokens, features, result, good)
  return state.replace(
      tokens=appended, num_generated=num_generated,
      prev_token=jnp.where(good, prev, state.prev_token),
      pending_token=jnp.where(good, result.next_token, state.pending_token),
      stop_reasons=reasons, target_cache=target_cache, draft_cache=draft_cache, rng=rng,
      stats=_count_tree_round(state.stats, result, parents, node_probs, target_probs, active,
                              good, depth, _max_children(tree)))


def _next_path_block(state: common.LoopState, new_tokens, features,
                     result: speculative.TreeRoundResult, good) -> common.LoopState:
  """The next round's re-read block for an EAGLE draft (`common.next_feature_block`): the
  appended tokens with the target's features `[B, N, D]` of the root and the kept path."""
  reached = jnp.concatenate([jnp.zeros_like(result.path[:, :1]), result.path], axis=1)
  return common.next_feature_block(
      state, new_tokens, jnp.take_along_axis(features, reached[:, :, None], axis=1),
      result.num_accepted, good)


def _keep_path(loop: _TreeLoop, target_cache, draft_cache, target_lengths,
               result: speculative.TreeRoundResult, pool_index, active) -> tuple:
  """Compaction: the kept path's entries move next to the prefix in both caches, and the
  target keeps C−1+n+1 positions (active rows). `pool_index` `[B, N]` maps a dynamic tree's
  nodes to the draft's pool (None for a static tree). Returns (target cache, draft cache)."""
  batch, n = result.path.shape[0], result.num_accepted
  root = jnp.zeros((batch, 1), jnp.int32)
  target_cache = loop.target_def.keep_tree_path(
      target_cache, target_lengths, jnp.concatenate([root, result.path], axis=1))
  target_cache = loop.target_def.rollback(
      target_cache, jnp.where(active, target_lengths + n + 1, target_lengths))
  draft_path = (result.path if pool_index is None
                else jnp.take_along_axis(pool_index, result.path, axis=1))
  draft_cache = loop.draft_def.keep_tree_path(
      draft_cache, target_lengths - 1,
      jnp.concatenate([root, root + 1, draft_path + 1], axis=1))
  return target_cache, draft_cache


_tree_jit = jax.jit(
    _tree_loop, static_argnums=(0, 1),
    static_argnames=('tree', 'sampling', 'buffer_length', 'target_capacity', 'draft_capacity'))
