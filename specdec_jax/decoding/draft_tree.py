"""The draft tree of :func:`~specdec_jax.decoding.tree_speculative_generate` and its parts.

Its static shape (:class:`DraftTree`) and checks, the candidates drafted after a node
(:func:`tree_candidates`), and a model's tree functions (:class:`TreeFns`); the loop itself is
in :mod:`specdec_jax.decoding.tree`, which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.sampling import sample_index
from specdec_jax._logits.adjust import adjusted_row
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.adjust import row_edits
from specdec_jax._logits.process import process_unchecked
from specdec_jax._logits.transform import process_row
from specdec_jax.decoding.args import model_fns
from specdec_jax.decoding.common import uniform
from specdec_jax.decoding.request_rows import row_bitmask
from specdec_jax.decoding.request_rows import split_history
from specdec_jax.models.protocol import Model


class DraftTree(NamedTuple):
  """The static shape of a draft tree: for each node, its parent and which candidate it is.

  Node 0 is the root (the last accepted token). Node ``c >= 1`` holds the
  ``ranks[c]``-th candidate for the position after its parent ``parents[c]``: under
  the ``"deterministic"`` law the ``(ranks[c] + 1)``-th most likely token of the
  draft model (a top-k tree, as in EAGLE-2), under ``"iid"`` the ``ranks[c]``-th of
  independent samples from the draft's distribution (SpecInfer). Nodes are in
  breadth-first order (depths never decrease) and the children of a node carry the
  ranks ``0, 1, 2, ...`` in index order. Build one with :meth:`from_paths` or
  :meth:`from_branching`; the tuples make it hashable (a static argument).

  Attributes:
    parents: ``(N,)`` ints, ``parents[0] == -1``, ``0 <= parents[c] < c``.
    ranks: ``(N,)`` ints, ``ranks[0] == 0``.

  Example:
    >>> tree = DraftTree.from_branching((2, 1))
    >>> tree.parents, tree.ranks, tree.depth
    ((-1, 0, 0, 1, 2), (0, 0, 1, 0, 0), 2)
    >>> DraftTree.from_paths([(0,), (1,), (0, 0)]).parents
    (-1, 0, 0, 1)
  """

  parents: tuple[int, ...]
  ranks: tuple[int, ...]

  @classmethod
  def from_paths(cls, paths) -> DraftTree:
    """A tree from the rank paths of its non-root nodes (Medusa's and EAGLE's "choices").

    ``(0, 1)`` is the second candidate after the first candidate. Every prefix of a
    path must be a path too, and a node's children must use the ranks ``0 .. k - 1``.
    """
    paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks = [-1], [0]
    for path in paths:
      if not path or min(path) < 0:
        raise ValueError(f"DraftTree.from_paths: paths must be non-empty tuples of ranks >= 0, "
                         f"got {path!r}.")
      if path[:-1] not in index:
        raise ValueError(f"DraftTree.from_paths: the prefix {path[:-1]!r} of {path!r} is missing.")
      if path[-1] > 0 and (*path[:-1], path[-1] - 1) not in index:
        raise ValueError(f"DraftTree.from_paths: {path!r} needs its sibling "
                         f"{(*path[:-1], path[-1] - 1)!r} (ranks 0 .. k - 1).")
      index[path] = len(parents)
      parents.append(index[path[:-1]])
      ranks.append(path[-1])
    return cls(tuple(parents), tuple(ranks))

  @classmethod
  def from_branching(cls, branching) -> DraftTree:
    """The full tree with ``branching[d]`` children per node at depth ``d``.

    ``(4, 2, 1)``: 4 candidates after the root, 2 after each of those, then 1 more
    each: ``1 + 4 + 8 + 8 = 21`` nodes, depth 3. ``(1,) * gamma`` is a chain.
    """
    branching = tuple(int(b) for b in branching)
    if any(b < 1 for b in branching):
      raise ValueError(f"DraftTree.from_branching: expected counts >= 1, got {branching}.")
    level, paths = [()], []
    for width in branching:
      level = [(*p, r) for p in level for r in range(width)]
      paths.extend(level)
    return cls.from_paths(paths)

  @property
  def size(self) -> int:
    """``N``, the number of nodes, root included."""
    return len(self.parents)

  @property
  def depth(self) -> int:
    """The most draft tokens one iteration can accept."""
    return int(self.depths().max())

  def depths(self) -> np.ndarray:
    """int32 ``(N,)``: the depth of each node (the root has depth 0)."""
    depths = np.zeros(self.size, np.int32)
    for c in range(1, self.size):
      depths[c] = depths[self.parents[c]] + 1
    return depths

  def paths(self) -> np.ndarray:
    """int32 ``(N, max(depth, 1))``: row ``c`` lists the nodes from the root (excluded) to
    ``c`` (included), root side first, then ``-1``."""
    table = np.full((self.size, max(self.depth, 1)), -1, np.int32)
    for c in range(1, self.size):
      chain, v = [], c
      while v > 0:
        chain.append(v)
        v = self.parents[v]
      table[c, :len(chain)] = chain[::-1]
    return table

  def ancestors(self) -> np.ndarray:
    """bool ``(N, N)``: ``[c, j]`` is True when ``j`` is ``c`` or one of its ancestors."""
    mask = np.eye(self.size, dtype=bool)
    for c in range(1, self.size):
      mask[c] |= mask[self.parents[c]]
    return mask


class TreeFns(NamedTuple):
  """A model's static functions including the tree ones (hashable)."""

  apply: Callable[..., Any]
  init_cache: Callable[[int, int], Any]
  vocab_size: int
  tree_apply: Callable[..., Any]
  copy_slots: Callable[..., Any]
  apply_features: Callable[..., Any] | None = None
  tree_apply_features: Callable[..., Any] | None = None
  label: str = "the model"  # "tree_speculative_generate: `target`"


