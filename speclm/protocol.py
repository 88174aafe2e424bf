"""The model protocol: the one seam between decoding algorithms and models.

Decode loops see a model only through the pure functions below, over explicit pytrees (in
the spirit of T5X's `tokens_to_logits` callback). A model *definition* is static and
hashable (a frozen dataclass: it is a static argument of `jax.jit`); its *parameters* and
*cache* are pytrees passed in and returned.

The autoregressive sequence a model continues is, for a decoder-only model, the prompt; for
an encoder-decoder model, the decoder's start token (the encoder input lives in the cache).
The cache holds the first `lengths[b]` positions of row b's sequence; entries past a row's
length are masked, never read, so rolling a row back is just lowering its length.

Shape letters: B batch, P prompt (input) length, K tokens appended in one call, V vocabulary,
L cache capacity in positions, D feature width (a target's hidden states).
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

Params = Any
Cache = Any  # a pytree with an int32 `[B]` field `lengths`


class LanguageModel(abc.ABC):
  """A model definition, as decode loops see it. Subclasses are frozen (hashable) dataclasses."""

  vocab_size: int

  @abc.abstractmethod
  def init_cache(self, batch_size: int, max_length: int) -> Cache:
    """An empty cache, all lengths 0.

    Args:
      batch_size: B, the rows the cache holds.
      max_length: L, the positions it holds per row (prefix and generated tokens).

    Returns:
      The cache pytree (`cache_lengths` `[B]` zeros, `cache_capacity` L).
    """

  @abc.abstractmethod
  def prefill(self, params: Params, inputs: jax.Array, input_lengths: jax.Array,
              cache: Cache) -> tuple[jax.Array, Cache]:
    """Processes each row's inputs into an empty cache.

    Args:
      params: the model's parameters.
      inputs: `[B, P]` int32, right-padded: row b's tokens are `inputs[b, :input_lengths[b]]`.
      input_lengths: `[B]` int32, each at least 1.
      cache: an empty cache from `init_cache`.

    Returns:
      (logits `[B, V]` for the first new token, the cache with lengths
      `prefix_length(input_lengths)`).
    """

  @abc.abstractmethod
  def extend(self, params: Params, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
    """Appends tokens at each row's own position, causal within the K.

    K = 1 is a decode step; K = γ+1 is verification.

    Args:
      params: the model's parameters.
      tokens: `[B, K]` int32, written after each row's `cache_lengths`.
      cache: the cache, with room for K more positions per row.

    Returns:
      (logits `[B, K, V]`: position k predicts the token after `tokens[:, k]`, the cache with
      every row's length increased by K).
    """

  def extend_last(self, params: Params, tokens: jax.Array, cache: Cache
                  ) -> tuple[jax.Array, Cache]:
    """`extend`, returning only the last position's logits.

    A draft catching up on tokens it has not read (the two it re-reads every round, or those
    of rounds it sat out) needs only its prediction after the newest. Models override this to
    apply their output head to that position alone: at a batch of 8 the head over every
    re-read position cost more than the rest of the catch-up (docs/performance.md).

    Args:
      params: the model's parameters.
      tokens: `[B, K]` int32, as for `extend`.
      cache: the cache, with room for K more positions per row.

    Returns:
      (logits `[B, V]` after `tokens[:, -1]`, the cache with lengths increased by K).
    """
    logits, cache = self.extend(params, tokens, cache)
    return logits[:, -1], cache

  def extend_live(self, params: Params, tokens: jax.Array, cache: Cache, num_live: jax.Array
                  ) -> tuple[jax.Array, Cache]:
    """`extend` of K tokens of which only the first `num_live` are needed.

    An adaptive round verifies the k it drafted at one compiled width, γ_max + 1 (a branch
    per width costs copies of the whole cache on CPU, docs/performance.md). A model whose
    `skips_dead_positions` is True leaves the other positions' work out; any other computes
    them (this default: `extend`).

    Args:
      params, tokens, cache: as for `extend` (tokens `[B, K]`).
      num_live: int32 scalar (traced), 1 … K.

    Returns:
      `extend`'s (logits `[B, K, V]`, cache with lengths increased by K), exact at the first
      `num_live` positions; the logits and cache entries of the others are unspecified (never
      read: decoding rolls the cache back before them).
    """
    del num_live
    return self.extend(params, tokens, cache)

  def skips_dead_positions(self, params: Params, shape: tuple[int, int]) -> bool:
    """Whether `extend_live` of tokens of `shape` `(B, K)` with these parameters costs about
    what a call of `num_live` positions does (False: it costs a K-position call, as this
    default). Static: decided from the parameters' structure and the shape while tracing."""
    del params, shape
    return False

  @abc.abstractmethod
  def prefix_length(self, input_lengths: jax.Array | int) -> jax.Array | int:
    """How many cache positions `prefill` fills for inputs of the given lengths.

    Args:
      input_lengths: `[B]` int32 (or one int): the real lengths given to `prefill`.

    Returns:
      The same shape: the prompt length for a decoder-only model, 1 (the start token) for an
      encoder-decoder one.
    """

  @abc.abstractmethod
  def last_prefix_token(self, inputs: jax.Array, input_lengths: jax.Array) -> jax.Array:
    """The last token of the sequence after `prefill` (the prompt's last, or the start token).

    Args:
      inputs: `[B, P]` int32, as given to `prefill`.
      input_lengths: `[B]` int32.

    Returns:
      `[B]` int32.
    """

  # Token trees (`speclm.token_trees`). Optional: models without them refuse tree decoding.
  def extend_tree(self, params: Params, tokens: jax.Array, tree: Any,
                  cache: Cache) -> tuple[jax.Array, Cache]:
    """Appends a token tree of K nodes after each row's length.

    Node k is written to cache slot `length + k` but sits at sequence position
    `length + depths[k]`, and attends to the row's committed positions and to its own
    ancestors only (`tree.ancestors`); `keep_tree_path` then makes one path an ordinary
    sequence. With a chain (node k's parent k−1) this is `extend`.

    Args:
      params: the model's parameters.
      tokens: `[B, K]` int32, the nodes in the layout's order (parents before children).
      tree: a `speclm.token_trees.TreeLayout` of K nodes (depths `[K]`, ancestors `[K, K]`).
      cache: the cache, with room for K more positions per row.

    Returns:
      (logits `[B, K, V]`: node k's predict the token after it, the cache with lengths
      increased by K).
    """
    raise NotImplementedError(
        f'{type(self).__name__} does not verify token trees (no extend_tree); use a chain'
        ' (speculative_decode with gamma) or a model that implements it (Llama, T5, n-gram'
        ' and lookup drafts).')

  def keep_tree_path(self, cache: Cache, start: jax.Array, path: jax.Array) -> Cache:
    """Makes a tree path contiguous: for i < M, slot `start + path[b, i]` moves to `start + i`.

    Lengths are unchanged (roll back to the kept length afterwards).

    Args:
      cache: the cache after `extend_tree`.
      start: `[B]` int32, each row's length before the tree was appended.
      path: `[B, M]` int32 node indices, increasing, `path[b, i] >= i`.

    Returns:
      The cache with the path's entries in slots `start … start + M − 1`.
    """
    raise NotImplementedError(f'{type(self).__name__} does not verify token trees.')

  # Functional cache bookkeeping; models whose cache is a struct with `lengths` keep these.
  def cache_lengths(self, cache: Cache) -> jax.Array:
    """`[B]` int32 positions held by each row of `cache`."""
    return cache.lengths

  def rollback(self, cache: Cache, lengths: jax.Array) -> Cache:
    """The cache with each row cut back (or forward, over already written entries).

    Args:
      cache: the cache.
      lengths: `[B]` int32 new lengths, at most the capacity L.

    Returns:
      The cache with `cache_lengths` = `lengths`; entries past them are ignored.
    """
    return cache.replace(lengths=lengths.astype(jnp.int32))

  def cache_capacity(self, cache: Cache) -> int:
    """Static number of positions L the cache can hold per row."""
    return cache.capacity

  def validate_params(self, params: Params) -> None:
    """Raises ValueError if `params` does not fit this definition. Optional."""
    del params

  @property
  def max_context_length(self) -> int | None:
    """Positions the model was trained for (prompt + generated), or None when unlimited or
    unknown. Decoding refuses a prompt plus `max_new_tokens` longer than this."""
    return None


class WrappedLanguageModel(LanguageModel):
  """A model that changes some calls of an `inner` model (a field of the subclass) and hands
  the cache bookkeeping to it unchanged."""

  inner: LanguageModel  # declared again as a field by each (dataclass) subclass

  def prefix_length(self, input_lengths):
    """The inner model's (`LanguageModel.prefix_length`)."""
    return self.inner.prefix_length(input_lengths)

  def cache_lengths(self, cache):
    """The inner model's (`LanguageModel.cache_lengths`)."""
    return self.inner.cache_lengths(cache)

  def rollback(self, cache, lengths):
    """The inner model's (`LanguageModel.rollback`)."""
    return self.inner.rollback(cache, lengths)

  def cache_capacity(self, cache):
    """The inner model's (`LanguageModel.cache_capacity`)."""
    return self.inner.cache_capacity(cache)

  def keep_tree_path(self, cache, start, path):
    """The inner model's (`LanguageModel.keep_tree_path`)."""
    return self.inner.keep_tree_path(cache, start, path)

  @property
  def max_context_length(self) -> int | None:
    """The inner model's (`LanguageModel.max_context_length`)."""
    return self.inner.max_context_length


class FeatureSource(abc.ABC):
  """A model that can also hand out its final hidden states ("features", the inputs of its
  output head), for a `FeatureConditionedDraft` to read. Llama targets are one.

  `with_feature_layers(layers)` gives the same model handing out, instead, its hidden states
  after each of the decoder layers `layers`, concatenated (EAGLE-3's low, middle and high
  features); `feature_dim` is then their total width.
  """

  feature_dim: int

  def with_feature_layers(self, layers: tuple[int, ...] | None) -> 'FeatureSource':
    """This model handing out the hidden states after decoder layers `layers` (None: the final
    ones). The base refuses anything but None."""
    if layers is None:
      return self
    raise TypeError(f'{type(self).__name__} hands out only its final hidden states, not those'
                    f' of layers {layers}.')

  @abc.abstractmethod
  def prefill_with_features(self, params: Params, inputs: jax.Array, input_lengths: jax.Array,
                            cache: Cache) -> tuple[jax.Array, jax.Array, Cache]:
    """`prefill` that also returns the features of every input position.

    Args:
      params, inputs, input_lengths, cache: as for `LanguageModel.prefill` (inputs `[B, P]`,
        input_lengths `[B]`).

    Returns:
      (logits `[B, V]`, features `[B, P, D]`: position p's is the hidden state that predicts
      the token after `inputs[:, p]`, the cache).
    """

  @abc.abstractmethod
  def extend_with_features(self, params: Params, tokens: jax.Array,
                           cache: Cache) -> tuple[jax.Array, jax.Array, Cache]:
    """`extend` that also returns the features of the K new positions.

    Args:
      params, tokens, cache: as for `LanguageModel.extend` (tokens `[B, K]`).

    Returns:
      (logits `[B, K, V]`, features `[B, K, D]`, the cache with lengths increased by K).
    """

  def extend_live_with_features(self, params: Params, tokens: jax.Array, cache: Cache,
                                num_live: jax.Array) -> tuple[jax.Array, jax.Array, Cache]:
    """`extend_with_features` where only the first `num_live` positions are needed (as
    `LanguageModel.extend_live`; the features of the others are unspecified too). This
    default computes them all."""
    del num_live
    return self.extend_with_features(params, tokens, cache)

  def extend_tree_with_features(self, params: Params, tokens: jax.Array, tree: Any,
                                cache: Cache) -> tuple[jax.Array, jax.Array, Cache]:
    """`LanguageModel.extend_tree` that also returns the features `[B, K, D]` of the K nodes
    (a feature-conditioned draft over a token tree). Optional; this default refuses."""
    raise NotImplementedError(f'{type(self).__name__} hands out no features over token trees'
                              ' (no extend_tree_with_features).')


class FeatureConditionedDraft(LanguageModel):
  """A draft that reads a `FeatureSource` target's features as well as tokens (EAGLE-style).

  `features[:, k]` always belongs to the position *before* `tokens[:, k]` (the feature from
  which that token was predicted); zeros stand in before the first position. Decode loops
  give it the target's features where they are known and its own predictions elsewhere.

  `feature_layers`: None to read the target's final hidden states, or the target layers whose
  hidden states it reads, concatenated (`FeatureSource.with_feature_layers`); the loops ask the
  target for those. Its own predicted features may then be narrower than the target's
  (`feature_dim`): `extend_with_features` takes either.
  """

  feature_dim: int
  feature_layers: tuple[int, ...] | None = None

  @abc.abstractmethod
  def prefill_with_features(self, params: Params, inputs: jax.Array, input_lengths: jax.Array,
                            features: jax.Array, cache: Cache) -> Cache:
    """Processes each row's inputs, with the target's features before each, into a cache.

    Args:
      params: the draft's parameters.
      inputs: `[B, P]` int32, right-padded.
      input_lengths: `[B]` int32.
      features: `[B, P, D]`: `features[:, p]` is the target's feature that predicted
        `inputs[:, p]` (zeros at p = 0).
      cache: an empty cache from `init_cache`.

    Returns:
      The cache (lengths `prefix_length(input_lengths)`); the draft proposes with
      `extend_with_features` next.
    """

  @abc.abstractmethod
  def extend_with_features(self, params: Params, tokens: jax.Array, features: jax.Array,
                           cache: Cache) -> tuple[jax.Array, jax.Array, Cache]:
    """Appends tokens, each with the feature before it.

    Args:
      params: the draft's parameters.
      tokens: `[B, K]` int32.
      features: `[B, K, D]`: the target's (D = `feature_dim`) or the draft's own predictions
        (D = D').
      cache: the cache, with room for K more positions per row.

    Returns:
      (logits `[B, K, V]`, the draft's predicted features `[B, K, D']` for the same
      positions, the cache with lengths increased by K).
    """

  def extend_tree_with_features(self, params: Params, tokens: jax.Array, features: jax.Array,
                                tree: Any, cache: Cache) -> tuple[jax.Array, jax.Array, Cache]:
    """`extend_with_features` over a token tree of K nodes, laid out as in
    `LanguageModel.extend_tree`; `features[:, k]` belongs to node k's parent (the position
    before it). Optional (token-tree decoding); this default refuses.

    Returns:
      (logits `[B, K, V]`, the predicted features `[B, K, D']` of the nodes, the cache with
      lengths increased by K).
    """
    raise NotImplementedError(f'{type(self).__name__} does not draft token trees (no'
                              ' extend_tree_with_features); use a chain (speculative_decode).')

  def prefill(self, *args, **kwargs):
    """Refused: the draft needs the target's features (`prefill_with_features`)."""
    raise TypeError(f'{type(self).__name__} drafts from the target\'s features: use it through'
                    ' speclm.speculative_decode with a target that provides them (a'
                    ' protocol.FeatureSource such as a Llama model).')

  extend = prefill  # the same error


@struct.dataclass
class Model:
  """A model definition bundled with its parameters; a pytree whose only leaves are params."""

  definition: LanguageModel = struct.field(pytree_node=False)
  params: Params

  @property
  def vocab_size(self) -> int:
    """V, the definition's vocabulary size."""
    return self.definition.vocab_size


def target_for_feature_draft(target: Model, draft: Model) -> Model:
  """`target` handing out the features `draft` reads, if it is a `FeatureConditionedDraft`
  (its final hidden states, or those of the draft's `feature_layers`; the tokens and logits
  are the same either way); `target` itself for any other draft. Raises ValueError if the
  target cannot provide them."""
  if not isinstance(draft.definition, FeatureConditionedDraft):
    return target
  if not isinstance(target.definition, FeatureSource):
    raise ValueError(
        f'The draft ({type(draft.definition).__name__}) reads the target\'s features, but the'
        f' target ({type(target.definition).__name__}) does not provide them'
        ' (protocol.FeatureSource).')
  target = Model(target.definition.with_feature_layers(draft.definition.feature_layers),
                 target.params)
  if draft.definition.feature_dim != target.definition.feature_dim:
    raise ValueError(f'The draft reads features of width {draft.definition.feature_dim}, the'
                     f' target\'s are {target.definition.feature_dim} wide.')
  return target
