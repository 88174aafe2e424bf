r"""Would token trees pay on this CPU? Greedy acceptance of draft chains and trees, offline.

Tree drafting (SpecInfer, Medusa, Sequoia) lets the target check several candidate
continuations in one call: the draft proposes its top few tokens at each depth, and the target
scores every node of the tree at once (a tree attention mask). At temperature 0 the accepted
text is the longest root path whose tokens all equal the target's greedy ones.

That is easy to estimate without building it. Along SmolLM2's greedy reply, teacher-forced,
take the rank of each true next token among the draft's candidates, ordered as the demo's
draft would order them: the prompt lookup's proposal first where a 2+-token n-gram matches
(`lookup.lookup_first`), then the trained draft's tokens by probability. A round starting at
position t accepts depth d exactly when the ranks (rank_t, …, rank_{t+d−1}) form a node of the
tree; a chain of γ drafts is the tree of all-zero rank tuples. Rounds advance by the accepted
tokens + 1, as in the decode loop, so the script reports tokens per target call.

Trees are chosen greedily by how often each rank path occurs (a node at a time, keeping the
tree closed under prefixes), fitted on the demo prompts and scored on the 16 held-out prompts.
What a tree costs: one draft call per depth, and a verification of (nodes + 1) rows, whose
r the script times on the CPU kernels (`speclm.run.calibration.measure_costs`); it prints
tokens per call and the speedup they predict, tokens per call / (depth × c + r).

  python scripts/estimate_tree_drafts.py             # about 5 minutes on 2 CPU cores
"""

from __future__ import annotations

import collections
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

import speclm
from speclm.data import builtin_prompts
from speclm.models import lookup
from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm.run import calibration

_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 128, 'Greedy reply tokens per prompt.')
_MIN_NGRAM = flags.DEFINE_integer('lookup_min_ngram', 2, 'Lookup first where this many tokens'
                                  ' match (0: the trained draft alone).')
_NODES = flags.DEFINE_list('nodes', ['3', '5', '7', '11', '15'], 'Tree sizes to fit.')
_DEPTHS = flags.DEFINE_list('depths', ['3', '6'], 'Deepest trees to fit.')
_HELDOUT = flags.DEFINE_integer('heldout_prompts', 16, 'Held-out prompts to score on.')

MAX_RANK = 64  # ranks at or beyond this are never in a tree
Tree = frozenset  # of rank tuples, closed under prefixes


def chain(gamma: int) -> Tree:
  """The plain speculative round: γ drafts, each the draft's first choice."""
  return Tree((0,) * depth for depth in range(1, gamma + 1))


def rounds_needed(ranks: np.ndarray, tree: Tree) -> int:
  """Target calls that make the tokens ranked by `ranks` when every round drafts `tree`.

  ranks[k] is the rank of the k-th token among the candidates drafted for it (teacher-forced
  on the greedy reply). A round from position t keeps depth d while (rank_t, …, rank_{t+d−1})
  is a node, then adds the target's own token.
  """
  start = rounds = 0
  while start < len(ranks):
    accepted = 0
    while (start + accepted < len(ranks) - 1
           and tuple(int(x) for x in ranks[start:start + accepted + 1]) in tree):
      accepted += 1
    start += accepted + 1
    rounds += 1
  return rounds


def tokens_per_call(rank_rows: Sequence[np.ndarray], tree: Tree) -> float:
  """Greedy tokens per verification call over several replies."""
  return sum(map(len, rank_rows)) / sum(rounds_needed(r, tree) for r in rank_rows)


def fit_tree(rank_rows: Sequence[np.ndarray], nodes: int, max_depth: int = 6) -> Tree:
  """The `nodes` most frequent rank paths, added one at a time so every prefix is in the tree."""
  counts = collections.Counter()
  for ranks in rank_rows:
    for t in range(len(ranks)):
      for depth in range(1, max_depth + 1):
        path = tuple(int(x) for x in ranks[t:t + depth])
        if len(path) < depth or path[-1] >= MAX_RANK:
          break
        counts[path] += 1
  tree = set()
  while len(tree) < nodes:
    frontier = [p for p in counts if p not in tree and (len(p) == 1 or p[:-1] in tree)]
    if not frontier:
      break
    tree.add(max(frontier, key=lambda p: (counts[p], -len(p))))
  return Tree(tree)


def describe(tree: Tree) -> str:
  return ' '.join('.'.join(map(str, p)) for p in sorted(tree, key=lambda p: (len(p), p)))


