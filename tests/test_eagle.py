"""The EAGLE-style feature-conditioned draft (`speclm.models.eagle`) and the decode loop's
feature plumbing. Exact sampling with it is checked in `test_exact_sampling.py`; the trained
SmolLM2 draft in `test_smollm2_eagle.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import decoding
from speclm import protocol
from speclm import testing
from speclm import token_trees
from speclm import tree_decoding
from speclm.analysis import measure
from speclm.models import eagle
from speclm.models import llama
from speclm.models import lookup
from speclm.models import t5
from speclm.run import calibration

PROMPTS = np.array([[5, 9, 2, 7, 0, 0, 0], [3, 3, 8, 1, 4, 6, 2]], np.int32)
LENGTHS = np.array([4, 7], np.int32)


@pytest.fixture(scope='module')
def target():
  return llama.random_model(vocab_size=32, embed_dim=32, num_layers=2, seed=4)


@pytest.mark.parametrize('gamma', [1, 3])
@pytest.mark.parametrize('cpu_kernels', [False, True])
def test_greedy_speculative_equals_baseline(target, gamma, cpu_kernels):
  draft = eagle.random_draft(target, num_layers=1, head_size=24, seed=1)
  if cpu_kernels:
    if not llama.cpu_kernels_usable('float32'):
      pytest.skip('the CPU kernel is unavailable here')
    draft = eagle.make(target, draft.definition.trained(draft.params),
                       np.asarray(draft.params['head_ids']), 1, cpu_kernels=True)
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=24)
  spec = speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=gamma,
                                   max_new_tokens=24)
  np.testing.assert_array_equal(spec.tokens, base.tokens)


def test_feature_draft_of_another_family():
  """The feature hand-off of the other families (here Gemma 2: scaled embeddings, post norms,
  sliding layers, soft-capped logits): the draft reads the head's inputs, and greedy decoding
  with it equals the baseline."""
  target = llama.random_model(vocab_size=32, embed_dim=32, num_layers=2, seed=4,
                              family='gemma2', sliding_window=3, final_logit_softcap=5.0)
  cache = target.definition.init_cache(2, 8)
  logits, features, _ = target.definition.prefill_with_features(
      target.params, PROMPTS, LENGTHS, cache)
  last = features[jnp.arange(2), LENGTHS - 1]
  table = target.params['embedder']['embedding']
  np.testing.assert_allclose(5.0 * jnp.tanh(last @ table.T / 5.0), logits, atol=1e-5)
  draft = eagle.random_draft(target, num_layers=1, head_size=24, seed=1)
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=16)
  spec = speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=2,
                                   max_new_tokens=16)
  np.testing.assert_array_equal(spec.tokens, base.tokens)


def _echo_draft(target):
  """An EAGLE draft whose prediction is the feature it is given: `fuse` passes the feature
  through, the layer adds nothing (zero output projections) and the head is the target's full
  embedding. Its q̃ at token s_k is then the target's p̃ at position k−1, so a greedy draft
  proposes the pending token again, γ times, if and only if the loop hands it the right
  features."""
  draft = eagle.random_draft(target, num_layers=1)
  d = target.definition.config.embed_dim
  params = jax.tree_util.tree_map(lambda x: x, draft.params)
  params['fuse'] = {'kernel': jnp.concatenate([jnp.zeros((d, d)), jnp.eye(d)], axis=0)}
  layer = params['layers_0']
  layer['attention']['out']['kernel'] = jnp.zeros_like(layer['attention']['out']['kernel'])
  layer['mlp']['down']['kernel'] = jnp.zeros_like(layer['mlp']['down']['kernel'])
  return protocol.Model(draft.definition, params)


def _accepted_if_repeating(tokens, limit, gamma):
  """Drafted tokens accepted when every proposal repeats the pending token: per round, the
  run of following tokens equal to it (at most γ)."""
  accepted, pending = 0, 0
  while pending + 1 < limit:  # the loop runs while fewer than `limit` tokens were generated
    n = 0
    while n < gamma and tokens[pending + 1 + n] == tokens[pending]:
      n += 1
    accepted += n
    pending += n + 1
  return accepted


GAMMAS = (1, 2, 4)
LIMIT = 40


@pytest.fixture(scope='module')
def six_token_target():
  """A 6-token vocabulary: greedy continuations repeat tokens often, and (with this seed) also
  alternate, so that proposing the wrong token (a feature one position off) shows. With its
  greedy continuation, LIMIT + max(GAMMAS) + 1 tokens: every γ's check reads a prefix of it."""
  target = llama.random_model(vocab_size=6, embed_dim=16, num_layers=2, seed=2)
  base = speclm.autoregressive_decode(target, PROMPTS % 6, LENGTHS,
                                      max_new_tokens=LIMIT + max(GAMMAS) + 1)
  return target, base


