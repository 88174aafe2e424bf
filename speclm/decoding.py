"""Compiled decode loops: `autoregressive_decode` (the baseline) and `speculative_decode`.

Each generation is one `jax.lax.while_loop` under `jax.jit`. The loop state is a frozen pytree
dataclass; γ, the sampling rule and the model definitions are static, everything that varies
per call (prompts, lengths, seeds, limits) is an array, so new prompts of the same shapes do
not recompile. Rows advance independently: every row accepts its own n ∈ [0, γ] each round.

Models are seen only through `speclm.protocol` (this module imports no model code). What the
loops share with the token-tree loop (`speclm.tree_decoding`) lives in `speclm.decode_common`
(called `common` below): the result types, the loop state, validation, start, append, finish.

Bookkeeping (both loops). A row's sequence is s_0 … s_{C−1}: the prefix that `prefill`
consumed (prompt, or decoder start token) followed by the generated tokens. The newest token
s_{C−1} ("pending") is not yet in the target's cache: the target cache holds C−1 positions.
  * Start (`_prefill_pair`): each loop prefills its models, one function per kind of draft
    (`_prefill_chain`; `_prefill_lazy` for a draft that may sit rounds out; a
    feature-conditioned draft with the target's prompt features, `_prefill_features`), then
    `common.start` draws s_{C−1}, the first new token, from the target's prefill p̃ and
    builds the loop state.
  * Baseline step: extend the target with [pending] -> p̃ -> sample the next pending token.
  * Speculative round (Algorithm 1), one `_round` of `_speculative_loop`:
      1. draft (`_draft_step`, `_draft_tokens`): roll its cache back to C−2 positions and
         extend with [s_{C−2}, s_{C−1}] (`_read_newest`; the re-fed s_{C−2} is what lets the
         draft catch up after a round where all γ were kept, without a branch); then γ−1
         single-token steps (`_draft_chain`). γ draft calls give q̃_1…q̃_γ, x_1…x_γ. A
         `protocol.FeatureConditionedDraft` (EAGLE-style) instead rolls back to C − n − 1
         and re-reads the n+1 tokens the last round appended, each with the target's
         feature of the position before it (`common.reread_feature_block`: G+1 rows, the
         ones past n+1 unused), so every position before the round holds the target's
         features, as training-time test trains it; its later steps read its own predicted
         features.
      2. verify (`_verify_and_accept`): one target extend with [s_{C−1}, x_1, …, x_γ]
         -> p̃_1 … p̃_{γ+1} (and its features of those positions for a feature-conditioned
         draft).
      3. accept (`speculative.speculative_round`) -> n accepted and one more token t. At
         temperature 0, where every p̃ and q̃ is one-hot, `speculative.greedy_round` makes
         the same decisions from the argmax ids (`sampling.greedy_ids`) alone.
      4. append (`common.round_tokens`, `common.commit_round`): the target cache keeps
         C−1+n+1 positions (rollback = lowering a length); x_1…x_n, t are appended and t
         becomes pending.
  * Adaptive γ (`gamma=adaptive.AdaptiveGamma(...)`): before step 1 the rule picks the round's
    γ ∈ [0, γ_max] from each row's running α (`speclm.adaptive`). The draft then proposes
    k ≤ γ_max tokens (a while loop, `_draft_adaptive`), and the target verifies k+1 tokens
    and Algorithm 1 accepts among the k, at one of γ_max+1 widths chosen by `lax.switch` (a
    target on the CPU kernels verifies at γ_max+1 before it, told to skip the positions past
    k+1: `extend_live`). When γ = 0 the draft sits out (`lax.cond` in `_draft_step`; unless
    `max_skip` = 0). The loop keeps the last W = max_skip + 2 tokens (`recent`,
    updated by `_track_drafting`); when the draft next runs it rolls back to C−g and re-feeds
    the g = skipped+2 tokens it has not read instead of [s_{C−2}, s_{C−1}] (`_catch_up`),
    or, after more than max_skip rounds out, re-reads the whole sequence
    (`common.reread_draft`). A batch that stopped speculating therefore runs the draft not at
    all. Two bookkeeping helpers finish the round: `common.count_chain_round` adds it to the
    statistics (β sums and counts, the acceptance histogram, call counts) and
    `common.next_feature_block` keeps, for a feature-conditioned draft, the round's appended
    tokens and the target's features before them for the next round's re-read.

Shape letters: B batch, P prompt length, T output buffer, G γ, K tokens per extend, V
vocabulary, D feature width, W recent tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from speclm import adaptive
from speclm import decode_common as common
from speclm import protocol
from speclm import sampling as sampling_lib
from speclm import speculative
# Re-exported: callers and tests take the result types and the job-side checks from here.
from speclm.decode_common import DecodeResult
from speclm.decode_common import DecodeStats
from speclm.decode_common import StopReason
from speclm.decode_common import add_round
from speclm.decode_common import check_gamma
from speclm.decode_common import check_pair
from speclm.decode_common import end_tokens

__all__ = [
    'DecodeResult', 'DecodeStats', 'StopReason', 'add_round', 'autoregressive_decode',
    'check_gamma', 'check_pair', 'end_tokens', 'speculative_decode',
]


# ----------------------------------------------------------------------------------------------
# Public API


def autoregressive_decode(
    model: protocol.Model,
    prompt_tokens,
    prompt_lengths,
    *,
    sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY,
    max_new_tokens: int | Sequence[int] = 32,
    seed: int = 0,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    cache_length: int | None = None,
    partitioner=None,
) -> DecodeResult:
  """Plain sampling from `model`, one target call per token: the baseline.

  Args:
    model: the target, a `speclm.protocol.Model`.
    prompt_tokens: `[B, P]` int, right-padded prompts (encoder inputs for encoder-decoders).
    prompt_lengths: `[B]` int, real lengths (1 … P).
    sampling: how logits become the distribution sampled from.
    max_new_tokens: the generation limit, one for all rows or one per row.
    seed: random seed (unused by greedy sampling).
    eos_id: a token that ends a row (kept in the output), a list of such tokens (e.g. a chat
      model's end-of-turn and end-of-text ids), or None.
    pad_id: the value written past each row's length in the result.
    cache_length: cache positions per row; by default exactly enough for the prompt and every
      new token. A smaller value stops rows with `StopReason.CACHE_FULL`.
    partitioner: a `speclm.partitioning.Partitioner` to compile the loop with its mesh and
      shardings (parameters as `partitioner.shard_model` placed them); None for one device.
  """
  prompts, lengths, limits = common.validate_inputs(model, prompt_tokens, prompt_lengths,
                                                    sampling, max_new_tokens, seed, eos_id)
  common.check_context(model.definition, 'model', lengths, limits)
  capacity = common.cache_capacity(model.definition, prompts.shape[1], int(limits.max()), 0,
                                   cache_length)
  loop = (autoregressive_jit if partitioner is None else
          partitioner.jit_decode_loop(_autoregressive_loop, num_models=1))
  result = loop(
      model.definition, model.params, prompts, lengths, limits, jax.random.key(seed),
      end_tokens(eos_id), jnp.int32(pad_id), sampling=sampling,
      buffer_length=int(limits.max()) + 1, capacity=capacity)
  return common.trim(result, int(limits.max()))


def speculative_decode(
    target: protocol.Model,
    draft: protocol.Model,
    prompt_tokens,
    prompt_lengths,
    *,
    gamma: int | adaptive.AdaptiveGamma,
    sampling: sampling_lib.SamplingConfig = sampling_lib.GREEDY,
    max_new_tokens: int | Sequence[int] = 32,
    seed: int = 0,
    eos_id: int | Sequence[int] | None = None,
    pad_id: int = 0,
    cache_length: int | None = None,
    partitioner=None,
    baseline_if_never_drafting: bool = True,
) -> DecodeResult:
  """Speculative decoding (Algorithm 1): samples exactly from `target`, γ drafts per round.

  Args:
    target, draft: `speclm.protocol.Model`s sharing one vocabulary V.
    prompt_tokens: `[B, P]` int, right-padded prompts; prompt_lengths: `[B]` int, 1 … P.
    gamma: tokens the draft proposes per target call (an integer ≥ 1), or an
      `adaptive.AdaptiveGamma` rule that chooses it every round, 0 … γ_max.
    The rest as in `autoregressive_decode`; with a `partitioner` the draft's parameters follow
    its draft rules (replicated by default).

  With greedy sampling the output equals `autoregressive_decode(target, …)` token for token.

  A rule that chooses γ = 0 before it has any evidence never drafts (`adaptive.never_drafts`):
  with `baseline_if_never_drafting` (the default) the decode is then
  `autoregressive_decode(target, …)` itself, which runs a plain step faster than the adaptive
  loop runs a γ = 0 round; its statistics count every step as a γ = 0 round. With False the
  adaptive loop runs its own γ = 0 rounds (the same tokens; cost calibration times those).
  """
  prompts, lengths, limits = common.validate_inputs(target, prompt_tokens, prompt_lengths,
                                                    sampling, max_new_tokens, seed, eos_id)
  rule = gamma if isinstance(gamma, adaptive.AdaptiveGamma) else None
  gamma = rule.max_gamma if rule is not None else check_gamma(gamma)
  check_pair(target, draft)
  if rule is not None and isinstance(draft.definition, protocol.FeatureConditionedDraft):
    rule = dataclasses.replace(rule, max_skip=0)  # it reads the target's features every round
  common.check_context(draft.definition, 'draft', lengths, limits)
  if rule is not None and baseline_if_never_drafting and adaptive.never_drafts(rule):
    baseline = autoregressive_decode(
        target, prompts, lengths, sampling=sampling, max_new_tokens=max_new_tokens, seed=seed,
        eos_id=eos_id, pad_id=pad_id, cache_length=cache_length, partitioner=partitioner)
    return common.as_rounds_without_drafts(baseline, rule.max_gamma)
  target = protocol.target_for_feature_draft(target, draft)
  common.check_context(target.definition, 'target', lengths, limits)
  common.check_same_prefix(target, draft, prompts.shape[1])
  return _run_speculative_loop(
      target, draft, prompts, lengths, limits, gamma=gamma, rule=rule, sampling=sampling,
      seed=seed, eos_id=eos_id, pad_id=pad_id, cache_length=cache_length,
      partitioner=partitioner)


def _run_speculative_loop(target, draft, prompts, lengths, limits, *, gamma, rule, sampling,
                          seed, eos_id, pad_id, cache_length, partitioner) -> DecodeResult:
  """Sizes the caches and runs the compiled `_speculative_loop` on validated inputs
  (`prompts` `[B, P]`, `lengths` and `limits` `[B]`, int32)."""
  max_new = int(limits.max())
  capacity = functools.partial(common.cache_capacity, prompt_width=prompts.shape[1],
                               max_new=max_new, gamma=gamma, cache_length=cache_length)
  loop = (speculative_jit if partitioner is None else
          partitioner.jit_decode_loop(_speculative_loop, num_models=2))
  # An adaptive rule's costs travel as an array: rules that differ only in them share a loop.
  costs = jnp.asarray(rule.cost_vector() if rule is not None else np.zeros(0, np.float32))
  result = loop(
      target.definition, draft.definition, target.params, draft.params, prompts, lengths,
      limits, jax.random.key(seed), end_tokens(eos_id), jnp.int32(pad_id), costs,
      gamma=gamma, rule=None if rule is None else rule.structure(), sampling=sampling,
      buffer_length=max_new + gamma + 1, target_capacity=capacity(target.definition),
      draft_capacity=capacity(draft.definition,
                              gamma=common.feature_block_lookahead(draft.definition, gamma + 1,
                                                                   gamma + 1) - 1))
  return common.trim(result, max_new)


# ----------------------------------------------------------------------------------------------
# The baseline loop


def _autoregressive_loop(model_def, params, prompts, lengths, limits, rng, eos_id, pad_id, *,
                         sampling, buffer_length, capacity) -> DecodeResult:
  """The baseline in a while loop: one target call and one sampled token per step."""
  cache = model_def.init_cache(prompts.shape[0], capacity)
  logits, cache = model_def.prefill(params, prompts, lengths, cache)
  state = common.start(model_def, prompts, lengths, limits, rng, eos_id, sampling,
                       buffer_length, gamma=0, logits=logits, target_cache=cache)

  def step(state: common.LoopState) -> common.LoopState:
    reasons = common.stop_if_full(state.stop_reasons,
                                  model_def.cache_lengths(state.target_cache), 1,
                                  model_def.cache_capacity(state.target_cache))
    state = state.replace(stop_reasons=reasons)
    active = state.active
    rng, key = jax.random.split(state.rng)
    logits, cache = model_def.extend(params, state.pending_token[:, None], state.target_cache)
    token = sampling_lib.draw(key, logits[:, 0], sampling)
    # Finished rows keep their cache length (their writes land past it and are never read).
    old_lengths = model_def.cache_lengths(state.target_cache)
    cache = model_def.rollback(cache, jnp.where(active, old_lengths + 1, old_lengths))
    # A row whose logits are bad stops first, so the token drawn from them is not appended.
    bad = active & common.bad_rows(logits)
    tokens, num_generated, reasons = common.append(
        state.replace(stop_reasons=jnp.where(bad, StopReason.BAD_LOGITS, state.stop_reasons)),
        token[:, None], jnp.ones_like(token), limits, eos_id)
    stats = state.stats.replace(target_calls=state.stats.target_calls + 1,
                                target_calls_per_row=state.stats.target_calls_per_row + active)
    return state.replace(tokens=tokens, num_generated=num_generated, prev_token=state.pending_token,
                         pending_token=jnp.where(active & ~bad, token, state.pending_token),
                         stop_reasons=reasons, target_cache=cache, rng=rng, stats=stats)

  state = jax.lax.while_loop(lambda s: jnp.any(s.active), step, state)
  return common.finish(state, pad_id)


# ----------------------------------------------------------------------------------------------
# The speculative loop: prefill, then rounds of Algorithm 1


@dataclasses.dataclass(frozen=True)
class _Loop:
  """What every round of one traced `_speculative_loop` reads: the models, the call's arrays
  (prompts `[B, P]`, lengths and limits `[B]`, end tokens `[E]`, the rule's costs) and the
  static settings. `lazy_draft`: the draft may sit rounds out (adaptive γ with
  `max_skip` > 0), so it is not prefilled and catches up when it next drafts."""

  target_def: protocol.LanguageModel
  draft_def: protocol.LanguageModel
  target_params: object
  draft_params: object
  prompts: jax.Array
  lengths: jax.Array
  limits: jax.Array
  eos_id: jax.Array
  costs: jax.Array
  gamma: int
  rule: adaptive.AdaptiveGamma | None
  sampling: sampling_lib.SamplingConfig
  with_features: bool
  lazy_draft: bool


def _speculative_loop(target_def, draft_def, target_params, draft_params, prompts, lengths,
                      limits, rng, eos_id, pad_id, rule_costs, *, gamma, rule, sampling,
                      buffer_length, target_capacity, draft_capacity) -> DecodeResult:
  """Algorithm 1 in a while loop. With an adaptive `rule` (its `structure()`, static),
  `rule_costs` is its `cost_vector()`; unused otherwise."""
  with_features = isinstance(draft_def, protocol.FeatureConditionedDraft)
  loop = _Loop(target_def=target_def, draft_def=draft_def, target_params=target_params,
               draft_params=draft_params, prompts=prompts, lengths=lengths, limits=limits,
               eos_id=eos_id, costs=rule_costs, gamma=gamma, rule=rule, sampling=sampling,
               with_features=with_features,
               lazy_draft=rule is not None and rule.max_skip > 0 and not with_features)
  state = _prefill_pair(loop, rng, buffer_length, target_capacity, draft_capacity)
  state = jax.lax.while_loop(lambda s: jnp.any(s.active), functools.partial(_round, loop),
                             state)
  return common.finish(state, pad_id)


def _prefill_pair(loop: _Loop, rng, buffer_length: int, target_capacity: int,
                  draft_capacity: int) -> common.LoopState:
  """Prefills both models (one function per kind of draft) and builds the first state: the
  first token drawn (`common.start`), an adaptive rule's evidence, a lazy draft's window."""
  batch = loop.prompts.shape[0]
  draft_cache = loop.draft_def.init_cache(batch, draft_capacity)
  target_cache = loop.target_def.init_cache(batch, target_capacity)
  prefill = (_prefill_features if loop.with_features
             else _prefill_lazy if loop.lazy_draft else _prefill_chain)
  logits, target_cache, draft_cache, draft_features = prefill(loop, target_cache, draft_cache)
  state = common.start(loop.target_def, loop.prompts, loop.lengths, loop.limits, rng,
                       loop.eos_id, loop.sampling, buffer_length, loop.gamma, logits=logits,
                       target_cache=target_cache, draft_cache=draft_cache,
                       draft_features=draft_features)
  if not loop.lazy_draft:
    state = state.replace(stats=state.stats.replace(draft_calls=state.stats.draft_calls + 1))
  if loop.with_features:
    state = common.first_feature_block(state, loop.gamma + 1)
  if loop.rule is None:
    return state
  state = state.replace(evidence_sum=jnp.zeros((batch,), jnp.float32),
                        evidence_count=jnp.zeros((batch,), jnp.float32))
  if loop.lazy_draft:
    # The window of recent tokens starts as [0 … 0, s_{C−2}, s_{C−1}]; the draft has read
    # nothing yet (`skipped` = W − 1: re-read before drafting).
    window = loop.rule.max_skip + 2
    recent = jnp.zeros((batch, window), jnp.int32)
    state = state.replace(skipped=jnp.int32(window - 1), recent=recent.at[:, -2].set(
        state.prev_token).at[:, -1].set(state.pending_token))
  return state


def _prefill_chain(loop: _Loop, target_cache, draft_cache) -> tuple:
  """Prefill of a draft that reads tokens only: the draft, then the target.

  Returns (the target's logits `[B, V]`, target cache, draft cache, None: no features).
  """
  _, draft_cache = loop.draft_def.prefill(loop.draft_params, loop.prompts, loop.lengths,
                                          draft_cache)
  logits, target_cache = loop.target_def.prefill(loop.target_params, loop.prompts,
                                                 loop.lengths, target_cache)
  return logits, target_cache, draft_cache, None


def _prefill_lazy(loop: _Loop, target_cache, draft_cache) -> tuple:
  """Prefill for a draft that may sit rounds out (adaptive γ): only the target. The draft's
  cache is zeros shaped as after prefill (an encoder-decoder's holds the input); the draft
  reads the prompt when it first drafts (`common.reread_draft`), so a batch that never
  speculates never runs it. Returns what `_prefill_chain` does."""
  shaped = jax.eval_shape(loop.draft_def.prefill, loop.draft_params, loop.prompts,
                          loop.lengths, draft_cache)[1]
  draft_cache = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shaped)
  logits, target_cache = loop.target_def.prefill(loop.target_params, loop.prompts,
                                                 loop.lengths, target_cache)
  return logits, target_cache, draft_cache, None


def _prefill_features(loop: _Loop, target_cache, draft_cache) -> tuple:
  """Prefill of a feature-conditioned draft: the target, then the draft with the target's
  prompt features (`common.prefill_feature_draft`). Returns what `_prefill_chain` does, with
  the first round's `draft_features` `[B, 2, D]` last."""
  logits, features, target_cache = loop.target_def.prefill_with_features(
      loop.target_params, loop.prompts, loop.lengths, target_cache)
  draft_cache, draft_features = common.prefill_feature_draft(
      loop.draft_def, loop.draft_params, loop.prompts, loop.lengths, features, draft_cache)
  return logits, target_cache, draft_cache, draft_features


def _round(loop: _Loop, state: common.LoopState) -> common.LoopState:
  """One round of Algorithm 1 for every row: draft, verify, accept, append."""
  # The target writes γ+1 positions after C−1; the draft γ+1 after C−2 (an EAGLE draft γ+2).
  state, target_lengths, active, keys = common.begin_round(
      state, loop.target_def, loop.draft_def, loop.gamma + 1,
      common.feature_block_lookahead(loop.draft_def, loop.gamma + 1, loop.gamma + 1))
  rng, draft_key, uniform_key, next_key = keys
  # 0. An adaptive rule picks this round's γ from each row's running α (`speclm.adaptive`).
  round_gamma = None
  if loop.rule is not None:
    round_gamma = adaptive.choose_gamma(
        adaptive.running_alpha(state.evidence_sum, state.evidence_count, loop.rule), active,
        loop.rule, loop.costs)
  # 1. Draft: γ guesses x_1 … x_γ from q̃_1 … q̃_γ (k ≤ γ under an adaptive rule, and
  #    steps 2–3 then run at the width k).
  draft_probs, drafted, draft_cache, draft_bad, num_drafted, draft_runs = _draft_step(
      loop, state, target_lengths, round_gamma, active, draft_key)
  # 2. Verify: one parallel target call on [s_{C−1}, x_1, …, x_k] gives p̃_1 … p̃_{k+1}.
  # 3. Accept n of the guesses (r < p̃(x)/q̃(x)) and draw one more token t (Algorithm 1).
  uniforms = jax.random.uniform(uniform_key, (loop.prompts.shape[0], loop.gamma))
  result, target_bad, features, target_cache = _verify_and_accept(
      loop.target_def, loop.target_params, state, draft_probs, drafted, loop.with_features,
      loop.sampling, uniforms, next_key, num_drafted=None if loop.rule is None else num_drafted)
  n = result.num_accepted
  # 4. Keep C−1+n+1 target positions (rollback = a smaller length); append x_1 … x_n, t.
  # A row with bad logits anywhere in the round (the target's γ+1 or the draft's) stops
  # first and appends nothing from it.
  target_cache = loop.target_def.rollback(
      target_cache, jnp.where(active, target_lengths + n + 1, target_lengths))
  padded, new_tokens = common.round_tokens(drafted, n, result.next_token)
  tokens, num_generated, reasons, good, prev = common.commit_round(
      state, active, padded, new_tokens, n, active & (target_bad | draft_bad), loop.limits,
      loop.eos_id)
  state = _track_drafting(loop, state, result, new_tokens, good, num_drafted, draft_runs)
  if loop.with_features:
    state = common.next_feature_block(state, new_tokens, features, n, good)
  # t becomes pending; the token before it is x_n, or the old pending token when n = 0.
  return state.replace(
      tokens=tokens, num_generated=num_generated,
      prev_token=jnp.where(good, prev, state.prev_token),
      pending_token=jnp.where(good, result.next_token, state.pending_token),
      stop_reasons=reasons, target_cache=target_cache, draft_cache=draft_cache, rng=rng,
      stats=common.count_chain_round(state.stats, result, active, good, num_drafted,
                                     draft_runs))


def _draft_step(loop: _Loop, state: common.LoopState, target_lengths, round_gamma, active,
                key) -> tuple:
  """Step 1 of a round: `_draft_tokens`, or, when γ = 0 and the draft may fall behind
  (`rule.max_skip` > 0), nothing: it sits the round out (`lax.cond`) and catches up later.

  Returns `_draft_tokens`' (q̃, x, draft cache, draft bad, k) and whether the draft ran (True,
  or `[]` bool for a lazy draft).
  """
  def draft(state):
    reread = functools.partial(
        common.reread_draft, loop.draft_def, loop.draft_params, loop.prompts, loop.lengths,
        state.tokens, target_lengths, loop.draft_def.cache_capacity(state.draft_cache),
        loop.gamma + 1)
    return _draft_tokens(loop.draft_def, loop.draft_params, state, target_lengths, loop.gamma,
                         loop.sampling, key, rule=loop.rule, round_gamma=round_gamma,
                         active=active, costs=loop.costs, reread=reread)

  def sit_out(state):
    batch, gamma = loop.prompts.shape[0], loop.gamma
    return (None if loop.sampling.is_greedy
            else jnp.zeros((batch, gamma, loop.target_def.vocab_size), jnp.float32),
            jnp.zeros((batch, gamma), jnp.int32), state.draft_cache,
            jnp.zeros((batch,), bool), jnp.int32(0))

  if state.skipped is None:
    return draft(state) + (True,)
  draft_runs = round_gamma > 0
  return jax.lax.cond(draft_runs, draft, sit_out, state) + (draft_runs,)


def _track_drafting(loop: _Loop, state: common.LoopState, result: speculative.RoundResult,
                    new_tokens, good, num_drafted, draft_runs) -> common.LoopState:
  """Adaptive γ's state after a round: each row's decayed β evidence (`adaptive`) and, for a
  lazy draft, the window of recent tokens and the count of rounds it sat out.

  `new_tokens` `[B, G+1]` are the round's (`common.round_tokens`), of which `good` `[B]` rows
  appended n+1; rows that did not append keep their window. `skipped` stops at W − 1: more
  rounds than the window holds.
  """
  n = result.num_accepted
  if loop.rule is not None:
    evidence_sum, evidence_count = adaptive.update_evidence(
        state.evidence_sum, state.evidence_count,
        *common.reached_beta(result, good, num_drafted), loop.rule)
    state = state.replace(evidence_sum=evidence_sum, evidence_count=evidence_count)
  if state.skipped is not None:
    window = state.recent.shape[1]
    joined = jnp.concatenate([state.recent, new_tokens], axis=1)
    taken = jnp.take_along_axis(joined, (n + 1)[:, None] + jnp.arange(window)[None, :], axis=1)
    state = state.replace(recent=jnp.where(good[:, None], taken, state.recent),
                          skipped=jnp.where(draft_runs, 0,
                                            jnp.minimum(state.skipped + 1, window - 1)))
  return state


# ----------------------------------------------------------------------------------------------
# Steps 2–3 and the round's bookkeeping


def _verify_and_accept(target_def, target_params, state: common.LoopState, draft_probs, drafted,
                       with_features: bool, sampling, uniforms, key, num_drafted=None):
  """Steps 2 and 3 of a round: one target call on [s_{C−1}, x_1, …, x_k] (K = k+1 tokens)
  gives p̃_1 … p̃_{k+1}, then Algorithm 1 accepts n of x_1 … x_k and draws t.

  Returns (the `speculative.RoundResult`, its β `[B, G]` zero past k; `[B]` rows whose target
  logits are bad; the target's features `[B, G+1, D]` of the verified positions for a
  feature-conditioned draft, None otherwise; the target's cache). With a fixed γ, k = G.
  With a traced `num_drafted` k, the acceptance has the width k+1 (one of G+1 compiled
  branches, chosen by `lax.switch`), so the round's work over the vocabulary (p̃ at each
  verified position, the residual) follows the k chosen, not γ_max. So does the target call:
  in the branches, or once at the width G+1 before them (`extend_live`) for a target that
  skips the positions not needed (`skips_dead_positions`: the CPU kernels), as on CPU a
  branch that writes the cache copies all of it. Features past position k+1 repeat the last
  one (never read). At temperature 0 the acceptance is `speculative.greedy_round` on the
  argmax ids (the same decisions, no [B, K, V] arrays).
  """
  verified = jnp.concatenate([state.pending_token[:, None], drafted], axis=1)
  gamma = drafted.shape[1]

  def call(tokens, num_live=None):
    params, cache = target_params, state.target_cache
    if with_features:
      return (target_def.extend_with_features(params, tokens, cache) if num_live is None else
              target_def.extend_live_with_features(params, tokens, cache, num_live))
    logits, cache = (target_def.extend(params, tokens, cache) if num_live is None else
                     target_def.extend_live(params, tokens, cache, num_live))
    return logits, None, cache

  def accept(k, logits, features):
    """Algorithm 1 over the first k drafts, from the logits of the first k+1 positions."""
    if sampling.is_greedy:
      result = speculative.greedy_round(drafted[:, :k], sampling_lib.greedy_ids(logits))
    else:
      result = speculative.speculative_round(
          draft_probs[:, :k], drafted[:, :k], sampling_lib.standardize(logits, sampling),
          uniforms[:, :k], key)
    if k < gamma:
      result = result.replace(beta=jnp.pad(result.beta, ((0, 0), (0, gamma - k))))
      if features is not None:
        features = jnp.concatenate(
            [features[:, :k + 1], jnp.repeat(features[:, k:k + 1], gamma - k, axis=1)], axis=1)
    return result, common.bad_rows(logits), features

  def verify_and_accept(k):
    logits, features, cache = call(verified[:, :k + 1])
    return accept(k, logits, features) + (cache,)

  if num_drafted is None:
    return verify_and_accept(gamma)
  if not target_def.skips_dead_positions(target_params, verified.shape):
    return jax.lax.switch(num_drafted, [functools.partial(verify_and_accept, k)
                                        for k in range(gamma + 1)])
  logits, features, cache = call(verified, num_live=num_drafted + 1)
  result, bad, features = jax.lax.switch(
      num_drafted, [lambda k=k: accept(k, logits[:, :k + 1], features) for k in range(gamma + 1)])
  return result, bad, features, cache


# ----------------------------------------------------------------------------------------------
# Step 1: the draft proposes


def _draft_tokens(draft_def, draft_params, state: common.LoopState, target_lengths, gamma,
                  sampling, rng, *, rule: adaptive.AdaptiveGamma | None = None,
                  round_gamma=None, active=None, costs=None, reread=None):
  """Step 1 of a round: up to γ draft calls.

  Returns (q̃ `[B, G, V]`, x `[B, G]`, draft cache, `[B]` rows with bad draft logits, the
  number of proposals made). With a fixed γ that number is γ (a Python int). With an adaptive
  `rule` it is traced: 0 when `round_gamma` is 0, else up to `round_gamma` (or up to γ_max
  under draft-side stopping, see `speclm.adaptive`); x past it is 0 and q̃ past it is never
  read. The first call, which reads the newest tokens, is made in every round. At
  temperature 0 q̃ is None: it is one-hot on x, and `speculative.greedy_round` needs x alone.
  A draft that sat out more rounds than its window of recent tokens holds first re-reads the
  sequence with `reread()` (a cache holding C−2 positions; see `common.reread_draft`).
  """
  keys = jax.random.split(rng, gamma)
  extend = common.draft_extender(draft_def, draft_params)
  if state.recent is None or state.recent.shape[1] == 2:
    logits, cache, feature = _read_newest(draft_def, draft_params, state, target_lengths)
  else:
    logits, cache, feature = _catch_up(draft_def, draft_params, state, target_lengths, reread)
  # `logits` `[B, V]`: the draft's prediction after s_{C−1}, the first proposal's.
  first_probs, first_token = _choose(logits, keys[0], sampling)
  bad = common.bad_rows(logits)
  propose = functools.partial(_propose, extend, sampling)
  if rule is None:
    return _draft_chain(propose, keys, first_probs, first_token, feature, cache, bad,
                        sampling.is_greedy)
  return _draft_adaptive(propose, keys, logits, first_probs, first_token, feature, cache, bad,
                         sampling.is_greedy, rule=rule, round_gamma=round_gamma,
                         active=active, costs=costs)


def _read_newest(draft_def, draft_params, state: common.LoopState, target_lengths):
  """Rolls the draft back to C−2 positions and re-feeds [s_{C−2}, s_{C−1}] (see the module
  docstring). A feature-conditioned draft instead re-reads the tokens the last round appended,
  with the target's features before them (`common.reread_feature_block`).

  Returns (the draft's logits `[B, V]` after s_{C−1}, its cache, its predicted feature
  `[B, 1, D]` of s_{C−1}, or None for a draft that reads no features).
  """
  if state.feature_tokens is not None:
    return common.reread_feature_block(draft_def, draft_params, state.draft_cache,
                                       state.feature_tokens, state.draft_features,
                                       state.feature_count, target_lengths)
  cache = draft_def.rollback(state.draft_cache, target_lengths - 1)
  newest = jnp.stack([state.prev_token, state.pending_token], axis=1)
  logits, cache = draft_def.extend_last(draft_params, newest, cache)
  return logits, cache, None


def _catch_up(draft_def, draft_params, state: common.LoopState, target_lengths, reread):
  """The first draft call after `state.skipped` rounds without the draft (adaptive γ = 0).

  It is that many tokens behind: roll back to C−g and re-feed the last g = skipped + 2 tokens
  of `state.recent` `[B, W]` (one compiled width per g, chosen by `lax.switch`). Past the
  window (skipped = W − 1) it re-reads the sequence up to C−2 first (`reread()`), then
  re-feeds [s_{C−2}, s_{C−1}]. Returns what `_read_newest` does (no feature).
  """
  window = state.recent.shape[1]

  def refeed(g, cache):
    cache = draft_def.rollback(cache, target_lengths + 1 - g)
    return draft_def.extend_last(draft_params, state.recent[:, window - g:], cache)

  branches = [functools.partial(refeed, g, state.draft_cache) for g in range(2, window + 1)]
  branches.append(lambda: refeed(2, reread()))
  logits, cache = jax.lax.switch(state.skipped, branches)
  return logits, cache, None


def _choose(logits, key, sampling):
  """(q̃ `[B, V]`, None at temperature 0; the token drawn from it `[B]`) from `logits`."""
  if sampling.is_greedy:
    return None, sampling_lib.greedy_ids(logits)
  probs = sampling_lib.standardize(logits, sampling)
  return probs, sampling_lib.sample(key, probs)


def _propose(extend, sampling, token, feature, cache, key):
  """One more draft call on `token` `[B]`: (its logits `[B, V]`, q̃ `[B, V]` or None, the
  next proposal `[B]`, the draft's predicted feature or None, the cache). Past the first
  proposal the true features are unknown: a feature-conditioned draft reads its own."""
  logits, cache, feature = extend(token[:, None], feature, cache)
  probs, next_token = _choose(logits[:, 0], key, sampling)
  return logits[:, 0], probs, next_token, feature, cache


def _draft_chain(propose, keys, first_probs, first_token, feature, cache, bad, greedy: bool):
  """A fixed γ = len(`keys`): the γ−1 draft calls after the first, in a `lax.scan`.

  Returns `_draft_tokens`' tuple, with the number of proposals the Python int γ.
  """
  def step(carry, key):
    token, feature, cache, bad = carry
    logits, probs, next_token, feature, cache = propose(token, feature, cache, key)
    return (next_token, feature, cache, bad | common.bad_rows(logits)), (probs, next_token)

  (_, _, cache, bad), (probs, tokens) = jax.lax.scan(step, (first_token, feature, cache, bad),
                                                     keys[1:])
  draft_probs = None if greedy else jnp.concatenate(
      [first_probs[:, None], jnp.swapaxes(probs, 0, 1)], axis=1)
  draft_tokens = jnp.concatenate([first_token[:, None], jnp.swapaxes(tokens, 0, 1)], axis=1)
  return draft_probs, draft_tokens, cache, bad, keys.shape[0]


def _draft_adaptive(propose, keys, logits, first_probs, first_token, feature, cache, bad,
                    greedy: bool, *, rule, round_gamma, active, costs):
  """Adaptive γ: a while loop that stops at the round's γ, or by `adaptive.keep_drafting`
  (draft-side stopping, from the draft's confidence). γ_max = len(`keys`).

  Returns `_draft_tokens`' tuple, with the traced number of proposals k.
  """
  gamma = keys.shape[0]
  confidence = adaptive.draft_confidence(logits, first_probs, greedy)
  probs_buffer = None if greedy else jnp.zeros(
      (first_probs.shape[0], gamma) + first_probs.shape[1:],
      first_probs.dtype).at[:, 0].set(first_probs)
  token_buffer = jnp.zeros((first_token.shape[0], gamma), jnp.int32).at[:, 0].set(first_token)
  # E_1 = Σ_b (1 + P_{b,1}) over active rows, P_{b,1} = a_{b,1}.
  expected = jnp.sum(jnp.where(active, 1.0 + confidence, 0.0))
  limit = gamma if rule.draft_stopping else round_gamma

  def more(carry):
    j, _, _, _, _, _, _, all_accepted, confidence, expected = carry
    go = (round_gamma > 0) & (j < limit)
    if rule.draft_stopping:
      go &= adaptive.keep_drafting(j, expected, all_accepted, confidence, active, rule, costs)
    return go

  def step(carry):
    j, token, feature, cache, bad, probs_buffer, token_buffer, all_accepted, _, expected = carry
    logits, probs, next_token, feature, cache = propose(token, feature, cache, keys[j])
    confidence = adaptive.draft_confidence(logits, probs, greedy)
    all_accepted = all_accepted * confidence
    return (j + 1, next_token, feature, cache, bad | common.bad_rows(logits),
            None if greedy else probs_buffer.at[:, j].set(probs),
            token_buffer.at[:, j].set(next_token),
            all_accepted, confidence,
            expected + jnp.sum(jnp.where(active, all_accepted, 0.0)))

  carry = (jnp.int32(1), first_token, feature, cache, bad, probs_buffer, token_buffer,
           confidence, confidence, expected)
  j, _, _, cache, bad, probs_buffer, token_buffer, *_ = jax.lax.while_loop(more, step, carry)
  num_drafted = jnp.where(round_gamma > 0, j, 0)
  drafted = jnp.arange(gamma)[None, :] < num_drafted
  return probs_buffer, jnp.where(drafted, token_buffer, 0), cache, bad, num_drafted


# `speclm.partitioning.Partitioner.jit_decode_loop` relies on the loops' argument order: the
# definitions, their parameters, then prompts, lengths, limits, rng, eos_id, pad_id (and the
# speculative loop's rule costs). Tests count the compiled loops' programs (`_cache_size()`).
autoregressive_jit = jax.jit(
    _autoregressive_loop, static_argnums=(0,),
    static_argnames=('sampling', 'buffer_length', 'capacity'))
speculative_jit = jax.jit(
    _speculative_loop, static_argnums=(0, 1),
    static_argnames=('gamma', 'rule', 'sampling', 'buffer_length', 'target_capacity',
                     'draft_capacity'))
