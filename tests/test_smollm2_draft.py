"""The shipped SmolLM2 draft: it loads, matches its model card, and keeps its α."""

import os

import numpy as np
import pytest

import speclm
from speclm.data import builtin_prompts
from speclm.presets import smollm2
from speclm.presets import smollm2_draft

pytestmark = pytest.mark.skipif(not smollm2.is_available(),
                                reason=f'SmolLM2 is not installed: {smollm2.SETUP_COMMAND}')


@pytest.fixture(scope='module')
def target():
  return smollm2.load_model()


@pytest.fixture(scope='module')
def shipped():
  return smollm2_draft.read()


def test_file_matches_model_card(shipped):
  trained, subset_ids, metadata = shipped
  path = os.path.join(smollm2_draft.DRAFT_DIR, smollm2_draft.WEIGHTS_FILE)
  assert os.path.getsize(path) <= 20e6
  card = open(os.path.join(smollm2_draft.DRAFT_DIR, 'MODEL_CARD.md'), encoding='utf-8').read()
  assert f"{metadata['subset_size']} tokens" in card
  assert len(subset_ids) == metadata['subset_size']
  assert len(np.unique(subset_ids)) == len(subset_ids)
  layers = sorted(k for k in trained if k.startswith('layers_'))
  assert len(layers) == metadata['num_layers']
  width = metadata['embed_dim']
  assert trained['layers_0']['attention']['query']['kernel'].shape[0] == width
  assert trained['other_embedding'].shape == (width,)


@pytest.mark.slow
def test_alpha_on_heldout_prompts_matches_the_card(target, shipped):
  _, _, metadata = shipped
  draft = smollm2_draft.load(target)
  assert draft.vocab_size == target.vocab_size
  tok = smollm2.load_tokenizer()
  prompts = builtin_prompts.heldout_prompts(metadata['heldout']['prompts'])
  tokens, lengths = tok.batch([tok.encode_chat(p) for p in prompts])
  kwargs = dict(max_new_tokens=64, eos_id=tok.eos_id, seed=metadata['seed'])
  spec = speclm.speculative_decode(target, draft, tokens, lengths, gamma=metadata['gamma'],
                                   **kwargs)
  card_alpha = metadata['heldout']['alpha_t0']
  assert spec.stats.alpha >= card_alpha - 0.05, (spec.stats.alpha, card_alpha)
  # Greedy speculative output is the target's own greedy output.
  base = speclm.autoregressive_decode(target, tokens, lengths, **kwargs)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
