r"""Token trees against the chain, side by side, on the embedded default (SmolLM2 + its draft).

In one process, interleaved round by round (one prompt per round; every case decodes it in
turn), batch 1, `--max_new_tokens` tokens per prompt, temperature 0 and 1:

  * the baseline (`autoregressive_decode`), the demo's chain (`speculative_decode`, γ = 3) and
    the same chain through the tree loop (`tree_speculative_decode(TreeShape.chain(3))`, the
    tree machinery's own cost);
  * static trees (`TreeShape`) and EAGLE-2 dynamic trees (`DynamicTree`), all with the
    shipped draft behind prompt lookup (the demo's draft);
  * per case: tokens per target call and its ratio to the chain's, α, per-rank acceptance,
    the tree theory's tokens per call from those rates (`theory.tree_expected_tokens`),
    milliseconds per token and the speedup over the baseline (median of per-round ratios),
    and whether the greedy output equals the baseline's;
  * the policy (`--policy`): per-rank acceptance measured on the other built-in prompt set,
    r of every static tree timed here, and the tree `theory.choose_tree` predicts fastest (the
    chain included) decoded as one more case;
  * r for trees of 4–32 nodes: one target `extend_tree` call over the tree / one 1-token
    `extend` call, at the prompts' mean context.

Prompts: the built-in demo prompts (`--prompts=demo`) or the held-out ones (`heldout`), both
shipped with speclm; trees were chosen on neither. It writes docs/tree_benchmarks.md:

  python scripts/benchmark_trees.py                    # the full run (about 30 minutes here)
  python scripts/benchmark_trees.py --rounds=1 --max_new_tokens=8 --target_layers=1 \
      --r_nodes=4 --output=/tmp/t.md                   # a smoke run
"""

from __future__ import annotations

import functools
import time

import numpy as np
from absl import app
from absl import flags

import speclm
from speclm import token_trees
from speclm import tree_decoding
from speclm.analysis import benchmarking
from speclm.analysis import measure
from speclm.analysis import theory
from speclm.analysis.benchmarking import Case
from speclm.analysis.benchmarking import fmt
from speclm.analysis.benchmarking import median
from speclm.data import builtin_prompts
from speclm.models import llama
from speclm.models import lookup
from speclm.presets import smollm2
from speclm.presets import smollm2_draft

_ROUNDS = flags.DEFINE_integer('rounds', 8, 'Interleaved rounds (one prompt per round).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt.')
_PROMPTS = flags.DEFINE_enum('prompts', 'demo', ['demo', 'heldout'], 'Built-in prompt set.')
_TEMPERATURES = flags.DEFINE_list('temperatures', ['0', '1'], 'Sampling temperatures.')
_GAMMA = flags.DEFINE_integer('gamma', 3, 'The chain\'s γ (the demo\'s).')
_LOOKUP_MIN_NGRAM = flags.DEFINE_integer('lookup_min_ngram', 2,
                                         'Prompt lookup before the draft (0: the draft alone).')
_R_NODES = flags.DEFINE_list('r_nodes', ['4', '8', '16', '32'],
                             'Tree sizes (nodes with the root) whose r is timed.')
_TARGET_LAYERS = flags.DEFINE_integer(
    'target_layers', 0, 'Smoke runs: cut the target to its first N layers (0: all).')
_POLICY = flags.DEFINE_bool(
    'policy', True, 'Also decode with the tree the policy chooses (`theory.choose_tree`), from'
    ' rank acceptance measured on the other built-in prompt set and r timed here.')
_OUTPUT = flags.DEFINE_string('output', 'docs/tree_benchmarks.md', 'Where the report goes.')

# The policy calibrates the per-rank acceptance on this tree, over the other built-in prompt
# set than the one decoded (the draft was trained on the training prompts' replies, so they
# would overstate its acceptance).
CALIBRATION_TREE = token_trees.TreeShape.from_branching((3, 2, 1, 1))
CALIBRATION_PROMPTS = 4


def _calibration_set() -> str:
  return 'held-out' if _PROMPTS.value == 'demo' else 'demo'


def calibration_prompts() -> list[str]:
  prompts = (builtin_prompts.heldout_prompts() if _PROMPTS.value == 'demo'
             else builtin_prompts.demo_prompts())
  return prompts[:CALIBRATION_PROMPTS]

