"""Inputs (text, JSONL, TSV), encoding limits, length buckets, vocabularies, seqio tasks."""

import importlib.util
import json
import sys

import numpy as np
import pytest
import sentencepiece

from speclm import data
from speclm.data import inputs


def _write(path, text):
  path.write_text(text, encoding='utf-8')
  return str(path)


def test_reads_jsonl_with_ids_and_references(tmp_path):
  path = _write(tmp_path / 'a.jsonl',
                json.dumps({'id': 'x', 'input': 'hello', 'reference': 'hallo'}) + '\n\n'
                + json.dumps({'input': 'world'}) + '\n')
  examples = data.read_examples(path)
  assert [(e.index, e.id, e.input, e.reference) for e in examples] == [
      (0, 'x', 'hello', 'hallo'), (1, '1', 'world', None)]


def test_reads_tsv_with_escapes_and_custom_columns(tmp_path):
  path = _write(tmp_path / 'a.tsv', 'a\\tb\tref one\nline\\ntwo\tref two\n')
  examples = data.read_examples(path)
  assert [e.input for e in examples] == ['a\tb', 'line\ntwo']
  assert [e.reference for e in examples] == ['ref one', 'ref two']
  path3 = _write(tmp_path / 'b.tsv', 'id7\tin\tout\n')
  (example,) = data.read_examples(path3, tsv_columns=('id', 'input', 'reference'))
  assert (example.id, example.input, example.reference) == ('id7', 'in', 'out')


def test_reads_plain_text_with_prefix_and_limit(tmp_path):
  path = _write(tmp_path / 'a.txt', 'first\n\nsecond\nthird\n')
  examples = data.read_examples(path, input_prefix='summarize: ', max_examples=2)
  assert [(e.id, e.input) for e in examples] == [('1', 'summarize: first'),
                                                 ('3', 'summarize: second')]


@pytest.mark.parametrize('text, fmt, match', [
    ('{"input": "a"}\nnot json\n', 'jsonl', r'a\.jsonl:2 is not valid JSON'),
    ('{"text": "a"}\n', 'jsonl', "no 'input' field"),
    ('only one column\n', 'tsv', 'has 1 tab-separated fields, expected 2'),
    ('{"id": 1, "input": "a"}\n{"id": 1, "input": "b"}\n', 'jsonl', 'appears twice'),
])
def test_malformed_files_name_the_line(tmp_path, text, fmt, match):
  path = _write(tmp_path / 'a.jsonl', text)
  with pytest.raises(data.DataError, match=match):
    data.read_examples(path, format=fmt)


def test_missing_file():
  with pytest.raises(data.DataError, match='does not exist'):
    data.read_examples('/nonexistent/file.jsonl')


def test_byte_vocabulary_round_trip_and_eos():
  v = data.ByteVocabulary()
  ids = v.encode('héllo')
  assert min(ids) >= 3 and v.vocab_size == 259
  assert v.decode(ids) == 'héllo'
  assert v.decode(v.encode('ab') + [v.eos_id] + v.encode('cd')) == 'ab'
  assert v.decode([v.pad_id] + ids) == 'héllo'


def test_function_vocabulary_adapts_any_tokenizer():
  words = ['<pad>', '</s>', 'a', 'b']
  v = data.FunctionVocabulary(lambda t: [words.index(w) for w in t.split()],
                              lambda ids: ' '.join(words[i] for i in ids), vocab_size=4, eos_id=1)
  assert v.encode('a b a') == [2, 3, 2]
  assert v.decode([2, 3, 1, 2]) == 'a b'


