"""The docs match the code.

* WORKSPACE.md's public-API list (the `speclm/__init__.py` line of its repository map) names
  exactly `speclm.__all__`, and every name in it exists.
* Every repository path the docs cite exists: paths under `speclm/`, `scripts/`, `configs/`,
  `docs/`, `tests/` (in backticks, links or prose); `*.gin` names (found under `configs/`, as
  the job's search path finds them); relative markdown links; every file of WORKSPACE.md's
  repository map; and dotted names `speclm.module.name` (resolved from the source). Output
  paths a user's run creates are allowed explicitly (`OUTPUT_FILES`, `OUTPUT_PREFIXES`).
* Every script is in WORKSPACE.md's map, and every doc in it and in README.md's list.
* Every public function and class that a speclm `__init__.py` exports has a docstring, and
  those taking arrays have an `Args:` (or, for a class, `Attributes:`) section; every
  function and class the docs cite by name has a docstring.

Everything is read from the files at test time, so a module that moves makes the docs that
still cite its old place fail here. Tests on scratch copies show each check reports what it
should.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import importlib
import inspect
import itertools
import os
import re
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Paths the docs cite as things a user's run creates, not files of the repository: a job's
# output files (docs/running.md) and output directories given as examples.
OUTPUT_FILES = frozenset({'config.gin', 'operative_config.gin'})
OUTPUT_PREFIXES = ('/tmp/', 'speclm_demo_output/')

# Exported names whose docstrings still lack what `docstring_problems` asks for (an `Args:`
# section; EncodedExample any docstring). Their modules are being restructured on other
# branches (issue 35); each entry must go when its docstring is complete
# (test_pending_list_is_current fails until then).
PENDING = frozenset()

# Parameter names that hold arrays in this code base, for parameters without an annotation.
ARRAY_PARAMETERS = frozenset({
    'prompt_tokens', 'prompt_lengths', 'prompts', 'lengths', 'tokens', 'logits', 'probs',
    'inputs', 'input_lengths', 'features', 'sequences', 'sample_ids',
})

_ROOTS = ('speclm', 'scripts', 'configs', 'docs', 'tests')
# A repository path: one of the roots, then path characters; braces and globs are expanded.
_PATH = re.compile(r'(?<![\w./-])((?:%s)/[\w./{},*-]*[\w*}])' % '|'.join(_ROOTS))
# A gin file name, bare or under a configs/ folder (`runs/compare.gin`).
_GIN = re.compile(r'(?<![\w./{},-])([\w./-]+\.gin)(?![\w])')
# A markdown link's target, without its #anchor.
_LINK = re.compile(r'\]\(([^)#\s]*)(?:#[^)]*)?\)')
# A repository map entry: names (commas inside braces belong to a name), then its description.
_MAP_NAME = r'(?:[^\s,{]|\{[^}\s]*\})+'
_MAP_ENTRY = re.compile(r'(%s(?:, %s)*)(?:\s+(.*))?$' % (_MAP_NAME, _MAP_NAME))
# A dotted name in the package: `speclm.models.llama.Llama`.
_DOTTED = re.compile(r'(?<![\w./-])(speclm(?:\.[A-Za-z_]\w*)+)')


def doc_files(root: str) -> list[str]:
  """README.md, WORKSPACE.md and docs/*.md under `root`."""
  files = [os.path.join(root, 'README.md'), os.path.join(root, 'WORKSPACE.md')]
  return files + sorted(glob.glob(os.path.join(root, 'docs', '*.md')))


def expand_braces(text: str) -> list[str]:
  """`{a,b}_x` -> [`a_x`, `b_x`]; every brace group in turn."""
  match = re.search(r'\{([^{}]*)\}', text)
  if not match:
    return [text]
  return list(itertools.chain.from_iterable(
      expand_braces(text[:match.start()] + option + text[match.end():])
      for option in match.group(1).split(',')))


def _exists(repo: str, path: str) -> bool:
  return any(glob.glob(os.path.join(repo, option)) for option in expand_braces(path))


def _gin_exists(repo: str, name: str) -> bool:
  name = name[2:] if name.startswith('./') else name
  if name in OUTPUT_FILES or _exists(repo, name):
    return True
  configs = os.path.join(repo, 'configs')
  return any(path.replace(os.sep, '/').endswith('/' + name)
             for path in glob.glob(os.path.join(configs, '**', '*.gin'), recursive=True))


def module_file(repo: str, module: str) -> str | None:
  """The source file of `module` (`speclm.a.b`) under `repo`, or None."""
  base = os.path.join(repo, *module.split('.'))
  for candidate in (base + '.py', os.path.join(base, '__init__.py')):
    if os.path.isfile(candidate):
      return candidate
  return None


def _defined_names(body: list[ast.stmt]) -> set[str]:
  names = set()
  for node in body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names.update((a.asname or a.name).split('.')[0] for a in node.names)
    elif isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.add(node.target.id)
    elif isinstance(node, (ast.If, ast.Try)):
      names |= _defined_names(node.body)
  return names


def resolves(repo: str, dotted: str) -> bool:
  """Whether `speclm.a.b.Name.attr` names a module, then a name in it, then one in that class.

  Read from the source: the longest prefix that is a module, then at most two names (a
  module-level name, and a name in the body of a class so named). Deeper names are not checked.
  """
  parts = dotted.split('.')
  for split in range(len(parts), 0, -1):
    path = module_file(repo, '.'.join(parts[:split]))
    if path:
      break
  else:
    return False
  rest = parts[split:]
  if not rest:
    return True
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read())
  if rest[0] not in _defined_names(tree.body):
    return False
  if len(rest) == 1:
    return True
  for node in tree.body:  # an imported name: look in the module it comes from
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('speclm'):
      for alias in node.names:
        if (alias.asname or alias.name) == rest[0]:
          return resolves(repo, '.'.join([node.module, alias.name] + rest[1:]))
  classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == rest[0]]
  return not classes or any(rest[1] in _defined_names(c.body) for c in classes)


def cited_paths(doc: str) -> list[tuple[int, str, str]]:
  """(line, kind, citation) for each path, gin name, link and dotted name the file cites."""
  found = []
  with open(doc, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      found += [(number, 'path', m.group(1)) for m in _PATH.finditer(line)]
      found += [(number, 'gin', m.group(1)) for m in _GIN.finditer(line)]
      found += [(number, 'link', m.group(1)) for m in _LINK.finditer(line)
                if m.group(1) and '://' not in m.group(1)]
      found += [(number, 'name', m.group(1).rstrip('.')) for m in _DOTTED.finditer(line)]
  return found


def missing_citations(doc_root: str, repo: str = REPO) -> list[str]:
  """`file:line: citation` for each citation in the docs under `doc_root` absent from `repo`."""
  problems = []
  for doc in doc_files(doc_root):
    rel_doc = os.path.relpath(doc, doc_root)
    for number, kind, cited in cited_paths(doc):
      if cited.startswith(OUTPUT_PREFIXES):
        continue
      if kind == 'path':
        ok = _exists(repo, cited)
      elif kind == 'gin':
        ok = _gin_exists(repo, cited)
      elif kind == 'link':
        ok = _exists(repo, os.path.normpath(os.path.join(os.path.dirname(rel_doc), cited)))
      else:
        ok = resolves(repo, cited)
      if not ok:
        problems.append(f'{rel_doc}:{number}: {kind} {cited}')
  return problems


@dataclasses.dataclass
class MapEntry:
  """One entry of WORKSPACE.md's repository map: its path and its text (continuations too)."""
  line: int
  path: str
  text: str


def repository_map(workspace: str) -> list[MapEntry]:
  """The entries of the first code block after '## The repository' in WORKSPACE.md.

  An entry starts at indentation 8 or less with a name (a file, or a folder ending in '/'; or
  several, comma-separated), then spaces and its description; deeper-indented lines continue
  the description. A folder's entries are indented under it.
  """
  with open(workspace, encoding='utf-8') as f:
    lines = f.read().split('\n')
  start = lines.index('## The repository')
  first = next(i for i in range(start, len(lines)) if lines[i].startswith('```'))
  entries, folders = [], []  # folders: (indent, path) of the enclosing folders
  for number in range(first + 1, len(lines)):
    line = lines[number]
    if line.startswith('```'):
      break
    indent = len(line) - len(line.lstrip(' '))
    match = _MAP_ENTRY.match(line.strip())
    if indent > 8 or not match:
      if entries and line.strip():
        entries[-1].text += ' ' + line.strip()
      continue
    while folders and folders[-1][0] >= indent:
      folders.pop()
    parent = folders[-1][1] if folders else ''
    for name in match.group(1).split(', '):
      entries.append(MapEntry(number + 1, parent + name, match.group(2) or ''))
    if match.group(1).endswith('/') and ', ' not in match.group(1):
      folders.append((indent, parent + match.group(1)))
  return entries


def listed_public_api(workspace: str) -> list[str]:
  """The names after 'the public API:' in the map's `speclm/__init__.py` entry."""
  entry = next((e for e in repository_map(workspace) if e.path == 'speclm/__init__.py'), None)
  assert entry is not None, 'WORKSPACE.md: the repository map has no speclm/__init__.py entry'
  assert 'the public API:' in entry.text, (
      f'WORKSPACE.md:{entry.line}: write the names as "the public API: name, name, …"')
  names = [n.strip() for n in entry.text.split('the public API:', 1)[1].split(',')]
  bad = [n for n in names if not n.isidentifier()]
  assert not bad, f'WORKSPACE.md:{entry.line}: the API list holds only names, found {bad}'
  return names


def api_list_problems(workspace: str) -> list[str]:
  """Names listed but missing from `speclm`, and names of `speclm.__all__` not listed."""
  import speclm  # pylint: disable=import-outside-toplevel
  listed = listed_public_api(workspace)
  problems = [f'WORKSPACE.md lists {n}, which speclm does not have' for n in listed
              if not hasattr(speclm, n)]
  problems += [f'speclm.__all__ has {n}, which WORKSPACE.md does not list' for n in speclm.__all__
               if n not in listed]
  return problems


def map_problems(workspace: str, repo: str = REPO) -> list[str]:
  """`WORKSPACE.md:line: path` for each map entry that does not exist under `repo`."""
  return [f'WORKSPACE.md:{e.line}: {e.path}' for e in repository_map(workspace)
          if not _exists(repo, e.path.rstrip('/'))]


def exported(repo: str = REPO) -> list[tuple[str, object]]:
  """(dotted name, object) for each public function and class a speclm `__init__.py` exports.

  A package's exports are its `__all__`, or else the public functions and classes its
  `__init__.py` defines.
  """
  found = []
  for path in sorted(glob.glob(os.path.join(repo, 'speclm', '**', '__init__.py'),
                               recursive=True)):
    package = os.path.relpath(os.path.dirname(path), repo).replace(os.sep, '.')
    module = importlib.import_module(package)
    names = getattr(module, '__all__', None)
    if names is None:
      names = [n for n, v in vars(module).items()
               if not n.startswith('_') and getattr(v, '__module__', None) == package]
    for name in names:
      value = getattr(module, name)
      if inspect.isfunction(value) or inspect.isclass(value):
        found.append((f'{package}.{name}', value))
  return found


def cited_objects(doc_root: str = REPO) -> list[tuple[str, object]]:
  """(dotted name, object) for each function or class the docs cite as `speclm.….name`."""
  names = sorted({cited for doc in doc_files(doc_root)
                  for _, kind, cited in cited_paths(doc) if kind == 'name'})
  found = []
  for name in names:
    parts = name.split('.')
    split = max(i for i in range(1, len(parts) + 1)
                if module_file(REPO, '.'.join(parts[:i])))
    value = importlib.import_module('.'.join(parts[:split]))
    for attribute in parts[split:]:
      value = getattr(value, attribute, None)
    if inspect.isfunction(value) or inspect.isclass(value):
      found.append((name, value))
  return found


def takes_arrays(value) -> bool:
  """Whether a function's (or a class constructor's) parameters include an array: annotated
  as one, or unannotated and named as arrays are here (`ARRAY_PARAMETERS`)."""
  try:
    parameters = inspect.signature(value).parameters.values()
  except (TypeError, ValueError):
    return False
  for parameter in parameters:
    if parameter.annotation is inspect.Parameter.empty:
      if parameter.name in ARRAY_PARAMETERS:
        return True
    elif re.search(r'Array|ndarray', str(parameter.annotation)):
      return True
  return False


def own_docstring(value) -> str:
  """The docstring written on `value` itself (not inherited, not dataclasses' signature)."""
  doc = vars(value).get('__doc__') if inspect.isclass(value) else value.__doc__
  if not doc or (dataclasses.is_dataclass(value) and doc.startswith(value.__name__ + '(')):
    return ''
  return doc.strip()


def docstring_problems(items: list[tuple[str, object]]) -> list[str]:
  """What each exported function or class lacks: a docstring, or an Args section for arrays."""
  problems = []
  for name, value in items:
    doc = own_docstring(value)
    if not doc:
      problems.append(f'{name}: no docstring')
      continue
    sections = ('Args:', 'Attributes:') if inspect.isclass(value) else ('Args:',)
    if takes_arrays(value) and not any(s in doc for s in sections):
      problems.append(f'{name}: takes arrays, so its docstring needs an Args: section with'
                      ' their shapes')
  return problems


# --- The checks on the repository.


def test_workspace_api_list_matches_the_package():
  assert api_list_problems(os.path.join(REPO, 'WORKSPACE.md')) == []


def test_every_path_the_docs_cite_exists():
  assert missing_citations(REPO) == []


def test_every_entry_of_the_repository_map_exists():
  assert map_problems(os.path.join(REPO, 'WORKSPACE.md')) == []


def test_every_script_and_doc_is_in_the_repository_map():
  listed = {e.path for e in repository_map(os.path.join(REPO, 'WORKSPACE.md'))}
  text = open(os.path.join(REPO, 'WORKSPACE.md'), encoding='utf-8').read()
  wanted = [p for p in glob.glob(os.path.join(REPO, 'scripts', '*')) if os.path.isfile(p)]
  missing = [os.path.relpath(p, REPO) for p in wanted if os.path.relpath(p, REPO) not in listed]
  missing += [f'docs/{os.path.basename(p)}' for p in glob.glob(os.path.join(REPO, 'docs', '*.md'))
              if os.path.basename(p) not in text]
  assert missing == []


def test_readme_lists_every_doc():
  text = open(os.path.join(REPO, 'README.md'), encoding='utf-8').read()
  docs = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, 'docs', '*.md')))
  assert [d for d in docs if f'({d})' not in text] == []


def test_exported_names_have_docstrings():
  items = exported()
  assert len(items) > 40  # every package's exports were found
  assert docstring_problems([i for i in items if i[0] not in PENDING]) == []


def test_names_the_docs_cite_have_docstrings():
  items = cited_objects()
  assert len(items) > 20  # the docs cite many names
  assert [p for p in docstring_problems(items) if p.endswith('no docstring')] == []


def test_pending_list_is_current():
  items = dict(exported())
  stale = [n for n in PENDING
           if n not in items or not docstring_problems([(n, items[n])])]
  assert stale == [], (f'remove {stale} from PENDING: their docstrings are complete now, or'
                       ' they are gone')


# --- The checks report what they should, on scratch copies.


def _scratch_docs(tmp_path) -> str:
  root = str(tmp_path / 'repo')
  os.makedirs(os.path.join(root, 'docs'))
  for doc in doc_files(REPO):
    shutil.copy(doc, os.path.join(root, os.path.relpath(doc, REPO)))
  return root


def test_a_bogus_citation_is_reported(tmp_path):
  root = _scratch_docs(tmp_path)
  with open(os.path.join(root, 'docs', 'running.md'), 'a', encoding='utf-8') as f:
    f.write('\nSee `speclm/run/nowhere.py`, `runs/nowhere.gin`, [x](nowhere.md),\n'
            '`speclm.decoding.no_such_function`, `speclm.Model.no_such_method`,\n'
            '`speclm.no_such_module.f` and `/tmp/out/speclm/made_by_a_run.py`.\n')
  problems = missing_citations(root)
  last = len(open(os.path.join(root, 'docs', 'running.md'), encoding='utf-8').readlines())
  assert problems == [
      f'docs/running.md:{last - 2}: path speclm/run/nowhere.py',
      f'docs/running.md:{last - 2}: gin runs/nowhere.gin',
      f'docs/running.md:{last - 2}: link nowhere.md',
      f'docs/running.md:{last - 1}: name speclm.decoding.no_such_function',
      f'docs/running.md:{last - 1}: name speclm.Model.no_such_method',
      f'docs/running.md:{last}: name speclm.no_such_module.f',
  ]


def test_a_removed_file_is_reported(tmp_path):
  repo = str(tmp_path / 'repo')
  shutil.copytree(os.path.join(REPO, 'docs'), os.path.join(repo, 'docs'))
  shutil.copytree(os.path.join(REPO, 'speclm'), os.path.join(repo, 'speclm'),
                  ignore=shutil.ignore_patterns('__pycache__', 'assets'))
  for name in ('README.md', 'WORKSPACE.md'):
    shutil.copy(os.path.join(REPO, name), repo)
  os.remove(os.path.join(repo, 'speclm', 'protocol.py'))
  problems = missing_citations(REPO, repo=repo)
  assert 'docs/decoding.md' in ' '.join(problems)
  assert any(p.endswith('path speclm/protocol.py') for p in problems)
  assert any(p.endswith('name speclm.protocol.LanguageModel') for p in problems)
  assert 'WORKSPACE.md' in ' '.join(map_problems(os.path.join(repo, 'WORKSPACE.md'), repo))


def test_api_list_changes_are_reported(tmp_path):
  workspace = str(tmp_path / 'WORKSPACE.md')
  text = open(os.path.join(REPO, 'WORKSPACE.md'), encoding='utf-8').read()
  names = listed_public_api(os.path.join(REPO, 'WORKSPACE.md'))
  with open(workspace, 'w', encoding='utf-8') as f:
    f.write(text.replace(f' {names[0]},', ' no_such_name,', 1))
  assert api_list_problems(workspace) == [
      'WORKSPACE.md lists no_such_name, which speclm does not have',
      f'speclm.__all__ has {names[0]}, which WORKSPACE.md does not list',
  ]


def test_a_map_entry_that_does_not_exist_is_reported(tmp_path):
  workspace = str(tmp_path / 'WORKSPACE.md')
  text = open(os.path.join(REPO, 'WORKSPACE.md'), encoding='utf-8').read()
  with open(workspace, 'w', encoding='utf-8') as f:
    f.write(text.replace('\n    cli.py ', '\n    nowhere.py              gone\n    cli.py ', 1))
  assert [p.split(': ')[1] for p in map_problems(workspace)] == ['speclm/run/nowhere.py']


def test_missing_docstrings_and_args_are_reported():
  def undocumented(tokens):
    return tokens

  def no_args(tokens: 'jax.Array'):
    """Says nothing of its argument's shape."""
    return tokens

  def with_args(tokens):
    """Doubles the tokens.

    Args:
      tokens: `[B, K]` int32.
    """
    return tokens

  def scalar(alpha: float):
    """A scalar needs no Args section."""
    return alpha

  assert docstring_problems([('a', undocumented), ('b', no_args), ('c', with_args),
                             ('d', scalar)]) == [
      'a: no docstring',
      'b: takes arrays, so its docstring needs an Args: section with their shapes',
  ]


@pytest.mark.parametrize('text, expanded', [
    ('configs/{ende,cnndm}_{small,base}.gin',
     ['configs/ende_small.gin', 'configs/ende_base.gin', 'configs/cnndm_small.gin',
      'configs/cnndm_base.gin']),
    ('docs/a.md', ['docs/a.md']),
])
def test_expand_braces(text, expanded):
  assert expand_braces(text) == expanded
