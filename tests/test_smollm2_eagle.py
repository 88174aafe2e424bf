"""The shipped EAGLE-3 draft for SmolLM2 (speclm/assets/smollm2_eagle,
`@smollm2_eagle_draft_model`): its file matches its model card (hash, sizes, shapes), greedy
decoding with it equals the target's own, and speculative sampling with its real q̃ leaves the
target's p̃ (χ²)."""

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm import protocol
from speclm import speculative
from speclm import testing
from speclm.analysis import measure
from speclm.data import builtin_prompts
from speclm.models import eagle
from speclm.models import lookup
from speclm.presets import smollm2
from speclm.presets import smollm2_draft

pytestmark = pytest.mark.skipif(not smollm2.is_available(),
                                reason=f'SmolLM2 is not installed: {smollm2.SETUP_COMMAND}')

PATH = os.path.join(smollm2_draft.EAGLE_DIR, smollm2_draft.EAGLE_FILE)


@pytest.fixture(scope='module')
def target():
  return smollm2.load_model()


@pytest.fixture(scope='module')
def shipped():
  return smollm2_draft.read(PATH)


def test_file_matches_model_card(shipped):
  trained, head_ids, metadata = shipped
  assert os.path.getsize(PATH) <= 20e6
  card = open(os.path.join(smollm2_draft.EAGLE_DIR, 'MODEL_CARD.md'), encoding='utf-8').read()
  with open(PATH, 'rb') as f:
    assert f'sha256 `{hashlib.sha256(f.read()).hexdigest()}`' in card
  assert f"{metadata['head_size']} tokens" in card
  assert len(head_ids) == metadata['head_size'] == len(np.unique(head_ids))
  assert metadata['feature_layers'] == list(eagle.eagle3_layers(30))
  width = metadata['embed_dim']
  assert trained['reduce']['kernel'].shape == (3 * width, width)
  assert trained['fuse']['kernel'].shape == (2 * width, width)
  assert f"{metadata['num_layers']} Llama layer(s)" in card
  assert sorted(k for k in trained if k.startswith('layers_')) == [
      f'layers_{i}' for i in range(metadata['num_layers'])]
  assert trained['layers_0']['attention']['query']['kernel'].shape[0] == width


@pytest.mark.slow
def test_greedy_decoding_behind_lookup_equals_the_target(target):
  draft = smollm2_draft.load_eagle(target, cpu_kernels=True)
  tok = smollm2.load_tokenizer()
  prompts = builtin_prompts.heldout_prompts(2) + builtin_prompts.demo_prompts()[:2]
  tokens, lengths = tok.batch([tok.encode_chat(p) for p in prompts])
  kwargs = dict(max_new_tokens=24, eos_id=tok.eos_id)
  base = speclm.autoregressive_decode(target, tokens, lengths, **kwargs)
  for proposer in (draft, lookup.lookup_first(draft, min_ngram=2)):
    spec = speclm.speculative_decode(target, proposer, tokens, lengths, gamma=3, **kwargs)
    np.testing.assert_array_equal(spec.tokens, base.tokens)
    assert spec.stats.alpha > 0.1  # the draft was read, and its proposals were kept


def _round_samples(p, q, num_samples, seed, residual=True):
  """The token each of `num_samples` γ = 1 rounds appends (Algorithm 1 with the draft's x ~ q;
  `residual=False` resamples from p after a rejection, a wrong sampler the test must catch).
  The test's own draws (x ~ q, the wrong resample ~ p) invert the cumulative distribution: one
  uniform a row, where `jax.random.categorical` makes 1,024 Gumbel draws a row."""

  def draw(key, probs, rows):
    cumulative = jnp.cumsum(probs)
    u = jax.random.uniform(key, (rows,)) * cumulative[-1]
    return jnp.minimum(jnp.searchsorted(cumulative, u, side='right'), probs.shape[-1] - 1)

  @jax.jit
  def chunk(key):
    draw_key, uniform_key, round_key = jax.random.split(key, 3)
    rows = 2_000
    x = draw(draw_key, q, rows)
    uniforms = jax.random.uniform(uniform_key, (rows, 1))
    if not residual:
      keep = uniforms[:, 0] < jnp.minimum(1.0, p[x] / q[x])
      return jnp.where(keep, x, draw(round_key, p, rows))
    result = speculative.speculative_round(
        jnp.broadcast_to(q, (rows, 1, q.shape[-1])), x[:, None],
        jnp.broadcast_to(p, (rows, 2, p.shape[-1])), uniforms, round_key)
    return jnp.where(result.num_accepted == 1, x, result.next_token)

  keys = jax.random.split(jax.random.key(seed), num_samples // 2_000)
  return np.concatenate([np.asarray(chunk(k)) for k in keys])


@pytest.mark.slow
def test_sampling_with_the_drafts_real_distributions_is_exact(target):
  """One round at T = 1 with p̃ and q̃ the target's and the shipped draft's own distributions for
  the token after a reply's first (teacher-forced, as `measure.beta_along` computes β; q̃ = 0
  outside the draft's 8,192-token head), on the tokens that carry their mass: the appended
  token must follow p̃ (χ²), and resampling from p̃ instead of the residual must be rejected."""
  draft = smollm2_draft.load_eagle(target)
  feature_target = protocol.target_for_feature_draft(target, draft)
  tok = smollm2.load_tokenizer()
  prompt = tok.encode_chat(builtin_prompts.heldout_prompts(1)[0])
  reply = speclm.autoregressive_decode(target, np.asarray([prompt]), np.asarray([len(prompt)]),
                                       max_new_tokens=3).tokens
  # pylint: disable-next=protected-access
  target_logits, draft_logits = measure._teacher_forced_with_features(
      feature_target.definition, draft.definition, feature_target.params, draft.params,
      jnp.asarray([prompt]), jnp.asarray([len(prompt)]), jnp.asarray(reply))
  p = jax.nn.softmax(target_logits[0, 1])
  q = jax.nn.softmax(draft_logits[0, 0])
  # The 1,024 tokens where either puts the most mass, renormalized: the same shapes of p̃ and
  # q̃ (q̃ = 0 on tokens outside the head), and 200,000 rounds over them take seconds.
  top = jnp.argsort(-jnp.maximum(p, q))[:1024]
  assert float(p[top].sum()) > 0.95 and float(q[top].sum()) > 0.95
  p, q = p[top] / p[top].sum(), q[top] / q[top].sum()
  beta = float(speculative.acceptance_overlap(p, q))
  assert 0.05 < beta < 0.95, beta  # both acceptance and rejection happen often
  samples = _round_samples(p, q, 200_000, seed=1)
  pvalue = testing.chi_square_pvalue(samples, np.asarray(p, np.float64))
  assert pvalue > 1e-3, (pvalue, beta)
  wrong = _round_samples(p, q, 200_000, seed=1, residual=False)
  assert testing.chi_square_pvalue(wrong, np.asarray(p, np.float64)) < 1e-3
