"""speclm.kernels.prompt_attention: a prompt's causal attention among its own tokens, one call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speclm.kernels import cpu_matmul
from speclm.kernels import prompt_attention
from speclm.models import attention
from speclm.models import llama

pytestmark = pytest.mark.skipif(not cpu_matmul.available(), reason='no CPU kernel here')


def _inputs(batch, length, kv_heads, groups, head_dim, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, length, kv_heads, groups, head_dim)).astype(np.float32)
  keys = rng.standard_normal((batch, kv_heads, length, head_dim)).astype(np.float32)
  values = rng.standard_normal((batch, kv_heads, length, head_dim)).astype(np.float32)
  return q, keys, values


def _float64_reference(q, keys, values, scale):
  """Causal softmax attention in float64, query by query."""
  q, keys, values = (np.asarray(a, np.float64) for a in (q, keys, values))
  scores = np.einsum('bknge,bnle->bkngl', q, keys) * scale
  length = q.shape[1]
  causal = np.arange(length)[None, :] <= np.arange(length)[:, None]  # [K, L]
  scores = np.where(causal[None, :, None, None, :], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum('bkngl,bnle->bknge', weights, values)


# Lengths around the 16-key blocks and 16-query tasks; head widths of 1, 4, 5, 8 and 16
# chunks (each compiles its own register layout); grouped heads and batches.
@pytest.mark.parametrize('batch,length,kv_heads,groups,head_dim', [
    (1, 1, 1, 1, 16), (1, 5, 3, 3, 64), (2, 17, 2, 4, 32), (1, 100, 3, 3, 64),
    (1, 33, 2, 1, 80), (1, 70, 2, 2, 128), (1, 40, 1, 2, 256)])
def test_equals_float64_attention_and_xla_tiles(batch, length, kv_heads, groups, head_dim):
  q, keys, values = _inputs(batch, length, kv_heads, groups, head_dim)
  scale = head_dim ** -0.5
  got = np.asarray(prompt_attention.attend(q, keys, values, scale=scale))
  np.testing.assert_allclose(got, _float64_reference(q, keys, values, scale), atol=2e-6,
                             rtol=1e-5)
  tiles = attention.prompt_attention(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values),
                                     scale=scale, cap=None, window=None, dtype=jnp.float32)
  np.testing.assert_allclose(got, np.asarray(tiles), atol=3e-6, rtol=1e-5)


def test_a_prompt_gets_the_numbers_of_any_longer_prompt_it_begins():
  """A query's sums do not depend on the prompt's length, the batch or its row's neighbours:
  key blocks from position 0 in order, unseen keys adding exactly 0."""
  q, keys, values = _inputs(2, 75, 2, 3, 64, seed=1)
  whole = np.asarray(prompt_attention.attend(q, keys, values, scale=0.125))
  for length in (1, 16, 17, 40):
    part = prompt_attention.attend(q[:, :length], keys[:, :, :length], values[:, :, :length],
                                   scale=0.125)
    np.testing.assert_array_equal(np.asarray(part), whole[:, :length])
  alone = prompt_attention.attend(q[1:], keys[1:], values[1:], scale=0.125)
  np.testing.assert_array_equal(np.asarray(alone), whole[1:])


def test_bad_shapes_say_what_is_expected():
  q, keys, values = _inputs(1, 8, 2, 2, 32)
  with pytest.raises(Exception, match='prompt_attention: expects'):
    jax.block_until_ready(prompt_attention.attend(q, keys[:, :, :7], values[:, :, :7],
                                                  scale=1.0))


def test_what_the_kernel_does_not_take_stays_with_xla():
  assert prompt_attention.serves(64, jnp.float32, cap=None, window=None)
  assert prompt_attention.serves(256, jnp.float32, cap=None, window=None)
  assert not prompt_attention.serves(8, jnp.float32, cap=None, window=None)
  assert not prompt_attention.serves(272, jnp.float32, cap=None, window=None)
  assert not prompt_attention.serves(64, jnp.bfloat16, cap=None, window=None)
  assert not prompt_attention.serves(64, jnp.float32, cap=50.0, window=None)  # Gemma 2
  assert not prompt_attention.serves(64, jnp.float32, cap=None, window=4096)  # sliding


def _prefill(model, tokens, lengths):
  definition = model.definition
  cache = definition.init_cache(tokens.shape[0], 48)
  logits, cache = jax.jit(definition.prefill)(model.params, tokens, lengths, cache)
  jaxpr = jax.make_jaxpr(definition.prefill)(model.params, tokens, lengths, cache)
  return logits, cache, str(jaxpr)


def test_packed_prompts_attend_through_the_kernel_and_match_the_plain_model():
  target = llama.random_model(vocab_size=120, embed_dim=64, num_layers=2, seed=4, mlp_dim=128,
                              num_heads=4, num_kv_heads=2)
  packed = llama.pack_for_cpu(target)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 120, (2, 37)), jnp.int32)
  lengths = jnp.asarray([37, 20], jnp.int32)
  got, got_cache, jaxpr = _prefill(packed, tokens, lengths)
  want, want_cache, plain_jaxpr = _prefill(target, tokens, lengths)
  assert cpu_matmul.PROMPT_ATTENTION_TARGET in jaxpr
  assert cpu_matmul.PROMPT_ATTENTION_TARGET not in plain_jaxpr
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  np.testing.assert_allclose(np.asarray(got_cache.keys), np.asarray(want_cache.keys), atol=1e-5)
  # A model with a sliding window keeps XLA's tiles for its prompts.
  windowed = llama.pack_for_cpu(llama.random_model(
      vocab_size=120, embed_dim=64, num_layers=2, seed=4, mlp_dim=128, num_heads=4,
      num_kv_heads=2, sliding_window=8))
  assert cpu_matmul.PROMPT_ATTENTION_TARGET not in _prefill(windowed, tokens, lengths)[2]
