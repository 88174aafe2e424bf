"""scripts/train_smollm2_eagle.py end to end on a tiny run of its default (EAGLE-3) draft:
features of three target layers, training-time test, file, card."""

import glob
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import speclm
from speclm.data import builtin_prompts
from speclm.models import lookup
from speclm.presets import smollm2
from speclm.presets import smollm2_draft
from speclm.run import providers
from speclm.run.errors import JobError
from speclm.testing.scripts import run_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2.is_available(),
                       reason=f'SmolLM2 is not installed: {smollm2.SETUP_COMMAND}'),
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One width (128) for every feature, training and measuring batch: each compiles once.
EAGLE = [os.path.join(ROOT, 'scripts', 'train_smollm2_eagle.py'), '--epochs=0.5',
         '--batch_size=2', '--feature_batch=2', '--eval_prompts=2', '--max_new_tokens=8',
         '--width_bucket=128', '--ttt_steps=2']
LAYERS = (2, 15, 27)  # EAGLE-3's low, middle and high layers of SmolLM2's 30


@pytest.fixture(scope='module')
def run(tmp_path_factory, draft_script_run):
  """The EAGLE script on a copy of the replies SmolLM2 generated in the session's tiny run of
  scripts/train_smollm2_draft.py (tests/conftest.py): what `--stage=generate` writes."""
  work = tmp_path_factory.mktemp('work')
  out = tmp_path_factory.mktemp('out')
  shards = sorted(glob.glob(os.path.join(draft_script_run.work_dir, 'gen_*.npz')))
  for path in shards + [os.path.join(draft_script_run.work_dir, 'generation_seconds.txt')]:
    shutil.copy(path, work)
  log = run_script(*EAGLE, f'--work_dir={work}', f'--output_dir={out}')
  return str(work), str(out), log


@pytest.fixture(scope='module')
def target():
  return smollm2.load_model()


def test_features_are_the_targets_hidden_states_of_three_layers(run, target):
  work, _, _ = run
  shards = sorted(glob.glob(os.path.join(work, 'gen_*.npz')))
  assert len(shards) >= 2  # the last one held out, the others to train on
  feature_file = lambda shard: shard.replace('gen_', 'feat-l2-15-27_')
  assert all(os.path.exists(feature_file(s)) for s in shards)
  with np.load(shards[0]) as gen, np.load(feature_file(shards[0])) as feat:
    tokens, lengths, features = gen['tokens'], gen['lengths'], feat['features']
    assert float(feat['seconds']) > 0
    assert tuple(feat['layers']) == LAYERS
  assert features.dtype == np.uint16  # bfloat16's bits
  assert features.shape == tokens.shape + (3 * target.definition.config.embed_dim,)
  n = int(lengths[0])
  row = jnp.asarray(tokens[:1, :n])
  source = target.definition.with_feature_layers(LAYERS)
  _, expected, _ = source.prefill_with_features(target.params, row, jnp.array([n], jnp.int32),
                                                source.init_cache(1, n))
  stored = features[0, :n].view(jnp.bfloat16).astype(np.float32)
  np.testing.assert_allclose(stored, np.asarray(expected)[0], rtol=1e-2, atol=1e-2)


def test_soft_labels_are_the_targets_distribution(run, target):
  """The features stage also writes SmolLM2's top-16 next-token probabilities at every
  position (label_*.npz, train_smollm2_draft.py's format), from the same forward pass."""
  work, _, log = run
  shard = sorted(glob.glob(os.path.join(work, 'gen_greedy_*.npz')))[0]
  with np.load(shard) as gen, np.load(shard.replace('gen_', 'label_')) as labels:
    tokens, lengths, prompt_lengths = gen['tokens'], gen['lengths'], gen['prompt_lengths']
    probs, ids = labels['probs'], labels['ids']
  assert probs.dtype == np.float16 and ids.shape == tokens.shape + (16,)
  n, p = int(lengths[0]), int(prompt_lengths[0])
  expected = jax.nn.softmax(target.definition.forward(target.params, jnp.asarray(tokens[:1, :n])))
  top_probs, top_ids = jax.lax.top_k(expected[0], 16)
  np.testing.assert_array_equal(ids[0, :n, 0], top_ids[:, 0])
  np.testing.assert_allclose(probs[0, :n].astype(np.float32), top_probs, atol=2e-3)
  # A greedy reply is the target's argmax: its next token is the top soft label.
  np.testing.assert_array_equal(ids[0, p - 1:n - 1, 0], tokens[0, p:n])
  assert 'features and soft labels of' in log


