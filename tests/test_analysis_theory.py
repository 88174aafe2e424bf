"""speclm.analysis.theory against hand-computed values, the paper's Table 1, and edge cases.

Also the report tables and the command line's `--help` and `theory` subcommand (no models).
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from speclm.analysis import __main__ as cli
from speclm.analysis import report
from speclm.analysis import theory

# The cells of Table 1 (c = ĉ = 0) as the paper prints them: (α, γ, speed, operations).
TABLE1 = [(0.6, 2, 1.96, 1.53), (0.7, 3, 2.53, 1.58), (0.8, 2, 2.44, 1.23),
          (0.8, 5, 3.69, 1.63), (0.9, 2, 2.71, 1.11), (0.9, 10, 6.86, 1.60)]


@pytest.mark.parametrize('alpha,gamma,speed,operations', TABLE1)
def test_table1_cells_match_the_paper(alpha, gamma, speed, operations):
  assert round(theory.walltime_improvement(alpha, gamma, c=0.0), 2) == speed
  assert round(theory.operations_factor(alpha, gamma, c_hat=0.0), 2) == operations


def test_table1_regenerated_rows_carry_the_papers_numbers():
  rows = theory.table1()
  assert [(r.alpha, r.gamma) for r in rows] == [(a, g) for a, g, _, _ in TABLE1]
  for row in rows:
    assert round(row.speed, 2) == row.paper_speed
    assert round(row.operations, 2) == row.paper_operations
  text = report.table1_markdown(rows)
  assert '| 0.8 | 5 | 3.69 | 1.63 | 3.69 | 1.63 |' in text
  # A different c drops the paper's columns (they only hold for c = ĉ = 0).
  assert theory.table1([(0.8, 5)], c=0.05)[0].paper_speed is None


def test_expected_tokens_hand_values():
  # (1 − α^(γ+1)) / (1 − α) = 1 + α + … + α^γ.
  assert theory.expected_tokens_per_iteration(0.5, 1) == pytest.approx(1.5)
  assert theory.expected_tokens_per_iteration(0.5, 2) == pytest.approx(1.75)
  assert theory.expected_tokens_per_iteration(0.8, 5) == pytest.approx(
      (1 - 0.8 ** 6) / 0.2, rel=1e-12)
  assert theory.expected_tokens_per_iteration(0.3, 0) == pytest.approx(1.0)


def test_expected_tokens_edge_cases():
  for gamma in (1, 4, 20):
    assert theory.expected_tokens_per_iteration(0.0, gamma) == 1.0  # only the corrected token
    assert theory.expected_tokens_per_iteration(1.0, gamma) == gamma + 1  # the α → 1 limit
    # Continuous as α → 1, where the naive quotient loses its digits.
    for eps in (1e-3, 1e-8, 1e-13):
      alpha = 1.0 - eps
      series = sum(alpha ** i for i in range(gamma + 1))
      assert theory.expected_tokens_per_iteration(alpha, gamma) == pytest.approx(series,
                                                                                 rel=1e-10)


def test_expected_tokens_broadcasts_over_arrays():
  alphas = np.array([0.0, 0.5, 1.0])
  out = theory.expected_tokens_per_iteration(alphas[:, None], np.array([1, 2])[None, :])
  np.testing.assert_allclose(out, [[1, 1], [1.5, 1.75], [2, 3]])


def test_walltime_improvement_hand_values():
  # Theorem 3.8: 1.75 tokens per iteration, cost γc + 1 = 1.2 target calls.
  assert theory.walltime_improvement(0.5, 2, c=0.1) == pytest.approx(1.75 / 1.2)
  # Generalised: a verification call costs r = 1.5 target calls.
  assert theory.walltime_improvement(0.5, 2, c=0.1, r=1.5) == pytest.approx(1.75 / 1.7)
  # r = 1 is the paper's formula; c = 0 leaves Eq. (1).
  assert theory.walltime_improvement(0.7, 4, 0.05, r=1.0) == theory.walltime_improvement(
      0.7, 4, 0.05)
  assert theory.walltime_improvement(0.7, 4, 0.0) == pytest.approx(
      theory.expected_tokens_per_iteration(0.7, 4))
  # The paper's T5-small EnDe example: α = 0.75, c = 0.02, γ = 7 -> about 3.2×.
  assert theory.walltime_improvement(0.75, 7, 0.02) == pytest.approx(3.157, abs=1e-3)


def test_walltime_improvement_edge_cases():
  # α = 0: one token per iteration, the draft calls are pure overhead.
  assert theory.walltime_improvement(0.0, 3, 0.1) == pytest.approx(1 / 1.3)
  # α = 1: every guess is kept.
  assert theory.walltime_improvement(1.0, 3, 0.1) == pytest.approx(4 / 1.3)
  assert theory.walltime_improvement(1.0, 3, 0.0) == 4.0


def test_operations_factor_hand_values_and_edges():
  # Theorem 3.11: (γĉ + γ + 1) / E[tokens].
  assert theory.operations_factor(0.5, 2, c_hat=0.1) == pytest.approx(3.2 / 1.75)
  assert theory.operations_factor(0.0, 4, c_hat=0.1) == pytest.approx(4 * 0.1 + 4 + 1)
  assert theory.operations_factor(1.0, 4, c_hat=0.0) == pytest.approx(1.0)
  assert theory.operations_factor(1.0, 4, c_hat=0.5) == pytest.approx(7 / 5)


def test_corollary_3_9_existence_and_lower_bound():
  gammas = np.arange(1, 200)
  for alpha in (0.05, 0.2, 0.5, 0.9):
    for c in (0.0, 0.01, 0.1, 0.5, 0.9, 1.0):
      speeds = theory.walltime_improvement(alpha, gammas, c)
      assert theory.speedup_exists(alpha, c) == (alpha > c)
      # (α = c gives exactly 1 at γ = 1, up to rounding.)
      assert theory.speedup_exists(alpha, c) == bool(np.max(speeds) > 1.0 + 1e-12)
      bound = theory.speedup_lower_bound(alpha, c)
      assert bound == pytest.approx(speeds[0])  # the bound is Theorem 3.8 at γ = 1
      if alpha > c:
        assert bound > 1.0
        assert np.max(speeds) >= bound - 1e-12
  assert theory.speedup_lower_bound(0.0, 0.0) == 1.0


def test_optimal_gamma_is_the_argmax():
  gammas = np.arange(1, 65)
  for alpha in (0.3, 0.5, 0.75, 0.9):
    for c in (0.01, 0.05, 0.2):
      for r in (1.0, 1.5):
        best = theory.optimal_gamma(alpha, c, r)
        speeds = theory.walltime_improvement(alpha, gammas, c, r)
        assert best.gamma == int(np.argmax(speeds)) + 1
        assert best.improvement == pytest.approx(np.max(speeds))
        assert not best.at_limit


def test_optimal_gamma_known_values_and_edges():
  # Figure 3's largest value: α = 0.9, c = 0.01 -> γ* = 24.
  assert theory.optimal_gamma(0.9, 0.01).gamma == 24
  # Higher c, smaller γ*; higher α, larger γ*.
  assert theory.optimal_gamma(0.8, 0.1).gamma < theory.optimal_gamma(0.8, 0.01).gamma
  assert theory.optimal_gamma(0.6, 0.05).gamma < theory.optimal_gamma(0.9, 0.05).gamma
  # c = 0: more guesses always help, even below float resolution; the search range binds.
  free = theory.optimal_gamma(0.2, 0.0, max_gamma=40)
  assert free.gamma == 40 and free.at_limit
  # α = 0: nothing helps; the cheapest γ is returned and marked as no improvement.
  useless = theory.optimal_gamma(0.0, 0.0)
  assert useless.gamma == 1 and not useless.beneficial
  # α ≤ c: Corollary 3.9 says no speedup at any γ.
  assert not theory.optimal_gamma(0.3, 0.4).beneficial
  assert list(theory.optimal_gamma_grid([0.5, 0.9], 0.01)) == [
      theory.optimal_gamma(0.5, 0.01).gamma, 24]


def test_oracle_bound():
  assert theory.oracle_tokens_bound(0.0) == 1.0
  assert theory.oracle_tokens_bound(0.75) == pytest.approx(4.0)
  assert theory.oracle_tokens_bound(1.0) == np.inf
  # Eq. (1) approaches the bound from below as γ grows.
  for alpha in (0.3, 0.8):
    tokens = theory.expected_tokens_per_iteration(alpha, np.arange(1, 400))
    assert np.all(tokens <= theory.oracle_tokens_bound(alpha) + 1e-12)
    assert tokens[-1] == pytest.approx(theory.oracle_tokens_bound(alpha))


def _simulated_batch_iterations(alphas, gamma, num_tokens, trials, seed=0):
  """E[max_b R_b] by direct simulation of Algorithm 1's i.i.d. acceptances (mean, std error)."""
  rng = np.random.default_rng(seed)
  counts = np.broadcast_to(num_tokens, (len(alphas),))
  iterations = np.zeros((trials, len(alphas)))
  for b, alpha in enumerate(alphas):
    made = np.zeros(trials)
    while np.any(made < counts[b]):
      active = made < counts[b]
      accepted = np.sum(np.cumprod(rng.random((trials, gamma)) < alpha, axis=1), axis=1)
      made += active * (accepted + 1)
      iterations[:, b] += active
  most = iterations.max(axis=1)
  return most.mean(), most.std() / np.sqrt(trials)


