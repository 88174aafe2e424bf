"""The job's errors: each is reported as one line, with no stack trace."""

from __future__ import annotations

import os


class JobError(Exception):
  """A problem with the job's configuration or inputs, reported as one paragraph (no trace)."""

  def __init__(self, message: str):
    super().__init__(message)
    self.message = message


class BadLogitsError(JobError):
  """The job finished and wrote its outputs, but some rows stopped on non-finite logits."""


class Interrupted(JobError):
  """Ctrl-C during a job: what was recorded stays, and rerunning the command resumes."""


def check_path(path: str, what: str) -> None:
  """Raises JobError unless `path` is set and, when local, exists."""
  if not path or not isinstance(path, str):
    raise JobError(f'The {what} path is not set (got {path!r}).')
  if '://' not in path and not os.path.exists(path):
    raise JobError(f'The {what} path {path} does not exist. Check the path (local paths are'
                   ' relative to the directory the job starts in) or point the setting at an'
                   ' existing checkpoint.')
