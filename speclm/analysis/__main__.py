"""Command line: `python -m speclm.analysis theory|alpha|cost|report [flags]`.

  theory  predictions from numbers alone: Eq. (1), Theorems 3.8 / 3.11, Corollary 3.9,
          optimal γ, the oracle bound; Table 1; Figures 2–4.
  alpha   α by Corollary 3.6 for a (target, draft) pair: DLK, β histogram, β autocorrelation.
  cost    c and r for a (target, draft) pair at a batch size: timed, compiled model calls.
  report  α, c, r and a real timed speedup, in the shape of the paper's Table 4.

Models are given either as specs, e.g. `--target=random:vocab=256,width=128,layers=4,seed=0
--draft=random:vocab=256,width=128,layers=4,seed=0,keep_layers=1` (see
`speclm.analysis.report.register_model_kind` to add kinds), or by a runner gin job:
`--gin_file=demo.gin [--gin.NAME=VALUE …]` takes the job's TARGET and DRAFT, and its DATASET
encoded by its VOCABULARY as the prompts (instead of random ones).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

from speclm import sampling as sampling_lib
from speclm.analysis import report
from speclm.analysis import theory

_MODEL_HELP = (
    "model spec 'kind:key=value,...'. Built-in kind 'random': a random-weight Llama with keys"
    ' vocab, width, layers, seed, heads, kv_heads, mlp, dtype; add keep_layers=N (keep the'
    ' first N layers: an early-exit draft) and/or noise=S,noise_seed=K (perturb every weight'
    ' by S standard deviations) to derive a draft from the same base model.')


def _add_models(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--target', help='target M_p: ' + _MODEL_HELP)
  parser.add_argument('--draft', help='draft M_q: ' + _MODEL_HELP)
  parser.add_argument('--gin_file', action='append', default=[],
                      help='a speclm.run gin job (repeatable) whose TARGET, DRAFT, VOCABULARY'
                      ' and DATASET macros give the models and prompts; --target/--draft,'
                      ' when given, override its models')
  parser.add_argument('--gin_bindings', action='append', default=[],
                      help="a gin binding (repeatable); --gin.NAME=VALUE is a shorthand")
  parser.add_argument('--gin_search_paths', action='append', default=[],
                      help='extra directories searched for gin files')


class _Job:
  """The models (and, from a gin job, the prompts) a subcommand works on."""

  def __init__(self, args):
    self.prompts = self.prompt_lengths = self.eos_id = None
    self.target = self.draft = None
    if args.gin_file:
      # The job's gin machinery: its flag parsing and the loading of its parts.
      from speclm.run import gin_cli  # pylint: disable=g-import-not-at-top
      from speclm.run import loading  # pylint: disable=g-import-not-at-top
      try:
        job = loading.load_job(args.gin_file, args.gin_bindings, args.gin_search_paths)
      except gin_cli.JobError as e:
        raise ValueError(e.message) from None
      self.target, self.draft = job['target'], job['draft']
      self.prompts, self.prompt_lengths = job['prompts'], job['prompt_lengths']
      self.eos_id = job['eos_id']
    if args.target:
      self.target = report.model_from_spec(args.target)
    if args.draft:
      self.draft = report.model_from_spec(args.draft)
    if self.target is None or self.draft is None:
      raise ValueError('Give the models: --target and --draft specs, or --gin_file=JOB.gin'
                       ' (a job with TARGET and DRAFT).')
    self.target_name = args.target or f'TARGET of {" ".join(args.gin_file)}'
    self.draft_name = args.draft or f'DRAFT of {" ".join(args.gin_file)}'


def _add_sampling(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--temperature', type=float, default=0.0,
                      help='sampling temperature; 0 = greedy (default 0)')
  parser.add_argument('--top_k', type=int, default=0, help='top-k (0 = off)')
  parser.add_argument('--top_p', type=float, default=1.0, help='nucleus top-p (1 = off)')


def _sampling(args) -> sampling_lib.SamplingConfig:
  return sampling_lib.SamplingConfig(temperature=args.temperature, top_k=args.top_k,
                                     top_p=args.top_p)


def _add_alpha_flags(parser: argparse.ArgumentParser) -> None:
  parser.add_argument('--num_tokens', type=int, default=10_000,
                      help='target-generated tokens to measure α on (default 10,000, as the'
                      ' paper)')
  parser.add_argument('--tokens_per_row', type=int, default=128,
                      help='tokens generated per random prompt (default 128)')
  parser.add_argument('--prompt_length', type=int, default=8,
                      help='length of the random prompts (default 8)')
  parser.add_argument('--bins', type=int, default=20, help='β histogram bins (default 20)')
  parser.add_argument('--max_lag', type=int, default=10,
                      help='β autocorrelation lags 1..max_lag (default 10)')


def _write(path: str | None, text: str) -> None:
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
      f.write(text)
    print(f'wrote {path}')


def build_parser() -> argparse.ArgumentParser:
  """The command line: one subcommand per kind of question (theory, alpha, cost, report)."""
  parser = argparse.ArgumentParser(
      prog='python -m speclm.analysis',
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description=textwrap.dedent("""\
          Speculative decoding analysis (Leviathan, Kalman & Matias, 2023, §3).

          subcommands:
            theory  predictions from α, γ, c (and r): Eq. (1), Theorems 3.8/3.11,
                    Corollary 3.9, optimal γ, oracle bound; Table 1; Figures 2-4
            alpha   measure α = E[Σ min(p̃, q̃)] on target-generated text (Cor. 3.6)
            cost    measure c = T_draft/T_target and r = T_target(γ+1)/T_target(1)
            report  α, c, r and a timed speedup, predicted vs measured (Table 4)

          Run `python -m speclm.analysis SUBCOMMAND --help` for each one's flags."""))
  sub = parser.add_subparsers(dest='command', metavar='SUBCOMMAND', required=True)
  _add_theory_command(sub)
  _add_alpha_command(sub)
  _add_cost_command(sub)
  _add_report_command(sub)
  return parser


