"""A job's settings, validated before anything is loaded or written.

`run_job`'s gin surface (its keyword arguments) becomes one frozen `JobSettings`: every value
checked in Python, with a message that names the gin binding to change, before the output
directory is locked or a model is read. A corrected rerun is then never refused as "a
different job" for a setting the first run rejected too late.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from speclm import decoding
from speclm import sampling as sampling_lib
from speclm import token_trees
from speclm.analysis import job_metrics
from speclm.run.calibration import tree_policy as tree_policy_lib
from speclm.data import inputs as inputs_lib
from speclm.run import providers
from speclm.run.errors import JobError

MODES = tuple(job_metrics.METHODS)
ON_BAD_LOGITS = ('fail', 'warn')
ADAPTIVE = 'adaptive'  # run_job.gamma for `speclm.adaptive.AdaptiveGamma`


@dataclasses.dataclass(frozen=True)
class JobSettings:
  """What a job does, as validated values (see `run_job` for each setting's meaning).

  Attributes:
    mode: 'speculative', 'baseline' or 'compare'.
    methods: the methods decoded per batch, in order ('baseline' first in compare mode).
    gamma: γ (an int) or `ADAPTIVE`.
    max_gamma, draft_stopping, prior_alpha: the adaptive rule's settings.
    tree: a fixed token tree (`token_trees.TreeShape` / `DynamicTree`), or None.
    policy: a `@tree_policy()` that chooses the tree at start-up, or None.
    sampling: the `SamplingConfig` both methods sample with.
    buckets: the input length buckets (ascending; the last ≥ max_input_length).
    The rest are `run_job`'s arguments as given.
  """

  mode: str
  methods: tuple[str, ...]
  output_dir: str
  gamma: int | str
  max_gamma: int
  draft_stopping: bool
  prior_alpha: float
  tree: Any
  policy: tree_policy_lib.TreePolicy | None
  sampling: sampling_lib.SamplingConfig
  max_new_tokens: int
  batch_size: int
  seed: int
  max_input_length: int
  buckets: tuple[int, ...]
  on_too_long: str
  add_eos_to_inputs: bool
  max_examples: int | None
  exclude_compile_time: bool
  measure_cost: bool
  reference_metrics: tuple[str, ...]
  show_progress: bool
  overwrite: bool
  on_bad_logits: str

  @property
  def adaptive(self) -> bool:
    """Whether γ is chosen every round (`speclm.adaptive.AdaptiveGamma`)."""
    return self.gamma == ADAPTIVE

  @property
  def speculates(self) -> bool:
    """Whether the job decodes the speculative method (and so loads a draft)."""
    return 'speculative' in self.methods

  def describe_gamma(self, tree) -> int | str:
    """γ as the report and fingerprint show it: `tree`'s description when a tree decodes."""
    return self.gamma if tree is None else tree.describe()

  def fingerprint_entries(self) -> dict[str, Any]:
    """The settings part of the job's fingerprint (`speclm.run.fingerprint`): the values the
    job decodes with. Its keys and their order are those job.json has always held."""
    speculative = self.speculates
    return {
        'mode': self.mode, 'gamma': self.describe_gamma(self.tree) if speculative else None,
        **({'tree': repr(self.tree)} if self.tree is not None and speculative else {}),
        **({'tree_policy': repr(self.policy)} if self.policy is not None else {}),
        **({'max_gamma': self.max_gamma, 'draft_stopping': self.draft_stopping}
           if self.adaptive and speculative else {}),
        'temperature': self.sampling.temperature, 'top_k': self.sampling.top_k,
        'top_p': self.sampling.top_p, 'max_new_tokens': self.max_new_tokens,
        'seed': self.seed, 'batch_size': self.batch_size,
        'max_input_length': self.max_input_length, 'length_buckets': list(self.buckets),
        'on_too_long': self.on_too_long, 'add_eos_to_inputs': self.add_eos_to_inputs,
        'max_examples': self.max_examples,
    }


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value: Any, minimum: int, hint: str = '') -> int:
  if not _is_int(value) or value < minimum:
    raise JobError(f'run_job.{name} must be an integer >= {minimum}, got {value!r}.{hint}')
  return value


def _choice(name: str, value: Any, allowed: Sequence[str]) -> str:
  if value not in allowed:
    raise JobError(f'run_job.{name} must be one of {tuple(allowed)}, got {value!r}.')
  return value


def _gamma(gamma: Any, max_gamma: Any, prior_alpha: Any) -> int | str:
  """γ (an int ≥ 1) or 'adaptive' (then max_gamma ≥ 1 and prior_alpha in [0, 1])."""
  adaptive_gamma = gamma == ADAPTIVE
  try:
    if adaptive_gamma:
      decoding.check_gamma(max_gamma)
    else:
      gamma = decoding.check_gamma(gamma)
  except ValueError as e:
    raise JobError(f"run_job.{'max_gamma' if adaptive_gamma else 'gamma'}: {e} (gamma may"
                   f" also be '{ADAPTIVE}').") from None
  if adaptive_gamma and (isinstance(prior_alpha, bool) or not isinstance(prior_alpha, (int, float))
                         or not 0.0 <= prior_alpha <= 1.0):
    raise JobError(f'run_job.prior_alpha must be a number in [0, 1], got {prior_alpha!r}.')
  return gamma


