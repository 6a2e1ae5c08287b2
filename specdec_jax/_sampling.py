"""Inverse-CDF sampling from an unnormalised row of weights, in JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def last_positive_index(weights: jax.Array) -> jax.Array:
  """Largest index whose weight is ``> 0``; ``0`` if there is none. Shape ``()`` int32."""
  size = weights.shape[-1]
  reversed_hit = jnp.argmax(weights[::-1] > 0).astype(jnp.int32)
  return jnp.int32(size - 1) - reversed_hit


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
  w = jnp.where(weights > 0, weights, jnp.zeros_like(weights))
  cdf = jnp.cumsum(w)
  hit = u * cdf[-1] < cdf
  first = jnp.argmax(hit).astype(jnp.int32)
  # XLA may evaluate the cumulative sum as a parallel prefix, whose rounding differs
  # from index to index: a zero-weight entry can then carry a larger partial sum than
  # the positive entry before it. Snap the hit back to the last positive index <= it.
  index = jnp.arange(w.shape[-1], dtype=jnp.int32)
  snapped = jnp.max(jnp.where((w > 0) & (index <= first), index, -1))
  first_positive = jnp.argmax(w > 0).astype(jnp.int32)
  found = jnp.where(snapped >= 0, snapped, first_positive)
  return jnp.where(jnp.any(hit), found, last_positive_index(w))