def _add_theory_command(sub) -> None:
  """The `theory` subcommand: closed-form predictions."""
  p = sub.add_parser(
      'theory', formatter_class=argparse.RawDescriptionHelpFormatter,
      help='closed-form predictions, Table 1 and Figures 2-4 (no models)',
      description=textwrap.dedent("""\
          Closed-form predictions (no models needed). For every α and γ given prints:
            E[tokens] per iteration, Eq. (1): (1-α^(γ+1))/(1-α)
            walltime improvement, Theorem 3.8: (1-α^(γ+1))/((1-α)(γc+1)),
              and with a verification cost ratio r: .../((1-α)(γc+r))
            operations factor, Theorem 3.11: (1-α)(γĉ+γ+1)/(1-α^(γ+1))
          and per α: Corollary 3.9 (speedup iff α > c; at least (1+α)/(1+c)),
          the optimal integer γ, and the γ-oracle bound 1/(1-α).
          Without --alpha, prints the paper's Table 1 regenerated."""))
  p.add_argument('--alpha', type=float, nargs='+', help='acceptance rate(s) α in [0, 1]')
  p.add_argument('--gamma', type=int, nargs='+', default=[3, 5, 7],
                 help='γ value(s) to tabulate (default 3 5 7)')
  p.add_argument('--c', type=float, default=0.0,
                 help='draft/target time per call, Definition 3.7 (default 0)')
  p.add_argument('--r', type=float, default=1.0,
                 help='target time on γ+1 tokens / on 1 token (default 1, the paper)')
  p.add_argument('--c_hat', type=float, default=0.0,
                 help='draft/target operations per token, Definition 3.10 (default 0)')
  p.add_argument('--max_gamma', type=int, default=64, help='search range for optimal γ')
  p.add_argument('--table1', action='store_true', help='also print Table 1')
  p.add_argument('--figures_dir', help='write Figures 2, 3, 4 as PNG files here')
  p.add_argument('--json', help='also write the predictions as JSON to this file')


