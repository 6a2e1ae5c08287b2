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
from specdec_jax._checks import INT
from specdec_jax._checks import KEY
from specdec_jax._checks import check_chain
from specdec_jax._checks import check_scalar
from specdec_jax._checks import host_array
from specdec_jax._checks import is_concrete
from specdec_jax._checks import public_jit
from specdec_jax._errors import ErrorCode
from specdec_jax._sampling import sample_index
from specdec_jax._threshold import top_k_mask
from specdec_jax._threshold import top_p_mask
from specdec_jax._verify import VerifyResult
from specdec_jax._verify import compute_dtype
from specdec_jax._verify import key_uniforms
from specdec_jax._verify import verify_rows


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


def is_concrete_value(x) -> bool:
  """A parameter that is set and whose value the host can read."""
  return x is not None and is_concrete(x)


_EXPECTED = {"temperature": ">= 0", "top_k": ">= 0 (0 disables)",
             "top_p": "in (0, 1]"}


def _in_range(field: str, v: np.ndarray) -> np.ndarray:
  if field == "temperature":
    return v >= 0  # NaN fails
  if field == "top_k":
    return v >= 0
  return (v > 0) & (v <= 1)


def check_params(params: SamplingParams, name: str, batch: int | None = None, *,
                 host_only: bool = False) -> None:
  """Host-side checks of :class:`SamplingParams`, shared by every entry point that takes them.

  Fields must be scalars (``batch=None``: one sequence; use ``jax.vmap`` for a batch) or,
  with ``batch = B``, scalars or ``(B,)`` arrays. ``top_k`` must be an integer and the
  temperature must be set. Concrete values (:func:`~specdec_jax._checks.is_concrete`) must
  be in range; traced ones are clipped where they are used and flagged by
  :func:`params_error`. ``host_only``: JAX arrays are not read back (no device round trip; a
  jitted entry point flags their values instead), only host values (NumPy, Python) are.
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


def params_error(params: SamplingParams) -> jax.Array:
  """``ErrorCode.BAD_PARAMS`` where a parameter is out of range (traced-safe), else 0."""
  bad = ~(jnp.asarray(params.temperature) >= 0)
  if params.top_k is not None:
    bad = bad | (jnp.asarray(params.top_k) < 0)
  if params.top_p is not None:
    top_p = jnp.asarray(params.top_p)
    bad = bad | ~((top_p > 0) & (top_p <= 1))
  return jnp.where(bad, jnp.int32(ErrorCode.BAD_PARAMS.value), jnp.int32(0))


def scaled_logits(logits: jax.Array, temperature) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(z, greedy, broken)`` for one row: the temperature-scaled logits and two flags.

  ``z = (x - max(x)) / T`` over the finite logits (``-inf`` stays ``-inf``): every entry is
  ``<= 0`` and the largest is 0, so no positive temperature, however small or large, can
  turn a row into NaN (a tiny ``T`` sends the others to ``-inf``, i.e. probability 0).
  ``greedy`` is ``~(T > 0)`` (0, negative or NaN). ``broken`` marks a row the model got
  wrong: a NaN or ``+inf`` logit, or no finite logit at all.
  """
  dtype = compute_dtype(logits.dtype)
  x = logits.astype(dtype)
  temperature = jnp.asarray(temperature, dtype)
  greedy = ~(temperature > 0)
  finite = jnp.isfinite(x)
  broken = jnp.any(jnp.isnan(x) | (x == jnp.inf)) | ~jnp.any(finite)
  top = jnp.max(jnp.where(finite, x, -jnp.inf))
  scale = jnp.where(greedy, jnp.ones((), dtype), temperature)
  z = jnp.where(finite, (x - jnp.where(broken, 0, top)) / scale, -jnp.inf)
  return z, greedy, broken


