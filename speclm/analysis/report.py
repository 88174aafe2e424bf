"""Predicted-versus-measured reports (the shape of the paper's Table 4) and Table 1.

A report row puts side by side what the theory predicts from measured α, c and r and what a
real run measured:

  α (Cor. 3.6)       mean β on target-generated text (`calibration.estimate_alpha`)
  α (loop)           beta_sum / beta_count from the speculative decode itself
  c, r               `calibration.measure_costs`
  E[tokens]          Eq. (1) at α, γ — versus the loop's measured tokens per target call
  predicted          Theorem 3.8 (r = 1) and the generalised form with the measured r
  measured           walltime of autoregressive_decode / walltime of speculative_decode

The measuring (`speclm.run.calibration.run_report`, which runs the decodes) lives beside the
job; this module builds and formats the rows from its records.

Models for the command line come from small spec strings, `kind:key=value,...`, resolved by a
registry (`register_model_kind`). The built-in kind `random` builds a random-weight Llama; the
runner's gin configuration will supply real models later.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from speclm import protocol
from speclm import sampling as sampling_lib
from speclm.analysis import measure
from speclm.analysis import theory

# ----------------------------------------------------------------------------------------------
# Model specs


ModelFactory = Callable[[dict[str, str]], protocol.Model]
_MODEL_KINDS: dict[str, ModelFactory] = {}


def register_model_kind(kind: str, factory: ModelFactory) -> None:
  """Makes `kind:key=value,...` specs build models with `factory(options)` (options are strings)."""
  if not kind.isidentifier():
    raise ValueError(f'A model kind must be an identifier, got {kind!r}.')
  _MODEL_KINDS[kind] = factory


def model_kinds() -> list[str]:
  return sorted(_MODEL_KINDS)


def parse_model_spec(spec: str) -> tuple[str, dict[str, str]]:
  """'random:vocab=64,layers=2' -> ('random', {'vocab': '64', 'layers': '2'})."""
  kind, _, rest = spec.partition(':')
  options = {}
  for item in filter(None, (part.strip() for part in rest.split(','))):
    key, sep, value = item.partition('=')
    if not sep or not key:
      raise ValueError(f'Bad model spec {spec!r}: expected kind:key=value,... but got {item!r}.')
    options[key.strip()] = value.strip()
  return kind.strip(), options


def model_from_spec(spec: str) -> protocol.Model:
  """Builds the model a spec string names (see `register_model_kind`)."""
  kind, options = parse_model_spec(spec)
  if kind not in _MODEL_KINDS:
    raise ValueError(f'Unknown model kind {kind!r} in {spec!r}; known kinds: {model_kinds()}.')
  return _MODEL_KINDS[kind](options)


def perturbed_copy(model: protocol.Model, scale: float, seed: int = 0) -> protocol.Model:
  """The model with every parameter array w replaced by w + scale·std(w)·N(0, 1).

  A cheap way to get a draft whose distributions are close to, but not equal to, the target's:
  α falls from 1 as `scale` grows.
  """
  rng = np.random.default_rng(seed)  # NumPy: one vectorized draw per array, nothing to compile

  def perturb(leaf):
    leaf = np.asarray(leaf)
    noise = rng.standard_normal(leaf.shape) * (scale * float(leaf.std()))
    return jnp.asarray((leaf + noise).astype(leaf.dtype))

  return model.replace(params=jax.tree_util.tree_map(perturb, model.params))


def truncated_llama(model: protocol.Model, num_layers: int) -> protocol.Model:
  """A Llama draft made of the target's embedding, first `num_layers` layers, norm and head.

  Shares the target's weights, costs about num_layers / L of it, and agrees with it as far as
  the early layers already decide the output (an early-exit draft).
  """
  from speclm.models import llama  # the analysis package may import models; the core may not
  definition = model.definition
  if not isinstance(definition, llama.Llama):
    raise ValueError(f'truncated_llama needs a Llama model, got {type(definition).__name__}.')
  if not 1 <= num_layers <= definition.config.num_layers:
    raise ValueError(f'num_layers must be in [1, {definition.config.num_layers}], got'
                     f' {num_layers}.')
  config = dataclasses.replace(definition.config, num_layers=num_layers)
  params = {name: value for name, value in dict(model.params).items()
            if not name.startswith('layers_') or int(name.split('_')[1]) < num_layers}
  return protocol.Model(llama.Llama(config), params)


@functools.lru_cache(maxsize=8)
def _cached_random_llama(**kwargs) -> protocol.Model:
  """`llama.random_model`, built once per setting (a target and its derived drafts share it)."""
  from speclm.models import llama
  return llama.random_model(**kwargs)


def _random_llama(options: dict[str, str]) -> protocol.Model:
  """`random:` a random-weight Llama; keys (defaults): vocab (64), width (32), layers (2),
  seed (0), heads (4), kv_heads (2), mlp (2·width), dtype (float32); then optionally
  keep_layers (a truncated copy, see `truncated_llama`) and noise, noise_seed (a perturbed copy,
  see `perturbed_copy`). Use the same vocab/width/layers/seed for target and draft and add
  keep_layers or noise to the draft to get a related pair."""
  known = {'vocab', 'width', 'layers', 'seed', 'heads', 'kv_heads', 'mlp', 'dtype',
           'keep_layers', 'noise', 'noise_seed'}
  unknown = sorted(set(options) - known)
  if unknown:
    raise ValueError(f'Unknown option(s) {unknown} for model kind random; known: {sorted(known)}.')
  integer = lambda key, default: int(options.get(key, default))
  width = integer('width', 32)
  model = _cached_random_llama(
      vocab_size=integer('vocab', 64), embed_dim=width, num_layers=integer('layers', 2),
      seed=integer('seed', 0), num_heads=integer('heads', 4), num_kv_heads=integer('kv_heads', 2),
      mlp_dim=integer('mlp', 2 * width), dtype=options.get('dtype', 'float32'))
  if 'keep_layers' in options:
    model = truncated_llama(model, integer('keep_layers', 0))
  if float(options.get('noise', 0.0)) > 0:
    model = perturbed_copy(model, float(options['noise']), integer('noise_seed', 1))
  return model


register_model_kind('random', _random_llama)


# ----------------------------------------------------------------------------------------------
# Predicted versus measured (Table 4)


@dataclasses.dataclass(frozen=True)
class ReportRow:
  """One line of a Table-4-shaped report. Missing measurements are NaN."""

  name: str
  gamma: int
  sampling: str
  alpha: float  # Corollary 3.6
  alpha_loop: float  # from the speculative decode's β statistics
  c: float
  r: float
  expected_tokens: float  # Eq. (1) at alpha, gamma
  tokens_per_target_call: float  # measured
  predicted_speedup_paper: float  # Theorem 3.8 (r = 1)
  predicted_speedup_generalized: float  # with the measured r
  measured_speedup: float
  optimal_gamma: int  # for alpha, c, r = 1
  alpha_positions: int = 0
  batch_size: int = 0

  @classmethod
  def from_numbers(cls, name: str, *, gamma: int, alpha: float, c: float, r: float = 1.0,
                   sampling: str = '', alpha_loop: float = math.nan,
                   tokens_per_target_call: float = math.nan,
                   measured_speedup: float = math.nan, alpha_positions: int = 0,
                   batch_size: int = 0) -> 'ReportRow':
    """Fills the predictions in from α, c, r and γ."""
    return cls(
        name=name, gamma=int(gamma), sampling=sampling, alpha=float(alpha),
        alpha_loop=float(alpha_loop), c=float(c), r=float(r),
        expected_tokens=float(theory.expected_tokens_per_iteration(alpha, gamma)),
        tokens_per_target_call=float(tokens_per_target_call),
        predicted_speedup_paper=float(theory.walltime_improvement(alpha, gamma, c)),
        predicted_speedup_generalized=float(theory.walltime_improvement(alpha, gamma, c, r)),
        measured_speedup=float(measured_speedup),
        optimal_gamma=theory.optimal_gamma(alpha, c).gamma,
        alpha_positions=int(alpha_positions), batch_size=int(batch_size))

  def to_dict(self) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in dataclasses.asdict(self).items()}


def describe_sampling(sampling: sampling_lib.SamplingConfig) -> str:
  if sampling.is_greedy:
    return 'T=0'
  text = f'T={sampling.temperature:g}'
  if sampling.top_k:
    text += f',k={sampling.top_k}'
  if sampling.top_p < 1:
    text += f',p={sampling.top_p:g}'
  return text


def _cell(value, digits: int = 2) -> str:
  if isinstance(value, float):
    return '–' if math.isnan(value) else f'{value:.{digits}f}'
  return str(value)


_COLUMNS = [
    ('Run', 'name', 0), ('γ', 'gamma', 0), ('Sampling', 'sampling', 0),
    ('α (Cor. 3.6)', 'alpha', 3), ('α (loop)', 'alpha_loop', 3), ('c', 'c', 3), ('r', 'r', 2),
    ('E[tokens] Eq. 1', 'expected_tokens', 2), ('Tokens/target call', 'tokens_per_target_call', 2),
    ('Predicted (Thm 3.8)', 'predicted_speedup_paper', 2),
    ('Predicted (with r)', 'predicted_speedup_generalized', 2),
    ('Measured', 'measured_speedup', 2), ('γ* (r=1)', 'optimal_gamma', 0),
]


def report_markdown(rows: list[ReportRow]) -> str:
  """A markdown table in the shape of the paper's Table 4 (speedups as ×)."""
  lines = ['| ' + ' | '.join(title for title, _, _ in _COLUMNS) + ' |',
           '|' + '|'.join('---' for _ in _COLUMNS) + '|']
  for row in rows:
    cells = []
    for _, field, digits in _COLUMNS:
      text = _cell(getattr(row, field), digits)
      if field.endswith('speedup') or field.startswith('predicted'):
        text = text if text == '–' else text + '×'
      cells.append(text)
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def report_json(rows: list[ReportRow], **extra: Any) -> str:
  """The rows (and any extra measurement dictionaries) as indented JSON."""
  return json.dumps({'rows': [row.to_dict() for row in rows], **extra}, indent=2,
                    ensure_ascii=False, default=_json_default)


