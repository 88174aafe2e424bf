"""`speclm.generate` (text in, text out) and the `checkpoint_llm` job on tiny saved checkpoints.

A random Qwen3 target and a draft (the target without its last layer) are saved with Hugging
Face transformers (safetensors), each with a word-level `tokenizer.json` built here and a
`tokenizer_config.json` holding a chat template and the end token, as real checkpoints ship
them. Two more drafts are refused: one ships a tokenizer of the same size whose ids differ,
the other has a larger vocabulary (and no tokenizer).
"""

import copy
import io
import json
import os
import shutil

import gin
import numpy as np
import pytest

import speclm
from speclm import outputs
from speclm import run
from speclm import text
from speclm import tokenizer as tokenizer_lib
from speclm.checkpoints import llm

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
tokenizers = pytest.importorskip('tokenizers')

VOCAB_SIZE = 64
SPECIAL = ['<pad>', '<eos>', '<unk>', '<|user|>', '<|assistant|>']
WORDS = 'hello world the a cat dog sat on mat and ran fast'.split()
TOKENS = SPECIAL + WORDS + [f'w{i}' for i in range(VOCAB_SIZE - len(SPECIAL) - len(WORDS))]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            '{% if add_generation_prompt %}<|assistant|>{% endif %}')
PROMPTS = ['hello world', 'the cat sat on the mat', 'a dog ran fast']
MAX_NEW = 10


def _save_tokenizer(directory, tokens):
  from tokenizers import models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  backend = tokenizers.Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)},
                                                  unk_token='<unk>'))
  backend.pre_tokenizer = pre_tokenizers.Whitespace()
  backend.add_special_tokens(SPECIAL)  # matched whole, before the whitespace split
  backend.save(os.path.join(directory, 'tokenizer.json'))
  config = {'eos_token': '<eos>', 'pad_token': '<pad>', 'chat_template': TEMPLATE}
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f)


