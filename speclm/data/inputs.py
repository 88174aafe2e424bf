"""Datasets for decoding jobs: text files, JSONL, TSV, a synthetic test set; encoding; buckets.

A *dataset provider* is any zero-argument callable returning a list of `Example`s; the job
layer registers `read_examples` with gin as `file_dataset` (`DATASET = @file_dataset` with
`file_dataset.path = …`), and `speclm.data.seqio_tasks.seqio_dataset` is another. Encoding turns each example into ids with a `Vocabulary` and applies the length limit
(truncate, skip or fail, as configured). Batching pads inputs to one of a few bucket widths and
every batch to the same number of rows, so a dataset compiles once per bucket, not once per
length.

File formats (one example per line; blank lines are ignored):
  text   the whole line is the input; the id is the line number (1-based).
  jsonl  a JSON object per line with an input field, and optionally id and reference fields.
  tsv    tab-separated columns named by `tsv_columns` (default: input, reference); `\\t`,
         `\\n` and `\\\\` inside a field are unescaped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
from typing import Iterable, Sequence

import numpy as np

from speclm.data import vocab as vocab_lib

FORMATS = ('text', 'jsonl', 'tsv')
ON_TOO_LONG = ('truncate', 'skip', 'error')


class DataError(ValueError):
  """A dataset that cannot be used; the message says which file, line and why."""


@dataclasses.dataclass(frozen=True)
class Example:
  """One input. `index` is its position in the dataset, the key that resuming relies on."""

  index: int
  id: str
  input: str
  reference: str | None = None


@dataclasses.dataclass(frozen=True)
class EncodedExample:
  """An example as token ids.

  Attributes:
    example: the example encoded.
    ids: its input token ids (after truncation, with an end token if the job adds one).
    truncated: whether the input was cut to the input limit.
    skipped: why the example is not decoded (the length rule), or None.
  """

  example: Example
  ids: tuple[int, ...]
  truncated: bool = False
  skipped: str | None = None  # why the example is not decoded, or None

  @property
  def length(self) -> int:
    return len(self.ids)


@dataclasses.dataclass(frozen=True)
class Batch:
  """Right-padded inputs `[B, W]` of one bucket width W; rows past `num_real` are padding.

  Attributes:
    examples: the real rows' encoded examples (padding rows repeat the last one).
    tokens: `[B, W]` int32 token ids, right-padded with the vocabulary's pad id.
    lengths: `[B]` int32 real input lengths.
  """

  examples: tuple[EncodedExample, ...]  # the real rows only
  tokens: np.ndarray  # [B, W] int32
  lengths: np.ndarray  # [B] int32

  @property
  def num_real(self) -> int:
    return len(self.examples)

  @property
  def width(self) -> int:
    return self.tokens.shape[1]


# ----------------------------------------------------------------------------------------------
# Reading


def _detect_format(path: str) -> str:
  ext = os.path.splitext(path)[1].lower()
  return {'.jsonl': 'jsonl', '.json': 'jsonl', '.tsv': 'tsv'}.get(ext, 'text')


def _unescape_tsv(field: str) -> str:
  if '\\' not in field:
    return field
  out, i = [], 0
  while i < len(field):
    ch = field[i]
    if ch == '\\' and i + 1 < len(field):
      nxt = field[i + 1]
      out.append({'t': '\t', 'n': '\n', '\\': '\\'}.get(nxt, ch + nxt))
      i += 2
    else:
      out.append(ch)
      i += 1
  return ''.join(out)


def read_examples(path: str, *, format: str = 'auto', input_field: str = 'input',  # pylint: disable=redefined-builtin
                  id_field: str = 'id', reference_field: str = 'reference',
                  tsv_columns: Sequence[str] = ('input', 'reference'), input_prefix: str = '',
                  max_examples: int | None = None) -> list[Example]:
  """Reads a text, JSONL or TSV file into `Example`s (see the module docstring for formats).

  Raises:
    DataError: the file is missing, a line is malformed, a field is missing, or ids repeat.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise DataError(f'The dataset path must be a string, got {path!r} (strings need quotes in'
                    ' gin: file_dataset.path = \'inputs.jsonl\').')
  if format == 'auto':
    format = _detect_format(path)
  if format not in FORMATS:
    raise DataError(f"Unknown dataset format {format!r}; expected one of {FORMATS} or 'auto'.")
  if not os.path.isfile(path):
    raise DataError(f'The dataset file {path} does not exist.')
  tsv_columns = tuple(tsv_columns)
  if format == 'tsv' and 'input' not in tsv_columns:
    raise DataError(f"tsv_columns must name an 'input' column, got {tsv_columns}.")

  examples: list[Example] = []
  with open(path, 'rb') as f:
    for line_number, raw in enumerate(f, start=1):
      try:  # a byte order mark (UTF-8 BOM) at the start of the file is not part of the input
        line = raw.decode('utf-8-sig' if line_number == 1 else 'utf-8')
      except UnicodeDecodeError as e:
        raise DataError(f'{path}:{line_number} is not UTF-8 (byte {raw[e.start]:#04x} at column'
                        f' {e.start + 1}); save the file as UTF-8.') from None
      line = line.rstrip('\n').rstrip('\r')
      if not line.strip():
        continue
      where = f'{path}:{line_number}'
      if format == 'text':
        fields = {'input': line}
      elif format == 'jsonl':
        try:
          record = json.loads(line)
        except json.JSONDecodeError as e:
          raise DataError(f'{where} is not valid JSON ({e.msg}).') from None
        if not isinstance(record, dict) or input_field not in record:
          raise DataError(f'{where} has no {input_field!r} field (set the input field name with'
                          ' file_dataset.input_field).')
        if not isinstance(record[input_field], str):
          value = record[input_field]
          kind = 'null' if value is None else f'a JSON {type(value).__name__} ({value!r:.40})'
          raise DataError(f'{where}: the {input_field!r} field is {kind}, not a string; every'
                          ' input must be text.')
        fields = {'input': record[input_field]}
        if id_field in record:
          fields['id'] = record[id_field]
        if record.get(reference_field) is not None:
          fields['reference'] = record[reference_field]
      else:  # tsv
        parts = line.split('\t')
        if len(parts) != len(tsv_columns):
          raise DataError(f'{where} has {len(parts)} tab-separated fields, expected'
                          f' {len(tsv_columns)} ({", ".join(tsv_columns)}).')
        fields = {name: _unescape_tsv(value) for name, value in zip(tsv_columns, parts)}
      index = len(examples)
      example_id = fields.get('id', line_number if format == 'text' else index)
      examples.append(Example(index=index, id=str(example_id),
                              input=input_prefix + str(fields['input']),
                              reference=None if fields.get('reference') is None
                              else str(fields['reference'])))
      if max_examples is not None and len(examples) >= max_examples:
        break
  check_unique_ids(examples, path)
  return examples


