"""Rows whose logits turn NaN stop with BAD_LOGITS and output no token drawn from them.

A wrapper model returns NaN logits for one row from a fixed sequence position on (or at
prefill); the other row of the batch must decode exactly as without the fault.
"""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import protocol
from speclm.models import llama

VOCAB = 48
MAX_NEW = 12
BAD = speclm.StopReason.BAD_LOGITS


@dataclasses.dataclass(frozen=True)
class _Faulty(protocol.WrappedLanguageModel):
  """`inner` with NaN logits for row `row`: at prefill if `at_prefill`, and in `extend` at
  every input position >= `from_position` (the logits predicting the token after it)."""

  inner: protocol.LanguageModel
  row: int = 1
  from_position: int | None = None
  at_prefill: bool = False

  @property
  def vocab_size(self) -> int:  # type: ignore[override]
    return self.inner.vocab_size

  def init_cache(self, batch_size, max_length):
    return self.inner.init_cache(batch_size, max_length)

  def last_prefix_token(self, inputs, input_lengths):
    return self.inner.last_prefix_token(inputs, input_lengths)

  def prefill(self, params, inputs, input_lengths, cache):
    logits, cache = self.inner.prefill(params, inputs, input_lengths, cache)
    if self.at_prefill:
      logits = logits.at[self.row].set(jnp.nan)
    return logits, cache

  def extend(self, params, tokens, cache):
    positions = self.inner.cache_lengths(cache)[:, None] + jnp.arange(tokens.shape[1])
    logits, cache = self.inner.extend(params, tokens, cache)
    if self.from_position is not None:
      rows = jnp.arange(tokens.shape[0])[:, None]
      fault = (rows == self.row) & (positions >= self.from_position)
      logits = jnp.where(fault[..., None], jnp.nan, logits)
    return logits, cache


def _faulty(model: speclm.Model, **kwargs) -> speclm.Model:
  return speclm.Model(_Faulty(model.definition, **kwargs), model.params)


@pytest.fixture(scope='module')
def target():
  return llama.random_model(vocab_size=VOCAB, embed_dim=32, num_layers=1, seed=0)


@pytest.fixture(scope='module')
def draft():
  return llama.random_model(vocab_size=VOCAB, embed_dim=16, num_layers=1, seed=7)


PROMPTS = np.array([[3, 14, 15, 9, 2], [6, 5, 35, 0, 0]])
LENGTHS = np.array([5, 3])
GOOD_TOKENS = 4  # row 1's logits are NaN from position LENGTHS[1] + GOOD_TOKENS on
FAULT = int(LENGTHS[1]) + GOOD_TOKENS
KWARGS = dict(max_new_tokens=MAX_NEW, seed=3)


def _check(result, clean, bad_length):
  """Row 0 as without the fault; row 1 stopped with BAD_LOGITS after `bad_length` tokens,
  which are the fault-free run's (the random draws do not depend on other rows)."""
  tokens, clean_tokens = np.asarray(result.tokens), np.asarray(clean.tokens)
  np.testing.assert_array_equal(tokens[0], clean_tokens[0])
  assert int(result.lengths[0]) == int(clean.lengths[0])
  assert int(result.stop_reasons[0]) == int(clean.stop_reasons[0])
  assert int(result.stop_reasons[1]) == BAD
  assert int(result.lengths[1]) == bad_length
  np.testing.assert_array_equal(tokens[1, :bad_length], clean_tokens[1, :bad_length])
  assert np.all(tokens[1, bad_length:] == 0)  # pad_id past the row's length
  stats, clean_stats = result.stats, clean.stats
  for field in ('target_calls_per_row', 'accepted_per_row', 'beta_count_per_row'):
    assert np.asarray(getattr(stats, field))[0] == np.asarray(getattr(clean_stats, field))[0]
  assert np.asarray(stats.beta_sum_per_row)[0] == pytest.approx(
      np.asarray(clean_stats.beta_sum_per_row)[0], rel=1e-5)
  assert np.all(np.isfinite(np.asarray(stats.beta_sum_per_row)))


def test_autoregressive_outputs_no_token_from_bad_logits(target):
  clean = speclm.autoregressive_decode(target, PROMPTS, LENGTHS, **KWARGS)
  result = speclm.autoregressive_decode(_faulty(target, from_position=FAULT), PROMPTS, LENGTHS,
                                        **KWARGS)
  # The prefill's token and one per extend at positions P … P+GOOD_TOKENS−1.
  _check(result, clean, GOOD_TOKENS + 1)


@pytest.mark.parametrize('sampling', [speclm.GREEDY, speclm.SamplingConfig(temperature=1.0)])
def test_speculative_discards_a_round_with_bad_target_logits(target, sampling):
  # A draft equal to the target accepts all γ = 2 each round: 1, 4, 7, … tokens. The round
  # after 4 tokens verifies positions P+3 … P+5, reaching the fault: it appends nothing.
  kwargs = dict(KWARGS, gamma=2, sampling=sampling)
  clean = speclm.speculative_decode(target, target, PROMPTS, LENGTHS, **kwargs)
  result = speclm.speculative_decode(_faulty(target, from_position=FAULT), target, PROMPTS,
                                     LENGTHS, **kwargs)
  _check(result, clean, 4)


def test_speculative_with_any_draft_stops_before_the_fault(target, draft):
  # The row stops in the round whose γ+1 verified positions reach the fault, with at most
  # the tokens before it and at least those of the rounds before.
  gamma = 3
  clean = speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=gamma, **KWARGS)
  result = speclm.speculative_decode(_faulty(target, from_position=FAULT), draft, PROMPTS,
                                     LENGTHS, gamma=gamma, **KWARGS)
  length = int(result.lengths[1])
  assert GOOD_TOKENS + 1 - gamma <= length <= GOOD_TOKENS + 1
  _check(result, clean, length)


def test_speculative_discards_a_round_with_bad_draft_logits(target):
  # The self-draft's round after 4 tokens reads positions P+2 … P+4 and meets the fault.
  clean = speclm.speculative_decode(target, target, PROMPTS, LENGTHS, gamma=2, **KWARGS)
  result = speclm.speculative_decode(target, _faulty(target, from_position=FAULT), PROMPTS,
                                     LENGTHS, gamma=2, **KWARGS)
  _check(result, clean, 4)


def test_bad_prefill_logits_give_no_tokens(target, draft):
  faulty = _faulty(target, at_prefill=True)
  _check(speclm.autoregressive_decode(faulty, PROMPTS, LENGTHS, **KWARGS),
         speclm.autoregressive_decode(target, PROMPTS, LENGTHS, **KWARGS), 0)
  _check(speclm.speculative_decode(faulty, draft, PROMPTS, LENGTHS, gamma=3, **KWARGS),
         speclm.speculative_decode(target, draft, PROMPTS, LENGTHS, gamma=3, **KWARGS), 0)
