"""A draft that only ever proposes a subset of the vocabulary (e.g. the most frequent tokens).

The inner model works over S = len(subset) + 1 ids: the subset, then one "other" id that
stands for every token outside it on the *input* side. Its logits are scattered back to the
full vocabulary with −inf (probability 0) everywhere else, so the draft's q̃ is 0 outside the
subset. Speculative sampling stays exact for any q (paper §3.6); a smaller head only lowers
the draft's cost c, and α a little where the target's tokens fall outside the subset.

Parameters: `{'inner': <inner model params>, 'to_subset': [V] int32, 'from_subset': [S-1]
int32}` — the id maps are arrays, so one compiled definition serves any subset of a size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from speclm import protocol


@dataclasses.dataclass(frozen=True)
class SubsetVocabModel(protocol.WrappedLanguageModel):
  """Wraps `inner` (vocabulary S = subset size + 1) as a model over `full_vocab_size` ids."""

  inner: protocol.LanguageModel
  full_vocab_size: int

  def __post_init__(self):
    if self.inner.vocab_size < 2:
      raise ValueError('The inner model needs at least one subset token and the "other" id.')

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    """V, the full vocabulary."""
    return self.full_vocab_size

  @property
  def subset_size(self) -> int:
    """S − 1, the tokens the draft can propose."""
    return self.inner.vocab_size - 1

  def _to_inner(self, params, tokens):
    return params['to_subset'][tokens]

  def _to_full(self, params, logits):
    """Inner logits `[..., S]` -> full logits `[..., V]`, −inf outside the subset."""
    return to_full_vocab(logits[..., :self.subset_size], params['from_subset'],
                         self.full_vocab_size)

  def init_cache(self, batch_size, max_length):
    """The inner model's; see `speclm.protocol.LanguageModel.init_cache`."""
    return self.inner.init_cache(batch_size, max_length)

  def prefill(self, params, inputs, input_lengths, cache):
    """Full-vocabulary tokens mapped into the subset, logits `[…, V]` back out (−inf outside it);
    see `speclm.protocol.LanguageModel.prefill`."""
    logits, cache = self.inner.prefill(params['inner'], self._to_inner(params, inputs),
                                       input_lengths, cache)
    return self._to_full(params, logits), cache

  def extend(self, params, tokens, cache):
    """Full-vocabulary tokens mapped into the subset, logits `[…, V]` back out (−inf outside it);
    see `speclm.protocol.LanguageModel.extend`."""
    logits, cache = self.inner.extend(params['inner'], self._to_inner(params, tokens), cache)
    return self._to_full(params, logits), cache

  def extend_last(self, params, tokens, cache):
    """Full-vocabulary tokens mapped into the subset, logits `[…, V]` back out (−inf outside it);
    see `speclm.protocol.LanguageModel.extend_last`."""
    logits, cache = self.inner.extend_last(params['inner'], self._to_inner(params, tokens),
                                           cache)
    return self._to_full(params, logits), cache

  def extend_tree(self, params, tokens, tree, cache):
    """Full-vocabulary tokens mapped into the subset, logits `[…, V]` back out (−inf outside it);
    see `speclm.protocol.LanguageModel.extend_tree`."""
    logits, cache = self.inner.extend_tree(params['inner'], self._to_inner(params, tokens), tree,
                                           cache)
    return self._to_full(params, logits), cache

  def last_prefix_token(self, inputs, input_lengths):
    """`[B]` the last real (full-vocabulary) token of each prompt `[B, P]`."""
    return jnp.take_along_axis(inputs, (input_lengths - 1)[:, None], axis=1)[:, 0]


def to_full_vocab(logits: jax.Array, token_ids: jax.Array, full_vocab_size: int) -> jax.Array:
  """Logits `[..., S]` over the tokens `token_ids` `[S]` -> `[..., V]`, −inf (q̃ = 0) on
  every other token."""
  full = jnp.full(logits.shape[:-1] + (full_vocab_size,), -jnp.inf, logits.dtype)
  return full.at[..., token_ids].set(logits)