def check_unique_ids(examples: Sequence[Example], source: str = 'the dataset') -> None:
  seen: dict[str, int] = {}
  for example in examples:
    if example.id in seen:
      raise DataError(f'Example id {example.id!r} appears twice in {source} (examples'
                      f' {seen[example.id]} and {example.index}); ids must be unique so a'
                      ' resumed job can tell which examples are done.')
    seen[example.id] = example.index


_WORDS = ('the cat sat on a mat while dogs ran in the park and birds sang over old trees near'
          ' quiet water under blue sky').split()


def synthetic_dataset(num_examples: int = 12, min_words: int = 2, max_words: int = 12,
                      seed: int = 0, input_prefix: str = '') -> list[Example]:
  """Short random sentences with references (their reversal); for tests and smoke runs."""
  rng = random.Random(seed)
  examples = []
  for index in range(num_examples):
    words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
    examples.append(Example(index=index, id=f'synthetic-{index}',
                            input=input_prefix + ' '.join(words),
                            reference=' '.join(reversed(words))))
  return examples


def fingerprint(examples: Sequence[Example]) -> str:
  """A short hash of ids and inputs: a resumed job checks it is continuing the same dataset."""
  digest = hashlib.sha256()
  for example in examples:
    digest.update(json.dumps([example.index, example.id, example.input]).encode('utf-8'))
  return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Encoding and batching