@pytest.mark.parametrize('alphas,gamma,num_tokens', [
    ([0.4], 3, 50), ([0.2, 0.5, 0.7], 3, 40), ([0.45] * 8, 1, 64), ([0.0, 0.9], 2, 30),
    ([0.3, 0.8, 0.5], 3, [12, 40, 0])])
def test_expected_batch_iterations_matches_simulation(alphas, gamma, num_tokens):
  exact = theory.expected_batch_iterations(alphas, gamma, num_tokens)
  mean, stderr = _simulated_batch_iterations(alphas, gamma, num_tokens, trials=4000)
  assert abs(exact - mean) < 4 * stderr + 1e-9, (exact, mean, stderr)


def test_batch_iterations_edge_cases_and_limits():
  # α = 0: one token an iteration; α = 1: γ + 1 tokens an iteration, the last one cut short.
  assert theory.expected_batch_iterations([0.0, 0.0], 3, 17) == pytest.approx(17.0)
  assert theory.expected_batch_iterations([1.0], 3, 17) == pytest.approx(5.0)
  cdf = theory.iterations_cdf(0.6, 2, 25)
  assert cdf[0] == 0.0 and cdf[-1] == 1.0 and np.all(np.diff(cdf) >= 0)
  # A long single-row generation approaches Eq. (1), and Theorem 3.8 with it.
  one_row = theory.batch_walltime_improvement([0.5], 3, 0.05, 1.1, num_tokens=4000)
  assert one_row == pytest.approx(theory.walltime_improvement(0.5, 3, 0.05, 1.1), rel=2e-3)
  # The slowest row sets the pace: adding rows never helps, and a slow row hurts.
  alone = theory.batch_walltime_improvement([0.6], 3, 0.05, 1.0, num_tokens=128)
  same = theory.batch_walltime_improvement([0.6] * 8, 3, 0.05, 1.0, num_tokens=128)
  mixed = theory.batch_walltime_improvement([0.6] * 7 + [0.2], 3, 0.05, 1.0, num_tokens=128)
  assert mixed < same < alone
  assert mixed < theory.batch_walltime_improvement([0.2], 3, 0.05, 1.0, num_tokens=128) * 1.001
  # Rows with their own lengths (an end token): a row with no tokens left changes nothing,
  # and the baseline's calls are the longest row's.
  assert theory.expected_batch_iterations([0.5, 0.9], 2, [20, 0]) == pytest.approx(
      theory.expected_batch_iterations([0.5], 2, 20))
  assert theory.batch_walltime_improvement([0.0, 0.0], 2, 0.1, 1.0, [7, 3]) == pytest.approx(
      1 / 1.2)


