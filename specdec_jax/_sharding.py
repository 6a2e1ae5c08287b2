"""Vocab-parallel verification with ``shard_map``: no device ever gathers a full row.

Every verifier has one per-sequence body that takes an optional ``axis_name``
(:func:`~specdec_jax._verify.verify_rows`, :func:`~specdec_jax._block.block_verify_rows`,
:func:`~specdec_jax._tree.tree_rows`): with it, the rows hold one device's ``V / n`` columns
and the few statistics the rule needs are reduced over the mesh axis. This module wraps
those bodies in ``shard_map`` over a mesh, batched with ``vmap``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax._block import block_verify_rows
from specdec_jax._checks import check_chain
from specdec_jax._packed import PackedVerifyResult
from specdec_jax._packed import check_packed
from specdec_jax._packed import packed_rows
from specdec_jax._tree import TreeVerifyResult
from specdec_jax._tree import check_tree
from specdec_jax._tree import tree_rows
from specdec_jax._verify import VerifyResult
from specdec_jax._verify import verify_rows

#: The chain rules :func:`vocab_parallel_verify` can run.
RULES = {"token": verify_rows, "block": block_verify_rows}


def place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Lay ``x`` out as ``sharding`` inside jit, on meshes with explicit or automatic axes."""
  if any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _check_mesh(fn: str, mesh: Mesh, vocab_axis: str, batch_axis: str | None) -> int:
  if vocab_axis not in mesh.axis_names:
    raise ValueError(
      f"{fn}: `vocab_axis` must name an axis of the mesh {mesh.axis_names}, got "
      f"{vocab_axis!r} instead."
    )
  if batch_axis is not None and batch_axis not in mesh.axis_names:
    raise ValueError(
      f"{fn}: `batch_axis` must name an axis of the mesh {mesh.axis_names}, got "
      f"{batch_axis!r} instead."
    )
  return mesh.shape[vocab_axis]


def _check_batched(fn: str, arrays) -> None:
  for arg, value, rank in arrays:
    if value.ndim != rank:
      raise ValueError(
        f"{fn}: `{arg}` must be batched with rank {rank}, got shape {tuple(value.shape)}."
      )


def _counts(fn: str, arg: str, value, batch: int, default: int) -> jax.Array:
  if value is None:
    return jnp.full((batch,), default, jnp.int32)
  if jnp.shape(value) != (batch,):
    raise ValueError(f"{fn}: `{arg}` must have shape (B,) = ({batch},), got {jnp.shape(value)}.")
  return jnp.clip(jnp.asarray(value), -1, 2**31 - 1).astype(jnp.int32)


def vocab_parallel_verify(
  mesh: Mesh,
  vocab_axis: str,
  batch_axis: str | None = None,
  *,
  pad_id: int = -1,
  rule: str = "token",
) -> Callable[..., VerifyResult]:
  """Build a jitted, batched :func:`verify` (or :func:`block_verify`) on vocab-split rows.

  This is the layout of a tensor-parallel LM head (as on TPU pods): every device holds
  ``V / n`` contiguous columns of every row. Per sequence only O(n) scalars cross devices:
  the ``2 * gamma`` gathered probabilities of the draft tokens (a ``psum`` of one
  contribution each), a few statistics of each row the rule reads (its sums for validity
  and the residual's mass; block verification reads up to ``gamma`` rows), ``n`` partial
  masses for the inverse-CDF sample (an ``all_gather`` and a prefix over devices) and one
  candidate id (a ``pmax``). The accept scan runs replicated on every device. Results equal
  the single-device verifier's for the same uniforms except within float rounding of an
  interval boundary of the final sample.

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    mesh: a ``jax.sharding.Mesh``.
    vocab_axis: the mesh axis the vocabulary is split over; ``V`` must be divisible by its
      size.
    batch_axis: optional mesh axis the batch is split over (data parallel); the batch size
      must be divisible by its size.
    pad_id: int written into unused token slots.
    rule: ``"token"`` (:func:`~specdec_jax.verify`) or ``"block"``
      (:func:`~specdec_jax.block_verify`).

  Returns:
    ``fn(p, q, draft, uniforms, num_draft=None) -> VerifyResult`` on batches:
    ``p`` ``(B, gamma + 1, V)``, ``q`` ``(B, gamma, V)``, ``draft`` ``(B, gamma)``,
    ``uniforms`` ``(B, gamma + 1)``, ``num_draft`` ``(B,)`` or ``None``. The result's
    fields have a leading ``B`` axis, sharded over ``batch_axis``.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> fn = vocab_parallel_verify(mesh, "model")
    >>> p = np.full((1, 3, 4), 0.25, np.float32); q = np.full((1, 2, 4), 0.25, np.float32)
    >>> fn(p, q, np.array([[1, 2]]), np.full((1, 3), 0.5, np.float32)).tokens.tolist()
    [[1, 2, 2]]

  Reference:
    Shoeybi et al., "Megatron-LM" (vocab-parallel output layer), arXiv:1909.08053;
    Leviathan, Kalman, Matias (2023), arXiv:2211.17192; Sun et al. (2025, block
    verification), arXiv:2403.10444.
  """
  name = "vocab_parallel_verify"
  shards = _check_mesh(name, mesh, vocab_axis, batch_axis)
  if rule not in RULES:
    raise ValueError(f"{name}: `rule` must be one of {sorted(RULES)}, got {rule!r} instead.")
  body = RULES[rule]
  rows, per_seq, scalar = P(batch_axis, None, vocab_axis), P(batch_axis, None), P(batch_axis)
  out_specs = VerifyResult(per_seq, scalar, scalar, scalar, scalar, scalar)

  def local(p, q, draft, uniforms, num_draft):
    one = functools.partial(body, pad_id=pad_id, vocab=p.shape[-1] * shards,
                            axis_name=vocab_axis)
    return jax.vmap(one)(p, q, draft, uniforms, num_draft)

  specs = (rows, rows, per_seq, per_seq, scalar)
  sharded = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)

  @jax.jit
  def fn(p, q, draft, uniforms, num_draft=None) -> VerifyResult:
    _check_batched(name, (("p", p, 3), ("q", q, 3), ("draft", draft, 2),
                          ("uniforms", uniforms, 2)))
    one = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (p, q, draft, uniforms)]
    gamma, vocab = check_chain(name, *one)
    if vocab % shards:
      raise ValueError(
        f"{name}: V = {vocab} must be divisible by the {shards} devices of mesh axis "
        f"{vocab_axis!r}."
      )
    args = (p, q, draft, uniforms, _counts(name, "num_draft", num_draft, p.shape[0], gamma))
    args = tuple(place(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True))
    return sharded(*args)

  return fn


