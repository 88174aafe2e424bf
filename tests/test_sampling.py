"""Standardized sampling (paper §2.2) against a plain NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from speclm import sampling
from speclm import testing


def reference_standardize(logits: np.ndarray, temperature: float, top_k: int,
                          top_p: float) -> np.ndarray:
  """A deliberately simple per-row NumPy implementation of the documented rules."""
  logits = np.asarray(logits, np.float64)
  out = np.zeros_like(logits)
  for idx in np.ndindex(logits.shape[:-1]):
    row = logits[idx]
    if temperature == 0:
      out[idx][np.argmax(row)] = 1.0  # np.argmax returns the first maximum
      continue
    row = row / temperature
    if 0 < top_k < len(row):
      kth = np.sort(row)[::-1][top_k - 1]
      row = np.where(row >= kth, row, -np.inf)
    probs = np.exp(row - row.max())
    probs /= probs.sum()
    if top_p < 1.0:
      order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
      kept, mass = [], 0.0
      for i in order:
        if mass >= top_p:
          break
        kept.append(i)
        mass += probs[i]
      mask = np.zeros(len(probs), bool)
      mask[kept] = True
      probs = np.where(mask, probs, 0.0)
      probs /= probs.sum()
    out[idx] = probs
  return out


SETTINGS = [
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (2.5, 0, 1.0),
    (1.0, 3, 1.0),
    (1.0, 0, 0.8),
    (0.7, 4, 0.9),
    (1.3, 2, 0.5),
    (1.0, 0, 0.05),  # keeps only the top token
    (0.0, 0, 1.0),
    (0.0, 5, 0.3),  # greedy ignores top-k / top-p
]


@pytest.mark.parametrize('temperature,top_k,top_p', SETTINGS)
def test_matches_numpy_reference(temperature, top_k, top_p):
  logits = np.random.RandomState(0).normal(size=(3, 4, 17)) * 2
  config = sampling.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
  got = np.asarray(config.standardize(logits))
  want = reference_standardize(logits, temperature, top_k, top_p)
  np.testing.assert_allclose(got, want, atol=1e-6)
  np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-6)
  assert got.dtype == np.float32


def test_ties_are_deterministic():
  logits = np.array([[1.0, 3.0, 3.0, 0.0, 3.0, -1.0]])
  # Greedy: the lowest id among the maxima.
  np.testing.assert_array_equal(sampling.standardize(logits, sampling.GREEDY)[0],
                                [0, 1, 0, 0, 0, 0])
  # top-k keeps every token tied with the k-th largest logit.
  topk = np.asarray(sampling.standardize(logits, sampling.SamplingConfig(top_k=2)))[0]
  np.testing.assert_allclose(topk, [0, 1 / 3, 1 / 3, 0, 1 / 3, 0], atol=1e-6)
  # top-p cuts ties by id: the first tied token alone reaches 0.3.
  for top_p in (0.3, 0.6, 0.95):
    got = np.asarray(sampling.standardize(logits, sampling.SamplingConfig(top_p=top_p)))
    np.testing.assert_allclose(got, reference_standardize(logits, 1.0, 0, top_p), atol=1e-6)


def test_top_p_one_keeps_every_token():
  logits = np.array([[30.0, 0.0, -30.0, -50.0]])  # tail masses far below float32 epsilon
  probs = np.asarray(sampling.standardize(logits, sampling.SamplingConfig(top_p=1.0)))
  assert np.all(probs > 0)


def test_negative_infinity_logits_become_zero_mass():
  logits = np.array([[0.0, -np.inf, 1.0, -np.inf]])
  for config in (sampling.SamplingConfig(), sampling.SamplingConfig(top_p=0.9, top_k=1)):
    probs = np.asarray(config.standardize(logits))
    assert probs[0, 1] == 0 and probs[0, 3] == 0
    np.testing.assert_allclose(probs.sum(), 1.0, atol=1e-6)


def test_standardize_under_jit_equals_eager():
  logits = np.random.RandomState(1).normal(size=(5, 11))
  config = sampling.SamplingConfig(temperature=0.8, top_k=6, top_p=0.7)
  eager = config.standardize(logits)
  jitted = jax.jit(sampling.standardize, static_argnums=1)(logits, config)
  np.testing.assert_allclose(eager, jitted, atol=1e-7)


def test_sample_never_draws_zero_probability_tokens():
  probs = np.tile(np.array([0.0, 0.5, 0.0, 0.5], np.float32), (4000, 1))
  draws = np.asarray(sampling.sample(jax.random.key(0), probs))
  assert set(np.unique(draws)) == {1, 3}
  one_hot = np.eye(4, dtype=np.float32)[[2] * 50]
  assert np.all(np.asarray(sampling.sample(jax.random.key(1), one_hot)) == 2)


def test_sample_matches_the_distribution_across_blocks():
  """The two-level inverse-CDF sampler against exact probabilities, over a vocabulary that
  spans several blocks and is not a multiple of the block size, with empty blocks and
  unnormalized rows (chi-square goodness of fit)."""
  rng = np.random.default_rng(0)
  vocab = 1000
  probs = rng.gamma(0.3, size=vocab).astype(np.float32)
  probs[300:600] = 0.0  # a whole empty block and parts of two others
  probs[999] = 0.0  # the last id, in the padded last block
  rows = np.tile(probs * 7.0, (20_000, 1))  # row sums of 7, not 1
  draws = np.asarray(sampling.sample(jax.random.key(3), rows))
  assert np.all(probs[draws] > 0)
  assert testing.chi_square_pvalue(draws, probs) > 1e-3


def test_sample_with_mass_in_one_tiny_entry_of_the_last_block():
  probs = np.zeros((64, 49_152), np.float32)
  probs[:, 49_151] = 1e-30  # the only positive entry; cumulative sums round hard around it
  assert np.all(np.asarray(sampling.sample(jax.random.key(4), probs)) == 49_151)


@pytest.mark.parametrize('kwargs,message', [
    (dict(temperature=-0.1), 'temperature'),
    (dict(top_p=0.0), 'top_p'),
    (dict(top_p=1.5), 'top_p'),
    (dict(top_k=-1), 'top_k'),
    (dict(top_k=2.5), 'top_k'),
    (dict(top_k=2.0), 'top_k'),
    (dict(temperature=float('nan')), 'temperature must be a finite number'),
    (dict(temperature=float('inf')), 'temperature must be a finite number'),
    (dict(temperature=np.float32('nan')), 'temperature must be a finite number'),
    (dict(top_p=float('nan')), 'top_p must be a finite number'),
    (dict(top_p=float('inf')), 'top_p must be a finite number'),
    (dict(top_p=np.float64('-inf')), 'top_p must be a finite number'),
    (dict(temperature=True), 'temperature'),
    (dict(top_p=True), 'top_p'),
    (dict(top_k=True), 'top_k'),
    (dict(top_k=np.bool_(True)), 'top_k'),
    (dict(temperature='0.7'), 'temperature'),
    (dict(top_k=np.int64(-1)), 'top_k'),
])
def test_invalid_settings_raise_before_tracing(kwargs, message):
  with pytest.raises(ValueError, match=message):
    sampling.SamplingConfig(**kwargs)


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers():
  config = sampling.SamplingConfig(temperature=np.float32(0.7), top_k=np.int64(5),
                                   top_p=np.float64(0.9))
  assert type(config.temperature) is float and type(config.top_p) is float
  assert type(config.top_k) is int
  # float32(0.7) is not 0.7; the stored value is that float32 value as a Python float.
  assert config == sampling.SamplingConfig(float(np.float32(0.7)), 5, 0.9)
  assert hash(config) == hash(sampling.SamplingConfig(float(np.float32(0.7)), 5, 0.9))
  assert sampling.SamplingConfig(np.float64(0.7)) == sampling.SamplingConfig(0.7)
  assert sampling.SamplingConfig(top_k=np.int32(3)) == sampling.SamplingConfig(top_k=3)
  # Python ints are numbers too, stored as floats where the field is a float.
  assert type(sampling.SamplingConfig(temperature=1, top_p=1).temperature) is float
  assert sampling.SamplingConfig(temperature=np.int64(0)).is_greedy
  # Equal settings are one static argument of jax.jit: no recompilation.
  logits = np.random.RandomState(2).normal(size=(2, 7))
  jitted = jax.jit(sampling.standardize, static_argnums=1)
  jitted(logits, sampling.SamplingConfig(np.float64(0.5)))
  compiled = jitted._cache_size()
  jitted(logits, sampling.SamplingConfig(0.5))
  assert jitted._cache_size() == compiled


def test_top_k_indices_equal_lax_top_k_ties_included():
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.integers(0, 5, size=(2, 3, 40)).astype(np.float32))  # many ties
  for k in (1, 2, 4):
    np.testing.assert_array_equal(np.asarray(sampling.top_k_indices(x, k)),
                                  np.asarray(jax.lax.top_k(x, k)[1]))


def test_greedy_draw_is_the_token_the_one_hot_sample_draws():
  """`draw` at temperature 0 skips the one-hot row and its search: the same token, ties and
  -inf included, eagerly and under jit; a row with a NaN still gets a valid id."""
  rng = np.random.default_rng(4)
  logits = rng.integers(0, 4, size=(3, 5, 9000)).astype(np.float32)  # ties everywhere
  logits[0, 1, :100] = -np.inf
  logits[1, 2] = -np.inf
  logits[1, 2, 8999] = 0.0  # the only finite logit is the last id
  logits = jnp.asarray(logits)
  key = jax.random.key(0)
  expected = sampling.sample(key, sampling.standardize(logits, sampling.GREEDY))
  np.testing.assert_array_equal(np.asarray(expected), np.argmax(np.asarray(logits), axis=-1))
  for draw in (sampling.draw, jax.jit(sampling.draw, static_argnums=2)):
    np.testing.assert_array_equal(np.asarray(draw(key, logits, sampling.GREEDY)),
                                  np.asarray(expected))
  assert 0 <= int(sampling.greedy_ids(logits.at[2, 0, 7].set(jnp.nan))[2, 0]) < 9000
  # Above temperature 0 `draw` is a draw from the standardized distribution.
  config = sampling.SamplingConfig(temperature=0.7, top_k=3)
  np.testing.assert_array_equal(
      np.asarray(sampling.draw(key, logits, config)),
      np.asarray(sampling.sample(key, sampling.standardize(logits, config))))