def test_the_file_loads_decodes_exactly_and_has_its_card(run, target):
  _, out, log = run
  path = os.path.join(out, smollm2_draft.EAGLE_FILE)
  trained, head_ids, metadata = smollm2_draft.read(path)
  _, shipped_subset, _ = smollm2_draft.read()
  np.testing.assert_array_equal(head_ids, shipped_subset)
  assert metadata['num_layers'] == 1 and metadata['feature_layers'] == list(LAYERS)
  assert metadata['ttt_steps'] == 2
  assert set(trained) == {'reduce', 'fuse', 'layers_0', 'final_norm'}
  assert metadata['heldout']['prompts'] == 2 and metadata['demo']['prompts'] == 2
  assert 0.0 <= metadata['heldout']['alpha_t0'] <= 1.0
  assert 0.0 <= metadata['heldout_accuracy'] <= 1.0
  assert 'held-out teacher-forced accuracy' in log and 'at unrolled step 2' in log
  card = open(os.path.join(out, 'MODEL_CARD.md'), encoding='utf-8').read()
  assert f"{metadata['demo']['alpha_t0']:.3f}" in card and 'training-time test' in card

  draft = smollm2_draft.load_eagle(target, path)
  assert draft.definition.feature_layers == LAYERS
  tok = smollm2.load_tokenizer()
  # The script's own α batch (2 held-out prompts padded to 128 columns, γ = 3, 8 tokens): the
  # speculative loop is the program the script compiled (a hit in the session's cache).
  tokens, lengths = tok.batch([tok.encode_chat(p) for p in builtin_prompts.heldout_prompts(2)])
  tokens = np.pad(tokens, [(0, 0), (0, 128 - tokens.shape[1])])
  base = speclm.autoregressive_decode(target, tokens, lengths, max_new_tokens=8)
  spec = speclm.speculative_decode(target, draft, tokens, lengths, gamma=3, max_new_tokens=8)
  np.testing.assert_array_equal(spec.tokens, base.tokens)
  # In a job: prompt lookup first, this draft elsewhere.
  combined = providers.smollm2_eagle_draft_model(path, cpu_kernels=False, lookup_min_ngram=2)
  assert isinstance(combined.definition, lookup.LookupFirstWithFeatures)
  spec = speclm.speculative_decode(target, combined, tokens, lengths, gamma=3, max_new_tokens=8)
  np.testing.assert_array_equal(spec.tokens, base.tokens)


def test_torch_backend_trains_a_draft_the_flax_code_loads_and_resumes(run, target, tmp_path):
  """--train_backend=torch (`speclm.models.eagle_torch`) on the same features and soft labels:
  the file loads as the Flax EAGLE-3 draft, and a second run continues from the saved step."""
  work = tmp_path / 'work'
  work.mkdir()
  for path in glob.glob(os.path.join(run[0], '*.npz')):
    if os.path.basename(path).startswith(('gen_', 'feat', 'label_')):
      shutil.copy(path, work)
  out = tmp_path / 'out'
  flags = [*EAGLE, f'--work_dir={work}', f'--output_dir={out}', '--stage=train',
           '--train_backend=torch', '--evaluate=false']
  log = run_script(*flags)
  assert 'at unrolled step 2' in log and 'held-out teacher-forced accuracy' in log
  path = os.path.join(out, smollm2_draft.EAGLE_FILE)
  trained, _, metadata = smollm2_draft.read(path)
  assert metadata['train_backend'] == 'torch' and metadata['steps'] >= 1
  assert set(trained) == {'reduce', 'fuse', 'layers_0', 'final_norm'}
  assert os.path.exists(work / 'train_state-l2-15-27.msgpack.torch')
  draft = smollm2_draft.load_eagle(target, path)
  assert draft.definition.feature_layers == LAYERS

  log = run_script(*flags, '--epochs=1.0')  # twice the steps: goes on from the saved state
  assert 'resuming from' in log
  _, _, again = smollm2_draft.read(path)
  assert again['steps'] > metadata['steps']
  assert again['positions_seen'] > metadata['positions_seen']


