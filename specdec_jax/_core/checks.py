"""Argument checks shared by every public entry point, written once.

Three kinds of checks, in the order a call meets them:

1. **Host conversion** (:func:`host_array`, applied by :func:`public_jit` before a jitted
   function is entered): Python lists and NumPy arrays become NumPy arrays of a kind JAX
   can hold, with an error that names the function and the argument for ragged nested
   sequences, strings, ``float128`` or complex values, and for integer ids that would change
   when cast to int32 (a NumPy int64 id ``2**32 + 1`` would silently become ``1``). JAX
   arrays and tracers pass through untouched: their values are checked under ``jit``.
2. **Trace-time checks** (:func:`check_array`, :func:`check_num_draft`, ...): ranks, shapes
   and dtypes, which are static, so a mistake raises before anything runs.
3. **Value checks under jit**: the verifiers cannot raise on traced values; they keep every
   id in range and set :class:`~specdec_jax.ErrorCode` bits instead (see ``_core/errors.py``).

Host functions that are not jitted (the decoding loops, :func:`~specdec_jax.process_logits`,
:func:`~specdec_jax.speculative_step`) also read *concrete* values (:func:`is_concrete`) and
raise on them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

FLOAT = "float"  #: an array of a floating dtype (probabilities, logits, uniforms)
INT = "int"  #: an array of an integer dtype (token ids, counts)
KEY = "key"  #: a jax.random key

_INT32 = np.iinfo(np.int32)


def compute_dtype(*dtypes) -> jnp.dtype:
  """The dtype the rule is computed in: the promoted input dtype, at least float32."""
  dtype = jnp.dtype(dtypes[0])
  for other in dtypes[1:]:
    dtype = jnp.promote_types(dtype, other)
  if jnp.dtype(dtype).itemsize < 4:
    return jnp.dtype(jnp.float32)
  return jnp.dtype(dtype)


def is_concrete(x) -> bool:
  """True when ``x``'s value can be read on this host: not traced and fully addressable.

  A global array that spans devices of several processes (multi-host) is not readable here;
  its values are checked under ``jit`` like a traced value's.
  """
  if isinstance(x, jax.core.Tracer):
    return False
  if isinstance(x, jax.Array):
    return x.is_fully_addressable
  return True


def is_host_value(x) -> bool:
  """True for Python numbers, sequences and NumPy values (anything that is not a JAX value)."""
  return not isinstance(x, jax.Array | jax.core.Tracer | jax.ShapeDtypeStruct)


def host_array(fn: str, arg: str, x, kind: str):
  """``x`` as a NumPy array of a dtype JAX holds, when ``x`` is a host value; else ``x``.

  Args:
    fn: the public function's name, for messages.
    arg: the argument's name, for messages.
    x: the value; JAX arrays, tracers and ``None`` are returned unchanged.
    kind: :data:`FLOAT`, :data:`INT` or :data:`KEY`.

  Returns:
    A NumPy array (integer arrays of size 0 as int32), or ``x`` unchanged.

  Raises:
    ValueError: ragged nested sequences; integer values outside int32.
    TypeError: non-numeric values, ``float128``, complex values, the wrong kind.
  """
  if x is None or not is_host_value(x):
    return x
  if kind == KEY:
    if isinstance(x, np.ndarray) and x.dtype == np.uint32 and x.ndim == 1:
      return x  # a raw key held in NumPy
    raise TypeError(
      f"{fn}: `key` must be a jax.random key (jax.random.key(seed)), got "
      f"{type(x).__name__} {x!r:.40} instead."
    )
  try:
    array = np.asarray(x)
  except (ValueError, TypeError):
    raise ValueError(
      f"{fn}: `{arg}` must be a rectangular array (nested sequences of equal lengths), got a "
      f"ragged {type(x).__name__} instead."
    ) from None
  check_host_dtype(fn, arg, array, kind)
  if kind == INT:
    if array.size == 0:
      return array.astype(np.int32)
    check_fits_int32(fn, arg, array)
  return array


def check_host_dtype(fn: str, arg: str, array: np.ndarray, kind: str) -> None:
  """Raise ``TypeError`` unless ``array``'s dtype is of ``kind`` and representable in JAX."""
  dtype = array.dtype
  if dtype.kind == "c":
    raise TypeError(f"{fn}: `{arg}` must hold real numbers, got dtype {dtype} instead.")
  floating = jnp.issubdtype(dtype, jnp.floating)  # NumPy's kind of bfloat16 is "V"
  if not floating and dtype.kind not in "biu":
    raise TypeError(
      f"{fn}: `{arg}` must be a numeric array, got dtype {dtype} ({type(array).__name__}) "
      "instead."
    )
  if kind == FLOAT:
    if not floating:
      raise TypeError(f"{fn}: `{arg}` must have a floating dtype, got {dtype} instead.")
    if dtype.itemsize > 8:
      raise TypeError(
        f"{fn}: `{arg}` has dtype {dtype}, which JAX does not support; convert it to float64 "
        "(with jax_enable_x64) or float32."
      )
  elif kind == INT and dtype.kind not in "iu":
    raise TypeError(f"{fn}: `{arg}` must have an integer dtype, got {dtype} instead.")


