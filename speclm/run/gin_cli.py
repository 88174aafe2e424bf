"""The gin command line shared by `python -m speclm.run` and `python -m speclm.analysis`.

T5X keeps the same apart in `t5x/gin_utils.py`: `--gin.NAME=VALUE` rewriting, the search path
(`--gin_search_paths`, the working directory, the repository's `configs/`), parsing with
errors that say what to change (unknown bindings with the nearest name, required settings,
macros set on the command line that nothing uses), a warning for local files that shadow the
repository's, and the checkpoint paths of the job's models checked before anything loads.
"""

from __future__ import annotations

import difflib
import logging as std_logging
import os
import re
import sys
from typing import Any, Sequence

import gin

from speclm.run import errors
from speclm.run.errors import JobError

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), 'configs')


def rewrite_gin_args(args: Sequence[str]) -> list[str]:
  """Rewrites each `--gin.NAME=VALUE` to `--gin_bindings=NAME = VALUE` (as T5X does)."""
  rewritten = []
  for arg in args:
    if arg.startswith('--gin.'):
      body = arg[len('--gin.'):]
      if '=' not in body:
        raise JobError(f'{arg} has no value. Write --gin.NAME=VALUE, e.g.'
                       ' --gin.run_job.batch_size=4 or --gin.OUTPUT_DIR="\'/tmp/out\'".')
      name, value = body.split('=', 1)
      arg = f'--gin_bindings={name} = {value}'
    rewritten.append(arg)
  return rewritten


def search_paths(extra: Sequence[str] = ()) -> list[str]:
  """Gin search path: the given directories, then '.', then the repository's configs/."""
  paths = [p for p in extra if p] + [os.getcwd(), CONFIGS_DIR]
  unique = []
  for path in paths:
    if path not in unique:
      unique.append(path)
  return unique


def _configurable_names() -> list[str]:
  registry = gin.config._REGISTRY  # pylint: disable=protected-access
  names = set()
  for selector, _ in registry.items():
    names.add(selector)
    names.add(selector.rsplit('.', 1)[-1])
  return sorted(names)


def _explain_gin_error(error: Exception) -> str:
  text = str(error).strip()
  first = text.splitlines()[0] if text else type(error).__name__
  where = ' '.join(line.strip() for line in text.splitlines()[1:3])
  match = re.search(r"No configurable matching '([^']+)'", text)
  if match:
    name = match.group(1).split('/')[-1]
    close = difflib.get_close_matches(name.rsplit('.', 1)[-1], _configurable_names(), n=3)
    hint = f' Did you mean {", ".join(close)}?' if close else ''
    return (f'Unknown gin binding: nothing is registered under the name {name!r} ({where}).'
            f'{hint} Check the spelling in the gin file or --gin flag.')
  match = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", text)
  if match:
    return (f'Unknown gin binding: {match.group(1)} has no parameter {match.group(2)!r}'
            f' ({where}). Check the spelling in the gin file or --gin flag.')
  if 'Unable to open file' in text or isinstance(error, (IOError, OSError)):
    return (f'Gin file not found: {first} Pass the file by path, or add its directory with'
            ' --gin_search_paths.')
  return (f'Could not parse the gin configuration: {first} {where} Strings on the command'
          ' line need quotes inside the flag, e.g. --gin.OUTPUT_DIR="\'/tmp/out\'".')


def _is_required(value: Any) -> bool:
  return isinstance(value, gin.config.ConfigurableReference) and repr(value) == '%gin.REQUIRED'


def unset_required() -> list[str]:
  """Macros and bindings still set to `%gin.REQUIRED` after all files and flags are parsed."""
  missing = []
  for (scope, selector), params in gin.config._CONFIG.items():  # pylint: disable=protected-access
    for param, value in params.items():
      if _is_required(value):
        if selector == 'gin.macro':
          missing.append(scope)
        else:
          name = selector.rsplit('.', 1)[-1]
          missing.append(f'{scope + "/" if scope else ""}{name}.{param}')
  return sorted(missing)


