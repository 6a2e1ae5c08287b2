"""sglang's tree encoding: first-child / next-sibling links, turned into parents and checked.

:func:`~specdec_jax.packed_tree_verify` reads draft trees as sglang-jax writes them
(``retrive_next_token``, ``retrive_next_sibling``); :func:`parents_from_links` gives the tree
rule its parents and :func:`malformed_links` flags links the rule would walk in another order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def parents_from_links(first_child: jax.Array, next_sibling: jax.Array) -> jax.Array:
  """Parent indices ``(N,)`` of a tree given as first-child / next-sibling links (-1: none).

  The root (node 0) and nodes no link reaches get ``-1``. Traced-safe: links outside
  ``[0, N)`` are ignored (the node they would reach is then unreachable, and
  :func:`~specdec_jax.tree_verify` flags a real node without a valid parent).

  Example:
    >>> import jax.numpy as jnp
    >>> parents_from_links(jnp.array([1, 3, -1, -1]), jnp.array([-1, 2, -1, -1])).tolist()
    [-1, 0, 0, 1]
  """
  size = first_child.shape[0]
  nodes = jnp.arange(size, dtype=jnp.int32)

  def valid(link):
    return (link >= 0) & (link < size)

  parent = jnp.full((size,), -1, jnp.int32).at[jnp.where(valid(first_child), first_child, size)]
  parent = parent.set(nodes, mode="drop")
  previous = jnp.full((size,), -1, jnp.int32).at[jnp.where(valid(next_sibling), next_sibling,
                                                           size)].set(nodes, mode="drop")

  def follow(_, parent):  # a sibling has its previous sibling's parent
    inherited = jnp.where(previous >= 0, parent[jnp.maximum(previous, 0)], -1)
    return jnp.where(parent >= 0, parent, inherited)

  return lax.fori_loop(0, size, follow, parent).at[0].set(-1)


def malformed_links(first_child: jax.Array, next_sibling: jax.Array) -> jax.Array:
  """Whether one tree's links break the encoding :func:`packed_tree_verify` reads (traced bool).

  Well formed: every link is ``-1`` or a later node (``u < link < N``: children after their
  parent, siblings in increasing order, hence no cycle), no node is reached by two links, and
  the root has no sibling. Nodes no link reaches are flagged by the tree rule itself.

  Example:
    >>> import jax.numpy as jnp
    >>> bool(malformed_links(jnp.array([1, -1, -1]), jnp.array([-1, 2, -1])))
    False
    >>> bool(malformed_links(jnp.array([2, -1, -1]), jnp.array([-1, -1, 1])))  # 2 -> 1
    True
  """
  size = first_child.shape[0]
  nodes = jnp.arange(size, dtype=first_child.dtype)
  links = jnp.concatenate([first_child, next_sibling])
  out_of_order = (links != -1) & ((links <= jnp.tile(nodes, 2)) | (links >= size))
  reached = jnp.zeros((size,), jnp.int32).at[jnp.where(links >= 0, links, size)].add(
    1, mode="drop")
  return jnp.any(out_of_order) | jnp.any(reached > 1) | (next_sibling[0] != -1)


__all__ = ["malformed_links", "parents_from_links"]