@pytest.mark.parametrize('call', [
    lambda: theory.expected_batch_iterations([], 3, 10),
    lambda: theory.expected_batch_iterations([0.5, 1.5], 3, 10),
    lambda: theory.expected_batch_iterations([0.5], 3, 0),
    lambda: theory.batch_walltime_improvement([0.5], 3, -0.1),
    lambda: theory.batch_walltime_improvement([0.5], 3, 0.1, r=0.0),
    lambda: theory.iterations_cdf(0.5, 3, True),
    lambda: theory.expected_batch_iterations([0.5, 0.5], 3, [4]),
    lambda: theory.expected_batch_iterations([0.5, 0.5], 3, [0, 0]),
    lambda: theory.expected_batch_iterations([0.5], 3, [-1]),
    lambda: theory.expected_tokens_per_iteration(1.2, 3),
    lambda: theory.expected_tokens_per_iteration(-0.1, 3),
    lambda: theory.expected_tokens_per_iteration(float('nan'), 3),
    lambda: theory.expected_tokens_per_iteration(0.5, -1),
    lambda: theory.expected_tokens_per_iteration(0.5, 2.5),
    lambda: theory.walltime_improvement(0.5, 3, -0.1),
    lambda: theory.walltime_improvement(0.5, 3, 0.1, r=0.0),
    lambda: theory.operations_factor(0.5, 3, c_hat=-1.0),
    lambda: theory.optimal_gamma(0.5, 0.1, max_gamma=0),
])
def test_bad_inputs_raise_clear_errors(call):
  with pytest.raises(ValueError):
    call()


