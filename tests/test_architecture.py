"""Every import points down the layers WORKSPACE.md draws; gin stays at the edges; no cycles;
the analysis package never runs a decode loop; modules and functions stay small; no module
reaches into another's private names.

The source is read (ast, nothing is executed), function-level imports included. Tests show
each check fails, naming file and line, on a scratch copy with a violation added.
"""

from __future__ import annotations

import ast
import os
import shutil

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bottom to top, as in WORKSPACE.md. A module belongs to the layer of its longest matching
# prefix; it may import its own layer and those below. The package itself (speclm/__init__.py,
# the public API) is matched by its exact name: it exports `speclm.generate`, which loads
# checkpoints by path, so it sits above the readers.
PACKAGE = 'speclm'
LAYERS = (
    ('foundations', ('speclm.sampling', 'speclm.protocol', 'speclm.trees', 'speclm.token_trees')),
    ('core', ('speclm.speculative', 'speclm.decoding', 'speclm.decode_common', 'speclm.adaptive',
              'speclm.tree_decoding', 'speclm.models', 'speclm.kernels', 'speclm.tokenizer',
              'speclm.partitioning', 'speclm.data', 'speclm.outputs', 'speclm.progress')),
    ('checkpoints', ('speclm.checkpoints',)),
    ('api', (PACKAGE, 'speclm.text')),
    ('presets', ('speclm.presets',)),
    ('analysis', ('speclm.analysis', 'speclm.testing')),
    # The job side, bottom to top: calibration (timing c and r(γ), the tree policy, measuring
    # runs), then the gin configuration both command lines share (flag parsing, providers,
    # loading a job's parts), then the job itself and the command lines.
    ('calibration', ('speclm.run.calibration', 'speclm.run.errors')),
    ('config', ('speclm.run.gin_cli', 'speclm.run.providers', 'speclm.run.fingerprint',
                'speclm.run.loading')),
    ('job', ('speclm.run', 'speclm.analysis.__main__', 'speclm.example')),
)
# Layers below this one never import gin.
FIRST_GIN_LAYER = 'presets'
# The algorithms see models only through the protocol.
ALGORITHMS = ('speclm.speculative', 'speclm.decoding', 'speclm.decode_common',
              'speclm.adaptive', 'speclm.tree_decoding')
# The analysis package explains results after decoding: it never imports a decode loop nor the
# job side (its command line, `speclm.analysis.__main__`, belongs to the job layer).
ANALYSIS = 'speclm.analysis'
ANALYSIS_CLI = 'speclm.analysis.__main__'
NOT_FOR_ANALYSIS = ('speclm.decoding', 'speclm.tree_decoding', 'speclm.run')
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80  # a function's lines from `def` to its end, its docstring not counted
# Private names used on purpose, each with its reason. gin 0.5 has no public API that lists every
# binding or every registered configurable (`gin_cli._gin_state` is the one function reading
# them; everything else goes through `gin_cli.all_bindings`), nor one that removes a search path
# (`gin_cli._reset_gin_search_path`, so one parse's directories never shadow the next's).
ALLOWED_PRIVATE = {
    ('speclm/run/gin_cli.py', 'gin.config._CONFIG'),
    ('speclm/run/gin_cli.py', 'gin.config._REGISTRY'),
    ('speclm/run/gin_cli.py', 'gin.config._LOCATION_PREFIXES'),
}


def _module_name(root: str, path: str) -> str:
  rel = os.path.relpath(path, root)[:-len('.py')].replace(os.sep, '.')
  return rel[:-len('.__init__')] if rel.endswith('.__init__') else rel


def modules(root: str) -> dict[str, str]:
  """speclm module name -> file path, for every .py file of the package under `root`."""
  found = {}
  for directory, _, files in os.walk(os.path.join(root, 'speclm')):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(directory, name)
        found[_module_name(root, path)] = path
  return found


def layer_of(module: str) -> int:
  best, best_len = None, -1
  for index, (_, prefixes) in enumerate(LAYERS):
    for prefix in prefixes:
      prefixed = prefix != PACKAGE and module.startswith(prefix + '.')
      if (module == prefix or prefixed) and len(prefix) > best_len:
        best, best_len = index, len(prefix)
  if best is None:
    raise AssertionError(f'{module} is in no layer: add it to LAYERS and WORKSPACE.md')
  return best


