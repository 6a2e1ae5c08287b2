"""Inverse-CDF sampling from an unnormalised row of weights in JAX, on one device or sharded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def last_positive_index(weights: jax.Array) -> jax.Array:
  """Largest index whose weight is ``> 0``; ``size - 1`` if none is. Shape ``()`` int32."""
  size = weights.shape[-1]
  reversed_hit = jnp.argmax(weights[::-1] > 0).astype(jnp.int32)
  return jnp.int32(size - 1) - reversed_hit


def _sanitize(weights: jax.Array) -> jax.Array:
  """NaN and negative weights count as 0."""
  return jnp.where(weights > 0, weights, jnp.zeros_like(weights))


def _first_hit(w: jax.Array, cdf: jax.Array, target: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(any, k)``: the smallest ``k`` with ``target < cdf[k]``, snapped to a positive weight.

  XLA may evaluate a cumulative sum as a parallel prefix whose rounding differs
  from index to index, so a zero-weight entry can carry a larger partial sum than
  the positive entry before it. The hit is snapped back to the last positive index
  at or before it (the interval it really belongs to).
  """
  hit = target < cdf
  first = jnp.argmax(hit).astype(jnp.int32)
  index = jnp.arange(w.shape[-1], dtype=jnp.int32)
  snapped = jnp.max(jnp.where((w > 0) & (index <= first), index, -1))
  first_positive = jnp.argmax(w > 0).astype(jnp.int32)
  return jnp.any(hit), jnp.where(snapped >= 0, snapped, first_positive)


def sample_index(weights: jax.Array, u: jax.Array) -> jax.Array:
  """Inverse-CDF sample from unnormalised ``weights`` with one uniform ``u``.

  Returns the smallest ``k`` with ``u * total < cumsum(weights)[k]`` where
  ``total = cumsum(weights)[-1]``: this is SPEC.md's ``u < cumsum(probs)[k]`` with
  ``probs = weights / total``, without dividing the row. If rounding leaves
  ``u * total`` at or above every cumulative sum (or ``u`` is not in ``[0, 1)``),
  the largest index with positive weight is returned. Entries that are NaN or
  negative are treated as 0, so a weight-0 id is never returned while any weight
  is positive, and the result is always in ``[0, V)``.

  Args:
    weights: shape ``(V,)``, floating, ``V >= 1``; need not sum to 1.
    u: scalar uniform in ``[0, 1)``, same dtype as ``weights``.

  Returns:
    int32 scalar in ``[0, V)``.

  Example:
    >>> int(sample_index(jnp.array([0.3, 0.3, 0.4]), jnp.float32(0.1)))
    0
  """
  w = _sanitize(weights)
  cdf = jnp.cumsum(w)
  found, index = _first_hit(w, cdf, u * cdf[-1])
  return jnp.where(found, index, last_positive_index(w))


def sample_index_sharded(weights: jax.Array, u: jax.Array, axis_name: str) -> jax.Array:
  """:func:`sample_index` over a row whose vocabulary is split across the devices of ``axis_name``.

  Call inside ``shard_map``: each device holds a contiguous ``V / n`` slice of the
  row (device ``d`` holds ids ``d * V/n .. (d+1) * V/n - 1``). Only ``n`` partial
  masses and one candidate id per device cross devices: the masses are gathered,
  a prefix over them picks the device whose slice contains ``u * total``, that
  device runs the inverse CDF on its slice, and a ``pmax`` returns the id. The
  result equals :func:`sample_index` on the gathered row except within float
  rounding of an interval boundary.

  Args:
    weights: ``(V / n,)`` this device's slice, floating.
    u: scalar uniform in ``[0, 1)``, the same on every device.
    axis_name: the mesh axis the vocabulary is split over.

  Returns:
    int32 scalar global id in ``[0, V)``, the same on every device.
  """
  w = _sanitize(weights)
  local_size = w.shape[-1]
  me = lax.axis_index(axis_name)
  cdf = jnp.cumsum(w)
  masses = lax.all_gather(cdf[-1], axis_name)  # (n,)
  prefix = jnp.cumsum(masses)
  before = prefix - masses
  found, owner = _first_hit(masses, prefix, u * prefix[-1])
  owner = jnp.where(found, owner, last_positive_index(masses))
  local_found, local_index = _first_hit(w, cdf, u * prefix[-1] - before[me])
  local_index = jnp.where(local_found, local_index, last_positive_index(w))
  candidate = jnp.where(me == owner, me.astype(jnp.int32) * local_size + local_index, -1)
  return lax.pmax(candidate, axis_name)
