"""speclm.kernels.cpu_matmul, llama.pack_for_cpu and t5.pack_for_cpu: accurate,
row-independent, used."""

import jax
import numpy as np
import pytest

import speclm
from speclm.kernels import cpu_matmul
from speclm.models import llama
from speclm.models import t5

pytestmark = pytest.mark.skipif(not cpu_matmul.available(),
                                reason='the CPU kernel could not be built here')


@pytest.mark.parametrize('rows,inputs,outputs', [(1, 576, 1536), (4, 576, 192), (5, 64, 8193),
                                                 (8, 1536, 576), (13, 33, 70), (20, 7, 64)])
def test_matmul_matches_a_float64_product(rows, inputs, outputs):
  rng = np.random.default_rng(rows)
  x = rng.standard_normal((rows, inputs)).astype(np.float32)
  w = rng.standard_normal((inputs, outputs)).astype(np.float32)
  y = np.asarray(jax.jit(cpu_matmul.matmul, static_argnums=2)(x, cpu_matmul.pack(w), outputs))
  exact = x.astype(np.float64) @ w.astype(np.float64)
  xla_error = np.abs(np.asarray(jax.numpy.dot(x, w)) - exact).max()
  assert y.shape == (rows, outputs)
  # Blocked summation into a float64 total: no less accurate than XLA's own product.
  assert np.abs(y - exact).max() <= xla_error + 1e-7 * np.abs(exact).max()


def test_long_sums_of_large_terms_round_less_than_xlas():
  """A few huge inputs (as SmolLM2's massive activations): the float64 total pays off.

  Five seeds measured the kernel's max error at 0.14-0.32 of XLA's float32 running sum.
  """
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 1536)).astype(np.float32)
  x[:, :8] *= 300
  w = rng.standard_normal((1536, 576)).astype(np.float32)
  exact = x.astype(np.float64) @ w.astype(np.float64)
  y = np.asarray(jax.jit(cpu_matmul.matmul, static_argnums=2)(x, cpu_matmul.pack(w), 576))
  xla_error = np.abs(np.asarray(jax.numpy.dot(x, w)) - exact).max()
  assert np.abs(y - exact).max() < 0.5 * xla_error


def test_a_rows_result_does_not_depend_on_the_other_rows():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((11, 96)).astype(np.float32)
  packed = cpu_matmul.pack(rng.standard_normal((96, 130)).astype(np.float32))
  matmul = jax.jit(cpu_matmul.matmul, static_argnums=2)
  whole = np.asarray(matmul(x, packed, 130))
  for r in (0, 7, 10):
    np.testing.assert_array_equal(np.asarray(matmul(x[r:r + 1], packed, 130))[0], whole[r])
    np.testing.assert_array_equal(np.asarray(matmul(x[r:r + 3], packed, 130))[0], whole[r])


@pytest.mark.parametrize('rows', [1, 3, 8, 13])
def test_bfloat16_panels_give_the_float32_kernels_sums_bit_for_bit(rows):
  """Weights that are bfloat16 values: half the bytes, the very same result."""
  rng = np.random.default_rng(rows)
  x = rng.standard_normal((rows, 200)).astype(np.float32)
  w = rng.standard_normal((200, 150)).astype(jax.numpy.bfloat16).astype(np.float32)
  matmul = jax.jit(cpu_matmul.matmul, static_argnums=2)
  packed = cpu_matmul.pack(w, 'bfloat16')
  assert packed.dtype == jax.numpy.bfloat16 and packed.nbytes == cpu_matmul.pack(w).nbytes // 2
  np.testing.assert_array_equal(np.asarray(matmul(x, packed, 150)),
                                np.asarray(matmul(x, cpu_matmul.pack(w), 150)))
  exact = x.astype(np.float64) @ w.astype(np.float64)
  assert np.abs(np.asarray(matmul(x, packed, 150)) - exact).max() < 1e-4


def test_auto_packs_bfloat16_only_where_it_is_lossless():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((40, 70)).astype(np.float32)
  assert not cpu_matmul.bfloat16_exact(w)
  assert cpu_matmul.pack(w, 'auto').dtype == np.float32
  rounded = w.astype(jax.numpy.bfloat16).astype(np.float32)
  assert cpu_matmul.bfloat16_exact(rounded)
  assert cpu_matmul.pack(rounded, 'auto').dtype == jax.numpy.bfloat16
  # Rounding on request: the panels hold the rounded weights.
  np.testing.assert_array_equal(
      np.asarray(cpu_matmul.pack(w, 'bfloat16'), np.float32)[0, :, :], rounded[:, :64])
  with pytest.raises(ValueError, match='dtype'):
    cpu_matmul.pack(w, 'float16')


def test_pack_layout_and_errors():
  w = np.arange(6 * 70, dtype=np.float32).reshape(6, 70)
  packed = cpu_matmul.pack(w)
  assert packed.shape == (2, 6, 64)
  np.testing.assert_array_equal(packed[1, :, :6], w[:, 64:])
  assert not packed[1, :, 6:].any()  # zero padding
  with pytest.raises(ValueError, match='2-D'):
    cpu_matmul.pack(np.zeros((2, 3, 4), np.float32))
  with pytest.raises(TypeError, match='float32'):
    cpu_matmul.matmul(jax.numpy.zeros((2, 6), jax.numpy.bfloat16), packed, 70)
  with pytest.raises(TypeError, match='float32'):
    cpu_matmul.matmul(jax.numpy.zeros((2, 6)), packed.astype(np.float16), 70)