def _add_alpha_command(sub) -> None:
  """The `alpha` subcommand: α measured on target-generated text."""
  p = sub.add_parser(
      'alpha', help='α by Corollary 3.6, DLK, β histogram and autocorrelation',
      description='α by Corollary 3.6. Lets the target generate --num_tokens tokens (greedy or'
      ' sampled, in batches, with speclm.autoregressive_decode) from random prompts, scores'
      ' every position with both models (teacher-forced), standardizes with the same sampling'
      ' settings as decoding, and reports α = mean Σ_x min(p̃, q̃), DLK = 1 - α, the β'
      ' histogram and the autocorrelation of β along the text (0 under the i.i.d. assumption'
      ' of Eq. (1)).')
  _add_models(p)
  _add_sampling(p)
  _add_alpha_flags(p)
  p.add_argument('--batch_size', type=int, default=8, help='rows per decode call (default 8)')
  p.add_argument('--seed', type=int, default=0, help='seed for prompts and sampling')
  p.add_argument('--figures_dir', help='write the β histogram PNG here')
  p.add_argument('--json', help='write the summary as JSON to this file')


def _add_cost_command(sub) -> None:
  """The `cost` subcommand: c and r from timed calls."""
  p = sub.add_parser(
      'cost', help='c and r from timed, compiled model calls',
      description='Compiles a draft decode step (extend with 1 token), a target decode step and'
      ' a target verification (extend with γ+1 tokens) with jax.jit, runs each at least'
      ' --num_steps times (and for at least --min_sample_ms) inside one compiled loop after a'
      ' warm-up, timing the three in turn, and reports medians over --repeats:'
      ' c = T_draft(1)/T_target(1) and r = T_target(γ+1)/T_target(1), plus the optimal γ'
      ' they imply for a given --alpha.')
  _add_models(p)
  p.add_argument('--gamma', type=int, default=4, help='γ for the verification call (default 4)')
  p.add_argument('--batch_size', type=int, default=1, help='rows per call (default 1)')
  p.add_argument('--context_length', type=int, default=64,
                 help='positions already in the cache (default 64)')
  p.add_argument('--num_steps', type=int, default=20,
                 help='minimum calls per timed sample (default 20)')
  p.add_argument('--min_sample_ms', type=float, default=50.0,
                 help='raise the calls per sample until one sample lasts this long (default 50)')
  p.add_argument('--repeats', type=int, default=5, help='timed samples; the median is kept')
  p.add_argument('--alpha', type=float, help='if given, also print predictions for this α')
  p.add_argument('--json', help='write the timings as JSON to this file')


def _add_report_command(sub) -> None:
  """The `report` subcommand: predicted against measured speedup."""
  p = sub.add_parser(
      'report', help='predicted vs measured speedup (Table 4 shape)',
      description='Measures α (Corollary 3.6, as `alpha`), c and r (as `cost`, at --batch_size),'
      ' and times speclm.autoregressive_decode against speclm.speculative_decode on one batch'
      ' of random prompts; prints a Table-4-shaped markdown row: α, α from the loop\'s own β'
      ' statistics, c, r, γ, Eq. (1) vs measured tokens per target call, the speedup'
      ' predicted by Theorem 3.8 (r = 1) and with the measured r, and the measured speedup.')
  _add_models(p)
  _add_sampling(p)
  _add_alpha_flags(p)
  p.add_argument('--gamma', type=int, default=4, help='tokens drafted per round (default 4)')
  p.add_argument('--batch_size', type=int, default=1,
                 help='rows per decode call, for α and for timing (default 1, as the paper)')
  p.add_argument('--max_new_tokens', type=int, default=128,
                 help='tokens per row in the timed decodes (default 128)')
  p.add_argument('--repeats', type=int, default=3, help='timed repeats; the median is kept')
  p.add_argument('--seed', type=int, default=0, help='seed for prompts and sampling')
  p.add_argument('--name', default='', help='row label (default: the draft spec)')
  p.add_argument('--markdown', help='write the markdown table to this file')
  p.add_argument('--json', help='write all measurements as JSON to this file')
  p.add_argument('--figures_dir', help='write the β histogram PNG here')


