r"""Token trees against the chain, side by side, on the embedded default (SmolLM2 + its draft).

In one process, interleaved round by round (one prompt per round; every case decodes it in
turn), batch 1, `--max_new_tokens` tokens per prompt, temperature 0 and 1:

  * the baseline (`autoregressive_decode`), the demo's chain (`speculative_decode`, γ = 3) and
    the same chain through the tree loop (`tree_speculative_decode(TreeShape.chain(3))`, the
    tree machinery's own cost);
  * static trees (`TreeShape`) and EAGLE-2 dynamic trees (`DynamicTree`), all with a
    shipped draft (`--draft`: the EAGLE-3 draft, the demo's, or the 2-layer token-only one)
    behind prompt lookup, as the demo runs it;
  * per case: tokens per target call and its ratio to the chain's, α, per-rank acceptance,
    the tree theory's tokens per call from those rates (`theory.tree_expected_tokens`),
    milliseconds per token and the speedup over the baseline (median of per-round ratios),
    and whether the greedy output equals the baseline's;
  * the policy (`--policy`): the job's `@tree_policy()` (`speclm.run.calibration.tree_policy`,
    its default candidates: the chain, paths3, paths4, dynamic 8) calibrated as a batch-1 job
    calibrates: on 4 prompts spread over their lengths, 32 new tokens (at most
    `--max_new_tokens`), one untimed and 3 timed interleaved decodes per candidate;
    its measured table (the tree theory's predictions beside it, with c and r timed here) and
    the chosen tree (or chain) decoded as one more case;
  * r for trees of 4–32 nodes: one target `extend_tree` call over the tree / one 1-token
    `extend` call, at the prompts' mean context.

Prompts: the built-in demo prompts (`--prompts=demo`) or the held-out ones (`heldout`), both
shipped with speclm; the fixed trees were chosen on neither (the policy sees 4 of them, as a
batch-1 job's policy sees 4 of its prompts). It writes docs/tree_benchmarks.md:

  python scripts/benchmark_trees.py                    # the full run (about an hour here)
  python scripts/benchmark_trees.py --rounds=1 --max_new_tokens=8 --target_layers=1 \
      --r_nodes=4 --output=/tmp/t.md                   # a smoke run
"""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
from absl import app
from absl import flags

import speclm
from speclm import token_trees
from speclm import tree_decoding
from speclm.analysis import benchmarking
from speclm.analysis import theory
from speclm.analysis.benchmarking import Case
from speclm.analysis.benchmarking import fmt
from speclm.analysis.benchmarking import median
from speclm.data import builtin_prompts
from speclm.models import llama
from speclm.models import lookup
from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm.run import calibration

_ROUNDS = flags.DEFINE_integer('rounds', 8, 'Interleaved rounds (one prompt per round).')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 128, 'Tokens generated per prompt.')
_PROMPTS = flags.DEFINE_enum('prompts', 'demo', ['demo', 'heldout'], 'Built-in prompt set.')
_TEMPERATURES = flags.DEFINE_list('temperatures', ['0', '1'], 'Sampling temperatures.')
_GAMMA = flags.DEFINE_integer('gamma', 3, 'The chain\'s γ (the demo\'s).')
_LOOKUP_MIN_NGRAM = flags.DEFINE_integer('lookup_min_ngram', 2,
                                         'Prompt lookup before the draft (0: the draft alone).')
_R_NODES = flags.DEFINE_list('r_nodes', ['4', '8', '16', '32'],
                             'Tree sizes (nodes with the root) whose r is timed.')
_DRAFT = flags.DEFINE_enum('draft', 'eagle', ['eagle', 'two_layer'],
                           'The shipped draft: the EAGLE-3 draft (the demo\'s) or the token-only'
                           ' 2-layer draft.')
_TARGET_LAYERS = flags.DEFINE_integer(
    'target_layers', 0, 'Smoke runs: cut the target to its first N layers (0: all).')
_POLICY = flags.DEFINE_bool(
    'policy', True, 'Also decode with what the job\'s default `@tree_policy()` chooses, by'
    ' speed measured on the first decoded prompts (`speclm.run.calibration.tree_policy`).')
_TREE = flags.DEFINE_multi_string(
    'tree', [], 'Only these cases of TREES / SAMPLED_TREES, by name (repeatable; default: all).')
_OUTPUT = flags.DEFINE_string('output', 'docs/tree_benchmarks.md', 'Where the report goes.')

# The job's default policy; it decodes at most --max_new_tokens per calibration call.
POLICY = calibration.TreePolicy(calibration.default_candidates())

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
    # Aiming at tokens / call >= 1.3x the chain's (the 16-node tree gave 1.24x). A width above
    # top_k is refused (the first depth has only top_k nodes to expand), hence width 4.
    'dynamic 32 (depth 6, top-4, width 4)': token_trees.DynamicTree(32, depth=6, top_k=4,
                                                                    width=4),
    # EAGLE-2's usual setting on GPUs (60 nodes, 6 expansions of the 10 best nodes by path
    # probability, 10 children each): tokens per call where verifying many rows is cheap.
    'dynamic 60 (depth 6, top-10, width 10)': token_trees.DynamicTree(60, depth=6, top_k=10,
                                                                      width=10),
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


