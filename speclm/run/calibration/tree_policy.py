"""A job's choice between token trees and the chain, by measured speed on its own prompts.

Calibration, before the job decodes (`run_job.tree = @tree_policy()`); the job records the
choice and its table in metrics.json and tree_policy.json.

Whether a token tree beats the chain depends on the machine, the model pair and the prompts:
a tree keeps more tokens per target call, but each round drafts more and verifies a wider
call. Predicting that from per-rank acceptance measured elsewhere and from isolated call
timings (`theory.choose_tree`) can be wrong both ways: the rates differ between prompt sets,
and a timed `extend` call misses the decode loop's own per-round work. So the policy here
measures instead of predicting:

  1. Take at least `calibration_rows` rows of the job's prompts, as whole batches of the job's
     own size, spread over its prompt lengths (`calibration_batches`: the job batches its
     prompts by length, shortest first, and a tree's gain shrinks as the context grows, so
     the first batch alone would judge the job by its shortest prompts).
  2. Decode them with the baseline (`autoregressive_decode`) and with every candidate (the
     chain, `speculative_decode` with the job's γ, is always one), `calibration_tokens` new
     tokens each: first one untimed call per candidate (compilation and warm-up), then
     `repeats` timed calls, interleaved across candidates (`benchmarking.interleaved_rounds`)
     so a slow period of a shared machine hits them all alike.
  3. Pick the candidate with the fewest measured seconds per generated token, where a tree
     must beat the chain by `min_tree_gain` (5%; ties: the chain, then fewer nodes). The
     chain is always measured, so the pick is never slower than the chain as measured. With
     `allow_baseline`, the baseline competes too: when no candidate beat it, the job decodes
     without speculation (`PolicyChoice.speculate` is False), so speculation never makes the
     job slower than plain decoding as measured — at large batches on a CPU, where verifying
     γ + 1 tokens per row costs nearly γ + 1 steps, that is the usual outcome.

The tree theory's predictions (`theory.tree_expected_tokens`, and with c and r given
`theory.tree_walltime_improvement`) from the measured rates are kept in the table, as a
report column only.

    policy = TreePolicy({'paths3': TreeShape.from_paths([(0,), (1,), (0, 0)])})
    choice = choose(policy, target, draft, [(prompts, lengths)], gamma=3)
    choice.tree      # None: the chain (speculative_decode with γ = 3); else the tree to use
    choice.rows      # the measured table (JSON-ready dicts)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from speclm import decoding
from speclm import sampling as sampling_lib
from speclm import token_trees
from speclm import tree_decoding
from speclm.analysis import benchmarking
from speclm.analysis import theory

CHAIN = 'chain'  # the name under which the plain chain is added when the candidates lack it
BASELINE = 'baseline'


def default_candidates() -> dict[str, token_trees.TreeShape | token_trees.DynamicTree | None]:
  """The candidates of `@tree_policy()`: the chain, two small static trees and a small EAGLE-2
  tree (the cheapest trees of docs/tree_benchmarks.md)."""
  return {
      CHAIN: None,
      'paths3': token_trees.TreeShape.from_paths([(0,), (1,), (0, 0)]),
      'paths4': token_trees.TreeShape.from_paths([(0,), (1,), (0, 0), (0, 0, 0)]),
      'dynamic8': token_trees.DynamicTree(8, depth=4, top_k=3, width=2),
  }


def _positive_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f'TreePolicy.{name} must be an integer >= 1, got {value!r}.')
  return int(value)


@dataclasses.dataclass(frozen=True)
class TreePolicy:
  """Choose between token trees and the chain by measured speed (see the module docstring).

  Attributes:
    candidates: ordered mapping name -> `TreeShape`, `DynamicTree` or None (the plain chain,
      `speculative_decode` with the job's γ). The chain is added first, as 'chain', when no
      candidate is None, so it is always measured.
    calibration_rows: rows of the job's prompts decoded, at least (fewer only if the job has
      fewer): whole batches of the job's size, spread over its prompt lengths
      (`calibration_batches`). One row of the shortest prompts misjudged a Spec-Bench job
      (docs/decoding.md, "Token trees").
    calibration_tokens: new tokens per calibration decode.
    repeats: timed decodes per candidate (after one untimed warm-up decode).
    allow_baseline: the baseline (`autoregressive_decode`) may be chosen too, when it measured
      faster than every candidate: the job then decodes without speculation.
    min_tree_gain: a tree is chosen over the chain only if its measured time per token is
      below the chain's by at least this fraction. A calibration of a few short decodes is
      noisy, and on a CPU the tree loop costs more per round than the chain's at the same
      tokens per call (its masks, compaction, vocabulary-wide node arrays): a tree that ties
      the chain in calibration ran 0.86× the chain's speed in docs/tree_benchmarks_eagle.md.
  """

  candidates: Mapping[str, token_trees.TreeShape | token_trees.DynamicTree | None]
  calibration_rows: int = 4
  calibration_tokens: int = 32
  repeats: int = 2
  allow_baseline: bool = False
  min_tree_gain: float = 0.05

  def __post_init__(self):
    if not isinstance(self.candidates, Mapping) or not self.candidates:
      raise ValueError('TreePolicy.candidates must be a non-empty mapping name -> tree (a'
                       ' TreeShape, a DynamicTree, or None for the chain), got'
                       f' {self.candidates!r}.')
    candidates = {}
    for name, tree in self.candidates.items():
      if not isinstance(name, str) or not name or name == BASELINE:
        raise ValueError(f'TreePolicy.candidates: names must be non-empty strings other than'
                         f' {BASELINE!r}, got {name!r}.')
      if tree is not None and not isinstance(tree, (token_trees.TreeShape,
                                                    token_trees.DynamicTree)):
        raise ValueError(f'TreePolicy.candidates[{name!r}] must be a TreeShape, a DynamicTree'
                         f' or None (the chain), got {tree!r}.')
      candidates[name] = tree
    if None not in candidates.values():
      if CHAIN in candidates:
        raise ValueError(f'TreePolicy.candidates names a tree {CHAIN!r}, the name of the chain'
                         ' the policy always measures; rename it or add the chain (None).')
      candidates = {CHAIN: None, **candidates}
    object.__setattr__(self, 'candidates', candidates)
    for name in ('calibration_rows', 'calibration_tokens', 'repeats'):
      object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
    if not isinstance(self.allow_baseline, bool):
      raise ValueError(f'TreePolicy.allow_baseline must be True or False, got'
                       f' {self.allow_baseline!r}.')
    if (isinstance(self.min_tree_gain, bool) or not isinstance(self.min_tree_gain, (int, float))
        or not 0.0 <= self.min_tree_gain < 1.0):
      raise ValueError(f'TreePolicy.min_tree_gain must be a fraction in [0, 1), got'
                       f' {self.min_tree_gain!r}.')

  def describe(self) -> str:
    """One line naming the candidates (and the baseline when allowed) and the calibration's
    size, for the job's log."""
    names = [*self.candidates, *([BASELINE] if self.allow_baseline else [])]
    return (f'tree policy over {", ".join(names)} ({self.calibration_rows} rows,'
            f' {self.calibration_tokens} tokens, {self.repeats} timed repeats)')


