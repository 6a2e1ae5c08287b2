"""Exact tree (multi-draft) verification by recursive rejection sampling.

A draft tree holds several candidate continuations at once. Walking it from the
root, the children of the current node are tested one after another against a
residual of the target's distribution that shrinks with every rejected sibling;
an accepted child becomes the current node, and when every child is rejected (or
the node has none) one token is sampled from what is left and the walk stops.
The emitted tokens are distributed exactly as if the target had sampled them one
at a time, whatever the tree looks like, provided the children's tokens were
drafted by the law the rule is told about (``law``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._checks import FLOAT
from specdec_jax._checks import INT
from specdec_jax._checks import KEY
from specdec_jax._checks import check_array
from specdec_jax._checks import check_scalar
from specdec_jax._checks import public_jit
from specdec_jax._errors import ErrorCode
from specdec_jax._errors import flag
from specdec_jax._errors import psum_if
from specdec_jax._errors import row_tolerance
from specdec_jax._errors import stop_row_error
from specdec_jax._errors import uniform_codes
from specdec_jax._errors import value_codes
from specdec_jax._rule import accepts
from specdec_jax._sampling import BLOCK
from specdec_jax._sampling import block_masses
from specdec_jax._sampling import mask_block
from specdec_jax._sampling import sample_blocks
from specdec_jax._sampling import sanitize
from specdec_jax._stream import anchored
from specdec_jax._stream import branch
from specdec_jax._stream import per_sequence
from specdec_jax._stream import shifted
from specdec_jax._verify import clip_count
from specdec_jax._verify import compute_dtype
from specdec_jax._verify import id_in_range
from specdec_jax._verify import key_uniforms

LAWS = ("iid", "without_replacement", "deterministic")

#: Where the uniforms are read (static ``uniform_layout`` of :func:`tree_verify`).
UNIFORM_LAYOUTS = ("sequential", "per_node", "per_parent")


class TreeVerifyResult(NamedTuple):
  """What one tree verification produced (one tree; add a leading batch axis under vmap).

  Attributes:
    tokens: int32 ``(max_depth + 1,)``. The tokens of the accepted path (root
      excluded), then the extra token (replacement or bonus), then ``pad_id``.
    path: int32 ``(max_depth + 1,)``. The node indices of the accepted path (root
      excluded), then ``-1``. ``path[i]`` is the node whose token is ``tokens[i]``;
      the extra token was sampled at node ``path[num_accepted - 1]`` (the root if
      ``num_accepted == 0``).
    num_tokens: int32 ``()``. How many leading entries of ``tokens`` are new,
      ``1 <= num_tokens <= max_depth + 1``.
    num_accepted: int32 ``()``. How many drafted tokens were kept, ``num_tokens - 1``.
    num_uniforms: int32 ``()``. How many uniforms the walk read: one per child test
      performed plus one for the final sample, at most ``N``.
    valid: bool ``()``. True when everything the walk read was valid: the tested child ids
      and their gathered ``p`` (and ``q``) entries (finite, in ``[0, 1]``), the full rows of
      the nodes where a residual was formed (``p`` and ``q`` of a node with a rejected child)
      or the final token was sampled (``p`` of the last node), the uniforms read,
      ``num_nodes`` and the parent indices of the real nodes. ``q`` is never read under
      ``"deterministic"``.
    error: int32 ``()``. :class:`~specdec_jax.ErrorCode` bit mask; 0 when ``valid``.
  """

  tokens: jax.Array
  path: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  num_uniforms: jax.Array
  valid: jax.Array
  error: jax.Array


def check_tree(p, q, parents, tokens, uniforms, law, max_depth, name,
                layout="sequential") -> tuple[int, int, int]:
  """Trace-time rank, shape, dtype and static-argument checks. Returns ``(N, V, max_depth)``.

  ``uniforms=None`` skips its check (the ``*_with_key`` form draws them).
  """
  for arg, value, rank, kind in (("p", p, 2, FLOAT), ("q", q, 2, FLOAT),
                                 ("parents", parents, 1, INT), ("tokens", tokens, 1, INT)):
    check_array(name, arg, value, rank, kind)
  if uniforms is not None:
    check_array(name, "uniforms", uniforms, 1, FLOAT)
  size, vocab = p.shape
  if size < 1 or vocab < 1:
    raise ValueError(f"{name}: `p` must have shape (N, V) with N, V >= 1, got {tuple(p.shape)}.")
  for arg, value, shape in (("q", q, (size, vocab)), ("parents", parents, (size,)),
                            ("tokens", tokens, (size,)), ("uniforms", uniforms, (size,))):
    if value is not None and tuple(value.shape) != shape:
      raise ValueError(
        f"{name}: `{arg}` must have shape {shape} (N = {size} nodes, V = {vocab} from `p`), "
        f"got {tuple(value.shape)} instead.")
  if law not in LAWS:
    raise ValueError(f"{name}: `law` must be one of {LAWS}, got {law!r} instead.")
  if layout not in UNIFORM_LAYOUTS:
    raise ValueError(f"{name}: `uniform_layout` must be one of {UNIFORM_LAYOUTS}, got "
                     f"{layout!r} instead.")
  if max_depth is None:
    max_depth = size - 1
  if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
    raise ValueError(f"{name}: `max_depth` must be a static int >= 0, got {max_depth!r}.")
  return size, vocab, max_depth


#: The array arguments of the tree verifiers, converted on the host by ``public_jit``.
TREE_ARRAYS = {"key": KEY, "p": FLOAT, "q": FLOAT, "parents": INT, "tokens": INT, "uniforms": FLOAT,
               "num_nodes": INT}


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


class _Reader:
  """A row reader of :mod:`~specdec_jax._stream` that also gathers one entry, sharded or not."""

  def __init__(self, read, local_vocab: int, axis_name: str | None):
    self.read, self.local_vocab, self.axis_name = read, local_vocab, axis_name

  def offset(self) -> jax.Array:
    """The global id of this device's first column."""
    if self.axis_name is None:
      return jnp.int32(0)
    return lax.axis_index(self.axis_name).astype(jnp.int32) * self.local_vocab

  def row(self, node, start, size: int) -> jax.Array:
    return self.read(node, start, size)

  def entry(self, node, token) -> jax.Array:
    """``row[node][token]`` on every device (the device that holds it contributes it)."""
    if self.axis_name is None:
      return self.read(node, token, 1)[0]
    local = token - self.offset()
    mine = (local >= 0) & (local < self.local_vocab)
    value = self.read(node, jnp.clip(local, 0, self.local_vocab - 1), 1)[0]
    return lax.psum(jnp.where(mine, value, jnp.zeros_like(value)), self.axis_name)


