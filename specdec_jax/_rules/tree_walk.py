"""The tree walk of recursive rejection sampling, for one tree, over row sources.

The walk carries scalars and ``(N,)`` arrays only, never a ``(V,)`` row: at the current node
the residual is ``max(p - c q, 0)`` with a scalar ``c``, except for the tokens rejected there,
whose weights are kept in ``(N,)`` arrays. A child test gathers two entries; a rejection costs
one residual pass over the node's rows (:func:`~specdec_jax._rows.residual.residual_pass`) and the
final token one more.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._core.accept import accepts
from specdec_jax._core.errors import ErrorCode
from specdec_jax._core.errors import flag
from specdec_jax._core.errors import psum_if
from specdec_jax._core.errors import stop_row_error
from specdec_jax._core.errors import uniform_codes
from specdec_jax._core.errors import value_codes
from specdec_jax._core.sampling import BLOCK
from specdec_jax._core.sampling import mask_block
from specdec_jax._core.sampling import sample_blocks
from specdec_jax._core.sampling import sanitize
from specdec_jax._rows.batching import anchored
from specdec_jax._rows.batching import branch
from specdec_jax._rows.residual import clean_masses
from specdec_jax._rows.residual import residual_pass
from specdec_jax._rows.residual import weights
from specdec_jax._rows.sources import ArrayRows
from specdec_jax._rows.sources import shifted


class WalkEnd(NamedTuple):
  """What the walk found: the emitted tokens, the accepted nodes, counts and error bits."""

  tokens: jax.Array
  path: jax.Array
  num_accepted: jax.Array
  num_tests: jax.Array
  error: jax.Array


class Walk(NamedTuple):
  """Loop state of the tree walk: scalars and ``(N,)`` arrays only, no ``(V,)`` row.

  At the current node the residual's unnormalised weights are ``G(v) = max(p(v) - c q(v), 0)``
  for every token not rejected there (``G = p`` under ``"deterministic"``), and
  ``frozen[k]`` for the ``k``-th token rejected there (``removed[k]``); the residual is
  ``G / z``, or ``p`` as given while ``raw``. A rejection updates ``c`` and the frozen values
  from gathered scalars and needs one pass over the node's rows for the new mass ``z``.

  Attributes:
    node: the current node.
    prev: children of ``node`` with index ``<= prev`` have been tested.
    depth: accepted tokens so far.
    tests: child tests performed so far.
    done: the final token has been sampled.
    raw: no rejection at this node yet, or the residual emptied and fell back to ``p``.
    c: the coefficient of ``q`` in ``G`` (0 while ``raw``).
    z: the residual's total mass ``sum_v G(v)`` (1 while ``raw``).
    q_total: ``sum_v q(v)`` of the node (known after its first pass).
    removed: ``(N,)`` the in-range tokens rejected at this node (``-1`` past ``n_removed``).
    frozen: ``(N,)`` their residual weights ``G``.
    removed_p: ``(N,)`` their target probabilities (the weights after a fallback to ``p``).
    removed_q: ``(N,)`` their draft probabilities (taken out of ``q`` without replacement).
    n_removed: how many tokens were rejected at this node.
    coin: ``uniform_layout="per_parent"``: the node's coin, rescaled after each rejection.
    out: ``(L,)`` emitted tokens.
    path: ``(L,)`` accepted nodes.
    error: ``ErrorCode`` bits so far.
  """

  node: jax.Array
  prev: jax.Array
  depth: jax.Array
  tests: jax.Array
  done: jax.Array
  raw: jax.Array
  c: jax.Array
  z: jax.Array
  q_total: jax.Array
  removed: jax.Array
  frozen: jax.Array
  removed_p: jax.Array
  removed_q: jax.Array
  n_removed: jax.Array
  coin: jax.Array
  out: jax.Array
  path: jax.Array
  error: jax.Array


def tree_walk(readers, parents, safe_tokens, token_in_range, uniforms, is_node, offset=0, *,
              law: str, max_depth: int, pad_id: int, layout: str, local_vocab: int, dtype,
              tol: float, axis_name: str | None = None, final_coin: bool = False,
              looped: bool = True) -> WalkEnd:
  """The walk of :func:`~specdec_jax.tree_verify` for one tree, reading rows through ``readers``.

  The body of :func:`~specdec_jax._rows.batching.per_sequence`: on XLA:CPU each tree of a batch runs
  its own loop with real branches, so a pass over a node's rows happens only after a rejection
  (for the residual's new mass) and once at the end (for the final sample). With
  ``axis_name`` the rows hold this device's ``V / n`` columns and only scalars cross devices.
  With ``final_coin`` the uniforms hold ``N + 1`` entries and the final token reads the last
  (sglang's ``uniform_samples_for_final_sampling``) instead of the layout's coin.
  """
  p_rows = ArrayRows(shifted(readers[0], offset), local_vocab, axis_name)
  q_rows = ArrayRows(shifted(readers[-1], offset), local_vocab, axis_name)  # p again: no q
  size = parents.shape[0]
  length = max_depth + 1
  block = min(BLOCK, local_vocab)
  index = anchored(jnp.arange(size, dtype=jnp.int32), parents)  # typed like the inputs
  uses_q = law != "deterministic"
  zero, one = jnp.zeros((), dtype), jnp.ones((), dtype)

  def g_of(p_val, q_val, c):
    """``G = max(p - c q, 0)`` (``max(p, 0)`` without ``q``); NaN propagates."""
    return weights(p_val, q_val, dtype, c=c)

  def with_removed(values, ids, s: Walk):
    """The frozen weights in place of ``G`` for the tokens rejected at this node."""
    for k in range(size):
      values = jnp.where((ids == s.removed[k]) & (k < s.n_removed), s.frozen[k], values)
    return values

  def pass_over(s: Walk, c, read_q):
    """One fused read of the node's rows (:func:`~specdec_jax._rows.residual.residual_pass`): clean
    block masses of the weights, their total ``Z``, ``sum q`` and the rows' error bits.
    Negative entries are poisoned with ``-inf`` (NaN propagates), so a block holding one has no
    mass and the bits report it."""
    ids = p_rows.first_column() + jnp.arange(local_vocab, dtype=jnp.int32)
    q_row = q_rows.slice(s.node, 0, local_vocab) if read_q else None
    masses, p_masses, q_sum = residual_pass(
      p_rows.slice(s.node, 0, local_vocab), q_row, block=block, dtype=dtype,
      c=None if q_row is None else c, adjust=lambda values: with_removed(values, ids, s))
    p_sum = psum_if(jnp.sum(p_masses), axis_name)
    q_sum = jnp.ones_like(p_sum) if q_row is None else psum_if(q_sum, axis_name)
    error = stop_row_error(masses, p_sum, q_sum, jnp.asarray(q_row is not None), tol, axis_name)
    clean = clean_masses(masses)
    return clean, psum_if(jnp.sum(clean), axis_name), q_sum, error

  def test_child(s: Walk, child) -> Walk:
    x, in_range = safe_tokens[child], token_in_range[child]
    u = {"per_node": uniforms[child], "per_parent": s.coin}.get(layout, uniforms[s.tests])
    p_x = p_rows.entry(s.node, x).astype(dtype)
    q_x = q_rows.entry(s.node, x).astype(dtype) if uses_q else None
    known = (s.removed == x) & (index < s.n_removed)  # x was rejected here before
    g_x = jnp.where(jnp.any(known), jnp.sum(jnp.where(known, s.frozen, 0)),
                    g_of(p_x, q_x, s.c))
    r_x = jnp.where(s.raw & ~jnp.any(known), p_x, g_x / s.z)
    removed_mass = jnp.sum(jnp.where(index < s.n_removed, sanitize(s.removed_q), 0))
    q_left = s.q_total - removed_mass
    if law == "iid":
      q_j = q_x
    elif law == "without_replacement":  # q without the rejected tokens, renormalised
      q_j = jnp.where(jnp.any(known), 0,
                      jnp.where(s.n_removed > 0, q_x / jnp.where(q_left > 0, q_left, 1), q_x))
    else:  # a point mass on x
      q_j = one
    ok = accepts(u, r_x, q_j) & in_range
    error = (s.error | uniform_codes(u, jnp.asarray(True))
             | flag(~in_range, ErrorCode.DRAFT_OUT_OF_RANGE) | value_codes(p_x, tol))
    if uses_q:
      error = error | value_codes(q_x, tol)

    def accept(_):
      # (Constants written as *_like the state: inside shard_map they keep its mesh axes.)
      return s._replace(
        node=child + jnp.zeros_like(s.node), prev=child + jnp.zeros_like(s.prev),
        depth=s.depth + 1, tests=s.tests + 1, raw=jnp.ones_like(s.raw), c=jnp.zeros_like(s.c),
        z=jnp.ones_like(s.z), n_removed=jnp.zeros_like(s.n_removed),
        coin=uniforms[child] + jnp.zeros_like(s.coin),
        out=s.out.at[s.depth].set(x), path=s.path.at[s.depth].set(child), error=error)

    def reject(_):
      # r <- max(r - q_j, 0), renormalised. With r = G / Z: the tokens not rejected here keep
      # G = max(p - c q, 0) with c += Z / S (S: the mass q_j was normalised by), a rejected
      # token's weight is frozen (q_j is 0 there from then on, without replacement).
      z = jnp.where(s.raw, one, s.z)
      if law == "deterministic":
        c, frozen_x = s.c, jnp.maximum(jnp.where(s.raw, p_x, g_x) - z, 0)
      else:
        share = jnp.where((law == "without_replacement") & (s.n_removed > 0), q_left, one)
        c = s.c + z / jnp.where(share > 0, share, one)
        frozen_x = jnp.where(jnp.any(known), g_x, g_of(p_x, q_x, c))
      new = in_range & ~jnp.any(known) & (law != "iid")
      slot = new & (index == s.n_removed)
      # Given this rejection the coin is uniform on [a, 1) (a: the acceptance probability):
      # rescaled, it is a fresh uniform for the next sibling or the final sample.
      a = jnp.where(q_j > 0, jnp.minimum(r_x / jnp.where(q_j > 0, q_j, one), one),
                    jnp.where(r_x > 0, one, zero))
      a = jnp.where(in_range & (a == a), a, zero)
      coin = jnp.where(a < 1, (s.coin - a) / jnp.where(a < 1, 1 - a, one), s.coin)
      coin = jnp.clip(coin, zero, jnp.asarray(1 - jnp.finfo(dtype).epsneg, dtype))
      t = s._replace(
        prev=child + jnp.zeros_like(s.prev), tests=s.tests + 1, c=c, coin=coin,
        removed=jnp.where(slot, x, s.removed),
        frozen=jnp.where(slot, frozen_x, s.frozen), removed_p=jnp.where(slot, p_x, s.removed_p),
        removed_q=jnp.where(slot, q_x if uses_q else zero, s.removed_q),
        n_removed=s.n_removed + new.astype(jnp.int32), error=error)
      _, total, q_sum, row_err = pass_over(t, c, uses_q)
      empty = ~(total > 0)  # nothing left: fall back to p[node]
      return t._replace(raw=empty, c=jnp.where(empty, zero, c), z=jnp.where(empty, one, total),
                        q_total=jnp.where(uses_q, sanitize(q_sum), one),
                        frozen=jnp.where(empty, t.removed_p, t.frozen), error=t.error | row_err)

    return branch(looped, ok, lambda: accept(None), lambda: reject(None))

  def finish(s: Walk) -> Walk:
    u = {"per_node": uniforms[0], "per_parent": s.coin}.get(layout, uniforms[s.tests])
    u = uniforms[size] if final_coin else u
    # While raw, the weights are p (the fallback's frozen weights are p too): q is not read.
    masses, _, _, row_err = branch(looped, s.raw, lambda: pass_over(s, zero, False),
                                   lambda: pass_over(s, s.c, uses_q))

    def block_values(lo, start, bsize):
      p_part = p_rows.slice(s.node, start, bsize)
      q_part = q_rows.slice(s.node, start, bsize) if uses_q else None
      q_part = None if q_part is None else jnp.where(s.raw, 0, q_part)
      ids = p_rows.first_column() + start + jnp.arange(bsize, dtype=jnp.int32)
      values = with_removed(g_of(p_part, q_part, jnp.where(s.raw, zero, s.c)), ids, s)
      return mask_block(sanitize(values), lo, start)

    token = sample_blocks(masses, block_values, u, local_vocab, axis_name)
    return s._replace(done=jnp.ones_like(s.done), out=s.out.at[s.depth].set(token),
                      error=s.error | uniform_codes(u, jnp.asarray(True)) | row_err)

  def step(s: Walk) -> Walk:
    candidates = is_node & (parents == s.node) & (index > s.prev) & (s.depth < max_depth)
    child = jnp.argmax(candidates).astype(jnp.int32)
    return branch(looped, candidates[child], lambda: test_child(s, child), lambda: finish(s))

  none = jnp.full((size,), -1, jnp.int32)
  empty_values = jnp.zeros((size,), dtype)
  start = Walk(
    node=jnp.int32(0), prev=jnp.int32(0), depth=jnp.int32(0), tests=jnp.int32(0),
    done=jnp.asarray(False), raw=jnp.asarray(True), c=zero, z=one, q_total=one, removed=none,
    frozen=empty_values, removed_p=empty_values, removed_q=empty_values, n_removed=jnp.int32(0),
    coin=uniforms[0], out=jnp.full((length,), pad_id, jnp.int32),
    path=jnp.full((length,), -1, jnp.int32), error=jnp.int32(0))
  # Typed like what the body computes (inside shard_map: the same varying mesh axes).
  start = anchored(start, parents, safe_tokens, uniforms, is_node, p_rows.entry(0, 0),
                   q_rows.entry(0, 0))
  end = lax.while_loop(lambda s: ~s.done, step, start)
  return WalkEnd(tokens=end.out, path=end.path, num_accepted=end.depth, num_tests=end.tests,
                 error=end.error)
