"""scripts/train_smollm2_eagle.py end to end on a tiny run: features, training, file, card."""

import glob
import os

import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm.testing.scripts import run_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2.is_available(),
                       reason=f'SmolLM2 is not installed: {smollm2.SETUP_COMMAND}'),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GENERATE = [os.path.join(ROOT, 'scripts', 'train_smollm2_draft.py'), '--stage=generate',
            '--num_prompts=4', '--self_prompts=0', '--sampled_replies=0', '--gen_batch=2',
            '--max_new_tokens=8']
EAGLE = [os.path.join(ROOT, 'scripts', 'train_smollm2_eagle.py'), '--epochs=2',
         '--batch_size=2', '--feature_batch=2', '--eval_prompts=2', '--max_new_tokens=8']


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  work = tmp_path_factory.mktemp('work')
  out = tmp_path_factory.mktemp('out')
  run_script(*GENERATE, f'--work_dir={work}')
  log = run_script(*EAGLE, f'--work_dir={work}', f'--output_dir={out}')
  return str(work), str(out), log


@pytest.fixture(scope='module')
def target():
  return smollm2.load_model()


def test_features_are_the_targets_final_hidden_states(run, target):
  work, _, _ = run
  shards = sorted(glob.glob(os.path.join(work, 'gen_*.npz')))
  assert len(shards) == 2  # 4 prompts, 2 a shard: one to train on, one held out
  with np.load(shards[0]) as gen, np.load(shards[0].replace('gen_', 'feat_')) as feat:
    tokens, lengths, features = gen['tokens'], gen['lengths'], feat['features']
    assert float(feat['seconds']) > 0
  assert features.dtype == np.float16
  assert features.shape == tokens.shape + (target.definition.config.embed_dim,)
  n = int(lengths[0])
  row = jnp.asarray(tokens[:1, :n])
  cache = target.definition.init_cache(1, n)
  _, expected, _ = target.definition.prefill_with_features(
      target.params, row, jnp.array([n], jnp.int32), cache)
  np.testing.assert_allclose(features[0, :n].astype(np.float32), np.asarray(expected)[0],
                             rtol=2e-3, atol=2e-2)


def test_the_file_loads_decodes_exactly_and_has_its_card(run, target):
  _, out, log = run
  path = os.path.join(out, smollm2_draft.EAGLE_FILE)
  trained, head_ids, metadata = smollm2_draft.read(path)
  _, shipped_subset, _ = smollm2_draft.read()
  np.testing.assert_array_equal(head_ids, shipped_subset)
  assert metadata['num_layers'] == 1 and set(trained) == {'fuse', 'layers_0'}
  assert metadata['heldout']['prompts'] == 2 and metadata['demo']['prompts'] == 2
  assert 0.0 <= metadata['heldout']['alpha_t0'] <= 1.0
  assert 0.0 <= metadata['heldout_accuracy'] <= 1.0
  assert 'held-out teacher-forced accuracy' in log
  card = open(os.path.join(out, 'MODEL_CARD.md'), encoding='utf-8').read()
  assert f"{metadata['demo']['alpha_t0']:.3f}" in card

  draft = smollm2_draft.load_eagle(target, path)
  tok = smollm2.load_tokenizer()
  tokens, lengths = tok.batch([tok.encode_chat(p) for p in ('Name a colour.',
                                                            'Write one line about the sea.')])
  base = speclm.autoregressive_decode(target, tokens, lengths, max_new_tokens=12)
  spec = speclm.speculative_decode(target, draft, tokens, lengths, gamma=3, max_new_tokens=12)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
