r"""α and speedup of SmolLM2's drafts where a user meets them: Spec-Bench's tasks and the demo.

Runs the gin jobs a user would run (`runs/spec_bench.gin`, `demo.gin`: the embedded default pair,
adaptive γ, compare mode, batch 1) once per draft, in this process (the compiled loops of one
job serve the next), and writes the section "Where a user meets them" of docs/drafts.md: per
draft and temperature, α, τ (tokens per target call) and the speedup per Spec-Bench task and
overall, α on MT-bench + QA together (the issue's measure of a draft alone), and the demo's.

Drafts (--drafts):
  eagle_lookup   the EAGLE-3 draft behind prompt lookup (the shipped file, or --eagle_path;
                 the demo's default)
  eagle          the same draft alone
  draft_lookup   the 2-layer token draft behind prompt lookup (the demo's until 2026-12-06)
  draft          the 2-layer draft alone

  python scripts/evaluate_drafts.py \
      --spec_bench_file=../shared/data/spec_bench/question.jsonl --per_category=4 \
      --drafts=eagle_lookup,draft_lookup,eagle,draft --speculative_only_drafts=eagle,draft
  python scripts/evaluate_drafts.py --spec_bench_file=… --report_only   # tables from the dirs

Spec-Bench's questions are evaluation data: nothing here trains or tunes on them.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from absl import app
from absl import flags
import jax

import speclm  # pylint: disable=unused-import  (registers the gin configurables)
from speclm import outputs as outputs_lib
from speclm import run
from speclm.analysis import benchmarking

_SPEC_BENCH_FILE = flags.DEFINE_string('spec_bench_file', None,
                                       "Spec-Bench's question.jsonl.", required=True)
_PER_CATEGORY = flags.DEFINE_integer('per_category', 4, 'Conversations per Spec-Bench task.')
_DRAFTS = flags.DEFINE_list('drafts', ['draft_lookup'],
                            'The drafts to evaluate (see the module docstring).')
_TEMPERATURES = flags.DEFINE_list('temperatures', ['0', '1'], 'Sampling temperatures.')
_WORKLOADS = flags.DEFINE_list('workloads', ['spec_bench', 'demo'], 'spec_bench and/or demo.')
_EAGLE_PATH = flags.DEFINE_string('eagle_path', None,
                                  'The EAGLE-3 draft file, e.g. what'
                                  ' scripts/train_sharegpt_draft.py wrote (None: the shipped'
                                  ' one).')
_OUTPUT_DIR = flags.DEFINE_string('output_dir', '/tmp/speclm_evaluate_drafts',
                                  'Where the jobs write (one directory per workload and draft).')
_DOC = flags.DEFINE_string('doc', os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'docs', 'drafts.md'), 'The document the section goes into.')
_REPORT_ONLY = flags.DEFINE_bool('report_only', False,
                                 'Only rebuild the section from the job directories.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 128, 'New tokens per Spec-Bench turn.')
_SPECULATIVE_ONLY = flags.DEFINE_bool('speculative_only', False,
                                      'Decode with the draft only (mode speculative): α and τ'
                                      ' without the baseline, so no speedup; half the time.')
_SPECULATIVE_ONLY_DRAFTS = flags.DEFINE_list(
    'speculative_only_drafts', [],
    'Drafts of --drafts that run as --speculative_only does (e.g. the drafts alone, measured'
    ' for α), while the others are compared with the baseline.')

HEADING = '## Where a user meets them: Spec-Bench and the demo'
DRAFTS = {
    'eagle_lookup': ('EAGLE-3 (--eagle_path) behind lookup', 'eagle', 2),
    'eagle': ('EAGLE-3 (--eagle_path) alone', 'eagle', 0),
    'draft_lookup': ('2-layer behind lookup', 'draft', 2),
    'draft': ('2-layer alone', 'draft', 0),
}
ALONE_MEASURE = ('mt_bench', 'qa')  # the tasks the issue measures a draft alone on


def draft_bindings(name: str) -> list[str]:
  """The gin bindings that make a job's DRAFT the draft `name`."""
  _, kind, min_ngram = DRAFTS[name]
  if kind == 'eagle':
    path = f"'{_EAGLE_PATH.value}'" if _EAGLE_PATH.value else 'None'
    return ['DRAFT = @smollm2_eagle_draft_model', f'smollm2_eagle_draft_model.path = {path}',
            f'smollm2_eagle_draft_model.lookup_min_ngram = {min_ngram}']
  return ['DRAFT = @smollm2_draft_model', f'smollm2_draft_model.lookup_min_ngram = {min_ngram}']