def test_report_row_predictions_and_markdown():
  row = report.ReportRow.from_numbers('toy', gamma=5, alpha=0.8, c=0.0, r=1.25,
                                      sampling='T=0', measured_speedup=2.5)
  assert row.expected_tokens == pytest.approx(3.68928)
  assert row.predicted_speedup_paper == pytest.approx(3.68928)
  assert row.predicted_speedup_generalized == pytest.approx(3.68928 / 1.25)
  text = report.report_markdown([row])
  assert '| toy | 5 | T=0 | 0.800 | – |' in text
  assert '3.69×' in text and '2.95×' in text and '2.50×' in text
  decoded = json.loads(report.report_json([row]))
  assert decoded['rows'][0]['alpha_loop'] is None  # NaN becomes null
  assert decoded['rows'][0]['optimal_gamma'] == row.optimal_gamma


def test_model_spec_parsing():
  assert report.parse_model_spec('random:vocab=64, layers=2') == (
      'random', {'vocab': '64', 'layers': '2'})
  assert report.parse_model_spec('random') == ('random', {})
  with pytest.raises(ValueError, match='Unknown model kind'):
    report.model_from_spec('nonsense:x=1')
  with pytest.raises(ValueError, match='key=value'):
    report.parse_model_spec('random:vocab')
  with pytest.raises(ValueError, match='Unknown option'):
    report.model_from_spec('random:vocabulary=3')


def test_cli_help_as_a_module():
  out = subprocess.run([sys.executable, '-m', 'speclm.analysis', '--help'],
                       capture_output=True, text=True, check=True, timeout=120).stdout
  for command in ('theory', 'alpha', 'cost', 'report'):
    assert command in out


