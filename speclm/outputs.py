"""The output directory of a job: predictions that survive a kill, metrics, the resolved config.

  predictions.jsonl  one JSON object per example, appended a batch at a time with a single
                     `write` followed by `fsync`. After a kill the file holds whole lines plus,
                     at worst, one torn last line; reopening cuts the torn tail, so every
                     example is either fully recorded or not at all, and a resumed job decodes
                     exactly the missing ones.
  job.json           what the predictions belong to (mode, dataset fingerprint); a restart
                     with a different dataset or mode refuses to mix outputs.
  metrics.json       the report (written atomically at the end).
  config.gin         the resolved gin config (written atomically at the start).
  operative_config.gin  the bindings the job used (at the end).
  .lock              held with `flock` while a job runs, so two jobs cannot share a directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import tempfile
from typing import Any, Iterable

PREDICTIONS = 'predictions.jsonl'
METRICS = 'metrics.json'
CONFIG = 'config.gin'
OPERATIVE_CONFIG = 'operative_config.gin'
JOB = 'job.json'
LOCK = '.lock'


class OutputError(RuntimeError):
  """The output directory cannot be used; the message says why and what to do."""


def _fsync_dir(path: str) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)


def write_atomic(path: str, text: str) -> None:
  """Writes `text` to `path` so a reader sees the old file or the new one, never a mix."""
  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp = tempfile.mkstemp(prefix='.' + os.path.basename(path) + '.', dir=directory)
  try:
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  _fsync_dir(directory)


def write_json_atomic(path: str, obj: Any) -> None:
  write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + '\n')


class OutputDir:
  """An output directory opened for a job: creates, locks and recovers it.

  Usage:
    out = OutputDir(path)                  # raises OutputError if unusable
    done = out.resume(mode, fingerprint)   # {example index: record} already recorded
    out.append([record, ...])              # durable once it returns
    out.close()
  """

  def __init__(self, path: str):
    if not path:
      raise OutputError('No output directory is set. Set one with'
                        " --gin.OUTPUT_DIR=\"'/path/to/dir'\".")
    self.path = path
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise OutputError(f'Cannot create the output directory {path}: {e.strerror}. Choose a'
                        ' directory you can write to with --gin.OUTPUT_DIR.') from None
    if not os.path.isdir(path):
      raise OutputError(f'The output path {path} exists and is not a directory.')
    if not os.access(path, os.W_OK | os.X_OK):
      raise OutputError(f'The output directory {path} is not writable. Choose a directory you'
                        ' can write to with --gin.OUTPUT_DIR, or fix its permissions.')
    try:
      self._lock_fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise OutputError(f'The output directory {path} is not writable ({e.strerror}). Choose'
                        ' another with --gin.OUTPUT_DIR.') from None
    try:
      fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(self._lock_fd)
      if e.errno in (errno.EAGAIN, errno.EACCES):
        raise OutputError(f'Another job is writing to {path}. Wait for it to finish, or use a'
                          ' different --gin.OUTPUT_DIR.') from None
      raise
    self._pred_fd: int | None = None

  @property
  def predictions_path(self) -> str:
    return os.path.join(self.path, PREDICTIONS)

  def file(self, name: str) -> str:
    return os.path.join(self.path, name)

  def resume(self, job_info: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Checks the directory belongs to this job and returns the examples already recorded.

    `job_info` (JSON-serializable) identifies the job; a directory holding predictions of a
    different job is refused rather than mixed.
    """
    job_path = self.file(JOB)
    if os.path.exists(job_path):
      with open(job_path, encoding='utf-8') as f:
        previous = json.load(f)
      if previous != job_info:
        changed = sorted(k for k in set(previous) | set(job_info)
                         if previous.get(k) != job_info.get(k))
        raise OutputError(
            f'{self.path} holds the outputs of a different job (changed: {", ".join(changed)}).'
            ' Resuming would mix them. Use a new --gin.OUTPUT_DIR, or delete the directory to'
            ' start over.')
    else:
      write_json_atomic(job_path, job_info)
    done = self._recover()
    self._pred_fd = os.open(self.predictions_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return done

  def _recover(self) -> dict[int, dict[str, Any]]:
    path = self.predictions_path
    if not os.path.exists(path):
      return {}
    with open(path, 'rb') as f:
      data = f.read()
    complete = data.rfind(b'\n') + 1
    if complete < len(data):  # a torn last line from a kill mid-write: drop it
      with open(path, 'r+b') as f:
        f.truncate(complete)
        f.flush()
        os.fsync(f.fileno())
    done: dict[int, dict[str, Any]] = {}
    for line_number, line in enumerate(data[:complete].splitlines(), start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        raise OutputError(f'{path}:{line_number} is corrupt (not JSON). Remove that line to'
                          ' resume; the example will be decoded again.') from None
      done[int(record['index'])] = record
    return done

  def append(self, records: Iterable[dict[str, Any]]) -> None:
    """Appends records durably: one `write` of whole lines, then `fsync`."""
    if self._pred_fd is None:
      raise RuntimeError('OutputDir.resume must be called before append.')
    data = b''.join(json.dumps(r, ensure_ascii=False, allow_nan=True).encode('utf-8') + b'\n'
                    for r in records)
    view = memoryview(data)
    while view:  # os.write may write less than asked (rare for regular files)
      written = os.write(self._pred_fd, view)
      view = view[written:]
    os.fsync(self._pred_fd)

  def close(self) -> None:
    if self._pred_fd is not None:
      os.close(self._pred_fd)
      self._pred_fd = None
    if self._lock_fd is not None:
      fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
      os.close(self._lock_fd)
      self._lock_fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def read_predictions(path: str) -> list[dict[str, Any]]:
  """All whole records of a predictions file (a torn last line is ignored)."""
  records = []
  with open(path, 'rb') as f:
    data = f.read()
  for line in data[:data.rfind(b'\n') + 1].splitlines():
    if line.strip():
      records.append(json.loads(line))
  return records