@dataclasses.dataclass(frozen=True)
class PolicyChoice:
  """What `choose` measured and chose.

  Attributes:
    name: the chosen candidate's name ('baseline' when the policy allowed it and no candidate
      beat it).
    tree: the chosen tree; None for the chain (`speculative_decode` with the job's γ) and for
      the baseline.
    rows: one dict per decode timed, the baseline first, then the candidates in order: name,
      kind ('baseline', 'chain', 'static tree', 'dynamic tree'), description, nodes,
      seconds (each timed repeat), seconds_per_token (median), speedup (over the baseline,
      median of per-repeat ratios), tokens_per_call, tokens_per_round, alpha,
      rank_acceptance (trees), predicted_tokens_per_round and predicted_speedup (the theory,
      from the measured rates; None where it has none), identical_to_baseline (greedy only),
      warmup_s (the untimed first call: compilation), chosen.
    calibration: rows, batches, prompt_lengths (each row's), tokens, repeats, min_tree_gain
      and seconds (the calibration's wall time).
  """

  name: str
  tree: token_trees.TreeShape | token_trees.DynamicTree | None
  rows: list[dict[str, Any]]
  calibration: dict[str, Any]

  @property
  def speculate(self) -> bool:
    """False when the baseline was chosen: the job decodes without speculation."""
    return self.name != BASELINE

  def row(self, name: str) -> dict[str, Any]:
    """The measured row of candidate `name` (or 'baseline'); StopIteration if none."""
    return next(row for row in self.rows if row['name'] == name)

  def to_dict(self) -> dict[str, Any]:
    """For metrics.json: the choice, how it was calibrated and the measured table."""
    return {'chosen': self.name, 'chosen_description': self.row(self.name)['description'],
            'calibration': dict(self.calibration), 'candidates': [dict(r) for r in self.rows]}

  def summary(self) -> str:
    """One line: the choice, its measured speedup and the chain's."""
    chain = next(r for r in self.rows if r['kind'] == 'chain')
    if not self.speculate:
      best = max(self.rows[1:], key=lambda r: r['speedup'])
      return (f'the baseline, no speculation (the fastest candidate, {best["name"]}, ran at'
              f' {_fmt(best["speedup"])}× the baseline on {self.calibration["rows"]} rows ×'
              f' {self.calibration["tokens"]} tokens)')
    line = (f'{self.name} ({_fmt(self.row(self.name)["speedup"])}× the baseline'
            f' on {self.calibration["rows"]} rows × {self.calibration["tokens"]} tokens')
    if chain['name'] != self.name:
      line += f'; chain {_fmt(chain["speedup"])}×'
    return line + ')'

  def markdown(self) -> list[str]:
    """The measured table as markdown lines."""
    lines = ['| candidate | nodes | ms / token | speedup | tokens / call | tokens / round |'
             ' α | acceptance by rank | theory: tokens / round | theory: speedup |'
             ' warm-up s | chosen |', '|' + ' --- |' * 12]
    for row in self.rows:
      rates = row['rank_acceptance']
      lines.append(
          f'| {row["name"]} | {row["nodes"] if row["nodes"] is not None else "—"} |'
          f' {1e3 * row["seconds_per_token"]:.1f} | {_fmt(row["speedup"])} |'
          f' {_fmt(row["tokens_per_call"])} | {_fmt(row["tokens_per_round"])} |'
          f' {_fmt(row["alpha"], ".3f")} |'
          f' {" ".join(f"{a:.2f}" for a in rates) if rates else "—"} |'
          f' {_fmt(row["predicted_tokens_per_round"])} | {_fmt(row["predicted_speedup"])} |'
          f' {row["warmup_s"]:.1f} | {"yes" if row["chosen"] else ""} |')
    return lines


