"""Token trees: shapes, tree attention and compaction in the models, and exact tree decoding.

What this proves (issue: token trees with exact verification):
  * `extend_tree` gives every node the logits of its own path, for Llama, T5 and the lookup
    draft, on a batch whose rows have different lengths; after `keep_tree_path` the next
    call's logits equal a fresh run over the same tokens (compaction).
  * Greedy tree decoding equals the baseline token for token (static and dynamic trees,
    Llama and T5, lookup first), and a chain-shaped tree equals `speculative_decode`.
  * Sampled tree decoding fits the target's enumerated sequence distribution (chi-square) at
    T = 1, T = 0.7 with top-k and top-p, with 2–3 children per node, sampled and deterministic
    candidates, static and dynamic trees, token drafts and EAGLE-3 drafts (behind lookup or
    not); a deliberately wrong sibling residual is rejected by the same test.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import speculative
from speclm import testing
from speclm import token_trees
from speclm import tree_decoding
from speclm.models import eagle
from speclm.models import llama
from speclm.models import lookup
from speclm.models import ngram
from speclm.models import t5

TreeShape = token_trees.TreeShape


# ----------------------------------------------------------------------------------------------
# Shapes


def test_shapes_from_paths_and_branching():
  tree = TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
  assert tree.parents == (-1, 0, 0, 1, 1, 2, 3)
  assert tree.depths == (0, 1, 1, 2, 2, 2, 3)
  assert tree.ranks == (0, 0, 1, 0, 1, 0, 0)
  assert (tree.num_nodes, tree.depth, tree.max_children) == (6, 3, 2)
  assert tree.rank_paths() == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
  assert TreeShape.from_branching((2, 2, 1)).num_nodes == 2 + 4 + 4
  assert TreeShape.chain(3).parents == (-1, 0, 1, 2)
  assert TreeShape.from_branching((1, 1, 1)) == TreeShape.chain(3)


@pytest.mark.parametrize('paths,message', [
    ([(0, 0)], 'no parent path'),
    ([(0,), (2,)], 'without gaps'),
    ([], 'non-empty'),
])
def test_bad_paths_are_refused(paths, message):
  with pytest.raises(ValueError, match=message):
    TreeShape.from_paths(paths)


def test_bad_trees_are_refused():
  with pytest.raises(ValueError, match='parents must come first'):
    TreeShape((-1, 0, 3, 1))
  with pytest.raises(ValueError, match='candidates must be'):
    TreeShape.chain(2, candidates='beam')
  with pytest.raises(ValueError, match='exceeds the nodes drafted'):
    token_trees.DynamicTree(num_nodes=50, depth=2, top_k=2, width=2)
  with pytest.raises(ValueError, match='width'):
    token_trees.DynamicTree(num_nodes=4, depth=2, top_k=2, width=3)


def test_layout_depths_and_ancestors():
  parents = np.array([[-1, 0, 0, 1, 2, 3], [-1, 0, 1, 2, 3, 4]])
  layout = token_trees.layout(parents)
  np.testing.assert_array_equal(layout.depths, [[0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 4, 5]])
  ancestors = np.asarray(layout.ancestors)
  assert ancestors[0, 5].tolist() == [True, True, False, True, False, True]
  assert ancestors[0, 4].tolist() == [True, False, True, False, True, False]
  np.testing.assert_array_equal(ancestors[1], np.tril(np.ones((6, 6), bool)))  # a chain
  np.testing.assert_array_equal(token_trees.sibling_ranks(jnp.asarray(parents))[0],
                                [0, 0, 1, 0, 0, 0])


# ----------------------------------------------------------------------------------------------
# Models: tree attention and compaction

PROMPTS = np.array([[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 0, 0, 0, 0], [5, 3, 5, 3, 5, 3, 0]],
                   np.int32)
LENGTHS = np.array([7, 3, 6], np.int32)
BRANCHY = TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)])


def _path_to(parents, node):
  path = [node]
  while parents[path[-1]] >= 0:
    path.append(parents[path[-1]])
  return path[::-1]


def _models():
  target = llama.random_model(vocab_size=16, embed_dim=32, num_layers=2, seed=1)
  return {'llama': target, 't5': t5.random_model(vocab_size=16, seed=2),
          'lookup_first': lookup.lookup_first(target, min_ngram=1)}


@pytest.fixture(scope='module')
def models():
  return _models()


@pytest.mark.parametrize('name', ['llama', 't5', 'lookup_first'])
def test_tree_nodes_see_their_own_path_and_compaction_restores_a_sequence(models, name):
  model = models[name]
  d = model.definition
  cache = d.init_cache(3, 32)
  _, cache = d.prefill(model.params, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), cache)
  start = d.cache_lengths(cache)
  parents = BRANCHY.parents
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (3, len(parents))), jnp.int32)
  layout = token_trees.layout(np.tile(parents, (3, 1)))
  logits, tree_cache = d.extend_tree(model.params, tokens, layout, cache)
  assert int(d.cache_lengths(tree_cache)[0]) == int(start[0]) + len(parents)
  # A chain over each node's path, right-padded to the deepest path: position len(path) − 1
  # sees the path only (causal), so one compiled call serves every node.
  extend = jax.jit(d.extend)
  width = BRANCHY.depth + 1
  for node in range(len(parents)):
    path = _path_to(parents, node)
    padded = jnp.pad(tokens[:, path], ((0, 0), (0, width - len(path))))
    chain = extend(model.params, padded, cache)[0][:, len(path) - 1]
    if name == 'lookup_first':
      # Where the lookup matches, the chain's q is one-hot on its proposal and the tree's
      # keeps the fallback's order far below it: the same first choice; elsewhere the same.
      matched = np.isinf(np.asarray(chain)).any(axis=-1)
      np.testing.assert_array_equal(jnp.argmax(logits[:, node], -1), jnp.argmax(chain, -1))
      np.testing.assert_allclose(logits[~matched, node], chain[~matched], atol=3e-5, rtol=1e-5)
      assert np.all(np.asarray(logits[matched, node]).max(-1)
                    > np.asarray(logits[matched, node]).min(-1) + 50)
    else:
      np.testing.assert_allclose(logits[:, node], chain, atol=3e-5, rtol=1e-5)
  # Keep a different path in each row (0-1-4, 0-2-6-8, 0-3), then append one token: the
  # logits equal a fresh run over the kept tokens and that token.
  paths = np.array([[0, 1, 4, 0], [0, 2, 6, 8], [0, 3, 0, 0]])
  kept = np.array([3, 4, 2])
  compact = d.keep_tree_path(tree_cache, start, jnp.asarray(paths))
  compact = d.rollback(compact, start + kept)
  following = jnp.asarray([[7], [8], [9]], jnp.int32)
  after = extend(model.params, jnp.pad(following, ((0, 0), (0, width - 1))), compact)[0][:, 0]
  fresh_tokens = np.zeros((3, width + 1), np.int32)
  for row in range(3):
    fresh_tokens[row, :kept[row] + 1] = np.append(np.asarray(tokens[row, paths[row, :kept[row]]]),
                                                  following[row])
  fresh = extend(model.params, jnp.asarray(fresh_tokens), cache)[0]
  np.testing.assert_allclose(after, fresh[np.arange(3), kept], atol=3e-5, rtol=1e-5)


def test_models_without_trees_are_refused():
  target = llama.random_model(vocab_size=16, embed_dim=32, num_layers=1)

  class NoTrees(llama.Llama):
    extend_tree = speclm.protocol.LanguageModel.extend_tree

  draft = speclm.Model(NoTrees(target.definition.config), target.params)
  with pytest.raises(ValueError, match='does not implement extend_tree'):
    tree_decoding.tree_speculative_decode(target, draft, PROMPTS, LENGTHS,
                                          tree=TreeShape.chain(2))
  with pytest.raises(ValueError, match='TreeShape'):
    tree_decoding.tree_speculative_decode(target, target, PROMPTS, LENGTHS, tree=3)


# ----------------------------------------------------------------------------------------------
# Greedy: the baseline's tokens


def _perturbed(model, scale, seed):
  leaves, tree = jax.tree_util.tree_flatten(model.params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return speclm.Model(model.definition, jax.tree_util.tree_unflatten(
      tree, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape)
             for x, k in zip(leaves, keys)]))


GREEDY_TREES = [
    ('chain3', TreeShape.chain(3)),
    ('branchy', BRANCHY),
    ('dynamic', token_trees.DynamicTree(num_nodes=8, depth=4, top_k=3, width=2)),
]


@pytest.mark.parametrize('kind,name,tree', [('llama',) + t for t in GREEDY_TREES]
                         + [('t5',) + t for t in GREEDY_TREES[1:]],
                         ids=[f'llama-{t[0]}' for t in GREEDY_TREES]
                         + [f't5-{t[0]}' for t in GREEDY_TREES[1:]])
def test_greedy_trees_equal_the_baseline(kind, name, tree):
  if kind == 'llama':
    target = llama.random_model(vocab_size=32, embed_dim=32, num_layers=2, seed=1)
  else:
    target = t5.random_model(vocab_size=32, seed=3)
  draft = _perturbed(target, 0.3, 9)
  if kind == 'llama':
    draft = lookup.lookup_first(draft, min_ngram=1)
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=[20, 13, 17])
  result = tree_decoding.tree_speculative_decode(target, draft, PROMPTS, LENGTHS, tree=tree,
                                                 max_new_tokens=[20, 13, 17])
  np.testing.assert_array_equal(result.tokens, base.tokens)
  np.testing.assert_array_equal(result.lengths, base.lengths)
  stats = result.stats
  assert 1.5 < result.tokens_per_target_call  # the draft is close: rounds keep several tokens
  assert int(np.sum(stats.accepted_histogram)) == int(np.sum(stats.target_calls_per_row)) - 3
  assert np.all(np.asarray(stats.rank_accepted) <= np.asarray(stats.rank_offered))
  if name == 'chain3':  # the chain's rounds exactly, statistics included (lookup-first too)
    chain = speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=3,
                                      max_new_tokens=[20, 13, 17])
    for field in ('accepted_histogram', 'target_calls_per_row', 'beta_count', 'draft_calls'):
      np.testing.assert_array_equal(getattr(stats, field), getattr(chain.stats, field))
    assert abs(stats.alpha - chain.stats.alpha) < 1e-6


def test_a_dynamic_tree_whose_pool_outgrows_its_nodes_decodes_to_the_end():
  """An EAGLE-2 draft extends everything it drafted so far at each depth: keeping 4 nodes of
  a pool drafted at depth 4, top-4, width 4, its last call reads 38 positions, more than the
  whole draft cache that the 4 nodes sized before (a shape error; a write clamped onto
  earlier positions where it only ran past the end). The draft's cache and its stop check
  follow `token_trees.draft_lookahead`, so greedy output runs to the limit, equal to the
  baseline's."""
  target = llama.random_model(vocab_size=32, embed_dim=32, num_layers=2, seed=1)
  draft = _perturbed(target, 0.3, 9)
  tree = token_trees.DynamicTree(num_nodes=4, depth=4, top_k=4, width=4)
  assert token_trees.draft_lookahead(tree) == 38
  assert token_trees.draft_lookahead(TreeShape.chain(3)) == 5
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=12)
  result = tree_decoding.tree_speculative_decode(target, draft, PROMPTS, LENGTHS, tree=tree,
                                                 max_new_tokens=12)
  np.testing.assert_array_equal(result.tokens, base.tokens)
  np.testing.assert_array_equal(result.stop_reasons, base.stop_reasons)


