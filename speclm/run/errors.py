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
  """Ctrl-C (or SIGTERM) during a job: what was recorded stays, and rerunning resumes."""


class Terminated(KeyboardInterrupt):
  """SIGTERM (a batch scheduler's or `timeout`'s stop), raised in the main thread by the
  command line's handler so the job stops as on Ctrl-C: records flushed, one line."""


def unexpected(error: BaseException, what: str | None = None) -> JobError:
  """An exception of no known kind (a bug, or a library's own error) as a one-line JobError:
  its type and first line, and how to see the traceback.

  Args:
    error: the exception.
    what: the step that raised it ('Loading the target model'), or None.
  """
  lines = [line.strip() for line in str(error).splitlines()
           if line.strip() and not line.strip().startswith(('In call to configurable',
                                                            'In scope'))]
  detail = f'{type(error).__name__}: {lines[0]}' if lines else type(error).__name__
  where = f'{what} failed: ' if what else ''
  return JobError(f'{where}{detail} (rerun with --verbose for the traceback).')


def check_path(path: str, what: str) -> None:
  """Raises JobError unless `path` is set and, when local, exists."""
  if not path or not isinstance(path, str):
    raise JobError(f'The {what} path is not set (got {path!r}).')
  if '://' not in path and not os.path.exists(path):
    raise JobError(f'The {what} path {path} does not exist. Check the path (local paths are'
                   ' relative to the directory the job starts in) or point the setting at an'
                   ' existing checkpoint.')
