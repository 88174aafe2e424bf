"""Timing c and r(γ) for a job before it decodes, and the per-machine cache of those timings.

What a job (or a benchmark script) needs before its first batch: how long a draft call, a
target call and a verification take on this machine (Definition 3.7's c, and r, the
verification's cost over one target step), and an adaptive-γ rule priced with them.

  measure_costs          c and r for one γ: three compiled `extend` calls, interleaved
  measure_costs_cached   the same, cached per machine (a job's Theorem 3.8 prediction)
  measure_verify_costs   c and r(0) … r(γ_max) from isolated `extend` calls
  measure_round_costs    c and r(0) … r(γ_max) timed on whole rounds of the adaptive loop
                         (`round_cost_tokens`: how many new tokens a timed decode makes)
  measure_adaptive_gamma an `adaptive.AdaptiveGamma` priced by `measure_round_costs`, cached
                         per machine under `cost_cache_dir()` ($SPECLM_COST_CACHE)
  time_extend, time_tree_verifications   one call, or one `extend_tree` call per token tree

Each call is compiled with `jax.jit` and repeated many times inside one compiled loop (as the
decode loops do, so Python dispatch is not counted; the count is raised until a sample lasts
≥ 50 ms, as shorter ones are mostly scheduler noise), and medians over repeats are reported
after a warm-up call, the calls timed in turn within each repeat so that a busy machine slows
them alike:
  c = T_draft(1) / T_target(1)   (Definition 3.7),   r = T_target(γ+1) / T_target(1).

Shape letters: B batch, P prompt length (`context_length`), K tokens per `extend` call.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from speclm import adaptive
from speclm import decoding
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import token_trees
from speclm.analysis import benchmarking
from speclm.analysis import measure
from speclm.analysis.measure import CostEstimate


def _token_calls(definition):
  """(prefill, extend) of `definition` taking tokens only, as the timed calls need them. A
  `protocol.FeatureConditionedDraft` is given zero features of its input width (those a
  round's first proposal reads, the target's; their values do not change the cost)."""
  if not isinstance(definition, protocol.FeatureConditionedDraft):
    return definition.prefill, definition.extend

  def zeros(tokens):
    return jnp.zeros(tokens.shape + (definition.feature_dim,), jnp.float32)

  def prefill(params, inputs, input_lengths, cache):
    cache = definition.prefill_with_features(params, inputs, input_lengths, zeros(inputs), cache)
    return None, cache

  def extend(params, tokens, cache):
    logits, _, cache = definition.extend_with_features(params, tokens, zeros(tokens), cache)
    return logits, cache

  return prefill, extend


@functools.partial(jax.jit, static_argnums=0)
def _prefill(definition, params, inputs, input_lengths, cache):
  """`prefill` of `definition` (tokens only, `_token_calls`), compiled once per definition and
  shapes (a `jax.jit` made per call compiled it again for every measurement)."""
  return _token_calls(definition)[0](params, inputs, input_lengths, cache)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _repeated_extend(definition, params, tokens, cache, num_steps, tree_parents=None):
  """Runs `extend` num_steps times from the same cache length (the decode loops' inner call),
  or `extend_tree` over the token tree of `tree_parents` (a static tuple).

  `num_steps` is traced, so calibrating it does not recompile.
  """
  start_lengths = definition.cache_lengths(cache)
  layout = None
  if tree_parents is not None:
    layout = token_trees.layout(np.tile(np.asarray(tree_parents), (tokens.shape[0], 1)))

  _, extend = _token_calls(definition)

  def body(_, carry):
    cache, tokens, checksum = carry
    if layout is None:
      logits, cache = extend(params, tokens, cache)
    else:
      logits, cache = definition.extend_tree(params, tokens, layout, cache)
    cache = definition.rollback(cache, start_lengths)  # what a rejected round does
    tokens = (tokens + 1) % definition.vocab_size
    return cache, tokens, checksum + jnp.sum(logits)  # the sum keeps every logit live

  _, _, checksum = jax.lax.fori_loop(0, num_steps, body, (cache, tokens, jnp.float32(0)))
  return checksum


@dataclasses.dataclass(frozen=True)
class _Runner:
  """A compiled, warmed-up call of `extend`, repeated `num_steps` times per run."""

  run: Any
  num_steps: int


def _extend_runner(model: protocol.Model, *, num_new: int, batch_size: int,
                   context_length: int, num_steps: int, min_sample_seconds: float,
                   seed: int, tree_parents: tuple[int, ...] | None = None) -> _Runner:
  """Compiles and warms up `extend` on `num_new` tokens, then raises num_steps until one run
  lasts at least `min_sample_seconds` (short samples are mostly scheduler noise)."""
  if min(num_new, batch_size, context_length, num_steps) < 1:
    raise ValueError('num_new, batch_size, context_length and num_steps must all be >= 1.')
  definition = model.definition
  prompts, lengths = measure.random_prompts(model.vocab_size, batch_size, context_length, seed)
  prefix = int(definition.prefix_length(context_length))
  cache = definition.init_cache(batch_size, prefix + num_new)
  _, cache = _prefill(definition, model.params, jnp.asarray(prompts), jnp.asarray(lengths),
                      cache)
  tokens = jnp.asarray(np.resize(prompts[:, ::-1], (batch_size, num_new)))
  run = lambda steps: _repeated_extend(definition, model.params, tokens, cache,
                                       jnp.int32(steps), tree_parents)
  run(num_steps).block_until_ready()  # compile and warm up
  for _ in range(8):
    start = time.perf_counter()
    run(num_steps).block_until_ready()
    elapsed = time.perf_counter() - start
    if elapsed >= min_sample_seconds:
      break
    num_steps = int(math.ceil(num_steps * min(16.0, 1.2 * min_sample_seconds /
                                              max(elapsed, 1e-6))))
  return _Runner(run=functools.partial(run, num_steps), num_steps=num_steps)


def median_per_step(seconds: list[float], num_steps: int = 1) -> float:
  """The median over repeats of one sample's seconds divided by the calls it made.

  Args:
    seconds: one wall time per timed repeat (a sample), e.g. a list that
      `benchmarking.interleaved_rounds` returns for one run.
    num_steps: the calls each sample made.

  Returns:
    Median seconds per call.
  """
  return float(np.median([s / num_steps for s in seconds]))


def time_extend(model: protocol.Model, *, num_new: int, batch_size: int = 1,
                context_length: int = 64, num_steps: int = 20, repeats: int = 5,
                min_sample_seconds: float = 0.05, seed: int = 0, tree=None) -> float:
  """Median seconds of one `extend` call on `num_new` tokens after `context_length` positions
  (with a `token_trees.TreeShape` `tree`: one `extend_tree` call over its nodes, `num_new`
  then being their count, the root included).

  The cache is prefilled with random tokens; the call is compiled and warmed up, then timed
  `repeats` times, each sample running it at least `num_steps` times (more if needed to last
  `min_sample_seconds`) inside one compiled loop.

  Args:
    model: the model whose `extend` (or `extend_tree`) is timed.
    num_new: K, tokens per call (a tree's node count).
    batch_size: B, rows per call.
    context_length: P, positions already in the cache (random prompt tokens).
    num_steps: the fewest calls per timed sample.
    repeats: timed samples; the median is kept.
    min_sample_seconds: calls per sample are raised until a sample lasts this long.
    seed: seeds the random prompts.
    tree: optional `token_trees.TreeShape` timed with one `extend_tree` call.

  Returns:
    Median seconds per call.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  if tree is not None and num_new != len(tree.parents):
    raise ValueError(f'num_new must be the tree\'s {len(tree.parents)} nodes, got {num_new}.')
  runner = _extend_runner(model, num_new=num_new, batch_size=batch_size,
                          context_length=context_length, num_steps=num_steps,
                          min_sample_seconds=min_sample_seconds, seed=seed,
                          tree_parents=None if tree is None else tree.parents)
  (seconds,) = benchmarking.interleaved_rounds([lambda _: runner.run()], repeats)
  return median_per_step(seconds, runner.num_steps)


def time_tree_verifications(target: protocol.Model, trees, *, batch_size: int = 1,
                            context_length: int = 64, num_steps: int = 20, repeats: int = 5,
                            min_sample_seconds: float = 0.05, seed: int = 0) -> list[float]:
  """r of each `token_trees.TreeShape` in `trees`: one target `extend_tree` call over its
  nodes / one 1-token `extend` call.

  The 1-token call and every tree's call are timed in turn within each repeat
  (`benchmarking.interleaved_rounds`), and each r is the median of its per-repeat ratios, so
  a slow spell of a shared machine shifts numerator and denominator alike.

  Args:
    target: M_p.
    trees: `token_trees.TreeShape`s, each timed with one `extend_tree` call over its nodes.
    batch_size: B, rows per call.
    context_length: P, positions already in the cache (random prompt tokens).
    num_steps: the fewest calls per timed sample.
    repeats: timed samples; the median is kept.
    min_sample_seconds: calls per sample are raised until a sample lasts this long.
    seed: seeds the random prompts.

  Returns:
    r of each tree, in the order of `trees`.
  """
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  common = dict(batch_size=batch_size, context_length=context_length, num_steps=num_steps,
                min_sample_seconds=min_sample_seconds, seed=seed)
  runners = [_extend_runner(target, num_new=1, **common)] + [
      _extend_runner(target, num_new=len(tree.parents), tree_parents=tree.parents, **common)
      for tree in trees]
  return _ratios_to_first(runners, repeats)


def verification_ratio(target: protocol.Model, *, num_new: int, batch_size: int = 1,
                       context_length: int = 64, num_steps: int = 20, repeats: int = 5,
                       min_sample_seconds: float = 0.05, seed: int = 0) -> float:
  """r of a chain: one `extend` call on `num_new` tokens over one 1-token call, the two timed
  in turn within each repeat and r the median of the per-repeat ratios (as
  `time_tree_verifications`), so that a slow spell shifts both alike. Arguments as there."""
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  common = dict(batch_size=batch_size, context_length=context_length, num_steps=num_steps,
                min_sample_seconds=min_sample_seconds, seed=seed)
  runners = [_extend_runner(target, num_new=k, **common) for k in (1, num_new)]
  return _ratios_to_first(runners, repeats)[0]


def _ratios_to_first(runners, repeats: int) -> list[float]:
  """Each runner after the first: the median over `repeats` interleaved rounds of its time
  per call over the first runner's in the same round."""
  seconds = benchmarking.interleaved_rounds([lambda _, r=r: r.run() for r in runners], repeats)
  per_call = [[s / r.num_steps for s in samples] for samples, r in zip(seconds, runners)]
  return [float(np.median([t / o for t, o in zip(samples, per_call[0])]))
          for samples in per_call[1:]]


def measure_costs(target: protocol.Model, draft: protocol.Model, *, gamma: int,
                  batch_size: int = 1, context_length: int = 64, num_steps: int = 20,
                  repeats: int = 5, min_sample_seconds: float = 0.05,
                  seed: int = 0) -> CostEstimate:
  """c and r for these models, this batch size and context length, on the default device.

  The three calls are timed in turn within each repeat (`benchmarking.interleaved_rounds`);
  each sample repeats a call at least `num_steps` times and lasts at least
  `min_sample_seconds`.

  Args:
    target, draft: M_p and M_q.
    gamma: γ; the verification call takes K = γ+1 tokens.
    batch_size: B, rows per call.
    context_length: P, positions already in the cache (random prompt tokens).
    num_steps: the fewest calls per timed sample.
    repeats: timed samples; the median is kept.
    min_sample_seconds: calls per sample are raised until a sample lasts this long.
    seed: seeds the random prompts.

  Returns:
    The `CostEstimate` (seconds per call; c and r as properties).
  """
  if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < 1:
    raise ValueError(f'gamma must be an integer >= 1, got {gamma!r}.')
  if repeats < 1:
    raise ValueError(f'repeats must be >= 1, got {repeats}.')
  kwargs = dict(batch_size=batch_size, context_length=context_length, num_steps=num_steps,
                min_sample_seconds=min_sample_seconds, seed=seed)
  runners = [_extend_runner(draft, num_new=1, **kwargs),
             _extend_runner(target, num_new=1, **kwargs),
             _extend_runner(target, num_new=gamma + 1, **kwargs)]
  seconds = benchmarking.interleaved_rounds([lambda _, r=r: r.run() for r in runners], repeats)
  draft_step, target_step, target_verify = (
      median_per_step(s, r.num_steps) for s, r in zip(seconds, runners))
  return CostEstimate(draft_step_seconds=draft_step, target_step_seconds=target_step,
                      target_verify_seconds=target_verify, gamma=int(gamma),
                      batch_size=batch_size, context_length=context_length)


def measure_verify_costs(target: protocol.Model, draft: protocol.Model, *, max_gamma: int,
                         batch_size: int = 1, context_length: int = 64, num_steps: int = 8,
                         repeats: int = 3, min_sample_seconds: float = 0.05,
                         seed: int = 0) -> tuple[float, tuple[float, ...]]:
  """c and r(0) … r(γ_max) for `adaptive.AdaptiveGamma`: one draft step, and target calls of
  1 … γ_max+1 tokens, each over a one-token target call (r(0) = 1). Timed as
  `measure_costs` times its three calls, all interleaved within each repeat.

  Args:
    target, draft: M_p and M_q.
    max_gamma: γ_max; target calls of K = 1 … γ_max+1 tokens are timed.
    batch_size, context_length, num_steps, repeats, min_sample_seconds, seed: as in
      `measure_costs`.

  Returns:
    (c, (r(0), …, r(γ_max))), r never decreasing with γ.
  """
  if isinstance(max_gamma, bool) or not isinstance(max_gamma, (int, np.integer)) or max_gamma < 1:
    raise ValueError(f'max_gamma must be an integer >= 1, got {max_gamma!r}.')
  kwargs = dict(batch_size=batch_size, context_length=context_length, num_steps=num_steps,
                min_sample_seconds=min_sample_seconds, seed=seed)
  runners = [_extend_runner(draft, num_new=1, **kwargs)] + [
      _extend_runner(target, num_new=k, **kwargs) for k in range(1, max_gamma + 2)]
  seconds = benchmarking.interleaved_rounds([lambda _, r=r: r.run() for r in runners], repeats)
  per_call = [median_per_step(s, r.num_steps) for s, r in zip(seconds, runners)]
  step = per_call[1]
  # A wider call never costs less: a noisy sample that says so is lifted to the one before.
  verify = np.maximum.accumulate([t / step for t in per_call[1:]])
  return per_call[0] / step, tuple(float(r) for r in verify)


# How long `measure_round_costs` times each γ by default: new tokens per decode (at least;
# `round_cost_tokens` gives more after a long prompt), and interleaved repeats.
# `measure_adaptive_gamma` caches other settings under their own key.
ROUND_COST_TOKENS = 32
ROUND_COST_REPEATS = 3


def round_cost_tokens(context_length: int) -> int:
  """New tokens per timed decode after a prompt of `context_length` tokens: ROUND_COST_TOKENS,
  or a quarter of the prompt (rounded up to 16) where that is more.

  Each timed decode includes the prompt's prefill, which `measure_round_costs` subtracts. A
  prefill grows with the prompt (576 tokens of SmolLM2-135M: 0.8–1.0 s on 2 cores, about 40
  decode steps), so after 32 tokens the rounds were about 40% of each sample, and the
  prefill's noise (±10% a sample) moved r(γ) by up to ±0.6 between runs (four runs gave r(4)
  from 1.72 to 2.86, one of them r(1) = 0.57). A quarter of the prompt keeps the decode about 3/4
  of a sample or more.
  """
  return max(ROUND_COST_TOKENS, 16 * math.ceil(context_length / 64))


def _forcing_rule(max_gamma: int, gamma: int, max_skip: int) -> adaptive.AdaptiveGamma:
  """An adaptive rule that chooses `gamma` every round: every other width is priced at 10⁶
  target steps (and drafting at nothing), so no running α can make another width win."""
  costs = [1e6] * (max_gamma + 1)
  costs[gamma] = 1.0
  return adaptive.AdaptiveGamma(max_gamma=max_gamma, draft_cost=0.0, verify_costs=tuple(costs),
                                max_skip=max_skip)


def measure_round_costs(target: protocol.Model, draft: protocol.Model, *, max_gamma: int,
                        batch_size: int = 1, context_length: int = 64,
                        num_new_tokens: int | None = None,
                        repeats: int = ROUND_COST_REPEATS, max_skip: int = 3,
                        seed: int = 0) -> tuple[float, tuple[float, ...]]:
  """c and r(0) … r(γ_max) for `adaptive.AdaptiveGamma`, with r timed on whole rounds.

  Timing the (γ+1)-token target call alone (`measure_verify_costs`) leaves out what else a
  round does: the draft's γ calls through the loop, the acceptance test over the vocabulary,
  sampling, appending, the width switch. Here the adaptive loop itself runs, made to choose
  γ every round (`_forcing_rule`), for γ = 0 … γ_max, beside the baseline loop, on
  `batch_size` random prompts of `context_length` tokens and `num_new_tokens` new ones, all
  interleaved within each of `repeats` rounds. The prompt's prefill (timed alone; the
  draft's, where it reads the prompt, is taken as c times the target's) is subtracted, the
  rest divided by the rounds the loop made (`DecodeStats.target_calls` − 1) and by the
  baseline's time per token, within each repeat (so that a machine slowing down between
  repeats slows both sides of each ratio), and the median over repeats is kept. That gives
  each round's full cost in target steps; the rule's
  draft calls are taken off it (γ·c, and for γ = 0 nothing, or c when max_skip = 0) so that
  `AdaptiveGamma.round_cost(γ)` returns the measured round cost. r(0) > 1 then holds the
  γ = 0 round's overhead over a plain step.

  The forced rules differ only in their costs, which reach the loop as an array, so the
  γ_max + 1 runs share one compilation (the baseline and the prefill have their own);
  `measure_adaptive_gamma` caches the result per machine.

  Args:
    target, draft: M_p and M_q.
    max_gamma: γ_max; rounds of γ = 0 … γ_max are timed.
    batch_size: B, random prompts decoded per call.
    context_length: P, their length.
    num_new_tokens: new tokens per timed decode; None: `round_cost_tokens(context_length)`.
    repeats: interleaved timed repeats; the medians of their ratios are kept.
    max_skip: the rule's `max_skip` (0 for a feature-conditioned draft, whatever is given).
    seed: seeds the prompts.

  Returns:
    (c, (r(0), …, r(γ_max))) in target steps, r never decreasing from γ = 1 on.
  """
  if isinstance(max_gamma, bool) or not isinstance(max_gamma, (int, np.integer)) or max_gamma < 1:
    raise ValueError(f'max_gamma must be an integer >= 1, got {max_gamma!r}.')
  if num_new_tokens is None:
    num_new_tokens = round_cost_tokens(context_length)
  if min(batch_size, context_length, num_new_tokens, repeats) < 1:
    raise ValueError('batch_size, context_length, num_new_tokens and repeats must all be >= 1.')
  if isinstance(draft.definition, protocol.FeatureConditionedDraft):
    max_skip = 0  # it reads the target's features every round (as `speculative_decode` sets)
  draft_runner = _extend_runner(draft, num_new=1, batch_size=batch_size,
                                context_length=context_length, num_steps=8,
                                min_sample_seconds=0.05, seed=seed)
  prompts, lengths = measure.random_prompts(target.vocab_size, batch_size, context_length, seed)
  prompts, lengths = jnp.asarray(prompts), jnp.asarray(lengths)
  common = dict(sampling=sampling_lib.GREEDY, max_new_tokens=num_new_tokens, seed=seed)
  cache = target.definition.init_cache(batch_size,
                                       context_length + num_new_tokens + max_gamma + 2)
  prefill = jax.jit(target.definition.prefill)
  # γ = 0 too runs the adaptive loop's rounds (`speculative_decode` would run the baseline for
  # a rule that never drafts): r(0) prices a γ = 0 round between drafting ones.
  loops = [functools.partial(decoding.speculative_decode, target, draft, prompts, lengths,
                             gamma=_forcing_rule(max_gamma, gamma, max_skip),
                             baseline_if_never_drafting=False, **common)
           for gamma in range(max_gamma + 1)]
  runs = [draft_runner.run,
          lambda: prefill(target.params, prompts, lengths, cache)[0],
          lambda: decoding.autoregressive_decode(target, prompts, lengths, **common).tokens,
          *[lambda loop=loop: loop().tokens for loop in loops]]
  jax.block_until_ready(runs[1]())  # compile and warm up (the draft runner already is)
  jax.block_until_ready(runs[2]())
  rounds = [int(loop().stats.target_calls) - 1 for loop in loops]  # also warms them up
  seconds = benchmarking.interleaved_rounds([lambda _, run=run: run() for run in runs], repeats)
  per_repeat = [
      _round_costs(draft_s / draft_runner.num_steps, prefill_s, baseline_s, list(loop_s), rounds,
                   num_new_tokens=num_new_tokens, max_skip=max_skip)
      for draft_s, prefill_s, baseline_s, *loop_s in zip(*seconds)]
  c = float(np.median([c for c, _ in per_repeat]))
  verify = np.median([r for _, r in per_repeat], axis=0)
  # A wider round never costs less: a noisy median that says so is lifted to the one before.
  verify = [verify[0]] + list(np.maximum.accumulate(verify[1:]))
  return c, tuple(float(r) for r in verify)


def _round_costs(draft_call_s: float, prefill_s: float, baseline_s: float,
                 loop_s: list[float], rounds: list[int], *, num_new_tokens: int,
                 max_skip: int) -> tuple[float, tuple[float, ...]]:
  """c and r(0) … r(γ_max) in baseline steps from one repeat of `measure_round_costs`: the
  seconds of one draft call, the target's prefill, a baseline decode, and the loop forced to
  each γ (which made `rounds[γ]` rounds)."""
  step = max(baseline_s - prefill_s, 1e-9) / num_new_tokens  # one baseline token
  c = draft_call_s / step
  verify = []
  for gamma, (total, num_rounds) in enumerate(zip(loop_s, rounds)):
    # The draft reads the prompt once (in its first drafting round when it may sit out).
    draft_prefill = c * prefill_s if (gamma or not max_skip) else 0.0
    round_steps = (total - prefill_s - draft_prefill) / max(num_rounds, 1) / step
    draft_calls = gamma if gamma else (0.0 if max_skip else 1.0)
    verify.append(max(round_steps - draft_calls * c, 0.05))
  return c, tuple(verify)


# The modules whose code the timed rounds run (paths under speclm/), and this timing code: an
# edit to any of them (a change to the loop, the models, the kernel or how they are timed)
# makes the cached timings stale. A listed path this copy of speclm lacks is skipped, so the
# digest of a tree without it is unchanged.
_TIMED_CODE = ('decoding.py', 'decode_common.py', 'adaptive.py', 'speculative.py',
               'sampling.py', 'protocol.py', 'models', 'kernels',
               os.path.join('run', 'calibration', 'costs.py'))


def _speclm_root() -> str:
  """The directory of the speclm package this module belongs to (speclm/run/calibration/..)."""
  here = os.path.dirname(os.path.abspath(__file__))
  return os.path.dirname(os.path.dirname(here))


@functools.lru_cache(maxsize=1)
def _timed_code_digest() -> str:
  """A digest of the source of `_TIMED_CODE` (in this installed copy of speclm)."""
  root = _speclm_root()
  digest = hashlib.sha256()
  for name in _TIMED_CODE:
    path = os.path.join(root, name)
    if not os.path.exists(path):
      continue
    files = ([os.path.join(path, f) for f in sorted(os.listdir(path))
              if f.endswith(('.py', '.cc', '.h'))] if os.path.isdir(path) else [path])
    for file in files:
      digest.update(os.path.relpath(file, root).encode())
      with open(file, 'rb') as f:
        digest.update(f.read())
  return digest.hexdigest()[:16]


def _cost_cache_key(target, draft, max_gamma, batch_size, context_length, max_skip=3,
                    method='whole rounds', **timing) -> str:
  """What the timings depend on: this machine, the software (speclm's timed code included:
  `_TIMED_CODE`), the models' definitions and parameter shapes, the batch size, γ_max and the
  context (and `timing`, the timing's own settings where they are not the defaults)."""
  def shapes(model):
    return [(str(x.shape), str(x.dtype)) for x in jax.tree_util.tree_leaves(model.params)]
  description = json.dumps({
      'machine': [platform.machine(), platform.processor(), os.cpu_count(),
                  jax.default_backend(), [d.device_kind for d in jax.devices()]],
      'software': [jax.__version__, platform.python_version(), _timed_code_digest()],
      'target': [repr(target.definition), shapes(target)],
      'draft': [repr(draft.definition), shapes(draft)],
      'batch_size': batch_size, 'max_gamma': max_gamma, 'context_length': context_length,
      'max_skip': max_skip,
      'method': method,  # 'whole rounds' (adaptive γ) or 'isolated calls' (measure_costs)
      **({'timing': timing} if timing else {}),
  }, sort_keys=True)
  return hashlib.sha256(description.encode()).hexdigest()[:24]


def cost_cache_dir() -> str:
  """Where measured adaptive-γ costs are kept: `$SPECLM_COST_CACHE` or ~/.cache/speclm/costs.

  One JSON file per key (`_cost_cache_key`): draft_cost, verify_costs, batch_size, max_gamma,
  context_length.
  """
  return os.environ.get('SPECLM_COST_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'speclm', 'costs')


def _read_cache(path: str) -> dict | None:
  """A cost cache file's JSON, or None where it is missing or does not parse."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _write_cache(path: str, entry: dict) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  temporary = f'{path}.{os.getpid()}.tmp'
  with open(temporary, 'w') as f:
    json.dump(entry, f, indent=1)
  os.replace(temporary, path)


def measure_costs_cached(target: protocol.Model, draft: protocol.Model, *, gamma: int,
                         batch_size: int = 1, context_length: int = 64, num_steps: int = 20,
                         repeats: int = 5, use_cache: bool = True) -> CostEstimate:
  """`measure_costs`, its result cached per machine as `measure_adaptive_gamma`'s is (same
  directory and key, with method 'isolated calls', γ and the timing settings): jobs of one
  model pair at several temperatures, or a rerun, time c and r once. A cache file that does
  not parse is measured again and rewritten; `use_cache=False` always measures."""
  path = os.path.join(cost_cache_dir(), _cost_cache_key(
      target, draft, gamma, batch_size, context_length, method='isolated calls',
      num_steps=num_steps, repeats=repeats) + '.json')
  saved = _read_cache(path) if use_cache else None
  if saved is not None:
    try:
      return CostEstimate(**{k: saved[k] for k in (
          'draft_step_seconds', 'target_step_seconds', 'target_verify_seconds', 'gamma',
          'batch_size', 'context_length')})
    except (KeyError, TypeError):
      pass
  estimate = measure_costs(target, draft, gamma=gamma, batch_size=batch_size,
                           context_length=context_length, num_steps=num_steps, repeats=repeats)
  if use_cache:
    _write_cache(path, estimate.to_dict())
  return estimate


def measure_adaptive_gamma(target: protocol.Model, draft: protocol.Model, *, max_gamma: int,
                           batch_size: int = 1, context_length: int = 64,
                           use_cache: bool = True, num_new_tokens: int | None = None,
                           repeats: int = ROUND_COST_REPEATS,
                           **rule_kwargs) -> adaptive.AdaptiveGamma:
  """An `adaptive.AdaptiveGamma` rule with c and r(γ) timed for these models and batch size.

  The timings are cached (`cost_cache_dir()`, one JSON file per machine, model pair, batch size,
  γ_max and context; see `_cost_cache_key`), so a job measures them once per machine. A
  cache file that does not parse is measured again and rewritten. c and r are timed on whole
  rounds of the adaptive loop (`measure_round_costs`, with `num_new_tokens` and `repeats`; a
  shorter timing than the default, e.g. for a smoke run, is cached under its own key).
  `rule_kwargs` go to `AdaptiveGamma` (prior_alpha, prior_weight, decay, draft_stopping,
  max_skip).

  Args:
    target, draft: M_p and M_q.
    max_gamma: γ_max of the rule.
    batch_size: B, the job's rows per decode call.
    context_length: P, the prompt length the rounds are timed after.
    use_cache: read and write `cost_cache_dir()`; False always measures and writes nothing.
    num_new_tokens, repeats: of `measure_round_costs`.
    **rule_kwargs: the rule's other settings.

  Returns:
    The `adaptive.AdaptiveGamma` rule with the measured draft_cost (c) and verify_costs (r).
  """
  max_skip = rule_kwargs.get('max_skip', 3)
  timing = {} if (num_new_tokens, repeats) == (None, ROUND_COST_REPEATS) else {
      'num_new_tokens': num_new_tokens, 'repeats': repeats}
  path = os.path.join(cost_cache_dir(), _cost_cache_key(target, draft, max_gamma, batch_size,
                                                        context_length, max_skip, **timing)
                      + '.json')
  costs = None
  saved = _read_cache(path) if use_cache else None
  if saved is not None:
    try:
      costs = (float(saved['draft_cost']), tuple(float(r) for r in saved['verify_costs']))
      adaptive.AdaptiveGamma(max_gamma=max_gamma, draft_cost=costs[0], verify_costs=costs[1])
    except (ValueError, KeyError, TypeError):
      costs = None
  if costs is None:
    costs = measure_round_costs(target, draft, max_gamma=max_gamma, batch_size=batch_size,
                                context_length=context_length, max_skip=max_skip,
                                num_new_tokens=num_new_tokens, repeats=repeats)
    if use_cache:
      _write_cache(path, {'draft_cost': costs[0], 'verify_costs': list(costs[1]),
                          'batch_size': batch_size, 'max_gamma': max_gamma,
                          'context_length': context_length})
  return adaptive.AdaptiveGamma(max_gamma=int(max_gamma), draft_cost=costs[0],
                                verify_costs=costs[1], **rule_kwargs)


