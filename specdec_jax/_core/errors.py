"""What went wrong, as bits: the error codes every jitted entry point reports, assembled once.

Under ``jax.jit`` values cannot raise. Every verifier and decoding loop therefore keeps its
outputs in range and reports problems as an :class:`ErrorCode` bit mask (``valid`` is
``error == 0``). The helpers here build those masks from the values a step actually read;
with an ``axis_name`` the statistics of a row split over a mesh axis are summed across it.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class ErrorCode(enum.IntFlag):
  """Bit flags in ``result.error``: what was wrong with the values a step read.

  Under ``jax.jit`` values cannot raise, so every returned id stays in ``[0, V)`` and
  problems are reported here instead. ``0`` means everything read was valid.
  """

  OK = 0
  NONFINITE = 1  #: a probability (or logit) that was read is NaN or infinite
  NEGATIVE = 2  #: a probability that was read is negative
  NOT_NORMALIZED = 4  #: a full row that was read does not sum to 1 (or a value exceeds 1)
  DRAFT_OUT_OF_RANGE = 8  #: a tested draft id is outside ``[0, V)``
  UNIFORM_OUT_OF_RANGE = 16  #: a uniform that was read is outside ``[0, 1)`` or NaN
  BAD_NUM_DRAFT = 32  #: ``num_draft`` (``num_nodes``) outside its range (it was clipped)
  BAD_PARAMS = 64  #: a sampling parameter, ``eos_id`` or tree parent was out of range (clipped)
  TOKEN_OUT_OF_RANGE = 128  #: a prompt token id outside ``[0, V)`` (decoding loops; clipped)
  OUT_OF_ROOM = 256  #: a row stopped because its buffer or the model's context was full
  BAD_LENGTH = 512  #: a prompt length outside ``[1, P]`` (loops; the row generates nothing)
  #: a row the final token would be drawn from allows no token (every adjusted logit masked,
  #: banned or ``-inf``): nothing is emitted from it (``num_tokens = num_accepted``)
  NO_ALLOWED_TOKEN = 1024
  #: a row's grammar (``grammar=`` in the loops) did not allow a token about to be emitted, or
  #: its initial state was outside the grammar's table: nothing outside the grammar is
  #: written, the row stops there
  GRAMMAR = 2048


def describe_error(code: int) -> str:
  """Human-readable text for an :class:`ErrorCode` bit mask (host side).

  Example:
    >>> describe_error(5)
    'NONFINITE|NOT_NORMALIZED'
  """
  code = int(code)
  if code == 0:
    return "OK"
  names = [flag.name for flag in ErrorCode if flag and code & flag]
  return "|".join(names)


def row_tolerance(dtype) -> float:
  """How far from 1 a row's sum may be: ``sqrt(eps)`` of the input's dtype.

  float64: 1.5e-8, float32: 3.5e-4, float16: 3.1e-2, bfloat16: 8.8e-2.
  """
  return float(np.sqrt(float(jnp.finfo(dtype).eps)))


def flag(condition: jax.Array, code: ErrorCode) -> jax.Array:
  """``code`` where ``condition`` holds, else 0 (int32, the shape of ``condition``)."""
  return jnp.where(condition, jnp.int32(code.value), jnp.int32(0))


def or_reduce(codes: jax.Array) -> jax.Array:
  """Bitwise OR of all entries of an int32 array (one reduction)."""
  return lax.reduce(codes, jnp.int32(0), lax.bitwise_or, tuple(range(codes.ndim)))


def psum_if(x: jax.Array, axis_name: str | None) -> jax.Array:
  """``lax.psum`` over ``axis_name``, or ``x`` itself on one device."""
  return x if axis_name is None else lax.psum(x, axis_name)


def value_codes(values: jax.Array, tol: float) -> jax.Array:
  """Per-entry error bits of probabilities that must lie in ``[0, 1]`` (int32, same shape)."""
  return (
    flag(~jnp.isfinite(values), ErrorCode.NONFINITE)
    | flag(values < 0, ErrorCode.NEGATIVE)
    | flag(values > 1 + tol, ErrorCode.NOT_NORMALIZED)
  )


def stop_row_error(masses, p_sum, q_sum, rejected, tol, axis_name=None) -> jax.Array:
  """Error bits of the stop row(s) from the fused passes' results.

  ``masses`` are block sums in which a negative entry was replaced by ``-inf``: a NaN or
  ``+inf`` sum flags NONFINITE, ``-inf`` flags NEGATIVE. The sums of ``p[n]`` (and of
  ``q[n]`` after a rejection) must be 1 within ``tol``.
  """
  nonfinite = psum_if(jnp.sum(jnp.isnan(masses) | (masses == jnp.inf), dtype=jnp.int32),
                      axis_name) > 0
  nonfinite = (nonfinite | jnp.isnan(p_sum) | (p_sum == jnp.inf)
               | (rejected & ~jnp.isfinite(q_sum)))
  negative = (psum_if(jnp.sum(masses == -jnp.inf, dtype=jnp.int32), axis_name) > 0) | (
    p_sum == -jnp.inf)
  off = (jnp.abs(p_sum - 1) > tol) | (rejected & (jnp.abs(q_sum - 1) > tol))
  return (
    flag(nonfinite, ErrorCode.NONFINITE)
    | flag(negative, ErrorCode.NEGATIVE)
    | flag(~nonfinite & ~negative & off, ErrorCode.NOT_NORMALIZED)
  )


def uniform_codes(uniforms: jax.Array, read: jax.Array) -> jax.Array:
  """UNIFORM_OUT_OF_RANGE where a uniform that was ``read`` is outside ``[0, 1)`` or NaN."""
  return flag(read & ~((uniforms >= 0) & (uniforms < 1)), ErrorCode.UNIFORM_OUT_OF_RANGE)