def imports(path: str, known: dict[str, str]) -> list[tuple[str, int]]:
  """(imported module, line) for each import in the file; speclm imports resolved to modules."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read(), filename=path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [(alias.name, node.lineno) for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        candidate = f'{node.module}.{alias.name}'
        found.append((candidate if candidate in known else node.module, node.lineno))
  return found


def violations(root: str) -> list[str]:
  """Every import against the layering, gin below the presets layer, and import cycles."""
  known = modules(root)
  gin_floor = [name for name, _ in LAYERS].index(FIRST_GIN_LAYER)
  problems, graph = [], {}
  for module, path in sorted(known.items()):
    layer = layer_of(module)
    where = os.path.relpath(path, root)
    graph[module] = set()
    for imported, line in imports(path, known):
      if imported == 'gin' or imported.startswith('gin.'):
        if layer < gin_floor:
          problems.append(f'{where}:{line}: imports gin, but {module} is in the'
                          f' {LAYERS[layer][0]} layer (gin only from {FIRST_GIN_LAYER} up)')
        continue
      if not imported.startswith('speclm'):
        continue
      graph[module].add(imported)
      target = layer_of(imported)
      if target > layer:
        problems.append(f'{where}:{line}: {module} ({LAYERS[layer][0]}) imports {imported}'
                        f' ({LAYERS[target][0]}), a layer above it')
      if module.startswith(ALGORITHMS) and target > 0 and not imported.startswith(ALGORITHMS):
        problems.append(f'{where}:{line}: {module} imports {imported}; the algorithms see'
                        ' models only through speclm.protocol')
      if (module.startswith(ANALYSIS) and module != ANALYSIS_CLI
          and _within(imported, NOT_FOR_ANALYSIS)):
        problems.append(f'{where}:{line}: {module} imports {imported}; the analysis package'
                        ' explains results and never runs a decode loop or the job')
  problems += [f'import cycle: {" -> ".join(cycle)}' for cycle in _cycles(graph)]
  return problems


def _within(module: str, prefixes) -> bool:
  return any(module == p or module.startswith(p + '.') for p in prefixes)


def _function_lines(node) -> int:
  """Lines of a function from `def` (decorators excluded) to its end, less its docstring."""
  lines = node.end_lineno - node.lineno + 1
  body = node.body
  if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)):
    lines -= body[0].end_lineno - body[0].lineno + 1
  return lines


def size_violations(root: str) -> list[str]:
  """Modules over MAX_MODULE_LINES lines and functions over MAX_FUNCTION_LINES, in speclm/."""
  problems = []
  for _, path in sorted(modules(root).items()):
    where = os.path.relpath(path, root)
    with open(path, encoding='utf-8') as f:
      text = f.read()
    if text.count('\n') > MAX_MODULE_LINES:
      problems.append(f'{where}: {text.count(chr(10))} lines (at most {MAX_MODULE_LINES})')
    for node in ast.walk(ast.parse(text, filename=path)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = _function_lines(node)
        if lines > MAX_FUNCTION_LINES:
          problems.append(f'{where}:{node.lineno}: {node.name} has {lines} lines (at most'
                          f' {MAX_FUNCTION_LINES}, docstring not counted)')
  return problems


def _is_private(name: str) -> bool:
  return name.startswith('_') and not name.startswith('__')


def private_access_violations(root: str) -> list[str]:
  """Uses of another module's private names: `from m import _x`, and `m._x` (or `m.sub._x`)
  where `m` is a name the file imported."""
  problems = []
  for _, path in sorted(modules(root).items()):
    where = os.path.relpath(path, root)
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), filename=path)
    imported = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        imported |= {(a.asname or a.name).split('.')[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom):
        imported |= {a.asname or a.name for a in node.names}
        problems += [f'{where}:{node.lineno}: imports {a.name} from {node.module}, a private'
                     ' name of another module' for a in node.names if _is_private(a.name)]
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and _is_private(node.attr):
        base = node.value
        while isinstance(base, ast.Attribute):
          base = base.value
        if (isinstance(base, ast.Name) and base.id in imported
            and (where, ast.unparse(node)) not in ALLOWED_PRIVATE):
          problems.append(f'{where}:{node.lineno}: {ast.unparse(node)} reaches into another'
                          ' module\'s private name')
  return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected group of modules (Tarjan), as a path back to its start."""
  index, low, stack, on_stack, groups = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in graph.get(node, ()):
      if nxt not in graph:
        continue
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      group = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        group.append(member)
        if member == node:
          break
      if len(group) > 1:
        groups.append(group)

  for node in sorted(graph):
    if node not in index:
      visit(node)
  cycles = []
  for group in groups:
    members, path, node = set(group), [min(group)], min(group)
    while True:
      node = sorted(n for n in graph[node] if n in members)[0]
      if node in path:
        cycles.append(path[path.index(node):] + [node])
        break
      path.append(node)
  return cycles


