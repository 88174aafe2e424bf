"""A job's report by category (metrics.json 'by_category'), as Spec-Bench reports speedups.

For a dataset whose records carry a category (`speclm.data.conversations`: Spec-Bench's tasks),
each category's row holds, from its records (every decoded turn):

  speedup                 speculative tokens/s over baseline tokens/s (compare mode)
  tokens_per_target_call  Spec-Bench's τ, the mean accepted tokens per target call: the
                          speculative method's tokens / its target calls (Eq. 1 measured)
  alpha                   Σβ / count over the category's rounds (Corollary 3.6)
  <method>_tokens_per_s   each method's tokens / its time
  examples, turns         conversations (distinct ids) and decoded turns

and an 'overall' row over every record. Every row's speedup is computed as Spec-Bench computes
it: each method's total tokens over its total time, and the ratio of those two rates. At
temperature 0 the outputs are identical and this is the ratio of times; at temperature > 0,
where the methods' outputs differ in length, it is a ratio of speeds, not of times.
"""

from __future__ import annotations

from typing import Any, Sequence

OVERALL = 'overall'


def _ratio(numerator: float, denominator: float) -> float | None:
  return numerator / denominator if denominator else None


def _row(records: list[dict[str, Any]], methods: Sequence[str]) -> dict[str, Any]:
  """One row's sums and rates over `records` (each method's time, tokens and tokens/s; the
  speculative method's τ and α; the ratio of the two rates as the speedup)."""
  row: dict[str, Any] = {'examples': len({r['id'] for r in records}), 'turns': len(records)}
  for method in methods:
    entries = [r[method] for r in records]
    time_s = sum(e['time_s'] for e in entries)
    tokens = sum(e['num_tokens'] for e in entries)
    row[f'{method}_time_s'] = time_s
    row[f'{method}_tokens'] = tokens
    row[f'{method}_tokens_per_s'] = _ratio(tokens, time_s)
  if 'speculative' in methods:
    entries = [r['speculative'] for r in records]
    row['tokens_per_target_call'] = _ratio(row['speculative_tokens'],
                                           sum(e['target_calls'] for e in entries))
    row['alpha'] = _ratio(sum(e['beta_sum'] for e in entries),
                          sum(e['beta_count'] for e in entries))
  if 'baseline' in methods and 'speculative' in methods:
    base, spec = row['baseline_tokens_per_s'], row['speculative_tokens_per_s']
    row['speedup'] = None if base is None or spec is None else _ratio(spec, base)
  return row


def by_category(decoded: list[dict[str, Any]], methods: Sequence[str]) -> dict[str, Any] | None:
  """metrics.json's 'by_category' table: a row per category (in the order first seen) and the
  'overall' row; None when the records carry no category.

  Args:
    decoded: the job's decoded (not skipped) records.
    methods: the methods the job ran ('baseline', 'speculative' or both, in order).
  """
  groups: dict[str, list[dict[str, Any]]] = {}
  for record in decoded:
    if 'category' in record:
      groups.setdefault(record['category'], []).append(record)
  if not groups:
    return None
  table = {category: _row(records, methods) for category, records in groups.items()}
  table[OVERALL] = _row(decoded, methods)
  return table


def _cell(value, spec: str) -> str:
  return 'n/a' if value is None else format(value, spec)


def table_text(table: dict[str, Any]) -> str:
  """The 'by_category' table as aligned text for the job's printed summary."""
  methods = [m for m in ('baseline', 'speculative')
             if f'{m}_tokens_per_s' in next(iter(table.values()))]
  header = ['category', 'turns', 'speedup', 'tau', 'alpha'] + [f'{m} tok/s' for m in methods]
  rows = [header]
  for category, row in table.items():
    rows.append([category, str(row['turns']), _cell(row.get('speedup'), '.2f'),
                 _cell(row.get('tokens_per_target_call'), '.2f'), _cell(row.get('alpha'), '.3f')]
                + [_cell(row[f'{m}_tokens_per_s'], '.1f') for m in methods])
  widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
  lines = ['  '.join(cell.ljust(w) if k == 0 else cell.rjust(w)
                     for k, (cell, w) in enumerate(zip(r, widths))) for r in rows]
  return '\n'.join(['by category (tau: tokens per target call; overall: total tokens over'
                    ' total time)'] + lines)