def test_init_from_continues_a_draft_file_and_counts_its_run(run, tmp_path):
  """--init_from starts training from a draft file (the module's run wrote one): the new file
  records that run's steps and positions as earlier ones (the model card's training line
  names them); with a larger --num_layers the file's layer comes first and the new one starts
  as an identity (`eagle.deepen`); a file of another shape is refused before training, naming
  the parameters that differ."""
  work = tmp_path / 'work'
  work.mkdir()
  for path in glob.glob(os.path.join(run[0], '*.npz')):
    if os.path.basename(path).startswith(('gen_', 'feat', 'label_')):
      shutil.copy(path, work)
  first = os.path.join(run[1], smollm2_draft.EAGLE_FILE)
  _, _, before = smollm2_draft.read(first)
  out = tmp_path / 'out'
  flags = [*EAGLE, f'--work_dir={work}', f'--output_dir={out}', '--stage=train',
           '--evaluate=false', f'--init_from={first}']
  log = run_script(*flags)
  assert f'starting from {first} ({before["steps"]} steps' in log
  _, _, after = smollm2_draft.read(os.path.join(out, smollm2_draft.EAGLE_FILE))
  assert after['earlier_steps'] == before['steps'] >= 1
  assert after['earlier_positions_seen'] == before['positions_seen'] > 0
  assert after['steps'] >= 1

  deeper = tmp_path / 'deeper'
  log = run_script(*flags, '--num_layers=2', f'--output_dir={deeper}', '--noresume')
  assert f'deepening {first}: layers_1 start as identities' in log
  trained, _, grown = smollm2_draft.read(os.path.join(deeper, smollm2_draft.EAGLE_FILE))
  assert grown['num_layers'] == 2 and grown['deepened_from_layers'] == 1
  assert float(np.abs(trained['layers_1']['mlp']['down']['kernel']).max()) > 0  # trained

  with pytest.raises(AssertionError, match=r'other parameters than this run.*feature_norm'):
    run_script(*flags, '--input_norms', '--noresume', f'--output_dir={tmp_path / "out2"}')

  # --stage=average: the continued draft becomes the mean of its parameters and the file it
  # started from, then is measured; the card names the other file; a second average, or one
  # with a file of other shapes, is refused.
  continued, head_ids, _ = smollm2_draft.read(os.path.join(out, smollm2_draft.EAGLE_FILE))
  started, _, _ = smollm2_draft.read(first)
  average = [*EAGLE, f'--work_dir={work}', f'--output_dir={out}', '--stage=average',
             f'--average_with={first}', '--average_weight=0.25']
  run_script(*average)
  mean, mean_ids, averaged = smollm2_draft.read(os.path.join(out, smollm2_draft.EAGLE_FILE))
  np.testing.assert_array_equal(mean_ids, head_ids)
  expected = jax.tree_util.tree_map(lambda a, b: 0.75 * a + 0.25 * b, continued, started)
  jax.tree_util.tree_map(lambda e, m: np.testing.assert_allclose(  # stored as bfloat16
      m, e, rtol=2 ** -7, atol=1e-6), expected, mean)
  assert averaged['averaged_with']['weight'] == 0.25
  assert averaged['averaged_with']['steps'] == before['steps']
  assert 0.0 <= averaged['heldout']['alpha_t0'] <= 1.0
  card = open(os.path.join(out, 'MODEL_CARD.md'), encoding='utf-8').read()
  assert averaged['averaged_with']['sha256'][:16] in card and '--stage=average' in card
  with pytest.raises(AssertionError, match='already an average'):
    run_script(*average)
  with pytest.raises(AssertionError, match='Parameter tree mismatch'):
    run_script(*EAGLE, f'--work_dir={work}', f'--output_dir={deeper}', '--stage=average',
               f'--average_with={first}')