def test_greedy_tree_with_end_token_and_bigram_draft():
  target = llama.random_model(vocab_size=32, embed_dim=32, num_layers=2, seed=4)
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=24)
  eos = int(np.asarray(base.tokens)[0, 5])  # row 0 ends early
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=24, eos_id=eos)
  replies = [list(r) for r in base.to_lists()]
  draft = ngram.estimate_bigram(replies, 32, max_successors=4)
  result = tree_decoding.tree_speculative_decode(
      target, draft, PROMPTS, LENGTHS, tree=TreeShape.from_branching((3, 1, 1)),
      max_new_tokens=24, eos_id=eos)
  np.testing.assert_array_equal(result.tokens, base.tokens)
  np.testing.assert_array_equal(result.stop_reasons, base.stop_reasons)


# ----------------------------------------------------------------------------------------------
# Sampling: the target's distribution, exactly

VOCAB = 6
NEW_TOKENS = 3
SAMPLES = 20_000
SIGNIFICANCE = 1e-3
PROMPT = np.array([3, 1, 4, 1, 5], np.int32)


@pytest.fixture(scope='module')
def small():
  target = llama.random_model(vocab_size=VOCAB, embed_dim=16, num_layers=2, seed=21,
                              num_heads=2, num_kv_heads=1)
  unrelated = llama.random_model(vocab_size=VOCAB, embed_dim=8, num_layers=1, seed=5,
                                 num_heads=2, num_kv_heads=1)
  eagle3 = eagle.random_draft(target, num_layers=1, head_size=5, seed=3, feature_layers=(0, 1),
                              input_norms=True)  # q̃ = 0 on the token outside its head
  return {'target': target, 'unrelated': unrelated, 'related': _perturbed(target, 0.5, 9),
          'lookup_first': lookup.lookup_first(unrelated, min_ngram=1), 'eagle3': eagle3,
          'lookup_eagle3': lookup.lookup_first(eagle3, min_ngram=1)}


