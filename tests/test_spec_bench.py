"""Spec-Bench as a job: the question reader, later turns conditioned on the model's own reply,
per-turn resume after a kill, the report by category, and the summary at temperature > 0.

Every file is written here (tmp_path); nothing reads the shared question file.
"""

import io
import json

import gin
import pytest

from speclm import outputs
from speclm import run
from speclm import sampling as sampling_lib
from speclm.analysis import job_metrics
from speclm.data import conversations
from speclm.data import vocab as vocab_lib
from speclm.run import providers
from speclm.run import records as records_lib

ROWS = [
    {'question_id': 81, 'category': 'writing', 'turns': ['Hi there', 'And more?']},
    {'question_id': 82, 'category': 'writing', 'turns': ['Tell me', 'Why?']},
    {'question_id': 83, 'category': 'roleplay', 'turns': ['Act', 'Again']},
    {'question_id': 'tr-1', 'category': 'translation', 'turns': ['Say hola']},
    {'question_id': 'tr-2', 'category': 'translation', 'turns': ['Say adios']},
]


def write_rows(path, rows):
  path.write_text(''.join((r if isinstance(r, str) else json.dumps(r)) + '\n' for r in rows))
  return str(path)


# ----------------------------------------------------------------------------------------------
# The reader


def test_reader_flattens_one_and_two_turn_conversations(tmp_path):
  turns = conversations.read_conversations(write_rows(tmp_path / 'q.jsonl', ROWS))
  assert [(t.index, t.id, t.turn, t.earlier, t.input) for t in turns] == [
      (0, '81', 1, (), 'Hi there'), (1, '81', 2, (0,), 'And more?'),
      (2, '82', 1, (), 'Tell me'), (3, '82', 2, (2,), 'Why?'),
      (4, '83', 1, (), 'Act'), (5, '83', 2, (4,), 'Again'),
      (6, 'tr-1', 1, (), 'Say hola'), (7, 'tr-2', 1, (), 'Say adios')]
  assert [t.category for t in turns] == ['writing'] * 4 + ['roleplay'] * 2 + ['translation'] * 2


def test_per_category_keeps_the_first_conversations_of_each(tmp_path):
  path = write_rows(tmp_path / 'q.jsonl', ROWS)
  turns = conversations.read_conversations(path, per_category=1)
  assert [(t.id, t.turn) for t in turns] == [('81', 1), ('81', 2), ('83', 1), ('83', 2),
                                             ('tr-1', 1)]
  # Spec-Bench's tasks: MT-bench's categories are one task, so one conversation of it is kept.
  grouped = providers.spec_bench_dataset(path, per_category=1)
  assert [(t.id, t.category) for t in grouped] == [('81', 'mt_bench'), ('81', 'mt_bench'),
                                                   ('tr-1', 'translation')]


@pytest.mark.parametrize('bad, message', [
    ({'question_id': 9, 'category': 'qa'}, 'has no turns'),
    ({'question_id': 9, 'category': 'qa', 'turns': []}, 'has no turns'),
    ({'question_id': 9, 'category': 'qa', 'turns': ['ok', 3]}, 'turn 2 is int'),
    ({'question_id': 9, 'category': 'qa', 'turns': ['  ']}, 'turn 1 is str'),
    ({'question_id': 9, 'turns': ['ok']}, 'has no category'),
    ({'category': 'qa', 'turns': ['ok']}, 'has no question_id'),
    ('{"question_id": 9, "turns": [', 'is not valid JSON'),
    ({'question_id': 82, 'category': 'qa', 'turns': ['ok']}, "question_id '82' repeats line 2"),
])
def test_bad_rows_are_refused_with_file_and_line(tmp_path, bad, message):
  path = write_rows(tmp_path / 'q.jsonl', ROWS[:2] + [bad])
  with pytest.raises(conversations.DataError) as error:
    conversations.read_conversations(path)
  assert str(error.value).startswith(f'{path}:3'), str(error.value)
  assert message in str(error.value)


# ----------------------------------------------------------------------------------------------
# Jobs on tiny random models with a byte-level chat template


def render(messages):
  """A simple chat template: each message in its role's tags, then the reply's opening tag."""
  tags = {'user': 'u', 'assistant': 'a'}
  return ''.join(f"<{tags[m['role']]}>{m['content']}</{tags[m['role']]}>"
                 for m in messages) + '<a>'


def chat_vocabulary():
  """Bytes as ids (`ByteVocabulary`), inputs rendered with `render`."""
  byte = vocab_lib.ByteVocabulary()
  return vocab_lib.FunctionVocabulary(
      lambda text: byte.encode(render([{'role': 'user', 'content': text}])), byte.decode,
      byte.vocab_size, eos_id=byte.eos_id, pad_id=byte.pad_id,
      conversation_fn=lambda messages: byte.encode(render(messages)))


