"""The accept test of speculative sampling, written once for NumPy and JAX.

Every code path that decides whether a draft token is kept (the jitted scan in
:func:`specdec_jax.verify`, the host adapter :func:`specdec_jax.speculative_step`
that counts how many random numbers to draw) calls :func:`accepts`. Keeping the
rule in one function is what makes the adapter's draw count and the core's
decisions agree bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np


def _namespace(*xs: Any):
  """NumPy for host values, ``jax.numpy`` as soon as one argument is a JAX value."""
  for x in xs:
    if not isinstance(x, np.ndarray | np.generic | float | int | bool):
      return jnp
  return np


def acceptance_ratio(p_x, q_x):
  """The ratio ``p(x) / q(x)`` of the rule, with ``q(x) == 0`` made explicit.

  ``q(x) == 0`` with ``p(x) > 0`` gives ``inf`` (always accept), with ``p(x) == 0``
  gives ``0`` (never accept). No ``0 / 0`` is ever evaluated.

  Args:
    p_x: target probability of the draft token; any shape, floating dtype.
    q_x: draft probability of the same token; same shape and dtype.

  Returns:
    The ratio, same shape and dtype; ``NaN`` only if an input is ``NaN``.
  """
  xp = _namespace(p_x, q_x)
  positive_q = q_x > 0
  safe_q = xp.where(positive_q, q_x, xp.ones_like(q_x))
  inf = xp.full_like(p_x, xp.inf)
  zero = xp.zeros_like(p_x)
  return xp.where(positive_q, p_x / safe_q, xp.where(p_x > 0, inf, zero))


def accepts(u, p_x, q_x):
  """The accept test of Leviathan et al. (2023): ``u < p(x) / q(x)``.

  This is the only place in the library where the decision is made. It never
  accepts a token with ``p(x) == 0`` (also for ``u == 0``: ``0 < 0`` is false),
  accepts every token with ``p(x) > 0 == q(x)``, and never accepts when an input
  is ``NaN`` (every comparison with ``NaN`` is false).

  Args:
    u: uniform random number(s) in ``[0, 1)``, same dtype as ``p_x``.
    p_x: target probability of the draft token.
    q_x: draft probability of the draft token.

  Returns:
    Boolean array, ``True`` where the draft token is kept.

  Example:
    >>> bool(accepts(0.7, 0.5, 0.3))   # 0.7 < 1.67
    True
    >>> bool(accepts(0.7, 0.2, 0.5))   # 0.7 >= 0.4
    False

  Reference:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
    Decoding", ICML 2023, arXiv:2211.17192, Algorithm 1.
  """
  return u < acceptance_ratio(p_x, q_x)
