"""scripts/train_sharegpt_draft.py end to end on a tiny ShareGPT file made here: pieces with
reply masks, the evaluation overlap dropped, SmolLM2's own replies to the first turns,
PyTorch bfloat16 features equal to the float32 model's within rounding (the replies' from the
pass that wrote them), a few steps of EAGLE-3 with input norms, a training curve, a resume,
and a draft file that loads and decodes exactly."""

import glob
import json
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
SCRIPT = os.path.join(ROOT, 'scripts', 'train_sharegpt_draft.py')
TINY = ['--window=128', '--heldout_percent=30', '--heldout_windows=2', '--shard_windows=4',
        '--feature_budget_s=600', '--train_budget_s=1', '--noevaluate', '--reply_tokens=12',
        '--reply_batch=4',
        '--eagle_flags=--batch_size=2,--feature_batch=2,--width_bucket=128,--ttt_steps=2,'
        '--input_norms,--save_every_s=0']
QUESTION = 'Describe the water cycle in three short sentences for a curious child please.'


def _sharegpt_file(path):
  """Sixteen conversations of two exchanges (cut off after the last, as the package's file
  is), one of which asks an evaluation question."""
  topics = ['rivers', 'volcanoes', 'bread', 'bicycles', 'libraries', 'comets', 'bees',
            'glass', 'maps', 'tides', 'clocks', 'paper', 'salt', 'owls', 'kites', 'bridges']
  elements = []
  for number, topic in enumerate(topics):
    question = QUESTION if number == 3 else f'Tell me about {topic}.'
    reply = ' '.join(f'Fact {k} about {topic}: they are interesting in many ways.'
                     for k in range(8))
    elements.append({'id': f'tiny{number}', 'conversations': [
        {'from': 'human', 'value': question}, {'from': 'gpt', 'value': reply},
        {'from': 'human', 'value': 'And more?'}, {'from': 'gpt', 'value': reply[::-1][:200]}]})
  text = json.dumps(elements, indent=2)
  path.write_text(text[:len(text) - 30], encoding='utf-8')  # the last one is cut off
  return str(path)


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('sharegpt')
  questions = tmp / 'question.jsonl'
  questions.write_text(json.dumps({'question_id': 1, 'category': 'writing',
                                   'turns': [QUESTION]}) + '\n', encoding='utf-8')
  work = tmp / 'work'
  log = run_script(SCRIPT, *TINY, f'--work_dir={work}',
                   f'--sharegpt_file={_sharegpt_file(tmp / "sharegpt.json")}',
                   f'--spec_bench_file={questions}')
  return str(work), log


def test_data_stage_writes_masked_pieces_without_the_evaluation_question(run):
  work, log = run
  assert '15 conversations kept; dropped: 1 cut off' in log
  assert '1 conversations dropped for overlapping evaluation text' in log
  shards = sorted(glob.glob(os.path.join(work, 'gen_sharegpt_*.npz')))
  assert shards[-1].endswith('gen_sharegpt_zheldout.npz') and len(shards) >= 3
  tokenizer = smollm2.load_tokenizer()
  with np.load(shards[0]) as data:
    tokens, lengths, mask = data['tokens'], data['lengths'], data['loss_mask']
  assert tokens.shape[1] <= 128 and mask.shape == tokens.shape
  row = tokens[0, :lengths[0]]
  assert mask[0, :lengths[0]].any() and not mask[0, lengths[0]:].any()
  text = tokenizer.decode(row[mask[0, :lengths[0]]])
  # the replies' words (forwards or, in the second reply, backwards), not the questions'
  assert 'interesting' in text or 'gnitseretni' in text
  assert 'Tell me about' not in text and 'And more?' not in text


def test_replies_stage_writes_smollm2s_own_replies_to_training_first_turns(run):
  work, log = run
  assert 'prompts of user turn 1 to answer' in log and 'own replies:' in log
  shards = sorted(glob.glob(os.path.join(work, 'gen_own_*.npz')))
  assert shards
  tokenizer = smollm2.load_tokenizer()
  target = smollm2.load_model()
  first_tokens_agree, rows = 0, 0
  for shard in shards:
    with np.load(shard) as data:
      tokens, lengths, mask = data['tokens'], data['lengths'], data['loss_mask']
    assert os.path.exists(shard.replace('gen_', 'feat-l2-15-27_'))
    for row, n, reply in zip(tokens, lengths, mask):
      prompt = row[:np.argmax(reply)]
      text = tokenizer.decode(prompt, stop_at_eos=False)
      assert QUESTION not in text and 'Tell me about' in text  # a training first turn
      assert 'And more?' not in text
      assert reply[:n].sum() >= 1 and not reply[n:].any() and reply[len(prompt):n].all()
      assert reply[:n].sum() <= 12
      logits = target.definition.forward(target.params, jnp.asarray(prompt[None]))[0, -1]
      first_tokens_agree += int(np.argmax(logits) == row[len(prompt)])
      rows += 1
  # greedy rows (3 batches of 4 in 4) start with the float32 model's argmax, up to bfloat16
  assert first_tokens_agree >= rows // 2