def spec_bench_job(output_dir, path, *bindings, vocabulary=None):
  """A tiny compare job (test_tiny.gin's models) over the question file at `path`."""
  gin.clear_config()
  try:
    run.parse_gin(['test_tiny.gin'], [
        f"OUTPUT_DIR = '{output_dir}'", 'run_job.measure_cost = False',
        'run_job.show_progress = False', 'DATASET = @spec_bench_dataset',
        f"spec_bench_dataset.path = '{path}'", 'MAX_NEW_TOKENS = 8', 'BATCH_SIZE = 2',
        *bindings])
    return run.run_job(vocabulary=vocabulary or chat_vocabulary(),  # pylint: disable=missing-kwoa
                       progress_stream=io.StringIO())
  finally:
    gin.clear_config()


def test_a_later_turn_follows_each_methods_own_reply(tmp_path, monkeypatch):
  path = write_rows(tmp_path / 'q.jsonl', ROWS)
  seen = {}  # (method, example index) -> the input ids that method decoded
  decode_one = records_lib.decode_one

  def spy(method, target, draft, batch, **kwargs):
    for row, item in enumerate(batch.examples):
      seen[(method, item.example.index)] = [int(t) for t in
                                            batch.tokens[row, :batch.lengths[row]]]
    return decode_one(method, target, draft, batch, **kwargs)

  monkeypatch.setattr(records_lib, 'decode_one', spy)
  metrics = spec_bench_job(tmp_path / 'out', path)
  records = {r['index']: r for r in outputs.read_predictions(
      str(tmp_path / 'out' / outputs.PREDICTIONS))}
  assert sorted(records) == list(range(8))
  assert [records[i]['turn'] for i in range(8)] == [1, 2, 1, 2, 1, 2, 1, 1]
  byte = vocab_lib.ByteVocabulary()
  for index in (1, 3, 5):  # the second turns
    record, first = records[index], records[index - 1]
    assert record['category'] == first['category'] == 'mt_bench'
    for method in ('baseline', 'speculative'):
      reply = first[method]['output']
      first_input = seen[(method, index - 1)]
      ids = seen[(method, index)]
      # The conversation so far, with this method's own reply, then the new question.
      assert ids[:len(first_input)] == first_input
      assert ids == byte.encode(render([
          {'role': 'user', 'content': first['input']},
          {'role': 'assistant', 'content': reply},
          {'role': 'user', 'content': record['input']}]))
      assert record[method]['input_tokens'] == len(ids)
    assert record['identical']  # T = 0: both methods saw the same conversation
  assert set(metrics['by_category']) == {'mt_bench', 'translation', 'overall'}
  assert metrics['by_category']['mt_bench']['turns'] == 6
  assert metrics['by_category']['mt_bench']['examples'] == 3


def test_a_vocabulary_without_a_chat_template_is_refused(tmp_path):
  path = write_rows(tmp_path / 'q.jsonl', ROWS[:1])
  with pytest.raises(run.JobError, match='no chat template'):
    spec_bench_job(tmp_path / 'out', path, vocabulary=vocab_lib.ByteVocabulary())


class _Killed(BaseException):
  """Stands for SIGKILL: raised right after a write, nothing after it runs."""


def test_killed_during_turn_two_resumes_every_recorded_turn(tmp_path, monkeypatch):
  path = write_rows(tmp_path / 'q.jsonl', ROWS)
  bindings = ['TEMPERATURE = 1.0']  # each method's own reply differs: per-method batches
  spec_bench_job(tmp_path / 'reference', path, *bindings)
  expected = {r['index']: r for r in outputs.read_predictions(
      str(tmp_path / 'reference' / outputs.PREDICTIONS))}
  assert any(expected[i]['baseline']['input_tokens'] != expected[i]['speculative']['input_tokens']
             for i in (1, 3, 5))  # the methods' conversations differ
  append = outputs.OutputDir.append

  def killing_append(self, records):
    records = list(records)
    append(self, records)
    if any(r.get('turn') == 2 for r in records):  # the first batch of turn 2 is durable
      raise _Killed()

  monkeypatch.setattr(outputs.OutputDir, 'append', killing_append)
  killed_dir = tmp_path / 'killed'
  with pytest.raises(_Killed):
    spec_bench_job(killed_dir, path, *bindings)
  monkeypatch.setattr(outputs.OutputDir, 'append', append)
  before = (killed_dir / outputs.PREDICTIONS).read_bytes()
  kept = outputs.read_predictions(str(killed_dir / outputs.PREDICTIONS))
  assert sorted(r['turn'] for r in kept) == [1, 1, 1, 1, 1, 2, 2]  # a batch of two turn-2s

  metrics = spec_bench_job(killed_dir, path, *bindings)
  assert (killed_dir / outputs.PREDICTIONS).read_bytes().startswith(before)  # all kept
  assert metrics['job']['resumed_from'] == 7 and metrics['job']['decoded_this_run'] == 1
  records = outputs.read_predictions(str(killed_dir / outputs.PREDICTIONS))
  assert sorted(r['index'] for r in records) == list(range(8))
  for record in records:
    for method in ('baseline', 'speculative'):
      assert record[method]['tokens'] == expected[record['index']][method]['tokens']


# ----------------------------------------------------------------------------------------------
# The report