def _required_message(names: Sequence[str]) -> str:
  examples = ' '.join(f'--gin.{n}=…' for n in names)
  return (f'Required setting{"s" if len(names) > 1 else ""} not provided: {", ".join(names)}.'
          f' Set {"them" if len(names) > 1 else "it"} in a gin file (e.g. {names[0]} = …) or on'
          f' the command line: {examples} (strings in quotes: --gin.{names[0]}="\'value\'").')


def required_call_error(error: Exception) -> str | None:
  match = re.search(r"Required bindings for `([^`]+)` not provided in config: \[([^\]]*)\]",
                    str(error))
  if not match:
    return None
  configurable = match.group(1).rsplit('.', 1)[-1]
  names = [f'{configurable}.{p.strip().strip(chr(39))}' for p in match.group(2).split(',')]
  return _required_message(names)


def warn(message: str) -> None:
  """One warning line on stderr (the job goes on)."""
  print(f'speclm.run: warning: {message}', file=sys.stderr)


_INCLUDE = re.compile(r"""^\s*include\s+(['"])(.+?)\1""", re.MULTILINE)


def _resolve_gin_file(name: str) -> str | None:
  """The file gin opens for `name`: the first search-path entry that has it."""
  prefixes = gin.config._LOCATION_PREFIXES if not os.path.isabs(name) else ['']  # pylint: disable=protected-access
  for prefix in prefixes:
    candidate = os.path.join(prefix, name)
    if os.path.isfile(candidate):
      return candidate
  return None


def shadowed_configs(gin_files: Sequence[str]) -> list[tuple[str, str]]:
  """(local file, repository file) for each gin file or include, followed recursively, that the
  search path finds outside configs/ although configs/ has a file of that name."""
  shadowed, seen, pending = [], set(), list(gin_files)
  while pending:
    name = pending.pop()
    resolved = _resolve_gin_file(name)
    if resolved is None or os.path.realpath(resolved) in seen:
      continue
    seen.add(os.path.realpath(resolved))
    ours = os.path.join(CONFIGS_DIR, name)
    if (not os.path.isabs(name) and os.path.isfile(ours)
        and os.path.realpath(ours) != os.path.realpath(resolved)):
      shadowed.append((os.path.abspath(resolved), ours))
    try:
      with open(resolved, encoding='utf-8') as f:
        pending += [m.group(2) for m in _INCLUDE.finditer(f.read())]
    except (OSError, UnicodeDecodeError):
      continue
  return shadowed


def _walk_references(value: Any, found: set[str]) -> None:
  if isinstance(value, gin.config.ConfigurableReference):
    if value._selector == 'gin.macro':  # pylint: disable=protected-access
      found.add(value._scopes[-1])  # pylint: disable=protected-access
  elif isinstance(value, (list, tuple)):
    for item in value:
      _walk_references(item, found)
  elif isinstance(value, dict):
    for item in value.values():
      _walk_references(item, found)


def unused_macros() -> tuple[list[str], list[str]]:
  """(macros nothing references, macros something references), after parsing."""
  config = gin.config._CONFIG  # pylint: disable=protected-access
  defined = {scope for scope, selector in config if selector == 'gin.macro'}
  used: set[str] = set()
  for params in config.values():
    for value in params.values():
      _walk_references(value, used)
  return sorted(defined - used), sorted(defined & used)


_MACRO_BINDING = re.compile(r'^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=')


def _check_macros(gin_bindings: Sequence[str]) -> None:
  """A macro set on the command line that nothing uses is a misspelling: stop and say so."""
  unused, used = unused_macros()
  if not unused:
    return
  from_flags = {m.group(1) for b in gin_bindings for m in [_MACRO_BINDING.match(b)] if m}
  for name in unused:
    close = difflib.get_close_matches(name, used, n=1)
    hint = f' Did you mean {close[0]}?' if close else ''
    if name in from_flags:
      raise JobError(f'--gin.{name} sets a macro that no configuration uses.{hint}')
    warn(f'the gin macro {name} is set but no configuration uses it.{hint}')