def check_fits_int32(fn: str, arg: str, array: np.ndarray) -> None:
  """Raise ``ValueError`` if an integer host array holds a value that int32 cannot represent.

  The library computes ids in int32; a wider value would wrap around silently when cast
  (``2**32 + 1`` becomes ``1``), so it is refused before the cast.
  """
  if array.dtype.itemsize < 4 or array.dtype == np.int32 or array.size == 0:
    return
  bad = (array < _INT32.min) | (array > _INT32.max)
  if np.any(bad):
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    where = f" at index {index}" if array.ndim else ""
    raise ValueError(
      f"{fn}: `{arg}` must hold values that fit in int32 (ids and counts are int32), got "
      f"{int(array[index])}{where} ({array.dtype})."
    )


def check_array(fn: str, arg: str, value, rank: int, kind: str, *, batch_hint: bool = True):
  """Trace-time check of one array argument: it is an array of ``rank`` and ``kind``."""
  if not hasattr(value, "ndim") or not hasattr(value, "dtype"):
    raise TypeError(f"{fn}: `{arg}` must be an array, got {type(value).__name__} instead.")
  if value.ndim != rank:
    hint = f" For a batch, use jax.vmap({fn})." if batch_hint and value.ndim > rank else ""
    raise ValueError(
      f"{fn}: `{arg}` must have rank {rank}, got shape {tuple(value.shape)} "
      f"(rank {value.ndim}) instead.{hint}"
    )
  if kind == FLOAT and not jnp.issubdtype(value.dtype, jnp.floating):
    raise TypeError(f"{fn}: `{arg}` must have a floating dtype, got {value.dtype} instead.")
  if kind == INT and not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"{fn}: `{arg}` must have an integer dtype, got {value.dtype} instead.")


def check_scalar(fn: str, arg: str, value, kind: str) -> None:
  """Trace-time check of an optional per-sequence scalar (``num_draft``, ``num_nodes``)."""
  if value is None:
    return
  shape = jnp.shape(value)
  if shape != ():
    raise ValueError(
      f"{fn}: `{arg}` must be a scalar (one sequence; use jax.vmap for a batch), got shape "
      f"{shape} instead."
    )
  dtype = jnp.result_type(value)
  if kind == INT and not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{fn}: `{arg}` must be an integer, got dtype {dtype} instead.")


