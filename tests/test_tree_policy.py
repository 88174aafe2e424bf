"""The tree policy (speclm.run.calibration.tree_policy): it times the baseline, the chain and each
candidate tree on a few batches of prompts and picks the fastest as measured.

What this proves: the choice is the argmin of the table's own measured seconds per token (the
timings are real: one per repeat, positive; a decode of several batches is timed whole over
their pooled tokens); the batches a job calibrates on are whole and spread over its lengths;
the chain is always a candidate and is chosen when the trees are made slower by construction
or are faster by less than the margin (`min_tree_gain`); the chosen decode's greedy output
equals the baseline (token drafts and an EAGLE-3 draft); and bad settings are refused with a
message naming them.
"""

import statistics
import time

import numpy as np
import pytest

import speclm
from speclm import token_trees
from speclm import tree_decoding
from speclm.models import eagle
from speclm.models import llama
from speclm.models import lookup
from speclm.run.calibration import tree_policy

PROMPTS = np.array([[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 0, 0, 0, 0], [5, 3, 5, 3, 5, 3, 0]],
                   np.int32)
LENGTHS = np.array([7, 3, 6], np.int32)
PATHS3 = token_trees.TreeShape.from_paths([(0,), (1,), (0, 0)])
# Two batches of one row each, decoded in turn by every timed call.
TWO_ROWS = [(PROMPTS[:1], LENGTHS[:1]), (PROMPTS[1:2], LENGTHS[1:2])]


@pytest.fixture(scope='module')
def pair():
  target = llama.random_model(vocab_size=32, embed_dim=32, num_layers=2, seed=1)
  draft = llama.random_model(vocab_size=32, embed_dim=32, num_layers=1, seed=1)
  return target, draft


def _choose(pair, **kwargs):
  target, draft = pair
  policy = tree_policy.TreePolicy({'paths3': PATHS3}, calibration_rows=2,
                                  calibration_tokens=10, repeats=2)
  return tree_policy.choose(policy, target, draft, TWO_ROWS, gamma=3, **kwargs)


def test_the_choice_is_the_fastest_measured_and_decodes_like_the_baseline(pair):
  choice = _choose(pair, c=0.1, r={'chain': 1.2, 'paths3': 1.3})
  names = [row['name'] for row in choice.rows]
  assert names == ['baseline', 'chain', 'paths3']  # the chain added first
  for row in choice.rows:
    assert len(row['seconds']) == 2 and all(s > 0 for s in row['seconds'])
    assert row['seconds_per_token'] > 0 and row['warmup_s'] > 0
    assert row['identical_to_baseline'] is True  # greedy: every candidate equals the baseline
  candidates = choice.rows[1:]
  # The fewest seconds per token, a tree's counted 5% slower (`min_tree_gain`).
  fastest = min(candidates, key=lambda row: row['seconds_per_token']
                * (1.0 if row['kind'] == 'chain' else 1.0 / 0.95))
  assert choice.name == fastest['name'] and [r['chosen'] for r in candidates].count(True) == 1
  assert choice.tree is (None if choice.name == 'chain' else PATHS3)
  assert choice.calibration['rows'] == 2 and choice.calibration['seconds'] > 0
  assert choice.calibration['batches'] == 2 and choice.calibration['prompt_lengths'] == [7, 3]
  for row in choice.rows:  # a call's time over both batches' tokens (2 rows × 10, no end id)
    assert row['seconds_per_token'] == pytest.approx(
        statistics.median(s / 20 for s in row['seconds']))
  chain, tree = choice.row('chain'), choice.row('paths3')
  assert chain['nodes'] == 3 and 0 <= chain['alpha'] <= 1 and chain['rank_acceptance'] is None
  assert len(tree['rank_acceptance']) == 2 and tree['tokens_per_call'] >= 1
  assert tree['predicted_tokens_per_round'] >= 1 and tree['predicted_speedup'] > 0
  assert chain['predicted_speedup'] > 0 and choice.row('baseline')['speedup'] == 1.0
  assert choice.to_dict()['chosen'] == choice.name and len(choice.markdown()) == 5
  # The chosen decode, on every row, is the baseline's greedy output.
  target, draft = pair
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=10)
  if choice.tree is None:
    out = speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=3, max_new_tokens=10)
  else:
    out = tree_decoding.tree_speculative_decode(target, draft, PROMPTS, LENGTHS,
                                                tree=choice.tree, max_new_tokens=10)
  np.testing.assert_array_equal(out.tokens, base.tokens)


