"""Inverse-CDF sampling from an unnormalised row of weights in JAX, on one device or sharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import check_array
from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.checks import public_jit


def sanitize(weights: jax.Array) -> jax.Array:
  """NaN and negative weights count as 0."""
  return jnp.where(weights > 0, weights, jnp.zeros_like(weights))


def first_hit(w: jax.Array, cdf: jax.Array, target: jax.Array) -> jax.Array:
  """The smallest ``k`` with ``target < cdf[k]``, snapped to a positive weight.

  XLA may evaluate a cumulative sum as a parallel prefix whose rounding differs
  from index to index, so a zero-weight entry can carry a larger partial sum than
  the positive entry before it: the hit is snapped back to the last positive index
  at or before it (the interval it really belongs to). If there is no hit (rounding
  at the top, or ``target`` past the total), the last positive index is returned;
  if no weight is positive, 0. One ``argmax`` over a priority score does the snapping.
  """
  size = w.shape[-1]
  hit = target < cdf
  first = jnp.argmax(hit).astype(jnp.int32)
  first = jnp.where(hit[first], first, size - 1)
  index = jnp.arange(size, dtype=jnp.int32)
  # Positive entries at or before `first` rank highest (the later the better), then
  # positive entries after it (the earlier the better), then everything else.
  score = jnp.where(w > 0, jnp.where(index <= first, size + index, size - 1 - index), -1)
  return jnp.argmax(score).astype(jnp.int32)


BLOCK = 256  #: block size of the two-level inverse CDF


def block_masses(w: jax.Array, block: int) -> jax.Array:
  """Sums of consecutive ``block``-sized slices of ``w`` (the last one may be shorter)."""
  size = w.shape[-1]
  full = size // block
  parts = []
  if full:
    parts.append(w[: full * block].reshape(full, block).sum(axis=-1))
  if size % block:
    parts.append(w[full * block :].sum(keepdims=True))
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def block_start(index: jax.Array, size: int, block: int) -> tuple[jax.Array, jax.Array]:
  """``(lo, start)``: block ``index`` covers ``[lo, lo + block)``; a ``block``-long slice
  from ``start = min(lo, size - block)`` holds it (ids below ``lo`` must be masked)."""
  lo = index.astype(jnp.int32) * block
  return lo, jnp.minimum(lo, size - block)


def mask_block(values: jax.Array, lo: jax.Array, start: jax.Array) -> jax.Array:
  """Zero the entries of a slice taken at ``start`` that belong to the block before ``lo``."""
  ids = start + jnp.arange(values.shape[-1], dtype=jnp.int32)
  return jnp.where(ids >= lo, values, jnp.zeros_like(values))


def pick_block(masses: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(b, local_target)``: the block whose interval holds ``target`` and the rest of ``target``.

  ``masses`` must be non-negative. Past the total (rounding), the last block of
  positive mass is chosen and ``local_target`` is past its mass too.
  """
  prefix = jnp.cumsum(masses)
  b = first_hit(masses, prefix, target)
  return b, target - (prefix[b] - masses[b])


def pick_in_block(values: jax.Array, target: jax.Array) -> jax.Array:
  """First ``k`` with ``target < cumsum(values)[k]`` (snapped to a positive value); else the last
  positive value. ``values`` must be non-negative."""
  return first_hit(values, jnp.cumsum(values), target)


def two_level_inverse_cdf(w: jax.Array, target: jax.Array, block: int = BLOCK) -> jax.Array:
  """First ``k`` with ``target < cumsum(w)[k]`` of non-negative ``w``, without a full cumsum.

  Block masses (one pass over ``w``), a prefix over the ``ceil(V / block)``
  masses, then a cumulative sum inside the one block that contains ``target``.
  Hits are snapped to positive weights at both levels; if ``target`` is at or past
  the total, the last positive entry is returned. Result in ``[0, V)``.
  """
  size = w.shape[-1]
  block = min(block, size)
  b, rest = pick_block(block_masses(w, block), target)
  lo, start = block_start(b, size, block)
  values = mask_block(lax.dynamic_slice_in_dim(w, start, block), lo, start)
  return start + pick_in_block(values, rest)


