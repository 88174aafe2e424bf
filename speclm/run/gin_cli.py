"""The gin command line shared by `python -m speclm.run` and `python -m speclm.analysis`.

T5X keeps the same apart in `t5x/gin_utils.py`: `--gin.NAME=VALUE` rewriting, the search path
(`--gin_search_paths`, the working directory, the repository's `configs/`), parsing with
errors that say what to change (unknown bindings with the nearest name, required settings,
macros set on the command line that nothing uses), a warning for local files that shadow the
repository's, and the checkpoint paths of the job's models checked before anything loads.

Gin is read through its public API (`gin.get_bindings`, `gin.query_parameter`,
`gin.get_configurable`, `gin.config_parser`, `ConfigurableReference.scopes`/`.selector`), save
for `_gin_state`, the one function that lists every binding and registered name (gin has no
public API for either). Errors are worked out from the bindings the user wrote and the
configurables' signatures, not from gin's error text.
"""

from __future__ import annotations

import difflib
import inspect
import logging as std_logging
import os
import re
import sys
from typing import Any, Mapping, Sequence

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


# ----------------------------------------------------------------------------------------------
# The configuration as gin holds it


def _gin_state() -> tuple[Mapping[tuple[str, str], Mapping[str, Any]], list[str]]:
  """(every binding, every registered selector): the one read of gin's private state.

  gin 0.5 has no public API that lists all bindings (`gin.config_str()` renders text and drops
  values that are not literals; `gin.get_bindings` and `gin.query_parameter` need a name
  first) nor one that lists the registered configurables (`gin.get_configurable` looks one
  name up). Everything else here goes through gin's public API.
  """
  config = gin.config._CONFIG  # pylint: disable=protected-access
  registry = gin.config._REGISTRY  # pylint: disable=protected-access
  return config, [selector for selector, _ in registry.items()]


def _reset_gin_search_path() -> None:
  """Gin's search path back to its own [''] (the working directory).

  Gin keeps the directories `gin.add_config_file_search_path` added across parses
  (`gin.clear_config` leaves them), so in a process that parses twice (a tool, a test) an
  earlier parse's directories would shadow this one's. gin 0.5 has no public call that
  removes a search path; this is the one write to its private list.
  """
  del gin.config._LOCATION_PREFIXES[1:]  # pylint: disable=protected-access
  del _SEARCH_PREFIXES[1:]


def all_bindings() -> Mapping[tuple[str, str], Mapping[str, Any]]:
  """Every binding parsed so far, read only: (scope, selector) -> {parameter: value}.

  A macro `NAME = v` is (NAME, 'gin.macro') -> {'value': v}; values keep their references
  (`gin.config.ConfigurableReference`) unevaluated.
  """
  return _gin_state()[0]


def _configurable_names() -> list[str]:
  names = set()
  for selector in _gin_state()[1]:
    names.add(selector)
    names.add(selector.rsplit('.', 1)[-1])
  return sorted(names)


def _is_registered(selector: str) -> bool:
  try:
    gin.get_configurable(selector)
  except ValueError:
    return False
  return True


def _parameters(selector: str) -> Mapping[str, inspect.Parameter]:
  """The parameters of configurable `selector` (a class: its constructor's but `self`, as gin
  reads them: the first `__init__` or `__new__` along the method resolution order)."""
  fn = gin.get_configurable(selector)
  if not inspect.isclass(fn):
    return inspect.signature(inspect.unwrap(fn)).parameters
  fn = next(vars(k)[m] for k in fn.__mro__ for m in ('__init__', '__new__') if m in vars(k))
  return dict(list(inspect.signature(inspect.unwrap(fn)).parameters.items())[1:])  # no self


def _takes(selector: str, param: str) -> bool:
  """Whether configurable `selector` accepts `param` (by name, or through **kwargs)."""
  try:
    params = _parameters(selector)
  except (TypeError, ValueError):
    return True
  return param in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


# ----------------------------------------------------------------------------------------------
# Errors that say what to change


class _Names(gin.config_parser.ParserDelegate):
  """Parses values without building anything, noting references to unknown configurables."""

  def __init__(self):
    self.unknown_reference = False

  def configurable_reference(self, scoped_configurable_name, evaluate):
    if not _is_registered(scoped_configurable_name.split('/')[-1]):
      self.unknown_reference = True
    return scoped_configurable_name

  def macro(self, macro_name):
    return macro_name