def default_buckets(max_input_length: int, smallest: int = 16,
                    finer_from: int = 512) -> tuple[int, ...]:
  """Widths from `smallest` up to, and ending at, `max_input_length`: powers of two up to
  `finer_from`, then four a doubling (steps of a quarter of the power of two below: 640, 768,
  896, 1024, 1280, …), so a long prompt is padded by at most a quarter of its bucket's octave.
  A prompt's prefill costs what its padded width costs, quadratically in its attention: a
  1,187-token prompt took 5.6 s at width 2,048 and 3.1 s at 1,280 (docs/performance.md, change
  18); each extra bucket costs one compilation per method, paid once with the persistent
  compilation cache."""
  buckets, width = [], smallest
  while width < max_input_length:
    buckets.append(width)
    octave = 1 << (width.bit_length() - 1)  # the power of two at or below `width`
    width += width if width < finer_from else octave // 4
  buckets.append(max_input_length)
  return tuple(buckets)


def bucket_width(length: int, buckets: Sequence[int]) -> int:
  """The smallest bucket that holds `length` tokens."""
  for width in buckets:
    if length <= width:
      return width
  raise ValueError(f'Length {length} exceeds the largest bucket {buckets[-1]}.')


def encode_examples(examples: Iterable[Example], vocabulary: vocab_lib.Vocabulary, *,
                    max_input_length: int, on_too_long: str = 'truncate',
                    add_eos: bool = False) -> list[EncodedExample]:
  """Encodes inputs and applies the length limit.

  Args:
    max_input_length: the most input tokens a row may have (an appended end token included).
    on_too_long: 'truncate' keeps the first tokens (and the end token when `add_eos`), as
      seqio's `append_eos_after_trim` does; 'skip' leaves the example out of decoding (it is
      still listed in the predictions, marked skipped); 'error' fails the job.
    add_eos: append the vocabulary's end token (T5 encoder inputs end with it).
  """
  if on_too_long not in ON_TOO_LONG:
    raise DataError(f'on_too_long must be one of {ON_TOO_LONG}, got {on_too_long!r}.')
  if max_input_length < 1:
    raise DataError(f'max_input_length must be >= 1, got {max_input_length}.')
  eos = vocabulary.eos_id if add_eos else None
  if add_eos and eos is None:
    raise DataError('add_eos_to_inputs is set but the vocabulary has no end token.')
  encoded, too_long = [], []
  for example in examples:
    ids = list(vocabulary.encode(example.input))
    if eos is not None:
      ids.append(eos)
    if not ids:
      encoded.append(EncodedExample(example, (), skipped='input encodes to no tokens'))
      continue
    if len(ids) <= max_input_length:
      encoded.append(EncodedExample(example, tuple(ids)))
    elif on_too_long == 'truncate':
      kept = ids[:max_input_length - 1] + [eos] if eos is not None else ids[:max_input_length]
      encoded.append(EncodedExample(example, tuple(kept), truncated=True))
    elif on_too_long == 'skip':
      encoded.append(EncodedExample(
          example, tuple(ids),
          skipped=f'input has {len(ids)} tokens, more than max_input_length={max_input_length}'))
    else:
      too_long.append((example.id, len(ids)))
  if too_long:
    shown = ', '.join(f'{i!r} ({n} tokens)' for i, n in too_long[:5])
    raise DataError(
        f'{len(too_long)} input(s) are longer than max_input_length={max_input_length}:'
        f' {shown}{" …" if len(too_long) > 5 else ""}. Raise run_job.max_input_length, or set'
        " run_job.on_too_long='truncate' (or 'skip').")
  return encoded


def make_batches(encoded: Sequence[EncodedExample], *, batch_size: int,
                 buckets: Sequence[int], pad_id: int = 0) -> list[Batch]:
  """Groups examples by bucket width (dataset order within a bucket) into fixed-size batches.

  Every batch has exactly `batch_size` rows (a short last batch repeats its last row, marked as
  padding), so each bucket width is one compiled shape.
  """
  if batch_size < 1:
    raise DataError(f'batch_size must be >= 1, got {batch_size}.')
  by_width: dict[int, list[EncodedExample]] = {}
  for item in encoded:
    if item.skipped is None:
      by_width.setdefault(bucket_width(item.length, buckets), []).append(item)
  batches = []
  for width in sorted(by_width):
    items = by_width[width]
    for start in range(0, len(items), batch_size):
      chunk = items[start:start + batch_size]
      rows = chunk + [chunk[-1]] * (batch_size - len(chunk))
      tokens = np.full((batch_size, width), pad_id, np.int32)
      for row, item in enumerate(rows):
        tokens[row, :item.length] = item.ids
      lengths = np.array([item.length for item in rows], np.int32)
      batches.append(Batch(examples=tuple(chunk), tokens=tokens, lengths=lengths))
  return batches