def vocab_parallel_tree_verify(
  mesh: Mesh,
  vocab_axis: str,
  batch_axis: str | None = None,
  *,
  law: str = "iid",
  pad_id: int = -1,
  max_depth: int | None = None,
  uniform_layout: str = "sequential",
) -> Callable[..., TreeVerifyResult]:
  """Build a jitted, batched :func:`tree_verify` on vocab-split rows (tensor-parallel head).

  The walk carries no ``(V,)`` row (see :func:`~specdec_jax.tree_verify`), so it runs
  replicated on every device: a child test gathers two scalars (a ``psum`` of one
  contribution each), a rejection reduces three statistics of the node's rows, and the final
  token is a sharded inverse CDF (``n`` partial masses and one candidate). Per tree O(n + N)
  scalars cross devices, nothing of size ``V``.

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    mesh, vocab_axis, batch_axis, pad_id: as in :func:`vocab_parallel_verify`.
    law, max_depth, uniform_layout: static, as in :func:`~specdec_jax.tree_verify`.

  Returns:
    ``fn(p, q, parents, tokens, uniforms, num_nodes=None) -> TreeVerifyResult`` on batches:
    ``p``, ``q`` ``(B, N, V)``, ``parents`` ``(N,)`` (one shape for the batch) or
    ``(B, N)``, ``tokens`` and ``uniforms`` ``(B, N)``, ``num_nodes`` ``(B,)`` or ``None``.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> fn = vocab_parallel_tree_verify(mesh, "model", law="deterministic")
    >>> p = np.full((1, 3, 4), 0.25, np.float32)
    >>> r = fn(p, p, np.array([-1, 0, 0]), np.array([[0, 1, 2]]), np.full((1, 3), 0.1))
    >>> r.tokens.tolist(), r.path.tolist()
    ([[1, 0, -1]], [[1, -1, -1]])

  Reference:
    Miao et al., "SpecInfer", arXiv:2305.09781; Shoeybi et al., "Megatron-LM",
    arXiv:1909.08053.
  """
  name = "vocab_parallel_tree_verify"
  shards = _check_mesh(name, mesh, vocab_axis, batch_axis)
  rows, per_seq, scalar = P(batch_axis, None, vocab_axis), P(batch_axis, None), P(batch_axis)
  out_specs = TreeVerifyResult(per_seq, per_seq, scalar, scalar, scalar, scalar, scalar)

  def local(p, q, parents, tokens, uniforms, num_nodes, *, depth):
    one = functools.partial(tree_rows, law=law, pad_id=pad_id, max_depth=depth,
                            uniform_layout=uniform_layout, vocab=p.shape[-1] * shards,
                            axis_name=vocab_axis)
    return jax.vmap(one)(p, q, parents, tokens, uniforms, num_nodes)

  specs = (rows, rows, per_seq, per_seq, per_seq, scalar)

  @jax.jit
  def fn(p, q, parents, tokens, uniforms, num_nodes=None) -> TreeVerifyResult:
    _check_batched(name, (("p", p, 3), ("q", q, 3), ("tokens", tokens, 2),
                          ("uniforms", uniforms, 2)))
    batch = p.shape[0]
    parents = jnp.asarray(parents)
    if parents.ndim == 1:
      parents = jnp.broadcast_to(parents, (batch, parents.shape[0]))
    one = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (p, q, parents, tokens, uniforms)]
    size, vocab, depth = check_tree(*one, law, max_depth, name, uniform_layout)
    if vocab % shards:
      raise ValueError(
        f"{name}: V = {vocab} must be divisible by the {shards} devices of mesh axis "
        f"{vocab_axis!r}."
      )
    counts = _counts(name, "num_nodes", num_nodes, batch, size)
    args = (p, q, jnp.clip(parents, -1, 2**31 - 1).astype(jnp.int32),
            jnp.clip(tokens, -1, 2**31 - 1).astype(jnp.int32), uniforms, counts)
    args = tuple(place(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True))
    sharded = jax.shard_map(functools.partial(local, depth=depth), mesh=mesh, in_specs=specs,
                            out_specs=out_specs)
    return sharded(*args)

  return fn


