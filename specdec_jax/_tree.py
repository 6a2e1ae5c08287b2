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
from specdec_jax._errors import row_error
from specdec_jax._errors import row_tolerance
from specdec_jax._rule import accepts
from specdec_jax._sampling import sample_index
from specdec_jax._sampling import sanitize
from specdec_jax._verify import clip_count
from specdec_jax._verify import compute_dtype
from specdec_jax._verify import id_in_range
from specdec_jax._verify import key_uniforms

LAWS = ("iid", "without_replacement", "deterministic")


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
    valid: bool ``()``. True when everything the walk read was valid: the tested
      child ids, the full ``p`` row of every visited node, the ``q`` row of every node
      whose children were tested (not read under ``"deterministic"``), the uniforms
      read, ``num_nodes`` and the parent indices of the real nodes.
    error: int32 ``()``. :class:`~specdec_jax.ErrorCode` bit mask; 0 when ``valid``.
  """

  tokens: jax.Array
  path: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  num_uniforms: jax.Array
  valid: jax.Array
  error: jax.Array


def _check_tree(p, q, parents, tokens, uniforms, law, max_depth, name) -> tuple[int, int, int]:
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
  if max_depth is None:
    max_depth = size - 1
  if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
    raise ValueError(f"{name}: `max_depth` must be a static int >= 0, got {max_depth!r}.")
  return size, vocab, max_depth


#: The array arguments of the tree verifiers, converted on the host by ``public_jit``.
TREE_ARRAYS = {"key": KEY, "p": FLOAT, "q": FLOAT, "parents": INT, "tokens": INT, "uniforms": FLOAT,
               "num_nodes": INT}


class _Walk(NamedTuple):
  node: jax.Array  # current node
  prev: jax.Array  # children of `node` with index <= prev have been tested
  depth: jax.Array  # accepted tokens so far
  tests: jax.Array  # child tests performed so far (= next uniform slot)
  done: jax.Array
  residual: jax.Array  # (V,) sampling weights at `node`: p[node], or the unnormalised residual
  raw: jax.Array  # True while `residual` is p[node] as given (no sibling rejected yet)
  q_left: jax.Array  # (V,) q[node] with rejected siblings' tokens removed ("without_replacement")
  removed: jax.Array  # True once a token was removed from q_left
  out: jax.Array  # (L,) emitted tokens
  path: jax.Array  # (L,) accepted nodes
  error: jax.Array


@public_jit(arrays=TREE_ARRAYS, static_argnames=("law", "pad_id", "max_depth"))
def tree_verify(p, q, parents, tokens, uniforms, *, num_nodes=None, law: str = "iid",
                pad_id: int = -1, max_depth: int | None = None) -> TreeVerifyResult:
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
  clipped (``BAD_NUM_DRAFT``), and NaN/negative/unnormalised rows that were read or
  uniforms outside ``[0, 1)`` set their bits in ``error``. Shapes are checked at
  trace time. The walk is a ``lax.while_loop`` of at most ``N`` steps, each
  ``O(N + V)``; children are found by masking ``parents == u``.

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
  size, vocab, max_depth = _check_tree(p, q, parents, tokens, uniforms, law, max_depth,
                                       "tree_verify")
  check_scalar("tree_verify", "num_nodes", num_nodes, INT)
  length = max_depth + 1
  tol = max(row_tolerance(p.dtype), row_tolerance(q.dtype))
  dtype = compute_dtype(p.dtype, q.dtype)
  uniforms = uniforms.astype(dtype)
  index = jnp.arange(size, dtype=jnp.int32)
  ids = jnp.arange(vocab, dtype=jnp.int32)
  real, bad_count = clip_count(num_nodes, 1, size)
  # Real non-root nodes need a parent in [0, own index); others are never reached (and flagged).
  # Parents and ids are compared in their own dtype, before the int32 cast (no wrap-around).
  bad_parent = (index > 0) & (index < real) & ((parents < 0) | (parents >= index))
  parents = jnp.clip(parents, -1, size).astype(jnp.int32)
  token_in_range, safe_tokens = id_in_range(tokens, vocab)
  error = (flag(bad_count, ErrorCode.BAD_NUM_DRAFT)
           | flag(jnp.any(bad_parent), ErrorCode.BAD_PARAMS)
           | row_error(p[0].astype(dtype), tol))
  is_node = (index > 0) & (index < real) & ~bad_parent

  def arrive(node):
    """The residual state on arriving at ``node``: p[node] as given, q[node] untouched."""
    return p[node].astype(dtype), jnp.asarray(True), q[node].astype(dtype), jnp.asarray(False)

  residual, raw, q_left, removed = arrive(jnp.int32(0))
  start = _Walk(
    node=jnp.int32(0), prev=jnp.int32(0), depth=jnp.int32(0), tests=jnp.int32(0),
    done=jnp.asarray(False), residual=residual, raw=raw, q_left=q_left, removed=removed,
    out=jnp.full((length,), pad_id, jnp.int32), path=jnp.full((length,), -1, jnp.int32),
    error=error)

  def uniform_error(u):
    return flag(~((u >= 0) & (u < 1)), ErrorCode.UNIFORM_OUT_OF_RANGE)

  def test_child(s: _Walk, child) -> _Walk:
    in_range = token_in_range[child]
    safe_x = safe_tokens[child]
    is_x = (ids == safe_x) & in_range  # all False for an out-of-range id
    u = uniforms[s.tests]
    total = jnp.sum(sanitize(s.residual))
    r = jnp.where(s.raw, s.residual, s.residual / jnp.where(total > 0, total, 1))
    if law == "iid":
      q_j = q[s.node].astype(dtype)
    elif law == "without_replacement":
      left = jnp.sum(sanitize(s.q_left))
      q_j = jnp.where(s.removed, s.q_left / jnp.where(left > 0, left, 1), s.q_left)
    else:  # a point mass on the child's token
      q_j = is_x.astype(dtype)
    ok = accepts(u, r[safe_x], q_j[safe_x]) & in_range
    first_test = s.prev == s.node
    error = s.error | uniform_error(u) | flag(~in_range, ErrorCode.DRAFT_OUT_OF_RANGE)
    if law != "deterministic":
      error = error | jnp.where(first_test, row_error(q[s.node].astype(dtype), tol), 0)

    def accept(_):
      residual, raw, q_left, removed = arrive(child)
      return s._replace(
        node=child, prev=child, depth=s.depth + 1, tests=s.tests + 1, residual=residual,
        raw=raw, q_left=q_left, removed=removed, out=s.out.at[s.depth].set(safe_x),
        path=s.path.at[s.depth].set(child),
        error=error | row_error(p[child].astype(dtype), tol))

    def reject(_):
      weights = jnp.maximum(r - q_j, 0)
      empty = ~(jnp.sum(sanitize(weights)) > 0)  # nothing left: fall back to p[node]
      residual = jnp.where(empty, p[s.node].astype(dtype), weights)
      q_left = s.q_left
      if law == "without_replacement":
        q_left = jnp.where(is_x, jnp.zeros_like(q_left), q_left)
      return s._replace(prev=child, tests=s.tests + 1, residual=residual, raw=empty,
                        q_left=q_left, removed=s.removed | jnp.any(is_x), error=error)

    return lax.cond(ok, accept, reject, None)

  def finish(s: _Walk) -> _Walk:
    u = uniforms[s.tests]
    token = sample_index(s.residual, u)
    return s._replace(done=jnp.asarray(True), out=s.out.at[s.depth].set(token),
                      error=s.error | uniform_error(u))

  def step(s: _Walk) -> _Walk:
    candidates = is_node & (parents == s.node) & (index > s.prev) & (s.depth < max_depth)
    child = jnp.argmax(candidates).astype(jnp.int32)
    return lax.cond(candidates[child], lambda c: test_child(s, c), lambda c: finish(s), child)

  end = lax.while_loop(lambda s: ~s.done, step, start)
  return TreeVerifyResult(
    tokens=end.out, path=end.path, num_tokens=end.depth + 1, num_accepted=end.depth,
    num_uniforms=end.tests + 1, valid=end.error == 0, error=end.error)




@public_jit(arrays=TREE_ARRAYS, static_argnames=("law", "pad_id", "max_depth"))
def tree_verify_with_key(key, p, q, parents, tokens, *, num_nodes=None, law: str = "iid",
                         pad_id: int = -1, max_depth: int | None = None) -> TreeVerifyResult:
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
  size, _, _ = _check_tree(p, q, parents, tokens, None, law, max_depth, name)
  uniforms = key_uniforms(name, key, size, compute_dtype(p.dtype, q.dtype))
  return tree_verify.jitted(p, q, parents, tokens, uniforms, num_nodes=num_nodes, law=law,
                            pad_id=pad_id, max_depth=max_depth)