def tree_walk(readers, parents, safe_tokens, token_in_range, uniforms, is_node, offset=0, *,
              law: str, max_depth: int, pad_id: int, layout: str, local_vocab: int, dtype,
              tol: float, axis_name: str | None = None,
              looped: bool = True) -> TreeVerifyResult:
  """The walk of :func:`tree_verify` for one tree, reading ``p``/``q`` rows through ``readers``.

  The body of :func:`~specdec_jax._stream.per_sequence`: on XLA:CPU each tree of a batch runs
  its own loop with real branches, so a pass over a node's rows happens only after a rejection
  (for the residual's new mass) and once at the end (for the final sample). With
  ``axis_name`` the rows hold this device's ``V / n`` columns and only scalars cross devices.
  """
  p_rows = _Reader(shifted(readers[0], offset), local_vocab, axis_name)
  q_rows = _Reader(shifted(readers[-1], offset), local_vocab, axis_name)  # p again: no q
  size = parents.shape[0]
  length = max_depth + 1
  block = min(BLOCK, local_vocab)
  index = anchored(jnp.arange(size, dtype=jnp.int32), parents)  # typed like the inputs
  uses_q = law != "deterministic"
  zero, one = jnp.zeros((), dtype), jnp.ones((), dtype)

  def g_of(p_val, q_val, c):
    """``G = max(p - c q, 0)`` (``max(p, 0)`` without ``q``); NaN propagates."""
    p_val = p_val.astype(dtype)
    if q_val is None:
      return jnp.maximum(p_val, 0)
    return jnp.maximum(p_val - c * q_val.astype(dtype), 0)

  def with_removed(values, ids, s: Walk):
    """The frozen weights in place of ``G`` for the tokens rejected at this node."""
    for k in range(size):
      values = jnp.where((ids == s.removed[k]) & (k < s.n_removed), s.frozen[k], values)
    return values

  def pass_over(s: Walk, c, read_q):
    """One fused read of the node's rows: clean block masses of the weights, their total ``Z``,
    ``sum q`` and the rows' error bits. Negative entries are poisoned with ``-inf`` (NaN
    propagates), so a block holding one has no mass and the bits report it."""
    p_row = p_rows.row(s.node, 0, local_vocab).astype(dtype)
    q_row = q_rows.row(s.node, 0, local_vocab).astype(dtype) if read_q else None
    ids = p_rows.offset() + jnp.arange(local_vocab, dtype=jnp.int32)
    negative = p_row < 0 if q_row is None else (p_row < 0) | (q_row < 0)
    values = with_removed(g_of(p_row, q_row, c), ids, s)
    masses = block_masses(jnp.where(negative, -jnp.inf, values), block)
    p_sum = psum_if(jnp.sum(jnp.where(p_row < 0, -jnp.inf, p_row)), axis_name)
    q_sum = jnp.ones_like(p_sum) if q_row is None else psum_if(jnp.sum(q_row), axis_name)
    error = stop_row_error(masses, p_sum, q_sum, jnp.asarray(q_row is not None), tol, axis_name)
    clean = jnp.where(jnp.isfinite(masses) & (masses > 0), masses, 0)
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
    # While raw, the weights are p (the fallback's frozen weights are p too): q is not read.
    masses, _, _, row_err = branch(looped, s.raw, lambda: pass_over(s, zero, False),
                                   lambda: pass_over(s, s.c, uses_q))

    def block_values(lo, start, bsize):
      p_part = p_rows.row(s.node, start, bsize)
      q_part = q_rows.row(s.node, start, bsize) if uses_q else None
      q_part = None if q_part is None else jnp.where(s.raw, 0, q_part)
      ids = p_rows.offset() + start + jnp.arange(bsize, dtype=jnp.int32)
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
  return TreeVerifyResult(
    tokens=end.out, path=end.path, num_tokens=end.depth + 1, num_accepted=end.depth,
    num_uniforms=end.tests + 1, valid=end.error == 0, error=end.error)


