"""Speculative sampling is exact: samples fit the target's enumerated sequence distribution.

With a 6-token vocabulary and 3 new tokens there are 216 continuations; their exact
probabilities under the target's standardized sampling come from teacher-forced logits.
20,000 continuations drawn by one batched `speculative_decode` call must pass Pearson's
chi-square test at significance level 0.001 (fixed seeds, so the outcome is deterministic).
The same test must *reject* a deliberately wrong sampler (resampling rejected positions from
p̃ instead of the residual), which shows the check is able to fail.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import speculative
from speclm import testing
from speclm.models import eagle
from speclm.models import llama
from speclm.models import lookup

VOCAB = 6
NEW_TOKENS = 3
SAMPLES = 20_000
SIGNIFICANCE = 1e-3
PROMPT = np.array([3, 1, 4, 1, 5], np.int32)


@pytest.fixture(scope='module')
def target():
  return llama.random_model(vocab_size=VOCAB, embed_dim=16, num_layers=2, seed=21,
                            num_heads=2, num_kv_heads=1)


@pytest.fixture(scope='module')
def drafts(target):
  unrelated = llama.random_model(vocab_size=VOCAB, embed_dim=8, num_layers=1, seed=5,
                                 num_heads=2, num_kv_heads=1)
  leaves, tree = jax.tree_util.tree_flatten(target.params)
  keys = jax.random.split(jax.random.key(9), len(leaves))
  related = jax.tree_util.tree_unflatten(
      tree, [x + 0.5 * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
  # Prompt lookup where a token of the context repeats (PROMPT has two 1s), else `unrelated`:
  # one-hot and dense q mixed within one sequence.
  # An EAGLE-style draft reads the target's features; its head covers 4 of the 6 tokens. The
  # EAGLE-3 one reads both layers' hidden states and, past a round's first proposal, its own.
  return {'unrelated': unrelated, 'related': speclm.Model(target.definition, related),
          'lookup_first': lookup.lookup_first(unrelated, min_ngram=1),
          'eagle': eagle.random_draft(target, head_size=4, seed=3),
          'eagle3': eagle.random_draft(target, head_size=4, seed=3, feature_layers=(1, 0)),
          'lookup_first_eagle3': lookup.lookup_first(
              eagle.random_draft(target, head_size=4, seed=3, feature_layers=(1, 0)),
              min_ngram=1),
          # The lookup's proposal mixed with the EAGLE-3 draft's q (weight 0.6): dense q.
          'lookup_mixed_eagle3': lookup.lookup_first(
              eagle.random_draft(target, head_size=4, seed=3, feature_layers=(1, 0)),
              min_ngram=1, weight=0.6)}


def _exact(target, sampling, num_tokens=NEW_TOKENS):
  forward = jax.jit(target.definition.forward)

  def teacher_forced(continuations):
    n = continuations.shape[0]
    seqs = np.concatenate([np.tile(PROMPT, (n, 1)), continuations], axis=1)
    logits = forward(target.params, seqs)
    return np.asarray(logits[:, len(PROMPT) - 1:-1])

  return testing.exact_continuation_distribution(teacher_forced, VOCAB, num_tokens, sampling)


def _speculative_samples(target, draft, sampling, gamma, seed, num_tokens=NEW_TOKENS):
  prompts = np.tile(PROMPT, (SAMPLES, 1))
  lengths = np.full((SAMPLES,), len(PROMPT))
  result = speclm.speculative_decode(target, draft, prompts, lengths, gamma=gamma,
                                     sampling=sampling, max_new_tokens=num_tokens, seed=seed)
  assert np.all(np.asarray(result.lengths) == num_tokens)
  return np.asarray(result.tokens), result.stats


CASES = [
    ('t1', speclm.SamplingConfig(temperature=1.0), 'related', 2),
    ('t1_unrelated', speclm.SamplingConfig(temperature=1.0), 'unrelated', 3),
    ('t0.7_top3', speclm.SamplingConfig(temperature=0.7, top_k=3), 'related', 3),
    ('top_p0.8', speclm.SamplingConfig(top_p=0.8), 'unrelated', 2),
    ('t1_lookup_first', speclm.SamplingConfig(temperature=1.0), 'lookup_first', 3),
    ('t1_eagle', speclm.SamplingConfig(temperature=1.0), 'eagle', 3),
    ('t0.7_top3_eagle3', speclm.SamplingConfig(temperature=0.7, top_k=3), 'eagle3', 3),
    ('t1_lookup_first_eagle3', speclm.SamplingConfig(temperature=1.0), 'lookup_first_eagle3',
     3),
    ('t1_lookup_mixed_eagle3', speclm.SamplingConfig(temperature=1.0), 'lookup_mixed_eagle3',
     3),
]


@pytest.mark.parametrize('name,sampling,draft_name,gamma', CASES, ids=[c[0] for c in CASES])
def test_speculative_samples_fit_the_exact_distribution(target, drafts, name, sampling,
                                                        draft_name, gamma):
  del name
  _, probs = _exact(target, sampling)
  tokens, stats = _speculative_samples(target, drafts[draft_name], sampling, gamma, seed=1)
  pvalue = testing.chi_square_pvalue(testing.sequence_ids(tokens, VOCAB), probs)
  assert pvalue > SIGNIFICANCE, f'p-value {pvalue:.2e}, α={stats.alpha:.3f}'
  # The draft really was used: some guesses accepted, some rejected.
  hist = np.asarray(stats.accepted_histogram)
  assert hist[0] > 0 and hist[1:].sum() > 0


def test_four_new_tokens(target, drafts):
  sampling = speclm.SamplingConfig(temperature=1.0)
  _, probs = _exact(target, sampling, num_tokens=4)
  tokens, _ = _speculative_samples(target, drafts['related'], sampling, gamma=3, seed=2,
                                   num_tokens=4)
  assert testing.chi_square_pvalue(testing.sequence_ids(tokens, VOCAB), probs) > SIGNIFICANCE


def test_wrong_residual_is_rejected(target, drafts, monkeypatch):
  """Resampling a rejected position from p̃ (not norm(max(0, p̃ − q̃))) biases the output."""
  sampling = speclm.SamplingConfig(temperature=1.0)
  _, probs = _exact(target, sampling)
  monkeypatch.setattr(speculative, 'residual_distribution', lambda p, q: p)
  jax.clear_caches()  # retrace the loop with the broken rule
  try:
    tokens, _ = _speculative_samples(target, drafts['unrelated'], sampling, gamma=3, seed=1)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  pvalue = testing.chi_square_pvalue(testing.sequence_ids(tokens, VOCAB), probs)
  assert pvalue < SIGNIFICANCE, f'the wrong sampler passed with p-value {pvalue:.3g}'


def test_exact_distribution_matches_baseline_sampling(target):
  """The enumeration itself is right: plain ancestral samples fit it too."""
  sampling = speclm.SamplingConfig(temperature=0.7, top_k=3)
  _, probs = _exact(target, sampling)
  result = speclm.autoregressive_decode(target, np.tile(PROMPT, (SAMPLES, 1)),
                                        np.full((SAMPLES,), len(PROMPT)), sampling=sampling,
                                        max_new_tokens=NEW_TOKENS, seed=4)
  ids = testing.sequence_ids(np.asarray(result.tokens), VOCAB)
  assert testing.chi_square_pvalue(ids, probs) > SIGNIFICANCE