def _json_default(value):
  if isinstance(value, np.ndarray):
    return value.tolist()
  if isinstance(value, (np.integer, np.floating, np.bool_)):
    return value.item()
  raise TypeError(f'Not JSON serializable: {type(value).__name__}')


@dataclasses.dataclass(frozen=True)
class RunReport:
  """Everything `speclm.run.calibration.run_report` measured: the row and the measurements
  behind it (α's β summary, c and r, the timed speedup)."""

  row: ReportRow
  alpha: measure.AlphaEstimate
  costs: measure.CostEstimate
  speed: measure.SpeedupMeasurement

  def to_json(self) -> str:
    return report_json([self.row], beta=self.alpha.summary.to_dict(),
                       costs=self.costs.to_dict(), speed=self.speed.to_dict())


# ----------------------------------------------------------------------------------------------
# Table 1


def table1_markdown(rows: list[theory.Table1Row] | None = None) -> str:
  """Table 1 (speed and operations factors, c = ĉ = 0 unless the rows say otherwise)."""
  rows = theory.table1() if rows is None else rows
  lines = ['| α | γ | Speed (Thm 3.8) | Operations (Thm 3.11) | Paper speed | Paper operations |',
           '|---|---|---|---|---|---|']
  for row in rows:
    paper = lambda v: '–' if v is None else f'{v:.2f}'
    lines.append(f'| {row.alpha:g} | {row.gamma} | {row.speed:.2f} | {row.operations:.2f} |'
                 f' {paper(row.paper_speed)} | {paper(row.paper_operations)} |')
  return '\n'.join(lines) + '\n'
