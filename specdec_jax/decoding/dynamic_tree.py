"""EAGLE-2's dynamic draft tree: expand the most confident nodes, verify the most confident.

:class:`DynamicTree` is the static budget (``top_k`` candidates per expanded node, ``depth``
levels, ``num_draft`` tokens scored by the target); :func:`draft_dynamic_tree` builds one
tree per row and iteration from the draft's own confidences, with static shapes:

1. **Expansion.** The candidates after the root are the draft's top ``k`` tokens. At each
   level ``d < depth``, the ``k`` candidates of that level with the highest *path confidence*
   (the product of the draft's probabilities along the path, kept as a sum of logs) are fed
   to the draft in one tree-attention call; each gives its top ``k`` children, so a level
   after the first holds ``k * k`` candidates and the draft runs ``k`` tokens per call.
2. **Reranking.** Of all ``k + (depth - 1) k^2`` candidates, the ``num_draft`` with the
   highest path confidence become the tree the target scores, in breadth-first order. A
   child's confidence never exceeds its parent's, and ties go to the lower index (the parent
   comes first), so the chosen set is closed under parents: it is a tree.

The tree is a function of the draft alone, and siblings are distinct tokens (a top-``k``), so
the point-mass rule (:func:`~specdec_jax.tree_verify`, ``law="deterministic"``) keeps the
output distributed exactly as the target's, as for any static top-k tree.

Reference:
  Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
  arXiv:2406.16858 (Sec. 4: expansion and reranking).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.process import process_unchecked
from specdec_jax.decoding.request_rows import adjusted
from specdec_jax.decoding.request_rows import processed


class DynamicTree(NamedTuple):
  """The static budget of EAGLE-2's dynamic draft tree (hashable: a static argument).

  Pass it as ``tree=`` to :func:`~specdec_jax.decoding.tree_speculative_generate` with a
  :class:`~specdec_jax.decoding.FeatureDraft` and ``law="deterministic"``; the target's
  ``tree_apply_features`` then gets one tree mask per row, ``(B, N, N)``.

  Attributes:
    top_k: candidates per expanded node, and nodes expanded per level (EAGLE-2's ``top_k``).
    depth: levels drafted; the most draft tokens one iteration can accept.
    num_draft: draft tokens the target scores per iteration (EAGLE-2's ``total_tokens``),
      at most ``top_k + (depth - 1) * top_k ** 2``.

  Example:
    >>> tree = DynamicTree(top_k=4, depth=3, num_draft=8)
    >>> tree.size, tree.num_candidates, tree.num_fed
    (9, 36, 9)

  Reference:
    Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
    arXiv:2406.16858.
  """

  top_k: int
  depth: int
  num_draft: int

  @property
  def size(self) -> int:
    """``N``, the nodes the target scores, the root included."""
    return self.num_draft + 1

  @property
  def num_candidates(self) -> int:
    """Candidates drafted per iteration: ``k`` after the root, ``k * k`` per later level."""
    return self.top_k + (self.depth - 1) * self.top_k**2

  @property
  def num_fed(self) -> int:
    """Nodes the draft reads per iteration (its tree slots): the root and ``k`` per level."""
    return 1 + (self.depth - 1) * self.top_k

  def candidate_depths(self) -> np.ndarray:
    """int32 ``(num_candidates,)``: the depth of each candidate, level by level."""
    k = self.top_k
    return np.asarray([1] * k + [d for d in range(2, self.depth + 1) for _ in range(k * k)],
                      np.int32)


def check_dynamic_tree(tree: DynamicTree, name: str) -> DynamicTree:
  """``tree`` with int fields, or a ValueError naming the field."""
  fields = {f: getattr(tree, f) for f in DynamicTree._fields}
  for field, value in fields.items():
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
      raise ValueError(f"{name}: `tree.{field}` must be an int >= 1, got {value!r}.")
  tree = DynamicTree(*(int(v) for v in fields.values()))
  if tree.num_draft > tree.num_candidates:
    raise ValueError(f"{name}: `tree.num_draft` must be at most top_k + (depth - 1) * top_k^2 "
                     f"= {tree.num_candidates} (the candidates drafted), got {tree.num_draft}.")
  return tree


class DynamicDraft(NamedTuple):
  """One dynamic tree per row, ready for the target: all arrays ``(B, N)`` but ``mask``.

  Attributes:
    tokens: int32, node 0 the root, then the chosen candidates in breadth-first order.
    parents: int32, ``parents[:, 0] = -1``, ``0 <= parents[:, c] < c``.
    depths: int32, depths non-decreasing along each row.
    mask: bool ``(B, N, N)``, ``mask[b, c, j]``: ``j`` is ``c`` or one of its ancestors.
    q: float32 ``(B, N, V)``, the draft's processed distribution after each node (zero at a
      node it did not expand), or None when not asked for.
  """

  tokens: jax.Array
  parents: jax.Array
  depths: jax.Array
  mask: jax.Array
  q: jax.Array | None


def draft_dynamic_tree(tree: DynamicTree, level_call, root_token, root_logits, root_feature,
                       cache, root, *, vocab_ids, vocab: int, params=None,
                       need_q: bool = False, history=None):
  """Expand and rerank one dynamic tree per row (see the module docstring).

  Args:
    tree: static :class:`DynamicTree`.
    level_call: ``level_call(tokens (B, k), features (B, k, D), positions (B, k), cache,
      nodes (k,), mask (B, k, F)) -> (logits (B, k, K), features (B, k, D), cache)``: the
      draft's tree attention over its ``F = tree.num_fed`` slots after ``root``.
    root_token: int32 ``(B,)``, the last accepted token (node 0).
    root_logits: ``(B, K)``, the draft's logits after the root (over its vocabulary).
    root_feature: ``(B, D)``, the feature the draft predicted at the root.
    cache: the draft's cache.
    root: int32 ``(B,)``, the root's position and slot.
    vocab_ids: int32 ``(K,)``, the target ids of the draft's vocabulary.
    vocab: the target's vocabulary size ``V``.
    params: :class:`~specdec_jax.SamplingParams` batched ``(B,)``, for ``q`` only.
    need_q: also return the draft's processed distributions (a negative control's rule
      reads them; the point-mass rule does not).
    history: each row's :class:`~specdec_jax.History` (or None). When ``params`` adjust the
      logits (penalties, bias, bans, allowed ids), each expanded node's row is adjusted after
      the history and its path's tokens, as the target's row at that node is: its candidates
      and confidences come from the adjusted logits (over the whole vocabulary, a subset's
      other ids ``-inf``), and ``q`` is processed from them.

  Returns:
    ``(DynamicDraft, cache)``.
  """
  k, depth, fed = tree.top_k, tree.depth, tree.num_fed
  batch = root_logits.shape[0]
  rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
  edited = params is not None and needs_edits(params, None)  # static
  # The fed slots' tokens (slot 0: the root), for the paths the adjustments read.
  fed_tokens = jnp.zeros((batch, fed), jnp.int32).at[:, 0].set(root_token) if edited else None

  def widen(logits):
    """Draft-vocabulary logits ``(..., K)`` in their target columns ``(..., V)``, ``-inf``
    elsewhere (only when adjusting: the adjustments read target ids)."""
    out = jnp.full((*logits.shape[:-1], vocab), -jnp.inf, jnp.float32)
    return out.at[..., vocab_ids].set(logits.astype(jnp.float32))

  def top(logits, prefix=None, prefix_len=None):
    """The top ``k`` of each row (ties to the lower id) and their draft log-probabilities;
    adjusted after each row's history and ``prefix`` when ``params`` adjust."""
    if edited:
      logits = adjusted(widen(logits), params, history, prefix, prefix_len)
    ids = lax.top_k(logits, k)[1]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logp, ids, axis=-1)
    return (ids.astype(jnp.int32) if edited else vocab_ids[ids],
            jnp.where(jnp.isnan(logp), -jnp.inf, logp))

  fed_logits = jnp.zeros((batch, fed, root_logits.shape[-1]), jnp.float32)
  fed_logits = fed_logits.at[:, 0].set(root_logits)
  features = jnp.zeros((batch, fed, root_feature.shape[-1]), root_feature.dtype)
  features = features.at[:, 0].set(root_feature)
  ancestors = jnp.zeros((batch, fed, fed), bool).at[:, 0, 0].set(True)
  tokens, scores = top(root_logits)  # the first level's candidates
  level_tokens, level_scores = [tokens], [scores]
  level_parents = [jnp.full((batch, k), -1, jnp.int32)]  # candidate indices; -1: the root
  level_fed_parents = jnp.zeros((batch, k), jnp.int32)  # the draft slot of each's parent
  expanded = []  # (candidate indices (B, k), their draft slots (k,)) per level
  offset = 0  # the first candidate index of the current level
  for d in range(1, depth):
    chosen = lax.top_k(level_scores[-1], k)[1]  # the level's k most confident candidates
    slots = np.arange(1 + (d - 1) * k, 1 + d * k, dtype=np.int32)
    parent_slots = jnp.take_along_axis(level_fed_parents, chosen, axis=1)
    mask = ancestors[rows, parent_slots] | jax.nn.one_hot(slots, fed, dtype=bool)[None]
    ancestors = ancestors.at[:, slots].set(mask)
    chosen_tokens = jnp.take_along_axis(level_tokens[-1], chosen, axis=1)
    if edited:
      fed_tokens = fed_tokens.at[:, slots].set(chosen_tokens)
    logits, predicted, cache = level_call(
      chosen_tokens, features[rows, parent_slots],
      jnp.broadcast_to((root + d)[:, None], (batch, k)), cache, jnp.asarray(slots), mask)
    features = features.at[:, slots].set(predicted.astype(features.dtype))
    fed_logits = fed_logits.at[:, slots].set(logits.astype(jnp.float32))
    expanded.append((offset + chosen, slots))
    # (B, k, k): the children of each expanded node (after its path: `fed_prefix`)
    tokens, logp = top(logits, *((fed_prefix(mask, fed_tokens, k, depth)) if edited else ()))
    parent_scores = jnp.take_along_axis(level_scores[-1], chosen, axis=1)
    offset += level_scores[-1].shape[1]
    level_tokens.append(tokens.reshape(batch, k * k))
    level_scores.append((parent_scores[:, :, None] + logp).reshape(batch, k * k))
    level_parents.append(jnp.repeat(expanded[-1][0], k, axis=1))  # child (i, r) at i k + r
    level_fed_parents = jnp.broadcast_to(jnp.repeat(jnp.asarray(slots), k)[None], (batch, k * k))

  cand_tokens = jnp.concatenate(level_tokens, axis=1)  # (B, M), level by level
  cand_scores = jnp.concatenate(level_scores, axis=1)
  cand_parents = jnp.concatenate(level_parents, axis=1)
  cand_fed = jnp.full(cand_tokens.shape, -1, jnp.int32)
  for chosen, slots in expanded:
    cand_fed = cand_fed.at[rows, chosen].set(jnp.asarray(slots)[None])

  # Reranking: the num_draft most confident candidates, in candidate (breadth-first) order.
  chosen = jnp.sort(lax.top_k(cand_scores, tree.num_draft)[1], axis=1)
  position = jnp.zeros(cand_tokens.shape, jnp.int32).at[rows, chosen].set(
    jnp.arange(1, tree.num_draft + 1, dtype=jnp.int32)[None])
  parent = jnp.take_along_axis(cand_parents, chosen, axis=1)
  parent = jnp.where(parent < 0, 0, jnp.take_along_axis(position, jnp.maximum(parent, 0), axis=1))
  zero = jnp.zeros((batch, 1), jnp.int32)
  parents = jnp.concatenate([zero - 1, parent], axis=1)
  node_tokens = jnp.concatenate([jnp.asarray(root_token, jnp.int32)[:, None],
                                 jnp.take_along_axis(cand_tokens, chosen, axis=1)], axis=1)
  depths = jnp.concatenate([zero, jnp.asarray(tree.candidate_depths())[chosen]], axis=1)
  size = tree.size
  walk = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32)[None], (batch, size))
  step = jnp.maximum(parents, 0)
  mask = jnp.zeros((batch, size, size), bool)
  for _ in range(depth + 1):  # each node, then its parent, ..., up to the root
    mask = mask | jax.nn.one_hot(walk, size, dtype=bool)
    walk = jnp.take_along_axis(step, walk, axis=1)
  q = None
  if need_q:
    node_fed = jnp.concatenate([zero, jnp.take_along_axis(cand_fed, chosen, axis=1)], axis=1)
    if edited:  # each fed node's row after its path
      q_fed = processed(widen(fed_logits), params, history,
                        *fed_prefix(ancestors, fed_tokens, k, depth))
    else:
      q_fed = jax.vmap(jax.vmap(process_unchecked, in_axes=(0, None)))(fed_logits, params)
      q_fed = jnp.zeros((batch, fed, vocab), q_fed.dtype).at[:, :, vocab_ids].set(q_fed)
    q = jnp.where((node_fed >= 0)[..., None], q_fed[rows, jnp.maximum(node_fed, 0)], 0.0)
  return DynamicDraft(node_tokens, parents, depths, mask, q), cache


