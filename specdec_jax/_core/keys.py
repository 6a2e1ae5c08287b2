"""Randomness, one way everywhere: ``key=`` (one key, or one key per request) or ``uniforms=``.

Every verifier reads its random numbers from a ``uniforms`` array whose slots are documented
per rule. Instead of the array, a caller may pass ``key=``: one ``jax.random`` key, or (for
batched layouts) ``B`` keys, one per request, which makes each request's result independent
of the batch it is in. :func:`draw_uniforms` draws the array. (The ``*_with_key(key, ...)``
twins of the one-sequence verifiers were removed before 1.0: ``key=`` is the one form.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdec_jax._core.checks import check_key
from specdec_jax._core.checks import compute_dtype


def key_uniforms(fn: str, key, count: int, dtype) -> jax.Array:
  """``count`` uniforms in ``[0, 1)`` of ``dtype`` from one ``key``."""
  check_key(fn, key)
  return jax.random.uniform(key, (count,), dtype=dtype)


def draw_uniforms(name: str, key, batch: int, count: int, dtype) -> jax.Array:
  """``(B, count)`` uniforms from one key, or from ``B`` keys (row ``i`` from key ``i``).

  One key: ``uniform(key, (B, count))``. ``B`` keys: ``uniform(key_i, (count,))`` per row,
  which is what ``jax.vmap`` of a one-sequence verifier's ``key=`` form draws.
  """
  dtype_of = getattr(key, "dtype", None)
  shape = tuple(getattr(key, "shape", ()))
  typed = dtype_of is not None and jnp.issubdtype(dtype_of, jax.dtypes.prng_key)
  if (typed and shape == ()) or (dtype_of == jnp.uint32 and shape == (2,)):
    return jax.random.uniform(key, (batch, count), dtype=dtype)
  if (typed and shape == (batch,)) or (dtype_of == jnp.uint32 and shape == (batch, 2)):
    return jax.vmap(lambda k: jax.random.uniform(k, (count,), dtype=dtype))(key)
  # (Under jit every array is a tracer: its dtype and shape say what was passed, its type not.)
  what = type(key).__name__ if dtype_of is None else "an array"
  raise TypeError(f"{name}: `key` must be one jax.random key or B = {batch} keys (one per "
                  f"request), got {what} of dtype {dtype_of} and shape {shape} instead.")


@functools.partial(jax.jit, static_argnames=("name", "batch", "count", "dtype"))
def _draw(key, *, name: str, batch: int, count: int, dtype) -> jax.Array:
  return draw_uniforms(name, key, batch, count, dtype)


def uniforms_first(name: str, key, uniforms, batch, count: int, dtypes):
  """``(key, uniforms)`` with the key turned into its uniforms before its body.

  The batched entry points (packed, packed tree, vocabulary-parallel) draw from ``key`` in a
  small jitted program of their own and pass the array to the body, so that one compiled body
  serves all three randomness sources (``uniforms=``, one key, ``B`` keys); inside an outer
  ``jit`` both are traced into the caller's program alike. The uniforms are those
  :func:`draw_uniforms` gives (``dtype``: :func:`compute_dtype` of ``dtypes``). Returns
  ``(key, uniforms)`` unchanged without a key, or when the shapes or dtypes are ones the body
  will refuse with its own message (``batch`` not an int, a dtype not floating).
  """
  if (key is None or not isinstance(batch, int)
      or not all(jnp.issubdtype(d, jnp.floating) for d in dtypes)):
    return key, uniforms
  dtype = compute_dtype(*dtypes)
  return None, _draw(key, name=name, batch=batch, count=count, dtype=jnp.dtype(dtype))


def one_source(name: str, key, uniforms, uniforms_name: str = "uniforms") -> None:
  """Raise unless exactly one of ``key`` and ``uniforms`` is given."""
  if (key is None) == (uniforms is None):
    raise ValueError(f"{name}: pass exactly one of `key` and `{uniforms_name}`, got "
                     f"{'both' if key is not None else 'neither'}.")
