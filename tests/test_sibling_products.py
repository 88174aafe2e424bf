"""Several quantized matrices over one input in one kernel call (`quantized.matmul_many`,
`projections.sibling_products`): each product is bit for bit the one its own call gives, a
layer's query/key/value and gate/up take one call each, and whatever cannot (float kernels,
mixed formats, Qwen2's biases) keeps its own calls."""

import numpy as np
import pytest

gguf = pytest.importorskip('gguf')

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

from speclm.kernels import quantized  # pylint: disable=g-import-not-at-top
from speclm.models import llama  # pylint: disable=g-import-not-at-top
from speclm.models import projections  # pylint: disable=g-import-not-at-top
from speclm.testing.gguf_blocks import random_rows  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.skipif(not quantized.available(), reason='CPU kernel unavailable')
needs_interleaving = pytest.mark.skipif(not quantized.interleaving(),
                                        reason='interleaved rows need the integer route')
MANY = 'quantized_matmul_many'  # in the name of every `matmul_many` target


def held(fmt: str, n: int, k: int, seed: int):
  name, rows = quantized.loaded(fmt, random_rows(fmt, n, k, seed=seed))
  return name, jnp.asarray(rows)


@needs_interleaving
@pytest.mark.parametrize('fmt', sorted(quantized.FORMATS))
def test_one_call_gives_each_matrix_its_own_numbers(fmt):
  k = 512
  names, mats = zip(*(held(fmt, n, k, seed) for n, seed in ((48, 1), (16, 2), (32, 3))))
  x = np.random.default_rng(4).standard_normal((17, k)).astype(np.float32)
  x[3] = 0.0  # an all-zero row is skipped (zero_rows.h) in every output alike
  many = jax.jit(quantized.matmul_many, static_argnums=2)
  one = jax.jit(quantized.matmul, static_argnums=2)
  for m in (1, 2, 5, 17):
    got = many(jnp.asarray(x[:m]), list(mats), names[0])
    assert [g.shape for g in got] == [(m, 48), (m, 16), (m, 32)]
    for i, (g, w) in enumerate(zip(got, mats)):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(one(jnp.asarray(x[:m]), w,
                                                                  names[0])),
                                    err_msg=f'{m} rows, matrix {i}')


@needs_interleaving
def test_every_task_runs_once_however_the_threads_share_them():
  """101 groups of 16 rows, called 40 times in a row (the helper thread lingers between
  calls, takes its own range and steals halves): every call gives the same numbers, and they
  are the dequantized product's."""
  name, rows = held('Q4_1', 16 * 101, 256, seed=5)
  x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 256)).astype(np.float32))

  def calls(x):
    return jax.lax.map(lambda i: quantized.matmul(x * (1.0 + 0.0 * i), rows, name),
                       jnp.arange(40.0))

  ys = np.asarray(jax.jit(calls)(x))
  for y in ys[1:]:
    np.testing.assert_array_equal(y, ys[0])
  w = np.asarray(quantized.dequantize(rows, name), np.float64)
  np.testing.assert_allclose(ys[0], np.asarray(x, np.float64) @ w.T, rtol=1e-5, atol=1e-5)


@needs_interleaving
def test_matmul_many_refuses_what_it_does_not_take():
  name, a = held('Q8_0', 16, 64, seed=1)
  _, b = held('Q8_0', 16, 128, seed=2)
  x = jnp.ones((1, 64))
  with pytest.raises(ValueError, match='interleaved rows'):
    quantized.matmul_many(x, [jnp.asarray(random_rows('Q8_0', 16, 64))], 'Q8_0')
  with pytest.raises(ValueError, match='1 to 4 matrices'):
    quantized.matmul_many(x, [a] * 5, name)
  with pytest.raises(ValueError, match='same row bytes'):
    quantized.matmul_many(x, [a, b], name)
  with pytest.raises(ValueError, match=r'x must be \[M, 64\]'):
    quantized.matmul_many(jnp.ones((1, 32)), [a], name)


def test_products_take_one_call_each_where_rows_are_not_interleaved():
  mats = [jnp.asarray(random_rows('Q4_0', 40, 64, seed=s)) for s in (1, 2)]  # 40: not 16s
  x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32))
  jaxpr = str(jax.make_jaxpr(lambda x: quantized.products(x, mats, 'Q4_0'))(x))
  assert 'matmul_many' not in jaxpr
  for got, w in zip(quantized.products(x, mats, 'Q4_0'), mats):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(quantized.matmul(x, w, 'Q4_0')))


def stored_model(formats, family='llama'):
  """A 2-layer model of width 64 whose seven matrices per layer hold GGUF rows (interleaved
  where the route reads them); `formats` maps a matrix name to its format (else Q8_0)."""
  model = llama.random_model(vocab_size=64, embed_dim=64, num_layers=2, num_heads=2,
                             num_kv_heads=1, head_dim=32, mlp_dim=64, seed=3, family=family)
  params = jax.tree_util.tree_map(lambda a: a, model.params)
  outputs = {'query': 64, 'key': 32, 'value': 32, 'out': 64, 'gate': 64, 'up': 64, 'down': 64}
  for i in range(2):
    layer = params[f'layers_{i}']
    for seed, (name, n) in enumerate(outputs.items()):
      fmt = formats.get(name, 'Q8_0')
      group = layer['mlp'] if name in ('gate', 'up', 'down') else layer['attention']
      kept = {key: value for key, value in group[name].items() if key == 'bias'}
      stored_name, rows = held(fmt, n, 64, seed=10 * i + seed)
      group[name] = {stored_name: rows, **kept}
  model.definition.validate_params(params)
  return model.definition, params


def logits_and_calls(definition, params):
  tokens = jnp.asarray([[1, 5, 9], [2, 7, 4]], jnp.int32)
  cache = definition.init_cache(2, 8)
  extend = jax.jit(definition.extend)
  jaxpr = str(jax.make_jaxpr(definition.extend)(params, tokens, cache))
  return np.asarray(extend(params, tokens, cache)[0]), jaxpr.count(MANY)


@needs_interleaving
def test_a_layer_multiplies_its_siblings_in_one_call_with_the_same_numbers(monkeypatch):
  definition, params = stored_model({})
  logits, calls = logits_and_calls(definition, params)
  assert calls == 2 * 2  # query/key/value and gate/up, in each of the two layers
  monkeypatch.setattr(projections, 'shared_stored_format', lambda *args: None)
  apart, calls_apart = logits_and_calls(definition, params)
  assert calls_apart == 0
  np.testing.assert_array_equal(logits, apart)


@needs_interleaving
def test_mixed_formats_and_biases_keep_their_own_calls():
  """A Q4_K_M-style file stores some matrices in another format (here the value projection
  and the up projection): those layers' siblings are multiplied one by one. Qwen2's biased
  query/key/value likewise; its gate and up still share a call."""
  definition, params = stored_model({'value': 'Q4_0', 'up': 'Q4_1'})
  assert logits_and_calls(definition, params)[1] == 0
  definition, params = stored_model({}, family='qwen2')
  logits, calls = logits_and_calls(definition, params)
  assert calls == 2 and np.all(np.isfinite(logits))