def test_slower_trees_lose_to_the_chain(pair, monkeypatch):
  """Every tree decode made 50 ms slower (really: it sleeps): the chain wins, as measured."""
  real = tree_decoding.tree_speculative_decode

  def slow(*args, **kwargs):
    result = real(*args, **kwargs)
    time.sleep(0.05)
    return result

  monkeypatch.setattr(tree_decoding, 'tree_speculative_decode', slow)
  choice = _choose(pair)
  assert choice.name == 'chain' and choice.tree is None
  assert choice.row('paths3')['seconds_per_token'] > choice.row('chain')['seconds_per_token']
  assert min(choice.row('paths3')['seconds']) >= 0.05


def test_a_tree_must_beat_the_chain_by_the_margin(pair, monkeypatch):
  """The tree's timed decodes recorded as 3% faster than the chain's: within the default 5%
  margin the chain is chosen; with `min_tree_gain=0` the tree is."""
  real = tree_policy._time_decodes

  def timed(runs, repeats, progress):
    warmup_s, results, seconds = real(runs, repeats, progress)
    seconds['paths3'] = [0.97 * s for s in seconds['chain']]
    return warmup_s, results, seconds

  monkeypatch.setattr(tree_policy, '_time_decodes', timed)
  choice = _choose(pair)
  assert choice.name == 'chain' and choice.calibration['min_tree_gain'] == 0.05
  assert choice.row('paths3')['seconds_per_token'] < choice.row('chain')['seconds_per_token']
  target, draft = pair
  eager = tree_policy.TreePolicy({'paths3': PATHS3}, calibration_rows=2, calibration_tokens=10,
                                 repeats=2, min_tree_gain=0.0)
  assert tree_policy.choose(eager, target, draft, TWO_ROWS, gamma=3).name == 'paths3'


def test_the_baseline_is_chosen_only_when_allowed_and_faster(pair, monkeypatch):
  """Every speculative decode (chain and tree) made 50 ms slower: with `allow_baseline` the
  job decodes without speculation; without it the policy still picks among the candidates."""
  for module, name in ((tree_decoding, 'tree_speculative_decode'),
                       (speclm.decoding, 'speculative_decode')):
    real = getattr(module, name)

    def slow(*args, _real=real, **kwargs):
      result = _real(*args, **kwargs)
      time.sleep(0.05)
      return result

    monkeypatch.setattr(module, name, slow)
  target, draft = pair
  allowed = tree_policy.TreePolicy({'paths3': PATHS3}, calibration_rows=2,
                                   calibration_tokens=10, repeats=2, allow_baseline=True)
  choice = tree_policy.choose(allowed, target, draft, TWO_ROWS, gamma=3)
  assert choice.name == 'baseline' and choice.tree is None and not choice.speculate
  assert choice.row('baseline')['chosen'] and choice.to_dict()['chosen'] == 'baseline'
  assert all(row['speedup'] < 1 for row in choice.rows[1:])
  assert choice.summary().startswith('the baseline, no speculation')
  assert 'baseline' in allowed.describe()
  choice = _choose(pair)  # the same slowdown, the baseline not allowed
  assert choice.name in ('chain', 'paths3') and choice.speculate


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match='allow_baseline must be True or False'):
    tree_policy.TreePolicy({'paths3': PATHS3}, allow_baseline='yes')
  for gain in (1.0, -0.1, 'x', True):
    with pytest.raises(ValueError, match='min_tree_gain must be a fraction'):
      tree_policy.TreePolicy({'paths3': PATHS3}, min_tree_gain=gain)
  with pytest.raises(ValueError, match='non-empty mapping'):
    tree_policy.TreePolicy({})
  with pytest.raises(ValueError, match='calibration_rows must be an integer >= 1'):
    tree_policy.TreePolicy({'paths3': PATHS3}, calibration_rows=0)
  with pytest.raises(ValueError, match='repeats'):
    tree_policy.TreePolicy({'paths3': PATHS3}, repeats=0)
  with pytest.raises(ValueError, match=r"candidates\['three'\] must be a TreeShape"):
    tree_policy.TreePolicy({'three': 3})
  with pytest.raises(ValueError, match='the name of the chain'):
    tree_policy.TreePolicy({'chain': PATHS3})
  policy = tree_policy.TreePolicy({'paths3': PATHS3})
  with pytest.raises(ValueError, match='at least one batch'):
    tree_policy.choose(policy, None, None, [], gamma=3)
  with pytest.raises(ValueError, match=r'prompts \[B, P\]'):
    tree_policy.choose(policy, None, None, [(PROMPTS[0], LENGTHS[:1])], gamma=3)
  policy = tree_policy.TreePolicy({'mine': None, 'paths3': PATHS3})
  assert list(policy.candidates) == ['mine', 'paths3']  # the chain given: not added again
  assert list(tree_policy.TreePolicy(tree_policy.default_candidates()).candidates) == [
      'chain', 'paths3', 'paths4', 'dynamic8']


