"""Unigram, bigram and prompt-lookup drafts: estimation, files, protocol, exact decoding.

Tiny random Llama targets keep these fast; `test_smollm2.py` repeats the decoding check with
the real SmolLM2-135M target.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import protocol
from speclm import token_trees
from speclm.models import llama
from speclm.models import lookup
from speclm.models import ngram

V = 64


def _corpus(seed=0, num=20, length=50):
  rng = np.random.default_rng(seed)
  # A skewed, partly repetitive corpus so that bigram statistics are informative.
  base = rng.zipf(1.5, size=(num, length)) % V
  base[:, 1::3] = (base[:, 0::3][:, :base[:, 1::3].shape[1]] * 7 + 3) % V
  return [row.tolist() for row in base]


# ----------------------------------------------------------------------------------------------
# Estimation


def test_unigram_estimate_matches_counts():
  corpus = [[1, 2, 2, 3], [3, 3]]
  model = ngram.estimate_unigram(corpus, 5)
  probs = np.exp(np.asarray(model.params['log_probs']))
  np.testing.assert_allclose(probs, [0, 1 / 6, 2 / 6, 3 / 6, 0], atol=1e-7)
  smoothed = np.exp(np.asarray(ngram.estimate_unigram(corpus, 5, add_k=1.0).params['log_probs']))
  np.testing.assert_allclose(smoothed, np.array([1, 2, 3, 4, 1]) / 11, atol=1e-7)


def _bigram_reference(corpus, vocab, max_successors, backoff):
  """q(x | t) straight from the formula in ngram's docstring, one context at a time."""
  unigram = collections.Counter(t for seq in corpus for t in seq)
  total = sum(unigram.values())
  p_uni = np.array([unigram[x] / total for x in range(vocab)])
  pairs = collections.Counter((a, b) for seq in corpus for a, b in zip(seq[:-1], seq[1:]))
  table = np.zeros((vocab, vocab))
  for t in range(vocab):
    successors = sorted(((c, x) for (a, x), c in pairs.items() if a == t),
                        key=lambda cx: (-cx[0], cx[1]))
    n_t = sum(c for c, _ in successors)
    kept = successors[:max_successors]
    if n_t + backoff == 0:
      table[t] = p_uni
      continue
    table[t] = (n_t - sum(c for c, _ in kept) + backoff) / (n_t + backoff) * p_uni
    for c, x in kept:
      table[t, x] += c / (n_t + backoff)
  return table


@pytest.mark.parametrize('max_successors,backoff', [(3, 1.0), (2, 0.0), (V, 0.5)])
def test_bigram_estimate_matches_formula(max_successors, backoff):
  corpus = _corpus()
  model = ngram.estimate_bigram(corpus, V, max_successors=max_successors, backoff=backoff)
  got = np.exp(np.asarray(model.definition.next_token_logits(model.params, jnp.arange(V))))
  want = _bigram_reference(corpus, V, max_successors, backoff)
  np.testing.assert_allclose(got, want, atol=1e-6)
  np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_bigram_pairs_do_not_cross_sequences():
  model = ngram.estimate_bigram([[1, 2], [3, 4]], 5, backoff=0.0)
  probs = np.exp(np.asarray(model.definition.next_token_logits(model.params, jnp.arange(5))))
  # 2 ends its sequence, so it has no successors: its row is the unigram, not a jump to 3.
  np.testing.assert_allclose(probs[2], [0, 0.25, 0.25, 0.25, 0.25])
  assert probs[1, 2] == 1.0 and probs[3, 4] == 1.0


def test_estimation_errors():
  with pytest.raises(ValueError, match='empty'):
    ngram.estimate_bigram([[]], V)
  with pytest.raises(ValueError, match=r'\[0, 64\)'):
    ngram.estimate_unigram([[1, 64]], V)
  with pytest.raises(ValueError, match='max_successors'):
    ngram.estimate_bigram([[1, 2]], V, max_successors=0)


@pytest.mark.parametrize('kind', ['unigram', 'bigram'])
def test_save_and_load_round_trip(tmp_path, kind):
  corpus = _corpus()
  model = (ngram.estimate_unigram(corpus, V) if kind == 'unigram'
           else ngram.estimate_bigram(corpus, V, max_successors=4))
  path = tmp_path / f'{kind}.safetensors'
  ngram.save(path, model)
  loaded = ngram.load(path)
  assert loaded.definition == model.definition
  for name, value in model.params.items():
    np.testing.assert_array_equal(np.asarray(loaded.params[name]), np.asarray(value))