@pytest.mark.parametrize('gamma', GAMMAS)
def test_the_draft_gets_the_targets_features(six_token_target, gamma):
  target, base = six_token_target
  prompts = PROMPTS % 6
  limit = LIMIT
  spec = speclm.speculative_decode(target, _echo_draft(target), prompts, LENGTHS, gamma=gamma,
                                   max_new_tokens=limit)
  expected = np.asarray(base.tokens)
  want = [_accepted_if_repeating(row, limit, gamma) for row in expected]
  assert sum(want) > 5  # the check has repeats to find ...
  changes = np.sum(expected[:, 1:limit] != expected[:, :limit - 1], axis=1)
  assert np.all(changes >= 3)  # ... and changes of token
  np.testing.assert_array_equal(spec.stats.accepted_per_row, want)
  np.testing.assert_array_equal(spec.tokens, base.tokens[:, :limit])


def _echo_with_attention_draft(target, seed):
  """The echo draft plus its layer's attention (random output projection, `seed`): its
  proposals mostly repeat the pending token, but also depend on what the draft's cache holds
  for earlier positions, so a wrong feature handed over for any of them shows."""
  echo = _echo_draft(target)
  params = jax.tree_util.tree_map(lambda x: x, echo.params)
  random_out = eagle.random_draft(target, num_layers=1, seed=seed).params['layers_0']
  params['layers_0']['attention']['out'] = random_out['attention']['out']
  return protocol.Model(echo.definition, params)


@pytest.mark.parametrize('seed', [1, 2])
def test_greedy_rounds_replay_on_teacher_forced_beta(target, seed):
  """At γ = 1 every proposal reads true features only, so the loop's β sums, acceptance
  histogram and target calls must equal Algorithm 1 replayed on β teacher-forced with the
  target's features at every position (`testing.check_greedy_replay`). This covers the features
  of earlier positions in the draft's cache, which the echo check above cannot see; a loop that
  kept the wrong feature for prev after a round accepting nothing failed it for both seeds."""
  draft = _echo_with_attention_draft(target, seed)
  replay, _ = testing.check_greedy_replay(target, draft, PROMPTS, LENGTHS, gamma=1,
                                          max_new_tokens=40)
  assert min(replay.accepted_histogram) >= 5  # both kinds of rounds, several times
  with pytest.raises(ValueError, match='γ = 1'):
    testing.check_greedy_replay(target, draft, PROMPTS, LENGTHS, gamma=2, max_new_tokens=8)


def test_features_are_the_heads_inputs(target):
  cache = target.definition.init_cache(2, 8)
  logits, features, _ = target.definition.prefill_with_features(
      target.params, PROMPTS, LENGTHS, cache)
  last = features[jnp.arange(2), LENGTHS - 1]
  table = target.params['embedder']['embedding']
  np.testing.assert_allclose(last @ table.T, logits, rtol=1e-5, atol=1e-5)
  ext_logits, ext_features, _ = target.definition.extend_with_features(
      target.params, PROMPTS, target.definition.init_cache(2, 8))
  np.testing.assert_allclose(ext_features @ table.T, ext_logits, rtol=1e-5, atol=1e-5)


def _shapes_only(definition) -> protocol.Model:
  """A model whose parameters are only shapes: for checks that refuse a pair of models before
  any parameter is read (no weights to initialise, nothing compiled)."""
  return protocol.Model(definition, jax.eval_shape(definition.init_params, jax.random.key(0)))