def _where(location) -> str:
  """'In file "x.gin", line 3 a.b = 1' or 'In bindings string line 1 a.b = 1'."""
  source = f'file "{location.filename}",' if location.filename else 'bindings string'
  return f'In {source} line {location.line_num} {location.line_content.strip()}'


def _first_unknown(source, names: _Names, seen: set[str]):
  """(selector, parameter or None, location) of the first statement of `source` (gin text,
  includes followed) that names an unknown configurable or parameter; None if there is none
  or an unknown reference comes first (then gin's own message is kept)."""
  for statement in gin.config_parser.ConfigParser(source, names):
    if names.unknown_reference:
      return None
    if isinstance(statement, gin.config_parser.IncludeStatement):
      path = _resolve_gin_file(statement.filename)
      if path is None or os.path.realpath(path) in seen:
        continue
      seen.add(os.path.realpath(path))
      with open(path, encoding='utf-8') as f:
        found = _first_unknown(f, names, seen)
      if found is not None or names.unknown_reference:
        return found
    elif isinstance(statement, gin.config_parser.BlockDeclaration):
      if not _is_registered(statement.selector):
        return statement.selector, None, statement.location
    elif isinstance(statement, gin.config_parser.BindingStatement) and statement.arg_name:
      if not _is_registered(statement.selector):
        return statement.selector, None, statement.location
      if not _takes(statement.selector, statement.arg_name):
        return statement.selector, statement.arg_name, statement.location
  return None


def _unknown_binding(gin_files: Sequence[str], gin_bindings: Sequence[str]):
  """The first binding, in gin's order (files with their includes, then bindings), that names
  an unknown configurable or parameter: (selector, parameter or None, location), or None."""
  names = _Names()
  for name in gin_files:
    path = _resolve_gin_file(name)
    if path is None:
      return None
    with open(path, encoding='utf-8') as f:
      found = _first_unknown(f, names, {os.path.realpath(path)})
    if found is not None or names.unknown_reference:
      return found
  return _first_unknown('\n'.join(gin_bindings), names, set())


def _explain_gin_error(error: Exception, gin_files: Sequence[str],
                       gin_bindings: Sequence[str]) -> str:
  """The message for an error gin raised while parsing `gin_files` then `gin_bindings`."""
  text = str(error).strip()
  first = text.splitlines()[0] if text else type(error).__name__
  unknown = None
  if isinstance(error, ValueError):
    try:
      unknown = _unknown_binding(gin_files, gin_bindings)
    except (SyntaxError, ValueError, OSError, UnicodeDecodeError):
      pass  # text past gin's error that does not parse: gin's own message is kept
  if unknown is not None:
    selector, param, location = unknown
    if param is None:
      close = difflib.get_close_matches(selector.rsplit('.', 1)[-1], _configurable_names(), n=3)
      hint = f' Did you mean {", ".join(close)}?' if close else ''
      return (f'Unknown gin binding: nothing is registered under the name {selector!r}'
              f' ({_where(location)}).{hint} Check the spelling in the gin file or --gin flag.')
    return (f'Unknown gin binding: {selector} has no parameter {param!r}'
            f' ({_where(location)}). Check the spelling in the gin file or --gin flag.')
  if isinstance(error, (IOError, OSError)):
    return (f'Gin file not found: {first} Pass the file by path, or add its directory with'
            ' --gin_search_paths.')
  where = ' '.join(line.strip() for line in text.splitlines()[1:3])  # gin's location lines
  return (f'Could not parse the gin configuration: {first} {where} Strings on the command'
          ' line need quotes inside the flag, e.g. --gin.OUTPUT_DIR="\'/tmp/out\'".')


def _is_required(value: Any) -> bool:
  return isinstance(value, gin.config.ConfigurableReference) and repr(value) == '%gin.REQUIRED'


def unset_required() -> list[str]:
  """Macros and bindings still set to `%gin.REQUIRED` after all files and flags are parsed."""
  missing = []
  for (scope, selector), params in all_bindings().items():
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


