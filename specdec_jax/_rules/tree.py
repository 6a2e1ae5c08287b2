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
from jax.typing import ArrayLike

from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import INT
from specdec_jax._core.checks import KEY
from specdec_jax._core.checks import check_array
from specdec_jax._core.checks import check_scalar
from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.checks import public_jit
from specdec_jax._core.errors import ErrorCode
from specdec_jax._core.errors import flag
from specdec_jax._core.errors import row_tolerance
from specdec_jax._core.keys import key_uniforms
from specdec_jax._core.keys import one_source
from specdec_jax._logits.params import check_bitmask
from specdec_jax._rows.batching import per_sequence
from specdec_jax._rows.chain import clip_count
from specdec_jax._rows.chain import id_in_range
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax._rows.logprobs import finish_emitted
from specdec_jax._rows.logprobs import path_rows
from specdec_jax._rows.sources import masked_rows
from specdec_jax._rules.tree_walk import tree_walk

LAWS = ("iid", "without_replacement", "deterministic")

#: Where the uniforms are read (static ``uniform_layout`` of :func:`tree_verify`).
UNIFORM_LAYOUTS = ("sequential", "per_node", "per_parent")


class TreeVerifyResult(NamedTuple):
  """What one tree verification produced (one tree; add a leading batch axis under vmap).

  The first six fields are those of every result (:class:`~specdec_jax.VerifyResult`).

  Attributes:
    tokens: int32 ``(max_depth + 1,)``. The tokens of the accepted path (root
      excluded), then the extra token (replacement or bonus), then ``pad_id``.
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
    path: int32 ``(max_depth + 1,)``. The node indices of the accepted path (root
      excluded), then ``-1``. ``path[i]`` is the node whose token is ``tokens[i]``;
      the extra token was sampled at node ``path[num_accepted - 1]`` (the root if
      ``num_accepted == 0``).
    logprobs: float32 ``(S,)`` with ``logprobs=k`` (else None): each emitted token's
      log-probability under the target's processed distribution at its position (the
      replacement's too; ``logprobs_mode="raw"``: the raw logits' softmax); NaN in unused slots
      and for a caller's bonus token.
    top_ids, top_logprobs: ``(S, k)`` with ``logprobs=k > 0``: the ``k`` most likely tokens of
      each emitted token's distribution and their logprobs (ties toward the lower id).
  """

  tokens: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  num_uniforms: jax.Array
  valid: jax.Array
  error: jax.Array
  path: jax.Array
  logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None