def decode_with(target, draft, tree):
  """The decode of a tree, or of the chain (`speculative_decode`, γ = --gamma) for None."""
  if tree is None:
    return functools.partial(speclm.speculative_decode, target, draft, gamma=_GAMMA.value)
  return functools.partial(tree_decoding.tree_speculative_decode, target, draft, tree=tree)


def build_cases(target, draft, single, choices) -> list[Case]:
  """`choices`: temperature -> the policy's `PolicyChoice` (none without --policy)."""
  cases = []
  for temperature in [float(t) for t in _TEMPERATURES.value]:
    sampling = speclm.SamplingConfig(temperature=temperature)
    trees = dict(TREES, **(SAMPLED_TREES if temperature > 0 else {}))
    if _TREE.value:
      unknown = set(_TREE.value) - set(TREES) - set(SAMPLED_TREES)
      if unknown:
        raise app.UsageError(f'--tree: unknown {sorted(unknown)}; known: {list(TREES)}'
                             f' + {list(SAMPLED_TREES)}')
      trees = {name: tree for name, tree in trees.items() if name in _TREE.value}
    cases.append(make_case('baseline', sampling, single,
                           functools.partial(speclm.autoregressive_decode, target)))
    cases.append(make_case(f'chain γ={_GAMMA.value}', sampling, single,
                           decode_with(target, draft, None)))
    for name, tree in trees.items():
      cases.append(make_case(name, sampling, single, decode_with(target, draft, tree)))
    if temperature in choices:
      choice = choices[temperature]
      cases.append(make_case(f'policy: {choice.name}', sampling, single,
                             decode_with(target, draft, choice.tree)))
  return cases


def theory_costs(target, draft, context) -> tuple[float, dict[str, float]]:
  """c, and r of the policy's chain and static trees (isolated calls, interleaved with the
  1-token call): only for the theory's columns of the policy table."""
  cost = calibration.measure_costs(target, draft, gamma=1, context_length=context)
  shapes = {name: token_trees.TreeShape.chain(_GAMMA.value) if tree is None else tree
            for name, tree in POLICY.candidates.items()
            if not isinstance(tree, token_trees.DynamicTree)}
  r = calibration.time_tree_verifications(target, list(shapes.values()),
                                          context_length=context, repeats=7)
  return cost.c, dict(zip(shapes, r))


def run_policy(target, draft, tok, prompts, context) -> dict:
  """The job's policy per temperature, calibrated as a batch-1 job calibrates (the cases
decode one prompt at a time): on prompts spread over their lengths
(`tree_policy.spread_prompts`), with 3 timed repeats instead of 2. {temperature:
PolicyChoice}."""
  policy = dataclasses.replace(POLICY, repeats=3,
                               calibration_tokens=min(POLICY.calibration_tokens, _MAX_NEW.value))
  batches = calibration.tree_policy.spread_prompts([tok.encode_chat(p) for p in prompts],
                                                   policy.calibration_rows)
  c, r = theory_costs(target, draft, context)
  choices = {}
  for temperature in [float(t) for t in _TEMPERATURES.value]:
    choice = calibration.choose(policy, target, draft, batches, gamma=_GAMMA.value,
                                sampling=speclm.SamplingConfig(temperature=temperature),
                                seed=0, c=c, r=r, progress=print)
    print(f'policy at T={temperature:g}: {choice.summary()}', flush=True)
    choices[temperature] = choice
  return choices


def policy_lines(choices, cases) -> list[str]:
  """The policy's tables and how its choice fared in the rounds, against the chain."""
  if not choices:
    return []
  first = next(iter(choices.values())).calibration
  lines = ['## The policy: `@tree_policy()` chooses by measured speed', '',
           f'The job\'s default policy, calibrated as a batch-1 job does: on'
           f' {first["rows"]} prompt(s) spread over their lengths (of'
           f' {", ".join(map(str, first["prompt_lengths"]))} tokens), {first["tokens"]} new'
           f' tokens, one untimed decode then {first["repeats"]} timed ones per candidate,'
           ' interleaved (`speclm.run.calibration.choose`). It picks the fewest measured ms / token'
           ' (the chain is always a candidate). The theory columns use the measured rates with'
           ' c and r from isolated calls timed here, for comparison only.', '']
  for temperature, choice in choices.items():
    chain = benchmarking.find(cases, f'chain γ={_GAMMA.value}', 1, temperature)
    chosen = benchmarking.find(cases, f'policy: {choice.name}', 1, temperature)
    lines += [f'### Temperature {temperature:g}: chose {choice.name}'
              f' (calibration {choice.calibration["seconds"]:.0f} s)', '']
    lines += choice.markdown()
    lines += ['', f'In the rounds above: the policy\'s case ran at'
              f' {fmt(benchmarking.ratio(chosen, chain))}× the chain\'s speed (median of'
              ' per-round ratios).', '']
  return lines