def test_load_rejects_other_files(tmp_path):
  with pytest.raises(FileNotFoundError):
    ngram.load(tmp_path / 'missing.safetensors')
  (tmp_path / 'junk.safetensors').write_bytes(b'\x00' * 3)
  with pytest.raises(ValueError, match='not a readable'):
    ngram.load(tmp_path / 'junk.safetensors')
  from safetensors import numpy as st_numpy
  st_numpy.save_file({'x': np.zeros(3, np.float32)}, str(tmp_path / 'other.safetensors'))
  with pytest.raises(ValueError, match='not a speclm n-gram draft'):
    ngram.load(tmp_path / 'other.safetensors')


# ----------------------------------------------------------------------------------------------
# Protocol behaviour


def test_bigram_protocol_logits_follow_previous_token():
  model = ngram.estimate_bigram(_corpus(), V, max_successors=4)
  d, p = model.definition, model.params
  prompts = jnp.array([[5, 6, 7, 0], [9, 10, 0, 0]], jnp.int32)
  lengths = jnp.array([3, 2], jnp.int32)
  cache = d.init_cache(2, 10)
  logits, cache = d.prefill(p, prompts, lengths, cache)
  np.testing.assert_allclose(logits, d.next_token_logits(p, jnp.array([7, 10])))
  new = jnp.array([[1, 2], [3, 4]], jnp.int32)
  logits, cache = d.extend(p, new, cache)
  np.testing.assert_allclose(logits, d.next_token_logits(p, new))
  np.testing.assert_array_equal(cache.lengths, [5, 4])
  np.testing.assert_array_equal(cache.tokens[0, :5], [5, 6, 7, 1, 2])
  np.testing.assert_array_equal(cache.tokens[1, :4], [9, 10, 3, 4])
  cache = d.rollback(cache, jnp.array([4, 2]))
  _, cache = d.extend(p, jnp.array([[11], [12]], jnp.int32), cache)
  np.testing.assert_array_equal(cache.tokens[0, :5], [5, 6, 7, 1, 11])
  np.testing.assert_array_equal(cache.tokens[1, :3], [9, 10, 12])


def _lookup_reference(seq, position, max_ngram, min_ngram):
  """The proposal for the context seq[:position + 1], by brute force (None if no match)."""
  for n in range(max_ngram, min_ngram - 1, -1):
    if position + 1 < n:
      continue
    suffix = seq[position - n + 1:position + 1]
    for i in range(position - 1, n - 2, -1):  # latest first; the match ends at i < position
      if seq[i - n + 1:i + 1] == suffix:
        return seq[i + 1]
  return None


def test_lookup_examples():
  d = lookup.PromptLookup(V, max_ngram=3)
  seq = jnp.array([[5, 6, 7, 8, 9, 5, 6, 1, 6, 0, 0, 0]], jnp.int32)
  proposal, found = d.propose(seq, jnp.array([[6, 8, 0, 7]]))
  # ...5 6 -> 7 (2-gram match at 0..1); ...1 6 -> no 2-gram, latest 1-gram '6' at 6 -> 1;
  # position 0 has no earlier context; ...6 1 -> '1' never seen before.
  np.testing.assert_array_equal(found, [[True, True, False, False]])
  np.testing.assert_array_equal(proposal[0, :2], [7, 1])


def test_lookup_matches_brute_force():
  rng = np.random.default_rng(0)
  d = lookup.PromptLookup(6, max_ngram=3, min_ngram=1)
  seqs = rng.integers(0, 6, size=(4, 30))
  positions = np.tile(np.arange(30), (4, 1))
  proposal, found = jax.jit(d.propose)(jnp.asarray(seqs, jnp.int32), jnp.asarray(positions))
  for b in range(4):
    for j in range(30):
      want = _lookup_reference(seqs[b].tolist(), j, 3, 1)
      assert bool(found[b, j]) == (want is not None)
      if want is not None:
        assert int(proposal[b, j]) == want, (b, j)


def test_lookup_distribution_shapes():
  prompts = jnp.array([[3, 4, 5, 3, 4]], jnp.int32)
  for confidence in (1.0, 0.8):
    d = lookup.PromptLookup(V, confidence=confidence)
    logits, cache = d.prefill({}, prompts, jnp.array([5]), d.init_cache(1, 8))
    probs = np.asarray(jax.nn.softmax(logits[0]))
    assert int(np.argmax(probs)) == 5
    np.testing.assert_allclose(probs[5], confidence + (1 - confidence) / V, rtol=1e-5)
    np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-5)
  logits, _ = d.extend({}, jnp.array([[60]], jnp.int32), cache)
  np.testing.assert_array_equal(logits, np.zeros((1, 1, V)))  # 60 is new: uniform
  with pytest.raises(ValueError, match='confidence'):
    lookup.PromptLookup(V, confidence=0.0)