def _models():
  target = llama.random_model(vocab_size=200, embed_dim=64, num_layers=2, seed=0, mlp_dim=128)
  draft = llama.random_model(vocab_size=200, embed_dim=64, num_layers=1, seed=1, mlp_dim=128)
  return target, draft


def test_packed_model_uses_the_kernel_for_every_row_count():
  target, _ = _models()
  packed = llama.pack_for_cpu(target)
  assert packed.params['layers_0']['attention']['out']['packed'].shape == (1, 64, 64)
  assert packed.params['lm_head']['packed'].shape == (4, 64, 64)  # head untied, 200 -> 256

  def uses_kernel(length):
    tokens = np.zeros((1, length), np.int32)
    jaxpr = jax.make_jaxpr(packed.definition.forward)(packed.params, tokens)
    return cpu_matmul.TARGET_NAME in str(jaxpr)

  assert all(uses_kernel(length) for length in (1, 2, 16, 17, 64))
  tokens = np.zeros((1, 3), np.int32)
  assert cpu_matmul.TARGET_NAME not in str(
      jax.make_jaxpr(target.definition.forward)(target.params, tokens))  # plain: XLA's dots


def test_a_model_stored_in_bfloat16_is_packed_in_bfloat16_with_the_same_logits():
  _, draft = _models()
  rounded = jax.tree.map(lambda a: a.astype(jax.numpy.bfloat16).astype(np.float32),
                         dict(draft.params))
  draft = speclm.protocol.Model(draft.definition, rounded)
  packed = llama.pack_for_cpu(draft)
  assert packed.params['layers_0']['mlp']['gate']['packed'].dtype == jax.numpy.bfloat16
  tokens = np.array([[5, 6, 7, 8, 9]], np.int32)
  np.testing.assert_allclose(packed.definition.forward(packed.params, tokens),
                             draft.definition.forward(draft.params, tokens), atol=1e-5)


def test_packed_model_gives_the_same_logits_and_exact_speculative_decoding():
  target, draft = _models()
  packed_target, packed_draft = llama.pack_for_cpu(target), llama.pack_for_cpu(draft)
  tokens = np.array([[5, 6, 7, 8, 9], [9, 10, 11, 12, 13]], np.int32)
  np.testing.assert_allclose(packed_target.definition.forward(packed_target.params, tokens),
                             target.definition.forward(target.params, tokens), atol=1e-5)
  prompts = np.array([[5, 6, 7, 8], [9, 10, 0, 0]], np.int32)
  lengths = np.array([4, 2], np.int32)
  base = speclm.autoregressive_decode(packed_target, prompts, lengths, max_new_tokens=24)
  spec = speclm.speculative_decode(packed_target, packed_draft, prompts, lengths, gamma=4,
                                   max_new_tokens=24)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  plain = speclm.autoregressive_decode(target, prompts, lengths, max_new_tokens=24)
  np.testing.assert_array_equal(base.tokens, plain.tokens)


def _t5_models():
  target = t5.random_model(vocab_size=200, emb_dim=64, num_layers=2, num_heads=4, seed=0)
  draft = t5.random_model(vocab_size=200, emb_dim=64, num_layers=1, num_heads=4, seed=1)
  return target, draft


def test_packed_t5_uses_the_kernel_with_the_same_logits_and_exact_speculative_decoding():
  target, draft = _t5_models()
  packed_target, packed_draft = t5.pack_for_cpu(target), t5.pack_for_cpu(draft)
  decoder = packed_target.params['decoder']
  assert decoder['layers_0']['self_attention']['out']['packed'].shape == (1, 64, 64)  # [64, 64]
  assert decoder['logits_dense']['packed'].shape == (4, 64, 64)  # 200 -> 256 columns
  inputs = np.array([[5, 6, 7, 8, 1], [9, 10, 1, 0, 0]], np.int32)
  lengths = np.array([5, 3], np.int32)
  decoder_tokens = np.array([[0, 4, 5, 6], [0, 7, 8, 9]], np.int32)
  forward = packed_target.definition.forward
  assert cpu_matmul.TARGET_NAME in str(jax.make_jaxpr(forward)(
      packed_target.params, inputs, lengths, decoder_tokens))
  np.testing.assert_allclose(forward(packed_target.params, inputs, lengths, decoder_tokens),
                             forward(target.params, inputs, lengths, decoder_tokens), atol=1e-5)
  base = speclm.autoregressive_decode(packed_target, inputs, lengths, max_new_tokens=24,
                                      eos_id=None)
  spec = speclm.speculative_decode(packed_target, packed_draft, inputs, lengths, gamma=4,
                                   max_new_tokens=24, eos_id=None)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  plain = speclm.autoregressive_decode(target, inputs, lengths, max_new_tokens=24, eos_id=None)
  np.testing.assert_array_equal(base.tokens, plain.tokens)


def test_t5_pack_for_cpu_leaves_other_dtypes_alone():
  model = t5.random_model(vocab_size=64, emb_dim=16, dtype='bfloat16')
  assert t5.pack_for_cpu(model) is model