# The trees compared. 'paths5' is the best tree of scripts/estimate_tree_drafts.py (fitted on
# the demo prompts' ranks, docs/drafts.md); the others are the usual families.
TREES = {
    'chain 3 (tree loop)': token_trees.TreeShape.chain(3),
    'paths3: 0 1 0.0': token_trees.TreeShape.from_paths([(0,), (1,), (0, 0)]),
    'paths4: 0 1 0.0 0.0.0': token_trees.TreeShape.from_paths([(0,), (1,), (0, 0),
                                                               (0, 0, 0)]),
    'paths5: 0 1 2 0.0 0.0.0': token_trees.TreeShape.from_paths(
        [(0,), (1,), (2,), (0, 0), (0, 0, 0)]),
    'branching 2 1 1 1': token_trees.TreeShape.from_branching((2, 1, 1, 1)),
    'branching 3 2 1': token_trees.TreeShape.from_branching((3, 2, 1)),
    'dynamic 8 (depth 4, top-3, width 2)': token_trees.DynamicTree(8, depth=4, top_k=3, width=2),
    'dynamic 16 (depth 5, top-4, width 4)': token_trees.DynamicTree(16, depth=5, top_k=4,
                                                                    width=4),
}
SAMPLED_TREES = {  # at T > 0 also: siblings drawn without replacement from q̃
    'paths5, sampled siblings': token_trees.TreeShape.from_paths(
        [(0,), (1,), (2,), (0, 0), (0, 0, 0)], candidates='sample'),
}


def make_case(name, sampling, single, run_one) -> Case:
  holder = []

  def run(round_index):
    tokens, lengths = single[round_index % len(single)]
    result = run_one(tokens, lengths, sampling=sampling, max_new_tokens=_MAX_NEW.value,
                     eos_id=None, seed=round_index)
    holder[0].stats.append(result.stats)
    return np.asarray(result.tokens)

  case = Case(name, 'main', 1, sampling.temperature, _MAX_NEW.value, run)
  holder.append(case)
  return case


def build_cases(target, draft, single, policy) -> list[Case]:
  """`policy`: temperature -> the name of the static tree the policy chose (or None)."""
  cases = []
  for temperature in [float(t) for t in _TEMPERATURES.value]:
    sampling = speclm.SamplingConfig(temperature=temperature)
    trees = dict(TREES, **(SAMPLED_TREES if temperature > 0 else {}))
    cases.append(make_case('baseline', sampling, single,
                           functools.partial(speclm.autoregressive_decode, target)))
    cases.append(make_case(f'chain γ={_GAMMA.value}', sampling, single, functools.partial(
        speclm.speculative_decode, target, draft, gamma=_GAMMA.value)))
    for name, tree in trees.items():
      cases.append(make_case(name, sampling, single, functools.partial(
          tree_decoding.tree_speculative_decode, target, draft, tree=tree)))
    if policy.get(temperature):
      cases.append(make_case(f'policy: {policy[temperature]}', sampling, single,
                             functools.partial(tree_decoding.tree_speculative_decode, target,
                                               draft, tree=TREES[policy[temperature]])))
  return cases