# ----------------------------------------------------------------------------------------------
# Exact decoding with every draft kind (tiny random target)


def _drafts():
  corpus = _corpus()
  return {
      'unigram': ngram.estimate_unigram(corpus, V),
      'bigram': ngram.estimate_bigram(corpus, V, max_successors=8),
      'lookup': lookup.prompt_lookup(V),
      'lookup_smoothed': lookup.prompt_lookup(V, confidence=0.9, max_ngram=2),
      'lookup_first': lookup.lookup_first(
          llama.random_model(vocab_size=V, embed_dim=16, num_layers=1, seed=3), min_ngram=2),
      'lookup_mixed': lookup.lookup_first(
          llama.random_model(vocab_size=V, embed_dim=16, num_layers=1, seed=3), min_ngram=2,
          weight=0.5),
  }


@pytest.mark.parametrize('kind,gamma', [('unigram', 4), ('bigram', 4), ('lookup', 4),
                                        ('lookup_smoothed', 1), ('lookup_first', 3),
                                        ('lookup_mixed', 3)])
def test_greedy_speculative_equals_baseline(kind, gamma):
  target = llama.random_model(vocab_size=V, embed_dim=32, num_layers=2, seed=1)
  draft = _drafts()[kind]
  prompts = np.array([[3, 4, 5, 3, 4, 5, 3, 0], [7, 8, 9, 10, 11, 12, 13, 14],
                      [1, 2, 0, 0, 0, 0, 0, 0]])
  lengths = np.array([7, 8, 2])
  baseline = speclm.autoregressive_decode(target, prompts, lengths, max_new_tokens=20)
  result = speclm.speculative_decode(target, draft, prompts, lengths, gamma=gamma,
                                     max_new_tokens=20)
  assert result.to_lists() == baseline.to_lists()
  assert 0.0 <= result.stats.alpha <= 1.0


def test_sampling_with_peaked_drafts_runs_clean():
  """-inf logits of a one-hot draft are legal: no row stops for bad logits at temperature 1."""
  target = llama.random_model(vocab_size=V, embed_dim=32, num_layers=2, seed=2)
  prompts, lengths = np.array([[3, 4, 5, 3, 4, 5], [9, 9, 9, 9, 9, 9]]), np.array([6, 4])
  for draft in (_drafts()['lookup'],):  # one-hot q: -inf everywhere but one token
    result = speclm.speculative_decode(target, draft, prompts, lengths, gamma=3, seed=5,
                                       sampling=speclm.SamplingConfig(temperature=1.0),
                                       max_new_tokens=12)
    assert np.all(np.asarray(result.stop_reasons) == speclm.StopReason.MAX_NEW_TOKENS)
    assert np.all(np.asarray(result.lengths) == 12)


def test_lookup_first_proposes_the_match_else_the_fallback():
  fallback = llama.random_model(vocab_size=V, embed_dim=16, num_layers=1, seed=3)
  model = lookup.lookup_first(fallback, min_ngram=2)
  d = model.definition
  prompts = np.array([[3, 4, 5, 3, 4], [7, 8, 9, 10, 11]], np.int32)
  lengths = np.array([5, 5], np.int32)
  logits, cache = d.prefill(model.params, prompts, lengths, d.init_cache(2, 16))
  plain, plain_cache = fallback.definition.prefill(
      fallback.params, prompts, lengths, fallback.definition.init_cache(2, 16))
  # Row 0 ends in "3 4", seen before and followed by 5: q is one-hot on 5.
  assert int(jnp.argmax(logits[0])) == 5 and np.isneginf(np.delete(logits[0], 5)).all()
  # Row 1 repeats nothing: the fallback's own logits.
  np.testing.assert_array_equal(logits[1], plain[1])
  # Extending row 1 with "10 11" creates a 2-gram match ("10 11" -> 10): one-hot again.
  logits, cache = d.extend(model.params, np.array([[5, 6], [10, 11]], np.int32), cache)
  assert int(jnp.argmax(logits[1, -1])) == 10 and np.isneginf(logits[1, -1]).sum() == V - 1
  assert int(d.cache_lengths(cache)[0]) == 7
  rolled = d.rollback(cache, jnp.array([5, 6], jnp.int32))
  assert d.cache_lengths(rolled).tolist() == [5, 6]
  assert rolled.history.lengths.tolist() == [5, 6]
  del plain_cache


