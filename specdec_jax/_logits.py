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

from specdec_jax._rule import ErrorCode
from specdec_jax._sampling import sample_index
from specdec_jax._verify import VerifyResult
from specdec_jax._verify import _check_shapes
from specdec_jax._verify import check_num_draft
from specdec_jax._verify import compute_dtype
from specdec_jax._verify import verify_rows


class SamplingParams(NamedTuple):
  """Per-sequence sampling parameters; every field may be a traced scalar (vmap over a batch).

  Attributes:
    temperature: float scalar ``>= 0``. ``0`` means greedy: the processed
      distribution is a point mass on ``argmax(logits)`` (ties to the lowest id,
      as ``jnp.argmax``). Default 1.
    top_k: int scalar ``>= 0`` or ``None``. Keep the ``top_k`` largest logits;
      ``0`` disables at run time, ``None`` removes the step at trace time (no sort).
    top_p: float scalar in ``(0, 1]`` or ``None``. Keep the smallest prefix of the
      tokens sorted by probability whose mass reaches ``top_p``; ``1`` disables at
      run time, ``None`` at trace time.

  Out-of-range values raise ``ValueError`` when concrete; under ``jit`` they are
  clipped (temperature to 0, top_k to 0, top_p into ``[tiny, 1]``) and reported by
  ``ErrorCode.BAD_PARAMS`` in :func:`verify_logits`.
  """

  temperature: float | jax.Array = 1.0
  top_k: int | jax.Array | None = None
  top_p: float | jax.Array | None = None


def _is_concrete(x) -> bool:
  return x is not None and not isinstance(x, jax.core.Tracer)


def _check_params(params: SamplingParams, name: str) -> None:
  """Raise on concrete out-of-range values; shapes must be scalar (use vmap for batches)."""
  if not isinstance(params, SamplingParams):
    raise TypeError(
      f"{name}: `params` must be a SamplingParams, got {type(params).__name__} instead."
    )
  for field, value in zip(params._fields, params, strict=True):
    if value is not None and jnp.shape(value) != ():
      raise ValueError(
        f"{name}: `params.{field}` must be a scalar per sequence (use jax.vmap for a batch), "
        f"got shape {jnp.shape(value)} instead."
      )
  if params.top_k is not None and not jnp.issubdtype(jnp.result_type(params.top_k), jnp.integer):
    raise TypeError(
      f"{name}: `params.top_k` must be an integer, got dtype {jnp.result_type(params.top_k)}."
    )
  t, k, p = params
  if _is_concrete(t) and not float(t) >= 0:
    raise ValueError(f"{name}: `params.temperature` must be >= 0, got {float(t)} instead.")
  if _is_concrete(k) and int(k) < 0:
    raise ValueError(f"{name}: `params.top_k` must be >= 0 (0 disables), got {int(k)} instead.")
  if _is_concrete(p) and not 0.0 < float(p) <= 1.0:
    raise ValueError(f"{name}: `params.top_p` must be in (0, 1], got {float(p)} instead.")


def params_error(params: SamplingParams) -> jax.Array:
  """``ErrorCode.BAD_PARAMS`` if a parameter is out of range (traced-safe), else 0."""
  bad = ~(jnp.asarray(params.temperature) >= 0)
  if params.top_k is not None:
    bad = bad | (jnp.asarray(params.top_k) < 0)
  if params.top_p is not None:
    top_p = jnp.asarray(params.top_p)
    bad = bad | ~((top_p > 0) & (top_p <= 1))
  return jnp.where(bad, jnp.int32(ErrorCode.BAD_PARAMS.value), jnp.int32(0))