def _theory(args) -> int:
  if args.alpha is None or args.table1:
    print('Table 1 (c = ĉ = 0), regenerated from Theorems 3.8 and 3.11:\n')
    print(report.table1_markdown())
  results = []
  for alpha in args.alpha or []:
    best = theory.optimal_gamma(alpha, args.c, args.r, args.max_gamma)
    best_paper = theory.optimal_gamma(alpha, args.c, 1.0, args.max_gamma)
    print(f'α = {alpha:g}, c = {args.c:g}, r = {args.r:g}, ĉ = {args.c_hat:g}')
    print(f'  Corollary 3.9: speedup exists (α > c): {theory.speedup_exists(alpha, args.c)};'
          f' lower bound (1+α)/(1+c) = {theory.speedup_lower_bound(alpha, args.c):.3f}')
    print(f'  optimal γ (Thm 3.8, r = 1): {best_paper.gamma}'
          f'{"+ (search limit)" if best_paper.at_limit else ""} ->'
          f' {best_paper.improvement:.3f}×')
    if args.r != 1.0:
      print(f'  optimal γ (with r = {args.r:g}): {best.gamma}'
            f'{"+ (search limit)" if best.at_limit else ""} -> {best.improvement:.3f}×')
    print(f'  γ-oracle bound on tokens per target call 1/(1-α):'
          f' {theory.oracle_tokens_bound(alpha):.3f}')
    print('  | γ | E[tokens] Eq. 1 | speed Thm 3.8 | speed with r | operations Thm 3.11 |')
    print('  |---|---|---|---|---|')
    for gamma in args.gamma:
      row = {
          'alpha': alpha, 'gamma': gamma, 'c': args.c, 'r': args.r, 'c_hat': args.c_hat,
          'expected_tokens': theory.expected_tokens_per_iteration(alpha, gamma),
          'speedup_paper': theory.walltime_improvement(alpha, gamma, args.c),
          'speedup_generalized': theory.walltime_improvement(alpha, gamma, args.c, args.r),
          'operations': theory.operations_factor(alpha, gamma, args.c_hat),
          'optimal_gamma': best_paper.gamma, 'optimal_gamma_with_r': best.gamma,
      }
      results.append(row)
      print(f'  | {gamma} | {row["expected_tokens"]:.3f} | {row["speedup_paper"]:.3f}× |'
            f' {row["speedup_generalized"]:.3f}× | {row["operations"]:.3f}× |')
  if args.figures_dir:
    from speclm.analysis import figures  # matplotlib only when asked for
    for path in figures.theory_figures(args.figures_dir):
      print(f'wrote {path}')
  _write(args.json, json.dumps({'predictions': results}, indent=2, ensure_ascii=False))
  return 0


def _alpha(args) -> int:
  import math
  from speclm.analysis import measure
  from speclm.run import calibration  # the decodes that measure (the job's layer)
  job = _Job(args)
  target, draft = job.target, job.draft
  if job.prompts is not None:
    prompts, lengths = job.prompts, job.prompt_lengths
  else:
    rows = math.ceil(args.num_tokens / args.tokens_per_row)
    prompts, lengths = measure.random_prompts(target.vocab_size, rows, args.prompt_length,
                                              args.seed)
  estimate = calibration.estimate_alpha(
      target, draft, prompts, lengths, tokens_per_row=args.tokens_per_row,
      sampling=_sampling(args), seed=args.seed, batch_size=args.batch_size, bins=args.bins,
      max_lag=args.max_lag, eos_id=job.eos_id)
  s = estimate.summary
  print(f'target {job.target_name}\ndraft  {job.draft_name}\nsampling'
        f' {report.describe_sampling(_sampling(args))}')
  print(f'α (Corollary 3.6) = {s.alpha:.4f} ± {s.stderr:.4f} (i.i.d. standard error),'
        f' DLK = {s.dlk:.4f}, over {s.num_positions} target-generated tokens')
  print('β autocorrelation by lag: ' + ', '.join(
      f'{k + 1}: {v:.3f}' for k, v in enumerate(s.autocorrelation)))
  print('β histogram (bin: fraction): ' + ', '.join(
      f'[{lo:.2f},{hi:.2f}): {n / s.num_positions:.3f}'
      for lo, hi, n in zip(s.bin_edges[:-1], s.bin_edges[1:], s.histogram) if n))
  if args.figures_dir:
    from speclm.analysis import figures
    print('wrote ' + figures.beta_histogram_figure(
        os.path.join(args.figures_dir, 'beta_histogram.png'), s))
  _write(args.json, json.dumps({'target': args.target, 'draft': args.draft,
                                'sampling': report.describe_sampling(_sampling(args)),
                                **s.to_dict()}, indent=2, ensure_ascii=False))
  return 0