def check_tree(p, q, parents, tokens, uniforms, law, max_depth, name,
                layout="sequential") -> tuple[int, int, int]:
  """Trace-time rank, shape, dtype and static-argument checks. Returns ``(N, V, max_depth)``.

  ``uniforms=None`` skips its check (``key=`` draws them).
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


@public_jit(arrays=TREE_ARRAYS,
            static_argnames=("law", "pad_id", "max_depth", "uniform_layout", "logprobs",
                             "logprobs_mode"))
def tree_verify(p: ArrayLike, q: ArrayLike | None, parents: ArrayLike, tokens: ArrayLike,
                uniforms: ArrayLike | None = None, *, key: ArrayLike | None = None,
                num_nodes: ArrayLike | None = None, law: str = "iid", pad_id: int = -1,
                max_depth: int | None = None,
                uniform_layout: str = "sequential", target_bitmask: ArrayLike | None = None,
                draft_bitmask: ArrayLike | None = None, logprobs: int | None = None,
                logprobs_mode: str = "processed") -> TreeVerifyResult:
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
  walk (:mod:`~specdec_jax._rows.batching`), so those passes happen only where they are needed.

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

  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    p: ``(N, V)`` floating. ``p[u]``: the target's next-token law after the path to ``u``.
    q: ``(N, V)`` floating. ``q[u]``: the draft law ``u``'s children were drafted
      from (after temperature, top-k, top-p). Rows of childless nodes are not read.
    parents: ``(N,)`` integer. ``parents[c]`` in ``[0, c)`` for real nodes ``c >= 1``;
      ``parents[0]`` and entries of unused nodes are ignored.
    tokens: ``(N,)`` integer ids in ``[0, V)``; ``tokens[0]`` is ignored.
    uniforms: ``(N,)`` floating, each in ``[0, 1)``; or
    key: one ``jax.random`` key: ``uniforms = jax.random.uniform(key, (N,))`` in the
      computation dtype.
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
    target_bitmask: optional grammar words ``(N, ceil(V / 32))``: each target row is masked
      (token ``32 j + i`` allowed iff bit ``i`` of word ``j``) and renormalised; a row that
      allows nothing emits nothing (``ErrorCode.NO_ALLOWED_TOKEN``).
    draft_bitmask: optional ``(N, ceil(V / 32))``, the draft rows' masks, the same way.
    logprobs: static None, or ``k`` in ``[0, 64]``: the result's ``logprobs`` (each emitted
      token's log-probability under its parent node's (masked) target row) and, for ``k >
      0``, ``top_ids`` / ``top_logprobs`` (the rows' ``k`` most likely tokens).
    logprobs_mode: static, ``"processed"`` or ``"raw"``: the same for probabilities.

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
  name = "tree_verify"
  size, vocab, max_depth = check_tree(p, q, parents, tokens, uniforms, law, max_depth, name,
                                      uniform_layout)
  check_scalar(name, "num_nodes", num_nodes, INT)
  one_source(name, key, uniforms)
  if key is not None:
    uniforms = key_uniforms(name, key, size, compute_dtype(p.dtype, q.dtype))
  p = masked_rows(p, check_bitmask(name, "target_bitmask", target_bitmask, size, vocab))
  if q is not None:
    q = masked_rows(q, check_bitmask(name, "draft_bitmask", draft_bitmask, size, vocab))
  result = tree_rows(p, q, parents, tokens, uniforms, num_nodes, law=law, pad_id=pad_id,
                     max_depth=max_depth, uniform_layout=uniform_layout, vocab=vocab)
  return finish_emitted(result, p, path_rows(result.path), pad_id=pad_id,
                        k=check_logprobs(name, logprobs, logprobs_mode, vocab),
                        mode=logprobs_mode)


def tree_rows(p, q, parents, tokens, uniforms, num_nodes, *, law: str, pad_id: int,
              max_depth: int, uniform_layout: str, vocab: int,
              axis_name: str | None = None, offset=0,
              final_coin: bool = False) -> TreeVerifyResult:
  """The body of :func:`tree_verify` for one tree whose rows may be vocab-sharded or packed.

  With ``axis_name`` (inside ``shard_map``) ``p``/``q`` hold this device's ``(N, V / n)``
  columns; the walk is replicated and only scalars cross devices (gathered entries, row
  sums, the sharded inverse CDF's partial masses and candidate). Packed trees: node ``u``'s
  rows are ``p[offset + u]`` of an array shared by the batch; ``q=None`` (only under
  ``"deterministic"``, which never reads it) passes no draft rows. ``final_coin``: the uniforms
  hold ``N + 1`` entries, the last one for the final token (packed trees' ``final_coins``).
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
                           axis_name=axis_name, final_coin=final_coin)
  end = per_sequence(walk, (p,) if q is None else (p, q), parents, safe_tokens,
                     token_in_range, uniforms.astype(dtype), is_node,
                     jnp.asarray(offset, jnp.int32))
  error = (end.error | flag(bad_count, ErrorCode.BAD_NUM_DRAFT)
           | flag(jnp.any(bad_parent), ErrorCode.BAD_PARAMS))
  return TreeVerifyResult(tokens=end.tokens, num_tokens=end.num_accepted + 1,
                          num_accepted=end.num_accepted, num_uniforms=end.num_tests + 1,
                          valid=error == 0, error=error, path=end.path)