def choose_trees(target, draft, tok, context) -> tuple[dict, list[str]]:
  """The policy: per temperature, the static tree (the chain included) of highest predicted
  speedup, from per-rank acceptance measured on training prompts and r and c timed here.
  Returns ({temperature: name}, report lines)."""
  static = {name: tree for name, tree in TREES.items()
            if isinstance(tree, token_trees.TreeShape)}
  cost = measure.measure_costs(target, draft, gamma=1, context_length=context)
  r = dict(zip(static, measure.time_tree_verifications(target, list(static.values()),
                                                       context_length=context, repeats=7)))
  calibration = [benchmarking.chat_prompt_batch(tok, [p]) for p in calibration_prompts()]
  chosen, lines = {}, ['## The policy: a tree only where it pays', '',
                       f'Per-rank acceptance measured with {CALIBRATION_TREE.describe()} on'
                       f' the first {CALIBRATION_PROMPTS} built-in {_calibration_set()} prompts'
                       f' ({_MAX_NEW.value} tokens each; not the prompts decoded below);'
                       f' c = {cost.c:.3f}; each tree\'s r timed here, interleaved with the'
                       ' 1-token call (`measure.time_tree_verifications`);'
                       ' `theory.choose_tree` predicts every tree\'s speedup and takes the'
                       ' best.', '',
                       '| T | acceptance by rank | ' + ' | '.join(static) + ' | chosen |',
                       '|' + ' --- |' * (len(static) + 3),
                       '| r | | ' + ' | '.join(f'{r[n]:.2f}' for n in static) + ' | |']
  for temperature in [float(t) for t in _TEMPERATURES.value]:
    sampling = speclm.SamplingConfig(temperature=temperature)
    offered = accepted = 0
    for seed, (tokens, lengths) in enumerate(calibration):
      stats = tree_decoding.tree_speculative_decode(
          target, draft, tokens, lengths, tree=CALIBRATION_TREE, sampling=sampling,
          max_new_tokens=_MAX_NEW.value, seed=seed).stats
      offered = offered + np.asarray(stats.rank_offered)
      accepted = accepted + np.asarray(stats.rank_accepted)
    rates = theory.rank_acceptance_rates(accepted, offered)
    best, predicted = theory.choose_tree(static, rates, cost.c, r)
    chosen[temperature] = best
    lines.append(f'| {temperature:g} | {" ".join(f"{a:.2f}" for a in rates)} | '
                 + ' | '.join(f'{predicted[n]:.2f}' for n in static) + f' | {best} |')
    print(f'policy at T={temperature:g}: {best} (predicted {predicted[best]:.2f})', flush=True)
  return chosen, lines + ['']


def tree_of(name: str):
  """The tree a case decodes with (None for the baseline and speculative_decode's chain)."""
  name = name[len('policy: '):] if name.startswith('policy: ') else name
  return TREES.get(name) or SAMPLED_TREES.get(name)


def rank_rates(case: Case) -> np.ndarray | None:
  if not case.stats or case.stats[0].rank_offered is None:
    return None
  offered = sum(np.asarray(s.rank_offered) for s in case.stats)
  accepted = sum(np.asarray(s.rank_accepted) for s in case.stats)
  return theory.rank_acceptance_rates(accepted, offered)