@public_jit(arrays=TREE_ARRAYS,
            static_argnames=("law", "pad_id", "max_depth", "uniform_layout"))
def tree_verify(p, q, parents, tokens, uniforms, *, num_nodes=None, law: str = "iid",
                pad_id: int = -1, max_depth: int | None = None,
                uniform_layout: str = "sequential") -> TreeVerifyResult:
  """Exact draft-tree verification by recursive rejection sampling (jitted).

  Node 0 is the root (the current context, no token); node ``c`` in ``1 .. N - 1``
  has parent ``parents[c] < c`` and token ``tokens[c]``. The walk starts at the root
  with residual ``r = p[root]``. At the current node ``u`` its children are tested
  in index order; child ``c`` with token ``x`` is accepted if
  ``uniform < r(x) / q_j(x)`` (:func:`~specdec_jax.accepts`), where ``q_j`` is the
  law the ``j``-th sibling was drafted from:

  * ``"iid"`` (SpecInfer): siblings i.i.d. from ``q[u]``, so ``q_j = q[u]``;
  * ``"without_replacement"`` (RSD): siblings drawn one after another without
    replacement from ``q[u]``, so ``q_j`` is ``q[u]`` with the earlier siblings'
    tokens removed, renormalised;
  * ``"deterministic"`` (EAGLE-2 top-k): ``q_j`` is a point mass on ``x``, i.e.
    accept with probability ``r(x)``; ``q`` is not read.

  On rejection ``r <- normalize(max(r - q_j, 0))``, or ``p[u]`` if that is empty:
  rounding can empty it when ``r`` is close to ``q_j``, and so can exact arithmetic when
  a sibling the law cannot produce is rejected (``q_j(x) = 0 = r(x)``, e.g. a padded
  sibling under ``"without_replacement"`` after ``r`` has become ``q_j``; such inputs are
  outside the drafting law, and the walk stays in range). An accepted child's token is
  emitted and the walk continues there with ``r = p[child]``; when all children of ``u``
  are rejected a token is sampled from ``r``, and at a node without children from
  ``p[u]`` (bonus); then the walk stops. The emitted tokens are distributed exactly
  as if the target had sampled them one by one.

  Order of uniforms: slot ``t`` is the ``t``-th child test in the order the tests
  happen (the root's children in index order up to the first accepted one, then
  that child's children, ...); slot ``num_uniforms - 1`` (= number of tests) is
  the final sample. Later slots are never read. A chain (one child per node) under
  ``"iid"`` or ``"without_replacement"`` is exactly :func:`~specdec_jax.verify`,
  uniform for uniform.

  Under ``jit`` nothing raises on values: ids stay in ``[0, V)``, an out-of-range
  child id is rejected (``DRAFT_OUT_OF_RANGE``), a real node whose parent is not in
  ``[0, own index)`` is ignored (``BAD_PARAMS``), ``num_nodes`` outside ``[1, N]`` is
  clipped (``BAD_NUM_DRAFT``), and NaN/negative/unnormalised values that were read or
  uniforms outside ``[0, 1)`` set their bits in ``error``. Shapes are checked at
  trace time.

  The walk is a ``lax.while_loop`` of at most ``N`` steps that carries no ``(V,)`` row: the
  residual at a node is ``max(p - c q, 0)`` (``p`` under ``"deterministic"``) with a scalar
  ``c``, except for the tokens rejected there, whose weights are kept in ``(N,)`` arrays.
  A test gathers two scalars; a rejection costs one pass over the node's rows (for the new
  residual mass) and the final token one more (a two-level inverse CDF, as
  :func:`~specdec_jax.sample_index`). Under ``jax.vmap`` on XLA:CPU each tree runs its own
  walk (:mod:`~specdec_jax._stream`), so those passes happen only where they are needed.

  ``uniform_layout="per_node"`` is the layout of engines that draw one coin per tree node
  (EAGLE): the test of child ``c`` reads ``uniforms[c]`` and the final sample reads
  ``uniforms[0]`` (the root has no test). ``"per_parent"`` is sglang's: one coin per parent
  node, ``uniforms[u]`` for all the tests among ``u``'s children. After a rejection whose
  acceptance probability was ``a`` the coin is uniform on ``[a, 1)``, so it is rescaled to
  ``(coin - a) / (1 - a)`` for the next sibling, and the final sample reads the last node's
  coin (rescaled if its children were tested). Under ``"deterministic"`` that accepts the
  ``j``-th child iff ``coin < p(c_1) + ... + p(c_j)``, sglang's target-only rule, coin for
  coin. Each layout reads every number at most once as a fresh uniform, so the output law
  is the same; only which number decides what differs.

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    p: ``(N, V)`` floating. ``p[u]``: the target's next-token law after the path to ``u``.
    q: ``(N, V)`` floating. ``q[u]``: the draft law ``u``'s children were drafted
      from (after temperature, top-k, top-p). Rows of childless nodes are not read.
    parents: ``(N,)`` integer. ``parents[c]`` in ``[0, c)`` for real nodes ``c >= 1``;
      ``parents[0]`` and entries of unused nodes are ignored.
    tokens: ``(N,)`` integer ids in ``[0, V)``; ``tokens[0]`` is ignored.
    uniforms: ``(N,)`` floating, each in ``[0, 1)``.
    num_nodes: optional int scalar (traced) in ``[1, N]``: nodes ``>= num_nodes`` are
      unused, for ragged batches of trees padded to a common ``N``. ``None``: ``N``.
    law: static, one of ``"iid"``, ``"without_replacement"``, ``"deterministic"``.
    pad_id: static int written into the unused slots of ``tokens``.
    max_depth: static int, the length of the output minus one (default ``N - 1``).
      Children deeper than ``max_depth`` are ignored (a truncated tree, still exact).
    uniform_layout: static, ``"sequential"`` (slot ``t`` is the ``t``-th test, then the
      final sample), ``"per_node"`` (slot ``c`` is child ``c``'s test, slot 0 the final
      sample) or ``"per_parent"`` (slot ``u`` for the tests among ``u``'s children, rescaled,
      and the final sample at the last node).

  Returns:
    :class:`TreeVerifyResult` with ``tokens`` and ``path`` of shape ``(max_depth + 1,)``.

  Example:
    >>> import jax.numpy as jnp
    >>> p = jnp.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]])
    >>> q = jnp.array([[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3], [1 / 3, 1 / 3, 1 / 3]])
    >>> parents, tokens = jnp.array([-1, 0, 0]), jnp.array([0, 0, 1])
    >>> r = tree_verify(p, q, parents, tokens, jnp.array([0.7, 0.9, 0.1]))
    >>> r.tokens.tolist(), r.path.tolist(), int(r.num_uniforms)  # 0 rejected, 1 kept, bonus 0
    ([1, 0, -1], [2, -1, -1], 3)

    Batched, ragged: ``jax.vmap(tree_verify)(p_b, q_b, parents_b, tokens_b, u_b, num_nodes=n_b)``.

  Reference:
    Miao et al., "SpecInfer: Accelerating Large Language Model Serving with Tree-based
    Speculative Inference and Verification", arXiv:2305.09781; Jeon et al., "Recursive
    Speculative Decoding: Accelerating LLM Inference via Sampling Without Replacement",
    arXiv:2402.14160; Li et al., "EAGLE-2: Faster Inference of Language Models with
    Dynamic Draft Trees", arXiv:2406.16858.
  """
  _, vocab, max_depth = check_tree(p, q, parents, tokens, uniforms, law, max_depth,
                                       "tree_verify", uniform_layout)
  check_scalar("tree_verify", "num_nodes", num_nodes, INT)
  return tree_rows(p, q, parents, tokens, uniforms, num_nodes, law=law, pad_id=pad_id,
                   max_depth=max_depth, uniform_layout=uniform_layout, vocab=vocab)