def vocab_parallel_packed_verify(
  mesh: Mesh,
  vocab_axis: str,
  *,
  max_spec_len: int,
  bonus_rows: bool = True,
  rule: str = "token",
  pad_id: int = -1,
) -> Callable[..., PackedVerifyResult]:
  """Build a jitted :func:`~specdec_jax.packed_verify` on vocab-split packed rows.

  The packed target (and draft) probabilities hold ``V / n`` columns per device, as a
  tensor-parallel LM head leaves them; every request reads its gathered scalars and stop
  row in place, exactly as :func:`vocab_parallel_verify` does for padded rows, so per
  request O(n) scalars cross devices and nothing of size ``V``. Probabilities only: process
  logits first (top-k/top-p over a split row would need a reduction per bisection pass).

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    mesh, vocab_axis, pad_id: as in :func:`vocab_parallel_verify`.
    max_spec_len, bonus_rows, rule: static, as in :func:`~specdec_jax.packed_verify`.

  Returns:
    ``fn(draft_token_ids, num_draft_tokens, target_probs, uniforms, draft_probs=None,
    bonus_token_ids=None) -> PackedVerifyResult`` with the shapes of
    :func:`~specdec_jax.packed_verify`.

  Example:
    >>> import jax, numpy as np
    >>> fn = vocab_parallel_packed_verify(jax.make_mesh((1,), ("model",)), "model",
    ...                                   max_spec_len=1)
    >>> p = np.array([[0.0, 1.0], [1.0, 0.0]], np.float32)   # one request: a draft row, a bonus row
    >>> fn(np.array([1]), np.array([1]), p, np.array([[0.5, 0.5]], np.float32)).tokens.tolist()
    [[1, 0]]

  Reference:
    Shoeybi et al., "Megatron-LM", arXiv:1909.08053; the packed layouts of vLLM V1 and
    vllm-project/tpu-inference.
  """
  name = "vocab_parallel_packed_verify"
  shards = _check_mesh(name, mesh, vocab_axis, None)
  if rule not in RULES:
    raise ValueError(f"{name}: `rule` must be one of {sorted(RULES)}, got {rule!r} instead.")
  rows, replicated = P(None, vocab_axis), P()
  out_specs = PackedVerifyResult(*(replicated,) * 5)

  @jax.jit
  def fn(draft_token_ids, num_draft_tokens, target_probs, uniforms, draft_probs=None,
         bonus_token_ids=None) -> PackedVerifyResult:
    check_packed(name, draft_token_ids, num_draft_tokens, target_probs, draft_probs,
                 bonus_token_ids, uniforms, max_spec_len, bonus_rows, "target_probs",
                 "draft_probs")
    if target_probs.shape[1] % shards:
      raise ValueError(f"{name}: V = {target_probs.shape[1]} must be divisible by the {shards} "
                       f"devices of mesh axis {vocab_axis!r}.")
    named = {"draft_token_ids": draft_token_ids, "num_draft_tokens": num_draft_tokens,
             "target": target_probs, "uniforms": uniforms}
    if draft_probs is not None:
      named["draft"] = draft_probs
    if bonus_token_ids is not None:
      named["bonus"] = bonus_token_ids
    specs = {k: rows if k in ("target", "draft") else replicated for k in named}
    named = {k: place(v, NamedSharding(mesh, specs[k])) for k, v in named.items()}

    def local(named):
      return packed_rows(named["draft_token_ids"], named["num_draft_tokens"], named["target"],
                         named.get("draft"), named.get("bonus"), named["uniforms"], None,
                         max_spec_len=max_spec_len, bonus_rows=bonus_rows, rule=rule,
                         pad_id=pad_id, axis_name=vocab_axis)

    return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_specs)(named)

  return fn