def check_chain(fn: str, p, q, draft, uniforms,
                names: tuple[str, str] = ("p", "q")) -> tuple[int, int]:
  """Trace-time checks of a chain verifier's arrays. Returns ``(gamma, V)``.

  ``p`` is ``(gamma + 1, V)``, ``q`` ``(gamma, V)``, ``draft`` ``(gamma,)`` and ``uniforms``
  ``(gamma + 1,)`` (``uniforms=None`` skips its check: the ``key=`` forms draw them;
  ``q=None`` means point-mass drafts).
  """
  pn, qn = names
  check_array(fn, pn, p, 2, FLOAT)
  if q is not None:
    check_array(fn, qn, q, 2, FLOAT)
  check_array(fn, "draft", draft, 1, INT)
  if uniforms is not None:
    check_array(fn, "uniforms", uniforms, 1, FLOAT)
  gamma = draft.shape[0]
  vocab = p.shape[1]
  if vocab < 1:
    raise ValueError(f"{fn}: `{pn}` must have V >= 1 columns, got shape {tuple(p.shape)}.")
  if p.shape[0] != gamma + 1:
    raise ValueError(
      f"{fn}: `{pn}` must have shape (gamma + 1, V) = ({gamma + 1}, {vocab}) for gamma = "
      f"{gamma} (the length of `draft`), got {tuple(p.shape)} instead."
    )
  if q is not None and tuple(q.shape) != (gamma, vocab):
    raise ValueError(
      f"{fn}: `{qn}` must have shape (gamma, V) = ({gamma}, {vocab}) for gamma = {gamma} "
      f"(the length of `draft`) and V = {vocab} (from `{pn}`), got {tuple(q.shape)} instead."
    )
  if uniforms is not None and tuple(uniforms.shape) != (gamma + 1,):
    raise ValueError(
      f"{fn}: `uniforms` must have shape (gamma + 1,) = ({gamma + 1},) for gamma = {gamma}, "
      f"got {tuple(uniforms.shape)} instead."
    )
  return gamma, vocab


def check_key(fn: str, key) -> None:
  """Trace-time check that ``key`` is one ``jax.random`` key (typed, or a raw uint32 key)."""
  dtype = getattr(key, "dtype", None)
  shape = tuple(getattr(key, "shape", ()))
  if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
    if shape == ():
      return
  elif dtype is not None and dtype == jnp.uint32 and len(shape) == 1:
    return
  raise TypeError(
    f"{fn}: `key` must be one jax.random key (jax.random.key(seed), or a raw "
    f"jax.random.PRNGKey); for a batch split it and use jax.vmap. Got "
    f"{type(key).__name__} of dtype {dtype} and shape {shape} instead."
  )


def check_static_int(fn: str, arg: str, value, minimum: int) -> int:
  """A static (Python) integer argument ``>= minimum``."""
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
    raise ValueError(f"{fn}: `{arg}` must be a static int >= {minimum}, got {value!r} instead.")
  return int(value)


def host_top_k(params):
  """``params`` (a :class:`~specdec_jax.SamplingParams`) with a host ``top_k`` beyond int32
  clipped in its own dtype before JAX sees it.

  JAX holds int32: a Python ``2**40`` would not convert at all and a NumPy int64 would wrap
  (``2**32 + 1`` to ``1``, keeping one token instead of all). Every ``top_k >= V`` keeps the
  whole row, so ``2**31 - 1`` means the same. Other values pass unchanged (checked later).
  """
  top_k = getattr(params, "top_k", None)
  if top_k is None or not is_host_value(top_k):
    return params
  try:
    array = np.asarray(top_k)
  except (TypeError, ValueError):
    return params
  if array.dtype.kind not in "iu" or array.dtype.itemsize < 8:
    return params
  info = np.iinfo(np.int32)
  if np.all((array >= info.min) & (array <= info.max)):
    return params
  array = np.where(array > info.max, info.max, array)
  if array.dtype.kind == "i":
    array = np.where(array < info.min, info.min, array)
  return params._replace(top_k=array.astype(np.int32))


def check_pad_id(fn: str, value) -> int:
  """A static ``pad_id``: a Python or NumPy integer that int32 holds (``2.7`` is not ``2``)."""
  if (isinstance(value, bool) or not isinstance(value, int | np.integer)
      or not np.iinfo(np.int32).min <= value <= np.iinfo(np.int32).max):
    raise ValueError(f"{fn}: `pad_id` must be a static int in int32 range (the token slots "
                     f"are int32), got {value!r} instead.")
  return int(value)


