"""scripts/train_smollm2_draft.py end to end on a tiny run: data, soft labels, draft, card."""

import glob
import json
import os

import numpy as np
import pytest

from speclm.presets import smollm2
from speclm.presets import smollm2_draft

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2.is_available(),
                       reason=f'SmolLM2 is not installed: {smollm2.SETUP_COMMAND}'),
]


@pytest.fixture(scope='module')
def run(draft_script_run):
  """The session's tiny run of the script (tests/conftest.py: all stages, --noevaluate)."""
  return draft_script_run.work_dir, draft_script_run.output_dir


def test_generated_data_and_soft_labels_agree(run):
  work, _ = run
  self_prompts = json.load(open(os.path.join(work, 'self_prompts.json'), encoding='utf-8'))
  assert 1 <= len(self_prompts) <= 4 and all(p.strip() for p in self_prompts)
  shards = sorted(glob.glob(os.path.join(work, 'gen_*.npz')))
  kinds = {os.path.basename(s).split('_')[1] for s in shards}
  assert kinds == {'greedy', 'sampled'}
  checked = 0
  for shard in shards:
    with np.load(shard) as gen, np.load(shard.replace('gen_', 'label_')) as labels:
      probs, ids = labels['probs'].astype(np.float32), labels['ids']
      assert probs.shape == ids.shape and probs.shape[2] == 8
      assert probs.shape[0] == len(gen['tokens']) and probs.shape[1] >= gen['tokens'].shape[1]
      assert np.all(np.diff(probs, axis=-1) <= 1e-3)  # top-k, most probable first
      assert np.all(probs.sum(-1) <= 1.0 + 1e-2)
      if 'greedy' not in shard:
        continue
      # A greedy reply token is the target's argmax after its prefix: the soft label's top id.
      for row, n, p, top in zip(gen['tokens'], gen['lengths'], gen['prompt_lengths'], ids):
        np.testing.assert_array_equal(top[p - 1:n - 1, 0], row[p:n])
        checked += n - p
  assert checked > 0


def test_draft_file_then_evaluate_writes_the_card(run, draft_script_run):
  _, out = run
  path = os.path.join(out, smollm2_draft.WEIGHTS_FILE)
  trained, subset_ids, metadata = smollm2_draft.read(path)
  assert len(subset_ids) == 512 and metadata['subset_size'] == 512
  assert metadata['num_layers'] == 2 and 'layers_1' in trained
  assert metadata['sampled_replies'] == 1 and 1 <= metadata['self_prompts'] <= 4
  assert metadata['sequences'] == 2 * (3 + metadata['self_prompts'])
  assert 'heldout' not in metadata  # --noevaluate: no α yet
  assert not os.path.exists(os.path.join(out, 'MODEL_CARD.md'))

  log = draft_script_run.run(f'--work_dir={out}', f'--output_dir={out}', '--stage=evaluate')
  _, _, measured = smollm2_draft.read(path)
  assert 0.0 <= measured['heldout']['alpha_t0'] <= 1.0
  assert measured['heldout']['prompts'] == 2 and measured['demo']['prompts'] == 2
  assert measured['alpha_new_tokens'] == 8  # --alpha_new_tokens
  assert measured['steps'] == metadata['steps']  # training metadata is kept
  card = open(os.path.join(out, 'MODEL_CARD.md'), encoding='utf-8').read()
  assert f"{measured['demo']['alpha_t0']:.3f}" in card
  assert 'requests SmolLM2 wrote itself' in card
  assert '8 new tokens' in card and '| the 2 demo prompts |' in card
  assert 'α on' in log
