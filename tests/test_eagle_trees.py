"""Token trees drafted by a draft that reads the target's features (EAGLE, EAGLE-3, behind
prompt lookup or not): `speclm.tree_decoding` with a `protocol.FeatureConditionedDraft`.

What this proves:
  * Every node's q̃ in a drafted tree (static and EAGLE-2 dynamic, rows of different lengths)
    is what the draft gives after that node's own path, read as a chain: [s_{C−2}, s_{C−1}]
    with the target's features, then each token with the feature the draft predicted before
    it. A node fed a sibling's or cousin's feature, or seeing one in attention, fails.
  * `extend_tree_with_features` of a Llama target gives each node the logits and features of
    its own path.
  * Greedy tree decoding equals the baseline token for token; a chain-shaped tree makes the
    rounds of `speculative_decode` (the same acceptance histogram and calls: the features
    handed to the next round are the kept path's).
  * Sampling: χ² cases over EAGLE drafts are in `test_token_trees.py` (CASES).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import decode_common
from speclm import token_trees
from speclm import tree_decoding
from speclm.models import eagle
from speclm.models import llama
from speclm.models import lookup

TreeShape = token_trees.TreeShape
PROMPTS = np.array([[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 0, 0, 0, 0], [5, 3, 5, 3, 5, 3, 0]],
                   np.int32)
LENGTHS = np.array([7, 3, 6], np.int32)
BRANCHY = TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)])
DYNAMIC = token_trees.DynamicTree(num_nodes=8, depth=4, top_k=3, width=2)


@pytest.fixture(scope='module')
def target():
  return llama.random_model(vocab_size=32, embed_dim=32, num_layers=2, seed=1)


def _drafts(target):
  eagle3 = eagle.random_draft(target, num_layers=1, head_size=24, seed=1, feature_layers=(0, 1),
                              input_norms=True)
  return {'eagle': eagle.random_draft(target, num_layers=1, head_size=24, seed=2),
          'eagle3': eagle3,
          'lookup_eagle3': lookup.lookup_first(eagle3, min_ngram=1)}


def _start(target, draft):
  """Both models after the prompts, as a tree round starts: the draft rolled back to C−2,
  the pending token, the target's features before s_{C−2} and s_{C−1}."""
  target = speclm.protocol.target_for_feature_draft(target, draft)
  batch, width = PROMPTS.shape
  target_cache = target.definition.init_cache(batch, width + 16)
  _, features, _ = target.definition.prefill_with_features(target.params, PROMPTS, LENGTHS,
                                                           target_cache)
  cache, draft_features = decode_common.prefill_feature_draft(
      draft.definition, draft.params, PROMPTS, LENGTHS, features,
      draft.definition.init_cache(batch, width + 16))
  base = jnp.asarray(LENGTHS) - 1
  prev = jnp.asarray(PROMPTS[np.arange(batch), LENGTHS - 1])
  pending = jnp.asarray([6, 11, 3], jnp.int32)
  return draft.definition.rollback(cache, base), base, prev, pending, draft_features


def _chain_probs(draft, cache, base, prev, pending, draft_features, path_tokens):
  """q̃ (T = 1) after each token of `path_tokens` `[B, d]`, read as a chain."""
  definition, params = draft.definition, draft.params
  logits, predicted, cache = definition.extend_with_features(
      params, jnp.stack([prev, pending], axis=1), draft_features,
      definition.rollback(cache, base))
  feature, out = predicted[:, 1:], [logits[:, 1]]
  for i in range(path_tokens.shape[1]):
    logits, feature, cache = definition.extend_with_features(params, path_tokens[:, i:i + 1],
                                                             feature, cache)
    out.append(logits[:, 0])
  return [jax.nn.softmax(x.astype(jnp.float32), axis=-1) for x in out]


def _path(parents, node):
  path = [node]
  while parents[path[-1]] > 0:
    path.append(parents[path[-1]])
  return path[::-1] if node > 0 else []


@pytest.mark.parametrize('draft_name,tree', [('eagle', DYNAMIC), ('eagle3', BRANCHY),
                                             ('lookup_eagle3', BRANCHY),
                                             ('lookup_eagle3', DYNAMIC)],
                         ids=['eagle-dynamic', 'eagle3-static', 'lookup_eagle3-static',
                              'lookup_eagle3-dynamic'])
