r"""Reproduces Table 2 of Leviathan et al. (2023): tasks × drafts × temperatures, paper beside ours.

Each row is one `speclm.run` job in 'compare' mode (speculative and baseline on the same
inputs), configured by the task file `configs/{task}_{draft}.gin` at the paper's γ. The script
writes, under --output_dir, one job directory per row plus `table2.md` and `table2.csv` with the
paper's α and walltime speedup next to ours, Theorem 3.8's prediction from our measured α and
c, tokens per target call, identical-output rate and BLEU/ROUGE.

Real run (T5 1.1 checkpoints fine-tuned on each task; `{size}` is xxl/small/base/large and
`{task}` ende/cnndm):

  python scripts/reproduce_table2.py --output_dir=/tmp/table2 \
      --checkpoint_pattern='gs://my-bucket/t5_1_1_{size}_{task}/checkpoint_1000000' \
      --gin.MAX_EXAMPLES=500

Smoke run (minutes on a laptop CPU): tiny random Llamas stand in for T5 — a 4-layer target and
1/2/3-layer drafts sharing its first layers, so α and c both grow with the draft as in the
paper — on a synthetic dataset:

  python scripts/reproduce_table2.py --smoke --output_dir=/tmp/table2_smoke

Rows already finished in --output_dir are not decoded again (the jobs resume); --report_only
rebuilds the tables from the job directories without running anything (e.g. after copying
results back from a TPU VM).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import io
import json
import os
import sys
from typing import Any, Sequence

if importlib.util.find_spec('speclm') is None:  # running from a checkout without installing
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin  # pylint: disable=g-import-not-at-top

from speclm import run  # pylint: disable=g-import-not-at-top
from speclm.analysis import theory  # pylint: disable=g-import-not-at-top

TASKS = ('ende', 'cnndm')
DRAFTS = ('small', 'base', 'large')
TEMPERATURES = (0.0, 1.0)
TASK_NAMES = {'ende': 'EnDe', 'cnndm': 'CNNDM'}
TASK_PREFIXES = {'ende': 'translate English to German: ', 'cnndm': 'summarize: '}
TASK_METRICS = {'ende': 'bleu', 'cnndm': 'rougeLsum'}  # the column shown in the table
TASK_SCORERS = {'ende': 'bleu', 'cnndm': 'rouge'}  # run_job.reference_metrics

# Table 2 of the paper: (task, draft, temperature) -> (γ, α, walltime speedup).
PAPER = theory.PAPER_TABLE2
SMOKE_DRAFT_LAYERS = {'small': 1, 'base': 2, 'large': 3}
SMOKE_TARGET_LAYERS = 4


def row_dir(output_dir: str, task: str, draft: str, temperature: float) -> str:
  return os.path.join(output_dir, f'{task}_{draft}_t{temperature:g}')


def job_bindings(task: str, draft: str, temperature: float, *, smoke: bool,
                 checkpoint_pattern: str | None, output_dir: str,
                 extra: Sequence[str]) -> tuple[list[str], list[str]]:
  """(gin files, bindings) of one row's job."""
  gamma = PAPER[(task, draft, temperature)][0]
  bindings = [f"OUTPUT_DIR = '{output_dir}'", f'TEMPERATURE = {temperature}']
  if smoke:
    files = ['test_tiny.gin']
    bindings += [
        f'GAMMA = {gamma}', "run_job.mode = 'compare'",
        f'target/random_llama.num_layers = {SMOKE_TARGET_LAYERS}',
        f'draft/random_llama.num_layers = {SMOKE_DRAFT_LAYERS[draft]}',
        f"synthetic_dataset.input_prefix = '{TASK_PREFIXES[task]}'",
        'synthetic_dataset.num_examples = 8', 'BATCH_SIZE = 4', 'MAX_NEW_TOKENS = 16',
        f"run_job.reference_metrics = ['{TASK_SCORERS[task]}']",
    ]
  else:
    files = [f'{task}_{draft}.gin']
    if checkpoint_pattern:
      bindings += [
          f"TARGET_CHECKPOINT = '{checkpoint_pattern.format(size='xxl', task=task)}'",
          f"DRAFT_CHECKPOINT = '{checkpoint_pattern.format(size=draft, task=task)}'"]
  return files, bindings + list(extra)


def run_row(files: Sequence[str], bindings: Sequence[str]) -> dict[str, Any]:
  gin.clear_config()
  try:
    run.parse_gin(files, bindings)
    return run.run_job(show_progress=False)  # pylint: disable=missing-kwoa
  finally:
    gin.clear_config()


def _load_metrics(directory: str) -> dict[str, Any] | None:
  path = os.path.join(directory, 'metrics.json')
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)


COLUMNS = ['task', 'draft', 'temperature', 'gamma', 'paper_alpha', 'alpha', 'paper_speedup',
           'speedup', 'theorem_3_8_speedup', 'c', 'tokens_per_target_call',
           'identical_output_rate', 'quality_metric', 'quality', 'examples']


def table_rows(output_dir: str, rows: Sequence[tuple[str, str, float]]) -> list[dict[str, Any]]:
  out = []
  for task, draft, temperature in rows:
    gamma, paper_alpha, paper_speedup = PAPER[(task, draft, temperature)]
    metrics = _load_metrics(row_dir(output_dir, task, draft, temperature)) or {}
    quality_key = TASK_METRICS[task]
    out.append({
        'task': TASK_NAMES[task], 'draft': f'T5-{draft.upper()}', 'temperature': temperature,
        'gamma': metrics.get('gamma', gamma), 'paper_alpha': paper_alpha,
        'alpha': metrics.get('alpha'), 'paper_speedup': paper_speedup,
        'speedup': metrics.get('speedup'),
        'theorem_3_8_speedup': metrics.get('predicted_speedup_theorem_3_8'),
        'c': metrics.get('c'), 'tokens_per_target_call': metrics.get('tokens_per_target_call'),
        'identical_output_rate': metrics.get('identical_output_rate'),
        'quality_metric': quality_key,
        'quality': (metrics.get('speculative') or {}).get(quality_key),
        'examples': metrics.get('num_decoded'),
    })
  return out