def greedy_replies(target, tok, prompts: Sequence[str],
                   max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
  rows = [tok.encode_chat(p) for p in prompts]
  tokens, lengths = tok.batch(rows)
  result = speclm.autoregressive_decode(target, tokens, lengths, eos_id=tok.eos_id,
                                        max_new_tokens=max_new_tokens)
  return [(list(row), reply) for row, reply in zip(rows, result.to_lists())]


def candidate_ranks(draft, prompt: list[int], reply: list[int],
                    lookup_min_ngram: int) -> np.ndarray:
  """`[len(reply) − 1]` the rank of reply[1:] among the draft's candidates before each.

  reply[0] is left out: the target's prefill makes it, before any round. With
  `lookup_min_ngram` > 0 the prompt lookup's proposal, where there is one, comes first.
  """
  d = draft.definition
  cache = d.init_cache(1, len(prompt) + len(reply) + 1)
  first, cache = d.prefill(draft.params, jnp.asarray([prompt], jnp.int32),
                           jnp.asarray([len(prompt)], jnp.int32), cache)
  rest, _ = d.extend(draft.params, jnp.asarray([reply[:-1]], jnp.int32), cache)
  logits = np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1)[0]
  true = np.asarray(reply)
  true_logit = logits[np.arange(len(reply)), true][:, None]
  ranks = np.sum(logits > true_logit, axis=-1)  # the draft's own order
  ranks = np.where(np.isfinite(true_logit[:, 0]), ranks, MAX_RANK)  # off the draft's subset
  if lookup_min_ngram:
    finder = lookup.PromptLookup(d.vocab_size, max_ngram=max(3, lookup_min_ngram),
                                 min_ngram=lookup_min_ngram)
    history = jnp.asarray([prompt + reply], jnp.int32)
    positions = len(prompt) - 1 + jnp.arange(len(reply), dtype=jnp.int32)[None]
    proposal, found = (np.asarray(x)[0] for x in finder.propose(history, positions))
    # The lookup's proposal goes first, then the draft's order without it.
    above = logits[np.arange(len(reply)), proposal] > true_logit[:, 0]
    merged = np.where(proposal == true, 0, ranks + 1 - above)
    ranks = np.where(found, merged, ranks)
  return np.minimum(ranks, MAX_RANK)[1:]


def main(argv):
  del argv
  target, tok = smollm2.load()
  draft = smollm2_draft.load(target)
  sets = {'demo': builtin_prompts.demo_prompts(),
          'held-out': builtin_prompts.heldout_prompts(_HELDOUT.value)}
  ranks = {}
  for name, prompts in sets.items():
    ranks[name] = [candidate_ranks(draft, prompt, reply, _MIN_NGRAM.value)
                   for prompt, reply in greedy_replies(target, tok, prompts, _MAX_NEW.value)]
    every = np.concatenate(ranks[name])
    print(f'{name}: {len(every)} positions; the true token is candidate 1, ≤2, ≤4, ≤8 at'
          f' {", ".join(f"{np.mean(every < k):.3f}" for k in (1, 2, 4, 8))}', flush=True)

  trees = [(f'chain γ = {g}', chain(g)) for g in (1, 2, 3, 4, 5, 7)]
  for nodes in map(int, _NODES.value):
    for depth in map(int, _DEPTHS.value):
      tree = fit_tree(ranks['demo'], nodes, depth)
      if all(tree != t for _, t in trees):
        trees.append((f'tree: {describe(tree)}', tree))
  # What a round costs on the CPU kernels: `depth` draft calls and a verification of
  # nodes + 1 rows (as a chain of that length would have; a tree mask adds nothing here).
  fast_target = smollm2.load_model(cpu_kernels=True)
  fast_draft = smollm2_draft.load(smollm2.load_model(), cpu_kernels=True)
  context = int(np.mean([len(tok.encode_chat(p)) for p in sets['demo']])) + _MAX_NEW.value // 2
  costs = {rows: calibration.measure_costs(fast_target, fast_draft, gamma=rows - 1,
                                           batch_size=1, context_length=context)
           for rows in sorted({len(t) + 1 for _, t in trees})}
  print('\n| drafts | nodes | depth (draft calls) | rows verified | r | tokens / call, demo |'
        ' held-out | predicted speedup, held-out |')
  print('| --- | --- | --- | --- | --- | --- | --- | --- |')
  for name, tree in trees:
    depth, cost = max(map(len, tree)), costs[len(tree) + 1]
    held_out = tokens_per_call(ranks['held-out'], tree)
    print(f'| {name} | {len(tree)} | {depth} | {len(tree) + 1} | {cost.r:.2f} |'
          f' {tokens_per_call(ranks["demo"], tree):.3f} | {held_out:.3f} |'
          f' {held_out / (depth * cost.c + cost.r):.2f}× |')
  print(f'\nc = {np.median([c.c for c in costs.values()]):.3f} (median over the timings);'
        f' context {context}. Predicted speedup = tokens per call / (depth × c + r).')


if __name__ == '__main__':
  app.run(main)
