"""The command line `python -m speclm.run --gin_file=FILE [--gin.NAME=VALUE …]`: flags, then the
job or the sweep; every error is one line on stderr (exit 2; 1 for rows stopped on bad logits;
130 for Ctrl-C, 143 for SIGTERM, both after the records are flushed). An exception of no known
kind is one line too; `--verbose` adds its traceback."""

from __future__ import annotations

import signal
import sys
import traceback
from typing import Sequence

from absl import app
from absl import flags
from absl import logging

from speclm import tokenizer
from speclm.checkpoints import errors as checkpoint_errors
from speclm.data import inputs
from speclm.run import compile_cache
from speclm.run import gin_cli
from speclm.run import job
from speclm.run import providers
from speclm.run.errors import BadLogitsError
from speclm.run.errors import Interrupted
from speclm.run.errors import JobError
from speclm.run.errors import Terminated
from speclm.run.errors import unexpected

_GIN_FILE = flags.DEFINE_multi_string(
    'gin_file', [], 'A gin file to parse (repeatable); looked up on the gin search path.')


_GIN_BINDINGS = flags.DEFINE_multi_string(
    'gin_bindings', [], "A gin binding, e.g. run_job.batch_size=4 (repeatable). "
    '--gin.NAME=VALUE is a shorthand for --gin_bindings="NAME = VALUE".')


_GIN_SEARCH_PATHS = flags.DEFINE_list(
    'gin_search_paths', [], 'Directories searched for gin files and their includes, before the'
    " current directory and the repository's configs/.")


_COMPILATION_CACHE = flags.DEFINE_bool(
    'compilation_cache', True, "Keep compiled programs in the user's cache directory"
    ' ($SPECLM_COMPILATION_CACHE, else ~/.cache/speclm/xla) so that a rerun of the same job'
    ' skips compiling; --nocompilation_cache compiles everything afresh.')


# Exceptions from below the job layer whose message names the file and the fault.
_KNOWN = (checkpoint_errors.CheckpointError, tokenizer.ChatTemplateError,
          tokenizer.TokenizerFileError, inputs.DataError)

_VERBOSE = flags.DEFINE_bool(
    'verbose', False, 'On an error, print its Python traceback before the one-line message.')

# The signal that stopped the job (SIGINT or SIGTERM): its exit status is 128 + its number.
_stopped_by = {'signal': signal.SIGINT}


def _on_sigterm(signum, frame) -> None:
  """SIGTERM's handler: the first one stops the job as Ctrl-C does (`Terminated` is a
  KeyboardInterrupt, raised in the main thread); later ones are ignored while it stops."""
  del frame
  if _stopped_by['signal'] == signum:
    return
  _stopped_by['signal'] = signum
  raise Terminated()


def main(argv: Sequence[str]) -> None:
  """The job's entry after flag parsing: parses gin, checks checkpoint paths, runs the job or
  the sweep. Every failure ends in `_fail`'s one line (status 2; 1 for bad logits; 130 for
  Ctrl-C, 143 for SIGTERM); `--verbose` adds the traceback.
  """
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}')
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # gin's file lookups log at INFO
  _stopped_by['signal'] = signal.SIGINT
  signal.signal(signal.SIGTERM, _on_sigterm)
  try:
    _run()
  except Interrupted as e:
    _fail(_stop_message(e.message), status=128 + _stopped_by['signal'], prefix='')
  except KeyboardInterrupt:
    _fail(_stop_message('interrupted before decoding began; rerun the same command to start'
                        ' again.'), status=128 + _stopped_by['signal'], prefix='')
  except BadLogitsError as e:
    _fail(e.message, status=1)
  except JobError as e:
    _fail(e.message)
  except RuntimeError as e:
    message = gin_cli.required_call_error(e)
    _fail(unexpected(e).message if message is None else message)
  except _KNOWN as e:  # errors whose message already says what is wrong and where
    _fail(checkpoint_errors.one_line(str(e)))
  except Exception as e:  # pylint: disable=broad-except  # no traceback without --verbose
    _fail(unexpected(e).message)


def _stop_message(message: str) -> str:
  """Ctrl-C's message, or for SIGTERM the same with 'terminated (SIGTERM)' in front."""
  if _stopped_by['signal'] == signal.SIGTERM and message.startswith('interrupted'):
    return 'terminated (SIGTERM)' + message[len('interrupted'):]
  return message


def _run() -> None:
  """Parses gin, checks the checkpoint paths, then runs the job or the sweep."""
  if not _GIN_FILE.value:
    raise JobError('No gin file given. Run e.g. python -m speclm.run'
                   ' --gin_file=test_tiny.gin --gin.OUTPUT_DIR="\'/tmp/out\'".')
  compile_cache.enable(_COMPILATION_CACHE.value)  # before anything compiles
  gin_cli.parse_gin(_GIN_FILE.value, _GIN_BINDINGS.value, _GIN_SEARCH_PATHS.value)
  # Before gin builds any argument of run_job (a vocabulary written `@Vocabulary()` is built
  # when run_job is called): a missing checkpoint is the first thing reported.
  gin_cli.check_model_paths()
  providers.initialize_distributed()  # only when gin enables it; before any JAX work
  if job.sweep_requested():
    job.run_sweep()  # pylint: disable=no-value-for-parameter
  else:
    job.run_job()  # pylint: disable=missing-kwoa
  print(compile_cache.summary(), file=sys.stderr)


def _fail(message: str, status: int = 2, prefix: str = 'error: ') -> None:
  """Prints `message` as one line on stderr (after the traceback of the exception being
  handled, with --verbose) and exits with `status`."""
  if flags.FLAGS.is_parsed() and _VERBOSE.value and sys.exc_info()[0] is not None:
    traceback.print_exc()
  print(f'speclm.run: {prefix}{message}', file=sys.stderr)
  sys.exit(status)


def _parse_flags(argv: list[str]):
  """absl's flag parsing after `--gin.NAME=VALUE` is rewritten; errors are one line."""
  try:
    return app.parse_flags_with_usage(gin_cli.rewrite_gin_args(argv))
  except JobError as e:
    _fail(e.message)
  except Exception as e:  # pylint: disable=broad-except  # no traceback before flags parse
    _fail(unexpected(e).message)


def run_main() -> None:
  """`python -m speclm.run`: parses the flags (`--gin.NAME=VALUE` rewritten) and runs `main`."""
  app.run(main, flags_parser=_parse_flags)


if __name__ == '__main__':
  run_main()
