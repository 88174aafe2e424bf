"""A draft over a vocabulary subset: zero mass elsewhere, still exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import testing
from speclm.models import llama
from speclm.models import subset_vocab

VOCAB = 6


def test_subset_draft_logits_and_greedy_exactness():
  target = llama.random_model(vocab_size=30, embed_dim=16, num_layers=1, seed=0)
  subset = [0, 3, 4, 7, 9, 12, 20, 29]
  inner = llama.random_model(vocab_size=len(subset) + 1, embed_dim=8, num_layers=1, seed=1)
  draft = subset_vocab.wrap(inner, subset, 30)
  tokens = np.array([[3, 5, 7, 1], [29, 28, 0, 0]])
  lengths = np.array([4, 2])
  cache = draft.definition.init_cache(2, 8)
  logits, _ = jax.jit(draft.definition.prefill)(draft.params, tokens, lengths, cache)
  logits = np.asarray(logits)
  outside = np.setdiff1d(np.arange(30), subset)
  assert np.all(np.isneginf(logits[:, outside])) and np.all(np.isfinite(logits[:, subset]))
  # Tokens outside the subset (5, 1, 28) read as the "other" id: same as feeding id len(subset).
  mapped = np.asarray(draft.params['to_subset'])[tokens]
  inner_logits, _ = jax.jit(inner.definition.prefill)(inner.params, mapped, lengths, cache)
  np.testing.assert_allclose(logits[:, subset], np.asarray(inner_logits)[:, :-1], atol=1e-6)

  base = speclm.autoregressive_decode(target, tokens, lengths, max_new_tokens=12)
  spec = speclm.speculative_decode(target, draft, tokens, lengths, gamma=3, max_new_tokens=12)
  np.testing.assert_array_equal(spec.tokens, base.tokens)


def test_subset_draft_sampling_is_exact():
  """q̃ = 0 on half the vocabulary: samples still fit the target's exact distribution."""
  target = llama.random_model(vocab_size=VOCAB, embed_dim=16, num_layers=1, seed=3,
                              num_heads=2, num_kv_heads=1)
  inner = llama.random_model(vocab_size=4, embed_dim=8, num_layers=1, seed=4, num_heads=2,
                             num_kv_heads=1)
  draft = subset_vocab.wrap(inner, [1, 2, 5], VOCAB)
  prompt = np.array([2, 0, 3], np.int32)
  forward = jax.jit(target.definition.forward)
  sampling = speclm.SamplingConfig(temperature=1.0)

  def teacher_forced(continuations):
    seqs = np.concatenate([np.tile(prompt, (len(continuations), 1)), continuations], axis=1)
    return np.asarray(forward(target.params, seqs))[:, len(prompt) - 1:-1]

  _, probs = testing.exact_continuation_distribution(teacher_forced, VOCAB, 3, sampling)
  n = 20_000
  result = speclm.speculative_decode(target, draft, np.tile(prompt, (n, 1)), np.full(n, 3),
                                     gamma=2, sampling=sampling, max_new_tokens=3, seed=8)
  ids = testing.sequence_ids(np.asarray(result.tokens), VOCAB)
  assert testing.chi_square_pvalue(ids, probs) > 1e-3
  assert 0 < result.stats.alpha < 1


def test_subset_validation():
  inner = llama.random_model(vocab_size=4, embed_dim=8, num_layers=1)
  with pytest.raises(ValueError, match='needs 3'):
    subset_vocab.wrap(inner, [1, 2], 10)
  with pytest.raises(ValueError, match='duplicate'):
    subset_vocab.wrap(inner, [1, 1, 2], 10)


def test_resized_vocabulary_pads_with_zero_probability_and_drops_extra_ids():
  """A draft over 40 ids seen as 48 (q̃ = 0 on the 8 it lacks, which enter as its last id)
  and as 32 (its logits past 32 dropped); greedy decoding with the wider one equals the
  baseline."""
  draft = llama.random_model(vocab_size=40, num_layers=1, seed=5)
  tokens = jnp.asarray([[3, 39, 45, 7]])  # 45: an id only the larger vocabulary has
  inner = draft.definition.forward(draft.params, jnp.minimum(tokens, 39))
  wider = subset_vocab.resize_vocabulary(draft, 48)
  logits = wider.definition.extend(wider.params, tokens,
                                   wider.definition.init_cache(1, 8))[0]
  np.testing.assert_allclose(np.asarray(logits[..., :40]), np.asarray(inner), atol=1e-5)
  assert np.all(np.isneginf(np.asarray(logits[..., 40:])))
  narrower = subset_vocab.resize_vocabulary(draft, 32)
  logits = narrower.definition.extend(narrower.params, jnp.minimum(tokens, 31),
                                      narrower.definition.init_cache(1, 8))[0]
  assert logits.shape[-1] == 32
  assert subset_vocab.resize_vocabulary(draft, 40) is draft
  target = llama.random_model(vocab_size=48, num_layers=1, seed=6)
  prompts, lengths = np.array([[1, 2, 3], [4, 45, 0]], np.int32), np.array([3, 2], np.int32)
  base = speclm.autoregressive_decode(target, prompts, lengths, max_new_tokens=8)
  spec = speclm.speculative_decode(target, wider, prompts, lengths, gamma=3, max_new_tokens=8)
  assert spec.to_lists() == base.to_lists()