def test_compare_drafts_smoke_run_lists_every_draft(run, tmp_path):
  """scripts/compare_drafts.py on tiny settings with this run's draft, alone and behind lookup
  first (the shipped drafts' rows are left out here: each costs compilations): a row per
  draft, each with α, tokens per call and speedup at T = 0 and 1, c, and greedy exactness."""
  _, out, _ = run
  report = tmp_path / 'drafts.md'
  run_script(os.path.join(ROOT, 'scripts', 'compare_drafts.py'), '--rounds=1',
             '--max_new_tokens=4', '--gamma=2', '--cost_repeats=1', '--nobuiltin_drafts',
             f'--eagle_path={os.path.join(out, smollm2_draft.EAGLE_FILE)}', f'--output={report}')
  rows = {line.split(' | ')[0].lstrip('| '): line.split(' | ')
          for line in report.read_text().splitlines() if line.startswith('| ')}
  assert 'trained 2-layer' not in rows
  for name in ('EAGLE-style', 'lookup first (EAGLE-style)'):
    cells = rows[name]
    assert len(cells) == 9 and cells[3].endswith('×') and cells[6].endswith('×')
    assert 0.0 <= float(cells[1]) <= 1.0 and float(cells[7]) >= 0.0
    assert cells[8].rstrip(' |') == 'yes'  # greedy speculative = baseline


def test_gpu_plan_chains_the_stages(run, draft_script_run, tmp_path):
  """scripts/train_smollm2_eagle_gpu.sh (the run for a GPU lease) on this run's data, with the
  tiny settings given through GEN_FLAGS and TRAIN_FLAGS and a training budget of seconds
  (TRAIN_S; the script's 180 s would train for 180 s here too): every stage finds its output
  already made (resumable) except training, which writes the draft file to OUT_DIR."""
  work, _, _ = run
  copy = tmp_path / 'work'
  shutil.copytree(work, copy)
  shutil.copy(os.path.join(draft_script_run.work_dir, 'self_prompts.json'), copy)
  out = tmp_path / 'out'
  generation = [f for f in draft_script_run.tiny_flags
                if not f.startswith(('--label', '--batch_size', '--epochs', '--width'))]
  env = dict(os.environ, WORK_DIR=str(copy), OUT_DIR=str(out), TRAIN_S='3',
             GEN_FLAGS=' '.join(generation + ['--grounded_prompts=0']),
             TRAIN_FLAGS=' '.join(EAGLE[1:]))
  done = subprocess.run(['bash', os.path.join(ROOT, 'scripts', 'train_smollm2_eagle_gpu.sh')],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'generated' not in done.stderr and 'features and soft labels of' not in done.stderr
  _, _, metadata = smollm2_draft.read(str(out / smollm2_draft.EAGLE_FILE))
  assert metadata['feature_layers'] == list(LAYERS) and 'heldout' not in metadata  # α: on CPU


def test_bad_lookup_settings_are_job_errors_before_loading(monkeypatch):
  """Both SmolLM2 draft providers check `lookup_min_ngram` and `lookup_weight` before they
  load any model."""
  def no_loading(*args, **kwargs):
    raise AssertionError('loaded a model before checking the lookup settings')
  monkeypatch.setattr(smollm2, 'load_model', no_loading)
  bad = {'lookup_min_ngram must be >= 0': dict(lookup_min_ngram=-1),
         r'lookup_weight must be in \(0, 1\]': dict(lookup_min_ngram=2, lookup_weight=0.0)}
  for message, settings in bad.items():
    with pytest.raises(JobError, match=message):
      providers.smollm2_draft_model(**settings)
  monkeypatch.setattr(providers.os.path, 'exists', lambda path: True)
  monkeypatch.setattr(providers.errors, 'check_path', lambda path, what: None)
  for message, settings in bad.items():
    with pytest.raises(JobError, match=message):
      providers.smollm2_eagle_draft_model(**settings)


def test_a_missing_eagle_draft_is_a_job_error(monkeypatch, tmp_path):
  monkeypatch.setattr(smollm2_draft, 'EAGLE_DIR', str(tmp_path))
  with pytest.raises(JobError, match='The shipped EAGLE-3 draft is missing'):
    providers.smollm2_eagle_draft_model()
  with pytest.raises(JobError, match='does not exist'):
    providers.smollm2_eagle_draft_model(str(tmp_path / 'missing.safetensors'))