def test_each_node_reads_its_own_path(target, draft_name, tree):
  draft = _drafts(target)[draft_name]
  cache, base, prev, pending, draft_features = _start(target, draft)
  sampling = speclm.SamplingConfig(temperature=1.0)
  static = isinstance(tree, TreeShape)
  block = (jnp.stack([prev, pending], axis=1), draft_features, jnp.full((3,), 2, jnp.int32))
  read = tree_decoding._feature_reader(draft.definition, draft.params, block, base + 1,
                                       tree_decoding.drafted_nodes(tree))
  carry = (cache, jnp.zeros((3,), bool), None)
  vocab = draft.definition.vocab_size
  built = (tree_decoding._draft_static_tree(read, carry, pending, tree, sampling,
                                            jax.random.key(0), vocab) if static else
           tree_decoding._draft_dynamic_tree(read, carry, pending, tree, sampling, vocab))
  tokens, parents, node_probs = (np.asarray(x) for x in built[:3])
  checked = 0
  for row in range(3):
    for node in range(tokens.shape[1]):
      if not node_probs[row, node].any():
        continue  # a leaf: never read
      path = _path(parents[row], node)
      path_tokens = jnp.asarray(np.tile(tokens[row, path], (3, 1)), jnp.int32)
      expected = _chain_probs(draft, cache, base, prev, pending, draft_features, path_tokens)
      np.testing.assert_allclose(node_probs[row, node], expected[-1][row], atol=2e-5)
      checked += 1
  assert checked >= 3 * 4  # the root and nodes at depths 1 and 2 in every row
  assert np.any(np.asarray(token_trees.layout(parents).depths) >= 3)


def test_the_targets_tree_features_are_those_of_each_path(target):
  definition = target.definition.with_feature_layers((0, 1))
  cache = definition.init_cache(3, 24)
  _, _, cache = definition.prefill_with_features(target.params, PROMPTS, LENGTHS, cache)
  parents = np.asarray(BRANCHY.parents)
  tokens = jnp.asarray(np.tile(np.arange(9) + 3, (3, 1)), jnp.int32)
  logits, features, _ = definition.extend_tree_with_features(
      target.params, tokens, token_trees.layout(np.tile(parents, (3, 1))), cache)
  assert features.shape == (3, 9, 64)
  for node in (4, 7, 8):
    path = [0] + _path(parents, node)
    chain_logits, chain_features, _ = definition.extend_with_features(
        target.params, tokens[:, path], cache)
    np.testing.assert_allclose(features[:, node], chain_features[:, -1], atol=2e-5)
    np.testing.assert_allclose(logits[:, node], chain_logits[:, -1], atol=2e-5)


@pytest.mark.parametrize('draft_name,tree', [('eagle', TreeShape.chain(3)), ('eagle', DYNAMIC),
                                             ('lookup_eagle3', TreeShape.chain(3)),
                                             ('lookup_eagle3', BRANCHY)],
                         ids=['eagle-chain3', 'eagle-dynamic', 'lookup_eagle3-chain3',
                              'lookup_eagle3-static'])
def test_greedy_eagle_trees_equal_the_baseline(target, draft_name, tree):
  draft = _drafts(target)[draft_name]
  limits = [20, 13, 17]
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=limits)
  result = tree_decoding.tree_speculative_decode(target, draft, PROMPTS, LENGTHS, tree=tree,
                                                 max_new_tokens=limits)
  np.testing.assert_array_equal(result.tokens, base.tokens)
  np.testing.assert_array_equal(result.lengths, base.lengths)
  if draft_name == 'lookup_eagle3':
    assert result.tokens_per_target_call > 2.0  # the prompts repeat: rounds keep several
  if tree == TreeShape.chain(3):
    chain = speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=3,
                                      max_new_tokens=limits)
    for field in ('accepted_histogram', 'target_calls_per_row', 'beta_count', 'draft_calls'):
      np.testing.assert_array_equal(getattr(result.stats, field), getattr(chain.stats, field))


def test_drafts_without_feature_trees_are_refused(target):
  class NoTrees(type(eagle.random_draft(target).definition)):
    extend_tree_with_features = speclm.protocol.FeatureConditionedDraft.extend_tree_with_features

  draft = eagle.random_draft(target)
  draft = speclm.Model(NoTrees(**{f: getattr(draft.definition, f)
                                  for f in draft.definition.__dataclass_fields__}), draft.params)
  with pytest.raises(ValueError, match='extend_tree_with_features'):
    tree_decoding.tree_speculative_decode(target, draft, PROMPTS, LENGTHS, tree=BRANCHY)