def parse_gin(gin_files: Sequence[str], gin_bindings: Sequence[str],
              gin_search_paths: Sequence[str] = ()) -> None:
  """Parses files then bindings (later ones win) and checks no required setting is left unset,
  no macro set on the command line goes unused, and says which repository gin files are
  shadowed by local files of the same name."""
  gin.clear_config()  # a fresh configuration each time (tools and tests parse more than once)
  # Gin keeps its search path across parses (clear_config leaves it): start from gin's own
  # [''] so this parse's directories come first, not those of an earlier parse.
  del gin.config._LOCATION_PREFIXES[1:]  # pylint: disable=protected-access
  for path in search_paths(gin_search_paths):
    gin.add_config_file_search_path(path)
  for local, ours in shadowed_configs(gin_files):
    warn(f'{local} shadows the repository\'s {os.path.relpath(ours, os.path.dirname(CONFIGS_DIR))}'
         ' (the search path finds it first); rename it to use the repository\'s file.')
  # Gin logs an error for every search-path entry that lacks a file, even when a later entry
  # has it; silence that while parsing (a file found nowhere still raises).
  std_logging.disable(std_logging.ERROR)
  try:
    gin.parse_config_files_and_bindings(list(gin_files), list(gin_bindings),
                                        finalize_config=False)
  except (ValueError, IOError, OSError, SyntaxError, TypeError) as e:
    raise JobError(_explain_gin_error(e)) from None
  finally:
    std_logging.disable(std_logging.NOTSET)
  missing = unset_required()
  if missing:
    raise JobError(_required_message(missing))
  _check_macros(gin_bindings)
  gin.finalize()


# ----------------------------------------------------------------------------------------------
# Reading bindings without calling anything


def _macro_value(reference) -> Any:
  scope = reference._scopes[-1]  # pylint: disable=protected-access
  return gin.config._CONFIG.get((scope, 'gin.macro'), {}).get('value')  # pylint: disable=protected-access


def _is_macro(value: Any) -> bool:
  return (isinstance(value, gin.config.ConfigurableReference)
          and value._selector == 'gin.macro')  # pylint: disable=protected-access


def resolve_macros(value: Any, depth: int = 0) -> Any:
  """`value` with every `%MACRO` replaced by the macro's value (recursively)."""
  if depth > 32:
    return value
  if _is_macro(value):
    return resolve_macros(_macro_value(value), depth + 1)
  if isinstance(value, (list, tuple)):
    return type(value)(resolve_macros(v, depth + 1) for v in value)
  if isinstance(value, dict):
    return {k: resolve_macros(v, depth + 1) for k, v in value.items()}
  return value


def _binding(scopes: Sequence[str], selector: str, param: str) -> Any:
  """The value gin binds to `param` of `selector` under `scopes` (innermost first), with
  macros resolved; None when unbound."""
  config = gin.config._CONFIG  # pylint: disable=protected-access
  for depth in range(len(scopes), -1, -1):
    scope = '/'.join(scopes[:depth])
    params = config.get((scope, selector), {})
    if param in params:
      return resolve_macros(params[param])
  return None


# Model-provider parameters that name a checkpoint path, checked before anything loads.
_PATH_PARAMS = ('checkpoint_path', 'path')


def check_model_paths() -> None:
  """The checkpoint paths of the job's target and draft providers exist (local paths only).

  Providers check their own paths too; this runs first so that a missing checkpoint is the
  first thing reported, before the vocabulary or dataset load.
  """
  config = gin.config._CONFIG  # pylint: disable=protected-access
  job = next((params for (scope, selector), params in config.items()
              if not scope and selector.rsplit('.', 1)[-1] == 'run_job'), {})
  for role in ('target', 'draft'):
    provider = resolve_macros(job.get(role))
    if not isinstance(provider, gin.config.ConfigurableReference):
      continue
    scopes, selector = provider._scopes, provider._configurable.selector  # pylint: disable=protected-access
    for param in _PATH_PARAMS:
      path = _binding(scopes, selector, param)
      if isinstance(path, str) and path:
        errors.check_path(path, f'{role} checkpoint ({selector.rsplit(".", 1)[-1]}.{param})')
