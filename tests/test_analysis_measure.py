"""speclm.analysis.measure and the measurements of speclm.run.calibration: α estimators
against analytic values, Eq. (1) by simulation, and the loop's own α against Corollary 3.6 on
a real (tiny) model pair.

Fake models first (a bigram "model" whose α is computable in closed form), real ones second.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
from flax import struct

import speclm
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import speculative
from speclm import testing
from speclm.analysis import __main__ as cli
from speclm.analysis import measure
from speclm.analysis import report
from speclm.analysis import theory
from speclm.run import calibration

# ----------------------------------------------------------------------------------------------
# A bigram model: logits for the next token depend only on the current one (params[token]).


@struct.dataclass
class _LengthCache:
  lengths: jax.Array
  slots: jax.Array  # [B, L], only its shape is used (capacity)

  @property
  def capacity(self) -> int:
    return self.slots.shape[1]


@dataclasses.dataclass(frozen=True)
class _Bigram(protocol.LanguageModel):
  vocab: int

  @property
  def vocab_size(self):
    return self.vocab

  def init_cache(self, batch_size, max_length):
    return _LengthCache(lengths=jnp.zeros((batch_size,), jnp.int32),
                        slots=jnp.zeros((batch_size, max_length), jnp.int8))

  def prefill(self, params, inputs, input_lengths, cache):
    last = jnp.take_along_axis(inputs, (input_lengths - 1)[:, None], axis=1)[:, 0]
    return params[last], cache.replace(lengths=input_lengths.astype(jnp.int32))

  def extend(self, params, tokens, cache):
    return params[tokens], cache.replace(lengths=cache.lengths + tokens.shape[1])

  def prefix_length(self, input_lengths):
    return input_lengths

  def last_prefix_token(self, inputs, input_lengths):
    return jnp.take_along_axis(inputs, (input_lengths - 1)[:, None], axis=1)[:, 0]


V = 6


def _bigram_pair():
  rng = np.random.default_rng(0)
  target_logits = rng.normal(size=(V, V)).astype(np.float32) * 2.0
  draft_logits = target_logits + rng.normal(size=(V, V)).astype(np.float32) * 1.5
  return (protocol.Model(_Bigram(V), jnp.asarray(target_logits)),
          protocol.Model(_Bigram(V), jnp.asarray(draft_logits)))


def _analytic_bigram_alpha(target, draft, sampling, start_token, num_tokens):
  """E[mean β over positions 0 … T−1] for text that the target writes from `start_token`.

  Position t predicts token t from token t−1 (the prompt's last token for t = 0), so
  E[β_t] = π_t · B with B(s) = Σ_x min(p̃(x|s), q̃(x|s)) and π_t the distribution of token
  t−1: π_0 = one-hot(start), π_{t+1} = π_t P̃ (at temperature 0, P̃ is the argmax map).
  """
  p = np.asarray(sampling_lib.standardize(target.params, sampling), np.float64)
  q = np.asarray(sampling_lib.standardize(draft.params, sampling), np.float64)
  overlap = np.minimum(p, q).sum(-1)
  pi = np.eye(V)[start_token]
  total = 0.0
  for _ in range(num_tokens):
    total += pi @ overlap
    pi = pi @ p
  return total / num_tokens


# ----------------------------------------------------------------------------------------------
# β on synthetic distributions


def test_overlap_matches_total_variation_on_random_distributions():
  rng = np.random.default_rng(1)
  p = rng.dirichlet(np.full(9, 0.5), size=500)
  q = rng.dirichlet(np.full(9, 0.5), size=500)
  # β = Σ min(p, q) = 1 − DLK = 1 − ½ Σ |p − q| (Lemma 3.3).
  np.testing.assert_allclose(measure.overlap(p, q), 1 - 0.5 * np.abs(p - q).sum(-1), atol=1e-6)
  # A draft mixing the target with uniform noise: β = 1 − ε Σ max(0, p − 1/V).
  eps = 0.3
  mixed = (1 - eps) * p + eps / 9
  np.testing.assert_allclose(measure.overlap(p, mixed),
                             1 - eps * np.maximum(p - 1 / 9, 0).sum(-1), atol=1e-6)
  assert measure.overlap(np.eye(3)[0], np.eye(3)[1]) == 0.0  # disjoint supports
  assert measure.overlap(p[0], p[0]) == pytest.approx(1.0)


def test_summarize_beta_mean_histogram_and_mask():
  beta = np.array([[1.0, 0.0, 0.5, 0.25], [0.75, 1.0, 9.0, 9.0]])
  mask = np.array([[True, True, True, True], [True, True, False, False]])
  summary = measure.summarize_beta(beta, mask, bins=4, max_lag=2)
  assert summary.num_positions == 6
  assert summary.alpha == pytest.approx(3.5 / 6)
  assert summary.dlk == pytest.approx(1 - 3.5 / 6)
  assert summary.histogram.sum() == 6
  assert summary.histogram.tolist() == [1, 1, 1, 3]  # β = 1.0 falls in the closed last bin
  json.dumps(summary.to_dict())  # serializable
  with pytest.raises(ValueError):
    measure.summarize_beta(np.array([1.5]))


def test_autocorrelation_of_iid_and_markov_beta():
  rng = np.random.default_rng(2)
  iid = rng.uniform(size=(4, 5000))
  rho = measure.beta_autocorrelation(iid, max_lag=5)
  assert np.all(np.abs(rho) < 4 / np.sqrt(iid.size))  # zero within sampling error
  # A two-state chain that keeps its state with probability s has ρ(k) = (2s − 1)^k.
  stay = 0.8
  states = np.empty(40_000)
  states[0] = 1.0
  flips = rng.uniform(size=states.size) > stay
  for t in range(1, states.size):
    states[t] = 1.0 - states[t - 1] if flips[t] else states[t - 1]
  rho = measure.beta_autocorrelation(states, max_lag=3)
  np.testing.assert_allclose(rho, [0.6, 0.36, 0.216], atol=0.04)
  assert np.all(np.isnan(measure.beta_autocorrelation(np.ones(10), max_lag=2)))  # constant β


# ----------------------------------------------------------------------------------------------
# Corollary 3.6 on a bigram pair, where α is known in closed form


def test_corollary_3_6_on_bigram_models_greedy_is_exact():
  target, draft = _bigram_pair()
  prompts = np.array([[1, 2, 3]] * 4, np.int32)
  lengths = np.array([3, 3, 3, 3], np.int32)
  estimate = calibration.estimate_alpha(target, draft, prompts, lengths, tokens_per_row=25,
                                        sampling=speclm.GREEDY, batch_size=4)
  assert estimate.summary.num_positions == 100
  expected = _analytic_bigram_alpha(target, draft, speclm.GREEDY, 3, 25)
  assert estimate.alpha == pytest.approx(expected, abs=1e-6)


def test_corollary_3_6_on_bigram_models_sampled_within_sampling_error():
  """At temperature 1, rows are i.i.d. samples; the tolerance is 4 standard errors of the
  mean of per-row α (rows are independent even if positions within a row are not)."""
  target, draft = _bigram_pair()
  sampling = speclm.SamplingConfig(temperature=1.0)
  rows, length = 256, 24
  prompts = np.full((rows, 2), 4, np.int32)
  estimate = calibration.estimate_alpha(target, draft, prompts, np.full((rows,), 2, np.int32),
                                        tokens_per_row=length, sampling=sampling,
                                        batch_size=128)
  expected = _analytic_bigram_alpha(target, draft, sampling, 4, length)
  row_means = estimate.beta.mean(axis=1)
  stderr = row_means.std(ddof=1) / np.sqrt(rows)
  assert abs(estimate.alpha - expected) < 4 * stderr
  assert 0.05 < expected < 0.95  # a non-trivial case


# ----------------------------------------------------------------------------------------------
# Eq. (1) by simulation


@pytest.mark.parametrize('alpha,gamma', [(0.7, 4), (0.3, 2), (0.9, 7)])
def test_iid_acceptances_reproduce_eq1(alpha, gamma):
  """Algorithm 1's own round (speculative.speculative_round) on distributions built so that
  every drafted token is accepted independently with probability exactly α:
  p = (α, 1−α, 0), q = (α, 0, 1−α): the draft proposes token 0 (always kept, p/q = 1) with
  probability α and token 2 (never kept, p = 0) otherwise, and β = Σ min(p, q) = α. The mean
  number of tokens per round, n + 1, must match Eq. (1) within 4 standard errors, and n must
  follow the capped geometric law (χ² test at significance 0.001)."""
  rows = 20_000
  p = np.array([alpha, 1 - alpha, 0.0], np.float32)
  q = np.array([alpha, 0.0, 1 - alpha], np.float32)
  key_tokens, key_uniform, key_next = jax.random.split(jax.random.key(0), 3)
  draft_tokens = jax.random.categorical(key_tokens, jnp.log(jnp.asarray(q)), shape=(rows, gamma))
  result = speculative.speculative_round(
      jnp.broadcast_to(q, (rows, gamma, 3)), draft_tokens,
      jnp.broadcast_to(p, (rows, gamma + 1, 3)),
      jax.random.uniform(key_uniform, (rows, gamma)), key_next)
  np.testing.assert_allclose(np.asarray(result.beta), alpha, atol=1e-6)
  tokens = np.asarray(result.num_accepted) + 1
  expected = theory.expected_tokens_per_iteration(alpha, gamma)
  assert abs(tokens.mean() - expected) < 4 * tokens.std(ddof=1) / np.sqrt(rows)
  law = np.array([alpha ** k * (1 - alpha) for k in range(gamma)] + [alpha ** gamma])
  observed = np.bincount(tokens - 1, minlength=gamma + 1)
  assert scipy.stats.chisquare(observed, law * rows).pvalue > 1e-3


def test_greedy_round_replay_by_hand():
  # Token 0 comes from prefill (β[0] is never used). γ = 3, 8 new tokens.
  #   position  1 2 3 | 4     | 5 6 | 7
  #   β         1 1 1 | 0     | 1 0 | 0
  # Round 1 drafts positions 1–3 and keeps all (n = 3); it counts β_1..β_3 and the target's
  # extra token fills position 4 undrafted. Round 2 starts at 5: n = 1 (β_5 = 1, β_6 = 0); it
  # counts β_5, β_6 and the correction fills 6. Round 3 starts at 7: n = 0, counts β_7, and
  # the correction fills 7, the 8th token: done.
  beta = np.array([9, 1, 1, 1, 0, 1, 0, 0, 1, 1], float)  # position 0 is never used
  replay = measure.greedy_round_replay(beta, num_new_tokens=8, gamma=3)
  assert replay.beta_count == 3 + 2 + 1
  assert replay.beta_sum == 3 + 1 + 0
  assert replay.accepted_histogram.tolist() == [1, 1, 0, 1]
  assert replay.target_calls == 4
  with pytest.raises(ValueError, match='needs'):
    measure.greedy_round_replay(beta[:8], num_new_tokens=8, gamma=3)


# ----------------------------------------------------------------------------------------------
# A real model pair: the loop's α and Corollary 3.6's


GAMMA = 4
MAX_NEW = 40
TARGET_SPEC = 'random:vocab=64,width=32,layers=1,seed=0'


@pytest.fixture(scope='module')
def llama_pair():
  target = report.model_from_spec(TARGET_SPEC)
  draft = report.perturbed_copy(target, scale=0.3, seed=1)
  rng = np.random.default_rng(3)
  prompts = rng.integers(0, 64, size=(8, 6)).astype(np.int32)
  lengths = np.array([6, 3, 5, 4, 6, 2, 5, 6], np.int32)  # ragged prompts
  return target, draft, prompts, lengths


def test_loop_alpha_matches_corollary_3_6_on_the_same_greedy_text(llama_pair):
  """"Same data" at temperature 0. Greedy speculative decoding outputs the target's greedy
  text, so Corollary 3.6's β, computed teacher-forced along the target's own greedy text
  (generated by autoregressive_decode, MAX_NEW + γ tokens so the last round's look-ahead is
  covered), is β at exactly the prefixes the loop drafted at. Two checks:

  1. Exact: replaying Algorithm 1's rounds on that β sequence (accept iff β = 1 at
     temperature 0) must give the loop's β count and accepted histogram exactly and its β sum
     to float rounding. This pins down which positions the loop's α averages over.
  2. Approximate: the loop's α and the plain Corollary 3.6 α over all MAX_NEW positions of the
     same text differ only because the loop never drafts some positions (token 0, and the
     bonus token after γ acceptances) and may look past the limit. With β ∈ [0, 1], the gap is
     at most (positions in one set but not the other) / (positions): the stated tolerance.
  """
  target, draft, prompts, lengths = llama_pair
  replay, beta = testing.check_greedy_replay(target, draft, prompts, lengths, gamma=GAMMA,
                                             max_new_tokens=MAX_NEW)
  loop_alpha = replay.alpha
  assert 0.2 < loop_alpha < 0.8  # the perturbed copy gives a moderate α

  plain = measure.summarize_beta(beta[:, :MAX_NEW]).alpha
  in_text = MAX_NEW * len(prompts)
  # Positions the loop counted inside the text are at most its count, and those outside the
  # text (past the limit) at most (γ − 1) per row.
  outside = (GAMMA - 1) * len(prompts)
  tolerance = (in_text - (replay.beta_count - outside) + outside) / in_text
  assert abs(loop_alpha - plain) <= tolerance
  assert tolerance < 0.5  # the check has teeth: most positions are shared


def test_loop_alpha_agrees_with_corollary_3_6_when_sampling(llama_pair):
  """At temperature 1 the loop's text is a fresh sample from the target, so "same data" can
  only mean the same prompts and the same distribution of text. Corollary 3.6 on text the
  target writes from the same prompts must agree with the loop's α within 4 combined standard
  errors of the per-row means (rows are independent), plus 0.02 for the positions the loop
  does not draft (the bonus tokens; their β need not have the overall mean)."""
  target, draft, prompts, lengths = llama_pair
  sampling = speclm.SamplingConfig(temperature=1.0)
  rows = np.repeat(np.arange(len(prompts)), 4)  # 32 rows, 4 samples per prompt
  spec = speclm.speculative_decode(target, draft, prompts[rows], lengths[rows], gamma=GAMMA,
                                   sampling=sampling, max_new_tokens=MAX_NEW, seed=7)
  loop_rows = measure.alpha_per_row_from_stats(spec.stats)
  estimate = calibration.estimate_alpha(target, draft, prompts[rows], lengths[rows],
                                        tokens_per_row=MAX_NEW, sampling=sampling, seed=11,
                                        batch_size=32)
  reference_rows = estimate.beta.mean(axis=1)
  stderr = np.hypot(loop_rows.std(ddof=1), reference_rows.std(ddof=1)) / np.sqrt(len(rows))
  loop_alpha = spec.stats.alpha
  assert abs(loop_alpha - estimate.alpha) < 4 * stderr + 0.02


def test_costs_and_speedup_are_measured(llama_pair):
  target, draft, prompts, lengths = llama_pair
  # The draft shares the target's definition, so its step reuses the target step's compilation.
  costs = calibration.measure_costs(target, draft, gamma=3, batch_size=2, context_length=8,
                                    num_steps=3, repeats=2)
  for seconds in (costs.draft_step_seconds, costs.target_step_seconds,
                  costs.target_verify_seconds):
    assert 0 < seconds < 1.0
  assert costs.c == pytest.approx(costs.draft_step_seconds / costs.target_step_seconds)
  assert costs.r > 0 and costs.gamma == 3
  # r alone (benchmark_quantized.py): the two calls in turn; one token over one token is ~1.
  timing = dict(batch_size=2, context_length=8, num_steps=3, repeats=3)
  assert calibration.verification_ratio(target, num_new=4, **timing) > 0
  assert 0.3 < calibration.verification_ratio(target, num_new=1, **timing) < 3.0
  with pytest.raises(ValueError, match='repeats'):
    calibration.verification_ratio(target, num_new=4, repeats=0)
  speed = calibration.measure_speedup(target, draft, prompts, lengths, gamma=GAMMA,
                                      sampling=speclm.GREEDY, max_new_tokens=MAX_NEW,
                                      repeats=1)
  assert speed.outputs_match  # greedy: token-for-token equal
  assert speed.speedup > 0 and speed.num_tokens == MAX_NEW * len(prompts)
  assert speed.tokens_per_target_call > 1.0
  assert speed.accepted_histogram.sum() > 0


def test_run_report_puts_its_measurements_in_one_row(llama_pair):
  """`calibration.run_report` on a job's prompts: the row carries the α, c, r and speedup it
  measured (α equal to `estimate_alpha` on the same prompts: greedy text is deterministic),
  and the theory's predictions for them."""
  target, draft, prompts, lengths = llama_pair
  result = calibration.run_report(
      target, draft, name='pair', gamma=GAMMA, sampling=speclm.GREEDY, tokens_per_row=MAX_NEW,
      batch_size=8, max_new_tokens=MAX_NEW, repeats=1, prompts=(prompts, lengths))
  alpha = calibration.estimate_alpha(target, draft, prompts, lengths, tokens_per_row=MAX_NEW,
                                     sampling=speclm.GREEDY, batch_size=8)
  row = result.row
  assert row.alpha == alpha.alpha and row.alpha_positions == alpha.summary.num_positions
  assert (row.c, row.r) == (result.costs.c, result.costs.r)
  assert result.costs.context_length == int(lengths.max()) + MAX_NEW // 2
  assert row.measured_speedup == result.speed.speedup and result.speed.outputs_match
  assert row.expected_tokens == pytest.approx(
      theory.expected_tokens_per_iteration(row.alpha, GAMMA))
  assert json.loads(result.to_json())['rows'][0]['name'] == 'pair'


