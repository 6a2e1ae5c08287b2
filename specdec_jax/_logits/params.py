"""A request's sampling parameters: the fields, their checks, and their expansion to rows.

:class:`SamplingParams` holds every parameter an engine's request carries. Scalar fields are
one value per request; list fields (``logit_bias_ids``, ``allowed_token_ids``, ...) a short
``-1``-padded list per request. Every field may be traced (no recompilation when values change)
and ``None`` removes its step at trace time. :func:`check_params` checks them on the host,
:func:`params_error` flags them under ``jit``; :func:`per_request` and :func:`take_rows`
broadcast them to a batch and to the rows each request owns.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax._core.checks import INT
from specdec_jax._core.checks import host_array
from specdec_jax._core.checks import host_top_k
from specdec_jax._core.checks import is_concrete
from specdec_jax._core.errors import ErrorCode
from specdec_jax._logits.adjust import History


class SamplingParams(NamedTuple):
  """Per-request sampling parameters; every field may be traced (``jax.vmap`` over a batch).

  Applied in vLLM's order (see the docs, "Sampling parameters"): ``allowed_token_ids``,
  ``bad_words``, ``min_tokens``, ``logit_bias``, the penalties, then ``temperature``,
  ``min_p``, ``top_k``, ``top_p``. ``None`` removes a step at trace time; the "off" values
  (``top_k = 0``, ``top_p = 1``, ``min_p = 0``, ``repetition_penalty = 1``, the other
  penalties 0) disable it at run time.

  Attributes:
    temperature: float ``>= 0``. ``0`` means greedy: a point mass on the argmax of the
      adjusted logits (ties to the lowest id). Default 1. ``inf``: the uniform law over the
      kept tokens.
    top_k: int ``>= 0`` or None. Keep the ``top_k`` largest logits (ties to the lower id).
    top_p: float in ``(0, 1]`` or None. Keep the shortest prefix, in the same order, whose
      mass reaches ``top_p``.
    min_p: float in ``[0, 1]`` or None. Keep tokens whose probability is at least ``min_p``
      times the largest one (after the temperature), before top-k.
    repetition_penalty: float ``> 0`` or None. A logit of a token in the prompt or the output
      is divided by it when positive, multiplied when not (``1`` is off).
    frequency_penalty: float or None. Subtracted once per occurrence in the output.
    presence_penalty: float or None. Subtracted once if the token occurs in the output.
    logit_bias_ids: int ``(L,)`` ids, ``-1`` padded, or None; with
    logit_bias_values: float ``(L,)`` the biases added to those ids' logits (a repeated id's
      biases add up).
    allowed_token_ids: int ``(A,)`` ids, ``-1`` padded, or None: every other token is masked.
    bad_words: int ``(NB, Lb)`` token sequences, each ``-1`` padded (a ``-1`` anywhere is
      skipped: ``[-1, 5, -1, 7]`` is the word ``[5, 7]``), or None: a
      sequence's last token is masked where the tokens before it were just produced (a
      one-token sequence: always).
    min_tokens: int ``>= 0`` or None; with
    stop_token_ids: int ``(NS,)``, ``-1`` padded: masked while fewer than ``min_tokens``
      tokens were produced (list the end-of-sequence id here too).

  The penalties, ``min_tokens`` and bad words read a request's
  :class:`~specdec_jax.History` (its prompt and output), passed beside the parameters; at a
  draft position the draft tokens before it count as output.

  Out-of-range values: the host functions raise ``ValueError`` on concrete values; under
  the jitted verifiers and traced values they are clipped (temperature to 0 = greedy,
  ``top_k`` to 0, ``top_p`` into ``[tiny, 1]``, ``min_p`` into ``[0, 1]``, ids out of range
  ignored) and ``ErrorCode.BAD_PARAMS`` is reported in the result.
  """

  temperature: float | jax.Array = 1.0
  top_k: int | jax.Array | None = None
  top_p: float | jax.Array | None = None
  min_p: float | jax.Array | None = None
  repetition_penalty: float | jax.Array | None = None
  frequency_penalty: float | jax.Array | None = None
  presence_penalty: float | jax.Array | None = None
  logit_bias_ids: jax.Array | None = None
  logit_bias_values: jax.Array | None = None
  allowed_token_ids: jax.Array | None = None
  bad_words: jax.Array | None = None
  min_tokens: int | jax.Array | None = None
  stop_token_ids: jax.Array | None = None


#: Each field's rank for one request (0: a scalar; list fields 1; ``bad_words`` 2).
RANK = {"logit_bias_ids": 1, "logit_bias_values": 1, "allowed_token_ids": 1, "bad_words": 2,
        "stop_token_ids": 1}

#: Fields of token ids (checked against ``[-1, V)``; ``-1`` pads).
ID_FIELDS = ("logit_bias_ids", "allowed_token_ids", "bad_words", "stop_token_ids")

#: Integer fields.
INT_FIELDS = ("top_k", "min_tokens", *ID_FIELDS)

#: The fields that adjust logits before the temperature (they need row edits).
ADJUSTING = ("repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias_ids",
             "allowed_token_ids", "bad_words", "min_tokens")

_EXPECTED = {"temperature": ">= 0", "top_k": ">= 0 (0 disables)", "top_p": "in (0, 1]",
             "min_p": "in [0, 1]", "repetition_penalty": "> 0 (1 disables)",
             "frequency_penalty": "finite", "presence_penalty": "finite",
             "logit_bias_values": "finite", "min_tokens": ">= 0"}


def rank(field: str) -> int:
  """The rank of ``field`` for one request."""
  return RANK.get(field, 0)


def adjusts(params: SamplingParams) -> bool:
  """Whether ``params`` adjust logits before the temperature (static: which fields are set)."""
  return any(getattr(params, f) is not None for f in ADJUSTING)


def _in_range(field: str, v: np.ndarray) -> np.ndarray:
  """Elementwise: is ``v`` a valid value of ``field`` (NaN fails everywhere)."""
  if field in ("temperature", "top_k", "min_tokens"):
    return v >= 0
  if field == "top_p":
    return (v > 0) & (v <= 1)
  if field == "min_p":
    return (v >= 0) & (v <= 1)
  if field == "repetition_penalty":
    return (v > 0) & np.isfinite(v)
  return np.isfinite(v)


def check_params(params: SamplingParams, name: str, batch: int | None = None, *,
                 host_only: bool = False, vocab: int | None = None) -> SamplingParams:
  """Host-side checks of :class:`SamplingParams`, shared by every entry point that takes them.

  Fields must be scalars / one request's lists (``batch=None``: one sequence; use
  ``jax.vmap`` for a batch) or, with ``batch = B``, those or arrays with a leading ``B``.
  Integer fields must be integers and the temperature must be set; ``logit_bias_ids`` and
  ``logit_bias_values`` come together with the same shape, ``min_tokens`` with
  ``stop_token_ids``. Concrete values (:func:`~specdec_jax._core.checks.is_concrete`) must be in
  range (ids in ``[-1, vocab)`` when ``vocab`` is given); traced ones are clipped where they
  are used and flagged by :func:`params_error`. ``host_only``: JAX arrays are not read back (no
  device round trip; a jitted entry point flags their values instead), only host values are.
  Returns ``params`` with a host ``top_k`` beyond int32 clipped (:func:`host_top_k`).
  """
  if not isinstance(params, SamplingParams):
    raise TypeError(
      f"{name}: `params` must be a SamplingParams, got {type(params).__name__} instead."
    )
  if params.temperature is None:
    raise ValueError(f"{name}: `params.temperature` must be a number, got None instead.")
  if (params.logit_bias_ids is None) != (params.logit_bias_values is None):
    raise ValueError(f"{name}: `params.logit_bias_ids` and `params.logit_bias_values` go "
                     "together: pass both or neither.")
  if (params.min_tokens is None) != (params.stop_token_ids is None):
    raise ValueError(f"{name}: `params.min_tokens` needs `params.stop_token_ids` (the ids it "
                     "holds back, the end-of-sequence id included), and the other way round.")
  for field, value in zip(params._fields, params, strict=True):
    if value is None:
      continue
    try:
      dtype = jnp.result_type(value)
    except TypeError:
      raise TypeError(
        f"{name}: `params.{field}` must be a number or an array of numbers, got "
        f"{type(value).__name__} instead.") from None
    if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
      raise TypeError(f"{name}: `params.{field}` must be a real number, got dtype {dtype}.")
    if field in INT_FIELDS and not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"{name}: `params.{field}` must be an integer, got dtype {dtype}.")
    shape = jnp.shape(value)
    r = rank(field)
    ok = len(shape) == r or (batch is not None and len(shape) == r + 1 and shape[0] == batch)
    if not ok:
      one = "a scalar" if r == 0 else f"an array of rank {r}"
      expected = (f"{one} per sequence (use jax.vmap for a batch)" if batch is None else
                  f"{one}, or that with a leading B = {batch}")
      raise ValueError(f"{name}: `params.{field}` must be {expected}, got shape {shape} "
                       "instead.")
    if is_concrete(value) and not (host_only and isinstance(value, jax.Array)):
      if field in ID_FIELDS:
        ids = np.asarray(value)
        bad = (ids < -1) | (ids >= vocab) if vocab is not None else ids < -1
        if np.any(bad):
          limit = f"[-1, {vocab})" if vocab is not None else ">= -1"
          raise ValueError(f"{name}: `params.{field}` must hold token ids in {limit} (-1 "
                           f"pads), got {ids[bad].ravel()[:4].tolist()} instead.")
        continue
      v = np.asarray(value, np.float64)
      if not np.all(_in_range(field, v)):
        shown = np.asarray(value).tolist() if field in INT_FIELDS else (
          v.tolist() if v.ndim else float(v))
        raise ValueError(f"{name}: `params.{field}` must be {_EXPECTED[field]}, got {shown} "
                         "instead.")
  if params.logit_bias_ids is not None and (
      jnp.shape(params.logit_bias_ids) != jnp.shape(params.logit_bias_values)):
    raise ValueError(f"{name}: `params.logit_bias_ids` and `params.logit_bias_values` must have "
                     f"one shape, got {jnp.shape(params.logit_bias_ids)} and "
                     f"{jnp.shape(params.logit_bias_values)} instead.")
  return host_top_k(params)


def params_error(params: SamplingParams, vocab: int | None = None) -> jax.Array:
  """``ErrorCode.BAD_PARAMS`` where a parameter is out of range (traced-safe), else 0.

  Fields ``(B, ...)`` (or one request's): the result has the leading shape of the scalar
  fields (``()`` or ``(B,)``), a list field's problem reported on its request.
  """
  bad = ~(jnp.asarray(params.temperature) >= 0)
  for field, value in zip(params._fields, params, strict=True):
    if value is None or field == "temperature":
      continue
    value = jnp.asarray(value)
    if field in ID_FIELDS:
      wrong = (value < -1) | ((value >= vocab) if vocab is not None else False)
    elif field in INT_FIELDS:
      wrong = value < 0
    else:
      wrong = ~_in_range_traced(field, value)
    r = rank(field)
    if r:
      wrong = jnp.any(wrong, axis=tuple(range(wrong.ndim - r, wrong.ndim)))
    bad = bad | wrong
  return jnp.where(bad, jnp.int32(ErrorCode.BAD_PARAMS.value), jnp.int32(0))


def _in_range_traced(field: str, v: jax.Array) -> jax.Array:
  if field == "top_p":
    return (v > 0) & (v <= 1)
  if field == "min_p":
    return (v >= 0) & (v <= 1)
  if field == "repetition_penalty":
    return (v > 0) & jnp.isfinite(v)
  return jnp.isfinite(v)


def check_history(name: str, history, vocab: int | None, batch: int | None = None):
  """Host-side checks of a :class:`~specdec_jax.History` (or None): integer ids of rank 1 (one
  request) or ``(B, n)``, concrete values in ``[-1, vocab)``. Returns it with host values as
  NumPy int32 arrays."""
  if history is None:
    return None
  if not isinstance(history, History):
    raise TypeError(f"{name}: `history` must be a History, got {type(history).__name__} "
                    "instead.")
  fields = {}
  for field, value in zip(history._fields, history, strict=True):
    if value is None:
      fields[field] = None
      continue
    arg = f"history.{field}"
    value = host_array(name, arg, value, INT)
    shape = jnp.shape(value)
    if not jnp.issubdtype(jnp.result_type(value), jnp.integer):
      raise TypeError(f"{name}: `{arg}` must be integer token ids, got dtype "
                      f"{jnp.result_type(value)} instead.")
    ok = len(shape) == 1 or (batch is not None and len(shape) == 2 and shape[0] == batch)
    if not ok:
      expected = "(n,) for one sequence" if batch is None else f"(n,) or (B, n) = ({batch}, n)"
      raise ValueError(f"{name}: `{arg}` must have shape {expected}, got {shape} instead.")
    if is_concrete(value) and not isinstance(value, jax.Array):
      ids = np.asarray(value)
      bad = (ids < -1) | ((ids >= vocab) if vocab is not None else False)
      if np.any(bad):
        raise ValueError(f"{name}: `{arg}` must hold token ids in [-1, {vocab}) (-1 pads), got "
                         f"{ids[bad].ravel()[:4].tolist()} instead.")
    fields[field] = value
  return History(**fields)


def history_error(history, vocab: int) -> jax.Array:
  """``BAD_PARAMS`` per request (leading shape of the history's rows) for ids out of range."""
  bad = jnp.zeros((), bool)
  for value in history or ():
    if value is not None:
      value = jnp.asarray(value)
      bad = bad | jnp.any((value < -1) | (value >= vocab), axis=-1)
  return jnp.where(bad, jnp.int32(ErrorCode.BAD_PARAMS.value), jnp.int32(0))


def check_bitmask(name: str, arg: str, bitmask, rows: int | None, vocab: int):
  """Host and trace-time checks of a grammar bitmask: int32 (or uint32) words,
  ``(rows, ceil(V / 32))`` (``(ceil(V / 32),)`` when ``rows`` is None). Returns it as an
  array (NumPy for host values)."""
  if bitmask is None:
    return None
  if not isinstance(bitmask, jax.Array):  # host words: all 32 bits (uint32 or 0xFFFFFFFF) kept
    array = np.asarray(bitmask)
    if array.dtype.kind in "iu" and array.size and array.min() >= -2**31 and (
        array.max() < 2**32):
      bitmask = array.astype(np.int64).astype(np.uint32).view(np.int32)
  bitmask = host_array(name, arg, bitmask, INT)
  dtype = jnp.result_type(bitmask)
  if dtype not in (jnp.int32, jnp.uint32):
    raise TypeError(f"{name}: `{arg}` must be int32 (or uint32) bitmask words, got dtype "
                    f"{dtype} instead.")
  words = -(-vocab // 32)
  expected = (words,) if rows is None else (rows, words)
  if tuple(jnp.shape(bitmask)) != expected:
    what = "ceil(V / 32)" if rows is None else "(rows, ceil(V / 32))"
    raise ValueError(f"{name}: `{arg}` must have shape {what} = {expected} (one bit per token, "
                     f"V = {vocab}), got {tuple(jnp.shape(bitmask))} instead.")
  return bitmask


def per_request(params: SamplingParams, batch: int) -> SamplingParams:
  """Every field with a leading ``B`` (a scalar or one request's list is shared)."""
  def broadcast(field, v):
    if v is None:
      return None
    v = jnp.asarray(v)
    r = rank(field)
    return v if v.ndim == r + 1 else jnp.broadcast_to(v, (batch, *v.shape))
  return SamplingParams(*(broadcast(f, v) for f, v in zip(params._fields, params, strict=True)))


def take_rows(params: SamplingParams, owners: jax.Array) -> SamplingParams:
  """Per-request (or shared) parameters expanded to the rows ``owners`` (``(R,)`` request of
  each row): every field gets a leading ``R``."""
  def expand(field, v):
    if v is None:
      return None
    v = jnp.asarray(v)
    r = rank(field)
    if v.ndim == r:
      return jnp.broadcast_to(v, (*owners.shape, *v.shape))
    return v[owners]
  return SamplingParams(*(expand(f, v) for f, v in zip(params._fields, params, strict=True)))


def clipped(params: SamplingParams) -> SamplingParams:
  """Traced-safe in-range values (what the verifiers compute with; :func:`params_error` says
  which were out of range): ``min_p`` into ``[0, 1]``, a repetition penalty that is not
  positive and finite as 1, other non-finite penalties and biases as 0."""
  def fix(field, v):
    if v is None:
      return None
    v = jnp.asarray(v)
    if field == "min_p":
      return jnp.clip(jnp.nan_to_num(v), 0, 1)
    if field == "repetition_penalty":
      return jnp.where((v > 0) & jnp.isfinite(v), v, jnp.ones_like(v))
    if field in ("frequency_penalty", "presence_penalty", "logit_bias_values"):
      return jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v))
    if field == "min_tokens":
      return jnp.maximum(v, 0)
    return v
  return SamplingParams(*(fix(f, v) for f, v in zip(params._fields, params, strict=True)))


__all__ = ["SamplingParams", "adjusts", "check_bitmask", "check_history", "check_params",
           "history_error", "params_error", "per_request", "take_rows"]