def _fmt(x: float | None, spec: str = '.2f') -> str:
  """`x` formatted by `spec`, or a dash for None."""
  return '—' if x is None else format(x, spec)


def _finite(x) -> float | None:
  """`x` as a float, or None when it is NaN or infinite."""
  x = float(x)
  return x if math.isfinite(x) else None


def calibration_batches(widths: Sequence[int], batch_rows: Sequence[int],
                        rows: int) -> list[int]:
  """Which of a job's batches a calibration of at least `rows` rows decodes: indices into its
  batches, whose prompt widths (`widths`, non-decreasing: the job batches by length) and real
  rows (`batch_rows`) are given. Whole batches, as the job decodes them, enough to hold `rows`
  rows (all of them when the job has fewer), taken at the middles of equal parts of the list,
  so that they spread over the job's prompt lengths as its rows do."""
  count = len(widths)
  if count != len(batch_rows):
    raise ValueError(f'calibration_batches: {count} widths but {len(batch_rows)} row counts.')
  if count == 0:
    return []
  if any(b < a for a, b in zip(widths, widths[1:])):
    raise ValueError(f'calibration_batches: widths must not decrease, got {list(widths)}.')
  size = max(max(batch_rows), 1)
  wanted = min(count, -(-rows // size))
  while wanted < count:  # short batches (a width's last) may hold fewer rows than `size`
    picked = [int((i + 0.5) * count / wanted) for i in range(wanted)]
    if sum(batch_rows[i] for i in picked) >= rows:
      return picked
    wanted += 1
  return list(range(count))


def spread_prompts(prompts: Sequence[Sequence[int]], rows: int) -> list[tuple]:
  """`rows` of token-id lists as a batch-1 job calibrates on them: each its own batch
  (`[1, n]` ids, `[1]` length), picked by `calibration_batches` from the prompts ordered by
  length. For scripts that decode their prompts one at a time, as the job does at batch 1."""
  ordered = sorted(prompts, key=len)
  picked = calibration_batches([len(ids) for ids in ordered], [1] * len(ordered), rows)
  return [(np.asarray([ordered[i]], np.int32), np.asarray([len(ordered[i])], np.int32))
          for i in picked]


def choose(policy: TreePolicy, target, draft, batches, *, gamma: int,
           sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY,
           eos_id: int | Sequence[int] | None = None, seed: int = 0, pad_id: int = 0,
           c: float | None = None, r: Mapping[str, float] | None = None,
           progress: Callable[[str], Any] | None = None) -> PolicyChoice:
  """Decodes `batches` with every candidate and returns the fastest.

  Args:
    policy: the candidates and the calibration's size (`calibration_rows` is the caller's to
      apply: the job picks its batches with `calibration_batches`).
    target, draft: the models (`speclm.Model`).
    batches: (prompts, lengths) pairs, right-padded prompts `[B, P]` and their lengths `[B]`
      (each its own B and P); a decode is one call per batch, in order, and every row counts.
    gamma: the chain's γ.
    sampling, eos_id, seed, pad_id: as in `speculative_decode` (timed repeat k uses seed + k).
    c, r: optional, for the theory's predicted speedup column only: c, and r per candidate
      name (its verification cost relative to a 1-token call).
    progress: called with a line per warmed-up decode (e.g. `print`).

  Returns:
    The `PolicyChoice`: the candidate with the fewest measured seconds per generated token;
    with `policy.allow_baseline`, the baseline when no candidate was faster than it.
  """
  gamma = decoding.check_gamma(gamma)
  batches = [(np.asarray(prompts), np.asarray(lengths)) for prompts, lengths in batches]
  if not batches:
    raise ValueError('choose needs at least one batch of prompts to decode.')
  for prompts, lengths in batches:
    if prompts.ndim != 2 or prompts.shape[0] < 1 or lengths.shape != prompts.shape[:1]:
      raise ValueError(f'each batch must be prompts [B, P] with B >= 1 and lengths [B], got'
                       f' shapes {prompts.shape} and {lengths.shape}.')
  decodes = _candidate_decodes(policy, target, draft, gamma)
  common = dict(sampling=sampling, max_new_tokens=policy.calibration_tokens, eos_id=eos_id,
                pad_id=pad_id)
  runs = {name: (lambda k, decode=decode: [decode(prompts, lengths, seed=seed + k, **common)
                                           for prompts, lengths in batches])
          for name, decode in decodes.items()}
  started = time.perf_counter()
  warmup_s, results, seconds = _time_decodes(runs, policy.repeats, progress)
  table = _measured_table(policy, gamma, sampling, c, r, warmup_s, results, seconds)
  best = next(row for row in table if row['chosen'])
  return PolicyChoice(
      name=best['name'], tree=policy.candidates.get(best['name']), rows=table,
      calibration={'rows': sum(int(p.shape[0]) for p, _ in batches), 'batches': len(batches),
                   'prompt_lengths': [int(n) for _, lengths in batches for n in lengths],
                   'tokens': policy.calibration_tokens, 'repeats': policy.repeats,
                   'min_tree_gain': policy.min_tree_gain,
                   'seconds': time.perf_counter() - started})


def _candidate_decodes(policy: TreePolicy, target, draft, gamma: int) -> dict[str, Callable]:
  """name -> the decode function of the baseline (first) and of each candidate, in order;
  each takes (prompts, lengths, **decode settings)."""
  decodes = {BASELINE: functools.partial(decoding.autoregressive_decode, target)}
  for name, tree in policy.candidates.items():
    decodes[name] = (functools.partial(decoding.speculative_decode, target, draft, gamma=gamma)
                     if tree is None else
                     functools.partial(tree_decoding.tree_speculative_decode, target, draft,
                                       tree=tree))
  return decodes


def _time_decodes(runs: dict[str, Callable[[int], Any]], repeats: int,
                  progress: Callable[[str], Any] | None):
  """Warms every run up (untimed, seed offset 0), then times `repeats` interleaved rounds.

  Returns (warm-up seconds by name, the decode results by name (per timed repeat, a list of
  one per batch, on the host), the timed seconds by name).
  """
  warmup_s = {}
  for name, run in runs.items():  # compile and warm up, untimed
    start = time.perf_counter()
    jax.block_until_ready(run(0))
    warmup_s[name] = time.perf_counter() - start
    if progress is not None:
      progress(f'  {name}: compiled and warmed up in {warmup_s[name]:.1f}s')
  results = {name: [] for name in runs}

  def record(_, __, outputs):
    for name, out in zip(runs, outputs):
      results[name].append(jax.device_get(out))

  seconds = dict(zip(runs, benchmarking.interleaved_rounds(
      list(runs.values()), repeats, after_round=record)))
  return warmup_s, results, seconds


# The table's keys in one order (JSON readers and markdown alike).
_TABLE_KEYS = ('name', 'kind', 'description', 'nodes', 'seconds', 'seconds_per_token',
               'speedup', 'tokens_per_call', 'tokens_per_round', 'alpha', 'rank_acceptance',
               'predicted_tokens_per_round', 'predicted_speedup', 'identical_to_baseline',
               'warmup_s', 'chosen')


def _measured_table(policy: TreePolicy, gamma: int, sampling, c, r, warmup_s, results,
                    seconds) -> list[dict[str, Any]]:
  """The rows of `PolicyChoice.rows` (the baseline first), the fastest marked chosen: the
  fewest seconds per generated token, a tree's counted as if `policy.min_tree_gain` slower
  (ties: the chain, then fewer nodes, then the order given), or the baseline when the policy
  allows it and no candidate was faster."""
  names = list(results)
  per_token = {name: [s / max(sum(int(np.sum(out.lengths)) for out in outs), 1)
                      for s, outs in zip(seconds[name], results[name])] for name in names}
  flat = {name: [out for outs in results[name] for out in outs] for name in names}
  base_outputs = [out.to_lists() for out in flat[BASELINE]]
  table = []
  for name in names:
    tree = None if name == BASELINE else policy.candidates[name]
    row = _row(name, tree, gamma, flat[name], base_outputs, sampling, c, r)
    row.update(
        seconds=[float(s) for s in seconds[name]],
        seconds_per_token=float(statistics.median(per_token[name])),
        speedup=float(statistics.median(
            [b / t for b, t in zip(per_token[BASELINE], per_token[name])])),
        warmup_s=float(warmup_s[name]), chosen=False)
    table.append(row)
  order = {name: i for i, name in enumerate(names)}
  handicap = 1.0 / (1.0 - policy.min_tree_gain)  # a tree must beat the chain by the margin
  best = min(table[1:], key=lambda row: (
      row['seconds_per_token'] * (1.0 if row['kind'] == 'chain' else handicap),
      row['kind'] != 'chain', row['nodes'], order[row['name']]))
  if policy.allow_baseline and table[0]['seconds_per_token'] <= best['seconds_per_token']:
    best = table[0]  # speculation did not pay here: decode without it
  best['chosen'] = True
  return [{key: row[key] for key in _TABLE_KEYS} for row in table]


def _row(name: str, tree, gamma: int, results: list[decoding.DecodeResult],
         base_outputs: list[list[list[int]]], sampling, c, r) -> dict[str, Any]:
  """The measured statistics of one decode (pooled over its timed repeats) and the theory's
  predictions from them; everything but the timings."""
  if name == BASELINE:
    kind, description, nodes = 'baseline', 'autoregressive_decode', None
  elif tree is None:
    kind, description, nodes = 'chain', f'chain of γ={gamma} (speculative_decode)', gamma
  else:
    kind = 'static tree' if isinstance(tree, token_trees.TreeShape) else 'dynamic tree'
    description, nodes = tree.describe(), tree.num_nodes
  stats = [out.stats for out in results]
  generated = sum(int(np.sum(out.lengths)) for out in results)
  calls = sum(float(np.sum(s.target_calls_per_row)) for s in stats)
  row = {'name': name, 'kind': kind, 'description': description, 'nodes': nodes,
         'tokens_per_call': generated / max(calls, 1.0), 'tokens_per_round': None,
         'alpha': None, 'rank_acceptance': None, 'predicted_tokens_per_round': None,
         'predicted_speedup': None,
         'identical_to_baseline': (all(out.to_lists() == base for out, base in
                                       zip(results, base_outputs))
                                   if sampling.is_greedy else None)}
  if kind == 'baseline':
    return row
  histogram = sum(np.asarray(s.accepted_histogram, np.float64) for s in stats)
  if histogram.sum() > 0:
    row['tokens_per_round'] = float(np.sum((np.arange(len(histogram)) + 1) * histogram)
                                    / histogram.sum())
  count = sum(int(s.beta_count) for s in stats)
  row['alpha'] = _finite(sum(float(s.beta_sum) for s in stats) / count) if count else None
  cost_r = None if c is None or r is None else r.get(name)
  if kind == 'chain':
    if row['alpha'] is not None:
      row['predicted_tokens_per_round'] = float(
          theory.expected_tokens_per_iteration(row['alpha'], gamma))
      if cost_r is not None:
        row['predicted_speedup'] = float(theory.walltime_improvement(row['alpha'], gamma, c,
                                                                     cost_r))
    return row
  offered = sum(np.asarray(s.rank_offered, np.float64) for s in stats)
  accepted = sum(np.asarray(s.rank_accepted, np.float64) for s in stats)
  rates = theory.rank_acceptance_rates(accepted, offered)
  row['rank_acceptance'] = [float(a) for a in rates]
  if kind == 'static tree' and np.sum(rates) <= 1:
    row['predicted_tokens_per_round'] = theory.tree_expected_tokens(tree, rates)
    if cost_r is not None:
      row['predicted_speedup'] = theory.tree_walltime_improvement(tree, rates, c, cost_r)
  return row