def _process_row(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """One row ``(V,)`` of logits to probabilities (float32 at least)."""
  vocab = logits.shape[-1]
  dtype = compute_dtype(logits.dtype)
  x = logits.astype(dtype)
  temperature = jnp.asarray(params.temperature, dtype)
  greedy = ~(temperature > 0)  # also NaN / negative: clipped to greedy
  scaled = x / jnp.where(greedy, jnp.ones((), dtype), temperature)
  neg_inf = jnp.full_like(scaled, -jnp.inf)

  if params.top_k is not None or params.top_p is not None:
    # One stable sort by logit, descending: ties go to the lower token id.
    order = jnp.argsort(-scaled, stable=True)
    rank = jnp.zeros(vocab, jnp.int32).at[order].set(jnp.arange(vocab, dtype=jnp.int32))
    if params.top_k is not None:
      k = jnp.asarray(params.top_k).astype(jnp.int32)
      k = jnp.where(k > 0, jnp.minimum(k, vocab), vocab)
      scaled = jnp.where(rank < k, scaled, neg_inf)
    if params.top_p is not None:
      top_p = jnp.clip(jnp.asarray(params.top_p, dtype), jnp.finfo(dtype).tiny, 1)
      sorted_probs = jax.nn.softmax(scaled[order])
      mass_before = jnp.cumsum(sorted_probs) - sorted_probs
      keep_sorted = (mass_before < top_p) | (jnp.arange(vocab) == 0)
      keep = jnp.zeros(vocab, bool).at[order].set(keep_sorted)
      scaled = jnp.where(keep | (top_p >= 1), scaled, neg_inf)

  probs = jax.nn.softmax(scaled)  # log-sum-exp stabilised
  one_hot = jax.nn.one_hot(jnp.argmax(x), vocab, dtype=dtype)
  return jnp.where(greedy, one_hot, probs)


def process_logits(logits: jax.Array, params: SamplingParams = SamplingParams()) -> jax.Array:
  """Logits to the processed distribution: temperature, then top-k, then top-p.

  1. ``temperature``: divide by it; ``0`` means greedy (point mass on the argmax).
  2. ``top_k``: keep the ``k`` largest logits. Ties at the boundary are broken
     toward the lower token id (one stable sort), so exactly ``k`` survive.
  3. ``top_p``: over the softmax of what survived, sorted by probability with the
     same tie-breaking, keep each token whose preceding mass is ``< top_p`` (the
     first token always survives; the token that crosses ``top_p`` is kept).
  4. Softmax (log-sum-exp stabilised) over the survivors.

  bfloat16/float16 logits are processed in float32. Use the *same* function and
  parameters for the draft (its ``q``) and the target (its ``p``): exactness of
  speculative sampling is with respect to these processed distributions.

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
  _check_params(params, "process_logits")
  logits = jnp.asarray(logits)
  if logits.ndim not in (1, 2) or logits.shape[-1] < 1:
    raise ValueError(
      f"process_logits: `logits` must have shape (V,) or (rows, V) with V >= 1, "
      f"got {tuple(logits.shape)} instead."
    )
  if not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f"process_logits: `logits` must be floating, got {logits.dtype} instead.")
  if logits.ndim == 1:
    return _process_row(logits, params)
  return jax.vmap(_process_row, in_axes=(0, None))(logits, params)


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


def _verify_logits(target_logits, draft_logits, draft, uniforms,
                   params: SamplingParams = SamplingParams(), *, num_draft=None,
                   pad_id: int = -1) -> VerifyResult:
  name = "verify_logits"
  target_logits = jnp.asarray(target_logits)
  draft_logits = jnp.asarray(draft_logits)
  if target_logits.ndim == 2 and draft_logits.ndim == 2 and (
      target_logits.shape[-1] != draft_logits.shape[-1]):
    raise ValueError(
      f"{name}: `target_logits` and `draft_logits` must have the same vocabulary size, got "
      f"V = {target_logits.shape[-1]} and V = {draft_logits.shape[-1]} instead."
    )
  gamma, vocab = _check_shapes(target_logits, draft_logits, draft, uniforms, name=name,
                               names=("target_logits", "draft_logits"))
  check_num_draft(num_draft, gamma, name)
  _check_params(params, name)
  p = process_logits(target_logits, params)
  q = process_logits(draft_logits, params) if gamma else jnp.zeros((0, vocab), p.dtype)
  result = verify_rows(p, q, draft, uniforms, num_draft, pad_id=pad_id, vocab=vocab)
  error = result.error | params_error(params)
  return result._replace(error=error, valid=error == 0)


verify_logits = jax.jit(_verify_logits, static_argnames=("pad_id",))
verify_logits.__doc__ = """:func:`verify` on logits, with per-sequence temperature, top-k and top-p.

  Both ``target_logits`` and ``draft_logits`` go through :func:`process_logits`
  with the same ``params``; the result is exact with respect to the processed
  target distribution, provided the draft tokens were sampled from the processed
  draft distribution (e.g. with :func:`sample_draft`). ``temperature == 0`` gives
  greedy verification: accept while the draft equals the target's argmax, then
  emit the argmax (point masses make the rule do exactly that), so greedy and
  sampled sequences can share one batch. All parameters may be traced: no
  recompilation when their values change.

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


def _verify_logits_with_key(key, target_logits, draft_logits, draft,
                            params: SamplingParams = SamplingParams(), *, num_draft=None,
                            pad_id: int = -1) -> VerifyResult:
  gamma = jnp.shape(draft)[0]
  dtype = compute_dtype(jnp.asarray(target_logits).dtype)
  uniforms = jax.random.uniform(key, (gamma + 1,), dtype=dtype)
  return _verify_logits(target_logits, draft_logits, draft, uniforms, params,
                        num_draft=num_draft, pad_id=pad_id)


verify_logits_with_key = jax.jit(_verify_logits_with_key, static_argnames=("pad_id",))
verify_logits_with_key.__doc__ = """:func:`verify_logits` with uniforms drawn from a key.

  Draws ``jax.random.uniform(key, (gamma + 1,))`` in the computation dtype, as
  :func:`verify_with_key` does; split keys per sequence for a batch.

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

__all__ = [
  "DraftSample",
  "SamplingParams",
  "process_logits",
  "sample_draft",
  "verify_logits",
  "verify_logits_with_key",
]