def test_errors(target):
  draft = eagle.random_draft(target)
  with pytest.raises(TypeError, match='features'):
    draft.definition.extend(draft.params, PROMPTS, draft.definition.init_cache(2, 8))
  encoder_decoder = _shapes_only(t5.T5(t5.tiny_config(vocab_size=32)))
  with pytest.raises(ValueError, match='does not provide them'):
    speclm.speculative_decode(encoder_decoder, draft, PROMPTS, LENGTHS, gamma=2,
                              max_new_tokens=4)
  wide = _shapes_only(llama.Llama(llama.LlamaConfig(
      vocab_size=32, num_layers=1, embed_dim=48, num_heads=4, num_kv_heads=2, head_dim=12,
      mlp_dim=96)))
  with pytest.raises(ValueError, match='features of width'):
    speclm.speculative_decode(wide, draft, PROMPTS, LENGTHS, gamma=2, max_new_tokens=4)
  reference = calibration.generate_reference(target, PROMPTS, LENGTHS, tokens_per_row=4,
                                             sampling=speclm.GREEDY)
  with pytest.raises(ValueError, match='does not provide them'):
    measure.beta_along(encoder_decoder, draft, reference, sampling=speclm.GREEDY)
  with pytest.raises(ValueError, match='at least two'):
    eagle.random_draft(target, feature_layers=(1,))
  with pytest.raises(ValueError, match='decoder layers 0 … 1'):
    speclm.speculative_decode(target, eagle.random_draft(target, feature_layers=(0, 2)),
                              PROMPTS, LENGTHS, gamma=2, max_new_tokens=4)
  trained = draft.definition.trained(draft.params)
  del trained['fuse']
  with pytest.raises(ValueError, match='missing'):
    eagle.make(target, trained, np.arange(32), 1)


# ----------------------------------------------------------------------------------------------
# Prompt lookup first, the feature draft elsewhere (`lookup.lookup_first`)


def test_lookup_first_over_a_feature_draft_proposes_the_match_else_the_draft(target):
  """Where the last 2+ tokens occurred before, q is one-hot on what followed them; elsewhere it
  is the feature draft's own q, and the draft's predicted features are its own everywhere."""
  fallback = eagle.random_draft(target, num_layers=1, head_size=24, seed=1,
                                feature_layers=(0, 1))
  model = lookup.lookup_first(fallback, min_ngram=2)
  d, f = model.definition, fallback.definition
  assert isinstance(d, lookup.LookupFirstWithFeatures)
  assert d.feature_layers == (0, 1) and d.feature_dim == f.feature_dim == 64
  prompts = np.array([[3, 4, 5, 3, 4], [7, 8, 9, 10, 11]], np.int32)
  lengths = np.array([5, 5], np.int32)
  features = jax.random.normal(jax.random.key(0), (2, 5, 64))
  cache = d.prefill_with_features(model.params, prompts, lengths, features, d.init_cache(2, 16))
  plain_cache = f.prefill_with_features(fallback.params, prompts, lengths, features,
                                        f.init_cache(2, 16))
  tokens = np.array([[5, 3], [10, 11]], np.int32)
  more = jax.random.normal(jax.random.key(1), (2, 2, 64))
  logits, predicted, cache = d.extend_with_features(model.params, tokens, more, cache)
  plain, plain_predicted, _ = f.extend_with_features(fallback.params, tokens, more, plain_cache)
  np.testing.assert_array_equal(predicted, plain_predicted)
  # Row 0 is now "3 4 5 3 4 5 3": after "… 4 5" comes 3 (as after the first "4 5"), after
  # "… 4 5 3" comes 4. Row 1 is "7 8 9 10 11 10 11": after "… 10 11" comes 10; "11 10" has no
  # earlier occurrence, so there q is the draft's own.
  for row, position, token in ((0, 0, 3), (0, 1, 4), (1, 1, 10)):
    assert int(jnp.argmax(logits[row, position])) == token
    assert np.isneginf(np.delete(logits[row, position], token)).all()
  np.testing.assert_allclose(logits[1, 0], plain[1, 0], rtol=1e-6)
  assert int(d.cache_lengths(cache)[0]) == 7
  assert d.rollback(cache, jnp.array([5, 6], jnp.int32)).history.lengths.tolist() == [5, 6]


