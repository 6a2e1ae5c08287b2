"""Randomness, one way everywhere: ``key=`` (one key, or one key per request) or ``uniforms=``.

Every verifier reads its random numbers from a ``uniforms`` array whose slots are documented
per rule. Instead of the array, a caller may pass ``key=``: one ``jax.random`` key, or (for
batched layouts) ``B`` keys, one per request, which makes each request's result independent
of the batch it is in. :func:`draw_uniforms` draws the array. :func:`key_twin` generates the
``*_with_key(key, ...)`` form of a one-sequence verifier from the verifier itself.
"""

from __future__ import annotations

import contextvars
import functools
import inspect

import jax
import jax.numpy as jnp

from specdec_jax._checks import PublicJit
from specdec_jax._checks import check_key
from specdec_jax._checks import compute_dtype
from specdec_jax._checks import public_jit

_NAME = contextvars.ContextVar("specdec_jax_entry_name", default=None)


def entry_name(default: str) -> str:
  """The public name a call came in by (the ``*_with_key`` twin's, while it runs), for messages."""
  return _NAME.get() or default


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


def key_twin(fn: PublicJit, example: str) -> PublicJit:
  """``<fn>_with_key(key, *args, **kwargs)``: ``fn(*args, key=key, **kwargs)``, generated.

  The twin's signature is ``fn``'s with ``key`` first and without ``uniforms``; its messages
  name the twin. ``example`` is the docstring's doctest.
  """
  body = fn.__wrapped__
  name = f"{fn.__name__}_with_key"
  signature = inspect.signature(body)
  params = [inspect.Parameter("key", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
    p for n, p in signature.parameters.items() if n not in ("key", "uniforms")]
  twin_signature = signature.replace(parameters=params)

  def twin(*args, **kwargs):
    bound = twin_signature.bind(*args, **kwargs)
    token = _NAME.set(name)
    try:
      return body(**bound.arguments)
    finally:
      _NAME.reset(token)

  twin.__signature__ = twin_signature
  twin.__name__ = twin.__qualname__ = name
  twin.__module__ = body.__module__
  twin.__doc__ = f""":func:`{fn.__name__}` with its uniforms drawn from ``key`` (generated).

  ``{name}(key, *args, **kwargs)`` is ``{fn.__name__}(*args, key=key, **kwargs)``: the
  uniforms are ``jax.random.uniform(key, (count,), dtype)`` in the computation dtype (float32
  for float32/float16/bfloat16 inputs, float64 under x64), all drawn whether read or not, so
  results are reproducible per key. For a batch split the key, one per sequence:
  ``jax.vmap({name})(jax.random.split(key, B), ...)``. A uniform of exactly 0 can occur
  (probability ``2**-23`` per draw in float32); the rule never accepts a token of target
  probability 0 for it.

  Args:
    key: one ``jax.random`` key (typed ``jax.random.key`` or raw ``PRNGKey``).
    *args, **kwargs: as in :func:`{fn.__name__}`, without ``uniforms``.

  Returns:
    What :func:`{fn.__name__}` returns.

  Example:
{example}
  """
  return public_jit(twin, arrays=fn.arrays, static_argnames=fn.static_argnames, name=name)