def _process_row(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """One row ``(V,)`` of logits to probabilities (float32 at least)."""
  vocab = logits.shape[-1]
  z, greedy, broken = scaled_logits(logits, params.temperature)
  dtype = z.dtype
  neg_inf = jnp.full_like(z, -jnp.inf)

  if params.top_k is not None:
    z = jnp.where(top_k_mask(z, params.top_k), z, neg_inf)
  if params.top_p is not None:
    top_p = jnp.clip(jnp.asarray(params.top_p, dtype), jnp.finfo(dtype).tiny, 1)
    keep = top_p_mask(z, jax.nn.softmax(z), top_p)
    z = jnp.where(keep | (top_p >= 1), z, neg_inf)

  probs = jax.nn.softmax(z)
  one_hot = jax.nn.one_hot(jnp.argmax(logits), vocab, dtype=dtype)
  # A broken row is NaN at every temperature (greedy too), so whoever reads it flags it.
  return jnp.where(broken, jnp.nan, jnp.where(greedy, one_hot, probs))


def process_logits(logits: jax.Array, params: SamplingParams = SamplingParams()) -> jax.Array:
  """Logits to the processed distribution: temperature, then top-k, then top-p.

  1. ``temperature``: divide by it; ``0`` means greedy (point mass on the argmax).
  2. ``top_k``: keep the ``k`` largest logits. Ties at the boundary are broken
     toward the lower token id (as a stable sort would), so exactly ``k`` survive.
  3. ``top_p``: over the softmax of what survived, ordered by probability with the
     same tie-breaking, keep each token whose preceding mass is ``< top_p`` (the
     first token always survives; the token that crosses ``top_p`` is kept).
  4. Softmax (log-sum-exp stabilised) over the survivors.

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

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host (out-of-range ``params`` held so give NaN rows, above).

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
  check_params(params, "process_logits")
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


def process_unchecked(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """:func:`process_logits` without its checks, and without NaN rows for out-of-range
  parameters: for callers that flag ``ErrorCode.BAD_PARAMS`` themselves (the verifiers from
  logits, the decoding loops)."""
  if logits.ndim == 1:
    return _process_row(logits, params)
  return jax.vmap(_process_row, in_axes=(0, None))(logits, params)


def process_rows(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """``(R, V)`` logits to probabilities with per-row parameters (fields ``(R,)`` or None).

  The traced body of :func:`process_logits` for packed rows (no checks: the caller's).
  """
  return jax.vmap(_process_row)(logits, params)


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

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host (as :func:`process_logits`).

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


def verify_logits_rows(target_logits, draft_logits, draft, uniforms, params, num_draft, *,
                       pad_id: int, name: str) -> VerifyResult:
  """Process both sides' logits with ``params`` and verify: the body of :func:`verify_logits`."""
  if target_logits.ndim == 2 and draft_logits.ndim == 2 and (
      target_logits.shape[-1] != draft_logits.shape[-1]):
    raise ValueError(
      f"{name}: `target_logits` and `draft_logits` must have the same vocabulary size, got "
      f"V = {target_logits.shape[-1]} and V = {draft_logits.shape[-1]} instead."
    )
  gamma, vocab = check_chain(name, target_logits, draft_logits, draft, uniforms,
                             names=("target_logits", "draft_logits"))
  check_scalar(name, "num_draft", num_draft, INT)
  check_params(params, name)
  p = process_unchecked(target_logits, params)
  q = process_unchecked(draft_logits, params) if gamma else jnp.zeros((0, vocab), p.dtype)
  result = verify_rows(p, q, draft, uniforms, num_draft, pad_id=pad_id, vocab=vocab)
  error = result.error | params_error(params)
  return result._replace(error=error, valid=error == 0)


#: The array arguments of the logits verifiers, converted on the host by ``public_jit``.
LOGITS_ARRAYS = {"key": KEY, "target_logits": FLOAT, "draft_logits": FLOAT, "draft": INT,
                 "uniforms": FLOAT, "num_draft": INT}


@public_jit(arrays=LOGITS_ARRAYS, static_argnames=("pad_id",))
def verify_logits(target_logits, draft_logits, draft, uniforms,
                  params: SamplingParams = SamplingParams(), *, num_draft=None,
                  pad_id: int = -1) -> VerifyResult:
  """:func:`verify` on logits, with per-sequence temperature, top-k and top-p.

  Both ``target_logits`` and ``draft_logits`` go through :func:`process_logits`
  with the same ``params``; the result is exact with respect to the processed
  target distribution, provided the draft tokens were sampled from the processed
  draft distribution (e.g. with :func:`sample_draft`). ``temperature == 0`` gives
  greedy verification: accept while the draft equals the target's argmax, then
  emit the argmax (point masses make the rule do exactly that), so greedy and
  sampled sequences can share one batch. All parameters may be traced: no
  recompilation when their values change.

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    target_logits: ``(gamma + 1, V)`` target logits.
    draft_logits: ``(gamma, V)`` draft logits at the proposed positions.
    draft: ``(gamma,)`` integer token ids.
    uniforms: ``(gamma + 1,)`` uniforms in ``[0, 1)``, read as in :func:`verify`.
    params: :class:`SamplingParams` with scalar fields.
    num_draft: optional int32 scalar in ``[0, gamma]``, as in :func:`verify`.
    pad_id: static int for the unused slots.

  Returns:
    :class:`VerifyResult`; ``ErrorCode.BAD_PARAMS`` is set for out-of-range parameters.

  Example:
    >>> import jax.numpy as jnp
    >>> target = jnp.array([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    >>> draft_logits = jnp.zeros((2, 3))
    >>> r = verify_logits(target, draft_logits, jnp.array([1, 2]), jnp.array([0.5, 0.5, 0.5]),
    ...                   SamplingParams(temperature=0.0))
    >>> r.tokens.tolist()   # greedy: 1 == argmax kept, 2 != argmax replaced by 0
    [1, 0, -1]

  Reference:
    Leviathan, Kalman, Matias (2023), arXiv:2211.17192.
  """
  return verify_logits_rows(target_logits, draft_logits, draft, uniforms, params, num_draft,
                            pad_id=pad_id, name="verify_logits")




@public_jit(arrays=LOGITS_ARRAYS, static_argnames=("pad_id",))
def verify_logits_with_key(key, target_logits, draft_logits, draft,
                           params: SamplingParams = SamplingParams(), *, num_draft=None,
                           pad_id: int = -1) -> VerifyResult:
  """:func:`verify_logits` with uniforms drawn from a key.

  Draws ``jax.random.uniform(key, (gamma + 1,))`` in the computation dtype, as
  :func:`verify_with_key` does; split keys per sequence for a batch.

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    key: a ``jax.random`` key.
    target_logits: ``(gamma + 1, V)``.
    draft_logits: ``(gamma, V)``.
    draft: ``(gamma,)`` integer ids.
    params: :class:`SamplingParams`.
    num_draft: optional int32 scalar.
    pad_id: static int.

  Returns:
    :class:`VerifyResult`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> r = verify_logits_with_key(jax.random.key(1), jnp.zeros((3, 4)), jnp.zeros((2, 4)),
    ...                            jnp.array([0, 3]))
    >>> int(r.num_tokens)   # equal distributions: every proposal is accepted
    3
  """
  name = "verify_logits_with_key"
  gamma, _ = check_chain(name, target_logits, draft_logits, draft, None,
                         names=("target_logits", "draft_logits"))
  uniforms = key_uniforms(name, key, gamma + 1, compute_dtype(target_logits.dtype))
  return verify_logits_rows(target_logits, draft_logits, draft, uniforms, params, num_draft,
                            pad_id=pad_id, name=name)

__all__ = [
  "DraftSample",
  "SamplingParams",
  "process_logits",
  "sample_draft",
  "verify_logits",
  "verify_logits_with_key",
]
