"""speclm.data.sharegpt: the tolerant reader, chat rendering with the reply mask, pieces,
the split and the overlap filter. Every file is made here (the package's is not needed)."""

import json

import numpy as np
import pytest

from speclm.data import sharegpt
from speclm.presets import smollm2


def _conversation(cid, *turns):
  roles = ('human', 'gpt')
  return {'id': cid, 'conversations': [{'from': roles[i % 2], 'value': text}
                                       for i, text in enumerate(turns)]}


def _write_truncated(path, elements, cut_chars=40):
  """A JSON array of `elements` as the package ships it: indented, cut off inside the last."""
  text = json.dumps(elements, indent=2)
  last = text.rindex('{\n    "id"')  # the start of the last element
  path.write_text(text[:last + cut_chars], encoding='utf-8')
  return str(path)


def test_reader_keeps_complete_conversations_and_counts_the_cut_one(tmp_path):
  elements = [_conversation('a', 'Hi', 'Hello!'),
              _conversation('b', 'Two turns?', 'Yes.', 'And again?', 'Again.'),
              {'id': 'c', 'conversations': [{'from': 'human', 'value': 'only a question'}]},
              {'id': 'd', 'conversations': [{'from': 'bing', 'value': 'x'}]},
              _conversation('e', 'cut', 'off here')]
  path = _write_truncated(tmp_path / 'sharegpt.json', elements)
  with pytest.raises(json.JSONDecodeError):
    json.loads(open(path, encoding='utf-8').read())  # what json.load would do
  counts = sharegpt.ReadCounts()
  read = list(sharegpt.read_conversations(path, counts))
  assert [c.id for c in read] == ['a', 'b']
  assert read[1].messages == ({'role': 'user', 'content': 'Two turns?'},
                              {'role': 'assistant', 'content': 'Yes.'},
                              {'role': 'user', 'content': 'And again?'},
                              {'role': 'assistant', 'content': 'Again.'})
  assert (counts.kept, counts.incomplete_tail, counts.empty, counts.unknown_role) == (2, 1, 1, 1)
  assert '2 conversations kept' in counts.summary()


def test_reader_reads_a_whole_array_and_rejects_other_files(tmp_path):
  whole = tmp_path / 'whole.json'
  whole.write_text(json.dumps([_conversation('a', 'Q', 'A')]), encoding='utf-8')
  counts = sharegpt.ReadCounts()
  assert len(list(sharegpt.read_conversations(str(whole), counts))) == 1
  assert counts.incomplete_tail == 0
  other = tmp_path / 'other.json'
  other.write_text('{"id": 1}', encoding='utf-8')
  with pytest.raises(sharegpt.ShareGPTError, match='not a JSON array'):
    list(sharegpt.read_conversations(str(other)))
  with pytest.raises(sharegpt.ShareGPTError, match='Cannot read'):
    list(sharegpt.read_conversations(str(tmp_path / 'missing.json')))


@pytest.mark.skipif(not smollm2.is_available(), reason=smollm2.SETUP_COMMAND)
def test_render_marks_exactly_the_replies_tokens():
  tokenizer = smollm2.load_tokenizer()
  messages = ({'role': 'user', 'content': 'Name a colour.'},
              {'role': 'assistant', 'content': 'Blue.'},
              {'role': 'user', 'content': 'Another one?'},
              {'role': 'assistant', 'content': 'Green, like grass.'})
  ids, mask = sharegpt.render(tokenizer, messages)
  # The same ids as the whole conversation encoded at once.
  whole = tokenizer.encode(tokenizer.render_chat(list(messages), add_generation_prompt=False),
                           add_bos=False)
  np.testing.assert_array_equal(ids, whole)
  # The masked runs are the two replies with their end token (and the template's newline).
  runs = np.split(np.flatnonzero(mask), np.flatnonzero(np.diff(np.flatnonzero(mask)) > 1) + 1)
  assert [tokenizer.decode(ids[run]) for run in runs] == ['Blue.', 'Green, like grass.']
  end = tokenizer.token_to_id('<|im_end|>')
  assert [ids[run][-2:].tolist() for run in runs] == [[end, tokenizer.encode('\n')[0]]] * 2
  # What precedes each run is the assistant's header, not part of the reply.
  header = tokenizer.encode('<|im_start|>assistant\n', add_bos=False)
  for run in runs:
    assert ids[run[0] - len(header):run[0]].tolist() == header


def test_windows_cut_and_keep_pieces_with_replies():
  ids = np.arange(10, dtype=np.int32)
  mask = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 1], bool)
  pieces = list(sharegpt.windows(ids, mask, width=4, min_reply_tokens=2))
  # [0..3] has no reply token after its first; [4..7] has 3; [8, 9] has 1 (dropped).
  assert [p[0].tolist() for p in pieces] == [[4, 5, 6, 7]]
  assert pieces[0][1].tolist() == [False, True, True, True]


def test_split_is_a_fixed_fraction_by_id():
  ids = [f'conv{i}' for i in range(20_000)]
  held = [sharegpt.is_heldout(i, 1.0) for i in ids]
  assert 0.008 < np.mean(held) < 0.012
  assert held == [sharegpt.is_heldout(i, 1.0) for i in ids]  # the same every time
  assert not any(sharegpt.is_heldout(i, 0.0) for i in ids[:1000])


def test_overlap_finds_eight_shared_words_regardless_of_case_and_punctuation():
  overlap = sharegpt.EvaluationOverlap(
      ['Compose an engaging travel blog post about a recent trip to Hawaii, highlighting'
       ' cultural experiences.', 'Hi there'])
  assert overlap.overlaps('Please COMPOSE an engaging travel blog post about a recent trip!')
  assert not overlap.overlaps('Compose an engaging travel blog post about Paris.')
  assert overlap.overlaps('hi, there')  # a short text must match whole
  assert not overlap.overlaps('hi there friend')
