"""Vocabularies: the seam between text and token ids.

A job needs to turn an example's input text into ids for the models and the generated ids
back into text. Anything with the small interface of `Vocabulary` works: the byte-level test
vocabulary here, a SentencePiece model (T5), or any tokenizer adapted with `FunctionVocabulary`
(e.g. a SmolLM2 tokenizer: `FunctionVocabulary(tok.encode, tok.decode, vocab_size=…, eos_id=…)`).

The job layer (`speclm.run.providers`) registers them with gin, so a run file picks one with,
for example, `VOCABULARY = @SentencePieceVocabulary`.
"""

from __future__ import annotations

import abc
import os
from typing import Callable, Mapping, Sequence



class Vocabulary(abc.ABC):
  """Text <-> token ids.

  Attributes:
    vocab_size: number of ids the vocabulary can produce; a model's vocabulary may be larger
      (T5 pads 32100 to 32128), never smaller.
    pad_id: the id written past a row's end.
    eos_id: the id that ends a generation, or None if generations only stop at a length limit.
  """

  vocab_size: int
  pad_id: int
  eos_id: int | None

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """The ids of `text` (no end token appended)."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids`, cut at the first end token; padding and unknown ids are dropped."""

  @property
  def end_ids(self) -> tuple[int, ...]:
    """Every id that ends a generation: `eos_id`, and a chat model's others (end of turn)."""
    return () if self.eos_id is None else (self.eos_id,)

  @property
  def renders_conversations(self) -> bool:
    """Whether `encode_conversation` renders a whole conversation (a chat template)."""
    return False

  def encode_conversation(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The ids of a conversation rendered with a chat template, ending with the header of
    the assistant's next reply (a later turn of a multi-turn job, `speclm.run.turns`).

    Args:
      messages: {'role': 'user' | 'assistant' | 'system', 'content': str} in order.
    """
    raise ValueError(f'{self!r} has no chat template, so it cannot render a conversation of'
                     ' several turns; use a chat vocabulary (e.g. @smollm2_chat_vocabulary,'
                     ' @checkpoint_chat_vocabulary).')

  def _until_eos(self, ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in ids]
    ends = [k for k, i in enumerate(ids) if i in self.end_ids]
    return ids[:ends[0]] if ends else ids


class ByteVocabulary(Vocabulary):
  """UTF-8 bytes as ids: 0 pad, 1 end, 2 unknown, byte b -> b + 3 (259 ids). For tests.

  Needs no file, so the tiny test jobs run anywhere; a random model with `vocab_size >= 259`
  pairs with it.
  """

  PAD, EOS, UNK = 0, 1, 2
  OFFSET = 3

  def __init__(self):
    self.vocab_size = 256 + self.OFFSET
    self.pad_id = self.PAD
    self.eos_id = self.EOS

  def encode(self, text: str) -> list[int]:
    """UTF-8 bytes of `text`, each offset past the three special ids."""
    return [b + self.OFFSET for b in text.encode('utf-8')]

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids` up to the first end id; special and out-of-range ids are dropped."""
    data = bytes(i - self.OFFSET for i in self._until_eos(ids)
                 if self.OFFSET <= i < self.OFFSET + 256)
    return data.decode('utf-8', errors='replace')

  def __repr__(self):
    return 'ByteVocabulary()'


class FunctionVocabulary(Vocabulary):
  """Adapts any tokenizer given as two functions (the seam for tokenizers of other modules).

  `conversation_fn`, when given, renders and encodes a whole conversation (a list of
  {'role', 'content'} messages) with the tokenizer's chat template (`encode_conversation`);
  `encode_fn` alone renders one user message.
  """

  def __init__(self, encode_fn: Callable[[str], Sequence[int]],
               decode_fn: Callable[[Sequence[int]], str], vocab_size: int, *,
               eos_id: int | None = None, pad_id: int = 0, end_ids: Sequence[int] = (),
               conversation_fn: Callable[[Sequence[Mapping[str, str]]], Sequence[int]]
               | None = None):
    self._conversation_fn = conversation_fn
    self._encode_fn = encode_fn
    self._decode_fn = decode_fn
    self.vocab_size = int(vocab_size)
    self.eos_id = eos_id
    self.pad_id = pad_id
    self._end_ids = tuple(int(i) for i in end_ids)

  @property
  def end_ids(self) -> tuple[int, ...]:
    """The ids that end a reply: `eos_id` and the `end_ids` given."""
    return tuple(dict.fromkeys(super().end_ids + self._end_ids))

  def encode(self, text: str) -> list[int]:
    """`encode_fn(text)` as a list of ints."""
    return [int(i) for i in self._encode_fn(text)]

  @property
  def renders_conversations(self) -> bool:
    """Whether a `conversation_fn` was given."""
    return self._conversation_fn is not None

  def encode_conversation(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """`conversation_fn(messages)` as a list of ints (see `Vocabulary.encode_conversation`)."""
    if self._conversation_fn is None:
      return super().encode_conversation(messages)
    return [int(i) for i in self._conversation_fn(list(messages))]

  def decode(self, ids: Sequence[int]) -> str:
    """`decode_fn` of `ids` up to the first end id."""
    return self._decode_fn(self._until_eos(ids))


class SentencePieceVocabulary(Vocabulary):
  """A SentencePiece model, as T5 uses it (pad 0, end 1, unknown 2, plus `extra_ids` sentinels).

  Args:
    path: the `.model` file: a local path, or `gs://…` when TensorFlow is installed (read through
      `tf.io.gfile`).
    extra_ids: sentinel ids appended after the model's pieces (T5 uses 100). They count in
      `vocab_size`; decoding drops them.
  """

  def __init__(self, path: str, extra_ids: int = 0):
    import sentencepiece  # pylint: disable=g-import-not-at-top
    self.path = path
    proto = _read_bytes(path)
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(proto)
    except Exception as e:  # sentencepiece raises a bare RuntimeError/OSError
      raise ValueError(f'{path} is not a valid SentencePiece model: {e}') from None
    self._num_pieces = self._sp.GetPieceSize()
    self.vocab_size = self._num_pieces + int(extra_ids)
    self.pad_id = max(self._sp.pad_id(), 0)
    eos = self._sp.eos_id()
    self.eos_id = eos if eos >= 0 else None

  def encode(self, text: str) -> list[int]:
    """The SentencePiece ids of `text` (no end token appended)."""
    return list(self._sp.EncodeAsIds(text))

  def decode(self, ids: Sequence[int]) -> str:
    """The text of `ids` up to the first end id; padding and sentinel ids are dropped."""
    kept = [i for i in self._until_eos(ids) if 0 <= i < self._num_pieces and i != self.pad_id]
    return self._sp.DecodeIds(kept)

  def __repr__(self):
    return f'SentencePieceVocabulary({self.path!r}, vocab_size={self.vocab_size})'


def _read_bytes(path: str) -> bytes:
  if '://' in path:
    try:
      import tensorflow as tf  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise FileNotFoundError(
          f'Reading {path} needs TensorFlow (tf.io.gfile), which is not installed. Copy the'
          ' file to a local path, or install the seqio extra.') from None
    if not tf.io.gfile.exists(path):
      raise FileNotFoundError(f'The vocabulary file {path} does not exist.')
    with tf.io.gfile.GFile(path, 'rb') as f:
      return f.read()
  if not os.path.isfile(path):
    raise FileNotFoundError(f'The vocabulary file {path} does not exist.')
  with open(path, 'rb') as f:
    return f.read()
