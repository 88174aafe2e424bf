"""The decoder-only model's cache: K-token extends, per-row positions, functional rollback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speclm.models import attention
from speclm.models import llama

TOL = dict(atol=2e-5, rtol=2e-5)


class Jitted:
  """The protocol functions of a definition, each under jax.jit (eager Flax is slow on CPU)."""

  def __init__(self, definition):
    self.definition = definition
    self.init_cache = definition.init_cache
    self.rollback = definition.rollback
    self.forward = jax.jit(definition.forward)
    self.prefill = jax.jit(definition.prefill)
    self.extend = jax.jit(definition.extend)


@pytest.fixture(scope='module')
def model():
  return llama.random_model(vocab_size=40, embed_dim=32, num_layers=2, seed=3,
                            num_heads=4, num_kv_heads=2)


@pytest.fixture(scope='module')
def d(model):
  return Jitted(model.definition)


def test_extend_k_tokens_equals_single_steps_and_full_forward(model, d):
  params = model.params
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, 40)
  full = d.forward(params, tokens)  # teacher-forced, no prefill

  cache = d.init_cache(2, 16)
  logits, cache = d.prefill(params, tokens[:, :5], jnp.array([5, 5]), cache)
  np.testing.assert_allclose(logits, full[:, 4], **TOL)

  # One extend of K = 4 ...
  chunk, chunk_cache = d.extend(params, tokens[:, 5:9], cache)
  np.testing.assert_allclose(chunk, full[:, 5:9], **TOL)
  # ... equals 4 single-token extends.
  steps, step_cache = [], cache
  for k in range(5, 9):
    out, step_cache = d.extend(params, tokens[:, k:k + 1], step_cache)
    steps.append(out)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), chunk, **TOL)
  np.testing.assert_array_equal(chunk_cache.lengths, [9, 9])
  np.testing.assert_allclose(step_cache.keys[:, :, :, :9], chunk_cache.keys[:, :, :, :9], **TOL)


def test_rows_with_different_prompt_lengths(model, d):
  params = model.params
  rng = np.random.RandomState(0)
  seqs = [rng.randint(0, 40, size=n) for n in (7, 3, 5)]
  width = 7
  prompts = np.zeros((3, width), np.int32)
  for b, s in enumerate(seqs):
    prompts[b, :len(s)] = s
  lengths = np.array([len(s) for s in seqs])
  cache = d.init_cache(3, 12)
  logits, cache = d.prefill(params, prompts, lengths, cache)
  new = rng.randint(0, 40, size=(3, 3))
  ext, cache = d.extend(params, new, cache)
  for b, s in enumerate(seqs):
    alone = d.forward(params, np.concatenate([s, new[b]])[None])[0]
    np.testing.assert_allclose(logits[b], alone[len(s) - 1], **TOL)
    np.testing.assert_allclose(ext[b], alone[len(s):], **TOL)
  np.testing.assert_array_equal(cache.lengths, lengths + 3)


def test_rollback_masks_rejected_entries(model):
  """Writing garbage, rolling back and writing the real tokens equals never writing garbage."""
  d, params = model.definition, model.params
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 40)
  cache = d.init_cache(2, 12)
  _, cache = d.prefill(params, tokens[:, :4], jnp.array([4, 4]), cache)
  garbage = jax.random.randint(jax.random.key(2), (2, 4), 0, 40)
  _, dirty = d.extend(params, garbage, cache)
  # Row 0 keeps one garbage token (accepted), row 1 none.
  dirty = d.rollback(dirty, jnp.array([5, 4]))
  row0 = jnp.concatenate([tokens[:1, :4], garbage[:1, :1], tokens[:1, 4:7]], axis=1)
  row1 = tokens[1:, :7]
  logits, _ = d.extend(params, jnp.stack([row0[0, 5:8], row1[0, 4:7]]), dirty)
  np.testing.assert_allclose(logits[0], d.forward(params, row0)[0, 5:8], **TOL)
  np.testing.assert_allclose(logits[1], d.forward(params, row1)[0, 4:7], **TOL)


def test_extend_is_the_same_under_jit(model, d):
  params = model.params
  tokens = jax.random.randint(jax.random.key(4), (2, 6), 0, 40)
  cache = d.init_cache(2, 8)
  eager, _ = model.definition.extend(params, tokens, cache)
  jitted, _ = d.extend(params, tokens, cache)
  np.testing.assert_allclose(eager, jitted, **TOL)


def test_untied_head_and_bfloat16_params():
  model = llama.random_model(vocab_size=30, embed_dim=16, num_layers=1, tie_embeddings=False,
                             dtype='bfloat16')
  assert 'lm_head' in model.params
  assert model.params['layers_0']['mlp']['up']['kernel'].dtype == jnp.bfloat16
  logits = jax.jit(model.definition.forward)(model.params, jnp.zeros((1, 3), jnp.int32))
  assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


def test_validate_params_names_the_parameter(model):
  bad = jax.tree_util.tree_map(lambda x: x, model.params)
  bad['layers_1']['mlp']['up']['kernel'] = jnp.zeros((3, 3))
  with pytest.raises(ValueError, match=r"layers_1.*mlp.*up.*kernel.*\(3, 3\).*\(32, 64\)"):
    model.definition.validate_params(bad)


def test_rope_scaling_frequencies():
  base = llama.LlamaConfig(vocab_size=8, num_layers=1, embed_dim=16, num_heads=2,
                           num_kv_heads=1, head_dim=64, mlp_dim=8, rope_theta=500_000.0)
  plain = llama.rope_frequencies(base)
  linear = llama.rope_frequencies(
      llama.LlamaConfig(**{**base.__dict__, 'rope_scaling': llama.RopeScaling('linear', 4.0)}))
  np.testing.assert_allclose(linear, plain / 4, rtol=1e-6)
  scaled = llama.rope_frequencies(llama.LlamaConfig(**{**base.__dict__,
                                                       'rope_scaling': llama.RopeScaling()}))
  # High frequencies (short wavelengths) are kept, the lowest are divided by the factor.
  assert scaled[0] == pytest.approx(plain[0])
  assert scaled[-1] == pytest.approx(plain[-1] / 8, rel=1e-5)


def test_first_layers_is_the_model_stopped_early(model):
  """`llama.first_layers(model, 1)`: the embedding, layer 0, the final norm and the head; its
  logits are those of a 1-layer Llama given exactly those parameters; no other layer is kept."""
  cut = llama.first_layers(model, 1)
  assert cut.definition.config.num_layers == 1
  assert sorted(cut.params) == sorted(k for k in model.params if k != 'layers_1')
  tokens = jnp.array([[3, 1, 4, 1, 5]])
  one_layer = llama.Llama(cut.definition.config)
  np.testing.assert_array_equal(jax.jit(cut.definition.forward)(cut.params, tokens),
                                jax.jit(one_layer.forward)(dict(cut.params), tokens))
  assert not np.allclose(jax.jit(model.definition.forward)(model.params, tokens),
                         jax.jit(cut.definition.forward)(cut.params, tokens))
  with pytest.raises(ValueError, match='1..2'):
    llama.first_layers(model, 3)


@pytest.mark.parametrize('family', ['llama', 'gemma2', 'gemma3'])
def test_a_prompt_attends_in_tiles_as_over_the_whole_cache(family, monkeypatch):
  """`prefill` attends among the prompt's own tokens in tiles (at most
  `attention.PROMPT_BLOCK`, 3 here: four tiles of 3 for 11 tokens, one padded); logits and cache
  equal one K-token `extend` into an empty cache, which attends over every slot, for padded
  rows, soft-capped scores (Gemma 2) and a sliding window (4, Gemma 2 and 3) shorter than the
  prompt, which skips whole key tiles."""
  monkeypatch.setattr(attention, 'PROMPT_BLOCK', 3)
  extra = dict(sliding_window=4, layer_types=('sliding', 'full')) if family != 'llama' else {}
  if family == 'gemma2':
    extra['attn_logit_softcap'] = 0.5  # small enough to change the scores
  model = llama.random_model(vocab_size=40, embed_dim=32, num_layers=2, seed=5, num_heads=4,
                             num_kv_heads=2, family=family, **extra)
  d, params = model.definition, model.params
  prompts = np.random.RandomState(1).randint(0, 40, size=(2, 11)).astype(np.int32)
  lengths = jnp.array([11, 6])
  blocked, cache = jax.jit(lambda *a: d.prefill(*a))(params, prompts, lengths,
                                                   d.init_cache(2, 16))
  whole, whole_cache = jax.jit(lambda *a: d.extend(*a))(params, prompts, d.init_cache(2, 16))
  for b, n in enumerate(np.asarray(lengths)):
    np.testing.assert_allclose(blocked[b], whole[b, n - 1], **TOL)
    np.testing.assert_allclose(cache.keys[:, b, :, :n], whole_cache.keys[:, b, :, :n], **TOL)
    np.testing.assert_allclose(cache.values[:, b, :, :n], whole_cache.values[:, b, :, :n], **TOL)
  np.testing.assert_array_equal(cache.lengths, lengths)


@pytest.mark.parametrize('batch', [3, 10])  # per-row updates up to 8 rows, one scatter above
def test_a_cache_write_puts_each_rows_entries_at_its_own_offset(batch):
  rng = np.random.default_rng(batch)
  layers, kv_heads, length, head_dim, count = 3, 2, 16, 4, 3
  cache = rng.standard_normal((layers, batch, kv_heads, length, head_dim)).astype(np.float32)
  new = rng.standard_normal((batch, kv_heads, count, head_dim)).astype(np.float32)
  starts = rng.integers(0, length - count, batch).astype(np.int32)
  want = cache.copy()
  for b, start in enumerate(starts):
    want[1, b, :, start:start + count] = new[b]
  got = jax.jit(attention.write_cache, static_argnums=1)(jnp.asarray(cache), 1, jnp.asarray(new),
                                                       jnp.asarray(starts))
  np.testing.assert_array_equal(np.asarray(got), want)