def test_replies_to_a_later_turn_follow_the_earlier_exchange(tmp_path):
  """--reply_turn=2: SmolLM2 answers the second user turn after the first turn and ShareGPT's
  reply to it, in shards of their own (gen_own_t2_*), with the loss on its reply alone."""
  questions = tmp_path / 'question.jsonl'
  questions.write_text(json.dumps({'question_id': 1, 'category': 'writing',
                                   'turns': [QUESTION]}) + '\n', encoding='utf-8')
  work = tmp_path / 'work'
  log = run_script(SCRIPT, *TINY, f'--work_dir={work}', '--stage=replies', '--reply_turn=2',
                   '--max_prompt_tokens=400',
                   f'--sharegpt_file={_sharegpt_file(tmp_path / "sharegpt.json")}',
                   f'--spec_bench_file={questions}')
  assert 'prompts of user turn 2 to answer' in log
  assert not glob.glob(os.path.join(work, 'gen_own_0*.npz'))
  shards = sorted(glob.glob(os.path.join(work, 'gen_own_t2_*.npz')))
  assert shards and os.path.exists(shards[0].replace('gen_', 'feat-l2-15-27_'))
  tokenizer = smollm2.load_tokenizer()
  for shard in shards:
    with np.load(shard) as data:
      tokens, lengths, mask = data['tokens'], data['lengths'], data['loss_mask']
    for row, n, reply in zip(tokens, lengths, mask):
      start = int(np.argmax(reply))
      prompt = tokenizer.decode(row[:start], stop_at_eos=False)
      # the first question, ShareGPT's first reply, then the second question, last
      assert prompt.index('Tell me about') < prompt.index('interesting') < \
          prompt.rindex('And more?')
      assert QUESTION not in prompt
      assert 1 <= reply[:n].sum() <= 12 and reply[start:n].all() and not reply[n:].any()


def _assert_features_are_the_float32_models(shard, first_labelled=0):
  """The stored features and soft labels of the first row of `shard` against the float32
  model's teacher-forced ones, from position `first_labelled` on for the labels."""
  target = smollm2.load_model()
  with np.load(shard) as gen, np.load(shard.replace('gen_', 'feat-l2-15-27_')) as feat, \
      np.load(shard.replace('gen_', 'label_')) as labels:
    n = int(gen['lengths'][0])
    row, stored = gen['tokens'][:1, :n], feat['features'][0, :n]
    top_ids, top_probs = labels['ids'][0, :n, 0], labels['probs'][0, :n, 0]
  source = target.definition.with_feature_layers((2, 15, 27))
  _, expected, _ = source.prefill_with_features(target.params, jnp.asarray(row),
                                                jnp.array([n], jnp.int32),
                                                source.init_cache(1, n))
  got = stored.view(jnp.bfloat16).astype(np.float32)
  expected = np.asarray(expected)[0]
  # bfloat16 arithmetic through 27 layers: within a few percent of each row's scale
  error = np.linalg.norm(got - expected, axis=-1) / np.linalg.norm(expected, axis=-1)
  assert np.median(error) < 0.02 and error.max() < 0.1
  logits = target.definition.forward(target.params, jnp.asarray(row))[0]
  agree = np.asarray(jnp.argmax(logits, -1)) == top_ids
  assert np.mean(agree[first_labelled:]) > 0.9
  assert not top_probs[:first_labelled].any() and top_probs[first_labelled:].all()


def test_torch_features_are_the_float32_models_within_bfloat16(run):
  work, log = run
  assert 'features and soft labels of gen_sharegpt_zheldout.npz' in log
  _assert_features_are_the_float32_models(os.path.join(work, 'gen_sharegpt_zheldout.npz'))


