"""Every import points down the layers WORKSPACE.md draws; gin stays at the edges; no cycles.

The imports are read from the source (ast, nothing is executed), function-level imports
included. A test shows the check fails, naming file and line, on a scratch copy with forbidden
imports added.
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
    ('job', ('speclm.run', 'speclm.analysis.__main__', 'speclm.example')),
)
# Layers below this one never import gin.
FIRST_GIN_LAYER = 'presets'
# The algorithms see models only through the protocol.
ALGORITHMS = ('speclm.speculative', 'speclm.decoding', 'speclm.decode_common',
              'speclm.adaptive', 'speclm.tree_decoding')


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
  problems += [f'import cycle: {" -> ".join(cycle)}' for cycle in _cycles(graph)]
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
  found = violations(str(scratch))
  assert any(p.startswith(f'speclm/models/llama.py:{gin_line}: imports gin') for p in found)
  assert any(p.startswith(f'speclm/checkpoints/t5x.py:{up_line}: speclm.checkpoints.t5x'
                          ' (checkpoints) imports speclm.run.job (job)') for p in found)
  assert any(p.startswith(f'speclm/decoding.py:{model_line}: speclm.decoding imports'
                          ' speclm.models.llama') for p in found)
  assert any('import cycle:' in p and 'speclm.sampling' in p and 'speclm.speculative' in p
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
