"""scripts/train_smollm2_draft.py end to end on a tiny run: data, soft labels, draft, card."""

import glob
import json
import os

import numpy as np
import pytest

from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm.testing.scripts import run_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2.is_available(),
                       reason=f'SmolLM2 is not installed: {smollm2.SETUP_COMMAND}'),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, 'scripts', 'train_smollm2_draft.py')
TINY = ['--num_prompts=3', '--self_prompts=4', '--self_prompt_tokens=48', '--gen_batch=4',
        '--max_new_tokens=6', '--sampled_replies=1', '--label_batch=4', '--label_top_k=8',
        '--batch_size=2', '--epochs=1', '--subset_size=512', '--eval_prompts=2',
        '--matmul_precision=highest']


def _run(*args):
  return run_script(SCRIPT, *TINY, *args)


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  work = tmp_path_factory.mktemp('work')
  out = tmp_path_factory.mktemp('out')
  _run(f'--work_dir={work}', f'--output_dir={out}', '--noevaluate')
  return str(work), str(out)


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


def test_draft_file_then_evaluate_writes_the_card(run):
  _, out = run
  path = os.path.join(out, smollm2_draft.WEIGHTS_FILE)
  trained, subset_ids, metadata = smollm2_draft.read(path)
  assert len(subset_ids) == 512 and metadata['subset_size'] == 512
  assert metadata['num_layers'] == 2 and 'layers_1' in trained
  assert metadata['sampled_replies'] == 1 and 1 <= metadata['self_prompts'] <= 4
  assert metadata['sequences'] == 2 * (3 + metadata['self_prompts'])
  assert 'heldout' not in metadata  # --noevaluate: no α yet
  assert not os.path.exists(os.path.join(out, 'MODEL_CARD.md'))

  log = _run(f'--work_dir={out}', f'--output_dir={out}', '--stage=evaluate')
  _, _, measured = smollm2_draft.read(path)
  assert 0.0 <= measured['heldout']['alpha_t0'] <= 1.0
  assert measured['heldout']['prompts'] == 2
  assert measured['steps'] == metadata['steps']  # training metadata is kept
  card = open(os.path.join(out, 'MODEL_CARD.md'), encoding='utf-8').read()
  assert f"{measured['demo']['alpha_t0']:.3f}" in card
  assert 'requests SmolLM2 wrote itself' in card
  assert 'α on' in log