def _cost(args) -> int:
  from speclm.run import calibration  # timed model calls (the job's layer)
  job = _Job(args)
  target, draft = job.target, job.draft
  costs = calibration.measure_costs(target, draft, gamma=args.gamma, batch_size=args.batch_size,
                                    context_length=args.context_length,
                                    num_steps=args.num_steps, repeats=args.repeats,
                                    min_sample_seconds=args.min_sample_ms / 1e3)
  print(f'batch {costs.batch_size}, context {costs.context_length} positions,'
        f' median of {args.repeats} timed samples, each ≥ {args.num_steps} calls and'
        f' ≥ {args.min_sample_ms:g} ms')
  print(f'  draft step (1 token):        {costs.draft_step_seconds * 1e3:9.3f} ms')
  print(f'  target step (1 token):       {costs.target_step_seconds * 1e3:9.3f} ms')
  print(f'  target verify ({args.gamma + 1} tokens):   {costs.target_verify_seconds * 1e3:9.3f} ms')
  print(f'c = {costs.c:.4f}   r (γ = {args.gamma}) = {costs.r:.4f}')
  if args.alpha is not None:
    print(f'for α = {args.alpha:g}: Thm 3.8 at γ = {args.gamma}:'
          f' {theory.walltime_improvement(args.alpha, args.gamma, costs.c):.3f}×, with r:'
          f' {theory.walltime_improvement(args.alpha, args.gamma, costs.c, costs.r):.3f}×;'
          f' optimal γ (r = 1): {theory.optimal_gamma(args.alpha, costs.c).gamma}')
  _write(args.json, json.dumps(costs.to_dict(), indent=2))
  return 0


def _report(args) -> int:
  from speclm.run import calibration  # the decodes that measure (the job's layer)
  job = _Job(args)
  prompts = None if job.prompts is None else (job.prompts, job.prompt_lengths)
  result = calibration.run_report(
      job.target, job.draft, name=args.name or job.draft_name, gamma=args.gamma,
      sampling=_sampling(args), alpha_tokens=args.num_tokens, tokens_per_row=args.tokens_per_row,
      batch_size=args.batch_size, prompt_length=args.prompt_length,
      max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed, bins=args.bins,
      max_lag=args.max_lag, prompts=prompts, eos_id=job.eos_id)
  table = report.report_markdown([result.row])
  print(table)
  speed, costs = result.speed, result.costs
  same = (f' (outputs identical: {speed.outputs_match})' if _sampling(args).is_greedy else
          ' (sampled: each decode draws its own text)')
  print(f'autoregressive {speed.autoregressive_seconds:.3f} s, speculative'
        f' {speed.speculative_seconds:.3f} s for {speed.num_tokens} tokens{same};'
        f' rounds accepting n = 0..γ drafts: {speed.accepted_histogram.tolist()}')
  print(f'draft step {costs.draft_step_seconds * 1e3:.3f} ms, target step'
        f' {costs.target_step_seconds * 1e3:.3f} ms, target verify'
        f' {costs.target_verify_seconds * 1e3:.3f} ms;'
        f' β autocorrelation lag 1: {result.alpha.summary.autocorrelation[0]:.3f}')
  _write(args.markdown, table)
  _write(args.json, result.to_json())
  if args.figures_dir:
    from speclm.analysis import figures
    print('wrote ' + figures.beta_histogram_figure(
        os.path.join(args.figures_dir, 'beta_histogram.png'), result.alpha.summary))
  return 0


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  # --gin.NAME=VALUE -> --gin_bindings=NAME = VALUE, exactly as the runner reads it.
  from speclm.run import gin_cli  # pylint: disable=g-import-not-at-top
  try:
    argv = gin_cli.rewrite_gin_args(argv)
  except gin_cli.JobError as e:
    print(f'error: {e.message}', file=sys.stderr)
    return 2
  args = build_parser().parse_args(argv)
  try:
    return {'theory': _theory, 'alpha': _alpha, 'cost': _cost, 'report': _report}[
        args.command](args)
  except ValueError as error:
    print(f'error: {error}', file=sys.stderr)
    return 2


if __name__ == '__main__':
  sys.exit(main())