@pytest.mark.parametrize('gamma', [1, 3])
def test_lookup_first_over_a_feature_draft_decodes_exactly(target, gamma):
  draft = eagle.random_draft(target, num_layers=1, head_size=24, seed=1, feature_layers=(0, 1))
  combined = lookup.lookup_first(draft, min_ngram=1)
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=24)
  spec = speclm.speculative_decode(target, combined, PROMPTS, LENGTHS, gamma=gamma,
                                   max_new_tokens=24)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  alone = speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=gamma,
                                    max_new_tokens=24)
  assert spec.stats.accepted_per_row.tolist() != alone.stats.accepted_per_row.tolist()


def test_lookup_first_over_a_feature_draft_replays_on_teacher_forced_beta(six_token_target):
  """γ = 1 rounds of the combination replay on β teacher-forced with the target's features
  (`testing.check_greedy_replay`): the wrapper hands the fallback the features the loop gives
  it, at every position of its cache."""
  target, _ = six_token_target
  draft = lookup.lookup_first(_echo3_draft(target, seed=3), min_ngram=2)
  replay, _ = testing.check_greedy_replay(target, draft, PROMPTS % 6, LENGTHS, gamma=1,
                                          max_new_tokens=40)
  assert min(replay.accepted_histogram) >= 5


def test_costs_of_feature_drafts_are_measured(target):
  """c and the adaptive rule's round costs time a feature draft's calls (it has no plain
  prefill or extend: timing them raised TypeError, so an adaptive job with one failed)."""
  draft = eagle.random_draft(target, num_layers=1, head_size=24, seed=1, feature_layers=(0, 1))
  for model in (draft, lookup.lookup_first(draft, min_ngram=2)):
    costs = calibration.measure_costs(target, model, gamma=2, repeats=1, num_steps=2)
    assert costs.draft_step_seconds > 0 and np.isfinite(costs.c)
  c, verify = calibration.measure_round_costs(target, draft, max_gamma=2, repeats=1,
                                              num_new_tokens=4)
  assert c > 0 and len(verify) == 3 and all(np.isfinite(verify))


# ----------------------------------------------------------------------------------------------
# EAGLE-3: features from several target layers, training-time test


def test_eagle3_reads_the_hidden_states_of_its_layers(target):
  """The target hands out its hidden states after the draft's layers (before any final norm),
  concatenated in the draft's order; its logits are unchanged."""
  tapped = target.definition.with_feature_layers((1, 0))
  assert tapped.feature_dim == 64
  cache = target.definition.init_cache(2, 8)
  logits, final, _ = target.definition.extend_with_features(target.params, PROMPTS, cache)
  tapped_logits, taps, _ = tapped.extend_with_features(target.params, PROMPTS, cache)
  np.testing.assert_array_equal(tapped_logits, logits)
  hidden, _, layer_outputs = target.definition.module.apply(
      {'params': target.params}, PROMPTS, cache, None, (0, 1))
  np.testing.assert_array_equal(hidden, final)
  np.testing.assert_array_equal(taps, jnp.concatenate([layer_outputs[..., 32:],
                                                       layer_outputs[..., :32]], axis=-1))
  assert not np.allclose(taps[..., :32], final)  # the top layer's output is not the head's input


@pytest.mark.parametrize('gamma,input_norms', [(1, False), (3, False), (3, True)])
def test_eagle3_greedy_speculative_equals_baseline(target, gamma, input_norms):
  draft = eagle.random_draft(target, num_layers=1, head_size=24, seed=1, feature_layers=(0, 1),
                             input_norms=input_norms)
  assert set(draft.params) >= {'reduce', 'final_norm', 'fuse', 'layers_0', 'head'}
  assert input_norms == ({'embedding_norm', 'feature_norm'} <= set(draft.params))
  base = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, max_new_tokens=24)
  spec = speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=gamma,
                                   max_new_tokens=24)
  np.testing.assert_array_equal(spec.tokens, base.tokens)


