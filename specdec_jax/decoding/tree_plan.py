"""A draft tree sized to the machine: the shape that maximises expected tokens per unit of time.

A top-k draft tree (the ``"deterministic"`` law of
:func:`~specdec_jax.decoding.tree_speculative_generate`) accepts at each depth at most one of
a node's candidates. Under that law, with point-mass candidates, the ``r``-th candidate after
an accepted node is the token kept there with probability ``p(c_r)``: the target's probability
of that candidate (each rejection removes the candidate from the target's residual, and the
next one is accepted with its renormalised probability). Averaged over contexts this is an
acceptance table ``a[d, r]``: the probability that the rank-``r`` candidate at depth ``d`` is
the accepted token, given its parent was accepted. A node is then reached with the product of
``a`` along its path, and an iteration with tree ``T`` emits on average

  ``E(T) = 1 + sum over the nodes of T of prod_{(d, r) on the path} a[d, r]``

tokens. It costs ``C(T) = call[n] + fixed + depth * draft`` where ``call[n]`` is the target's
call on the root and ``n`` nodes, measured on the machine (the cost curve), and ``draft`` one
level of drafting. :func:`plan_tree` returns the tree with the largest ``E / C``: for each
depth bound and size ``n``, the ``n`` nodes of largest path probability within the bound (the
best ``E`` of any such tree when ``a[d, r]`` does not grow with ``r``; a node's path
probability never exceeds its parent's, so they always form a tree), chains included; the
plan is "no tree" when plain decoding (``call[0]``, one token per call) is faster. Where a call
on more tokens is cheap the tree grows wide; where it is expensive it shrinks to a chain or
nothing, so in expectation it never loses to the chain it could have been.

This sizes one static tree from measured averages, as Sequoia (Chen et al., "Sequoia:
Scalable, Robust, and Hardware-aware Speculative Decoding", arXiv:2402.12374) sizes its tree
from a hardware cost curve; EAGLE-2 (Li et al., arXiv:2406.16858) grows the tree by the
draft's confidence in each iteration instead. The tree is a :class:`DraftTree`, so the loop's
exactness does not depend on how it was chosen.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from specdec_jax.decoding.draft_tree import DraftTree


class TreePlan(NamedTuple):
  """The result of :func:`plan_tree`.

  Attributes:
    tree: the chosen :class:`DraftTree`, or None when plain decoding is expected to be faster.
    expected_tokens: ``E``, tokens per target call the plan expects (1.0 without a tree).
    cost: ``C``, the cost of one iteration in the units of ``call_cost`` (``call_cost[0]``
      without a tree).
    speedup: ``(E / C) / (1 / call_cost[0])``: the expected speed-up over plain decoding.
    curve: ``((nodes, E, C), ...)``: the best tree of each size (largest ``E / C``), by size
      (size 0 is plain decoding), for plots and reports.
  """

  tree: DraftTree | None
  expected_tokens: float
  cost: float
  speedup: float
  curve: tuple[tuple[int, float, float], ...]


def _check(acceptance, call_cost, draft_cost, fixed_cost) -> tuple[np.ndarray, np.ndarray]:
  name = "plan_tree"
  a = np.asarray(acceptance, np.float64)
  if a.ndim != 2 or a.size == 0:
    raise ValueError(f"{name}: `acceptance` must be a non-empty (depth, ranks) array, got shape "
                     f"{a.shape} instead.")
  if not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 1:
    raise ValueError(f"{name}: `acceptance` entries must be probabilities in [0, 1], got values "
                     f"in [{np.nanmin(a):g}, {np.nanmax(a):g}] (or non-finite) instead.")
  if np.any(a.sum(axis=1) > 1 + 1e-6):
    d = int(np.argmax(a.sum(axis=1)))
    raise ValueError(f"{name}: `acceptance[{d}]` must sum to at most 1 (at most one candidate "
                     f"is accepted per depth), got {a[d].sum():g} instead.")
  c = np.asarray(call_cost, np.float64)
  if c.ndim != 1 or c.size < 1 or not np.all(np.isfinite(c)) or c.min() <= 0:
    raise ValueError(f"{name}: `call_cost` must be a non-empty 1-D array of positive finite "
                     f"costs (index n: the target's call on 1 + n tokens), got {c!r} instead.")
  for label, value in (("draft_cost", draft_cost), ("fixed_cost", fixed_cost)):
    if not (isinstance(value, (int, float, np.floating, np.integer)) and np.isfinite(value)
            and value >= 0):
      raise ValueError(f"{name}: `{label}` must be a finite number >= 0, got {value!r} instead.")
  return a, c


def plan_tree(acceptance, call_cost, *, draft_cost: float = 0.0,
              fixed_cost: float = 0.0) -> TreePlan:
  """The draft tree with the most expected tokens per unit of cost (see the module docstring).

  Args:
    acceptance: ``(D, R)``: ``[d, r]`` the probability that the rank-``r`` candidate at depth
      ``d`` is accepted given its parent was (rows sum to at most 1). ``D`` bounds the depth,
      ``R`` the candidates per node.
    call_cost: ``(M + 1,)``: ``[n]`` the cost of an iteration's target call on the root and
      ``n`` draft nodes, verification included; ``[0]`` is a plain decoding step. ``M``
      bounds the number of nodes.
    draft_cost: the cost of drafting one level of the tree (one draft call).
    fixed_cost: what speculating adds per iteration beyond those (the draft's first call).

  Returns:
    A :class:`TreePlan`.

  Example:
    >>> acc = [[0.6, 0.15, 0.05], [0.5, 0.1, 0.0]]
    >>> plan_tree(acc, [1.0, 1.02, 1.04, 1.06, 1.08, 1.10]).tree.parents  # cheap calls: wide
    (-1, 0, 0, 1, 1, 2)
    >>> plan_tree(acc, [1.0, 1.1, 1.3, 1.6]).tree.parents  # each token costs: a chain
    (-1, 0, 1)
    >>> print(plan_tree(acc, [1.0, 2.0, 3.0]).tree)  # a call on 2 tokens costs 2 steps
    None
  """
  a, call = _check(acceptance, call_cost, draft_cost, fixed_cost)
  plain = call[0]
  best = (1.0 / plain, 1.0, plain, None)  # (E / C, E, C, paths); None: plain decoding
  curve = {0: (1.0, plain)}
  # For each depth bound, the trees of largest E of each size within it: the best tree of depth
  # d is among those of bound d, so the best over the bounds is the best tree (draft levels
  # priced by the tree's own depth).
  for bound in range(1, a.shape[0] + 1):
    for paths, expected, depth in _grown(a[:bound], call.size - 1):
      c = call[len(paths)] + fixed_cost + depth * draft_cost
      if expected / c > best[0]:
        best = (expected / c, expected, c, list(paths))
      seen = curve.get(len(paths))
      if seen is None or expected / c > seen[0] / seen[1]:
        curve[len(paths)] = (expected, c)
  ratio, e, c, chosen = best
  tree = None if chosen is None else DraftTree.from_paths(chosen)
  return TreePlan(tree, float(e), float(c), float(ratio * plain),
                  tuple((n, float(v[0]), float(v[1])) for n, v in sorted(curve.items())))


def _grown(a: np.ndarray, max_nodes: int):
  """``(paths, E, depth)`` after each node of a tree grown by largest path probability within
  ``a``'s depth (ties: breadth first, lower rank first): the ``n`` nodes of largest path
  probability, for ``n = 1 .. max_nodes``. A popped node makes its first child and its next
  sibling candidates; ``paths`` is the same list, growing."""
  depth, ranks = a.shape
  frontier = [(-a[0, 0], (0,), 1.0)]  # (-path probability, path, parent's path probability)
  paths: list[tuple[int, ...]] = []
  expected, tree_depth = 1.0, 0
  while frontier and len(paths) < max_nodes:
    neg, path, parent = heapq.heappop(frontier)
    paths.append(path)
    expected -= neg
    tree_depth = max(tree_depth, len(path))
    if len(path) < depth:
      heapq.heappush(frontier, (neg * a[len(path), 0], (*path, 0), -neg))
    if path[-1] + 1 < ranks:
      heapq.heappush(frontier, (-parent * a[len(path) - 1, path[-1] + 1],
                                (*path[:-1], path[-1] + 1), parent))
    yield paths, expected, tree_depth


def tree_expected_tokens(tree: DraftTree, acceptance) -> float:
  """``E(T)``: the tokens per target call a :class:`DraftTree` emits on average under the
  acceptance table of :func:`plan_tree` (``(D, R)``, deeper or wider nodes than it covers are
  never accepted).

  Example:
    >>> tree_expected_tokens(DraftTree.from_branching((2, 1)), [[0.5, 0.2], [0.5, 0.1]])
    2.05
  """
  a = np.asarray(acceptance, np.float64)
  reach = np.ones(tree.size)
  for c in range(1, tree.size):
    d, r = int(tree.depths()[c]) - 1, tree.ranks[c]
    inside = d < a.shape[0] and r < a.shape[1]
    reach[c] = reach[tree.parents[c]] * (a[d, r] if inside else 0.0)
  return float(round(reach.sum(), 12))


__all__ = ["TreePlan", "plan_tree", "tree_expected_tokens"]