@pytest.mark.parametrize('weight', [0.5, 0.8])
def test_lookup_weight_mixes_the_proposal_with_the_fallbacks_q(weight):
  """Where the lookup matches, q = w·δ(its token) + (1 − w)·q_fallback; elsewhere the
  fallback's logits. For w ≥ 1/2 the argmax is the lookup's token (the same greedy drafts as
  w = 1), and the tree path mixes alike."""
  fallback = llama.random_model(vocab_size=V, embed_dim=16, num_layers=1, seed=3)
  d = lookup.lookup_first(fallback, min_ngram=2, weight=weight).definition
  overriding = lookup.lookup_first(fallback, min_ngram=2).definition
  prompts = np.array([[3, 4, 5, 3, 4], [7, 8, 9, 10, 11]], np.int32)
  lengths = np.array([5, 5], np.int32)
  logits, _ = d.prefill(fallback.params, prompts, lengths, d.init_cache(2, 16))
  plain, _ = fallback.definition.prefill(fallback.params, prompts, lengths,
                                         fallback.definition.init_cache(2, 16))
  q_fallback = jax.nn.softmax(plain[0].astype(jnp.float32))
  expected = (1.0 - weight) * q_fallback + weight * jax.nn.one_hot(5, V)  # "3 4" -> 5
  np.testing.assert_allclose(jax.nn.softmax(logits[0]), expected, atol=1e-6)
  np.testing.assert_allclose(logits[1], plain[1], atol=1e-6)  # no match: the fallback's
  one_hot, _ = overriding.prefill(fallback.params, prompts, lengths,
                                  overriding.init_cache(2, 16))
  assert np.array_equal(np.argmax(logits, -1), np.argmax(one_hot, -1))
  tree = token_trees.layout(np.array([[-1, 0], [-1, 0]]))  # a chain: extend_tree = extend
  _, cache = d.prefill(fallback.params, prompts, lengths, d.init_cache(2, 16))
  tokens = np.array([[5, 3], [12, 13]], np.int32)
  chained, _ = d.extend(fallback.params, tokens, cache)
  as_tree, _ = d.extend_tree(fallback.params, tokens, tree, cache)
  np.testing.assert_allclose(jax.nn.softmax(as_tree), jax.nn.softmax(chained), atol=1e-5)
  for bad in (0.0, 1.5):
    with pytest.raises(ValueError, match='lookup_weight'):
      lookup.lookup_first(fallback, weight=bad)


def test_lookup_first_errors():
  fallback = llama.random_model(vocab_size=V, embed_dim=16, num_layers=1, seed=3)
  with pytest.raises(ValueError, match='vocabulary'):
    lookup.LookupFirst(fallback.definition, lookup.PromptLookup(V + 1))
  from speclm.models import t5  # pylint: disable=import-outside-toplevel
  encoder_decoder = t5.random_model(vocab_size=V)
  with pytest.raises(ValueError, match='decoder-only'):
    lookup.lookup_first(encoder_decoder)


def test_drafts_are_protocol_models():
  for model in _drafts().values():
    assert isinstance(model, protocol.Model)
    assert model.vocab_size == V
    model.definition.validate_params(model.params)
    hash(model.definition)


def _last_position_models():
  small = llama.random_model(vocab_size=V, embed_dim=16, num_layers=1, seed=3)
  from speclm.models import subset_vocab  # pylint: disable=import-outside-toplevel
  inner = llama.random_model(vocab_size=9, embed_dim=16, num_layers=1, seed=4)
  return {**_drafts(), 'llama': small,
          'subset_vocab': subset_vocab.wrap(inner, np.arange(3, 11), V),
          'resized_vocab': subset_vocab.resize_vocabulary(small, V + 5)}


@pytest.mark.parametrize('kind', sorted(_last_position_models()))
def test_extend_last_is_extend_at_the_last_position(kind):
  """A draft catching up reads only its last prediction (`LanguageModel.extend_last`): the
  same logits and the same cache as `extend`, for every draft kind and wrapper."""
  model = _last_position_models()[kind]
  d = model.definition
  prompts = np.array([[3, 4, 5, 3, 4], [7, 8, 9, 10, 11]], np.int32)
  lengths = np.array([5, 3], np.int32)
  _, cache = d.prefill(model.params, prompts, lengths, d.init_cache(2, 16))
  tokens = np.array([[5, 3, 4], [10, 11, 9]], np.int32)  # row 0: a lookup match at the end
  logits, full_cache = jax.jit(d.extend)(model.params, tokens, cache)
  last, last_cache = jax.jit(d.extend_last)(model.params, tokens, cache)
  assert last.shape == (2, model.vocab_size)
  np.testing.assert_allclose(last, logits[:, -1], atol=1e-5, rtol=1e-5)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5),
                         last_cache, full_cache)
  np.testing.assert_array_equal(d.cache_lengths(last_cache), [8, 6])