def time_r(target, context: int) -> list[tuple[int, str, float, float]]:
  """(nodes, tree, r of the tree call, r of a chain call on as many rows), all timed in
  interleaved rounds with the 1-token call."""
  sizes = [int(n) for n in _R_NODES.value]
  # Wide, shallow trees: 3 children per node, breadth first; and chains of as many rows.
  wide = [token_trees.TreeShape(tuple([-1] + [(k - 1) // 3 for k in range(1, n)]))
          for n in sizes]
  chains = [token_trees.TreeShape.chain(n - 1) for n in sizes]
  r = measure.time_tree_verifications(target, wide + chains, context_length=context, repeats=7)
  rows = [(n, f'{tree.num_nodes} drafted, depth {tree.depth}', r[i], r[len(sizes) + i])
          for i, (n, tree) in enumerate(zip(sizes, wide))]
  for n, _, tree_r, chain_r in rows:
    print(f'r({n} nodes): tree {tree_r:.2f}, chain {chain_r:.2f}', flush=True)
  return rows


def render(cases, r_rows, checks, context, seconds, policy_lines) -> str:
  lines = benchmarking.report_header('Token trees vs the chain (SmolLM2-135M + shipped draft)',
                                     'scripts/benchmark_trees.py', seconds)
  lines += [
      f'- prompts: the built-in {_PROMPTS.value} prompts, one per round, {_ROUNDS.value} rounds;'
      f' batch 1; {_MAX_NEW.value} new tokens; draft: the shipped draft'
      + (f' behind prompt lookup (min n-gram {_LOOKUP_MIN_NGRAM.value})'
         if _LOOKUP_MIN_NGRAM.value else ' alone') + '; CPU kernels on',
      '- speedup: baseline time / case time, the median of per-round ratios; tokens / call'
      ' counts the prefill call; "÷ chain" divides by the chain\'s tokens / call',
      '- tree theory: `theory.tree_expected_tokens(tree, a)` with the measured per-rank'
      ' acceptance a (tokens per round, without the prefill)', '']
  if _TARGET_LAYERS.value:
    lines += [f'**SMOKE RUN: the target was cut to its first {_TARGET_LAYERS.value} layers; the'
              ' figures are not SmolLM2\'s.**', '']
  for temperature in sorted({c.temperature for c in cases}):
    group = [c for c in cases if c.temperature == temperature]
    base = group[0]
    chain = group[1]
    lines += [f'## Temperature {temperature:g}', '',
              '| case | nodes | tokens / call | ÷ chain | α | acceptance by rank |'
              ' tree theory, tokens / round | measured tokens / round | ms / token |'
              ' speedup |', '|' + ' --- |' * 10]
    for case in group:
      tree = tree_of(case.name)
      rates = rank_rates(case)
      measured_round = predicted = None
      if case is not base:
        hist = sum(np.asarray(s.accepted_histogram, np.float64) for s in case.stats)
        measured_round = float(np.sum((np.arange(len(hist)) + 1) * hist) / max(hist.sum(), 1))
      if rates is not None and isinstance(tree, token_trees.TreeShape):
        predicted = theory.tree_expected_tokens(tree, rates)
      nodes = (tree.num_nodes if tree is not None else
               (_GAMMA.value if case is chain else None))
      lines.append(
          f'| {case.name} | {nodes if nodes is not None else "—"} |'
          f' {fmt(case.tokens_per_target_call() if case is not base else 1.0)} |'
          f' {fmt(case.tokens_per_target_call() / chain.tokens_per_target_call())} |'
          f' {fmt(case.pooled_alpha() if case is not base else None, ".3f")} |'
          f' {" ".join(f"{a:.2f}" for a in rates) if rates is not None else "—"} |'
          f' {fmt(predicted)} | {fmt(measured_round)} |'
          f' {median(case.ms_per_token()):.1f} | {fmt(benchmarking.ratio(case, base))} |')
    lines.append('')
  lines += policy_lines
  lines += [f'## r: one target call over a tree / one 1-token call (context {context})', '',
            '| nodes (root included) | tree | r, tree call | r, chain of as many rows |',
            '| --- | --- | --- | --- |']
  lines += [f'| {n} | {desc} | {tree_r:.2f} | {chain_r:.2f} |'
            for n, desc, tree_r, chain_r in r_rows]
  lines += ['', '## Checks', ''] + benchmarking.check_lines(checks) + ['']
  return '\n'.join(lines)


def main(argv):
  del argv
  started = time.time()
  print('loading SmolLM2-135M-Instruct and its draft …', flush=True)
  plain_target, tok = smollm2.load()
  if _TARGET_LAYERS.value:
    plain_target = llama.first_layers(plain_target, _TARGET_LAYERS.value)
  target = llama.pack_for_cpu(plain_target)
  draft = smollm2_draft.load(target, cpu_kernels=True)
  if _LOOKUP_MIN_NGRAM.value:
    draft = lookup.lookup_first(draft, min_ngram=_LOOKUP_MIN_NGRAM.value)
  prompts = (builtin_prompts.demo_prompts() if _PROMPTS.value == 'demo'
             else builtin_prompts.heldout_prompts())
  single = [benchmarking.chat_prompt_batch(tok, [p]) for p in prompts]
  context = int(np.mean([int(s[1][0]) for s in single])) + _MAX_NEW.value // 2
  policy, policy_lines = {}, []
  if _POLICY.value:
    print('the policy: calibrating rank acceptance and timing r …', flush=True)
    policy, policy_lines = choose_trees(target, draft, tok, context)
  cases = build_cases(target, draft, single, policy)
  print(f'compiling and warming up {len(cases)} cases …', flush=True)
  benchmarking.warm_up(cases)
  benchmarking.run_rounds(cases, _ROUNDS.value, shown=4)
  checks = {}
  for case in cases:
    if case.temperature == 0 and case.name != 'baseline':
      base = benchmarking.find(cases, 'baseline', 1, 0.0)
      checks[f'greedy {case.name} = baseline'] = benchmarking.outputs_equal(base, case)
  print('timing r for trees …', flush=True)
  r_rows = time_r(target, context)
  report = render(cases, r_rows, checks, context, time.time() - started, policy_lines)
  benchmarking.write_report(report, _OUTPUT.value)
  if not all(checks.values()):
    raise SystemExit('A greedy tree output differs from the baseline: see the checks.')


if __name__ == '__main__':
  app.run(main)
