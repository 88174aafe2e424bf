"""Table 2's own path on CPU: scripts/reproduce_table2.py --smoke through every task file.

The smoke runs the task files a TPU user runs ({ende,cnndm}_{small,base,large}.gin) on T5X
checkpoints written here, a SentencePiece vocabulary trained here and local EnDe/CNN-DM-shaped
inputs; the T5X writer's layout is compared with a checkpoint T5X itself wrote.
"""

import csv
import io
import os
import shutil

import gin
import numpy as np
import pytest

from speclm import run
from speclm.checkpoints import t5x
from speclm.testing import scripts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T5X_FIXTURE = os.path.join(REPO, '..', 'shared', 'fixtures', 't5x', 'test_t5_tiny.checkpoint_0')
ROWS = 12  # 2 tasks × 3 drafts × 2 temperatures


def _script():
  return scripts.load_script(os.path.join(REPO, 'scripts', 'reproduce_table2.py'))


def _keys(tree, prefix=''):
  """'/'-joined paths of a nested dict's dicts, down to two levels below the top."""
  out = set()
  for key, value in tree.items():
    name = f'{prefix}{key}'
    out.add(name)
    if isinstance(value, dict) and name.count('/') < 1:
      out |= _keys(value, name + '/')
  return out


def test_train_state_writer_lays_out_a_checkpoint_as_t5x_does(tmp_path):
  params = {'encoder': {'layers_0': {'mlp': {'wo': {'kernel': np.arange(
      6 * 4, dtype=np.float32).reshape(6, 4)}}}},
            'token_embedder': {'embedding': np.ones((300, 200), np.float32)}}
  path = t5x.save_t5x_train_state(tmp_path / 'checkpoint_0', params, step=3,
                                  zarr_min_bytes=1024)
  state = t5x.read_t5x_state(path)
  assert state['version'] == 3 and set(state) == {'version', 'optimizer'}
  assert int(state['optimizer']['state']['step']) == 3
  slots = state['optimizer']['state']['param_states']
  # Adafactor: the 300 × 200 embedding's second moment is factored, the 6 × 4 kernel's is not.
  embedding = slots['token_embedder']['embedding']
  assert embedding['v_row'].shape == (300,) and embedding['v_col'].shape == (200,)
  assert embedding['v'].shape == (1,) and embedding['m'].shape == (1,)
  assert slots['encoder']['layers_0']['mlp']['wo']['kernel']['v'].shape == (6, 4)
  # Large arrays are zarr directories named by their dotted path, as T5X names them.
  assert (tmp_path / 'checkpoint_0' / 'target.token_embedder.embedding' / '.zarray').exists()
  assert (tmp_path / 'checkpoint_0' / 'state.param_states.token_embedder.embedding.v_row'
          / '.zarray').exists()
  restored = t5x.load_t5x_checkpoint(path)
  np.testing.assert_array_equal(restored['encoder']['layers_0']['mlp']['wo']['kernel'],
                                params['encoder']['layers_0']['mlp']['wo']['kernel'])
  if os.path.exists(T5X_FIXTURE):  # the same tree of keys as a checkpoint of T5X's own
    assert _keys(t5x.read_t5x_state(T5X_FIXTURE)) == _keys(state)
    fixture_slots = t5x.read_t5x_state(T5X_FIXTURE)['optimizer']['state']['param_states']
    assert set(fixture_slots['token_embedder']['embedding']) == set(embedding)


def test_smoke_runs_every_task_file_on_t5x_checkpoints(tmp_path, capsys):
  out = tmp_path / 'table2'
  assert _script().main(['--smoke', '--smoke_size=tiny', f'--output_dir={out}']) == 0
  printed = capsys.readouterr().out
  rows = list(csv.DictReader(io.StringIO((out / 'table2.csv').read_text())))
  assert len(rows) == ROWS
  for row in rows:
    alpha, gamma, c = float(row['alpha']), int(row['gamma']), float(row['c'])
    assert 0 <= alpha <= 1 and c > 0 and float(row['speedup']) > 0, row
    # Theorem 3.8 from our measured α and c.
    expected = (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1)) if alpha < 1 else (
        (gamma + 1) / (gamma * c + 1))
    assert float(row['theorem_3_8_speedup']) == pytest.approx(expected, rel=1e-6)
    assert row['quality'] != '' and row['examples'] == '4'
    if row['temperature'] == '0.0':
      assert row['identical_output_rate'] == '1.0', row  # greedy: token for token
  # α grows with the draft (the drafts are the target's first 1 and 3 decoder layers).
  alpha = {(r['task'], r['draft'], r['temperature']): float(r['alpha']) for r in rows}
  for task in ('EnDe', 'CNNDM'):
    assert alpha[(task, 'T5-SMALL', '0.0')] < alpha[(task, 'T5-LARGE', '0.0')]
  # The paper's row beside ours, and each row a T5 job of its task file.
  assert '| EnDe | T5-SMALL | 0 | 7 | 0.75 |' in printed
  assert '| CNNDM | T5-LARGE | 1 | 3 | 0.56 |' in printed
  for task in ('ende', 'cnndm'):
    for draft in ('small', 'base', 'large'):
      config = (out / f'{task}_{draft}_t0' / 'operative_config.gin').read_text()
      assert f't5_1_1_{draft}_{task}' in config and f't5_1_1_xxl_{task}' in config
      assert 'SentencePieceVocabulary.path' in config and 'file_dataset.path' in config
  # The commands a TPU user would launch, for one host and for four.
  assert '--accelerator-type=v4-8' in printed and '--accelerator-type=v4-32' in printed
  assert '--gin.partitioning.initialize_distributed.enabled=True' in printed
  for draft in ('small', 'base', 'large'):
    assert f'--gin_file=cnndm_{draft}.gin' in printed
  # --report_only rebuilds the same table from the job directories.
  table = (out / 'table2.md').read_text()
  assert _script().main(['--smoke', '--smoke_size=tiny', '--report_only',
                         f'--output_dir={out}']) == 0
  assert (out / 'table2.md').read_text() == table


def test_a_broken_binding_in_a_task_file_stops_the_smoke(tmp_path, capsys):
  configs = tmp_path / 'configs'
  shutil.copytree(os.path.join(REPO, 'configs'), configs)
  task_file = configs / 'cnndm_base.gin'
  text = task_file.read_text()
  assert 'DRAFT_CONFIG = %T5_1_1_BASE\n' in text
  task_file.write_text(text.replace('DRAFT_CONFIG = %T5_1_1_BASE\n',
                                    'DRAFT_CONFIG = %T5_1_1_BSAE\n'))
  # An earlier parse without the copy (the repository's configs/ on gin's search path) must
  # not shadow it: each parse searches its own directories first.
  run.parse_gin(['cnndm_base.gin'], ["TARGET_CHECKPOINT = 't'", "DRAFT_CHECKPOINT = 'd'",
                                     "OUTPUT_DIR = 'o'"])
  gin.clear_config()
  out = tmp_path / 'table2'
  status = _script().main(['--smoke', '--smoke_size=tiny', f'--output_dir={out}',
                           f'--gin_search_paths={configs}'])
  err = capsys.readouterr().err
  assert status == 2
  assert 'cnndm_base.gin' in err and 'does not configure a job' in err and 'T5_1_1_BSAE' in err
  # Every row's configuration is checked before any decoding starts.
  assert not list(out.glob('*/metrics.json'))
