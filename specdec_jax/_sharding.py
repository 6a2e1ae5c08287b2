"""Vocab-parallel verification with ``shard_map``: no device ever gathers a full row."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax._checks import check_chain
from specdec_jax._verify import VerifyResult
from specdec_jax._verify import verify_rows


def _place(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """Lay ``x`` out as ``sharding`` inside jit, on meshes with explicit or automatic axes."""
  if any(t == AxisType.Explicit for t in sharding.mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def vocab_parallel_verify(
  mesh: Mesh,
  vocab_axis: str,
  batch_axis: str | None = None,
  *,
  pad_id: int = -1,
) -> Callable[..., VerifyResult]:
  """Build a jitted, batched :func:`verify` whose ``p``/``q`` rows are split over ``vocab_axis``.

  This is the layout of a tensor-parallel LM head (as on TPU pods): every device
  holds ``V / n`` contiguous columns of every row. Per sequence only O(n) scalars
  cross devices: the ``2 * gamma`` gathered probabilities of the draft tokens (a
  ``psum`` of one contribution each), three row statistics for validity and the
  residual mass, ``n`` partial masses for the inverse-CDF sample (an ``all_gather``
  and a prefix over devices), and one candidate id (a ``pmax``). The accept scan
  (the same ``lax.while_loop`` as :func:`verify`) runs replicated on every device.
  Results equal the single-device :func:`verify` for the same uniforms except
  within float rounding of an interval boundary of the final sample.

  Args:
    mesh: a ``jax.sharding.Mesh``.
    vocab_axis: the mesh axis the vocabulary is split over; ``V`` must be divisible
      by its size.
    batch_axis: optional mesh axis the batch is split over (data parallel); the
      batch size must be divisible by its size.
    pad_id: int written into unused token slots.

  Returns:
    ``fn(p, q, draft, uniforms, num_draft=None) -> VerifyResult`` on batches:
    ``p`` ``(B, gamma + 1, V)``, ``q`` ``(B, gamma, V)``, ``draft`` ``(B, gamma)``,
    ``uniforms`` ``(B, gamma + 1)``, ``num_draft`` ``(B,)`` or ``None``. The
    result's fields have a leading ``B`` axis, sharded over ``batch_axis``.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> fn = vocab_parallel_verify(mesh, "model")
    >>> p = np.full((1, 3, 4), 0.25, np.float32); q = np.full((1, 2, 4), 0.25, np.float32)
    >>> fn(p, q, np.array([[1, 2]]), np.full((1, 3), 0.5, np.float32)).tokens.tolist()
    [[1, 2, 2]]

  Reference:
    Shoeybi et al., "Megatron-LM" (vocab-parallel output layer), arXiv:1909.08053;
    Leviathan, Kalman, Matias (2023), arXiv:2211.17192.
  """
  if vocab_axis not in mesh.axis_names:
    raise ValueError(
      f"vocab_parallel_verify: `vocab_axis` must name an axis of the mesh {mesh.axis_names}, "
      f"got {vocab_axis!r} instead."
    )
  if batch_axis is not None and batch_axis not in mesh.axis_names:
    raise ValueError(
      f"vocab_parallel_verify: `batch_axis` must name an axis of the mesh {mesh.axis_names}, "
      f"got {batch_axis!r} instead."
    )
  shards = mesh.shape[vocab_axis]
  rows = P(batch_axis, None, vocab_axis)
  per_seq = P(batch_axis, None)
  scalar = P(batch_axis)
  out_specs = VerifyResult(per_seq, scalar, scalar, scalar, scalar, scalar)

  def local(p, q, draft, uniforms, num_draft):
    vocab = p.shape[-1] * shards

    def one(p1, q1, d1, u1, n1):
      return verify_rows(p1, q1, d1, u1, n1, pad_id=pad_id, vocab=vocab, axis_name=vocab_axis)

    return jax.vmap(one)(p, q, draft, uniforms, num_draft)

  sharded = jax.shard_map(
    local, mesh=mesh, in_specs=(rows, rows, per_seq, per_seq, scalar), out_specs=out_specs
  )

  @jax.jit
  def fn(p, q, draft, uniforms, num_draft=None) -> VerifyResult:
    name = "vocab_parallel_verify"
    for arg, value, rank in (("p", p, 3), ("q", q, 3), ("draft", draft, 2),
                             ("uniforms", uniforms, 2)):
      if value.ndim != rank:
        raise ValueError(
          f"{name}: `{arg}` must be batched with rank {rank}, got shape {tuple(value.shape)}."
        )
    one = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in (p, q, draft, uniforms)]
    gamma, vocab = check_chain(name, *one)
    if vocab % shards:
      raise ValueError(
        f"{name}: V = {vocab} must be divisible by the {shards} devices of mesh axis "
        f"{vocab_axis!r}."
      )
    batch = p.shape[0]
    if num_draft is None:
      num_draft = jnp.full((batch,), gamma, jnp.int32)
    elif jnp.shape(num_draft) != (batch,):
      raise ValueError(
        f"{name}: `num_draft` must have shape (B,) = ({batch},), got {jnp.shape(num_draft)}."
      )
    args = (p, q, draft.astype(jnp.int32), uniforms, jnp.asarray(num_draft).astype(jnp.int32))
    specs = (rows, rows, per_seq, per_seq, scalar)
    args = tuple(_place(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs, strict=True))
    return sharded(*args)

  return fn