def _f(value, digits: int = 2, suffix: str = '') -> str:
  if value is None:
    return '–'
  return f'{value:.{digits}f}{suffix}'


def to_markdown(rows: Sequence[dict[str, Any]], *, smoke: bool) -> str:
  lines = [
      '# Table 2: T5-XXL target, walltime speedup of speculative decoding',
      '',
      ('Smoke run: tiny random Llamas stand in for T5 (target 4 layers; SMALL/BASE/LARGE drafts'
       ' 1/2/3 layers sharing its weights) on synthetic inputs, so only the shape of the table'
       ' is meaningful.' if smoke else
       'Paper: one TPU-v4, batch size 1. Ours: this machine and the jobs\' settings.'),
      '',
      '| Task | M_q | Temp | γ | α paper | α ours | Speedup paper | Speedup ours |'
      ' Thm 3.8 (ours) | c ours | Tokens/call | Identical | Quality |',
      '|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    quality = '–' if r['quality'] is None else f"{r['quality_metric']} {r['quality']:.1f}"
    lines.append(
        f"| {r['task']} | {r['draft']} | {r['temperature']:g} | {r['gamma']} |"
        f" {r['paper_alpha']:.2f} | {_f(r['alpha'])} | {r['paper_speedup']:.1f}X |"
        f" {_f(r['speedup'], 2, 'X')} | {_f(r['theorem_3_8_speedup'], 2, 'X')} |"
        f" {_f(r['c'], 3)} | {_f(r['tokens_per_target_call'])} |"
        f" {_f(r['identical_output_rate'] and 100 * r['identical_output_rate'], 0, '%')} |"
        f" {quality} |")
  return '\n'.join(lines) + '\n'


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator='\n')
  writer.writeheader()
  for r in rows:
    writer.writerow({k: ('' if r[k] is None else r[k]) for k in COLUMNS})
  return buffer.getvalue()


def _split(values: str, allowed: Sequence[Any], cast=str) -> list[Any]:
  chosen = [cast(v) for v in values.split(',') if v]
  for value in chosen:
    if value not in allowed:
      raise SystemExit(f'reproduce_table2: {value!r} is not one of {list(allowed)}.')
  return chosen


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0],
      epilog='Any --gin.NAME=VALUE argument is passed on to every job.',
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--output_dir', required=True, help='one job directory per row + tables')
  parser.add_argument('--smoke', action='store_true', help='tiny local models, minutes on CPU')
  parser.add_argument('--tasks', default=','.join(TASKS), help='comma-separated: ende,cnndm')
  parser.add_argument('--drafts', default=','.join(DRAFTS), help='comma-separated: small,...')
  parser.add_argument('--temperatures', default='0,1', help='comma-separated: 0,1')
  parser.add_argument('--checkpoint_pattern', default=None,
                      help="e.g. 'gs://bucket/t5_1_1_{size}_{task}/checkpoint_1000000'")
  parser.add_argument('--report_only', action='store_true',
                      help='only rebuild table2.md/.csv from existing job directories')
  args, rest = parser.parse_known_args(argv)
  try:
    extra = [b.split('=', 1)[1] for b in run.rewrite_gin_args(rest)
             if b.startswith('--gin_bindings=')]
  except run.JobError as e:
    raise SystemExit(f'reproduce_table2: {e.message}') from None
  unknown = [a for a in rest if not a.startswith('--gin.')]
  if unknown:
    parser.error(f'unrecognized arguments: {" ".join(unknown)}')
  rows = [(task, draft, temperature)
          for task in _split(args.tasks, TASKS)
          for draft in _split(args.drafts, DRAFTS)
          for temperature in _split(args.temperatures, TEMPERATURES, float)]
  if not args.smoke and not args.report_only and not args.checkpoint_pattern and not any(
      'CHECKPOINT' in b for b in extra):
    parser.error('real runs need checkpoints: pass --checkpoint_pattern (or --smoke).')
  os.makedirs(args.output_dir, exist_ok=True)

  if not args.report_only:
    for number, (task, draft, temperature) in enumerate(rows, start=1):
      directory = row_dir(args.output_dir, task, draft, temperature)
      print(f'[{number}/{len(rows)}] {task} {draft} temperature {temperature:g} -> {directory}',
            flush=True)
      files, bindings = job_bindings(task, draft, temperature, smoke=args.smoke,
                                     checkpoint_pattern=args.checkpoint_pattern,
                                     output_dir=directory, extra=extra)
      try:
        run_row(files, bindings)
      except run.JobError as e:
        print(f'reproduce_table2: {task} {draft} temperature {temperature:g}: {e.message}',
              file=sys.stderr)
        return 2

  table = table_rows(args.output_dir, rows)
  markdown = to_markdown(table, smoke=args.smoke)
  with open(os.path.join(args.output_dir, 'table2.md'), 'w', encoding='utf-8') as f:
    f.write(markdown)
  with open(os.path.join(args.output_dir, 'table2.csv'), 'w', encoding='utf-8') as f:
    f.write(to_csv(table))
  print(markdown)
  return 0


if __name__ == '__main__':
  sys.exit(main())