def tree_rows(p, q, parents, tokens, uniforms, num_nodes, *, law: str, pad_id: int,
              max_depth: int, uniform_layout: str, vocab: int,
              axis_name: str | None = None, offset=0) -> TreeVerifyResult:
  """The body of :func:`tree_verify` for one tree whose rows may be vocab-sharded or packed.

  With ``axis_name`` (inside ``shard_map``) ``p``/``q`` hold this device's ``(N, V / n)``
  columns; the walk is replicated and only scalars cross devices (gathered entries, row
  sums, the sharded inverse CDF's partial masses and candidate). Packed trees: node ``u``'s
  rows are ``p[offset + u]`` of an array shared by the batch; ``q=None`` (only under
  ``"deterministic"``, which never reads it) passes no draft rows.
  """
  size = parents.shape[0]
  q_dtype = p.dtype if q is None else q.dtype
  tol = max(row_tolerance(p.dtype), row_tolerance(q_dtype))
  dtype = compute_dtype(p.dtype, q_dtype)
  index = jnp.arange(size, dtype=jnp.int32)
  real, bad_count = clip_count(num_nodes, 1, size)
  # Real non-root nodes need a parent in [0, own index); others are never reached (and flagged).
  # Parents and ids are compared in their own dtype, before the int32 cast (no wrap-around).
  bad_parent = (index > 0) & (index < real) & ((parents < 0) | (parents >= index))
  parents = jnp.clip(parents, -1, size).astype(jnp.int32)
  token_in_range, safe_tokens = id_in_range(tokens, vocab)
  is_node = (index > 0) & (index < real) & ~bad_parent
  walk = functools.partial(tree_walk, law=law, max_depth=max_depth, pad_id=pad_id,
                           layout=uniform_layout, local_vocab=p.shape[-1], dtype=dtype, tol=tol,
                           axis_name=axis_name)
  result = per_sequence(walk, (p,) if q is None else (p, q), parents, safe_tokens,
                        token_in_range, uniforms.astype(dtype), is_node,
                        jnp.asarray(offset, jnp.int32))
  error = (result.error | flag(bad_count, ErrorCode.BAD_NUM_DRAFT)
           | flag(jnp.any(bad_parent), ErrorCode.BAD_PARAMS))
  return result._replace(error=error, valid=error == 0)