def test_eagle_drafts_compete_with_trees(pair):
  """A draft that reads the target's features (EAGLE-3 behind prompt lookup, as the demo's)
  is timed with the chain and a dynamic tree like any draft; every candidate decodes as the
  baseline does."""
  target, _ = pair
  draft = lookup.lookup_first(
      eagle.random_draft(target, num_layers=1, head_size=24, seed=1, feature_layers=(0, 1)),
      min_ngram=1)
  policy = tree_policy.TreePolicy(
      {'chain': None, 'dynamic4': token_trees.DynamicTree(4, depth=3, top_k=2, width=2)},
      calibration_rows=2, calibration_tokens=10, repeats=1)
  choice = tree_policy.choose(policy, target, draft, TWO_ROWS, gamma=3)
  assert [row['name'] for row in choice.rows] == ['baseline', 'chain', 'dynamic4']
  assert all(row['identical_to_baseline'] for row in choice.rows)
  assert choice.row('dynamic4')['tokens_per_call'] > 1.0  # the repeated prompt is looked up


def test_a_job_calibrates_on_whole_batches_spread_over_its_lengths():
  """`calibration_batches`: enough whole batches for the rows asked, at the middles of equal
  parts of the width-sorted list (so a batch-1 job is timed on short, middling and long
  prompts, not on its shortest ones), more when short batches fall short, all when too few."""
  widths = [16, 16, 32, 32, 64, 64, 128, 256]
  ones = [1] * 8
  assert tree_policy.calibration_batches(widths, ones, 4) == [1, 3, 5, 7]
  assert tree_policy.calibration_batches(widths, ones, 2) == [2, 6]
  assert tree_policy.calibration_batches(widths, ones, 1) == [4]
  assert tree_policy.calibration_batches(widths, ones, 20) == list(range(8))
  # Batches of 4 rows: 5 rows take two whole batches; a short batch asks for one more.
  fours = [4, 4, 4, 4, 4, 4, 4, 4]
  assert tree_policy.calibration_batches(widths, fours, 5) == [2, 6]
  assert tree_policy.calibration_batches(widths, [4, 4, 1, 4, 4, 4, 4, 4], 4) == [4]
  assert tree_policy.calibration_batches(widths, [4, 4, 4, 4, 1, 4, 4, 4], 4) == [2, 6]
  assert tree_policy.calibration_batches([], [], 4) == []
  # Scripts that decode one prompt at a time: each prompt its own batch, ordered by length.
  picked = tree_policy.spread_prompts([[1, 2, 3], [4], [5, 6]], 2)
  assert [(ids.tolist(), n.tolist()) for ids, n in picked] == [([[4]], [1]), ([[1, 2, 3]], [3])]
  with pytest.raises(ValueError, match='must not decrease'):
    tree_policy.calibration_batches([32, 16], [1, 1], 1)
  with pytest.raises(ValueError, match='2 widths but 1 row counts'):
    tree_policy.calibration_batches([16, 32], [1], 1)