def _exact(target, sampling):
  forward = jax.jit(target.definition.forward)

  def teacher_forced(continuations):
    seqs = np.concatenate([np.tile(PROMPT, (len(continuations), 1)), continuations], axis=1)
    return np.asarray(forward(target.params, seqs)[:, len(PROMPT) - 1:-1])

  return testing.exact_continuation_distribution(teacher_forced, VOCAB, NEW_TOKENS, sampling)[1]


def _tree_samples(small, draft_name, tree, sampling, seed=1):
  result = tree_decoding.tree_speculative_decode(
      small['target'], small[draft_name], np.tile(PROMPT, (SAMPLES, 1)),
      np.full((SAMPLES,), len(PROMPT)), tree=tree, sampling=sampling,
      max_new_tokens=NEW_TOKENS, seed=seed)
  assert np.all(np.asarray(result.lengths) == NEW_TOKENS)
  return testing.sequence_ids(np.asarray(result.tokens), VOCAB), result.stats


T1 = speclm.SamplingConfig(temperature=1.0)
SAMPLED_TREE = TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)],
                                    candidates='sample')
CASES = [
    ('t1_sampled_3children', T1, 'unrelated', SAMPLED_TREE),
    ('t1_top_k_candidates', T1, 'related', TreeShape.from_branching((3, 2))),
    ('t0.7_top3_sampled', speclm.SamplingConfig(temperature=0.7, top_k=3), 'related',
     TreeShape.from_branching((2, 2), candidates='sample')),
    ('top_p0.8_top_k_candidates', speclm.SamplingConfig(top_p=0.8), 'unrelated',
     TreeShape.from_branching((3, 2))),
    ('t1_dynamic_lookup_first', T1, 'lookup_first',
     token_trees.DynamicTree(num_nodes=6, depth=3, top_k=2, width=2)),
    ('t1_sampled_lookup_eagle3', T1, 'lookup_eagle3', SAMPLED_TREE),
    ('t0.7_dynamic_eagle3', speclm.SamplingConfig(temperature=0.7), 'eagle3',
     token_trees.DynamicTree(num_nodes=6, depth=3, top_k=2, width=2)),
]


