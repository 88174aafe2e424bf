"""Multi-turn jobs: a later turn is asked after the model's own reply to the earlier ones.

A conversational dataset (`speclm.data.conversations`: one `Turn` example per user message)
is decoded turn by turn in one job: every conversation's first turn (batched and resumed as any
dataset's examples), then every second turn, and so on. A later turn's input is the whole
conversation rendered with the vocabulary's chat template (`Vocabulary.encode_conversation`):
user, assistant, …, user, where each assistant message is the reply recorded for the earlier
turn by the same method. In compare mode each method thus conditions on its own replies; at
temperature 0 they are identical, so both methods decode the same inputs. The replies are read
back from predictions.jsonl, so a job killed during turn 2 resumes with every recorded turn
and decodes only the rest.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from speclm.data import conversations
from speclm.data import inputs as inputs_lib
from speclm.data import vocab as vocab_lib
from speclm.run.errors import JobError

EARLIER_SKIPPED = 'an earlier turn of the conversation was not decoded (skipped)'


def check_inputs(examples: Sequence[inputs_lib.Example], vocabulary: vocab_lib.Vocabulary,
                 process_count: int) -> None:
  """Refuses a multi-turn dataset the job cannot decode: one without a chat template to render
  conversations with, or one split over several processes (a turn's process must hold the
  reply to the earlier turn)."""
  if not any(isinstance(e, conversations.Turn) and e.turn > 1 for e in examples):
    return
  if not vocabulary.renders_conversations:
    raise JobError(f'The dataset has conversations of several turns, but the vocabulary'
                   f' ({vocabulary!r}) has no chat template to render them with. Use a chat'
                   ' vocabulary (e.g. VOCABULARY = @smollm2_chat_vocabulary).')
  if process_count > 1:
    raise JobError('Conversations of several turns are decoded by one process (a later turn'
                   ' needs the reply to the earlier one); run the job on one process.')


def first_turns(examples: Sequence[inputs_lib.Example]) -> list[inputs_lib.Example]:
  """The examples decoded from their own text: all of a plain dataset's, the first turns of a
  conversational one."""
  return [e for e in examples if not (isinstance(e, conversations.Turn) and e.earlier)]


def later_turns(examples: Sequence[inputs_lib.Example]) -> list[list[conversations.Turn]]:
  """The later turns grouped by turn number (2, 3, …), each group in dataset order; empty for
  a plain dataset."""
  by_turn: dict[int, list[conversations.Turn]] = {}
  for example in examples:
    if isinstance(example, conversations.Turn) and example.earlier:
      by_turn.setdefault(example.turn, []).append(example)
  return [by_turn[turn] for turn in sorted(by_turn)]


def pending_later(examples: Sequence[inputs_lib.Example], done) -> int:
  """How many later turns are not yet recorded (`done`: recorded examples by index)."""
  return sum(1 for group in later_turns(examples) for e in group if e.index not in done)


def conversation(turn: conversations.Turn, examples: Mapping[int, inputs_lib.Example],
                 recorded: dict[int, dict[str, Any]], method: str) -> list[dict[str, str]] | None:
  """The messages of `turn`'s conversation as `method` saw it: each earlier user message and
  the reply `method` recorded for it, then this turn's message. None when an earlier turn has
  no reply (it was skipped).

  Args:
    examples: the dataset's examples by index; recorded: the records so far, by index.
  """
  messages = []
  for index in turn.earlier:
    record = recorded.get(index)
    if record is None or 'skipped' in record or method not in record:
      return None
    messages += [{'role': 'user', 'content': examples[index].input},
                 {'role': 'assistant', 'content': record[method]['output']}]
  messages.append({'role': 'user', 'content': turn.input})
  return messages


def encode_turn(turn: conversations.Turn, examples: Mapping[int, inputs_lib.Example],
                recorded: dict[int, dict[str, Any]], vocabulary: vocab_lib.Vocabulary,
                methods: Sequence[str], *, input_limit: int,
                on_too_long: str) -> dict[str, inputs_lib.EncodedExample]:
  """`turn`'s input ids per method, held to `input_limit` by the `on_too_long` rule of
  `speclm.data.inputs.encode_examples` ('truncate' keeps the first tokens). A turn one method
  cannot decode (an earlier turn skipped, or too long with 'skip') is skipped for all."""
  encoded = {}
  for method in methods:
    messages = conversation(turn, examples, recorded, method)
    if messages is None:
      return {m: inputs_lib.EncodedExample(turn, (), skipped=EARLIER_SKIPPED) for m in methods}
    ids = vocabulary.encode_conversation(messages)
    if len(ids) <= input_limit:
      encoded[method] = inputs_lib.EncodedExample(turn, tuple(ids))
    elif on_too_long == 'truncate':
      encoded[method] = inputs_lib.EncodedExample(turn, tuple(ids[:input_limit]), truncated=True)
    elif on_too_long == 'skip':
      reason = (f'the conversation has {len(ids)} tokens, more than the input limit'
                f' {input_limit}')
      return {m: inputs_lib.EncodedExample(turn, tuple(ids), skipped=reason) for m in methods}
    else:
      raise JobError(f'Turn {turn.turn} of conversation {turn.id!r} has {len(ids)} tokens,'
                     f' more than the input limit {input_limit}. Raise run_job.max_input_length,'
                     " or set run_job.on_too_long='truncate' (or 'skip').")
  return encoded


def turn_batches(encoded: Sequence[dict[str, inputs_lib.EncodedExample]],
                 methods: Sequence[str], *, batch_size: int, buckets: Sequence[int],
                 pad_id: int) -> list[dict[str, inputs_lib.Batch]]:
  """Batches of one turn, a `Batch` per method over the same rows (dataset order within a
  width): each row's width is the bucket of its longest method's input."""
  by_width: dict[int, list[dict[str, inputs_lib.EncodedExample]]] = {}
  for per_method in encoded:
    longest = max(item.length for item in per_method.values())
    by_width.setdefault(inputs_lib.bucket_width(longest, buckets), []).append(per_method)
  batches = []
  for width in sorted(by_width):
    rows = by_width[width]
    for start in range(0, len(rows), batch_size):
      chunk = rows[start:start + batch_size]
      batches.append({m: inputs_lib.make_batches([row[m] for row in chunk],
                                                 batch_size=batch_size, buckets=(width,),
                                                 pad_id=pad_id)[0] for m in methods})
  return batches


def decode_later_turns(examples: Sequence[inputs_lib.Example], read_recorded: Callable[[], list],
                       append: Callable[[list], None],
                       decode: Callable[[dict[str, inputs_lib.Batch]], None],
                       base_record: Callable[[inputs_lib.EncodedExample], dict[str, Any]],
                       vocabulary: vocab_lib.Vocabulary, methods: Sequence[str], *,
                       input_limit: int, on_too_long: str, batch_size: int,
                       buckets: Sequence[int]) -> None:
  """Decodes every later turn not yet recorded, turn 2 of every conversation before turn 3.

  Args:
    read_recorded: the records so far (predictions.jsonl, this run's appends included).
    append: records a list of records (the skipped turns').
    decode: decodes one batch per method (rows aligned) and records it.
    base_record: a skipped turn's record.
  """
  by_index = {e.index: e for e in examples}
  for group in later_turns(examples):
    recorded = {int(r['index']): r for r in read_recorded()}
    pending = [turn for turn in group if turn.index not in recorded]
    encoded = [encode_turn(turn, by_index, recorded, vocabulary, methods,
                           input_limit=input_limit, on_too_long=on_too_long)
               for turn in pending]
    skipped = [per_method[methods[-1]] for per_method in encoded
               if per_method[methods[-1]].skipped]
    if skipped:
      append([base_record(item) for item in skipped])
    for batch in turn_batches([e for e in encoded if not e[methods[-1]].skipped], methods,
                              batch_size=batch_size, buckets=buckets,
                              pad_id=vocabulary.pad_id):
      decode(batch)