def subset_maps(token_ids, full_vocab_size: int) -> dict[str, np.ndarray]:
  """The id maps for a subset: full id -> inner id (S−1 = "other"), and inner id -> full id."""
  token_ids = np.asarray(token_ids, np.int32)
  if len(np.unique(token_ids)) != len(token_ids):
    raise ValueError('The token subset has duplicate ids.')
  if token_ids.min() < 0 or token_ids.max() >= full_vocab_size:
    raise ValueError(f'Subset ids must lie in [0, {full_vocab_size}).')
  to_subset = np.full((full_vocab_size,), len(token_ids), np.int32)
  to_subset[token_ids] = np.arange(len(token_ids), dtype=np.int32)
  return {'to_subset': to_subset, 'from_subset': token_ids}


def wrap(inner: protocol.Model, token_ids, full_vocab_size: int) -> protocol.Model:
  """A `Model` over the full vocabulary from an inner model over `len(token_ids) + 1` ids."""
  if inner.vocab_size != len(token_ids) + 1:
    raise ValueError(f'The inner model has {inner.vocab_size} ids; a subset of'
                     f' {len(token_ids)} tokens needs {len(token_ids) + 1} (one for "other").')
  params = {'inner': inner.params, **jax.tree_util.tree_map(
      jnp.asarray, subset_maps(token_ids, full_vocab_size))}
  return protocol.Model(SubsetVocabModel(inner.definition, full_vocab_size), params)


@dataclasses.dataclass(frozen=True)
class ResizedVocabModel(protocol.WrappedLanguageModel):
  """`inner` seen with another vocabulary size, for a draft whose tokenizer is the target's
  but whose embedding table is padded to another length (Qwen2.5-0.5B has 151,936 rows,
  Qwen2.5-7B 152,064, over the same 151,665 tokens). Ids the inner model lacks enter it as its
  last id and get logit −inf (q̃ = 0); logits past `vocab_size` are dropped. Exact for any
  inner model (§3.6: any q works); its parameters are the inner model's."""

  inner: protocol.LanguageModel
  resized_vocab_size: int

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    """V, the resized vocabulary size."""
    return self.resized_vocab_size

  def _to_inner(self, tokens):
    return jnp.minimum(tokens, self.inner.vocab_size - 1)

  def _resize(self, logits):
    extra = self.resized_vocab_size - logits.shape[-1]
    if extra <= 0:
      return logits[..., :self.resized_vocab_size]
    pad = jnp.full(logits.shape[:-1] + (extra,), -jnp.inf, logits.dtype)
    return jnp.concatenate([logits, pad], axis=-1)

  def init_cache(self, batch_size, max_length):
    """The inner model's; see `speclm.protocol.LanguageModel.init_cache`."""
    return self.inner.init_cache(batch_size, max_length)

  def prefill(self, params, inputs, input_lengths, cache):
    """The inner model's, with ids it lacks entering as its last id and logits resized to V; see
    `speclm.protocol.LanguageModel.prefill`."""
    logits, cache = self.inner.prefill(params, self._to_inner(inputs), input_lengths, cache)
    return self._resize(logits), cache

  def extend(self, params, tokens, cache):
    """The inner model's, with ids it lacks entering as its last id and logits resized to V; see
    `speclm.protocol.LanguageModel.extend`."""
    logits, cache = self.inner.extend(params, self._to_inner(tokens), cache)
    return self._resize(logits), cache

  def extend_last(self, params, tokens, cache):
    """The inner model's, with ids it lacks entering as its last id and logits resized to V; see
    `speclm.protocol.LanguageModel.extend_last`."""
    logits, cache = self.inner.extend_last(params, self._to_inner(tokens), cache)
    return self._resize(logits), cache

  def extend_tree(self, params, tokens, tree, cache):
    """The inner model's, with ids it lacks entering as its last id and logits resized to V; see
    `speclm.protocol.LanguageModel.extend_tree`."""
    logits, cache = self.inner.extend_tree(params, self._to_inner(tokens), tree, cache)
    return self._resize(logits), cache

  def last_prefix_token(self, inputs, input_lengths):
    """The inner model's: `[B]` the last token of each prompt."""
    return self.inner.last_prefix_token(inputs, input_lengths)


def resize_vocabulary(model: protocol.Model, vocab_size: int) -> protocol.Model:
  """`model` as a `ResizedVocabModel` of `vocab_size` ids (itself when the sizes agree)."""
  if model.vocab_size == vocab_size:
    return model
  return protocol.Model(ResizedVocabModel(model.definition, vocab_size), model.params)
