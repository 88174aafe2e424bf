"""Token trees: shapes of the candidates a draft proposes, and their attention layout.

A token tree verifies several candidates per position in one target call (SpecInfer, Medusa,
EAGLE-2, Sequoia). Node 0 is the root, the newest committed token (the chain's s_{C−1});
every other node k holds a drafted candidate whose parent `parents[k] < k` is the token it
continues. A node's *rank* is its index among its siblings (0 = the draft's first choice);
its *depth* is the number of edges from the root. Nodes are stored in topological order,
which every shape below keeps: parents before children, siblings by rank.

A chain of γ drafts (Algorithm 1) is the tree in which every node has one child.

Shapes:
  * `TreeShape` — static: the same tree every round, given as Medusa-style rank paths
    (`(0,), (1,), (0, 0)` = the first two candidates after the root and the first
    candidate after the first), or as a branching factor per depth. Hashable (it is a static
    argument of the compiled loop).
  * `DynamicTree` — EAGLE-2: per row and round, expand the nodes whose draft path probability
    is highest, then keep the `num_nodes` best nodes of everything drafted.

`TreeLayout` is the array form a model's `extend_tree` reads: per row, each node's depth and
its ancestor-or-self mask (a node attends to the committed prefix and to its ancestors).

Shape letters: B batch, K nodes, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class TreeLayout:
  """A token tree as arrays, per row (a model's `extend_tree` reads it).

  Attributes:
    parents: `[B, K]` int32, each node's parent index; -1 for a root.
    depths: `[B, K]` int32, edges from the node's root (a root has depth 0); node k sits at
      position `length + depths[k]` of its row's sequence.
    ancestors: `[B, K, K]` bool, `ancestors[b, i, j]`: node j is node i or one of its
      ancestors, i.e. node i may attend to node j.
  """

  parents: jax.Array
  depths: jax.Array
  ancestors: jax.Array

  @property
  def num_nodes(self) -> int:
    """K, the nodes of the tree (static)."""
    return self.parents.shape[1]


def layout(parents) -> TreeLayout:
  """The `TreeLayout` of parent indices `[B, K]` (or `[K]`, broadcast to batch 1), in
  topological order (`parents[k] < k`, -1 for roots). Works under `jax.jit`."""
  parents = jnp.asarray(parents, jnp.int32)
  if parents.ndim == 1:
    parents = parents[None]
  num_nodes = parents.shape[1]
  # Each node's parent as a one-hot row; -1 (a root) has none.
  step = jax.nn.one_hot(parents, num_nodes, dtype=jnp.int32)  # [B, K, K]
  reach = jnp.broadcast_to(jnp.eye(num_nodes, dtype=jnp.int32), step.shape)
  frontier = reach
  depths = jnp.zeros(parents.shape, jnp.int32)
  for _ in range(num_nodes - 1):  # a path has at most K−1 edges
    frontier = jnp.einsum('bij,bjk->bik', frontier, step)  # the ancestor one level further up
    depths = depths + jnp.sum(frontier, axis=-1)
    reach = reach | frontier
  return TreeLayout(parents=parents, depths=depths, ancestors=reach.astype(bool))


def sibling_ranks(parents: jax.Array) -> jax.Array:
  """`[B, K]` each node's index among its siblings (earlier nodes with the same parent)."""
  same = parents[:, None, :] == parents[:, :, None]  # [B, K(node), K(other)]
  earlier = jnp.arange(parents.shape[1])[None, :] < jnp.arange(parents.shape[1])[:, None]
  return jnp.sum(same & earlier[None], axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TreeShape:
  """A static token tree: the same shape every round.

  `parents[k]` is node k's parent (`parents[0]` = -1, the root). Candidates are chosen per
  node by rank: a node of rank r holds the draft's (r+1)-th choice after its parent
  (`candidates='top_k'`), or the (r+1)-th draw without replacement from the draft's q̃
  (`candidates='sample'`, at temperature > 0). Build one with `chain`, `from_paths` or
  `from_branching`.
  """

  parents: tuple[int, ...]
  candidates: str = 'top_k'

  def __post_init__(self):
    parents = tuple(int(p) for p in self.parents)
    object.__setattr__(self, 'parents', parents)
    if len(parents) < 2 or parents[0] != -1:
      raise ValueError(f'A tree needs a root (parent -1) and at least one drafted node, got'
                       f' parents {parents}.')
    for k, p in enumerate(parents[1:], start=1):
      if not 0 <= p < k:
        raise ValueError(f'Node {k} has parent {p}; parents must come first (0 <= parent <'
                         f' node), got {parents}.')
    if list(parents[1:]) != sorted(parents[1:]):
      raise ValueError('Nodes must be in breadth-first order (siblings together, parents in'
                       f' order), got parents {parents}; build trees with from_paths.')
    if self.candidates not in CANDIDATE_RULES:
      raise ValueError(f'candidates must be one of {CANDIDATE_RULES}, got {self.candidates!r}.')

  @classmethod
  def chain(cls, gamma: int, candidates: str = 'top_k') -> 'TreeShape':
    """γ nodes in a line: Algorithm 1's chain."""
    if gamma < 1:
      raise ValueError(f'A chain needs gamma >= 1, got {gamma}.')
    return cls(tuple(range(-1, gamma)), candidates)

  @classmethod
  def from_paths(cls, paths: Sequence[Sequence[int]], candidates: str = 'top_k') -> 'TreeShape':
    """A tree from rank paths (Medusa's format): `(1, 0)` is the first choice after the
    root's second choice. Every prefix of a path must be a path as well."""
    paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    if not paths or any(len(p) == 0 for p in paths):
      raise ValueError('paths must be non-empty rank tuples, e.g. [(0,), (1,), (0, 0)].')
    index = {(): 0}
    parents = [-1]
    for path in paths:
      if path[:-1] not in index:
        raise ValueError(f'Path {path} has no parent path {path[:-1]} in the tree.')
      if any(r < 0 for r in path):
        raise ValueError(f'Ranks must be >= 0, got path {path}.')
      index[path] = len(parents)
      parents.append(index[path[:-1]])
    siblings = {}
    for path in paths:
      siblings.setdefault(path[:-1], []).append(path[-1])
    for parent, ranks in siblings.items():
      if sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f'The children of {parent or "the root"} must have ranks 0, 1, …'
                         f' without gaps, got {sorted(ranks)}.')
    return cls(tuple(parents), candidates)

  @classmethod
  def from_branching(cls, branching: Sequence[int], candidates: str = 'top_k') -> 'TreeShape':
    """Every node at depth d gets `branching[d]` children (Medusa-style top-k per depth):
    `(2, 2, 1)` has 2 + 4 + 4 = 10 drafted nodes."""
    if not branching or any(int(b) < 1 for b in branching):
      raise ValueError(f'branching must be positive integers, got {branching}.')
    paths, level = [], [()]
    for width in branching:
      level = [p + (r,) for p in level for r in range(int(width))]
      paths += level
    return cls.from_paths(paths, candidates)

  @property
  def num_nodes(self) -> int:
    """Drafted nodes (the root not included): the chain's γ."""
    return len(self.parents) - 1

  @property
  def depths(self) -> tuple[int, ...]:
    """Each node's depth, the root's 0 (as many entries as `parents`)."""
    depths = [0]
    for p in self.parents[1:]:
      depths.append(depths[p] + 1)
    return tuple(depths)

  @property
  def depth(self) -> int:
    """The longest path in edges: the most drafts one round can accept."""
    return max(self.depths)

  @property
  def ranks(self) -> tuple[int, ...]:
    """Each node's rank among its siblings (0: its parent's first candidate), the root's 0."""
    ranks = [0]
    for k, p in enumerate(self.parents[1:], start=1):
      ranks.append(sum(1 for q in self.parents[1:k] if q == p))
    return tuple(ranks)

  @property
  def max_children(self) -> int:
    """The most children any node has."""
    return max(self.parents[1:].count(p) for p in set(self.parents[1:]))

  def level_sizes(self) -> tuple[int, ...]:
    """Nodes at depth 0, 1, …, depth (the root's level counts 1)."""
    depths = self.depths
    return tuple(depths.count(d) for d in range(self.depth + 1))

  def rank_paths(self) -> list[tuple[int, ...]]:
    """Each drafted node's rank path (the inverse of `from_paths`)."""
    paths = [()]
    for k, p in enumerate(self.parents[1:], start=1):
      paths.append(paths[p] + (self.ranks[k],))
    return paths[1:]

  def describe(self) -> str:
    """A one-line description for reports (nodes, depth, candidate rule)."""
    return (f'tree of {self.num_nodes} nodes, depth {self.depth}, candidates'
            f' {self.candidates}')


CANDIDATE_RULES = ('top_k', 'sample')


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2's dynamic tree: shaped per row and round by the draft's path probabilities.

  Each round: the root gets the draft's `top_k` first choices; at every further depth (up
  to `depth`) the `width` nodes of the previous depth with the highest path probability
  (the product of the draft's probabilities along the path) get `top_k` children each.
  Of everything drafted, the `num_nodes` nodes with the highest path probability are
  verified. A child's path probability never exceeds its parent's, so the kept nodes form a
  tree. The candidates are the draft's top choices (no sampling), so acceptance follows the
  deterministic-candidate rule, exact at every temperature.
  """

  num_nodes: int = 16
  depth: int = 5
  top_k: int = 4
  width: int = 4

  def __post_init__(self):
    for name in ('num_nodes', 'depth', 'top_k', 'width'):
      if int(getattr(self, name)) < 1:
        raise ValueError(f'DynamicTree.{name} must be >= 1, got {getattr(self, name)}.')
    if self.width > self.top_k:
      raise ValueError(f'width ({self.width}) cannot exceed top_k ({self.top_k}): a depth has'
                       f' at most top_k × width nodes to expand from.')
    if self.num_nodes > self.pool_size:
      raise ValueError(f'num_nodes ({self.num_nodes}) exceeds the nodes drafted per round'
                       f' ({self.pool_size} = top_k + (depth − 1) × width × top_k).')

  @property
  def pool_size(self) -> int:
    """Nodes drafted per round, before the best `num_nodes` are kept."""
    return self.top_k + (self.depth - 1) * self.width * self.top_k

  def describe(self) -> str:
    """A one-line description for reports (nodes, depth, top-k, width)."""
    return (f'dynamic tree of {self.num_nodes} nodes (depth {self.depth}, top-{self.top_k},'
            f' width {self.width})')


def draft_lookahead(tree: TreeShape | DynamicTree) -> int:
  """Cache positions the draft may write in one tree round after the C−2 it is rolled back
  to (s_{C−2}, the root s_{C−1}, then nodes). A static tree's draft reads at most its
  `num_nodes` + 2 tokens. A dynamic tree's draft extends everything drafted so far at each
  depth: in its last call, s_{C−2}, the root, the root's top_k children and width × top_k
  nodes for each of the depth − 2 levels after them — far more than `num_nodes` when the
  pool is large (EAGLE-2's 60 nodes of depth 6, top-10, width 10: 412 positions)."""
  if isinstance(tree, TreeShape):
    return tree.num_nodes + 2
  if tree.depth == 1:
    return 2
  return 2 + tree.top_k + (tree.depth - 2) * tree.width * tree.top_k


def check_tree(tree) -> TreeShape | DynamicTree:
  """The tree as given, or ValueError naming what a tree can be."""
  if not isinstance(tree, (TreeShape, DynamicTree)):
    raise ValueError('tree must be a speclm.token_trees.TreeShape (static) or DynamicTree'
                     f' (EAGLE-2), got {tree!r}.')
  return tree