def label(draft: str) -> str:
  """The draft's name in the tables: an EAGLE-3 draft is the shipped one unless --eagle_path."""
  name = DRAFTS[draft][0]
  return name if _EAGLE_PATH.value else name.replace('(--eagle_path)', '(shipped)')


def job_dir(workload: str, draft: str) -> str:
  return os.path.join(_OUTPUT_DIR.value, f'{workload}_{draft}')


def run_jobs(workload: str, draft: str) -> None:
  """The workload's gin job with this draft, at every temperature (resumes what is done)."""
  temperatures = ', '.join(f'{float(t)}' for t in _TEMPERATURES.value)
  bindings = [*draft_bindings(draft), f"OUTPUT_DIR = '{job_dir(workload, draft)}'",
              f'run_sweep.temperatures = [{temperatures}]']
  if _SPECULATIVE_ONLY.value or draft in _SPECULATIVE_ONLY_DRAFTS.value:
    bindings.append("run_job.mode = 'speculative'")
  if workload == 'spec_bench':
    files = ['runs/spec_bench.gin']
    bindings += [f"SPEC_BENCH_PATH = '{_SPEC_BENCH_FILE.value}'",
                 f'SPEC_BENCH_PER_CATEGORY = {_PER_CATEGORY.value}',
                 f'MAX_NEW_TOKENS = {_MAX_NEW.value}']
  else:
    files = ['demo.gin']
  print(f'\n##### {workload}, {label(draft)}', flush=True)
  run.parse_gin(files, bindings)
  try:
    run.run_sweep()  # pylint: disable=no-value-for-parameter
  finally:
    import gin  # pylint: disable=import-outside-toplevel
    gin.clear_config()
    # Each job compiles its own programs, and LLVM maps every executable's code into memory.
    # Dropping them between jobs keeps the process under the kernel's limit on mappings
    # (vm.max_map_count, 65,530 by default): a run of five jobs without this died in LLVM with
    # "Cannot allocate memory" on 2026-12-07. What a later job needs again comes back from the
    # persistent compilation cache.
    jax.clear_caches()


def _alpha(records, categories=None) -> float | None:
  """Σβ / count over the speculative records (of `categories`, or all)."""
  picked = [r['speculative'] for r in records if 'speculative' in r and
            (categories is None or r.get('category') in categories)]
  count = sum(e['beta_count'] for e in picked)
  return sum(e['beta_sum'] for e in picked) / count if count else None


def _f(value, spec='.2f') -> str:
  return 'n/a' if value is None else format(value, spec)


def _x(speedup) -> str:
  """A speedup as '1.23×', or 'n/a' where none was measured."""
  return 'n/a' if speedup is None else f'{speedup:.2f}×'


def read_results(workload: str, draft: str) -> dict[float, dict]:
  """Per temperature: metrics.json and the records of the job's predictions.jsonl."""
  out = {}
  for t in _TEMPERATURES.value:
    directory = os.path.join(job_dir(workload, draft), f'temperature_{float(t):g}')
    metrics_path = os.path.join(directory, outputs_lib.METRICS)
    if not os.path.exists(metrics_path):
      continue
    with open(metrics_path, encoding='utf-8') as f:
      metrics = json.load(f)
    records = outputs_lib.read_predictions(os.path.join(directory, outputs_lib.PREDICTIONS))
    out[float(t)] = dict(metrics=metrics, records=records)
  return out


def spec_bench_table(results: dict[str, dict[float, dict]]) -> list[str]:
  """A row per draft, temperature and task: α, τ, speedup; then the overall row."""
  lines = ['| draft | T | task | α | τ (tokens / target call) | speedup |',
           '| --- | --- | --- | --- | --- | --- |']
  for draft, by_t in results.items():
    for t, result in sorted(by_t.items()):
      table = result['metrics'].get('by_category') or {}
      for task, row in table.items():
        name = f'**{task}**' if task == 'overall' else task
        lines.append(f'| {label(draft)} | {t:g} | {name} | {_f(row.get("alpha"), ".3f")} |'
                     f' {_f(row.get("tokens_per_target_call"))} |'
                     f' {_x(row.get("speedup"))} |')
  return lines