def test_sentencepiece_vocabulary(tmp_path):
  corpus = tmp_path / 'corpus.txt'
  corpus.write_text('\n'.join(['the cat sat on the mat', 'a dog ran in the park',
                               'birds sing over the trees'] * 20))
  prefix = str(tmp_path / 'sp')
  sentencepiece.SentencePieceTrainer.Train(
      input=str(corpus), model_prefix=prefix, vocab_size=24, model_type='unigram',
      pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
  v = data.SentencePieceVocabulary(prefix + '.model', extra_ids=5)
  assert (v.pad_id, v.eos_id, v.vocab_size) == (0, 1, 29)
  ids = v.encode('the cat sat')
  assert v.decode(ids + [1, 7]) == 'the cat sat'
  assert v.decode(ids + [26]) == 'the cat sat'  # sentinel ids are dropped
  with pytest.raises(FileNotFoundError, match='does not exist'):
    data.SentencePieceVocabulary(str(tmp_path / 'missing.model'))


def _examples(*texts):
  return [inputs.Example(index=i, id=str(i), input=t) for i, t in enumerate(texts)]


def test_truncate_keeps_eos_and_counts():
  v = data.ByteVocabulary()
  encoded = data.encode_examples(_examples('abcdefgh', 'ab'), v, max_input_length=4,
                                 add_eos=True)
  assert encoded[0].truncated and encoded[0].ids == tuple(v.encode('abc')) + (v.eos_id,)
  assert not encoded[1].truncated and encoded[1].ids == tuple(v.encode('ab')) + (v.eos_id,)


def test_skip_and_error_policies():
  v = data.ByteVocabulary()
  encoded = data.encode_examples(_examples('abcdefgh', 'ab', ''), v, max_input_length=4,
                                 on_too_long='skip')
  assert 'more than max_input_length=4' in encoded[0].skipped
  assert encoded[1].skipped is None
  assert encoded[2].skipped == 'input encodes to no tokens'
  with pytest.raises(data.DataError, match="1 input\\(s\\) are longer .* '0' \\(8 tokens\\)"):
    data.encode_examples(_examples('abcdefgh', 'ab'), v, max_input_length=4,
                         on_too_long='error')


def test_buckets_and_fixed_batch_shapes():
  assert data.default_buckets(100) == (16, 32, 64, 100)
  assert data.default_buckets(16) == (16,)
  # Above 512, four widths a doubling: a long prompt pads by at most a quarter of its octave.
  assert data.default_buckets(2048) == (16, 32, 64, 128, 256, 512, 640, 768, 896, 1024, 1280,
                                        1536, 1792, 2048)
  assert data.default_buckets(700) == (16, 32, 64, 128, 256, 512, 640, 700)
  assert data.bucket_width(1187, data.default_buckets(2048)) == 1280
  assert data.bucket_width(17, (16, 32)) == 32
  v = data.ByteVocabulary()
  texts = ['a' * n for n in (3, 20, 5, 30, 7)]
  encoded = data.encode_examples(_examples(*texts), v, max_input_length=32)
  batches = data.make_batches(encoded, batch_size=2, buckets=(8, 32), pad_id=0)
  shapes = [b.tokens.shape for b in batches]
  assert shapes == [(2, 8), (2, 8), (2, 32)]  # every batch has batch_size rows
  assert [[e.example.index for e in b.examples] for b in batches] == [[0, 2], [4], [1, 3]]
  last_short = batches[1]
  assert last_short.num_real == 1
  np.testing.assert_array_equal(last_short.tokens[1], last_short.tokens[0])  # padding row
  np.testing.assert_array_equal(batches[2].lengths, [20, 30])


def test_synthetic_dataset_is_deterministic():
  a = data.synthetic_dataset(num_examples=5, seed=3)
  b = data.synthetic_dataset(num_examples=5, seed=3)
  assert a == b and len({e.id for e in a}) == 5
  assert inputs.fingerprint(a) == inputs.fingerprint(b)
  assert inputs.fingerprint(a) != inputs.fingerprint(data.synthetic_dataset(5, seed=4))


# Skipped only where seqio is not installed at all (it is in CI: `.ci/run` installs the seqio
# extra); an installed seqio that fails to import fails the test.
@pytest.mark.skipif(importlib.util.find_spec('seqio') is None,
                    reason='seqio is an optional extra (pip install "speclm[seqio]")')
def test_seqio_task_over_a_local_file(tmp_path):
  import seqio  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from speclm.data import seqio_tasks  # pylint: disable=g-import-not-at-top

  path = tmp_path / 'ende.tsv'
  path.write_text('Hello world.\tHallo Welt.\nThank you.\tDanke.\n', encoding='utf-8')

  def dataset_fn(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    lines = tf.data.TextLineDataset(str(path))
    fields = lines.map(lambda line: tf.strings.split(line, '\t'))
    return fields.map(lambda f: {'en': f[0], 'de': f[1]})

  source = seqio.FunctionDataSource(dataset_fn, splits=['validation'])
  name = 'speclm_test_local_ende'
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  seqio_tasks.add_translation_task(name, source, vocabulary=seqio.ByteVocabulary())
  examples = seqio_tasks.seqio_dataset(task_name=name, split='validation')
  assert [(e.input, e.reference) for e in examples] == [
      ('translate English to German: Hello world.', 'Hallo Welt.'),
      ('translate English to German: Thank you.', 'Danke.')]
  # The paper's tasks are registered under T5's names, with TFDS sources.
  ende, cnndm = seqio_tasks.register_paper_tasks()
  assert {ende, cnndm} <= set(seqio.TaskRegistry.names())
  with pytest.raises(data.DataError, match='No seqio task named'):
    seqio_tasks.seqio_dataset(task_name='no_such_task')


def test_seqio_dataset_without_seqio_explains(monkeypatch):
  monkeypatch.setitem(sys.modules, 'seqio', None)  # `import seqio` raises, installed or not
  from speclm.data import seqio_tasks  # pylint: disable=g-import-not-at-top
  with pytest.raises(ImportError, match='optional seqio extra'):
    seqio_tasks.seqio_dataset(task_name='wmt_t2t_ende_v003')



def test_grounded_prompts_come_from_docstrings_and_stay_apart_from_evaluation(tmp_path):
  """Passages are docstrings' first paragraphs (modules, classes, functions; test folders left
  out, too short ones dropped); each request holds one passage, deterministically per seed."""
  from speclm.data import builtin_prompts  # pylint: disable=import-outside-toplevel
  from speclm.data import grounded_prompts  # pylint: disable=import-outside-toplevel
  long_text = 'The quick brown fox jumps over the lazy dog. ' * 6
  (tmp_path / 'pkg').mkdir()
  (tmp_path / 'pkg' / 'mod.py').write_text(
      f'"""{long_text}\n\nSecond paragraph of the module."""\n\n'
      f'class Thing:\n  """Class: {long_text}"""\n\n'
      f'def helper():\n  """Too short."""\n')
  (tmp_path / 'tests').mkdir()
  (tmp_path / 'tests' / 'test_mod.py').write_text(f'"""Test: {long_text}"""\n')
  (tmp_path / 'broken.py').write_text('def (:\n')
  passages = grounded_prompts.stdlib_passages(min_chars=100, max_chars=400, root=str(tmp_path))
  assert passages == [f'{long_text.strip()}\nSecond paragraph of the module.',
                      f'Class: {long_text.strip()}']
  many = [f'Passage number {i}: ' + long_text for i in range(40)]
  prompts = grounded_prompts.grounded_prompts(30, seed=1, passages=many)
  assert prompts == grounded_prompts.grounded_prompts(30, seed=1, passages=many)
  assert prompts != grounded_prompts.grounded_prompts(30, seed=2, passages=many)
  assert len(set(prompts)) == 30
  assert all(sum(p in prompt for p in many) == 1 for prompt in prompts)
  assert len({prompt.split('\n\n')[0] for prompt in prompts}) > 3  # several kinds of task
  evaluation = set(builtin_prompts.demo_prompts()) | set(builtin_prompts.heldout_prompts(192))
  assert not evaluation & set(grounded_prompts.grounded_prompts(50))