@public_jit(arrays=TREE_ARRAYS,
            static_argnames=("law", "pad_id", "max_depth", "uniform_layout"))
def tree_verify_with_key(key, p, q, parents, tokens, *, num_nodes=None, law: str = "iid",
                         pad_id: int = -1, max_depth: int | None = None,
                         uniform_layout: str = "sequential") -> TreeVerifyResult:
  """:func:`tree_verify` with its ``N`` uniforms drawn from a key.

  The uniforms are ``jax.random.uniform(key, (N,), dtype)`` in the computation
  dtype; all ``N`` are drawn whether read or not. For a batch split the key:
  ``jax.vmap(tree_verify_with_key)(jax.random.split(key, B), p, q, parents, tokens)``.

  Args:
    key: a ``jax.random`` key.
    p, q, parents, tokens, num_nodes, law, pad_id, max_depth: as in :func:`tree_verify`.

  Returns:
    :class:`TreeVerifyResult`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> p = jnp.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]])
    >>> q = jnp.full((3, 3), 1 / 3)
    >>> r = tree_verify_with_key(jax.random.key(0), p, q, jnp.array([-1, 0, 0]),
    ...                          jnp.array([0, 0, 1]))
    >>> 1 <= int(r.num_tokens) <= 2
    True

  Reference:
    Miao et al. (2023), arXiv:2305.09781.
  """
  name = "tree_verify_with_key"
  size, vocab, max_depth = check_tree(p, q, parents, tokens, None, law, max_depth, name,
                                       uniform_layout)
  check_scalar(name, "num_nodes", num_nodes, INT)
  uniforms = key_uniforms(name, key, size, compute_dtype(p.dtype, q.dtype))
  return tree_rows(p, q, parents, tokens, uniforms, num_nodes, law=law, pad_id=pad_id,
                   max_depth=max_depth, uniform_layout=uniform_layout, vocab=vocab)