def fed_prefix(ancestors: jax.Array, fed_tokens: jax.Array, k: int,
               depth: int) -> tuple[jax.Array, jax.Array]:
  """``(prefix (B, n, depth), length (B, n))``: the path's tokens (root excluded, the node's
  own last) of ``n`` fed draft slots from their ancestor masks ``(B, n, F)`` over the ``F``
  fed slots, whose tokens are ``fed_tokens`` ``(B, F)``. A fed slot of level ``l >= 1`` is in
  block ``1 + (l - 1) k .. l k`` and has one ancestor (itself included) in each block up to
  its own, so the path is read block by block."""
  prefix = []
  for level in range(1, depth):
    block = slice(1 + (level - 1) * k, 1 + level * k)
    hit = ancestors[..., block]
    token = jnp.sum(jnp.where(hit, fed_tokens[:, None, block], 0), axis=-1)
    prefix.append(jnp.where(jnp.any(hit, axis=-1), token, -1))
  batch, n = ancestors.shape[:2]
  prefix += [jnp.full((batch, n), -1, jnp.int32)] * (depth - len(prefix))
  prefix = jnp.stack(prefix, axis=-1).astype(jnp.int32)
  return prefix, jnp.sum(prefix >= 0, axis=-1, dtype=jnp.int32)