def _echo3_draft(target, seed):
  """An EAGLE-3 draft reading layers (0, 1) of a 2-layer target that nearly echoes, as
  `_echo_draft` does: `reduce` gives h₁ + (h₁ − h₀) (layer 1's hidden state, plus what layer 1
  added: the two layers' order matters), `fuse` passes it on, its final norm is the target's,
  so its q̃ at token s_k is close to the target's p̃ at position k−1; its attention (random
  output projection, `seed`) makes its proposals depend on its cache too."""
  draft = eagle.random_draft(target, num_layers=1, seed=seed, feature_layers=(0, 1))
  d = target.definition.config.embed_dim
  params = jax.tree_util.tree_map(lambda x: x, draft.params)
  params['reduce'] = {'kernel': jnp.concatenate([-jnp.eye(d), 2 * jnp.eye(d)], axis=0)}
  params['fuse'] = {'kernel': jnp.concatenate([jnp.zeros((d, d)), jnp.eye(d)], axis=0)}
  params['final_norm'] = target.params['final_norm']
  params['layers_0']['mlp']['down']['kernel'] = jnp.zeros_like(
      params['layers_0']['mlp']['down']['kernel'])
  return protocol.Model(draft.definition, params)


def test_eagle3_rounds_replay_on_teacher_forced_beta(six_token_target, monkeypatch):
  """As `test_greedy_rounds_replay_on_teacher_forced_beta`, for an EAGLE-3 draft: the loop hands
  it the hidden states of its layers at every position of its cache. A loop that handed them
  over in the wrong order (the wrong layer in each slot) fails the same check."""
  target, _ = six_token_target
  draft = _echo3_draft(target, seed=3)
  replay, _ = testing.check_greedy_replay(target, draft, PROMPTS % 6, LENGTHS, gamma=1,
                                          max_new_tokens=40)
  assert min(replay.accepted_histogram) >= 5

  class SwappingProtocol:  # the decode loop's `protocol`, asking the target for swapped layers
    def __getattr__(self, name):
      return getattr(protocol, name)

    @staticmethod
    def target_for_feature_draft(target, draft):
      layers = draft.definition.feature_layers[::-1]
      return protocol.Model(target.definition.with_feature_layers(layers), target.params)

  monkeypatch.setattr(decoding, 'protocol', SwappingProtocol())
  with pytest.raises(AssertionError):
    testing.check_greedy_replay(target, draft, PROMPTS % 6, LENGTHS, gamma=1, max_new_tokens=40)


def _rounds_on_unrolled_draft(target, draft, prompts, lengths, gamma, limit, tokens):
  """The acceptance histogram of greedy rounds replayed on `eagle.training_time_test` along
  the target's greedy text `tokens` `[B, ≥ limit + γ]`: a round whose pending token sits at
  position v accepts proposal j (0-based) if the unrolled step j's argmax at v + j is the text's
  token at v + j + 1, and every proposal before it was accepted."""
  definition, histogram = draft.definition, np.zeros(gamma + 1, np.int64)
  source = target.definition.with_feature_layers(definition.feature_layers)
  for row in range(prompts.shape[0]):
    sequence = jnp.asarray(np.concatenate([prompts[row, :lengths[row]], tokens[row]])[None])
    width = sequence.shape[1]
    _, features, _ = source.prefill_with_features(target.params, sequence, jnp.array([width]),
                                                  source.init_cache(1, width))
    unrolled = eagle.training_time_test(definition, draft.params, sequence, features, gamma)
    proposals = np.asarray(draft.params['head_ids'])[np.argmax(unrolled[:, 0], axis=-1)]
    pending, generated = int(lengths[row]), 1
    while generated < limit:
      n = 0
      while n < gamma and proposals[n, pending + n] == sequence[0, pending + n + 1]:
        n += 1
      histogram[n] += 1
      pending, generated = pending + n + 1, generated + n + 1
  return histogram


@pytest.mark.parametrize('seed', [3, 4])
def test_every_round_drafts_as_training_time_test_unrolls(six_token_target, seed):
  """At γ = 3 each round's proposals are the unrolled steps of `eagle.training_time_test`:
  the draft's cache holds the target's true features at every position before the round, so
  a round's j-th proposal reads them and its own j − 1 predictions, as training sees it. The
  draft's attention makes its proposals depend on what its cache holds; a loop that re-read
  only the newest two tokens (leaving accepted x_1 … x_{n−1} with the draft's predicted
  features) fails the check for both seeds."""
  target, base = six_token_target
  gamma, limit, prompts = 3, LIMIT, PROMPTS % 6
  draft = _echo3_draft(target, seed)
  spec = speclm.speculative_decode(target, draft, prompts, LENGTHS, gamma=gamma,
                                   max_new_tokens=limit)
  np.testing.assert_array_equal(spec.tokens, base.tokens[:, :limit])
  histogram = _rounds_on_unrolled_draft(target, draft, prompts, LENGTHS, gamma, limit,
                                        np.asarray(base.tokens))
  assert histogram[2:].sum() >= 3  # rounds that kept two or more proposals, x_1 re-read
  np.testing.assert_array_equal(np.asarray(spec.stats.accepted_histogram), histogram)
  # The tree loop's root read re-reads the kept path the same way.
  tree = tree_decoding.tree_speculative_decode(target, draft, prompts, LENGTHS,
                                               tree=token_trees.TreeShape.chain(gamma),
                                               max_new_tokens=limit)
  np.testing.assert_array_equal(tree.tokens, base.tokens[:, :limit])
  np.testing.assert_array_equal(np.asarray(tree.stats.accepted_histogram), histogram)