def test_cli_alpha_on_random_specs(tmp_path, capsys):
  # Shapes chosen like the greedy test above (8 rows, prompts of 6, MAX_NEW + γ tokens) so the
  # compiled decode and teacher-forced passes are reused.
  out_json = tmp_path / 'alpha.json'
  assert cli.main(['alpha', f'--target={TARGET_SPEC}', f'--draft={TARGET_SPEC},noise=0.5',
                   f'--num_tokens={8 * (MAX_NEW + GAMMA)}', f'--tokens_per_row={MAX_NEW + GAMMA}',
                   '--batch_size=8', '--prompt_length=6', '--max_lag=3', f'--json={out_json}',
                   f'--figures_dir={tmp_path}']) == 0
  out = capsys.readouterr().out
  assert 'α (Corollary 3.6) =' in out and 'over 352 target-generated tokens' in out
  summary = json.loads(out_json.read_text())
  assert 0.0 <= summary['alpha'] <= 1.0 and summary['num_positions'] == 352
  assert (tmp_path / 'beta_histogram.png').read_bytes()[:4] == b'\x89PNG'


def test_cli_alpha_on_a_gin_job(tmp_path, capsys):
  """`--gin_file` takes the runner job's TARGET, DRAFT and its dataset as the prompts."""
  out_json = tmp_path / 'alpha.json'
  assert cli.main(['alpha', '--gin_file=test_tiny.gin', '--gin.synthetic_dataset.num_examples=4',
                   '--tokens_per_row=8', '--batch_size=4', '--max_lag=2',
                   f'--json={out_json}']) == 0
  out = capsys.readouterr().out
  assert 'TARGET of test_tiny.gin' in out and 'over 32 target-generated tokens' in out
  assert 0.0 <= json.loads(out_json.read_text())['alpha'] <= 1.0


def test_cli_gin_job_errors_are_one_line(capsys):
  assert cli.main(['alpha', '--gin_file=test_tiny.gin', '--gin.NO_SUCH.thing=1']) == 2
  assert 'Unknown gin binding' in capsys.readouterr().err
