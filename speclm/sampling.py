"""Standardized sampling (paper §2.2): logits -> the distribution actually sampled from.

Every sampling rule the paper considers (argmax, temperature, top-k, nucleus) is a fixed map
from a model's logits to a probability vector p̃ from which one plain categorical draw is
made. Speculative sampling (Algorithm 1) works on these standardized distributions, so the
target's p̃ and the draft's q̃ must come out of the *same* function — this one.

Shape letters: B batch, V vocabulary; `...` is any leading batch shape.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def _real(value) -> float | None:
  """`value` as a Python float if it is a real number (NumPy scalars included, booleans not)."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    return None
  return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How logits become the distribution sampled from.

  Applied in this order: temperature, then top-k, then top-p (as Hugging Face and T5X do).

  Attributes:
    temperature: 0 means argmax (a one-hot distribution; ties go to the lowest token id).
      Otherwise logits are divided by it before the softmax.
    top_k: keep the k most probable tokens (0 = keep all). Tokens tied with the k-th largest
      logit are all kept, so the kept set never depends on token ids.
    top_p: nucleus sampling; keep the smallest set of most probable tokens whose mass reaches
      top_p (1.0 = keep all). Among tokens of equal probability the lower id comes first.
  """

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    # Validate eagerly: a bad setting must fail here, in Python, not inside a traced loop.
    # NumPy scalars are accepted and stored as Python numbers, so equal settings hash equally
    # (the config is a static argument of jax.jit).
    temperature = _real(self.temperature)
    if temperature is None or not math.isfinite(temperature) or temperature < 0:
      raise ValueError(
          f'SamplingConfig.temperature must be a finite number >= 0 (0 means greedy), got'
          f' {self.temperature!r}.')
    if (isinstance(self.top_k, (bool, np.bool_)) or
        not isinstance(self.top_k, numbers.Integral) or self.top_k < 0):
      raise ValueError(
          f'SamplingConfig.top_k must be an integer >= 0 (0 disables top-k), got'
          f' {self.top_k!r}.')
    top_p = _real(self.top_p)
    if top_p is None or not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
      raise ValueError(
          f'SamplingConfig.top_p must be a finite number in (0, 1] (1 disables nucleus'
          f' sampling), got {self.top_p!r}.')
    object.__setattr__(self, 'temperature', temperature)
    object.__setattr__(self, 'top_k', int(self.top_k))
    object.__setattr__(self, 'top_p', top_p)

  @property
  def is_greedy(self) -> bool:
    """Whether temperature is 0: argmax, no randomness."""
    return self.temperature == 0

  def standardize(self, logits: jax.Array) -> jax.Array:
    """Logits `[..., V]` -> float32 probabilities `[..., V]` summing to 1 on the last axis."""
    return standardize(logits, self)


GREEDY = SamplingConfig(temperature=0.0)


def top_k_indices(x: jax.Array, k: int) -> jax.Array:
  """`[..., k]` int32 indices of the k largest entries of the last axis, largest first (ties:
  the lower index first), as `jax.lax.top_k(x, k)[1]` gives them.

  For the few candidates of a token tree: k passes of argmax. Inside the compiled decode
  loops XLA's CPU backend lowered `lax.top_k` over a vocabulary to a full sort, about 11 ms
  per call over SmolLM2's 49,152 ids (scripts/profile_decode.py --mode=tree), where one
  argmax pass costs a fraction of a millisecond.
  """
  columns = jnp.arange(x.shape[-1])
  chosen = []
  for _ in range(k):
    index = jnp.argmax(x, axis=-1)
    chosen.append(index)
    x = jnp.where(columns == index[..., None], -jnp.inf, x)
  return jnp.stack(chosen, axis=-1).astype(jnp.int32)


def standardize(logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """The standardized distribution p̃ of paper §2.2, in float32.

  Logits of -inf (a draft that never proposes some tokens) become exact zeros. At least one
  logit per row must be finite.

  Args:
    logits: `[..., V]` any float dtype.
    config: temperature (0: argmax, a one-hot on the first largest logit), top-k, top-p.

  Returns:
    `[..., V]` float32 probabilities summing to 1 on the last axis.
  """
  logits = logits.astype(jnp.float32)
  if config.is_greedy:
    return _first_argmax_one_hot(logits)

  logits = logits / config.temperature
  if config.top_k and config.top_k < logits.shape[-1]:
    kth_largest = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth_largest, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if config.top_p < 1.0:
    probs = _nucleus(probs, config.top_p)
  return probs


def _first_max_id(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(ids `[..., V]`, the id of the largest logit `[..., 1]`, the lowest on ties).

  Written as a max and a min over ids rather than `jnp.argmax`: XLA's CPU argmax (a variadic
  reduction) is about 5x slower over a 49k vocabulary, and this runs every decoding step.
  """
  ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  is_max = logits == jnp.max(logits, axis=-1, keepdims=True)
  return ids, jnp.min(jnp.where(is_max, ids, logits.shape[-1]), axis=-1, keepdims=True)


