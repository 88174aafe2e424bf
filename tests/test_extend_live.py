"""`extend_live`: a verification call told which positions it needs, and the adaptive loop's
single-width verification built on it (docs/performance.md, change 16)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import adaptive
from speclm import protocol
from speclm.kernels import cpu_matmul
from speclm.models import llama

needs_kernel = pytest.mark.skipif(not cpu_matmul.available(), reason='no CPU kernel here')


def _models(**switches):
  target = llama.random_model(vocab_size=200, embed_dim=64, num_layers=2, seed=0, mlp_dim=128,
                              **switches)
  draft = llama.random_model(vocab_size=200, embed_dim=64, num_layers=1, seed=1, mlp_dim=128)
  return target, draft


def _after_prompt(model, prompts, lengths, capacity=24):
  definition = model.definition
  cache = definition.init_cache(prompts.shape[0], capacity)
  return definition.prefill(model.params, jnp.asarray(prompts), jnp.asarray(lengths), cache)[1]


@needs_kernel
@pytest.mark.parametrize('switches', [{}, {'family': 'qwen2'}, {'family': 'gemma2'}])
def test_live_positions_get_extends_numbers_bit_for_bit(switches):
  """On the CPU kernels the positions past `num_live` are held at zero and skipped; the others
  (logits and cache entries) are those of `extend`, and of a call of the live ones alone."""
  target = llama.pack_for_cpu(_models(**switches)[0])
  definition, params = target.definition, target.params
  assert definition.skips_dead_positions(params, (2, 5))
  assert not definition.skips_dead_positions(params, (4, 5))  # 20 rows: XLA's products
  prompts, lengths = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], np.int32), np.array([4, 2])
  cache = _after_prompt(target, prompts, lengths)
  tokens = jnp.asarray([[11, 12, 13, 14, 15], [16, 17, 18, 19, 20]], jnp.int32)
  full, full_cache = jax.jit(definition.extend)(params, tokens, cache)
  live = jax.jit(definition.extend_live)
  for n in (1, 3, 5):
    logits, live_cache = live(params, tokens, cache, jnp.int32(n))
    alone, alone_cache = jax.jit(definition.extend)(params, tokens[:, :n], cache)
    np.testing.assert_array_equal(np.asarray(logits)[:, :n], np.asarray(full)[:, :n])
    np.testing.assert_array_equal(np.asarray(logits)[:, :n], np.asarray(alone))
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_array_equal(np.asarray(live_cache.lengths), lengths + 5)
    for row, length in enumerate(lengths):
      kept = slice(length, length + n)
      for field in ('keys', 'values'):
        np.testing.assert_array_equal(
            np.asarray(getattr(live_cache, field))[:, row, :, kept],
            np.asarray(getattr(alone_cache, field))[:, row, :, kept])
    np.testing.assert_array_equal(
        np.asarray(live_cache.keys)[:, 0, :, :4], np.asarray(full_cache.keys)[:, 0, :, :4])


def test_models_off_the_kernels_compute_every_position():
  """Without the CPU kernels nothing is skipped: the protocol's default is `extend` itself,
  and Llama's live positions still equal it (to float rounding: XLA's products)."""
  target, draft = _models()
  assert not target.definition.skips_dead_positions(target.params, (1, 5))
  assert not protocol.LanguageModel.skips_dead_positions(draft.definition, draft.params, (1, 5))
  prompts, lengths = np.array([[5, 6, 7, 8]], np.int32), np.array([4])
  cache = _after_prompt(target, prompts, lengths)
  tokens = jnp.asarray([[11, 12, 13, 14, 15]], jnp.int32)
  full, _ = target.definition.extend(target.params, tokens, cache)
  logits, _ = target.definition.extend_live(target.params, tokens, cache, jnp.int32(2))
  np.testing.assert_allclose(np.asarray(logits)[:, :2], np.asarray(full)[:, :2], atol=1e-5)
  default, _ = protocol.LanguageModel.extend_live(target.definition, target.params, tokens,
                                                  cache, jnp.int32(2))
  np.testing.assert_array_equal(np.asarray(default), np.asarray(full))


def _rule():
  return adaptive.AdaptiveGamma(max_gamma=4, draft_cost=0.05,
                                verify_costs=(1.0, 1.02, 1.04, 1.06, 1.08))


@needs_kernel
@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_adaptive_rounds_verify_at_one_width_with_the_branchs_draws(temperature, monkeypatch):
  """A packed target verifies every adaptive round at the width γ_max + 1 (`extend_live`):
  greedy output equals the baseline's, and at T = 1 every draw equals that of the loop that
  verifies at the width k + 1 in each branch (the same numbers, the same random keys)."""
  target, draft = (llama.pack_for_cpu(m) for m in _models())
  prompts = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], np.int32)
  lengths = np.array([4, 2], np.int32)
  kwargs = dict(max_new_tokens=20, sampling=speclm.SamplingConfig(temperature=temperature),
                seed=3, baseline_if_never_drafting=False)
  calls = []
  real = llama.Llama.extend_live
  monkeypatch.setattr(llama.Llama, 'extend_live',
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  one_width = speclm.speculative_decode(target, draft, prompts, lengths, gamma=_rule(), **kwargs)
  assert calls, 'the adaptive loop did not verify through extend_live'
  assert int(one_width.stats.beta_count) > 0  # the rounds drafted
  monkeypatch.setattr(llama.Llama, 'skips_dead_positions', lambda *args: False)
  jax.clear_caches()  # trace the loop again: verification in the branches
  calls.clear()
  branches = speclm.speculative_decode(target, draft, prompts, lengths, gamma=_rule(), **kwargs)
  assert not calls
  np.testing.assert_array_equal(one_width.tokens, branches.tokens)
  np.testing.assert_array_equal(one_width.stats.accepted_histogram,
                                branches.stats.accepted_histogram)
  if temperature == 0.0:
    base = speclm.autoregressive_decode(target, prompts, lengths, max_new_tokens=20)
    np.testing.assert_array_equal(one_width.tokens, base.tokens)
