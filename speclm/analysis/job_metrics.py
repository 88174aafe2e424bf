"""The report of a decoding job (metrics.json and the summary table) from its prediction records.

Per method: decode time, tokens/s, target calls, tokens per target call, stop reasons, BLEU/ROUGE
when references exist; for speculative decoding α (Σβ / count, Corollary 3.6), Eq. (1)'s
expected tokens per iteration, and Theorem 3.8's speedup from the measured c (and r), pooled and
row by row per batch (`theory.batch_walltime_improvement`); in compare mode the measured speedup
and the identical-output rate; for datasets whose records carry a category, the table by category
(`speclm.analysis.category_report`, as Spec-Bench reports).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from speclm import progress as progress_lib
from speclm import sampling as sampling_lib
from speclm.analysis import category_report
from speclm.analysis import theory

# The summary's 'identical outputs' at temperature > 0, where different draws are expected.
SAMPLED_OUTPUTS = "sampled: outputs differ by design, the distribution is the target's"

# The decoding methods each mode runs, in the order they run.
METHODS = {'speculative': ('speculative',), 'baseline': ('baseline',),
           'compare': ('baseline', 'speculative')}


def _predicted_speedup(alpha: float, gamma: int, c: float, r: float = 1.0) -> float | None:
  """Theorem 3.8, (1 − α^(γ+1)) / ((1 − α)(γc + r)) (r = 1 is the paper's form)."""
  if alpha is None or c is None or math.isnan(alpha):
    return None
  return float(theory.walltime_improvement(alpha, gamma, c, r))


def _predicted_speedup_per_batch(records: list[dict[str, Any]], gamma: int,
                                 cost: dict[str, Any]) -> float | None:
  """Theorem 3.8 row by row (`theory.batch_walltime_improvement`), over the job's batches.

  A batch runs until its slowest row is done: E[max_b R_b] iterations for the tokens each row
  made after its first (the prefill makes that one in both methods), from each row's own α,
  against the baseline's calls for its longest row. None for records without a batch key
  (jobs written before it existed).
  """
  if any('batch' not in r for r in records):
    return None
  batches: dict[int, list[dict[str, Any]]] = {}
  for record in records:
    batches.setdefault(record['batch'], []).append(record['speculative'])
  baseline_calls, iterations = 0, 0.0
  for rows in batches.values():
    counts = [max(row['num_tokens'] - 1, 0) for row in rows]
    if max(counts) == 0:
      continue
    alphas = [min(row['beta_sum'] / row['beta_count'], 1.0) if row['beta_count'] else 0.0
              for row in rows]
    baseline_calls += max(counts)
    iterations += theory.expected_batch_iterations(alphas, gamma, counts)
  if not iterations:
    return None
  return baseline_calls / (iterations * (gamma * cost['c'] + cost['r']))


def _reference_scores(hypotheses: list[str], references: list[str],
                      wanted: Sequence[str]) -> tuple[dict[str, float], list[str]]:
  scores, notes = {}, []
  if 'bleu' in wanted:
    try:
      import sacrebleu  # pylint: disable=g-import-not-at-top
      scores['bleu'] = float(sacrebleu.corpus_bleu(hypotheses, [references]).score)
    except ImportError:
      notes.append('BLEU skipped: pip install sacrebleu.')
  if 'rouge' in wanted:
    try:
      from rouge_score import rouge_scorer  # pylint: disable=g-import-not-at-top
      from rouge_score import scoring  # pylint: disable=g-import-not-at-top
      kinds = ['rouge1', 'rouge2', 'rougeLsum']
      scorer = rouge_scorer.RougeScorer(kinds)
      aggregator = scoring.BootstrapAggregator()
      for ref, hyp in zip(references, hypotheses):
        # rougeLsum treats newlines as sentence boundaries, as T5's evaluation does.
        aggregator.add_scores(scorer.score(ref, hyp))
      result = aggregator.aggregate()
      for kind in kinds:
        scores[kind] = float(result[kind].mid.fmeasure * 100)
    except ImportError:
      notes.append('ROUGE skipped: pip install rouge-score.')
  return scores, notes


def compute_metrics(records: list[dict[str, Any]], *, mode: str, gamma: int | str,
                    sampling: sampling_lib.SamplingConfig, cost: dict[str, Any] | None = None,
                    reference_metrics: Sequence[str] = ('bleu', 'rouge'),
                    tree=None) -> dict[str, Any]:
  """The metrics.json report from prediction records (all of the job's examples).

  `gamma` is the job's γ, or 'adaptive' (`speclm.adaptive`): then the fixed-γ predictions of
  Theorem 3.8 do not apply and are left out, and `gamma_histogram` shows the γ chosen. With a
  token `tree` (`speclm.token_trees`; `gamma` is then its description) the report adds the
  measured per-rank acceptance rates and, for a static tree, the tree theory's predictions
  (`theory.tree_expected_tokens`, `theory.tree_walltime_improvement` with c and r).
  """
  methods = METHODS[mode]
  decoded = [r for r in records if 'skipped' not in r]
  notes: list[str] = []
  metrics: dict[str, Any] = {
      'mode': mode, 'gamma': gamma if 'speculative' in methods else None,
      'sampling': {'temperature': sampling.temperature, 'top_k': sampling.top_k,
                   'top_p': sampling.top_p},
      'num_examples': len(records), 'num_decoded': len(decoded),
      'num_skipped': len(records) - len(decoded),
      'num_truncated': sum(1 for r in records if r.get('truncated')),
      # Rows cut short by non-finite logits: their numbers must not pass unnoticed.
      'num_bad_logits': sum(1 for r in decoded
                            if any(r[m]['stop_reason'] == 'BAD_LOGITS' for m in methods)),
  }
  with_refs = [r for r in decoded if r.get('reference') is not None]
  for method in methods:
    metrics[method] = _method_entry(method, decoded, with_refs, reference_metrics, notes)
  if 'speculative' in methods:
    _add_speculative_summary(metrics, decoded, gamma=gamma, tree=tree, cost=cost, notes=notes)
  if mode == 'compare':
    _add_comparison(metrics, decoded, sampling, notes)
  table = category_report.by_category(decoded, methods)
  if table is not None:  # a dataset whose examples carry a category (Spec-Bench)
    metrics['by_category'] = table
  metrics['notes'] = notes
  return metrics


def _method_entry(method: str, decoded: list[dict[str, Any]], with_refs: list[dict[str, Any]],
                  reference_metrics: Sequence[str], notes: list[str]) -> dict[str, Any]:
  """One method's totals over the decoded records (time, tokens, target calls, stop reasons;
  α, accepted tokens and the γ histogram for the speculative method; reference scores)."""
  rows = [r[method] for r in decoded]
  time_s = sum(r['time_s'] for r in rows)
  tokens = sum(r['num_tokens'] for r in rows)
  calls = sum(r['target_calls'] for r in rows)
  entry = {
      'decode_time_s': time_s, 'tokens': tokens,
      'tokens_per_s': tokens / time_s if time_s > 0 else None,
      'examples_per_s': len(rows) / time_s if time_s > 0 else None,
      'mean_output_tokens': tokens / len(rows) if rows else None,
      'target_calls': calls,
      'tokens_per_target_call': tokens / calls if calls else None,
      'stop_reasons': _count(r['stop_reason'] for r in rows),
  }
  if method == 'speculative':
    beta_count = sum(r['beta_count'] for r in rows)
    entry['alpha'] = sum(r['beta_sum'] for r in rows) / beta_count if beta_count else None
    entry['accepted_tokens'] = sum(r['accepted'] for r in rows)
    entry['gamma_histogram'] = _gamma_histogram(decoded, method)
  if with_refs and reference_metrics:
    scores, score_notes = _reference_scores([r[method]['output'] for r in with_refs],
                                            [r['reference'] for r in with_refs],
                                            reference_metrics)
    entry.update(scores)
    notes += [n for n in score_notes if n not in notes]
  return entry


def _add_speculative_summary(metrics: dict[str, Any], decoded: list[dict[str, Any]], *,
                             gamma, tree, cost, notes: list[str]) -> None:
  """α, tokens per call and the γ histogram at the top level, with Theorem 3.8's predictions
  (Eq. 1 for E[tokens per iteration]; the walltime factor with c, and r when measured), the
  adaptive rule's costs, or a token tree's per-rank rates."""
  spec = metrics['speculative']
  alpha = spec['alpha']
  metrics['alpha'] = alpha
  metrics['tokens_per_target_call'] = spec['tokens_per_target_call']
  metrics['gamma_histogram'] = spec['gamma_histogram']
  fixed = isinstance(gamma, int)
  metrics['expected_tokens_per_iteration'] = (
      None if alpha is None or not fixed
      else float(theory.expected_tokens_per_iteration(alpha, gamma)))
  if tree is not None:
    metrics.update(_tree_metrics(decoded, tree, cost))
  elif cost is not None and not fixed:
    metrics['c'] = cost['c']
    metrics['r_by_gamma'] = cost['r_by_gamma']
    metrics['cost_measurement'] = cost
    notes.append('γ was chosen every round (adaptive): the fixed-γ Theorem 3.8 predictions'
                 ' do not apply; gamma_histogram counts the rounds by tokens drafted.')
    if cost.get('never_drafts'):
      notes.append(f"At the prior α {cost['prior_alpha']:g} the adaptive rule chooses γ = 0,"
                   ' so no round drafts: the baseline loop decoded (a higher'
                   ' run_job.prior_alpha makes the batch try drafting).')
  elif cost is not None:
    metrics['c'] = cost['c']
    metrics['r'] = cost['r']
    metrics['cost_measurement'] = cost
    metrics['predicted_speedup_theorem_3_8'] = _predicted_speedup(alpha, gamma, cost['c'])
    metrics['predicted_speedup_with_r'] = _predicted_speedup(alpha, gamma, cost['c'],
                                                              cost['r'])
    metrics['predicted_speedup_per_batch'] = _predicted_speedup_per_batch(decoded, gamma,
                                                                          cost)
  else:
    metrics['c'] = None
    metrics['predicted_speedup_theorem_3_8'] = None
    notes.append('c was not measured (run_job.measure_cost = False), so there is no Theorem'
                 ' 3.8 prediction; (1 − α^(γ+1)) / ((1 − α)(γc + 1)) gives it for any c.')


def _add_comparison(metrics: dict[str, Any], decoded: list[dict[str, Any]],
                    sampling: sampling_lib.SamplingConfig, notes: list[str]) -> None:
  """Compare mode: the measured speedup and the rate of identical outputs (1.0 at temperature
  0).

  The speedup is the ratio of the methods' rates, speculative tokens/s over baseline tokens/s,
  as Spec-Bench computes it. When both made the same tokens (always at temperature 0, where the
  outputs are identical) that is the ratio of decode times, also kept as `time_ratio`. At
  temperature > 0 the sampled replies differ in length, and a ratio of times would count a
  method that happened to write shorter replies as faster.
  """
  base, spec = metrics['baseline'], metrics['speculative']
  metrics['time_ratio'] = (base['decode_time_s'] / spec['decode_time_s']
                           if spec['decode_time_s'] > 0 else None)
  metrics['speedup'] = (spec['tokens_per_s'] / base['tokens_per_s']
                        if spec['tokens_per_s'] and base['tokens_per_s'] else None)
  if base['tokens'] != spec['tokens'] and metrics['time_ratio'] is not None:
    notes.append(f"The methods made {base['tokens']} (baseline) and {spec['tokens']}"
                 f" (speculative) tokens, so the speedup is the ratio of their tokens/s; the ratio"
                 f" of decode times is {metrics['time_ratio']:.2f}.")
  metrics['identical_output_rate'] = (
      sum(1 for r in decoded if r['identical']) / len(decoded) if decoded else None)
  if not sampling.is_greedy:
    notes.append('At temperature > 0 both methods sample the same distribution but not the'
                 ' same random draws, so identical outputs are not expected.')


def _tree_metrics(decoded: list[dict[str, Any]], tree, cost) -> dict[str, Any]:
  """Per-rank acceptance and the tree theory's predictions, from the batches' rank counts."""
  offered = _batch_sum(decoded, 'speculative', 'rank_offered') or []
  accepted = _batch_sum(decoded, 'speculative', 'rank_accepted') or []
  rates = theory.rank_acceptance_rates(accepted, offered) if offered else None
  out: dict[str, Any] = {
      'tree': tree.describe(), 'tree_nodes': tree.num_nodes,
      'rank_acceptance': None if rates is None else [float(a) for a in rates],
      'rank_offered': offered, 'rank_accepted': accepted,
  }
  static = hasattr(tree, 'parents')
  if static and rates is not None and np.sum(rates) <= 1:
    out['predicted_tokens_per_call_tree'] = theory.tree_expected_tokens(tree, rates)
  if cost is not None:
    out.update(c=cost['c'], r=cost['r'], cost_measurement=cost)
    if 'predicted_tokens_per_call_tree' in out:
      out['predicted_speedup_tree'] = theory.tree_walltime_improvement(tree, rates, cost['c'],
                                                                        cost['r'])
  return out


def _batch_sum(decoded: list[dict[str, Any]], method: str, key: str) -> list[int] | None:
  """A per-batch count list summed over the batches (rows of a batch share its rounds)."""
  per_batch = {}
  for record in decoded:
    counts = record[method].get(key)
    if counts is not None:
      per_batch[record.get('batch', record['index'])] = counts
  if not per_batch:
    return None
  width = max(len(h) for h in per_batch.values())
  return [sum(h[g] for h in per_batch.values() if g < len(h)) for g in range(width)]


def _gamma_histogram(decoded: list[dict[str, Any]], method: str) -> list[int] | None:
  """Rounds by tokens drafted, summed over the batches (rows of a batch share its rounds)."""
  return _batch_sum(decoded, method, 'gamma_histogram')


def _count(values) -> dict[str, int]:
  counts: dict[str, int] = {}
  for value in values:
    counts[value] = counts.get(value, 0) + 1
  return counts


def _fmt(value, spec: str = '.3f') -> str:
  if value is None:
    return 'n/a'
  if isinstance(value, float):
    return format(value, spec)
  return str(value)


def summary(metrics: dict[str, Any]) -> str:
  """The short table printed at the end of a job."""
  rows = [('mode', metrics['mode']),
          ('examples', f"{metrics['num_decoded']} decoded, {metrics['num_skipped']} skipped,"
                       f" {metrics['num_truncated']} truncated")]
  for method in ('baseline', 'speculative'):
    if method in metrics:
      entry = metrics[method]
      rows.append((f'{method} time', f"{_fmt(entry['decode_time_s'])} s,"
                                     f" {_fmt(entry['tokens_per_s'], '.1f')} tokens/s"))
      for key in ('bleu', 'rouge1', 'rouge2', 'rougeLsum'):
        if key in entry:
          rows.append((f'{method} {key}', _fmt(entry[key], '.2f')))
  if 'alpha' in metrics:
    rows += [('alpha (measured)', _fmt(metrics['alpha'])),
             ('tokens / target call', _fmt(metrics['tokens_per_target_call'])),
             ('c (measured)', _fmt(metrics.get('c'))),
             ('r (measured)', _fmt(metrics.get('r'))
              if 'r_by_gamma' not in metrics else
              ' '.join(f'{r:.2f}' for r in metrics['r_by_gamma']) + '  (r(0) … r(γ_max))'),
             ('rounds by γ', _fmt(metrics.get('gamma_histogram'))),
             *([('token tree', metrics['tree']),
                ('acceptance by rank', ' '.join(f'{a:.2f}' for a in metrics['rank_acceptance']
                                                or [])),
                ('tree theory: tokens/call', _fmt(metrics.get('predicted_tokens_per_call_tree'))),
                ('tree theory: speedup', _fmt(metrics.get('predicted_speedup_tree'), '.2f'))]
               if 'tree' in metrics else []),
             *([] if 'tree' in metrics else [
                 ('Theorem 3.8 speedup',
                  _fmt(metrics.get('predicted_speedup_theorem_3_8'), '.2f')),
                 ('  with measured r', _fmt(metrics.get('predicted_speedup_with_r'), '.2f')),
                 ('  row by row, per batch', _fmt(metrics.get('predicted_speedup_per_batch'),
                                                  '.2f'))])]
  if (metrics.get('tree_policy') or {}).get('chosen'):
    policy = metrics['tree_policy']
    chosen = ('the baseline, no speculation: no candidate beat it,'
              if policy['chosen'] == 'baseline' else policy['chosen'] + ' among'
              f" {len(policy['candidates']) - 1} candidates")
    rows.append(('tree policy', f"chose {chosen} (timed on"
                                f" {policy['calibration']['rows']} rows at start-up)"))
  if 'speedup' in metrics:
    sampled = (metrics.get('sampling') or {}).get('temperature', 0.0) > 0
    rows += [('measured speedup', _fmt(metrics['speedup'], '.2f')
              + ('' if metrics['baseline']['tokens'] == metrics['speculative']['tokens']
                 else '  (tokens/s over tokens/s: the methods made different tokens)')),
             ('identical outputs', SAMPLED_OUTPUTS if sampled
              else _fmt(metrics['identical_output_rate'], '.1%'))]
  if metrics.get('num_bad_logits'):
    rows.append(('WARNING', f"{metrics['num_bad_logits']} example(s) stopped on NaN/inf logits"
                            ' (BAD_LOGITS); the figures above include them'))
  if 'job' in metrics:
    rows.append(('output dir', metrics['job']['output_dir']))
  text = progress_lib.table(rows, title='speclm run summary')
  if metrics.get('by_category'):
    text += '\n\n' + category_report.table_text(metrics['by_category'])
  return text