def summary_table(spec: dict, demo: dict) -> list[str]:
  """Per draft and temperature: α on MT-bench + QA, Spec-Bench overall α and speedup, the
  demo's α and speedup, c."""
  lines = ['| draft | T | α on MT-bench + QA | Spec-Bench α | Spec-Bench speedup | demo α |'
           ' demo speedup | c |', '| --- | --- | --- | --- | --- | --- | --- | --- |']
  for draft in _DRAFTS.value:
    for t in sorted(set(spec.get(draft, {})) | set(demo.get(draft, {}))):
      s, d = spec.get(draft, {}).get(t), demo.get(draft, {}).get(t)
      overall = (s['metrics'].get('by_category') or {}).get('overall', {}) if s else {}
      c = ((s or d or {}).get('metrics') or {}).get('c')
      lines.append(
          f'| {label(draft)} | {t:g} |'
          f' {_f(_alpha(s["records"], ALONE_MEASURE) if s else None, ".3f")} |'
          f' {_f(overall.get("alpha"), ".3f")} | {_x(overall.get("speedup"))} |'
          f' {_f(d["metrics"].get("alpha") if d else None, ".3f")} |'
          f' {_x(d["metrics"].get("speedup") if d else None)} | {_f(c, ".3f")} |')
  return lines


def section(spec: dict, demo: dict, seconds: float, resumed: bool = False) -> str:
  """The doc's section; `seconds` this process's time, `resumed` whether it went on with jobs
  an earlier run had begun (whose time it does not count)."""
  command = shlex.join(['python', 'scripts/evaluate_drafts.py', *sys.argv[1:]])
  took = f'{seconds / 60:.0f} min' + (', resuming jobs an earlier run had begun' if resumed
                                       else '')
  return '\n'.join([
      HEADING, '',
      f'Written by `{command}` ({took}; do not edit by hand). Each row is a gin'
      ' job a user runs (`runs/spec_bench.gin` with the first'
      f' {_PER_CATEGORY.value} conversations of each Spec-Bench task, {_MAX_NEW.value} new'
      ' tokens a turn, MT-bench\'s second turn after the model\'s own first reply; `demo.gin`),'
      ' batch 1, adaptive γ, compare mode (a draft without a speedup ran without the'
      ' baseline), with only DRAFT changed. Machine:'
      f' {_cpu_name()}. Spec-Bench\'s questions are evaluation data only.', '',
      *summary_table(spec, demo), '', '### By Spec-Bench task', '', *spec_bench_table(spec), ''])


def _cpu_name() -> str:
  return f'{benchmarking.cpu_name()}, {os.cpu_count()} cores'


def write_section(text: str) -> None:
  """Replaces (or appends) the section in --doc, keeping the rest."""
  with open(_DOC.value, encoding='utf-8') as f:
    doc = f.read()
  start = doc.find(HEADING)
  if start < 0:
    doc = doc.rstrip('\n') + '\n\n' + text
  else:
    end = doc.find('\n## ', start + len(HEADING))
    doc = doc[:start] + text + (doc[end + 1:] if end >= 0 else '')
  with open(_DOC.value, 'w', encoding='utf-8') as f:
    f.write(doc.rstrip('\n') + '\n')


def main(argv):
  del argv
  unknown = [d for d in _DRAFTS.value + _SPECULATIVE_ONLY_DRAFTS.value if d not in DRAFTS]
  if unknown:
    raise app.UsageError(f'--drafts: unknown {unknown}; choose from {sorted(DRAFTS)}.')
  started = time.time()
  resumed = any(os.path.exists(job_dir(w, d)) for w in _WORKLOADS.value for d in _DRAFTS.value)
  if not _REPORT_ONLY.value:
    for workload in _WORKLOADS.value:
      for draft in _DRAFTS.value:
        run_jobs(workload, draft)
  spec = {d: read_results('spec_bench', d) for d in _DRAFTS.value}
  demo = {d: read_results('demo', d) for d in _DRAFTS.value}
  text = section(spec, demo, time.time() - started, resumed)
  print(text)
  write_section(text)


if __name__ == '__main__':
  app.run(main)
