"""The EAGLE-style feature-conditioned draft (`speclm.models.eagle`) and the decode loop's
feature plumbing. Exact sampling with it is checked in `test_exact_sampling.py`; the trained
SmolLM2 draft in `test_smollm2_eagle.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import protocol
from speclm import testing
from speclm.analysis import measure
from speclm.models import eagle
from speclm.models import llama
from speclm.models import t5

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
  reference = measure.generate_reference(target, PROMPTS, LENGTHS, tokens_per_row=4,
                                         sampling=speclm.GREEDY)
  with pytest.raises(TypeError, match='FeatureSource'):
    measure.beta_along(encoder_decoder, draft, reference, sampling=speclm.GREEDY)
  trained = draft.definition.trained(draft.params)
  del trained['fuse']
  with pytest.raises(ValueError, match='missing'):
    eagle.make(target, trained, np.arange(32), 1)