@public_jit(arrays={"weights": FLOAT, "u": FLOAT})
def sample_index(weights: jax.Array, u: jax.Array) -> jax.Array:
  """Inverse-CDF sample from unnormalised ``weights`` with one uniform ``u`` (jitted).

  Returns the smallest ``k`` with ``u * total < cumsum(weights)[k]``, where
  ``total`` is the sum of the weights: the inverse CDF ``u < cumsum(probs)[k]`` with
  ``probs = weights / total``, without dividing the row. If rounding leaves
  ``u * total`` at or above every cumulative sum (or ``u`` is not in ``[0, 1)``),
  the largest index with positive weight is returned. Entries that are NaN or
  negative are treated as 0, so a weight-0 id is never returned while any weight
  is positive, and the result is always in ``[0, V)``.

  No cumulative sum over the whole row is formed: the row is cut into blocks of
  256, a prefix runs over the block masses and a cumulative sum inside the one
  block that holds ``u * total``. That is one pass over the row plus one block,
  and float32 partial sums over at most 256 entries (no drift over 128k-entry rows).

  Args:
    weights: shape ``(V,)``, floating, ``V >= 1``; need not sum to 1. float16 and
      bfloat16 rows are summed in float32.
    u: floating scalar uniform in ``[0, 1)``.

  Returns:
    int32 scalar in ``[0, V)``.

  Example:
    >>> int(sample_index(jnp.array([0.3, 0.3, 0.4]), jnp.float32(0.1)))
    0
    >>> int(sample_index([0.2, 0.0, 0.3, 0.5], 0.6))   # lists work too
    3

  Reference:
    The inverse transform method (Devroye 1986, Section 2.1).
  """
  check_array("sample_index", "weights", weights, 1, FLOAT)
  check_array("sample_index", "u", u, 0, FLOAT, batch_hint=True)
  if weights.shape[0] < 1:
    raise ValueError(f"sample_index: `weights` must have V >= 1 entries, got shape "
                     f"{tuple(weights.shape)}.")
  dtype = compute_dtype(weights.dtype)
  w = sanitize(weights.astype(dtype))
  total = jnp.sum(block_masses(w, min(BLOCK, w.shape[-1])))
  return two_level_inverse_cdf(w, u.astype(dtype) * total)


def sample_index_sharded(weights: jax.Array, u: jax.Array, axis_name: str) -> jax.Array:
  """:func:`sample_index` over a row whose vocabulary is split across the devices of ``axis_name``.

  Call inside ``shard_map``: each device holds a contiguous ``V / n`` slice of the
  row (device ``d`` holds ids ``d * V/n .. (d+1) * V/n - 1``). Only ``n`` partial
  masses and one candidate id per device cross devices: the masses are gathered,
  a prefix over them picks the device whose slice contains ``u * total``, that
  device runs the two-level inverse CDF on its slice, and a ``pmax`` returns the
  id. The result equals :func:`sample_index` on the gathered row except within
  float rounding of an interval boundary.

  Args:
    weights: ``(V / n,)`` this device's slice, floating.
    u: scalar uniform in ``[0, 1)``, the same on every device.
    axis_name: the mesh axis the vocabulary is split over.

  Returns:
    int32 scalar global id in ``[0, V)``, the same on every device.
  """
  w = sanitize(weights)
  masses = block_masses(w, min(BLOCK, w.shape[-1]))
  return sharded_inverse_cdf(
    masses, lambda lo, start, size: mask_block(lax.dynamic_slice_in_dim(w, start, size), lo, start),
    u, w.shape[-1], axis_name)


def sharded_inverse_cdf(masses, block_values, u, local_size: int, axis_name: str) -> jax.Array:
  """Two-level inverse CDF over a vocabulary split across ``axis_name`` (inside ``shard_map``).

  ``masses`` are this device's block masses (non-negative) and
  ``block_values(lo, start, size)`` returns the masked weights of one local block.
  """
  block = min(BLOCK, local_size)
  me = lax.axis_index(axis_name).astype(jnp.int32)
  device_masses = lax.all_gather(jnp.sum(masses), axis_name)  # (n,)
  owner, rest = pick_block(device_masses, u * jnp.sum(device_masses))
  rest = jnp.where(me == owner, rest, 0)
  b, rest = pick_block(masses, rest)
  lo, start = block_start(b, local_size, block)
  k = start + pick_in_block(block_values(lo, start, block), rest)
  candidate = jnp.where(me == owner, me * local_size + k, -1)
  return lax.pmax(candidate, axis_name)


def sample_blocks(masses, block_values, u, local_size: int,
                  axis_name: str | None = None) -> jax.Array:
  """The final token of every verifier: a two-level inverse CDF over clean block masses.

  ``masses`` are the (non-negative) block masses of the sampling weights and
  ``block_values(lo, start, size)`` the masked weights of one block; the block is picked on
  ``u * sum(masses)`` and only that block is read. With ``axis_name`` the vocabulary is split
  over that mesh axis (:func:`sharded_inverse_cdf`). Returns an int32 id (global).
  """
  if axis_name is not None:
    return sharded_inverse_cdf(masses, block_values, u, local_size, axis_name)
  b, rest = pick_block(masses, u * jnp.sum(masses))
  lo, start = block_start(b, local_size, min(BLOCK, local_size))
  return start + pick_in_block(block_values(lo, start, min(BLOCK, local_size)), rest)
