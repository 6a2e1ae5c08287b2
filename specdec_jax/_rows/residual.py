"""The one residual pass: a fused read of a stop row's ``p`` (and ``q``) slices.

Every rule ends the same way: after a rejection it samples from a residual
``max(a p - c q, 0)`` (token-wise: ``a = c = 1``; block: ``a = b_i``; tree: ``c`` grows with
each rejected sibling, and the weights of tokens rejected there are overwritten); after
acceptance of everything it samples from ``p``. :func:`residual_pass` reads the row(s) once and
returns what sampling and the validity checks need: block masses of the weights (a negative
input entry becomes ``-inf``, so the sum reveals it; NaN propagates), block masses of ``p``
(its total checks normalisation, and it is the fallback when the residual is empty) and the
sum of ``q``. The final token then reads one 256-entry block again
(:func:`~specdec_jax._core.sampling.sample_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax._core.sampling import block_masses


class RowStats(NamedTuple):
  """What one fused pass over a stop row gives.

  Attributes:
    masses: ``(ceil(V / block),)`` block sums of the sampling weights, a negative input entry
      replaced by ``-inf`` (NaN propagates).
    p_masses: ``(ceil(V / block),)`` block sums of ``p``, negative entries as ``-inf``.
    q_sum: ``()`` sum of the ``q`` row (0 without one).
  """

  masses: jax.Array
  p_masses: jax.Array
  q_sum: jax.Array


def weights(p_part, q_part, dtype, *, a=None, c=None, adjust: Callable | None = None):
  """Sampling weights of a slice: ``max(a p - c q, 0)`` (``max(p, 0)`` without ``q``).

  ``a``/``c`` None mean 1 (no multiplication: bit-identical to ``p - q``). ``adjust(values)``
  overwrites some entries (the tree's frozen weights of rejected tokens). Unsanitised: NaN
  propagates, negative inputs are the caller's to poison or zero.
  """
  p_part = p_part.astype(dtype)
  if a is not None:
    p_part = a * p_part
  if q_part is None:
    values = jnp.maximum(p_part, 0)
  else:
    q_part = q_part.astype(dtype)
    values = jnp.maximum(p_part - (q_part if c is None else c * q_part), 0)
  return values if adjust is None else adjust(values)


def residual_pass(p_row, q_row, *, block: int, dtype, a=None, c=None,
                  adjust: Callable | None = None) -> RowStats:
  """One read of ``p_row`` (and ``q_row``): :class:`RowStats` of ``max(a p - c q, 0)``.

  Without ``q_row`` and ``adjust`` the weights are ``p`` itself and ``masses`` is ``p_masses``.
  """
  p_row = p_row.astype(dtype)
  poisoned_p = jnp.where(p_row < 0, -jnp.inf, p_row)
  p_masses = block_masses(poisoned_p, block)
  if q_row is None and adjust is None and a is None:
    return RowStats(p_masses, p_masses, jnp.zeros_like(p_row[0]))
  values = weights(p_row, q_row, dtype, a=a, c=c, adjust=adjust)
  negative = p_row < 0 if q_row is None else (p_row < 0) | (q_row < 0)
  masses = block_masses(jnp.where(negative, -jnp.inf, values), block)
  q_sum = jnp.zeros_like(p_row[0]) if q_row is None else jnp.sum(q_row.astype(dtype))
  return RowStats(masses, p_masses, q_sum)


def clean_masses(masses: jax.Array) -> jax.Array:
  """Block masses fit for sampling: NaN, infinite and non-positive ones count as 0."""
  return jnp.where(jnp.isfinite(masses) & (masses > 0), masses, 0)
