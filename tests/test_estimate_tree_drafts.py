"""scripts/estimate_tree_drafts.py: its round counting by hand, and against the decode loop."""

import os

import numpy as np
import pytest

import speclm
from speclm.models import lookup
from speclm.models import llama
from speclm.testing import scripts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small random Llamas (the draft shares the target's embedding and first layer, so it agrees
# with the target often but not always); prompts that repeat themselves, so the prompt lookup
# finds matches. The script's counting does not depend on the model, and small models keep
# this test to seconds (the script itself runs on SmolLM2).
PROMPTS = ([5, 9, 2, 7, 5, 9, 2, 7, 5, 9], [3, 1, 4, 1, 5, 9, 2, 6])
GAMMA, NEW = 3, 40


@pytest.fixture(scope='module')
def script():
  return scripts.load_script(os.path.join(REPO, 'scripts', 'estimate_tree_drafts.py'))


def test_rounds_by_hand(script):
  # Every draft right: rounds of γ + 1 tokens, and a last short one.
  assert script.rounds_needed(np.zeros(9, int), script.chain(3)) == 3  # 4 + 4 + 1
  # A chain keeps only first choices; a tree with the second choice at depth 1 keeps more.
  ranks = np.array([1, 0, 0, 5, 1, 0])
  assert script.rounds_needed(ranks, script.chain(2)) == 4  # 1, 3, 1, 1
  tree = script.Tree({(0,), (1,), (1, 0), (0, 0)})
  assert script.rounds_needed(ranks, tree) == 3  # 3 (1.0 kept), 1, 2 (1 kept)
  assert script.tokens_per_call([ranks, np.zeros(9, int)], script.chain(3)) == pytest.approx(
      15 / (script.rounds_needed(ranks, script.chain(3)) + 3))


def test_fitted_trees_are_prefix_closed_and_follow_the_counts(script):
  rng = np.random.default_rng(0)
  ranks = [np.minimum(rng.geometric(0.5, 200) - 1, script.MAX_RANK) for _ in range(3)]
  ranks[0][:5] = script.MAX_RANK  # never a node
  previous = 0.0
  for nodes in (1, 3, 7, 15):
    tree = script.fit_tree(ranks, nodes)
    assert len(tree) == nodes
    assert all(len(p) == 1 or p[:-1] in tree for p in tree)
    assert all(script.MAX_RANK not in p for p in tree)
    made = script.tokens_per_call(ranks, tree)
    assert made >= previous  # a larger greedy tree contains the smaller one
    previous = made
  assert script.fit_tree(ranks, 1) == {(0,)}  # rank 0 is the most frequent


@pytest.fixture(scope='module')
def replies():
  """The target, the draft, the prompts and the target's greedy replies (NEW tokens)."""
  target = llama.random_model(vocab_size=48, embed_dim=32, num_layers=3, seed=3)
  draft = llama.random_model(vocab_size=48, embed_dim=32, num_layers=1, seed=3)
  rows = [list(p) for p in PROMPTS]
  tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for i, row in enumerate(rows):
    tokens[i, :len(row)] = row
  lengths = np.array([len(r) for r in rows], np.int32)
  result = speclm.autoregressive_decode(target, tokens, lengths, eos_id=None,
                                        max_new_tokens=NEW)
  return target, draft, rows, tokens, lengths, result.to_lists()


@pytest.mark.parametrize('lookup_min_ngram', [0, 2])
def test_chain_rounds_equal_the_decode_loops(script, replies, lookup_min_ngram):
  """Greedy speculative decoding makes exactly the rounds the script predicts."""
  target, draft, rows, tokens, lengths, replies = replies
  loop_draft = lookup.lookup_first(draft, min_ngram=lookup_min_ngram) if lookup_min_ngram \
      else draft
  result = speclm.speculative_decode(target, loop_draft, tokens, lengths, gamma=GAMMA,
                                     eos_id=None, max_new_tokens=NEW)
  assert result.to_lists() == replies
  loop_rounds = np.asarray(result.stats.target_calls_per_row) - 1  # less the prefill
  predicted = [script.rounds_needed(
      script.candidate_ranks(draft, row, reply, lookup_min_ngram), script.chain(GAMMA))
               for row, reply in zip(rows, replies)]
  assert list(loop_rounds) == predicted
  # Neither all drafts right nor all wrong: the counting is exercised both ways.
  assert GAMMA + 1 > NEW / max(predicted) and min(predicted) < NEW