def _first_argmax_one_hot(logits: jax.Array) -> jax.Array:
  """One-hot of the largest logit, the lowest id on ties."""
  ids, first = _first_max_id(logits)
  return (ids == first).astype(jnp.float32)


def greedy_ids(logits: jax.Array) -> jax.Array:
  """`[..., V]` -> int32 `[...]`: the token temperature 0 picks, the first largest logit.

  The token `sample(rng, standardize(logits, GREEDY))` draws (a one-hot row always yields its
  token), found without building the one-hot row or searching it. A row with a NaN still gets
  a valid id (which one depends on how the backend's max treats NaN); the decode loops stop
  such rows as bad and append nothing from them.
  """
  _, first = _first_max_id(logits)
  return jnp.minimum(first[..., 0], logits.shape[-1] - 1)


def draw(rng: jax.Array, logits: jax.Array, config: SamplingConfig) -> jax.Array:
  """One token per row from logits `[..., V]` -> int32 `[...]`: a draw from p̃ =
  `standardize(logits, config)`; at temperature 0 directly `greedy_ids(logits)` (the same
  token, without the vocabulary-wide one-hot and search; `rng` is then unused)."""
  if config.is_greedy:
    return greedy_ids(logits)
  return sample(rng, standardize(logits, config))


def _nucleus(probs: jax.Array, top_p: float) -> jax.Array:
  """Keeps the smallest most-probable prefix of tokens whose mass reaches `top_p`."""
  # Stable sort on -probs: ties keep ascending token order, so the cut is deterministic.
  order = jnp.argsort(-probs, axis=-1, stable=True)
  sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
  mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
  keep_sorted = mass_before < top_p  # the token that crosses top_p is kept; the first always is
  keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
  kept = jnp.where(keep, probs, 0.0)
  return kept / jnp.sum(kept, axis=-1, keepdims=True)


def sample(rng: jax.Array, probs: jax.Array) -> jax.Array:
  """One categorical draw per row from probabilities `[..., V]` -> int32 token ids `[...]`.

  Inverse-CDF sampling with one uniform per row, in two levels (blocks of `_BLOCK` ids, then
  ids inside the chosen block) so no cumulative sum runs over the whole vocabulary. This is
  exact up to float32 rounding of the cumulative sums, like any categorical sampler, and
  needs one random number per row instead of one per token (Gumbel-max over a 49k vocabulary
  costs more than a draft model's step on CPU). Zero-probability tokens are never drawn: the
  chosen index is the first whose cumulative mass exceeds the uniform, which a zero entry
  cannot be; a one-hot (greedy) row therefore always yields its token. Rows need not sum to 1.
  """
  probs = probs.astype(jnp.float32)
  vocab = probs.shape[-1]
  num_blocks = -(-vocab // _BLOCK)
  padding = [(0, 0)] * (probs.ndim - 1) + [(0, num_blocks * _BLOCK - vocab)]
  blocks = jnp.pad(probs, padding).reshape(probs.shape[:-1] + (num_blocks, _BLOCK))
  block_mass = jnp.sum(blocks, axis=-1)  # [..., NB]
  block_cdf = jnp.cumsum(block_mass, axis=-1)
  u = jax.random.uniform(rng, probs.shape[:-1] + (1,)) * block_cdf[..., -1:]
  block = _first_above(block_cdf, u, block_mass > 0)
  # The uniform's remainder inside the chosen block, then the same search over its ids.
  below = jnp.take_along_axis(block_cdf - block_mass, block[..., None], axis=-1)
  inner = jnp.take_along_axis(blocks, block[..., None, None], axis=-2)[..., 0, :]  # [..., BS]
  offset = _first_above(jnp.cumsum(inner, axis=-1), jnp.maximum(u - below, 0.0), inner > 0)
  return (block * _BLOCK + offset).astype(jnp.int32)


_BLOCK = 256


def _first_above(cdf: jax.Array, u: jax.Array, positive: jax.Array) -> jax.Array:
  """The first index with positive mass whose `cdf` exceeds `u`, else (rounding past the end)
  the last index with positive mass: an index of mass zero is never returned."""
  ids = jax.lax.broadcasted_iota(jnp.int32, cdf.shape, cdf.ndim - 1)
  size = cdf.shape[-1]
  index = jnp.min(jnp.where((cdf > u) & positive, ids, size), axis=-1)
  last_positive = jnp.max(jnp.where(positive, ids, 0), axis=-1)
  return jnp.where(index == size, last_positive, index)