@pytest.mark.slow  # with the rest of this module: its group is handed out first
@pytest.mark.parametrize('name,sampling,draft_name,tree', CASES, ids=[c[0] for c in CASES])
def test_tree_samples_fit_the_exact_distribution(small, name, sampling, draft_name, tree):
  del name
  ids, stats = _tree_samples(small, draft_name, tree, sampling)
  pvalue = testing.chi_square_pvalue(ids, _exact(small['target'], sampling))
  assert pvalue > SIGNIFICANCE, f'p-value {pvalue:.2e}'
  # The tree really was used: rounds stopped at the root and went deeper; later siblings won.
  hist = np.asarray(stats.accepted_histogram)
  assert hist[0] > 0 and hist[1:].sum() > 0
  assert np.asarray(stats.rank_accepted)[1:].sum() > 0


def test_wrong_sibling_residual_is_rejected(small, monkeypatch):
  """Siblings drawn without replacement but tested as if drawn from q̃ itself (the residual
  of SpecInfer's with-replacement rule): the output is biased, and the test sees it."""
  monkeypatch.setattr(
      speculative, 'without_replacement_proposals',
      lambda node_probs, tokens, parents: jnp.take_along_axis(
          node_probs, jnp.maximum(parents, 0)[:, :, None], axis=1))
  jax.clear_caches()
  try:
    ids, _ = _tree_samples(small, 'unrelated', SAMPLED_TREE, T1)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  pvalue = testing.chi_square_pvalue(ids, _exact(small['target'], T1))
  assert pvalue < SIGNIFICANCE, f'the wrong sibling residual passed with p-value {pvalue:.3g}'


