"""Adaptive γ (speclm.adaptive): the rule follows Theorem 3.8, and decoding stays exact.

Greedy decoding equals the baseline token for token and sampled decoding fits the enumerated
target distribution while γ changes from round to round — 0 included, with the draft sitting
rounds out and catching up — and with the draft stopping on its own confidence.
"""

import io
import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import adaptive
from speclm import decode_common
from speclm import decoding
from speclm import run
from speclm import testing
from speclm.analysis import theory
from speclm.models import llama
from speclm.models import lookup
from speclm.run.calibration import costs as costs_lib

VOCAB = 48
MAX_NEW = 24
FLAT = (1.0, 1.02, 1.04, 1.06, 1.08, 1.1)  # r(0) … r(5)


def _rule(**kwargs):
  kwargs = {'max_gamma': 5, 'draft_cost': 0.05, 'verify_costs': FLAT, **kwargs}
  return adaptive.AdaptiveGamma(**kwargs)


def _perturbed(model, scale, seed):
  leaves, tree = jax.tree_util.tree_flatten(model.params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return speclm.Model(model.definition, jax.tree_util.tree_unflatten(
      tree, [x + scale * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))


@pytest.fixture(scope='module')
def target():
  return llama.random_model(vocab_size=VOCAB, embed_dim=32, num_layers=2, seed=0)


@pytest.fixture(scope='module')
def prompts():
  rng = np.random.RandomState(0)
  return rng.randint(0, VOCAB, size=(4, 9)), np.array([9, 2, 5, 1])


@pytest.fixture(scope='module')
def baseline(target, prompts):
  return speclm.autoregressive_decode(target, *prompts, max_new_tokens=MAX_NEW)


@pytest.fixture
def scheduled(monkeypatch):
  """Replaces the rule's choice by a schedule that moves between 0 and γ_max from round to
  round (it reads the running α, which changes every round), so skipped rounds, catch-ups
  and forced catch-up rounds all happen."""
  def schedule(alpha, active, rule, costs=None):
    code = jnp.floor(jnp.mean(alpha) * 998.0).astype(jnp.int32)  # starts at 499: γ > 0
    return jnp.where(code % 3 == 0, 0, jnp.where(code % 3 == 1, 1 + code % rule.max_gamma, 0))
  monkeypatch.setattr(adaptive, 'choose_gamma', schedule)
  jax.clear_caches()
  yield
  monkeypatch.undo()
  jax.clear_caches()


# ----------------------------------------------------------------------------------------------
# The rule


def test_rule_settings_are_checked():
  with pytest.raises(ValueError, match='max_gamma'):
    _rule(max_gamma=0)
  with pytest.raises(ValueError, match='r\\(0\\) … r\\(5\\)'):
    _rule(verify_costs=(1.0, 1.1))
  with pytest.raises(ValueError, match='decay'):
    _rule(decay=0.0)
  with pytest.raises(ValueError, match='prior_alpha'):
    _rule(prior_alpha=1.5)
  with pytest.raises(ValueError, match='max_skip'):
    _rule(max_skip=-1)
  assert adaptive.AdaptiveGamma.from_costs(2, 0.1, [1.1, 1.2]).verify_costs == (1.0, 1.1, 1.2)
  assert hash(_rule()) == hash(_rule())  # a static argument of the compiled loop


@pytest.mark.parametrize('alpha', [0.1, 0.4, 0.6, 0.8, 0.95])
@pytest.mark.parametrize('c,r', [(0.05, FLAT), (0.2, (1.0, 1.1, 1.3, 1.6, 2.0, 2.5))])
def test_one_row_choice_maximises_theorem_3_8(alpha, c, r):
  """For one row the choice is §3.5's argmax of (1 − α^{γ+1}) / ((1 − α)(γc + r(γ)))."""
  rule = _rule(draft_cost=c, verify_costs=r, max_skip=0)
  chosen = int(adaptive.choose_gamma(jnp.array([alpha]), jnp.array([True]), rule))
  improvement = [1.0 / (c + 1.0)] + [  # γ = 0 still pays one draft call when max_skip = 0
      float(theory.walltime_improvement(alpha, g, c, r[g])) for g in range(1, 6)]
  assert chosen == int(np.argmax(improvement))


def test_choice_grows_with_alpha_and_stops_when_drafting_cannot_pay():
  rule = _rule()
  one = jnp.array([True])
  gammas = [int(adaptive.choose_gamma(jnp.array([a]), one, rule)) for a in (0.3, 0.6, 0.9)]
  assert gammas == sorted(gammas) and gammas[0] < gammas[-1]
  # c = 2: a draft call costs two target steps; even α = 0.9 cannot pay for it (Corollary
  # 3.9 needs α > c), so the draft sits out.
  assert int(adaptive.choose_gamma(jnp.array([0.9]), one, _rule(draft_cost=2.0))) == 0
  # Rows that stopped do not count: a finished row with α = 1 does not raise γ.
  both = jnp.array([0.1, 1.0])
  assert int(adaptive.choose_gamma(both, jnp.array([True, False]), rule)) == int(
      adaptive.choose_gamma(both[:1], one, rule))


def test_running_alpha_moves_from_the_prior_to_the_evidence_and_forgets():
  rule = _rule(prior_alpha=0.5, prior_weight=2.0, decay=0.5)
  beta_sum, count = jnp.zeros(1), jnp.zeros(1)
  assert float(adaptive.running_alpha(beta_sum, count, rule)[0]) == pytest.approx(0.5)
  for _ in range(10):  # ten rounds, each reaching 2 positions of β = 1
    beta_sum, count = adaptive.update_evidence(beta_sum, count, jnp.ones(1) * 2,
                                               jnp.array([2]), rule)
  assert float(adaptive.running_alpha(beta_sum, count, rule)[0]) > 0.75
  for _ in range(10):  # ten rounds without drafting: back towards the prior
    beta_sum, count = adaptive.update_evidence(beta_sum, count, jnp.zeros(1), jnp.array([0]),
                                               rule)
  assert float(adaptive.running_alpha(beta_sum, count, rule)[0]) < 0.51


def test_keep_drafting_is_the_marginal_ratio_test():
  rule = _rule(draft_cost=0.1, verify_costs=(1.0, 1.0, 1.0, 1.0, 1.5, 2.0))
  one = jnp.array([True])
  # After x_1 with confidence a: E_1 = 1 + a, C_1 = c + r(1) = 1.1; one more costs 0.1.
  for a, expected in [(0.9, True), (0.05, False)]:
    go = adaptive.keep_drafting(jnp.int32(1), jnp.float32(1 + a), jnp.array([a]),
                                jnp.array([a]), one, rule)
    left, right = (1 + a + a * a) / 1.2, (1 + a) / 1.1
    assert bool(go) == (left > right) == expected
  # Never past γ_max.
  assert not bool(adaptive.keep_drafting(jnp.int32(5), jnp.float32(6.0), jnp.ones(1),
                                         jnp.ones(1), one, rule))


# ----------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize('draft_stopping', [False, True])
@pytest.mark.parametrize('draft_name', ['self', 'related', 'lookup_first'])
def test_greedy_adaptive_equals_baseline(target, prompts, baseline, draft_name, draft_stopping):
  drafts = {'self': target, 'related': _perturbed(target, 0.3, seed=1),
            'lookup_first': lookup.lookup_first(_perturbed(target, 0.3, seed=1), min_ngram=1)}
  result = speclm.speculative_decode(target, drafts[draft_name], *prompts,
                                     gamma=_rule(draft_stopping=draft_stopping),
                                     max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(result.tokens, baseline.tokens)
  np.testing.assert_array_equal(result.lengths, baseline.lengths)
  histogram = np.asarray(result.stats.gamma_histogram)
  assert histogram.shape == (6,)
  assert histogram.sum() == int(result.stats.target_calls) - 1  # every round, once
  if draft_name == 'self':
    assert result.stats.alpha == pytest.approx(1.0)
    if not draft_stopping:  # (the random draft's confidence is low: it stops early)
      assert histogram[3:].sum() > 0  # α = 1: long proposals


@pytest.mark.parametrize('max_skip', [1, 2])
def test_skipped_rounds_keep_the_draft_in_step(target, prompts, baseline, scheduled, max_skip,
                                               monkeypatch):
  """A draft that sat rounds out and caught up (from its window of recent tokens, or by
  re-reading the sequence after more than max_skip rounds out) proposes exactly what a draft
  that read every round proposes (same γ schedule): same β, same acceptances. With the
  draft = the target, any state out of step would also show as α < 1."""
  rereads = []
  real_reread = decode_common.reread_draft

  def counted(*args):
    jax.debug.callback(lambda: rereads.append(1))
    return real_reread(*args)
  monkeypatch.setattr(decode_common, 'reread_draft', counted)
  for draft in (target, lookup.lookup_first(_perturbed(target, 0.3, seed=1), min_ngram=1)):
    skipping, reading = (speclm.speculative_decode(target, draft, *prompts,
                                                    gamma=_rule(max_skip=skip),
                                                    max_new_tokens=MAX_NEW)
                         for skip in (max_skip, 0))
    for result in (skipping, reading):
      np.testing.assert_array_equal(result.tokens, baseline.tokens)
    histogram = np.asarray(skipping.stats.gamma_histogram)
    assert histogram[0] >= 1 and histogram[1:].sum() >= 2, histogram
    np.testing.assert_array_equal(histogram, reading.stats.gamma_histogram)
    np.testing.assert_array_equal(skipping.stats.accepted_histogram,
                                  reading.stats.accepted_histogram)
    np.testing.assert_allclose(skipping.stats.beta_sum_per_row,
                               reading.stats.beta_sum_per_row, rtol=1e-5)
    if draft is target:
      assert skipping.stats.alpha == pytest.approx(1.0)
    # Rounds with k ≥ 1 made k draft calls (the catch-up, and the first round's read of the
    # prompt, ride on the first); γ = 0 rounds made none.
    proposals = int(np.sum(np.arange(6) * histogram))
    assert int(skipping.stats.draft_calls) == proposals
    assert int(reading.stats.draft_calls) == 1 + proposals + histogram[0]  # + the prefill
  assert rereads, 'the schedule never sat out more than max_skip rounds in a row'



def test_an_encoder_decoder_draft_rereads_its_sequence(scheduled):
  """T5: the re-read starts from the draft's own prefix (the decoder's start token), so a
  T5 draft that sat out past its window proposes what one that read every round does."""
  from speclm.models import t5  # pylint: disable=import-outside-toplevel
  target = t5.random_model(vocab_size=VOCAB, emb_dim=16, seed=11)
  draft = _perturbed(target, 0.2, seed=4)
  prompts = np.random.RandomState(1).randint(2, VOCAB, size=(3, 7)), np.array([7, 3, 5])
  baseline = speclm.autoregressive_decode(target, *prompts, max_new_tokens=MAX_NEW)
  skipping, reading = (speclm.speculative_decode(target, draft, *prompts,
                                                  gamma=_rule(max_skip=skip),
                                                  max_new_tokens=MAX_NEW) for skip in (1, 0))
  for result in (skipping, reading):
    np.testing.assert_array_equal(result.tokens, baseline.tokens)
  assert np.asarray(skipping.stats.gamma_histogram)[0] >= 2
  np.testing.assert_array_equal(skipping.stats.accepted_histogram,
                                reading.stats.accepted_histogram)
  np.testing.assert_allclose(skipping.stats.beta_sum_per_row, reading.stats.beta_sum_per_row,
                             rtol=1e-5)


def test_skipping_off_means_the_draft_reads_every_round(target, prompts, baseline, scheduled):
  result = speclm.speculative_decode(target, target, *prompts, gamma=_rule(max_skip=0),
                                     max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(result.tokens, baseline.tokens)
  stats = result.stats
  assert np.asarray(stats.gamma_histogram)[0] > 0
  assert int(stats.draft_calls) >= int(stats.target_calls)


# Costs of a batch where speculation does not pay at the prior α 0.5 (batch 8 on 2 CPU cores
# looks like this): γ = 1 yields 1.5 tokens for 2.3 steps against 1 for 1.
NOT_PAYING = dict(max_gamma=3, draft_cost=0.3, verify_costs=(1.0, 2.0, 2.2, 2.4))


def test_never_drafts_is_the_choice_at_the_prior():
  rule = _rule(**NOT_PAYING)
  assert adaptive.never_drafts(rule)
  assert not adaptive.never_drafts(_rule(**NOT_PAYING, prior_alpha=0.95))  # 3.71 / 3.3 > 1
  assert not adaptive.never_drafts(_rule())
  # The count of rows still generating does not move the choice at the prior.
  for rows in (1, 3, 8):
    prior = jnp.full((rows,), 0.5)
    assert int(adaptive.choose_gamma(prior, jnp.ones((rows,), bool), rule)) == 0


@pytest.mark.parametrize('max_skip', [3, 0])
def test_a_rule_that_never_drafts_runs_the_baseline(target, prompts, baseline, max_skip,
                                                    monkeypatch):
  """A rule that chooses γ = 0 at its prior would run γ = 0 rounds to the end; the decode is
  the baseline loop instead, with the statistics those rounds would have kept (rows ending
  early on an end token and on their own limits)."""
  rule = _rule(**NOT_PAYING, max_skip=max_skip)
  draft = _perturbed(target, 0.3, seed=1)
  kwargs = dict(max_new_tokens=[MAX_NEW, 5, MAX_NEW, 12],
                eos_id=int(np.asarray(baseline.tokens)[0, 9]))
  rounds = speclm.speculative_decode(target, draft, *prompts, gamma=rule,
                                     baseline_if_never_drafting=False, **kwargs)
  plain = speclm.autoregressive_decode(target, *prompts, **kwargs)

  def no_loop(*args, **kw):
    raise AssertionError('the speculative loop ran')
  monkeypatch.setattr(decoding, 'speculative_jit', no_loop)
  result = speclm.speculative_decode(target, draft, *prompts, gamma=rule, **kwargs)
  assert list(np.asarray(result.stop_reasons)) != [decoding.StopReason.MAX_NEW_TOKENS] * 4
  for other in (rounds, plain):
    np.testing.assert_array_equal(result.tokens, other.tokens)
    np.testing.assert_array_equal(result.lengths, other.lengths)
    np.testing.assert_array_equal(result.stop_reasons, other.stop_reasons)
  assert int(result.stats.draft_calls) == 0
  if max_skip:  # (with max_skip = 0 the rounds also re-feed the draft every round)
    for name in ('target_calls', 'draft_calls', 'target_calls_per_row', 'accepted_per_row',
                 'accepted_histogram', 'beta_sum', 'beta_count', 'beta_sum_per_row',
                 'beta_count_per_row', 'gamma_histogram'):
      np.testing.assert_array_equal(getattr(result.stats, name), getattr(rounds.stats, name),
                                    err_msg=name)
  else:
    assert int(rounds.stats.draft_calls) > 0
  # Sampled: the baseline itself, draw for draw.
  hot = speclm.SamplingConfig(temperature=1.0)
  np.testing.assert_array_equal(
      speclm.speculative_decode(target, draft, *prompts, gamma=rule, sampling=hot, seed=5,
                                **kwargs).tokens,
      speclm.autoregressive_decode(target, *prompts, sampling=hot, seed=5, **kwargs).tokens)


SMALL_VOCAB = 6
PROMPT = np.array([3, 1, 4, 1, 5], np.int32)
SAMPLES = 20_000


@pytest.fixture(scope='module')
def small():
  target = llama.random_model(vocab_size=SMALL_VOCAB, embed_dim=16, num_layers=2, seed=21,
                              num_heads=2, num_kv_heads=1)
  return target, _perturbed(target, 0.5, seed=9)


def _fits(target, draft, rule, sampling, seed=1, new_tokens=4):
  forward = jax.jit(target.definition.forward)

  def teacher_forced(continuations):
    seqs = np.concatenate([np.tile(PROMPT, (continuations.shape[0], 1)), continuations], axis=1)
    return np.asarray(forward(target.params, seqs)[:, len(PROMPT) - 1:-1])

  _, probs = testing.exact_continuation_distribution(teacher_forced, SMALL_VOCAB, new_tokens,
                                                     sampling)
  result = speclm.speculative_decode(
      target, draft, np.tile(PROMPT, (SAMPLES, 1)), np.full((SAMPLES,), len(PROMPT)),
      gamma=rule, sampling=sampling, max_new_tokens=new_tokens, seed=seed)
  tokens = np.asarray(result.tokens)
  return testing.chi_square_pvalue(testing.sequence_ids(tokens, SMALL_VOCAB), probs), result


@pytest.mark.parametrize('sampling', [speclm.SamplingConfig(temperature=1.0),
                                      speclm.SamplingConfig(temperature=0.7, top_k=3)],
                         ids=['t1', 't0.7_top3'])
def test_sampled_adaptive_fits_the_exact_distribution(small, sampling, scheduled):
  """γ changes between rounds (0 included, the draft sitting rounds out) under one sampler."""
  target, draft = small
  pvalue, result = _fits(target, draft, _rule(max_gamma=3, verify_costs=FLAT[:4], max_skip=1),
                         sampling)
  assert pvalue > 1e-3, pvalue
  histogram = np.asarray(result.stats.gamma_histogram)
  assert histogram[0] > 0 and histogram[1:].sum() > 0, histogram


@pytest.mark.parametrize('lookup_first', [False, True], ids=['draft', 'lookup_first'])
def test_sampled_draft_stopping_fits_the_exact_distribution(small, lookup_first):
  """The draft stops on its own confidence (which depends on what it drew) — still exact.
  With prompt lookup first, one-hot proposals (confidence 1) run on up to γ_max where the
  context repeats (PROMPT has two 1s), dense ones elsewhere."""
  target, draft = small
  if lookup_first:
    draft = lookup.lookup_first(draft, min_ngram=1)
  pvalue, result = _fits(target, draft, _rule(max_gamma=3, verify_costs=FLAT[:4],
                                              draft_stopping=True, draft_cost=0.3),
                         speclm.SamplingConfig(temperature=1.0))
  assert pvalue > 1e-3, pvalue
  assert np.asarray(result.stats.accepted_histogram)[1:].sum() > 0


# ----------------------------------------------------------------------------------------------
# Costs and the job


def test_rules_differing_only_in_costs_share_one_compiled_loop(target, prompts):
  """The costs travel as an array, so a second rule compiles nothing, and its choices follow
  its own costs (a loop compiled with the first rule's costs baked in would repeat them)."""
  from speclm import decoding  # pylint: disable=import-outside-toplevel
  draft = _perturbed(target, 0.3, seed=1)

  def forcing(gamma):  # every other width priced out
    return _rule(max_gamma=3, verify_costs=tuple(1.0 if g == gamma else 1e6 for g in range(4)),
                 draft_cost=0.0)
  histograms = []
  for gamma in (2, 0, 3):
    result = speclm.speculative_decode(target, draft, *prompts, gamma=forcing(gamma),
                                       max_new_tokens=MAX_NEW)
    if gamma == 2:
      compiled = decoding.speculative_jit._cache_size()  # pylint: disable=protected-access
    histograms.append(np.asarray(result.stats.gamma_histogram))
  assert decoding.speculative_jit._cache_size() == compiled  # pylint: disable=protected-access
  for gamma, histogram in zip((2, 0, 3), histograms):
    assert histogram.sum() > 0 and histogram.sum() == histogram[gamma], (gamma, histogram)


def test_round_costs_arithmetic(monkeypatch, target):
  """measure_round_costs turns whole-loop times into per-round costs in baseline steps: the
  prefill (the draft's, where it drafts, taken as c times the target's) comes off, the rest
  is divided by the rounds the loop made and by the baseline's time per token, and γ·c comes
  off again (a γ = 0 round runs no draft). Timings are given, the rounds are the loop's."""
  draft = _perturbed(target, 0.3, seed=1)
  new, max_skip, prefill, step, draft_step = 8, 1, 0.5, 0.1, 0.01
  round_seconds = [0.13, 0.12, 0.15, 0.14]  # γ = 0 … 3; γ = 3 cheaper than γ = 2: noise
  loops = {}

  def fake_rounds(runs, repeats, **_):
    # Three repeats on a machine whose speed changes between them (all of a repeat's calls
    # alike): each repeat's ratios, and so their median, are those of the first.
    del runs
    assert repeats == 3
    return [[s * speed for speed in (1.0, 2.5, 0.7)]
            for s in [draft_step * runner_steps[0], prefill, prefill + new * step]
            + [(1 + (draft_step / step if g else 0)) * prefill + loops[g] * round_seconds[g]
               for g in range(4)]]  # a draft that sits every round out never reads the prompt
  runner_steps = []
  real_runner = costs_lib._extend_runner  # pylint: disable=protected-access

  def runner(*args, **kwargs):
    made = real_runner(*args, **kwargs)
    runner_steps.append(made.num_steps)
    return made
  monkeypatch.setattr(costs_lib, '_extend_runner', runner)
  monkeypatch.setattr(costs_lib.benchmarking, 'interleaved_rounds', fake_rounds)
  real_decode = costs_lib.decoding.speculative_decode

  def counting(*args, gamma, baseline_if_never_drafting, **kwargs):
    # γ = 0 is timed on the loop's own rounds (a rule forcing it never drafts).
    assert not baseline_if_never_drafting
    result = real_decode(*args, gamma=gamma, baseline_if_never_drafting=False, **kwargs)
    forced = int(np.argmin(gamma.verify_costs))
    loops[forced] = int(result.stats.target_calls) - 1
    return result
  monkeypatch.setattr(costs_lib.decoding, 'speculative_decode', counting)
  c, r = costs_lib.measure_round_costs(target, draft, max_gamma=3, context_length=6,
                                       num_new_tokens=new, repeats=3, max_skip=max_skip)
  assert c == pytest.approx(draft_step / step)
  expected = [round_seconds[g] / step - g * c for g in range(4)]
  expected[3] = max(expected[3], expected[2])  # lifted: a wider round never costs less
  assert r == pytest.approx(expected)
  assert set(loops) == {0, 1, 2, 3} and all(n > 0 for n in loops.values())


def test_round_cost_tokens_grow_with_the_prompt():
  """A timed decode makes ROUND_COST_TOKENS new tokens after a short prompt, and a quarter of
  a long one (rounded up to 16), so that the prompt's prefill stays a small part of it."""
  assert costs_lib.round_cost_tokens(1) == costs_lib.ROUND_COST_TOKENS == 32
  assert costs_lib.round_cost_tokens(128) == 32
  assert costs_lib.round_cost_tokens(129) == 48
  assert costs_lib.round_cost_tokens(576) == 144
  assert costs_lib.round_cost_tokens(1088) == 272


def test_measured_costs_are_cached(tmp_path, monkeypatch, target):
  monkeypatch.setenv('SPECLM_COST_CACHE', str(tmp_path))
  draft = _perturbed(target, 0.3, seed=1)
  rule = costs_lib.measure_adaptive_gamma(target, draft, max_gamma=2, context_length=8,
                                          draft_stopping=True)
  assert len(rule.verify_costs) == 3 and all(r > 0 for r in rule.verify_costs)
  assert rule.draft_cost > 0 and rule.draft_stopping
  (saved,) = os.listdir(tmp_path)
  with open(tmp_path / saved) as f:
    assert json.load(f)['verify_costs'] == list(rule.verify_costs)
  # A second call reads the file instead of timing again.
  monkeypatch.setattr(costs_lib, 'measure_round_costs',
                      lambda *a, **k: pytest.fail('measured again'))
  again = costs_lib.measure_adaptive_gamma(target, draft, max_gamma=2, context_length=8)
  assert again.verify_costs == rule.verify_costs


def test_a_jobs_theorem_costs_are_cached_apart_from_the_adaptive_ones(tmp_path, monkeypatch,
                                                                      target):
  """`measure_costs_cached` (a job's c and r for Theorem 3.8) times once per machine, model
  pair, γ and context; its files sit beside the adaptive rule's under their own keys."""
  monkeypatch.setenv('SPECLM_COST_CACHE', str(tmp_path))
  draft = _perturbed(target, 0.3, seed=1)
  calls = []
  real = costs_lib.measure_costs
  monkeypatch.setattr(costs_lib, 'measure_costs',
                      lambda *a, **k: calls.append(k['gamma']) or real(*a, **k))
  first = costs_lib.measure_costs_cached(target, draft, gamma=2, context_length=8,
                                         num_steps=2, repeats=1)
  again = costs_lib.measure_costs_cached(target, draft, gamma=2, context_length=8,
                                         num_steps=2, repeats=1)
  assert calls == [2] and again == first and first.c > 0 and first.r > 0
  costs_lib.measure_costs_cached(target, draft, gamma=3, context_length=8, num_steps=2,
                                 repeats=1)
  costs_lib.measure_costs_cached(target, draft, gamma=2, context_length=8, num_steps=2,
                                 repeats=1, use_cache=False)
  assert calls == [2, 3, 2] and len(os.listdir(tmp_path)) == 2
  costs_lib.measure_adaptive_gamma(target, draft, max_gamma=2, context_length=8)
  assert len(os.listdir(tmp_path)) == 3  # the rule's own entry, not the γ = 2 one
  for name in os.listdir(tmp_path):  # a damaged file is timed again and rewritten
    (tmp_path / name).write_text('{not json')
  for _ in range(2):
    costs_lib.measure_costs_cached(target, draft, gamma=2, context_length=8, num_steps=2,
                                   repeats=1)
  assert calls == [2, 3, 2, 2]


def test_cached_costs_go_stale_when_the_timed_code_changes(tmp_path, monkeypatch):
  """The cost cache key covers the source of the loop, models and kernel (an edit to them
  re-times), not the rest of speclm. A listed file this copy lacks (decode_common.py here) is
  skipped, and counts once it exists."""
  for name in ('decoding.py', 'models/llama.py', 'kernels/skinny_matmul.cc', 'run/job.py',
               'kernels/parallel_tasks.h', 'adaptive.py', 'speculative.py', 'sampling.py',
               'protocol.py'):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text('# v1')
  monkeypatch.setattr(costs_lib, '__file__', str(tmp_path / 'run' / 'calibration' / 'costs.py'))

  def digest():
    costs_lib._timed_code_digest.cache_clear()  # pylint: disable=protected-access
    return costs_lib._timed_code_digest()  # pylint: disable=protected-access

  first = digest()
  (tmp_path / 'run' / 'job.py').write_text('# v2')
  assert digest() == first
  for name in ('decoding.py', 'models/llama.py', 'kernels/skinny_matmul.cc',
               'kernels/parallel_tasks.h'):  # the kernels' headers too
    (tmp_path / name).write_text('# v2')
    assert digest() != first
    (tmp_path / name).write_text('# v1')
  assert digest() == first
  (tmp_path / 'decode_common.py').write_text('# v1')
  assert digest() != first
  costs_lib._timed_code_digest.cache_clear()  # pylint: disable=protected-access


def _run_tiny(output_dir, *bindings):
  gin.clear_config()
  try:
    run.parse_gin(['test_tiny.gin'], [f"OUTPUT_DIR = '{output_dir}'", *bindings])
    return run.run_job(progress_stream=io.StringIO())  # pylint: disable=missing-kwoa
  finally:
    gin.clear_config()


def test_job_with_adaptive_gamma_reports_the_gamma_histogram(tmp_path, monkeypatch):
  monkeypatch.setenv('SPECLM_COST_CACHE', str(tmp_path / 'costs'))
  metrics = _run_tiny(tmp_path / 'out', "GAMMA = 'adaptive'", 'run_job.max_gamma = 3')
  assert metrics['gamma'] == 'adaptive'
  assert metrics['identical_output_rate'] == 1.0
  histogram = metrics['gamma_histogram']
  assert len(histogram) == 4 and sum(histogram) > 0
  assert len(metrics['r_by_gamma']) == 4 and metrics['c'] > 0
  assert metrics.get('predicted_speedup_theorem_3_8') is None  # a fixed-γ formula
  with open(tmp_path / 'out' / 'job.json') as f:
    assert '"settings.max_gamma": 3' in f.read()


def test_job_refuses_a_bad_gamma(tmp_path):
  with pytest.raises(run.JobError, match="adaptive"):
    _run_tiny(tmp_path, "GAMMA = 'adaptiv'")
  with pytest.raises(run.JobError, match=r"prior_alpha must be a number in \[0, 1\]"):
    _run_tiny(tmp_path, "GAMMA = 'adaptive'", 'run_job.prior_alpha = 1.5')


@pytest.mark.parametrize('prior_alpha', [0.5, 0.95])
def test_job_whose_rule_never_drafts_decodes_with_the_baseline(tmp_path, monkeypatch,
                                                               prior_alpha):
  """With costs where drafting does not pay at the prior, the job says so, every round is a
  γ = 0 round and metrics.json notes it; a higher prior makes the same job draft."""
  monkeypatch.setenv('SPECLM_COST_CACHE', str(tmp_path / 'costs'))
  monkeypatch.setattr(costs_lib, 'measure_round_costs',
                      lambda *a, **k: (NOT_PAYING['draft_cost'], NOT_PAYING['verify_costs']))
  gin.clear_config()
  stream = io.StringIO()
  try:
    run.parse_gin(['test_tiny.gin'], [f"OUTPUT_DIR = '{tmp_path / 'out'}'", "GAMMA = 'adaptive'",
                                      'run_job.max_gamma = 3',
                                      f'run_job.prior_alpha = {prior_alpha}'])
    metrics = run.run_job(progress_stream=stream)  # pylint: disable=missing-kwoa
  finally:
    gin.clear_config()
  never = prior_alpha == 0.5
  assert metrics['identical_output_rate'] == 1.0
  assert metrics['cost_measurement']['never_drafts'] is never
  assert metrics['cost_measurement']['prior_alpha'] == prior_alpha
  histogram = metrics['gamma_histogram']
  if never:
    assert histogram[0] > 0 and sum(histogram[1:]) == 0, histogram
  else:  # the first rounds draft (α 0.95 until evidence says otherwise)
    assert sum(histogram[1:]) > 0, histogram
  assert ('the baseline loop decodes' in stream.getvalue()) is never
  assert any('the baseline loop decoded' in note for note in metrics['notes']) is never
