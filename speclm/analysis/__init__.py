"""speclm.analysis: the paper's §3 as a tool — predict a speedup, then explain a measured one.

  theory    Eq. (1), Theorems 3.8 / 3.11, Corollary 3.9, optimal γ, the oracle bound, Table 1,
            token trees (expected tokens per call from per-rank acceptance rates)
  measure   α by Corollary 3.6 (and DLK, β histogram, β autocorrelation), c and r, speedups
  report    Table-4-shaped predicted-vs-measured reports, Table 1 as markdown, model specs
  figures   PNG figures (needs matplotlib; import `speclm.analysis.figures` explicitly)

Command line: `python -m speclm.analysis --help`.
"""

from speclm.analysis import measure
from speclm.analysis import report
from speclm.analysis import theory
from speclm.analysis.measure import estimate_alpha
from speclm.analysis.measure import measure_costs
from speclm.analysis.measure import measure_speedup
from speclm.analysis.theory import expected_tokens_per_iteration
from speclm.analysis.theory import operations_factor
from speclm.analysis.theory import optimal_gamma
from speclm.analysis.theory import oracle_tokens_bound
from speclm.analysis.theory import speedup_exists
from speclm.analysis.theory import speedup_lower_bound
from speclm.analysis.theory import tree_expected_tokens
from speclm.analysis.theory import walltime_improvement

__all__ = [
    'estimate_alpha', 'expected_tokens_per_iteration', 'measure', 'measure_costs',
    'measure_speedup', 'operations_factor', 'optimal_gamma', 'oracle_tokens_bound', 'report',
    'speedup_exists', 'speedup_lower_bound', 'theory', 'tree_expected_tokens',
    'walltime_improvement',
]