def test_one_tree_round_on_probability_arrays():
  """One round of `speculative.tree_round`, the first token over many rows: p̃ at the root,
  for sampled siblings (corrected residuals) and deterministic ones (one-hot proposals)."""
  rows, vocab = 40_000, 5
  p = jnp.asarray([0.4, 0.3, 0.15, 0.1, 0.05])
  q = jnp.asarray([0.05, 0.1, 0.2, 0.25, 0.4])
  parents = jnp.broadcast_to(jnp.asarray([-1, 0, 0, 0]), (rows, 4))
  key_draw, key_u, key_next = jax.random.split(jax.random.key(0), 3)
  gumbel = jnp.log(q) + jax.random.gumbel(key_draw, (rows, vocab))
  children = jax.lax.top_k(gumbel, 3)[1].astype(jnp.int32)
  tokens = jnp.concatenate([jnp.zeros((rows, 1), jnp.int32), children], axis=1)
  node_probs = jnp.zeros((rows, 4, vocab)).at[:, 0].set(q)
  target_probs = jnp.broadcast_to(p, (rows, 4, vocab))
  uniforms = jax.random.uniform(key_u, (rows, 4))
  for proposals in (speculative.without_replacement_proposals(node_probs, tokens, parents),
                    jax.nn.one_hot(tokens, vocab)):
    result = speculative.tree_round(target_probs, tokens, parents, proposals, uniforms,
                                    key_next, depth=1)
    first = jnp.where(result.num_accepted > 0,
                      jnp.take_along_axis(tokens, result.path, axis=1)[:, 0], result.next_token)
    assert testing.chi_square_pvalue(np.asarray(first), np.asarray(p)) > SIGNIFICANCE


# ----------------------------------------------------------------------------------------------
# Statistics against the theory


def test_measured_tokens_per_call_match_the_tree_theory():
  """Context-free models (a unigram target and draft) make the per-rank acceptance rates the
  same at every node: the draft's r-th choice x_r is kept with probability p(x_r). Measured
  rates and tokens per round must then match `theory.tree_expected_tokens`."""
  from speclm.analysis import theory  # pylint: disable=import-outside-toplevel
  vocab = 8
  p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
  q = np.array([0.1, 0.35, 0.05, 0.25, 0.05, 0.1, 0.05, 0.05])  # choices: tokens 1, 3, 0
  unigram = lambda probs: speclm.Model(ngram.Unigram(vocab), {'log_probs': jnp.log(probs)})
  tree = TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])
  rows = 2000
  result = tree_decoding.tree_speculative_decode(
      unigram(p), unigram(q), np.zeros((rows, 1), np.int32), np.ones((rows,), np.int32),
      tree=tree, sampling=T1, max_new_tokens=16, seed=3)
  stats = result.stats
  rates = theory.rank_acceptance_rates(stats.rank_accepted, stats.rank_offered)
  offered = np.asarray(stats.rank_offered)
  expected_rates = p[[1, 3, 0]]
  assert np.all(np.abs(rates - expected_rates) < 4 * np.sqrt(expected_rates / offered))
  hist = np.asarray(stats.accepted_histogram, np.float64)
  per_round = np.sum((np.arange(len(hist)) + 1) * hist) / hist.sum()
  predicted = theory.tree_expected_tokens(tree, expected_rates)
  assert abs(per_round - predicted) < 0.02 * predicted, (per_round, predicted)


def test_timing_a_tree_verification():
  from speclm.run import calibration  # pylint: disable=import-outside-toplevel
  target = llama.random_model(vocab_size=16, embed_dim=16, num_layers=1)
  seconds = calibration.time_extend(target, num_new=len(BRANCHY.parents), context_length=8,
                                    tree=BRANCHY, repeats=1, num_steps=2,
                                    min_sample_seconds=0.0)
  assert seconds > 0
  with pytest.raises(ValueError, match='tree'):
    calibration.time_extend(target, num_new=3, tree=BRANCHY)
  r = calibration.time_tree_verifications(target, [BRANCHY, TreeShape.chain(2)],
                                          context_length=8, repeats=2, num_steps=2,
                                          min_sample_seconds=0.0)
  assert len(r) == 2 and all(x > 0 for x in r)