def test_own_replies_carry_features_from_the_pass_that_wrote_them(run):
  """--reply_features: the replies stage writes the features and soft labels of its shards
  (the features stage then skips them), as a second pass would have computed them."""
  work, log = run
  shards = sorted(glob.glob(os.path.join(work, 'gen_own_*.npz')))
  assert shards and 'of gen_own_' not in log  # no features stage pass over them
  for shard in shards:
    with np.load(shard) as gen, np.load(shard.replace('gen_', 'feat-l2-15-27_')) as feat:
      assert feat['features'].shape[:2] == gen['tokens'].shape and feat['seconds'] == 0.0
      assert list(feat['layers']) == [2, 15, 27]
  with np.load(shards[0]) as gen:
    prompt_length = int(np.argmax(gen['loss_mask'][0]))
  # labels from the prompt's last position (it predicts the reply's first token) on
  _assert_features_are_the_float32_models(shards[0], first_labelled=prompt_length - 1)


def test_training_writes_a_curve_resumes_and_the_draft_decodes_exactly(run, tmp_path):
  work, log = run
  assert 'training on' in log
  curve = [json.loads(line) for line in open(
      os.path.join(work, 'training_curve-l2-15-27.jsonl'), encoding='utf-8')]
  assert curve and curve[-1]['positions'] > 0 and len(curve[-1]['greedy_agreement']) == 2
  assert all(0 <= v <= 1 for v in curve[-1]['overlap_top_k'])
  steps = curve[-1]['step']
  # A later run with a larger budget goes on from the saved state.
  again = run_script(SCRIPT, *TINY, f'--work_dir={work}', '--stage=train',
                     f'--train_budget_s={curve[-1]["seconds"] + 1}')
  assert f'resuming from {os.path.join(work, "train_state-l2-15-27.msgpack")} at step {steps}' \
      in again
  path = os.path.join(work, 'draft', smollm2_draft.EAGLE_FILE)
  trained, _, metadata = smollm2_draft.read(path)
  assert {'embedding_norm', 'feature_norm', 'reduce', 'fuse'} <= set(trained)
  assert metadata['input_norms'] and metadata['steps'] > steps
  sources = metadata['data_sources']  # both kinds of training data, counted
  assert set(sources) == {'sharegpt', 'own_replies'}
  assert all(c['sequences'] > 0 and c['reply_tokens'] > 0 for c in sources.values())
  assert metadata['generation_seconds'] > 0
  target = smollm2.load_model()
  draft = smollm2_draft.load_eagle(target, path)
  assert draft.definition.input_norms
  tokenizer = smollm2.load_tokenizer()
  tokens, lengths = tokenizer.batch([tokenizer.encode_chat('Name three rivers.')])
  base = speclm.autoregressive_decode(target, tokens, lengths, max_new_tokens=8)
  spec = speclm.speculative_decode(target, draft, tokens, lengths, gamma=2, max_new_tokens=8)
  np.testing.assert_array_equal(spec.tokens, base.tokens)


def test_the_token_only_draft_trains_on_the_same_shards_but_the_heldout_one(run, tmp_path):
  """scripts/train_smollm2_draft.py on the ShareGPT work dir (issue 37's comparison): every
  training shard with soft labels, never gen_sharegpt_zheldout.npz, and a card that names
  the sources."""
  work, _ = run
  draft_script = os.path.join(ROOT, 'scripts', 'train_smollm2_draft.py')
  flags = [f'--work_dir={work}', f'--output_dir={tmp_path}', '--batch_size=2', '--epochs=1',
           '--subset_size=512', '--width_bucket=128', '--eval_prompts=1',
           '--alpha_new_tokens=4', '--prompt_width=128']
  log = run_script(draft_script, *flags, '--stage=train', '--noevaluate')
  assert 'leaving out 1 held-out shard(s): gen_sharegpt_zheldout.npz' in log
  expected = {}
  for shard in glob.glob(os.path.join(work, 'gen_*.npz')):
    if 'heldout' in shard or not os.path.exists(shard.replace('gen_', 'label_')):
      continue
    kind = 'own_replies' if '_own_' in shard else 'sharegpt'
    with np.load(shard) as data:
      counts = expected.setdefault(kind, dict(sequences=0, reply_tokens=0))
      counts['sequences'] += len(data['lengths'])
      counts['reply_tokens'] += int(data['loss_mask'].sum())
  path = os.path.join(tmp_path, smollm2_draft.WEIGHTS_FILE)
  _, _, metadata = smollm2_draft.read(path)
  assert metadata['data_sources'] == expected and set(expected) == {'sharegpt', 'own_replies'}
  assert metadata['sequences'] == sum(c['sequences'] for c in expected.values())
  run_script(draft_script, *flags, '--stage=evaluate')
  card = open(os.path.join(tmp_path, 'MODEL_CARD.md'), encoding='utf-8').read()
  data_line = next(line for line in card.splitlines() if line.startswith('| data |'))
  assert 'pieces of ShareGPT V3 conversations' in data_line
  assert "SmolLM2's own replies to" in data_line and 'built-in training prompts' not in data_line