@pytest.mark.parametrize('command,expected', [
    ('theory', 'Theorem 3.8'), ('alpha', 'Corollary 3.6'), ('cost', 'jax.jit'),
    ('report', 'Table-4'),
])
def test_cli_subcommand_help(command, expected, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main([command, '--help'])
  assert exit_info.value.code == 0
  assert expected in ' '.join(capsys.readouterr().out.split())


def test_cli_theory_prints_predictions_and_writes_files(tmp_path, capsys):
  json_path = tmp_path / 'theory.json'
  figures = tmp_path / 'figures'
  assert cli.main(['theory', '--alpha', '0.8', '--gamma', '5', '--c', '0', '--table1',
                   '--json', str(json_path), '--figures_dir', str(figures)]) == 0
  out = capsys.readouterr().out
  assert '| 0.8 | 5 | 3.69 | 1.63 | 3.69 | 1.63 |' in out  # Table 1
  assert '| 5 | 3.689 | 3.689× | 3.689× | 1.626× |' in out
  assert 'speedup exists (α > c): True' in out
  predictions = json.loads(json_path.read_text())['predictions']
  assert predictions[0]['speedup_paper'] == pytest.approx(3.68928)
  for name in ('fig2_expected_tokens.png', 'fig3_optimal_gamma.png',
               'fig4_speed_vs_operations.png'):
    assert (figures / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_cli_reports_bad_values_without_a_traceback(capsys):
  assert cli.main(['theory', '--alpha', '1.5']) == 2
  assert 'alpha' in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Token trees


def test_tree_expected_tokens_of_a_chain_is_eq1():
  for alpha, gamma in [(0.6, 2), (0.8, 5), (0.3, 1)]:
    chain = [-1] + list(range(gamma))
    assert theory.tree_expected_tokens(chain, [alpha]) == pytest.approx(
        theory.expected_tokens_per_iteration(alpha, gamma))


def test_tree_expected_tokens_by_hand():
  # Root with children of ranks 0 and 1; the rank-0 child has one child (rank 0).
  tree = [-1, 0, 0, 1]
  a0, a1 = 0.5, 0.2
  assert theory.tree_expected_tokens(tree, [a0, a1]) == pytest.approx(1 + a0 + a1 + a0 * a0)
  # A rank beyond the rates is never kept.
  assert theory.tree_expected_tokens([-1, 0, 0, 0], [0.5, 0.2]) == pytest.approx(1.7)
  assert theory.tree_walltime_improvement(tree, [a0, a1], c=0.1, r=1.2) == pytest.approx(
      (1 + a0 + a1 + a0 * a0) / (2 * 0.1 + 1.2))
  np.testing.assert_allclose(theory.rank_acceptance_rates([30, 5, 0], [60, 50, 0]),
                             [0.5, 0.1, 0.0])


def test_tree_theory_refuses_bad_input():
  with pytest.raises(ValueError, match='root'):
    theory.tree_expected_tokens([0, 0], [0.5])
  with pytest.raises(ValueError, match='summing'):
    theory.tree_expected_tokens([-1, 0], [0.8, 0.5])


def test_choose_tree_pays_for_width_only_when_the_tokens_do():
  chain = [-1, 0, 1, 2]
  wide = [-1, 0, 0, 0, 1, 1, 2]  # 3 candidates at the root
  rates = [0.5, 0.2, 0.1]
  # Verification as cheap for 7 rows as for 4: the wider tree wins (more tokens per call).
  best, predicted = theory.choose_tree({'chain': chain, 'wide': wide}, rates, c=0.05,
                                       r={'chain': 1.0, 'wide': 1.0})
  assert best == 'wide' and predicted['wide'] > predicted['chain']
  # On a CPU where 7 rows cost 1.6 steps the chain wins.
  best, _ = theory.choose_tree({'chain': chain, 'wide': wide}, rates, c=0.05,
                               r={'chain': 1.05, 'wide': 1.6})
  assert best == 'chain'
