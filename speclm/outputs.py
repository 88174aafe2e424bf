"""The output directory of a job: predictions that survive a kill, metrics, the resolved config.

  predictions.jsonl  one JSON object per example, appended a batch at a time with a single
                     `write` followed by `fsync`. After a kill the file holds whole lines plus,
                     at worst, one torn last line; reopening cuts the torn tail, so every
                     example is either fully recorded or not at all, and a resumed job decodes
                     exactly the missing ones.
  job.json           the job's fingerprint: every setting that determines an output (see
                     `speclm.run.fingerprint`). A restart whose fingerprint differs is refused,
                     naming each differing setting, before anything in the directory changes.
  metrics.json       the report (written atomically at the end).
  config.gin         the resolved gin config (written atomically once the directory is
                     accepted).
  operative_config.gin  the bindings the job used (at the end).
  tree_policy.json   a `run_job.tree = @tree_policy()` job's choice and its measured table,
                     written before the first batch, so a resumed job decodes with the same tree.
  .lock              held with `flock` while a job runs, so two jobs cannot share a directory.

Every file is created with the same permissions (0666 less the umask, as `open` would).
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
TREE_POLICY = 'tree_policy.json'
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
    os.chmod(tmp, _FILE_MODE)  # mkstemp makes 0600; every output file gets the same mode
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise
  _fsync_dir(directory)


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


_FILE_MODE = 0o666 & ~_umask()


def write_json_atomic(path: str, obj: Any) -> None:
  """`obj` as indented, key-sorted JSON, written atomically to `path` (`write_atomic`)."""
  write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=True) + '\n')


class OutputDir:
  """An output directory opened for a job: creates, locks and recovers it.

  Usage:
    out = OutputDir(path)                  # raises OutputError if unusable; takes the lock
    out.check(fingerprint, partial=True)   # refuse early, before loading models (optional)
    done = out.resume(fingerprint)         # {example index: record} already recorded
    out.append([record, ...])              # durable once it returns
    out.close()

  Nothing in the directory is written before `resume` has accepted it (or `discard` emptied it).
  """

  def __init__(self, path: str):
    if not path:
      raise OutputError('No output directory is set. Set one with'
                        " --gin.OUTPUT_DIR=\"'/path/to/dir'\".")
    self.path = path
    if os.path.exists(path) and not os.path.isdir(path):
      raise OutputError(f'The output path {path} exists and is not a directory. Choose another'
                        ' --gin.OUTPUT_DIR.')
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
      self._lock_fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CREAT, 0o666)
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
    """The path of predictions.jsonl in this directory."""
    return os.path.join(self.path, PREDICTIONS)

  def file(self, name: str) -> str:
    """The path of file `name` in this directory."""
    return os.path.join(self.path, name)

  def previous_fingerprint(self) -> dict[str, Any] | None:
    """The fingerprint recorded in job.json, or None for a directory no job has used."""
    job_path = self.file(JOB)
    if not os.path.exists(job_path):
      return None
    try:
      with open(job_path, encoding='utf-8') as f:
        return json.load(f)
    except (OSError, ValueError):
      raise OutputError(f'{job_path} is unreadable, so what {self.path} holds is unknown. Use'
                        ' a new --gin.OUTPUT_DIR, or --gin.run_job.overwrite=True to discard'
                        ' its outputs.') from None

  def check(self, fingerprint: dict[str, Any], *, partial: bool = False) -> None:
    """Refuses a directory whose recorded job differs from `fingerprint`; writes nothing.

    `partial`: compare only the entries `fingerprint` has (a check made before every entry is
    known, e.g. before the models are loaded).
    """
    previous = self.previous_fingerprint()
    if previous is None:
      if self._holds_outputs():
        raise OutputError(
            f'{self.path} holds predictions but no job.json, so they cannot be matched to this'
            ' job. Use a new --gin.OUTPUT_DIR, or --gin.run_job.overwrite=True to discard them.')
      return
    if previous.get('fingerprint_version') != fingerprint.get('fingerprint_version'):
      raise OutputError(
          f'{self.path} holds outputs written by an earlier speclm (job.json format'
          f' {previous.get("fingerprint_version", 1)}), which cannot be matched to this job. Use'
          ' a new --gin.OUTPUT_DIR, or --gin.run_job.overwrite=True to discard them.')
    names = fingerprint if partial else set(previous) | set(fingerprint)
    changed = [name for name in sorted(names) if previous.get(name) != fingerprint.get(name)]
    if changed:
      shown = '; '.join(f'{name}: {_short(previous.get(name))} -> {_short(fingerprint.get(name))}'
                        for name in changed[:8])
      more = f' (and {len(changed) - 8} more)' if len(changed) > 8 else ''
      raise OutputError(
          f'{self.path} holds outputs of a different job ({shown}{more}); resuming would mix'
          ' them. Use a new --gin.OUTPUT_DIR, or --gin.run_job.overwrite=True to discard them.')

  def _holds_outputs(self) -> bool:
    return any(os.path.exists(self.file(name)) and os.path.getsize(self.file(name))
               for name in (PREDICTIONS, METRICS))

  def discard(self) -> list[str]:
    """Deletes the outputs a job writes here (not other files); returns the names deleted."""
    deleted = []
    for name in (PREDICTIONS, METRICS, JOB, CONFIG, OPERATIVE_CONFIG, TREE_POLICY):
      if os.path.exists(self.file(name)):
        os.unlink(self.file(name))
        deleted.append(name)
    _fsync_dir(self.path)
    return deleted

  def resume(self, fingerprint: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Accepts the directory for the job `fingerprint` (JSON-serializable) describes.

    Returns the examples already recorded. A directory holding a different job's outputs is
    refused (`check`) rather than mixed.
    """
    self.check(fingerprint)
    if self.previous_fingerprint() is None:
      write_json_atomic(self.file(JOB), fingerprint)
    done = self._recover()
    self._pred_fd = os.open(self.predictions_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    return done

  def _recover(self) -> dict[int, dict[str, Any]]:
    """The recorded examples; cuts a torn last line, and a last batch recorded only in part.

    Records of one batch carry the same 'batch' key and its row count 'batch_rows'; a batch is
    appended with one write, so only the last one can be incomplete (a crash mid-write). Its
    rows are dropped and decoded again together, with the batch's own seed, so a resumed job's
    outputs equal an uninterrupted run's.
    """
    path = self.predictions_path
    if not os.path.exists(path):
      return {}
    with open(path, 'rb') as f:
      data = f.read()
    complete = data.rfind(b'\n') + 1
    records: list[tuple[int, dict[str, Any]]] = []  # (line start offset, record)
    offset = 0
    for line_number, line in enumerate(data[:complete].split(b'\n')[:-1], start=1):
      start, offset = offset, offset + len(line) + 1
      if not line.strip():
        continue
      try:
        records.append((start, json.loads(line)))
      except json.JSONDecodeError:
        raise OutputError(f'{path}:{line_number} is corrupt (not JSON). Remove that line to'
                          ' resume; the example will be decoded again.') from None
    if records and 'batch_rows' in records[-1][1]:
      key = records[-1][1]['batch']
      group = [i for i, (_, r) in enumerate(records) if r.get('batch') == key]
      if len(group) < records[-1][1]['batch_rows']:
        complete = records[group[0]][0]
        records = records[:group[0]]
    if complete < len(data):  # a torn tail from a kill mid-write: drop it
      with open(path, 'r+b') as f:
        f.truncate(complete)
        f.flush()
        os.fsync(f.fileno())
    return {int(record['index']): record for _, record in records}

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
    """Closes predictions.jsonl and releases the directory's lock; idempotent."""
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


def _short(value: Any, limit: int = 48) -> str:
  text = 'unset' if value is None else json.dumps(value, ensure_ascii=False)
  return text if len(text) <= limit else text[:limit - 1] + '…'


def read_predictions(path: str) -> list[dict[str, Any]]:
  """All whole records of a predictions file (a torn last line is ignored)."""
  records = []
  with open(path, 'rb') as f:
    data = f.read()
  for line in data[:data.rfind(b'\n') + 1].splitlines():
    if line.strip():
      records.append(json.loads(line))
  return records