def check_draft_tree(tree: DraftTree, name: str) -> DraftTree:
  if not isinstance(tree, DraftTree):
    raise TypeError(f"{name}: `tree` must be a DraftTree, got {type(tree).__name__} instead.")
  parents = tuple(int(x) for x in tree.parents)
  ranks = tuple(int(x) for x in tree.ranks)
  if len(parents) != len(ranks) or not parents or parents[0] != -1 or ranks[0] != 0:
    raise ValueError(f"{name}: `tree` needs parents and ranks of equal length N >= 1 with "
                     f"parents[0] = -1 and ranks[0] = 0, got {tree!r}.")
  tree = DraftTree(parents, ranks)
  depths = [0] * len(parents)
  children: dict[int, int] = {}
  for c in range(1, len(parents)):
    if not 0 <= parents[c] < c:
      raise ValueError(f"{name}: `tree.parents[{c}]` must be in [0, {c}), got {parents[c]}.")
    depths[c] = depths[parents[c]] + 1
    if depths[c] < depths[c - 1]:
      raise ValueError(f"{name}: `tree` nodes must be in breadth-first order; node {c} has depth "
                       f"{depths[c]} after a node of depth {depths[c - 1]}.")
    expected = children.get(parents[c], 0)
    if ranks[c] != expected:
      raise ValueError(f"{name}: `tree.ranks[{c}]` must be {expected} (the children of node "
                       f"{parents[c]} take ranks 0, 1, ... in order), got {ranks[c]}.")
    children[parents[c]] = expected + 1
  return tree


def tree_candidates(logits, key, params, width: int, law: str, vocab_ids=None, vocab=None,
                    history=None, prefix=None, prefix_len=None, bitmask=None):
  """``width`` candidate tokens after one node and the law they follow: ``(ids (width,), q (V,))``.

  ``"deterministic"``: the top-``width`` tokens of the draft's raw logits (ties to the
  lower id), whatever ``params``; ``"iid"``: ``width`` independent inverse-CDF samples
  from the draft's processed distribution. With ``vocab_ids (K,)`` the logits are over that
  subset of the ``vocab`` ids (a :class:`~specdec_jax.decoding.FeatureDraft`): the candidates
  are mapped to their ids and ``q`` is zero elsewhere.

  When ``params`` adjust the logits (penalties, bias, bans, allowed ids), the node's row is
  adjusted as the target's row at that node is: after the request's ``history`` (one
  request's :class:`~specdec_jax.History`) and the path's tokens ``prefix[:prefix_len]``
  (``(D,)``; the node's own token last); the deterministic candidates are then the top of the
  *adjusted* logits, and ``q`` is processed from them over the whole vocabulary (a subset's
  other ids ``-inf``). ``bitmask`` ``(W,)``: the node's grammar mask (the row's state after
  the path), or None.
  """
  if not needs_edits(params, bitmask):
    q = process_unchecked(logits, params)
    if law == "deterministic":
      ids = lax.top_k(logits, width)[1].astype(jnp.int32)
    else:
      u = uniform(key, (width,))
      ids = jax.vmap(sample_index, in_axes=(None, 0))(q, u)
    if vocab_ids is None:
      return ids, q
    return vocab_ids[ids], jnp.zeros((vocab,), q.dtype).at[vocab_ids].set(q)
  x = logits.astype(compute_dtype(logits.dtype))
  if vocab_ids is not None:  # the subset's logits in their target columns
    x = jnp.full((vocab,), -jnp.inf, x.dtype).at[vocab_ids].set(x)
  if prefix is None:
    prefix, prefix_len = jnp.full((0,), -1, jnp.int32), jnp.int32(0)
  edits = row_edits(x, params, history, prefix, prefix_len, bitmask)
  q = process_row(x, params, None, edits)
  if law == "deterministic":
    ids = lax.top_k(adjusted_row(x, edits), width)[1].astype(jnp.int32)
  else:
    ids = jax.vmap(sample_index, in_axes=(None, 0))(q, uniform(key, (width,)))
  return ids, q


def node_bitmask(history, prefix, prefix_len):
  """int32 ``(B, n, W)``: the grammar bitmask of ``(B, n)`` tree nodes, each row's state after
  the node's path ``prefix`` ``(B, n, D)`` (``prefix_len`` ``(B, n)``); None without a
  grammar (``history`` not a :class:`~specdec_jax.decoding.request_rows.Constrained`)."""
  if split_history(history)[1] is None:
    return None
  batch, n = prefix.shape[:2]
  owners = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), n)
  return row_bitmask(history, owners, prefix.reshape(batch * n, -1),
                     prefix_len.reshape(-1)).reshape(batch, n, -1)


def tree_model_fns(model: Model, name: str, arg: str) -> TreeFns:
  fns = model_fns(model, name, arg)
  if model.tree_apply is None or model.copy_slots is None:
    raise ValueError(
      f"{name}: `{arg}` must provide `tree_apply` and `copy_slots` (tree attention; see "
      f"specdec_jax.models.protocol), got a Model named {model.name!r} without them."
    )
  return TreeFns(fns.apply, fns.init_cache, fns.vocab_size, model.tree_apply, model.copy_slots,
                 model.apply_features, model.tree_apply_features, fns.label)
