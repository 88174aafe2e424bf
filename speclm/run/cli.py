"""The command line `python -m speclm.run --gin_file=FILE [--gin.NAME=VALUE …]`: flags, then the
job or the sweep; every error is one line on stderr (exit 2; 1 for rows stopped on bad logits;
130 for Ctrl-C)."""

from __future__ import annotations

import sys
from typing import Sequence

from absl import app
from absl import flags
from absl import logging

from speclm.run import gin_cli
from speclm.run import job
from speclm.run import providers
from speclm.run.errors import BadLogitsError
from speclm.run.errors import Interrupted
from speclm.run.errors import JobError

_GIN_FILE = flags.DEFINE_multi_string(
    'gin_file', [], 'A gin file to parse (repeatable); looked up on the gin search path.')


_GIN_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], "A gin binding, e.g. run_job.batch_size=4 (repeatable). "
    '--gin.NAME=VALUE is a shorthand for --gin_bindings="NAME = VALUE".')


_GIN_SEARCH_PATHS = flags.DEFINE_list(
    'gin_search_paths', [], 'Directories searched for gin files and their includes, before the'
    " current directory and the repository's configs/.")


def main(argv: Sequence[str]) -> None:
  """The job's entry after flag parsing: parses gin, checks checkpoint paths, runs the job or
  the sweep; user errors exit with a message instead of a traceback (status 2; 1 for bad
  logits; 130 when interrupted).
  """
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # gin's file lookups log at INFO
  try:
    if not _GIN_FILE.value:
      raise JobError('No gin file given. Run e.g. python -m speclm.run'
                     ' --gin_file=test_tiny.gin --gin.OUTPUT_DIR="\'/tmp/out\'".')
    gin_cli.parse_gin(_GIN_FILE.value, _GIN_BINDINGS.value, _GIN_SEARCH_PATHS.value)
    # Before gin builds any argument of run_job (a vocabulary written `@Vocabulary()` is built
    # when run_job is called): a missing checkpoint is the first thing reported.
    gin_cli.check_model_paths()
    providers.initialize_distributed()  # only when gin enables it; before any JAX work
    if job.sweep_requested():
      job.run_sweep()  # pylint: disable=no-value-for-parameter
    else:
      job.run_job()  # pylint: disable=missing-kwoa
  except Interrupted as e:
    _fail(e.message, status=130, prefix='')
  except KeyboardInterrupt:
    _fail('interrupted before decoding began; rerun the same command to start again.',
          status=130, prefix='')
  except BadLogitsError as e:
    _fail(e.message, status=1)
  except JobError as e:
    _fail(e.message)
  except RuntimeError as e:
    message = gin_cli.required_call_error(e)
    if message is None:
      raise
    _fail(message)


def _fail(message: str, status: int = 2, prefix: str = 'error: ') -> None:
  print(f'speclm.run: {prefix}{message}', file=sys.stderr)
  sys.exit(status)


def _parse_flags(argv: list[str]):
  try:
    argv = gin_cli.rewrite_gin_args(argv)
  except JobError as e:
    _fail(e.message)
  return app.parse_flags_with_usage(argv)


def run_main() -> None:
  """`python -m speclm.run`: parses the flags (`--gin.NAME=VALUE` rewritten) and runs `main`."""
  app.run(main, flags_parser=_parse_flags)


if __name__ == '__main__':
  run_main()
