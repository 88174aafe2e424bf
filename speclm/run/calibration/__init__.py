"""Calibration: what a job measures on this machine before it decodes, and the decodes that
measure a model pair for the analysis command line and the benchmark scripts.

  costs         c and r(γ) from timed, compiled model calls or whole adaptive rounds
                (`measure_costs`, `measure_round_costs`, …), and `measure_adaptive_gamma`:
                the adaptive-γ rule priced with them, its timings cached per machine in
                `cost_cache_dir()` ($SPECLM_COST_CACHE, else ~/.cache/speclm/costs)
  tree_policy   `TreePolicy` and `choose`: the job's pick between token trees, the chain and
                (when allowed) the baseline, by measured speed on rows spread over its
                prompt lengths (`run_job.tree = @tree_policy()`)
  measurements  α on the target's own text (`generate_reference`, `estimate_alpha`), a timed
                speedup (`measure_speedup`) and one Table-4 row (`run_report`)

The layering: the job (`speclm.run.job`) calls this package before decoding; this package
runs the decode loops (`speclm.decoding`, `speclm.tree_decoding`) and keeps its results in the
records of `speclm.analysis` (`CostEstimate`, `AlphaEstimate`, `SpeedupMeasurement`,
`report.RunReport`), which explains them and never runs a decode itself. Nothing here reads
gin: `speclm.run.providers` gives `TreePolicy` its gin name (`@tree_policy()`).
"""

from speclm.run.calibration import costs
from speclm.run.calibration import measurements
from speclm.run.calibration import tree_policy
from speclm.run.calibration.costs import ROUND_COST_REPEATS
from speclm.run.calibration.costs import ROUND_COST_TOKENS
from speclm.run.calibration.costs import cost_cache_dir
from speclm.run.calibration.costs import measure_adaptive_gamma
from speclm.run.calibration.costs import measure_costs
from speclm.run.calibration.costs import measure_costs_cached
from speclm.run.calibration.costs import measure_round_costs
from speclm.run.calibration.costs import measure_verify_costs
from speclm.run.calibration.costs import round_cost_tokens
from speclm.run.calibration.costs import time_extend
from speclm.run.calibration.costs import time_tree_verifications
from speclm.run.calibration.costs import verification_ratio
from speclm.run.calibration.measurements import estimate_alpha
from speclm.run.calibration.measurements import generate_reference
from speclm.run.calibration.measurements import measure_speedup
from speclm.run.calibration.measurements import run_report
from speclm.run.calibration.tree_policy import PolicyChoice
from speclm.run.calibration.tree_policy import TreePolicy
from speclm.run.calibration.tree_policy import choose
from speclm.run.calibration.tree_policy import default_candidates

__all__ = [
    'PolicyChoice', 'ROUND_COST_REPEATS', 'ROUND_COST_TOKENS', 'TreePolicy', 'choose',
    'cost_cache_dir', 'costs', 'default_candidates', 'estimate_alpha', 'generate_reference',
    'measure_adaptive_gamma', 'measure_costs', 'measure_costs_cached', 'measure_round_costs',
    'measure_speedup', 'measure_verify_costs', 'measurements', 'round_cost_tokens', 'run_report',
    'time_extend', 'time_tree_verifications', 'tree_policy', 'verification_ratio',
]
