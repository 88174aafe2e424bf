"""The compiled decode loops: greedy exactness, stop reasons, statistics, errors, recompiles."""

import dataclasses
import re

import jax
import numpy as np
import pytest

import speclm
from speclm import decoding
from speclm import protocol
from speclm.models import llama

VOCAB = 48
MAX_NEW = 24


def _perturbed(model: speclm.Model, scale: float, seed: int) -> speclm.Model:
  """A draft related to `model`: its weights plus relative Gaussian noise."""
  leaves, tree = jax.tree_util.tree_flatten(model.params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  noisy = [x + scale * jax.numpy.std(x) * jax.random.normal(k, x.shape, x.dtype)
           for x, k in zip(leaves, keys)]
  return speclm.Model(model.definition, jax.tree_util.tree_unflatten(tree, noisy))


@pytest.fixture(scope='module')
def target():
  return llama.random_model(vocab_size=VOCAB, embed_dim=32, num_layers=2, seed=0)


@pytest.fixture(scope='module')
def drafts(target):
  return {
      'self': target,  # every round accepts γ (α = 1)
      'unrelated': llama.random_model(vocab_size=VOCAB, embed_dim=16, num_layers=1, seed=7),
      'related': _perturbed(target, 0.3, seed=1),
  }


@pytest.fixture(scope='module')
def prompts():
  rng = np.random.RandomState(0)
  lengths = np.array([9, 2, 5, 1])
  tokens = rng.randint(0, VOCAB, size=(4, 9))
  return tokens, lengths


@pytest.fixture(scope='module')
def baseline(target, prompts):
  return speclm.autoregressive_decode(target, *prompts, max_new_tokens=MAX_NEW)


@pytest.mark.parametrize('gamma', [1, 3, 7])
@pytest.mark.parametrize('draft_name', ['self', 'unrelated', 'related'])
def test_greedy_speculative_equals_baseline(target, drafts, prompts, baseline, gamma,
                                            draft_name):
  result = speclm.speculative_decode(target, drafts[draft_name], *prompts, gamma=gamma,
                                     max_new_tokens=MAX_NEW)
  np.testing.assert_array_equal(result.tokens, baseline.tokens)
  np.testing.assert_array_equal(result.lengths, baseline.lengths)
  np.testing.assert_array_equal(result.stop_reasons, [speclm.StopReason.MAX_NEW_TOKENS] * 4)
  stats = result.stats
  hist = np.asarray(stats.accepted_histogram)
  assert hist.shape == (gamma + 1,)
  assert hist.sum() == np.asarray(stats.target_calls_per_row).sum() - 4  # minus prefills
  assert int(stats.draft_calls) == 1 + gamma * (int(stats.target_calls) - 1)
  if draft_name == 'self':
    assert stats.alpha == pytest.approx(1.0)
    assert hist[:-1].sum() == 0  # every round kept all γ guesses
    # ceil((MAX_NEW − 1) / (γ + 1)) rounds after the prefill's first token.
    assert int(stats.target_calls) == 1 + -(-(MAX_NEW - 1) // (gamma + 1))
  else:
    assert 0.0 <= stats.alpha < 1.0
  # Tokens per target call: each round yields n + 1 tokens.
  rounds = np.asarray(stats.target_calls_per_row) - 1
  produced = np.asarray(stats.accepted_per_row) + rounds + 1
  assert np.all(produced >= np.asarray(result.lengths))


def test_related_draft_is_better_than_unrelated(target, drafts, prompts):
  alphas = {name: speclm.speculative_decode(target, drafts[name], *prompts, gamma=3,
                                            max_new_tokens=MAX_NEW).stats.alpha
            for name in ('related', 'unrelated')}
  assert alphas['related'] > alphas['unrelated']


def test_end_of_sequence_mid_generation(target, drafts, prompts, baseline):
  # Pick as end token one that the baseline emits mid-way in some row.
  row = 1
  eos = int(np.asarray(baseline.tokens)[row, 5])
  base = speclm.autoregressive_decode(target, *prompts, max_new_tokens=MAX_NEW, eos_id=eos)
  first = int(np.argmax(np.asarray(baseline.tokens)[row] == eos))
  assert int(base.lengths[row]) == first + 1
  assert int(base.stop_reasons[row]) == speclm.StopReason.END_OF_SEQUENCE
  assert np.all(np.asarray(base.tokens)[row, first + 1:] == 0)  # padded after the end
  for gamma in (1, 3, 7):
    for name in ('related', 'unrelated'):
      spec = speclm.speculative_decode(target, drafts[name], *prompts, gamma=gamma,
                                       max_new_tokens=MAX_NEW, eos_id=eos)
      np.testing.assert_array_equal(spec.tokens, base.tokens)
      np.testing.assert_array_equal(spec.lengths, base.lengths)
      np.testing.assert_array_equal(spec.stop_reasons, base.stop_reasons)


def test_several_end_tokens(target, drafts, prompts, baseline):
  """eos_id as a list (a chat model's end-of-turn and end-of-text ids): each row ends at the
  first of them it generates, in both loops."""
  generated = np.asarray(baseline.tokens)
  ends = [int(generated[0, 4]), int(generated[2, 6])]
  base = speclm.autoregressive_decode(target, *prompts, max_new_tokens=MAX_NEW, eos_id=ends)
  for row in range(generated.shape[0]):
    hits = np.flatnonzero(np.isin(generated[row, :MAX_NEW], ends))
    assert int(base.lengths[row]) == (hits[0] + 1 if hits.size else MAX_NEW)
  spec = speclm.speculative_decode(target, drafts['related'], *prompts, gamma=3,
                                   max_new_tokens=MAX_NEW, eos_id=ends)
  assert spec.to_lists() == base.to_lists()
  np.testing.assert_array_equal(spec.stop_reasons, base.stop_reasons)
  with pytest.raises(ValueError, match='several of them'):
    speclm.autoregressive_decode(target, *prompts, eos_id=[1, 10**6])


def test_per_row_max_new_tokens(target, drafts, prompts, baseline):
  limits = [3, MAX_NEW, 1, 10]
  spec = speclm.speculative_decode(target, drafts['related'], *prompts, gamma=3,
                                   max_new_tokens=limits)
  np.testing.assert_array_equal(spec.lengths, limits)
  for b, limit in enumerate(limits):
    np.testing.assert_array_equal(np.asarray(spec.tokens)[b, :limit],
                                  np.asarray(baseline.tokens)[b, :limit])


def test_cache_full_stops_rows(target, drafts, prompts):
  # Room for the 9-token prompt and a few tokens: rows stop with CACHE_FULL, output a prefix.
  base = speclm.autoregressive_decode(target, *prompts, max_new_tokens=MAX_NEW,
                                      cache_length=14)
  full = speclm.StopReason.CACHE_FULL
  assert int(base.stop_reasons[0]) == full
  spec = speclm.speculative_decode(target, drafts['related'], *prompts, gamma=3,
                                   max_new_tokens=MAX_NEW, cache_length=14)
  assert int(spec.stop_reasons[0]) == full
  reference = speclm.autoregressive_decode(target, *prompts, max_new_tokens=MAX_NEW)
  for result in (base, spec):
    for b in range(4):
      n = int(result.lengths[b])
      assert n >= 1
      np.testing.assert_array_equal(np.asarray(result.tokens)[b, :n],
                                    np.asarray(reference.tokens)[b, :n])


def test_bad_logits_are_reported(target, prompts, baseline):
  broken = speclm.Model(target.definition, jax.tree_util.tree_map(
      lambda x: x * np.nan, target.params))
  result = speclm.autoregressive_decode(broken, *prompts, max_new_tokens=4)
  np.testing.assert_array_equal(result.stop_reasons, [speclm.StopReason.BAD_LOGITS] * 4)
  np.testing.assert_array_equal(result.lengths, [0] * 4)  # the prefill's logits were bad
  spec = speclm.speculative_decode(target, broken, *prompts, gamma=2, max_new_tokens=4)
  np.testing.assert_array_equal(spec.stop_reasons, [speclm.StopReason.BAD_LOGITS] * 4)
  # The target's first token stands; the first round's drafts were bad, so nothing after it.
  np.testing.assert_array_equal(spec.lengths, [1] * 4)
  np.testing.assert_array_equal(np.asarray(spec.tokens)[:, 0], np.asarray(baseline.tokens)[:, 0])


@dataclasses.dataclass(frozen=True)
class _WithContext(protocol.WrappedLanguageModel):
  """`inner` declaring a context length, as checkpoint-loaded models do."""

  inner: protocol.LanguageModel
  max_context_length: int | None = None

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    return self.inner.vocab_size

  def init_cache(self, batch_size, max_length):
    return self.inner.init_cache(batch_size, max_length)

  def prefill(self, params, inputs, input_lengths, cache):
    return self.inner.prefill(params, inputs, input_lengths, cache)

  def extend(self, params, tokens, cache):
    return self.inner.extend(params, tokens, cache)

  def last_prefix_token(self, inputs, input_lengths):
    return self.inner.last_prefix_token(inputs, input_lengths)


def _with_context(model, context):
  return speclm.Model(_WithContext(model.definition, context), model.params)


def test_prompt_and_new_tokens_beyond_the_context_are_refused(target, drafts, prompts):
  tokens, lengths = prompts  # the longest prompt has 9 tokens
  short = _with_context(target, 9 + 6)
  message = ('prompt of 9 tokens + max_new_tokens 7 exceeds the model\'s context of 15'
             ' tokens; shorten the prompt or lower max_new_tokens')
  with pytest.raises(ValueError, match=re.escape(message)):
    speclm.autoregressive_decode(short, tokens, lengths, max_new_tokens=7)
  with pytest.raises(ValueError, match=re.escape(message.replace('model', 'target'))):
    speclm.speculative_decode(short, drafts['related'], tokens, jax.numpy.asarray(lengths),
                              gamma=2, max_new_tokens=7)
  with pytest.raises(ValueError, match="the draft's context of 15 tokens"):
    speclm.speculative_decode(target, _with_context(drafts['related'], 15), tokens, lengths,
                              gamma=2, max_new_tokens=7)
  # Per-row limits: the row that overflows is named.
  with pytest.raises(ValueError, match='prompt of 2 tokens \\+ max_new_tokens 20 exceeds'):
    speclm.autoregressive_decode(short, tokens, lengths, max_new_tokens=[1, 20, 1, 1])
  # Exactly the context fits.
  fits = speclm.speculative_decode(short, _with_context(drafts['related'], 15), tokens, lengths,
                                   gamma=2, max_new_tokens=6)
  np.testing.assert_array_equal(fits.tokens, np.asarray(
      speclm.speculative_decode(target, drafts['related'], tokens, lengths, gamma=2,
                                max_new_tokens=6).tokens))
  # No declared context (None, or no attribute at all): no limit.
  speclm.autoregressive_decode(_with_context(target, None), tokens, lengths, max_new_tokens=7)


def test_llama_context_length_from_its_config(target, prompts):
  config = dataclasses.replace(target.definition.config, max_position_embeddings=12)
  model = speclm.Model(llama.Llama(config), target.params)
  assert model.definition.max_context_length == 12
  with pytest.raises(ValueError, match="exceeds the model's context of 12 tokens"):
    speclm.autoregressive_decode(model, *prompts, max_new_tokens=4)


def test_no_recompile_for_new_prompts_and_seeds(target, drafts):
  rng = np.random.RandomState(5)
  kwargs = dict(gamma=3, max_new_tokens=8, sampling=speclm.SamplingConfig(temperature=1.0))
  speclm.speculative_decode(target, drafts['related'], rng.randint(0, VOCAB, (2, 6)),
                            np.array([6, 3]), seed=0, **kwargs)
  compiled = decoding.speculative_jit._cache_size()
  for seed in (1, 2):
    speclm.speculative_decode(target, drafts['related'], rng.randint(0, VOCAB, (2, 6)),
                              np.array([2, 5]), seed=seed, eos_id=seed, **kwargs)
  assert decoding.speculative_jit._cache_size() == compiled
  speclm.autoregressive_decode(target, rng.randint(0, VOCAB, (2, 6)), np.array([6, 3]),
                               max_new_tokens=8)
  compiled = decoding.autoregressive_jit._cache_size()
  speclm.autoregressive_decode(target, rng.randint(0, VOCAB, (2, 6)), np.array([1, 4]),
                               max_new_tokens=8, seed=3)
  assert decoding.autoregressive_jit._cache_size() == compiled


def test_sampled_decode_is_reproducible(target, drafts, prompts):
  kwargs = dict(gamma=3, max_new_tokens=12, sampling=speclm.SamplingConfig(temperature=1.0))
  a = speclm.speculative_decode(target, drafts['related'], *prompts, seed=11, **kwargs)
  b = speclm.speculative_decode(target, drafts['related'], *prompts, seed=11, **kwargs)
  c = speclm.speculative_decode(target, drafts['related'], *prompts, seed=12, **kwargs)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert not np.array_equal(a.tokens, c.tokens)


@pytest.mark.parametrize('kwargs,message', [
    (dict(gamma=0), 'gamma'),
    (dict(gamma=2.0), 'gamma'),
    (dict(max_new_tokens=0), 'max_new_tokens'),
    (dict(eos_id=VOCAB), 'eos_id'),
    (dict(prompt_lengths=np.array([10, 1, 1, 1])), 'prompt_lengths'),
    (dict(prompt_lengths=np.array([0, 1, 1, 1])), 'prompt_lengths'),
    (dict(prompt_tokens=np.zeros((0, 4), np.int32), prompt_lengths=np.zeros((0,), np.int32)),
     'empty'),
    (dict(prompt_tokens=np.full((4, 9), VOCAB)), 'prompt_tokens'),
    (dict(cache_length=5), 'does not fit'),
])
def test_bad_input_fails_before_tracing(target, drafts, prompts, kwargs, message):
  args = dict(prompt_tokens=prompts[0], prompt_lengths=prompts[1], gamma=2)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    speclm.speculative_decode(target, drafts['related'], **args)


def test_vocabulary_mismatch_is_rejected(target, prompts):
  other = llama.random_model(vocab_size=VOCAB + 1, embed_dim=16, num_layers=1)
  with pytest.raises(ValueError, match='vocabularies differ'):
    speclm.speculative_decode(target, other, *prompts, gamma=2)