def hand_record(index, qid, category, base, spec):
  """A compare record: base = (tokens, time_s); spec = (tokens, time_s, target calls, β sum,
  β count)."""
  def entry(tokens, time_s, calls):
    return {'output': '', 'tokens': [5] * tokens, 'num_tokens': tokens, 'stop_reason': 'LENGTH',
            'target_calls': calls, 'time_s': time_s}
  speculative = dict(entry(spec[0], spec[1], spec[2]), accepted=0, beta_sum=spec[3],
                     beta_count=spec[4], gamma_histogram=[0, 0, 1])
  return {'index': index, 'id': qid, 'input': 'q', 'input_tokens': 3, 'truncated': False,
          'category': category, 'turn': 1, 'batch': index, 'batch_rows': 1,
          'baseline': entry(base[0], base[1], base[0]), 'speculative': speculative,
          'identical': False}


def test_by_category_against_hand_computed_numbers():
  records = [hand_record(0, 'a', 'qa', (10, 2.0), (10, 1.0, 4, 3.0, 6)),
             hand_record(1, 'a', 'qa', (20, 4.0), (20, 1.0, 6, 2.0, 4)),
             hand_record(2, 'b', 'math', (30, 3.0), (40, 2.0, 10, 1.0, 4))]
  metrics = job_metrics.compute_metrics(records, mode='compare', gamma=2,
                                        sampling=sampling_lib.SamplingConfig(temperature=1.0),
                                        reference_metrics=())
  table = metrics['by_category']
  assert list(table) == ['qa', 'math', 'overall']
  qa = table['qa']
  assert (qa['examples'], qa['turns']) == (1, 2)
  assert qa['speedup'] == pytest.approx(6.0 / 2.0)
  assert qa['tokens_per_target_call'] == pytest.approx(30 / 10)
  assert qa['alpha'] == pytest.approx(5.0 / 10)
  assert qa['baseline_tokens_per_s'] == pytest.approx(30 / 6.0)
  assert qa['speculative_tokens_per_s'] == pytest.approx(30 / 2.0)
  math = table['math']
  # at T = 1 the outputs differ in length: the ratio of rates (40 / 2 s against 30 / 3 s),
  # as Spec-Bench computes every row, not the time ratio 3 / 2
  assert math['speedup'] == pytest.approx((40 / 2.0) / (30 / 3.0))
  assert math['tokens_per_target_call'] == pytest.approx(4.0)
  assert math['alpha'] == pytest.approx(0.25)
  overall = table['overall']
  assert (overall['examples'], overall['turns']) == (2, 3)
  # Spec-Bench's overall: total tokens over total time per method, then their ratio (70 / 4 s
  # against 60 / 9 s), not the time ratio 9 / 4.
  assert overall['baseline_tokens_per_s'] == pytest.approx(60 / 9.0)
  assert overall['speculative_tokens_per_s'] == pytest.approx(70 / 4.0)
  assert overall['speedup'] == pytest.approx((70 / 4.0) / (60 / 9.0))
  assert overall['tokens_per_target_call'] == pytest.approx(70 / 20)
  assert overall['alpha'] == pytest.approx(6.0 / 14)
  text = job_metrics.summary(metrics)
  assert 'by category' in text
  math_line = next(line for line in text.splitlines() if line.startswith('math '))
  assert math_line.split() == ['math', '1', '2.00', '4.00', '0.250', '10.0', '20.0']
  # The headline speedup is the overall row's ratio of rates, the time ratio kept beside it,
  # and the summary and notes say why the two differ.
  assert metrics['speedup'] == pytest.approx(overall['speedup'])
  assert metrics['time_ratio'] == pytest.approx(9.0 / 4.0)
  headline = next(line for line in text.splitlines() if line.startswith('measured speedup'))
  assert headline.split()[2] == f"{(70 / 4.0) / (60 / 9.0):.2f}"
  assert 'the methods made different tokens' in headline
  assert any('made 60 (baseline) and 70 (speculative) tokens' in note and '2.25' in note
             for note in metrics['notes'])


def test_a_dataset_without_categories_has_no_table():
  record = hand_record(0, 'a', 'qa', (10, 2.0), (10, 1.0, 4, 3.0, 6))
  del record['category'], record['turn']
  metrics = job_metrics.compute_metrics([record], mode='compare', gamma=2,
                                        sampling=sampling_lib.GREEDY, reference_metrics=())
  assert 'by_category' not in metrics
  assert 'by category' not in job_metrics.summary(metrics)


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_the_summary_line_for_identical_outputs(temperature):
  record = hand_record(0, 'a', 'qa', (10, 2.0), (10, 1.0, 4, 3.0, 6))
  metrics = job_metrics.compute_metrics(
      [record], mode='compare', gamma=2,
      sampling=sampling_lib.SamplingConfig(temperature=temperature), reference_metrics=())
  line = next(line for line in job_metrics.summary(metrics).splitlines()
              if line.startswith('identical outputs'))
  if temperature > 0:
    assert line.split(None, 2)[2] == (
        "sampled: outputs differ by design, the distribution is the target's")
  else:
    assert line.split()[-1] == '0.0%'
