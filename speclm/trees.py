"""Nested parameter trees by name: flatten to '/'-joined names, unflatten, check shapes.

Parameter trees are nested mappings (dicts, Flax `FrozenDict`s, checkpoint metadata trees)
whose leaves are arrays, `jax.ShapeDtypeStruct`s or anything else. Checkpoint readers, the
models and the tests all speak of a parameter by its joined name:

    flatten({'encoder': {'layers_0': {'mlp': {'wo': {'kernel': x}}}}})
        == {'encoder/layers_0/mlp/wo/kernel': x}
    unflatten({'encoder/layers_0/mlp/wo/kernel': x}) == {'encoder': {'layers_0': …}}
    check_tree_shapes(definition.param_shapes(), params)   # ValueError naming the parameter

Foundations layer: numpy only (no models, no checkpoints, no gin).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np


def _is_node(node) -> bool:
  """Mappings, and mapping-like objects (anything with `.items()`), are inner nodes."""
  return isinstance(node, Mapping) or callable(getattr(node, 'items', None))


def flatten(tree, sep: str = '/', *,
            is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
  """A nested mapping as {'a/b/c': leaf}, in the tree's own order.

  Args:
    tree: nested mappings; everything that is not a mapping is a leaf. Empty mappings leave
      no entry.
    sep: joins the keys (each key is converted with `str`).
    is_leaf: `is_leaf(node)` True keeps a mapping whole as a leaf (e.g. a TensorStore spec in
      a T5X checkpoint).
  """
  out: dict[str, Any] = {}

  def walk(node, prefix: str) -> None:
    if _is_node(node) and not (is_leaf is not None and is_leaf(node)):
      for key, value in node.items():
        walk(value, f'{prefix}{sep}{key}' if prefix else str(key))
    else:
      out[prefix] = node

  walk(tree, '')
  return out


def unflatten(flat: Mapping[str, Any], sep: str = '/') -> dict:
  """{'a/b/c': x} -> {'a': {'b': {'c': x}}}: a nested dict from joined names."""
  tree: dict = {}
  for name, value in flat.items():
    node = tree
    *parents, leaf = name.split(sep)
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return tree


def _listed(names: list[str]) -> str:
  return f'{names[:5]}{" …" if len(names) > 5 else ""}'


def check_tree_shapes(expected, actual) -> None:
  """Raises ValueError unless `actual` has exactly `expected`'s names and shapes.

  `expected` holds arrays or `jax.ShapeDtypeStruct`s (e.g. `jax.eval_shape` of an init); the
  message names the first missing, unexpected or misshapen parameters by their joined names,
  e.g. `Parameter layers_1/mlp/up/kernel has shape (3, 3), the config expects (32, 64).`
  """
  flat_expected = flatten(expected)
  flat_actual = flatten(actual)
  missing = sorted(set(flat_expected) - set(flat_actual))
  extra = sorted(set(flat_actual) - set(flat_expected))
  if missing or extra:
    raise ValueError(f'Parameter tree mismatch: missing {_listed(missing)}, unexpected'
                     f' {_listed(extra)}.')
  for name, want in flat_expected.items():
    got = tuple(np.shape(flat_actual[name]))
    if got != tuple(want.shape):
      raise ValueError(f'Parameter {name} has shape {got}, the config expects'
                       f' {tuple(want.shape)}.')


__all__ = ['check_tree_shapes', 'flatten', 'unflatten']