def unbound_parameters(scopes: Sequence[str], selector: str,
                       default: Any = gin.REQUIRED) -> list[str]:
  """The parameters of configurable `selector` whose default is `default` (`gin.REQUIRED`, or
  `inspect.Parameter.empty`: none) and that no binding sets under `scopes`, in signature
  order; *args and **kwargs never count."""
  try:
    params = _parameters(selector)
    bound = gin.get_bindings('/'.join([*scopes, selector]), resolve_references=False)
  except (TypeError, ValueError):
    return []
  return [name for name, p in params.items() if p.default is default and name not in bound
          and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def reference_to(fn: Any) -> Any:
  """The `gin.config.ConfigurableReference` of the bindings that gave `fn` (a configurable
  that gin passed as an argument, e.g. a provider `@target/random_llama`), or None."""
  for params in all_bindings().values():
    for ref in gin.config.iterate_references(params):
      if ref.scoped_configurable_fn is fn:
        return ref
  return None


def required_call_error(error: Exception) -> str | None:
  """The message for gin's RuntimeError on calling a configurable whose `gin.REQUIRED`
  parameters are unbound, naming them (found from the bindings and signatures); None for
  any other error."""
  if not isinstance(error, RuntimeError) or 'Required bindings' not in str(error):
    return None
  called = list(all_bindings())
  for params in all_bindings().values():
    called += [('/'.join(ref.scopes), ref.configurable.selector)
               for ref in gin.config.iterate_references(params)]
  names = []
  for scope, selector in dict.fromkeys(called):
    short = selector.rsplit('.', 1)[-1]
    scopes = scope.split('/') if scope else []
    names += [f'{short}.{param}' for param in unbound_parameters(scopes, selector)
              if f'{short}.{param}' not in names]
  return _required_message(names) if names else None


def warn(message: str) -> None:
  """One warning line on stderr (the job goes on)."""
  print(f'speclm.run: warning: {message}', file=sys.stderr)


_INCLUDE = re.compile(r"""^\s*include\s+(['"])(.+?)\1""", re.MULTILINE)


# Gin's search path as the last parse_gin gave it (gin's own '' first, then its directories).
_SEARCH_PREFIXES = ['']


def _resolve_gin_file(name: str) -> str | None:
  """The file gin opens for `name`: the first search-path entry that has it."""
  prefixes = _SEARCH_PREFIXES if not os.path.isabs(name) else ['']
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
    if value.selector == 'gin.macro':
      found.add(value.scopes[-1])
  elif isinstance(value, (list, tuple)):
    for item in value:
      _walk_references(item, found)
  elif isinstance(value, dict):
    for item in value.values():
      _walk_references(item, found)


def unused_macros() -> tuple[list[str], list[str]]:
  """(macros nothing references, macros something references), after parsing."""
  config = all_bindings()
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
  _reset_gin_search_path()
  for path in search_paths(gin_search_paths):
    gin.add_config_file_search_path(path)
    _SEARCH_PREFIXES.append(path)
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
    raise JobError(_explain_gin_error(e, gin_files, gin_bindings)) from None
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
  try:
    return gin.query_parameter(f'{reference.scopes[-1]}/gin.macro.value')
  except ValueError:  # an unset macro
    return None


def _is_macro(value: Any) -> bool:
  return isinstance(value, gin.config.ConfigurableReference) and value.selector == 'gin.macro'



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
  params = gin.get_bindings('/'.join([*scopes, selector]), resolve_references=False)
  return resolve_macros(params[param]) if param in params else None


# Model-provider parameters that name a checkpoint path, checked before anything loads.
_PATH_PARAMS = ('checkpoint_path', 'path')


def check_model_paths() -> None:
  """The checkpoint paths of the job's target and draft providers exist (local paths only).

  Providers check their own paths too; this runs first so that a missing checkpoint is the
  first thing reported, before the vocabulary or dataset load.
  """
  job = next((params for (scope, selector), params in all_bindings().items()
              if not scope and selector.rsplit('.', 1)[-1] == 'run_job'), {})
  for role in ('target', 'draft'):
    provider = resolve_macros(job.get(role))
    if not isinstance(provider, gin.config.ConfigurableReference):
      continue
    scopes, selector = provider.scopes, provider.configurable.selector
    for param in _PATH_PARAMS:
      path = _binding(scopes, selector, param)
      if isinstance(path, str) and path:
        errors.check_path(path, f'{role} checkpoint ({selector.rsplit(".", 1)[-1]}.{param})')