class PublicJit:
  """A jitted function with :func:`host_array` conversion of some arguments in front of it.

  Made by :func:`public_jit`. Calling it converts the host values of the named arguments,
  then calls the ``jax.jit`` of the function. ``lower``, ``trace`` and ``eval_shape`` are
  methods of the class, not entries of the instance's ``__dict__``, so wrappers that copy
  ``__dict__`` (``jax.vmap``, ``jax.jit``, ``functools.wraps``) do not inherit them.
  """

  def __init__(self, fn: Callable, arrays: Mapping[str, str], static_argnames: tuple[str, ...],
               name: str | None):
    functools.update_wrapper(self, fn)
    self._label = name or fn.__name__
    self.arrays, self.static_argnames = dict(arrays), tuple(static_argnames)
    self._jit = jax.jit(fn, static_argnames=static_argnames)
    params = list(inspect.signature(fn).parameters)
    self._slots = [(params.index(arg), arg, kind) for arg, kind in arrays.items()
                   if arg in params]
    self._params_at = params.index("params") if "params" in params else None

  def _convert(self, args, kwargs):
    args = list(args)
    for index, arg, kind in self._slots:
      if index < len(args):
        args[index] = host_array(self._label, arg, args[index], kind)
      elif arg in kwargs:
        kwargs[arg] = host_array(self._label, arg, kwargs[arg], kind)
    if "pad_id" in kwargs and "pad_id" in self.static_argnames:
      kwargs["pad_id"] = check_pad_id(self._label, kwargs["pad_id"])
    if self._params_at is not None and self._params_at < len(args):
      args[self._params_at] = host_top_k(args[self._params_at])
    elif "params" in kwargs:
      kwargs["params"] = host_top_k(kwargs["params"])
    return args, kwargs

  def __call__(self, *args, **kwargs):
    args, kwargs = self._convert(args, kwargs)
    return self._jit(*args, **kwargs)

  def __repr__(self) -> str:
    return f"<jitted function {self._label}>"

  def lower(self, *args, **kwargs):
    """``jax.jit(fn).lower`` after the host conversion."""
    args, kwargs = self._convert(args, kwargs)
    return self._jit.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    """``jax.jit(fn).trace`` after the host conversion."""
    args, kwargs = self._convert(args, kwargs)
    return self._jit.trace(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    """``jax.jit(fn).eval_shape`` after the host conversion."""
    args, kwargs = self._convert(args, kwargs)
    return self._jit.eval_shape(*args, **kwargs)

  def jitted(self, *args, **kwargs):
    """Call the jitted function without the host conversion (arguments already checked)."""
    return self._jit(*args, **kwargs)

  def _cache_size(self) -> int:
    return self._jit._cache_size()


def public_jit(fn: Callable | None = None, *, arrays: Mapping[str, str],
               static_argnames: tuple[str, ...] = (), name: str | None = None):
  """Decorator: ``jax.jit`` with :func:`host_array` conversion of the named arguments first.

  The decorated function is what users call: host values of the arguments named in
  ``arrays`` are converted and checked on the host (no device round trip: JAX values
  pass through), then the jitted function runs. Under an outer ``jit``/``vmap`` the
  arguments are tracers and the conversion costs nothing.

  Args:
    fn: the function to jit (its docstring and signature are kept).
    arrays: ``{argument name: FLOAT, INT or KEY}``; names the function lacks are ignored.
    static_argnames: as in ``jax.jit``.
    name: the name used in messages (default ``fn.__name__``).

  Returns:
    A :class:`PublicJit`.
  """
  if fn is None:
    return functools.partial(public_jit, arrays=arrays, static_argnames=static_argnames,
                             name=name)
  return PublicJit(fn, arrays, static_argnames, name)
