"""From logits to the processed distributions that drafting and verification must share.

Exactness of speculative sampling holds with respect to the distributions the
tokens are *actually* drawn from. If the draft samples at temperature 0.7 with
top-p 0.9, the ``q`` handed to verification must be that processed distribution,
and the target's ``p`` must be processed with the same parameters; the output is
then distributed exactly as the target's *processed* distribution. This module
computes that processing once (:func:`process_logits`) and uses it on both sides
(:func:`sample_draft`, :func:`verify_logits`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax._checks import FLOAT
from specdec_jax._checks import host_array
from specdec_jax._checks import host_top_k
from specdec_jax._checks import is_concrete
from specdec_jax._errors import ErrorCode
from specdec_jax._process import process_rows as process_rows
from specdec_jax._process import process_unchecked
from specdec_jax._process import scaled_logits as scaled_logits
from specdec_jax._sampling import sample_index


class SamplingParams(NamedTuple):
  """Per-sequence sampling parameters; every field may be a traced scalar (vmap over a batch).

  Attributes:
    temperature: float scalar ``>= 0``. ``0`` means greedy: the processed
      distribution is a point mass on ``argmax(logits)`` (ties to the lowest id,
      as ``jnp.argmax``). Default 1.
    top_k: int scalar ``>= 0`` or ``None``. Keep the ``top_k`` largest logits;
      ``0`` disables at run time, ``None`` removes the step at trace time.
    top_p: float scalar in ``(0, 1]`` or ``None``. Keep the smallest prefix of the
      tokens sorted by probability whose mass reaches ``top_p``; ``1`` disables at
      run time, ``None`` at trace time.

  Any positive temperature gives a valid distribution (as ``temperature -> 0`` it tends
  to the uniform law over the tied maximal logits; ``inf`` gives the uniform law over the
  tokens that top-k/top-p keep).

  Out-of-range values: the host functions (:func:`process_logits`, :func:`sample_draft`,
  the decoding loops) raise ``ValueError`` on concrete values; the jitted verifiers
  (:func:`verify_logits`, :func:`verify_logits_with_key`) and traced values clip them
  (temperature to 0 = greedy, top_k to 0, top_p into ``[tiny, 1]``) and report
  ``ErrorCode.BAD_PARAMS`` in the result.
  """

  temperature: float | jax.Array = 1.0
  top_k: int | jax.Array | None = None
  top_p: float | jax.Array | None = None


_EXPECTED = {"temperature": ">= 0", "top_k": ">= 0 (0 disables)",
             "top_p": "in (0, 1]"}


def _in_range(field: str, v: np.ndarray) -> np.ndarray:
  if field == "temperature":
    return v >= 0  # NaN fails
  if field == "top_k":
    return v >= 0
  return (v > 0) & (v <= 1)


def check_params(params: SamplingParams, name: str, batch: int | None = None, *,
                 host_only: bool = False) -> SamplingParams:
  """Host-side checks of :class:`SamplingParams`, shared by every entry point that takes them.

  Fields must be scalars (``batch=None``: one sequence; use ``jax.vmap`` for a batch) or,
  with ``batch = B``, scalars or ``(B,)`` arrays. ``top_k`` must be an integer and the
  temperature must be set. Concrete values (:func:`~specdec_jax._checks.is_concrete`) must
  be in range; traced ones are clipped where they are used and flagged by
  :func:`params_error`. ``host_only``: JAX arrays are not read back (no device round trip; a
  jitted entry point flags their values instead), only host values (NumPy, Python) are.
  Returns ``params`` with a host ``top_k`` beyond int32 clipped (:func:`host_top_k`).
  """
  if not isinstance(params, SamplingParams):
    raise TypeError(
      f"{name}: `params` must be a SamplingParams, got {type(params).__name__} instead."
    )
  if params.temperature is None:
    raise ValueError(f"{name}: `params.temperature` must be a number, got None instead.")
  shapes = ((),) if batch is None else ((), (batch,))
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
    if field == "top_k" and not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"{name}: `params.top_k` must be an integer, got dtype {dtype}.")
    shape = jnp.shape(value)
    if shape not in shapes:
      expected = ("a scalar per sequence (use jax.vmap for a batch)" if batch is None else
                  f"a scalar or have shape (B,) = ({batch},)")
      raise ValueError(f"{name}: `params.{field}` must be {expected}, got shape {shape} instead.")
    if is_concrete(value) and not (host_only and isinstance(value, jax.Array)):
      v = np.asarray(value, np.float64)
      if not np.all(_in_range(field, v)):
        shown = v.tolist() if v.ndim else float(v)
        if field == "top_k":
          shown = np.asarray(value).tolist()
        raise ValueError(f"{name}: `params.{field}` must be {_EXPECTED[field]}, got {shown} "
                         "instead.")
  return host_top_k(params)


def params_error(params: SamplingParams) -> jax.Array:
  """``ErrorCode.BAD_PARAMS`` where a parameter is out of range (traced-safe), else 0."""
  bad = ~(jnp.asarray(params.temperature) >= 0)
  if params.top_k is not None:
    bad = bad | (jnp.asarray(params.top_k) < 0)
  if params.top_p is not None:
    top_p = jnp.asarray(params.top_p)
    bad = bad | ~((top_p > 0) & (top_p <= 1))
  return jnp.where(bad, jnp.int32(ErrorCode.BAD_PARAMS.value), jnp.int32(0))


def process_logits(logits: jax.Array, params: SamplingParams = SamplingParams()) -> jax.Array:
  """Logits to the processed distribution: temperature, then top-k, then top-p.

  1. ``temperature``: divide by it; ``0`` means greedy (point mass on the argmax).
  2. ``top_k``: keep the ``k`` largest logits. Ties at the boundary are broken
     toward the lower token id (as a stable sort would), so exactly ``k`` survive.
  3. ``top_p``: over the softmax of what survived, in the same order, keep each token
     whose preceding mass is ``< top_p`` (the first token always survives; the token
     that crosses ``top_p`` is kept).
  4. Softmax (log-sum-exp stabilised) over the survivors.

  The order of steps 2 and 3 is that of the *raw* logits (descending, ties toward the
  lower id), never of the temperature-scaled ones: a temperature can round two distinct
  logits to one value, and every verifier from logits, :func:`sample_draft` and the
  decoding loops cut the same order, so they all keep the same set
  (``specdec_jax.reference.process_logits`` states it in float64).

  Nothing is sorted: top-k and top-p are threshold searches by bisection over the row
  (:mod:`specdec_jax._threshold`, as in tpu-inference and FlashInfer), about 32 passes each
  for float32. The top-p masses are summed by value level and token id rather than as a
  cumulative sum in sorted order, so a token whose preceding mass is within rounding
  (an ulp or so) of ``top_p`` may fall on the other side than with a sort; every other
  token, and every top-k decision, is the same.

  bfloat16/float16 logits are processed in float32. Use the *same* function and
  parameters for the draft (its ``q``) and the target (its ``p``): exactness of
  speculative sampling is with respect to these processed distributions.

  Temperature is applied as ``(x - max(x)) / T``, so every positive ``T`` gives a valid
  distribution (no overflow to NaN for tiny ``T``; the limit ``T -> 0`` is greedy up to
  ties). ``-inf`` logits are masked tokens. A row with a NaN or ``+inf`` logit, or without
  any finite logit, is returned as NaN at every temperature (greedy too), so a verifier or
  decoding loop that reads it reports ``ErrorCode.NONFINITE`` instead of a plausible token.
  Parameters out of range that could not be checked on the host (traced, or global arrays:
  ``temperature`` negative or NaN, ``top_k < 0``, ``top_p`` outside ``(0, 1]``) give NaN rows
  too, never a plausible distribution.

  Multi-host: see the README, "Running on many devices and hosts" (out-of-range ``params``
  held so give NaN rows, above).

  Args:
    logits: ``(V,)`` or ``(rows, V)`` floating logits (all rows share ``params``).
    params: :class:`SamplingParams` with scalar fields (use ``jax.vmap`` for
      per-sequence values).

  Returns:
    Probabilities of the same shape, float32 (float64 for float64 input).

  Example:
    >>> import jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([0.5, 0.3, 0.2]))
    >>> [round(float(v), 3) for v in process_logits(logits, SamplingParams(top_k=2))]
    [0.625, 0.375, 0.0]
    >>> process_logits(logits, SamplingParams(temperature=0.0)).tolist()
    [1.0, 0.0, 0.0]

  Reference:
    Holtzman et al., "The Curious Case of Neural Text Degeneration" (top-p),
    ICLR 2020, arXiv:1904.09751; Fan et al. 2018 (top-k), arXiv:1805.04833.
  """
  params = check_params(params, "process_logits")
  logits = jnp.asarray(host_array("process_logits", "logits", logits, FLOAT))
  if logits.ndim not in (1, 2) or logits.shape[-1] < 1:
    raise ValueError(
      f"process_logits: `logits` must have shape (V,) or (rows, V) with V >= 1, "
      f"got {tuple(logits.shape)} instead."
    )
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f"process_logits: `logits` must be floating, got {logits.dtype} instead.")
  probs = process_unchecked(logits, params)
  return jnp.where(params_error(params) != 0, jnp.asarray(jnp.nan, probs.dtype), probs)


class DraftSample(NamedTuple):
  """A draft token and the distribution it was drawn from.

  Attributes:
    token: int32 ``()``, the sampled id.
    probs: ``(V,)`` the processed distribution ``token`` was drawn from: pass it
      as the ``q`` row to verification.
  """

  token: jax.Array
  probs: jax.Array


def sample_draft(key: jax.Array, logits: jax.Array,
                 params: SamplingParams = SamplingParams()) -> DraftSample:
  """Sample one draft token from the processed distribution and return that distribution.

  Returning ``probs`` with the token means the ``q`` given to verification is, by
  construction, the law the token was drawn from (a mismatch here silently
  breaks exactness; it has been reported against Hugging Face transformers).
  Broken logits and parameters out of range under ``jit`` give NaN ``probs``, as in
  :func:`process_logits`: the verifier that reads them reports ``ErrorCode.NONFINITE``.

  Multi-host: see the README, "Running on many devices and hosts" (as :func:`process_logits`).

  Args:
    key: a ``jax.random`` key.
    logits: ``(V,)`` draft logits for the next position.
    params: :class:`SamplingParams`; the same ones the target is verified with.

  Returns:
    :class:`DraftSample` ``(token, probs)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> s = sample_draft(jax.random.key(0), jnp.array([0.0, 2.0, 1.0]), SamplingParams(0.0))
    >>> int(s.token), s.probs.tolist()
    (1, [0.0, 1.0, 0.0])
  """
  probs = process_logits(logits, params)
  if probs.ndim != 1:
    raise ValueError(
      f"sample_draft: `logits` must have shape (V,), got {tuple(jnp.shape(logits))} instead. "
      "Use jax.vmap for a batch."
    )
  u = jax.random.uniform(key, (), dtype=probs.dtype)
  return DraftSample(sample_index(probs, u), probs)


def sample_unchecked(key: jax.Array, logits: jax.Array, params: SamplingParams) -> DraftSample:
  """:func:`sample_draft` on :func:`process_unchecked` (the decoding loops, which flag
  ``ErrorCode.BAD_PARAMS`` themselves)."""
  probs = process_unchecked(logits, params)
  u = jax.random.uniform(key, (), dtype=probs.dtype)
  return DraftSample(sample_index(probs, u), probs)


__all__ = [
  "DraftSample",
  "SamplingParams",
  "process_logits",
  "sample_draft",
]