def _tree(tree: Any, *, adaptive_gamma: bool, partitioner: Any,
          speculates: bool) -> tuple[Any, tree_policy_lib.TreePolicy | None]:
  """(a fixed token tree or None, a tree policy or None) from `run_job.tree`."""
  if tree is None:
    return None, None
  tree = providers.provide(tree, 'The token tree setting')
  policy = None
  if isinstance(tree, tree_policy_lib.TreePolicy):
    policy, tree = tree, None
  else:
    try:
      token_trees.check_tree(tree)
    except ValueError as e:
      raise JobError(f'run_job.tree: {e} (or a @tree_policy()).') from None
  if adaptive_gamma:
    raise JobError("run_job.tree and gamma = 'adaptive' exclude each other: a tree round"
                   ' has its own shape (and a tree policy times the chain at a fixed γ). Set'
                   ' GAMMA to an integer (--gin.GAMMA=3; demo.gin sets adaptive) or unset'
                   ' run_job.tree.')
  if partitioner is not None:
    raise JobError('run_job.tree runs on one device; unset run_job.partitioner.')
  if policy is not None and not speculates:
    policy = None  # nothing to choose for the baseline alone
  return tree, policy


def _buckets(length_buckets: Sequence[int] | None, max_input_length: int) -> tuple[int, ...]:
  if length_buckets:
    if not all(_is_int(b) and b >= 1 for b in length_buckets):
      raise JobError(f'run_job.length_buckets must be integers >= 1, got {length_buckets!r}.')
    buckets = tuple(sorted(length_buckets))
  else:
    buckets = inputs_lib.default_buckets(max_input_length)
  if buckets[-1] < max_input_length:
    raise JobError(f'The largest length bucket ({buckets[-1]}) is below max_input_length'
                   f' ({max_input_length}); add a bucket of at least that width.')
  return buckets


def _seed(seed: Any) -> int:
  if not _is_int(seed):
    raise JobError(f'run_job.seed must be an integer (the base seed; each batch adds its first'
                   f' example\'s index), got {seed!r}.')
  return seed


def _flag(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, int)) or isinstance(value, int) and value not in (0, 1):
    raise JobError(f'run_job.{name} must be True or False, got {value!r}.')
  return bool(value)


def validate(*, mode, draft, output_dir, gamma, max_gamma, draft_stopping, prior_alpha, tree,
             sampling, max_new_tokens, batch_size, seed, max_input_length, length_buckets,
             on_too_long, add_eos_to_inputs, max_examples, exclude_compile_time, measure_cost,
             reference_metrics, show_progress, partitioner, overwrite,
             on_bad_logits) -> JobSettings:
  """`run_job`'s arguments as `JobSettings`, or a `JobError` naming the setting to change.

  Nothing is loaded (a tree or sampling provider is called, as they are cheap) and nothing is
  written: the output directory is only named here.
  """
  mode = _choice('mode', mode, MODES)
  on_bad_logits = _choice('on_bad_logits', on_bad_logits, ON_BAD_LOGITS)
  on_too_long = _choice('on_too_long', on_too_long, inputs_lib.ON_TOO_LONG)
  methods = job_metrics.METHODS[mode]
  if mode != 'baseline' and draft is None:
    raise JobError(f"Mode {mode!r} needs a draft model: set run_job.draft (e.g. DRAFT ="
                   " @draft/random_llama), or use mode 'baseline'.")
  if not isinstance(output_dir, str) or not output_dir:
    raise JobError(f'run_job.output_dir must be a directory path, got {output_dir!r}.'
                   " Set OUTPUT_DIR, e.g. --gin.OUTPUT_DIR=\"'/tmp/out'\".")
  gamma = _gamma(gamma, max_gamma, prior_alpha)
  tree, policy = _tree(tree, adaptive_gamma=gamma == ADAPTIVE, partitioner=partitioner,
                       speculates='speculative' in methods)
  sampling = providers.provide(sampling, 'The sampling setting', sampling_lib.SamplingConfig)
  max_new_tokens = _require_int('max_new_tokens', max_new_tokens, 1)
  max_input_length = _require_int('max_input_length', max_input_length, 1)
  if max_examples is not None:
    _require_int('max_examples', max_examples, 1, ' (None decodes every example)')
  if isinstance(reference_metrics, str):
    reference_metrics = (reference_metrics,)
  return JobSettings(
      mode=mode, methods=tuple(methods), output_dir=output_dir, gamma=gamma,
      max_gamma=max_gamma, draft_stopping=bool(draft_stopping),
      prior_alpha=float(prior_alpha) if gamma == ADAPTIVE else prior_alpha, tree=tree,
      policy=policy, sampling=sampling, max_new_tokens=max_new_tokens,
      batch_size=_require_int('batch_size', batch_size, 1),
      seed=_seed(seed),
      max_input_length=max_input_length, buckets=_buckets(length_buckets, max_input_length),
      on_too_long=on_too_long, add_eos_to_inputs=_flag('add_eos_to_inputs', add_eos_to_inputs),
      max_examples=max_examples,
      exclude_compile_time=_flag('exclude_compile_time', exclude_compile_time),
      measure_cost=_flag('measure_cost', measure_cost),
      reference_metrics=tuple(reference_metrics or ()),
      show_progress=_flag('show_progress', show_progress), overwrite=_flag('overwrite', overwrite),
      on_bad_logits=on_bad_logits)