@pytest.mark.parametrize('feature_layers,input_norms', [(None, False), ((0, 1), False),
                                                        ((0, 1), True)])
def test_training_time_test_unrolls_as_the_draft_drafts(target, feature_layers, input_norms):
  """Step j of `eagle.training_time_test` at position t gives the logits the draft computes in a
  round: prefilled and re-fed with the target's features up to the verified position t − j,
  then extended token by token on its own predicted features."""
  draft = eagle.random_draft(target, num_layers=1, seed=2, feature_layers=feature_layers,
                             input_norms=input_norms)
  definition = draft.definition
  tokens = jnp.asarray(PROMPTS[1:])  # [1, 7]
  source = target.definition.with_feature_layers(feature_layers)
  _, features, _ = source.prefill_with_features(target.params, tokens, jnp.array([7]),
                                                source.init_cache(1, 7))
  steps = 3
  unrolled = eagle.training_time_test(definition, draft.params, tokens, features, steps)
  assert unrolled.shape == (steps, 1, 7, 32)
  before = jnp.pad(features[:, :-1], ((0, 0), (1, 0), (0, 0)))
  for step in range(steps):
    for t in range(step, 7):
      verified = t - step
      own, logits, cache = definition.apply(draft.params, tokens[:, :verified + 1],
                                            before[:, :verified + 1], definition.init_cache(1, 8))
      for position in range(verified + 1, t + 1):
        own, logits, cache = definition.apply(draft.params, tokens[:, position:position + 1],
                                              own[:, -1:], cache)
      np.testing.assert_allclose(unrolled[step, 0, t], logits[0, -1], rtol=2e-5, atol=2e-5,
                                 err_msg=f'step {step} position {t}')


def test_a_deepened_draft_starts_where_the_shallower_one_was(target):
  """`eagle.deepen` appends layers that start as identities: the 2-layer draft's training-time
  logits equal the 1-layer draft's bit for bit, and training moves them (the new layer's
  gradient is not zero)."""
  tokens = jnp.asarray(PROMPTS[1:])
  source = target.definition.with_feature_layers((0, 1))
  _, features, _ = source.prefill_with_features(target.params, tokens, jnp.array([7]),
                                                source.init_cache(1, 7))
  shallow = eagle.random_draft(target, num_layers=1, seed=2, feature_layers=(0, 1))
  wide = eagle.random_draft(target, num_layers=2, seed=3, feature_layers=(0, 1))
  trained = eagle.deepen(shallow.definition.trained(shallow.params),
                         {'layers_1': wide.definition.trained(wide.params)['layers_1']})
  params = wide.definition.with_target_embedding(
      {k: v for k, v in trained.items() if k != 'head'}, llama.embedding_table(target),
      shallow.params['head_ids'])
  deep = eagle.training_time_test(wide.definition, params, tokens, features, 2)
  np.testing.assert_array_equal(
      deep, eagle.training_time_test(shallow.definition, shallow.params, tokens, features, 2))

  def loss(layer):
    return jnp.sum(eagle.training_time_test(wide.definition, {**params, 'layers_1': layer},
                                            tokens, features, 2) ** 2)
  grads = jax.grad(loss)(params['layers_1'])
  assert float(jnp.abs(grads['mlp']['down']['kernel']).max()) > 0
  assert float(jnp.abs(grads['attention']['out']['kernel']).max()) > 0
  with pytest.raises(ValueError, match='layers_0 is already'):
    eagle.deepen(trained, {'layers_0': trained['layers_0']})
