"""speclm.analysis: the paper's §3 as a tool — predict a speedup, then explain a measured one.

It explains results after decoding and never runs a decode loop itself: what is timed or
decoded to measure a pair (c and r, α on the target's text, a timed speedup, a job's tree
policy) is `speclm.run.calibration`, which keeps its results in the records defined here.

  theory        Eq. (1), Theorems 3.8 / 3.11, Corollary 3.9, optimal γ, the oracle bound,
                Table 1, token trees (expected tokens per call from per-rank acceptance rates)
  measure       α from teacher-forced β along a text (Corollary 3.6; DLK, β histogram, β
                autocorrelation), α per row from a decode's statistics, greedy rounds replayed
                on β, and the records `Reference`, `AlphaEstimate`, `CostEstimate`,
                `SpeedupMeasurement`
  report        Table-4-shaped predicted-vs-measured rows, Table 1 as markdown, model specs
  job_metrics   a job's metrics.json and summary table
  benchmarking  the interleaved timing harness the benchmarks and the calibration share
  profile_parts a profiler trace's decode-loop operations by part of the program (the
                target's layers, its head, the draft, the loop), for scripts/profile_decode.py
  figures       PNG figures (needs matplotlib; import `speclm.analysis.figures` explicitly)

Command line: `python -m speclm.analysis --help` (its alpha, cost and report subcommands
measure through `speclm.run.calibration`).
"""

from speclm.analysis import measure
from speclm.analysis import report
from speclm.analysis import theory
from speclm.analysis.measure import AlphaEstimate
from speclm.analysis.measure import BetaSummary
from speclm.analysis.measure import CostEstimate
from speclm.analysis.measure import SpeedupMeasurement
from speclm.analysis.measure import summarize_beta
from speclm.analysis.theory import expected_tokens_per_iteration
from speclm.analysis.theory import operations_factor
from speclm.analysis.theory import optimal_gamma
from speclm.analysis.theory import oracle_tokens_bound
from speclm.analysis.theory import speedup_exists
from speclm.analysis.theory import speedup_lower_bound
from speclm.analysis.theory import tree_expected_tokens
from speclm.analysis.theory import walltime_improvement

__all__ = [
    'AlphaEstimate', 'BetaSummary', 'CostEstimate', 'SpeedupMeasurement',
    'expected_tokens_per_iteration', 'measure', 'operations_factor', 'optimal_gamma',
    'oracle_tokens_bound', 'report', 'speedup_exists', 'speedup_lower_bound', 'summarize_beta',
    'theory', 'tree_expected_tokens', 'walltime_improvement',
]