def test_every_import_follows_the_layering():
  assert violations(REPO) == []


def test_modules_and_functions_stay_small():
  assert size_violations(REPO) == []


def test_no_module_reaches_into_another_modules_private_names():
  assert private_access_violations(REPO) == []


def test_size_and_private_checks_fail_on_violations(tmp_path):
  scratch = tmp_path / 'repo'
  shutil.copytree(os.path.join(REPO, 'speclm'), scratch / 'speclm',
                  ignore=shutil.ignore_patterns('__pycache__', 'assets'))
  long_body = ''.join(f'  x{i} = {i}\n' for i in range(MAX_FUNCTION_LINES))
  with open(scratch / 'speclm' / 'trees.py', 'a', encoding='utf-8') as f:
    f.write(f'\n\ndef too_long():\n  """Docstring lines are not counted."""\n{long_body}')
    f.write('\n\ndef peeks():\n  return sampling_lib._secret  # noqa\n')
    f.write('\nimport speclm.sampling as sampling_lib\nfrom speclm.sampling import _hidden\n')
  with open(scratch / 'speclm' / 'adaptive.py', 'a', encoding='utf-8') as f:
    f.write('\n' * (MAX_MODULE_LINES + 1))
  sizes = size_violations(str(scratch))
  assert any(p.startswith('speclm/trees.py:') and 'too_long has 81 lines' in p for p in sizes)
  assert any(p.startswith('speclm/adaptive.py:') and 'lines (at most' in p for p in sizes)
  private = private_access_violations(str(scratch))
  assert any('sampling_lib._secret' in p for p in private), private
  assert any('imports _hidden from speclm.sampling' in p for p in private), private
  assert size_violations(REPO) == [] and private_access_violations(REPO) == []


def test_every_module_has_a_layer():
  for module in modules(REPO):
    layer_of(module)


def test_the_check_fails_on_forbidden_imports(tmp_path):
  scratch = tmp_path / 'repo'
  shutil.copytree(os.path.join(REPO, 'speclm'), scratch / 'speclm',
                  ignore=shutil.ignore_patterns('__pycache__', 'assets'))

  def append(relative, text):
    with open(scratch / relative, 'a', encoding='utf-8') as f:
      f.write(text)
    with open(scratch / relative, encoding='utf-8') as f:
      return f.read().count('\n')

  gin_line = append('speclm/models/llama.py', '\nimport gin\n')
  up_line = append('speclm/checkpoints/t5x.py', '\nfrom speclm.run import job\n')
  model_line = append('speclm/decoding.py', '\nfrom speclm.models import llama\n')
  append('speclm/sampling.py', '\nfrom speclm import speculative\n')  # speculative imports it
  loop_line = append('speclm/analysis/theory.py', '\nfrom speclm import decoding\n')
  job_line = append('speclm/analysis/figures.py', '\nfrom speclm.run import job\n')
  found = violations(str(scratch))
  assert any(p.startswith(f'speclm/models/llama.py:{gin_line}: imports gin') for p in found)
  assert any(p.startswith(f'speclm/checkpoints/t5x.py:{up_line}: speclm.checkpoints.t5x'
                          ' (checkpoints) imports speclm.run.job (job)') for p in found)
  assert any(p.startswith(f'speclm/decoding.py:{model_line}: speclm.decoding imports'
                          ' speclm.models.llama') for p in found)
  assert any('import cycle:' in p and 'speclm.sampling' in p and 'speclm.speculative' in p
             for p in found), found
  assert any(p.startswith(f'speclm/analysis/theory.py:{loop_line}: speclm.analysis.theory'
                          ' imports speclm.decoding; the analysis package') for p in found)
  assert any(p.startswith(f'speclm/analysis/figures.py:{job_line}:') and 'never runs' in p
             for p in found), found
  assert violations(REPO) == []  # the original is untouched


@pytest.mark.parametrize('module', ['speclm.models.t5', 'speclm.models.llama',
                                    'speclm.checkpoints.t5x', 'speclm.decoding'])
def test_lower_layers_import_without_gin(module):
  # Loaded in a fresh interpreter: nothing below the presets layer pulls gin in.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = (f'import sys, {module}; bad = [m for m in sys.modules if m == "gin" or'
          ' m.startswith("speclm.run") or m.startswith("speclm.presets")]; print(bad)')
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''),
             JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().splitlines()[-1] == '[]'