def _save_qwen3(directory, *, layers, width, seed, tokens=TOKENS, vocab_size=VOCAB_SIZE,
                base=None, last_layer_scale=1.0):
  """A random Qwen3 saved as safetensors (float32, weights scaled up so each one matters);
  the weights `base` (a torch model) has under the same names are copied, and the last
  layer's output projections are scaled by `last_layer_scale`. Returns the model."""
  config = transformers.Qwen3Config(
      vocab_size=vocab_size, hidden_size=width, intermediate_size=2 * width,
      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
      head_dim=width // 4, max_position_embeddings=256, tie_word_embeddings=False)
  torch.manual_seed(seed)
  model = transformers.Qwen3ForCausalLM(config).float().eval()
  with torch.no_grad():
    for param in model.parameters():
      param.normal_(0.0, 0.3)
    last = model.model.layers[-1]
    last.self_attn.o_proj.weight.mul_(last_layer_scale)
    last.mlp.down_proj.weight.mul_(last_layer_scale)
    if base is not None:  # a longer vocabulary axis gets the base's rows first
      own = model.state_dict()
      for name, value in base.state_dict().items():
        if name in own:
          own[name][tuple(slice(0, n) for n in value.shape)] = value
  model.save_pretrained(directory, safe_serialization=True)
  if tokens is not None:
    _save_tokenizer(directory, tokens)
  return model


@pytest.fixture(scope='module')
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp('checkpoints')
  target = _save_qwen3(root / 'target', layers=2, width=32, seed=0, last_layer_scale=0.3)
  # The draft is the target without its (quieter) last layer: it agrees with it often, so
  # rounds keep drafted tokens as well as reject them.
  _save_qwen3(root / 'draft', layers=1, width=32, seed=1, base=target)
  other_tokens = SPECIAL + list(reversed(TOKENS[len(SPECIAL):]))  # same size, other ids
  _save_qwen3(root / 'other', layers=1, width=16, seed=2, tokens=other_tokens)
  _save_qwen3(root / 'bigger', layers=1, width=16, seed=3, tokens=None,
              vocab_size=VOCAB_SIZE + 16)
  # The target's tokenizer, the embedding table padded by 16 rows (as Qwen2.5's small models).
  _save_qwen3(root / 'padded', layers=1, width=32, seed=1, base=target,
              vocab_size=VOCAB_SIZE + 16)
  names = {'target': 'target', 'draft': 'draft', 'other_tokenizer': 'other',
           'other_vocab': 'bigger', 'padded': 'padded'}
  return {key: str(root / name) for key, name in names.items()}


@pytest.fixture(scope='module')
def speculative(dirs):
  """generate(target, draft, PROMPTS), greedy: the paths-in, texts-out case every test reuses."""
  return speclm.generate(dirs['target'], dirs['draft'], PROMPTS, max_new_tokens=MAX_NEW,
                         gamma=3)


def test_greedy_generate_with_a_draft_equals_the_target_alone(dirs, speculative):
  tok = llm.load_llm_tokenizer(dirs['target'])
  alone = speclm.generate(dirs['target'], None, PROMPTS, max_new_tokens=MAX_NEW)
  assert speculative.tokens == alone.tokens
  assert speculative.texts == alone.texts
  # The same as the decode loop on the chat-encoded prompts (the tokenizer has a template).
  rows = [tok.encode_chat(p) for p in PROMPTS]
  assert rows[0] == [3, TOKENS.index('hello'), TOKENS.index('world'), 4]
  prompts, lengths = tok.batch(rows)
  baseline = speclm.autoregressive_decode(llm.load_llm(dirs['target']), prompts, lengths,
                                          max_new_tokens=MAX_NEW, eos_id=tok.eos_id)
  assert speculative.tokens == baseline.to_lists()
  assert speculative.texts == [tok.decode(t) for t in speculative.tokens]
  stats = speculative.result.stats  # rounds kept drafted tokens, and rejected some
  assert 0 < np.sum(stats.accepted_per_row) < np.sum(stats.beta_count_per_row)


def test_rows_stop_at_the_tokenizers_end_token(dirs, speculative):
  # The end token here is one the target generates: the fourth token of the first reply.
  tok = copy.copy(llm.load_llm_tokenizer(dirs['target']))
  first = speculative.tokens[0]
  tok.eos_id = first[3]
  out = speclm.generate(dirs['target'], dirs['draft'], PROMPTS, tokenizer=tok,
                        max_new_tokens=MAX_NEW, gamma=3)
  stop = first.index(tok.eos_id)
  assert out.tokens[0] == first[:stop + 1]
  assert out.texts[0] == tok.decode(first[:stop]) != speculative.texts[0]
  for row, full, reason in zip(out.tokens, speculative.tokens, out.result.stop_reasons):
    ended = tok.eos_id in full
    assert row == (full[:full.index(tok.eos_id) + 1] if ended else full)
    assert speclm.StopReason(int(reason)) == (speclm.StopReason.END_OF_SEQUENCE if ended else
                                              speclm.StopReason.MAX_NEW_TOKENS)
  # stop_at_eos=False: every row runs to max_new_tokens.
  assert speclm.generate(dirs['target'], dirs['draft'], PROMPTS, tokenizer=tok, gamma=3,
                         max_new_tokens=MAX_NEW, stop_at_eos=False).tokens == speculative.tokens


def test_the_checkpoints_other_end_tokens_stop_rows(tmp_path, dirs, speculative):
  """generation_config.json's eos_token_id list (a chat model's end of turn) ends rows too."""
  import shutil  # pylint: disable=import-outside-toplevel
  target = tmp_path / 'target'
  shutil.copytree(dirs['target'], target)
  end_of_turn = speculative.tokens[1][2]
  (target / 'generation_config.json').write_text(json.dumps({'eos_token_id': [1, end_of_turn]}))
  tok = llm.load_llm_tokenizer(target)
  assert tok.end_ids == (tok.eos_id, end_of_turn)
  out = speclm.generate(str(target), dirs['draft'], PROMPTS, max_new_tokens=MAX_NEW, gamma=3)
  for row, full in zip(out.tokens, speculative.tokens):
    assert row == (full[:full.index(end_of_turn) + 1] if end_of_turn in full else full)
  assert out.texts[1] == tok.decode(speculative.tokens[1][:2])


def test_loaded_models_token_id_prompts_and_a_token_tree(dirs, speculative):
  tok = llm.load_llm_tokenizer(dirs['target'])
  target, draft = llm.load_llm(dirs['target']), llm.load_llm(dirs['draft'])
  ids = [tok.encode_chat(p) for p in PROMPTS]
  out = speclm.generate(target, draft, ids, tokenizer=dirs['target'],
                        max_new_tokens=MAX_NEW, gamma=3)
  assert out.tokens == speculative.tokens and out.texts == speculative.texts
  tree = speclm.generate(target, draft, PROMPTS, tokenizer=tok, max_new_tokens=MAX_NEW,
                         tree=speclm.TreeShape.from_branching([2, 1]))
  assert tree.tokens == speculative.tokens
  with pytest.raises(ValueError, match='needs a tokenizer for a loaded target'):
    speclm.generate(target, draft, PROMPTS)


def test_a_draft_with_another_tokenizer_or_vocabulary_is_refused(dirs):
  with pytest.raises(ValueError, match=r"draft's tokenizer differs from the target's: 58 ids"
                     r" name other tokens \(id 5 is 'hello' in the target's, 'w46' in the"):
    speclm.generate(dirs['target'], dirs['other_tokenizer'], PROMPTS)
  with pytest.raises(ValueError, match='vocabularies differ: draft has 80 tokens, target 64'):
    speclm.generate(dirs['target'], dirs['other_vocab'], PROMPTS)


def test_a_draft_with_a_padded_table_is_fitted_to_the_target(dirs, speculative):
  """Same tokenizer, 16 more embedding rows: q̃ over the target's ids, the same greedy output."""
  padded = speclm.generate(dirs['target'], dirs['padded'], PROMPTS, max_new_tokens=MAX_NEW,
                           gamma=3)
  assert padded.tokens == speculative.tokens
  assert padded.result.stats.alpha > 0


def test_tokenizers_are_compared_on_the_ids_both_have():
  from tokenizers import models  # pylint: disable=import-outside-toplevel

  def word_level(tokens):
    return tokenizer_lib.Tokenizer(tokenizers.Tokenizer(models.WordLevel(
        {t: i for i, t in enumerate(tokens)}, unk_token='<unk>')))

  ours = word_level(TOKENS)
  text.check_same_tokenizer(ours, word_level(TOKENS + ['[PAD64]', '[PAD65]']))  # GGUF padding
  with pytest.raises(ValueError, match=r"1 ids name other tokens \(id 63 is 'w46' in the"
                     r" target's, 'x' in the draft's\)"):
    text.check_same_tokenizer(ours, word_level(TOKENS[:-1] + ['x']))


def test_prompt_encoding_and_settings_are_checked(dirs):
  tok = llm.load_llm_tokenizer(dirs['target'])
  plain = tokenizer_lib.Tokenizer.from_tokenizer_json(os.path.join(dirs['target'],
                                                                   'tokenizer.json'))
  assert text.encode_prompt(tok, 'hello') == [3, 5, 4]  # chat: the tokenizer has a template
  assert text.encode_prompt(tok, 'hello', chat=False) == [5]
  assert text.encode_prompt(plain, 'hello') == [5]  # no template: plain text
  assert text.encode_prompt(tok, [{'role': 'user', 'content': 'hello'}]) == [3, 5, 4]
  assert text.encode_prompt(tok, [7, 8]) == [7, 8]
  # One prompt (a string, a conversation, token ids) or a list of them.
  conversation = [{'role': 'user', 'content': 'hi'}]
  assert text._as_prompt_list('hi') == ['hi']  # pylint: disable=protected-access
  assert text._as_prompt_list(conversation) == [conversation]  # pylint: disable=protected-access
  assert text._as_prompt_list([7, 8]) == [[7, 8]]  # pylint: disable=protected-access
  assert text._as_prompt_list(['a', [7]]) == ['a', [7]]  # pylint: disable=protected-access
  with pytest.raises(ValueError, match='no chat template'):
    text.encode_prompt(plain, 'hello', chat=True)
  with pytest.raises(ValueError, match='sampling= or temperature'):
    speclm.generate(dirs['target'], None, PROMPTS, sampling=speclm.GREEDY, temperature=1.0)
  with pytest.raises(ValueError, match='token tree needs a draft'):
    speclm.generate(dirs['target'], None, PROMPTS, tree=speclm.TreeShape.from_branching([2]))
  with pytest.raises(ValueError, match='No prompts'):
    speclm.generate(dirs['target'], None, [])


def _run_job(output_dir, dirs, prompts_path, *bindings):
  """runs/checkpoint_llm.gin on the tiny checkpoints: one batch of the 3 prompts, 16 wide, the
  shapes `generate` decoded them in (the compiled loops are reused)."""
  gin.clear_config()
  try:
    run.parse_gin(['runs/checkpoint_llm.gin'], [
        f"TARGET_PATH = '{dirs['target']}'", f"PROMPTS_PATH = '{prompts_path}'",
        f"OUTPUT_DIR = '{output_dir}'", f'MAX_NEW_TOKENS = {MAX_NEW}', 'GAMMA = 3',
        'BATCH_SIZE = 3', 'MAX_INPUT_LENGTH = 16', 'run_job.length_buckets = [16]',
        'run_job.measure_cost = False', 'run_job.reference_metrics = []', *bindings])
    return run.run_job(progress_stream=io.StringIO())  # pylint: disable=missing-kwoa
  finally:
    gin.clear_config()


def test_the_checkpoint_llm_job_runs_end_to_end(tmp_path, dirs, speculative):
  prompts_path = tmp_path / 'prompts.jsonl'
  prompts_path.write_text(''.join(json.dumps({'input': p}) + '\n' for p in PROMPTS))
  metrics = _run_job(tmp_path / 'out', dirs, prompts_path, f"DRAFT_PATH = '{dirs['draft']}'")
  assert metrics['identical_output_rate'] == 1.0
  records = sorted(outputs.read_predictions(str(tmp_path / 'out' / 'predictions.jsonl')),
                   key=lambda r: r['index'])
  # Each input is a chat user message, decoded as speclm.generate decodes it.
  assert [r['speculative']['tokens'] for r in records] == speculative.tokens
  assert [r['output'] for r in records] == speculative.texts
  # A draft whose tokenizer gives other ids stops the job before anything is decoded.
  with pytest.raises(run.JobError, match="Loading the draft model failed: The draft's tokenizer"
                     ' differs'):
    _run_job(tmp_path / 'refused', dirs, prompts_path,
             f"DRAFT_PATH = '{dirs['other_tokenizer']}'")
  assert not (tmp_path / 'refused' / 'predictions.jsonl').exists()


def test_the_vocabulary_providers(tmp_path, dirs):
  from speclm.run import providers  # pylint: disable=import-outside-toplevel
  chat = providers.checkpoint_chat_vocabulary(path=dirs['target'])
  assert chat.encode('hello') == [3, 5, 4] and chat.decode([5, 6, 1, 7]) == 'hello world'
  assert (chat.eos_id, chat.pad_id, chat.vocab_size) == (1, 0, VOCAB_SIZE)
  assert providers.checkpoint_tokenizer(path=dirs['target']).encode('hello') == [5]
  plain = tmp_path / 'plain'
  plain.mkdir()
  for name in ('config.json', 'tokenizer.json'):
    shutil.copy(os.path.join(dirs['target'], name), plain / name)
  with pytest.raises(run.JobError, match='no chat template: encode its inputs as plain text'):
    providers.checkpoint_chat_vocabulary(path=str(plain))


def test_the_run_file_names_what_to_set():
  gin.clear_config()
  gin.add_config_file_search_path(run.CONFIGS_DIR)
  try:
    gin.parse_config_files_and_bindings(['runs/checkpoint_llm.gin'], [], finalize_config=False)
    assert run.unset_required() == ['DRAFT_PATH', 'OUTPUT_DIR', 'PROMPTS_PATH', 'TARGET_PATH']
  finally:
    gin.clear_config()