def tree_of(name: str, choices, temperature: float):
  """The tree a case decodes with (None for the baseline and speculative_decode's chain)."""
  if name.startswith('policy: '):
    return choices[temperature].tree
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
  r = calibration.time_tree_verifications(target, wide + chains, context_length=context,
                                          repeats=7)
  rows = [(n, f'{tree.num_nodes} drafted, depth {tree.depth}', r[i], r[len(sizes) + i])
          for i, (n, tree) in enumerate(zip(sizes, wide))]
  for n, _, tree_r, chain_r in rows:
    print(f'r({n} nodes): tree {tree_r:.2f}, chain {chain_r:.2f}', flush=True)
  return rows


def render(cases, r_rows, checks, context, seconds, choices) -> str:
  lines = benchmarking.report_header('Token trees vs the chain (SmolLM2-135M + shipped draft)',
                                     'scripts/benchmark_trees.py', seconds)
  lines += [
      f'- prompts: the built-in {_PROMPTS.value} prompts, one per round, {_ROUNDS.value} rounds;'
      f' batch 1; {_MAX_NEW.value} new tokens; draft: the shipped'
      + (' EAGLE-3 draft' if _DRAFT.value == 'eagle' else ' 2-layer token-only draft')
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
      tree = tree_of(case.name, choices, temperature)
      rates = rank_rates(case)
      measured_round = predicted = None
      if case is not base:
        hist = sum(np.asarray(s.accepted_histogram, np.float64) for s in case.stats)
        measured_round = float(np.sum((np.arange(len(hist)) + 1) * hist) / max(hist.sum(), 1))
      if rates is not None and isinstance(tree, token_trees.TreeShape):
        predicted = theory.tree_expected_tokens(tree, rates)
      nodes = (tree.num_nodes if tree is not None else
               (None if case is base else _GAMMA.value))
      lines.append(
          f'| {case.name} | {nodes if nodes is not None else "—"} |'
          f' {fmt(case.tokens_per_target_call() if case is not base else 1.0)} |'
          f' {fmt(case.tokens_per_target_call() / chain.tokens_per_target_call())} |'
          f' {fmt(case.pooled_alpha() if case is not base else None, ".3f")} |'
          f' {" ".join(f"{a:.2f}" for a in rates) if rates is not None else "—"} |'
          f' {fmt(predicted)} | {fmt(measured_round)} |'
          f' {median(case.ms_per_token()):.1f} | {fmt(benchmarking.ratio(case, base))} |')
    lines.append('')
  lines += policy_lines(choices, cases)
  lines += [f'## r: one target call over a tree / one 1-token call (context {context})', '',
            '| nodes (root included) | tree | r, tree call | r, chain of as many rows |',
            '| --- | --- | --- | --- |']
  lines += [f'| {n} | {desc} | {tree_r:.2f} | {chain_r:.2f} |'
            for n, desc, tree_r, chain_r in r_rows]
  lines += ['', '## Checks', ''] + benchmarking.check_lines(checks) + ['']
  return '\n'.join(lines)


def load_draft(target) -> speclm.Model:
  """The shipped draft of `--draft` for `target`, with its kernels packed for the CPU. A smoke
  run's cut target (`--target_layers`) lacks the layers the EAGLE-3 draft reads; the draft
  then reads the last layer kept, as many times (its outputs mean nothing there either)."""
  if _DRAFT.value == 'two_layer':
    return smollm2_draft.load(target, cpu_kernels=True)
  draft = smollm2_draft.load_eagle(target, cpu_kernels=True)
  kept = target.definition.config.num_layers
  read = draft.definition.feature_layers
  if read and max(read) >= kept:
    draft = speclm.Model(dataclasses.replace(draft.definition, feature_layers=(kept - 1,)
                                             * len(read)), draft.params)
  return draft


def main(argv):
  del argv
  started = time.time()
  print('loading SmolLM2-135M-Instruct and its draft …', flush=True)
  plain_target, tok = smollm2.load()
  if _TARGET_LAYERS.value:
    plain_target = llama.first_layers(plain_target, _TARGET_LAYERS.value)
  target = llama.pack_for_cpu(plain_target)
  draft = load_draft(target)
  if _LOOKUP_MIN_NGRAM.value:
    draft = lookup.lookup_first(draft, min_ngram=_LOOKUP_MIN_NGRAM.value)
  prompts = (builtin_prompts.demo_prompts() if _PROMPTS.value == 'demo'
             else builtin_prompts.heldout_prompts())
  single = [benchmarking.chat_prompt_batch(tok, [p]) for p in prompts]
  context = int(np.mean([int(s[1][0]) for s in single])) + _MAX_NEW.value // 2
  choices = {}
  if _POLICY.value:
    print('the policy: timing its candidates on the first prompts …', flush=True)
    choices = run_policy(target, draft, tok, prompts, context)
  cases = build_cases(target, draft, single, choices)
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
  report = render(cases, r_rows, checks, context, time.time() - started, choices)
  benchmarking.write_report(report, _OUTPUT.value)
  if not all(checks.values()):
    raise SystemExit('A greedy tree output differs from the baseline: see the checks.')


if __name__ == '__main__':
  app.run(main)
