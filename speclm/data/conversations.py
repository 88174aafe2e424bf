"""Conversations as job input: question files in Spec-Bench's (and MT-bench's) format.

One JSON object per line:

  {"question_id": 81, "category": "writing", "turns": ["Compose …", "Rewrite …"]}

`turns` holds the user's messages, one or more. Each turn becomes an `Example` of its own (a
`Turn`, with the conversation's category, its turn number and the indices of its earlier
turns), so a job records, resumes and reports turn by turn. A later turn is asked after the
model's own reply to the earlier ones (`speclm.run.turns` renders the conversation with the
vocabulary's chat template); the turns are flattened in file order: conversation 1's turns,
then conversation 2's, ….

Spec-Bench's question file lists MT-bench's eight categories (writing, roleplay, reasoning, math,
coding, extraction, stem, humanities) before its five other tasks; `SPEC_BENCH_TASKS` maps them
to the one task 'mt_bench' its leaderboard reports.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from speclm.data import inputs as inputs_lib

DataError = inputs_lib.DataError

MT_BENCH_CATEGORIES = ('writing', 'roleplay', 'reasoning', 'math', 'coding', 'extraction',
                       'stem', 'humanities')
# Spec-Bench's six tasks: MT-bench's categories are one task, the others their own.
SPEC_BENCH_TASKS = {category: 'mt_bench' for category in MT_BENCH_CATEGORIES}


@dataclasses.dataclass(frozen=True)
class Turn(inputs_lib.Example):
  """One user turn of a conversation. `input` is the user's message of this turn, `id` the
  conversation's question_id (shared by its turns), `turn` 1, 2, …, and `earlier` the indices
  of the conversation's earlier turns, in order (empty for the first)."""

  category: str = ''
  turn: int = 1
  earlier: tuple[int, ...] = ()


def read_conversations(path: str, *, per_category: int | None = None,
                       category_map: Mapping[str, str] | None = None) -> list[Turn]:
  """Reads a question file into turns (see the module docstring for the format).

  Args:
    path: the JSONL file.
    per_category: keep only the first N conversations of each category (file order); None:
      all.
    category_map: renames categories before anything else (e.g. `SPEC_BENCH_TASKS`); a
      category it does not name keeps its name.

  Raises:
    DataError: the file is missing, or a row is bad (not JSON, no question_id, a repeated
      question_id, no category, missing or empty turns, a turn that is not a non-empty
      string); the message names the file and line.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise DataError(f'The question file path must be a string, got {path!r} (strings need'
                    " quotes in gin: spec_bench_dataset.path = 'question.jsonl').")
  if not os.path.isfile(path):
    raise DataError(f'The question file {path} does not exist.')
  if per_category is not None and per_category < 1:
    raise DataError(f'per_category must be >= 1 (or None for all), got {per_category}.')
  rows = _read_rows(path, category_map or {})
  if per_category is not None:
    counts: dict[str, int] = {}
    kept = []
    for row in rows:
      counts[row['category']] = counts.get(row['category'], 0) + 1
      if counts[row['category']] <= per_category:
        kept.append(row)
    rows = kept
  return _flatten(rows)


def _read_rows(path: str, category_map: Mapping[str, str]) -> list[dict[str, Any]]:
  """The file's conversations, each checked, with its category mapped."""
  rows, seen = [], {}
  with open(path, 'rb') as f:
    for line_number, raw in enumerate(f, start=1):
      where = f'{path}:{line_number}'
      try:
        line = raw.decode('utf-8')
      except UnicodeDecodeError:
        raise DataError(f'{where} is not UTF-8; save the file as UTF-8.') from None
      if not line.strip():
        continue
      row = _check_row(line, where)
      if row['question_id'] in seen:
        raise DataError(f'{where}: question_id {row["question_id"]!r} repeats line'
                        f' {seen[row["question_id"]]}; each conversation needs its own id.')
      seen[row['question_id']] = line_number
      row['category'] = category_map.get(row['category'], row['category'])
      rows.append(row)
  return rows


def _check_row(line: str, where: str) -> dict[str, Any]:
  """One line as {'question_id', 'category', 'turns'}, or a DataError naming `where`."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError as e:
    raise DataError(f'{where} is not valid JSON ({e.msg}).') from None
  if not isinstance(record, dict):
    raise DataError(f'{where} is not a JSON object with question_id, category and turns.')
  question_id = record.get('question_id')
  if question_id is None or isinstance(question_id, (bool, dict, list)):
    raise DataError(f'{where} has no question_id (a number or string).')
  category = record.get('category')
  if not isinstance(category, str) or not category:
    raise DataError(f'{where} has no category (a non-empty string).')
  turns = record.get('turns')
  if not isinstance(turns, list) or not turns:
    raise DataError(f'{where} has no turns: expected a non-empty list of the user\'s'
                    ' messages.')
  for number, turn in enumerate(turns, start=1):
    if not isinstance(turn, str) or not turn.strip():
      raise DataError(f'{where}: turn {number} is {type(turn).__name__} {turn!r:.40}, expected'
                      ' a non-empty string.')
  return {'question_id': str(question_id), 'category': category, 'turns': turns}


def _flatten(rows: list[dict[str, Any]]) -> list[Turn]:
  """Every conversation's turns in file order, indexed 0, 1, … across the conversations."""
  turns: list[Turn] = []
  for row in rows:
    earlier: list[int] = []
    for number, message in enumerate(row['turns'], start=1):
      index = len(turns)
      turns.append(Turn(index=index, id=row['question_id'], input=message,
                        category=row['category'], turn=number, earlier=tuple(earlier)))
      earlier.append(index)
  return turns


def is_conversational(examples) -> bool:
  """Whether a dataset's examples are conversation turns (`Turn`s)."""
  return any(isinstance(e, Turn) for e in examples)
