"""One error for every checkpoint reader: `CheckpointError`, naming the file (and the tensor or
key) in one line.

    with errors.reading(path):                  # any failure inside names `path`
      hf = json.load(f)
    errors.read_json(path)                      # a truncated config.json names the file
    errors.require(hf, 'num_hidden_layers', path)  # a missing key names key and file

The readers (`hf_llama`, `hf_t5`, `gguf`, `t5x`, `llm`) raise it, and `speclm.generate` and the
job pass it on, so a user with a target and a draft of the same family learns which file is
broken and what is wrong with it, never a library's bare message ('Expecting value: line 1
column 1', 'cannot reshape array of size …', a KeyError).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping


class CheckpointError(ValueError):
  """A missing, truncated, corrupt or mismatched checkpoint file.

  The message is one line and names `path`. A `ValueError`, so callers that catch ValueError
  from the readers keep working.

  Attributes:
    path: the checkpoint file or directory at fault (None when unknown).
    key: the tensor, metadata key or config key at fault (None when the whole file is).
  """

  def __init__(self, message: str, *, path: str | os.PathLike | None = None,
               key: str | None = None):
    message = one_line(message)
    if path is not None and os.fspath(path) not in message:
      message = f'{os.fspath(path)}: {message}'
    super().__init__(message)
    self.path = None if path is None else os.fspath(path)
    self.key = key


def one_line(message: str) -> str:
  """`message` with its line breaks folded into spaces (a library's message may span lines)."""
  return ' '.join(part.strip() for part in str(message).splitlines() if part.strip())


def describe(error: BaseException) -> str:
  """A library error as a short phrase: its message, or its type's name when it has none
  (a bare KeyError's message is only the key)."""
  if isinstance(error, KeyError):
    return f'missing key {error.args[0]!r}' if error.args else 'a missing key'
  text = one_line(str(error))
  return text or type(error).__name__


@contextlib.contextmanager
def reading(path: str | os.PathLike, *, key: str | None = None,
            what: str = 'checkpoint file') -> Iterator[None]:
  """Turns any failure inside the block into a `CheckpointError` naming `path` (and `key`).

  A `CheckpointError` passes unchanged, and so does FileNotFoundError (a missing file has its
  own handling: a job reports it before loading anything). KeyboardInterrupt and other
  non-`Exception`s are never caught.

  Args:
    path: the file (or directory) being read.
    key: the tensor or key being read, when one is.
    what: how the message calls the file ('config file', 'tokenizer file', …).
  """
  try:
    yield
  except (CheckpointError, FileNotFoundError):
    raise
  except json.JSONDecodeError as e:
    raise CheckpointError(
        f'{os.fspath(path)} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno});'
        ' the file is truncated or corrupt: download or write it again.', path=path,
        key=key) from e
  except UnicodeDecodeError as e:
    raise CheckpointError(f'{os.fspath(path)} is not UTF-8 text (byte {e.start}); the {what}'
                          ' is corrupt.', path=path, key=key) from e
  except Exception as e:  # pylint: disable=broad-except  # any reader failure names the file
    text = describe(e)
    if os.fspath(path) not in text:
      where = f' (tensor or key {key!r})' if key is not None else ''
      text = f'Cannot read the {what} {os.fspath(path)}{where}: {text}'
    raise CheckpointError(text, path=path, key=key) from e


def at_path(error: BaseException, path: str | os.PathLike, *, name: str | None = None
            ) -> CheckpointError:
  """`error` as a `CheckpointError` naming `path`: a message that starts with the file's bare
  `name` ('config.json sets …') gets the full path in its place; others get it in front.
  The key of a `CheckpointError` is kept."""
  path = os.fspath(path)
  message = describe(error)
  if name is not None and message.startswith(name):
    message = path + message[len(name):]
  return CheckpointError(message, path=path, key=getattr(error, 'key', None))


def read_json(path: str | os.PathLike, what: str = 'config file') -> Any:
  """The JSON document at `path`; a truncated or non-UTF-8 file is a `CheckpointError`."""
  with reading(path, what=what):
    with open(path, encoding='utf-8') as f:
      return json.load(f)


def require(mapping: Mapping[str, Any], key: str, path: str | os.PathLike,
            what: str = 'config.json') -> Any:
  """`mapping[key]`, or a `CheckpointError` naming the key and the file that lacks it."""
  if not isinstance(mapping, Mapping):
    raise CheckpointError(f'{os.fspath(path)}: {what} holds a {type(mapping).__name__}, not a'
                          ' JSON object.', path=path)
  if key not in mapping or mapping[key] is None:
    raise CheckpointError(f'{os.fspath(path)} lacks {key!r} in {what}; the file is incomplete'
                          ' (compare it with the original checkpoint).', path=path, key=key)
  return mapping[key]


__all__ = ['CheckpointError', 'at_path', 'describe', 'one_line', 'read_json', 'reading', 'require']
