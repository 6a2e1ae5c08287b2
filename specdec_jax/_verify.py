"""The pure, jit-compiled verification step for one sequence."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._rows import stop_row_stats
from specdec_jax._rows import weights
from specdec_jax._rule import ErrorCode
from specdec_jax._rule import accepts
from specdec_jax._rule import row_tolerance
from specdec_jax._sampling import BLOCK
from specdec_jax._sampling import _sanitize
from specdec_jax._sampling import block_start
from specdec_jax._sampling import mask_block
from specdec_jax._sampling import pick_block
from specdec_jax._sampling import pick_in_block
from specdec_jax._sampling import sharded_inverse_cdf


class VerifyResult(NamedTuple):
  """What one verification step produced (one sequence; add a leading batch axis under vmap).

  Attributes:
    tokens: int32 ``(gamma + 1,)``. The accepted draft tokens, then the replacement
      or bonus token, then ``pad_id`` in the unused slots.
    num_tokens: int32 ``()``. How many leading entries of ``tokens`` are new tokens,
      ``1 <= num_tokens <= gamma + 1``.
    num_accepted: int32 ``()``. How many draft tokens were kept, ``num_tokens - 1``.
    num_uniforms: int32 ``()``. How many uniforms the rule read: ``num_accepted + 2``
      after a rejection, ``gamma + 1`` when every proposal was accepted.
    valid: bool ``()``. True when every value the step read (the tested draft ids,
      their gathered probabilities, the uniforms it read and the full row(s) it
      sampled from) was in range and every row it read sums to 1.
    error: int32 ``()``. :class:`ErrorCode` bit mask that says what was wrong; 0 when
      ``valid``. Decode on the host with :func:`describe_error`.
  """

  tokens: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  num_uniforms: jax.Array
  valid: jax.Array
  error: jax.Array


def compute_dtype(*dtypes) -> jnp.dtype:
  """The dtype the rule is computed in: the promoted input dtype, at least float32."""
  dtype = jnp.dtype(dtypes[0])
  for other in dtypes[1:]:
    dtype = jnp.promote_types(dtype, other)
  if jnp.dtype(dtype).itemsize < 4:
    return jnp.dtype(jnp.float32)
  return jnp.dtype(dtype)


def _flag(condition: jax.Array, code: ErrorCode) -> jax.Array:
  return jnp.where(condition, jnp.int32(code.value), jnp.int32(0))


def _psum(x: jax.Array, axis_name: str | None) -> jax.Array:
  return x if axis_name is None else lax.psum(x, axis_name)


def _value_codes(values: jax.Array, tol: float) -> jax.Array:
  """Per-entry error bits of probabilities that must lie in ``[0, 1]`` (int32, same shape)."""
  return (
    _flag(~jnp.isfinite(values), ErrorCode.NONFINITE)
    | _flag(values < 0, ErrorCode.NEGATIVE)
    | _flag(values > 1 + tol, ErrorCode.NOT_NORMALIZED)
  )


def _or_reduce(codes: jax.Array) -> jax.Array:
  """Bitwise OR of all entries of an int32 array (one reduction)."""
  return lax.reduce(codes, jnp.int32(0), lax.bitwise_or, tuple(range(codes.ndim)))


def row_error(row: jax.Array, tol: float, axis_name: str | None = None) -> jax.Array:
  """Error bits for a full probability row: finite, non-negative, sums to 1 within ``tol``.

  With ``axis_name`` the row is split over that mesh axis and three scalars are summed across it.
  """
  nonfinite = _psum(jnp.sum(~jnp.isfinite(row), dtype=jnp.int32), axis_name) > 0
  negative = _psum(jnp.sum(row < 0, dtype=jnp.int32), axis_name) > 0
  off = jnp.abs(_psum(jnp.sum(row), axis_name) - 1) > tol
  return (
    _flag(nonfinite, ErrorCode.NONFINITE)
    | _flag(negative, ErrorCode.NEGATIVE)
    | _flag(~nonfinite & off, ErrorCode.NOT_NORMALIZED)
  )


def _stop_row_error(masses, p_sum, q_sum, rejected, tol, axis_name) -> jax.Array:
  """Error bits of the stop row(s) from the fused passes' results.

  ``masses`` are block sums in which a negative entry was replaced by ``-inf``: a
  NaN or ``+inf`` sum flags NONFINITE, ``-inf`` flags NEGATIVE. The sums of
  ``p[n]`` (and of ``q[n]`` after a rejection) must be 1 within ``tol``.
  """
  nonfinite = _psum(jnp.sum(jnp.isnan(masses) | (masses == jnp.inf), dtype=jnp.int32),
                    axis_name) > 0
  nonfinite = (nonfinite | jnp.isnan(p_sum) | (p_sum == jnp.inf)
               | (rejected & ~jnp.isfinite(q_sum)))
  negative = (_psum(jnp.sum(masses == -jnp.inf, dtype=jnp.int32), axis_name) > 0) | (
    p_sum == -jnp.inf)
  off = (jnp.abs(p_sum - 1) > tol) | (rejected & (jnp.abs(q_sum - 1) > tol))
  return (
    _flag(nonfinite, ErrorCode.NONFINITE)
    | _flag(negative, ErrorCode.NEGATIVE)
    | _flag(~nonfinite & ~negative & off, ErrorCode.NOT_NORMALIZED)
  )


def _check_shapes(p, q, draft, uniforms, name: str = "verify",
                  names: tuple[str, str] = ("p", "q")) -> tuple[int, int]:
  """Trace-time rank, shape and dtype checks. Returns ``(gamma, V)``."""
  hint = f" For a batch, use jax.vmap({name})."
  pn, qn = names
  ranks = ((pn, p, 2), (qn, q, 2), ("draft", draft, 1), ("uniforms", uniforms, 1))
  for arg, value, rank in ranks:
    if not hasattr(value, "ndim"):
      raise TypeError(f"{name}: `{arg}` must be an array, got {type(value).__name__} instead.")
    if value.ndim != rank:
      raise ValueError(
        f"{name}: `{arg}` must have rank {rank}, got shape {tuple(value.shape)} "
        f"(rank {value.ndim}) instead.{hint if value.ndim > rank else ''}"
      )
  for arg, value in ((pn, p), (qn, q), ("uniforms", uniforms)):
    if not jnp.issubdtype(value.dtype, jnp.floating):
      raise TypeError(f"{name}: `{arg}` must have a floating dtype, got {value.dtype} instead.")
  if not jnp.issubdtype(draft.dtype, jnp.integer):
    raise TypeError(f"{name}: `draft` must have an integer dtype, got {draft.dtype} instead.")
  gamma = draft.shape[0]
  vocab = p.shape[1]
  if vocab < 1:
    raise ValueError(f"{name}: `{pn}` must have V >= 1 columns, got shape {tuple(p.shape)}.")
  if p.shape[0] != gamma + 1:
    raise ValueError(
      f"{name}: `{pn}` must have shape (gamma + 1, V) = ({gamma + 1}, {vocab}) for gamma = "
      f"{gamma} (the length of `draft`), got {tuple(p.shape)} instead."
    )
  if q.shape != (gamma, vocab):
    raise ValueError(
      f"{name}: `{qn}` must have shape (gamma, V) = ({gamma}, {vocab}) for gamma = {gamma} "
      f"(the length of `draft`) and V = {vocab} (from `{pn}`), got {tuple(q.shape)} instead."
    )
  if uniforms.shape != (gamma + 1,):
    raise ValueError(
      f"{name}: `uniforms` must have shape (gamma + 1,) = ({gamma + 1},) for gamma = {gamma}, "
      f"got {tuple(uniforms.shape)} instead."
    )
  return gamma, vocab


def check_num_draft(num_draft, gamma: int, name: str = "verify") -> None:
  """Trace-time check of ``num_draft``: an integer scalar; concrete values must be in range."""
  if num_draft is None:
    return
  shape = jnp.shape(num_draft)
  if shape != ():
    raise ValueError(
      f"{name}: `num_draft` must be a scalar (one sequence; use jax.vmap for a batch), "
      f"got shape {shape} instead."
    )
  dtype = jnp.result_type(num_draft)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name}: `num_draft` must be an integer, got dtype {dtype} instead.")
  if not isinstance(num_draft, jax.core.Tracer):
    value = int(num_draft)
    if not 0 <= value <= gamma:
      raise ValueError(
        f"{name}: `num_draft` must be in [0, gamma] = [0, {gamma}], got {value} instead."
      )


class Prepared(NamedTuple):
  """What every verifier derives from its arguments before reading any probability."""

  tol: float  # row-sum tolerance of the input dtype
  dtype: jnp.dtype  # computation dtype
  uniforms: jax.Array  # in the computation dtype
  limit: jax.Array  # int32 number of real proposals (num_draft clipped to [0, gamma])
  bad_limit: jax.Array  # bool: num_draft was out of range
  in_range: jax.Array  # (gamma,) bool: draft id in [0, V)
  safe_draft: jax.Array  # (gamma,) int32 draft ids clipped into [0, V)
  positions: jax.Array  # (gamma,) int32 0 .. gamma - 1


def prepare(p, q, draft, uniforms, num_draft, vocab: int) -> Prepared:
  """Dtypes, the clipped ``num_draft`` and the clipped draft ids, shared by the verifiers."""
  gamma = draft.shape[0]
  tol = max(row_tolerance(p.dtype), row_tolerance(q.dtype))
  dtype = compute_dtype(p.dtype, q.dtype)
  draft = draft.astype(jnp.int32)
  if num_draft is None:
    limit, bad_limit = jnp.int32(gamma), jnp.asarray(False)
  else:
    num_draft = jnp.asarray(num_draft).astype(jnp.int32)
    limit = jnp.clip(num_draft, 0, gamma)
    bad_limit = limit != num_draft
  return Prepared(tol, dtype, uniforms.astype(dtype), limit, bad_limit,
                  (draft >= 0) & (draft < vocab), jnp.clip(draft, 0, vocab - 1),
                  jnp.arange(gamma, dtype=jnp.int32))


def verify_rows(p, q, draft, uniforms, num_draft, *, pad_id: int, vocab: int,
                axis_name: str | None = None) -> VerifyResult:
  """The rule on one sequence whose rows may be vocab-sharded (``axis_name``): the single body.

  ``p``/``q`` hold this device's ``(rows, V / n)`` slice when ``axis_name`` is set
  (inside ``shard_map``), the whole rows otherwise. Everything but the ``2 * gamma``
  gathered scalars, three row statistics and the final sample is replicated.
  """
  gamma = draft.shape[0]
  local_vocab = p.shape[-1]
  tol, dtype, uniforms, limit, bad_limit, in_range, safe_draft, positions = prepare(
    p, q, draft, uniforms, num_draft, vocab)

  # Only 2 * gamma scalars are gathered for the accept scan.
  if axis_name is None:
    p_x = p[positions, safe_draft].astype(dtype)
    q_x = q[positions, safe_draft].astype(dtype)
  else:  # the device that holds the id contributes it, the others 0
    local = safe_draft - lax.axis_index(axis_name).astype(jnp.int32) * local_vocab
    mine = (local >= 0) & (local < local_vocab)
    local = jnp.clip(local, 0, local_vocab - 1)
    zero = jnp.zeros((), dtype)
    p_x = lax.psum(jnp.where(mine, p[positions, local].astype(dtype), zero), axis_name)
    q_x = lax.psum(jnp.where(mine, q[positions, local].astype(dtype), zero), axis_name)

  def keep_going(state):
    i, rejected = state
    return (i < limit) & ~rejected

  def test_one(state):
    i, _ = state
    ok = accepts(uniforms[i], p_x[i], q_x[i]) & in_range[i]
    return i + ok.astype(jnp.int32), ~ok

  # The carry starts as a zero that depends on every input the loop reads, so that
  # under vmap it is batched (and sharded, on meshes with explicit axes) like them.
  zero = (jnp.zeros_like(uniforms[0], jnp.int32) + jnp.zeros_like(limit)
          + jnp.zeros_like(p_x[:1].sum(), jnp.int32) + jnp.zeros_like(q_x[:1].sum(), jnp.int32)
          + jnp.zeros_like(draft[:1].sum(), jnp.int32))
  start = (zero, zero > 0)
  num_accepted, rejected = lax.while_loop(keep_going, test_one, start) if gamma else start
  num_tests = num_accepted + rejected.astype(jnp.int32)

  # The stop row: the residual max(p[n] - q[n], 0) after a rejection at n, or p[n]
  # for the bonus (n = limit). One streamed read of it gives the block masses of the
  # sampling weights, the block sums of p[n] and the sum of q[n] (see _rows.py);
  # then one block of each row is read again for the inverse CDF. No (gamma + 1, V)
  # array is ever formed.
  row = num_accepted
  q_row_index = jnp.minimum(row, max(gamma - 1, 0))
  block = min(BLOCK, local_vocab)
  masses, p_masses, q_sum = stop_row_stats(p, q, row, q_row_index, rejected, block=block,
                                           dtype=dtype)
  q_sum = _psum(q_sum, axis_name)
  p_sum = _psum(jnp.sum(p_masses), axis_name)

  clean = jnp.where(jnp.isfinite(masses) & (masses > 0), masses, 0)
  clean_p = jnp.where(jnp.isfinite(p_masses) & (p_masses > 0), p_masses, 0)
  use_residual = rejected & (_psum(jnp.sum(clean), axis_name) > 0)  # else fall back to p[n]
  clean = jnp.where(use_residual | ~rejected, clean, clean_p)

  def block_values(lo, start, size):
    p_part = lax.dynamic_slice(p, (row, start), (1, size))[0]
    q_part = lax.dynamic_slice(q, (q_row_index, start), (1, size))[0] if gamma else None
    return mask_block(_sanitize(weights(p_part, q_part, use_residual, dtype)), lo, start)

  final_u = uniforms[num_tests]
  if axis_name is None:
    b, rest = pick_block(clean, final_u * jnp.sum(clean))
    lo, start = block_start(b, local_vocab, block)
    token = start + pick_in_block(block_values(lo, start, block), rest)
  else:
    token = sharded_inverse_cdf(clean, block_values, final_u, local_vocab, axis_name)

  slots = jnp.arange(gamma + 1, dtype=jnp.int32)
  kept = jnp.take(safe_draft, jnp.minimum(slots, gamma - 1)) if gamma else slots
  tokens = jnp.where(slots < num_accepted, kept, jnp.int32(pad_id))
  tokens = jnp.where(slots == num_accepted, token, tokens)

  # What the step read, and whether it was valid.
  # Per tested position: the draft id and its two gathered probabilities; per read
  # slot: the uniform. One OR-reduction over all of them.
  tested = positions < num_tests
  position_codes = jnp.where(
    tested,
    _flag(~in_range, ErrorCode.DRAFT_OUT_OF_RANGE) | _value_codes(p_x, tol)
    | _value_codes(q_x, tol),
    0,
  )
  u_codes = _flag((slots <= num_tests) & ~((uniforms >= 0) & (uniforms < 1)),
                  ErrorCode.UNIFORM_OUT_OF_RANGE)
  error = (
    _or_reduce(jnp.concatenate([position_codes, u_codes]))
    | _flag(bad_limit, ErrorCode.BAD_NUM_DRAFT)
    | _stop_row_error(masses, p_sum, q_sum, rejected, tol, axis_name)
  )
  return VerifyResult(
    tokens=tokens,
    num_tokens=num_accepted + 1,
    num_accepted=num_accepted,
    num_uniforms=num_tests + 1,
    valid=error == 0,
    error=error,
  )


def _verify(p, q, draft, uniforms, *, num_draft=None, pad_id: int = -1) -> VerifyResult:
  gamma, vocab = _check_shapes(p, q, draft, uniforms)
  check_num_draft(num_draft, gamma)
  return verify_rows(p, q, draft, uniforms, num_draft, pad_id=pad_id, vocab=vocab)


verify = jax.jit(_verify, static_argnames=("pad_id",))
verify.__doc__ = """Exact speculative-sampling verification of one draft sequence (pure, jitted).

  For ``i = 0 .. gamma - 1`` with ``x = draft[i]``: accept ``x`` if
  ``uniforms[i] < p[i, x] / q[i, x]``; at the first rejection sample a replacement
  from ``max(p[i] - q[i], 0)`` (normalised; ``p[i]`` if that is all zero) with
  ``uniforms[i + 1]`` and stop. If all are accepted, sample a bonus token from
  ``p[gamma]`` with ``uniforms[gamma]``. The returned tokens are distributed
  exactly as if the target had sampled them one at a time.

  The accept scan is a ``jax.lax.while_loop`` over ``2 * gamma`` gathered scalars;
  only the row the final sample needs is read in full. Slot ``i`` of ``uniforms``
  is the test at position ``i`` and slot ``t`` (``t`` = tests performed) the final
  sample; later slots are never read. Arithmetic is in the promoted input dtype
  (float16/bfloat16 are computed in float32; float64 needs ``jax_enable_x64``).

  Under ``jit`` nothing can raise on values: ids stay in ``[0, V)``, an
  out-of-range draft id is rejected, NaN or negative rows never yield a token of
  zero probability when a positive one exists, and ``valid``/``error`` say what
  was wrong. Shapes and dtypes are checked at trace time.

  Args:
    p: ``(gamma + 1, V)`` floating. Target distributions at the ``gamma``
      proposed positions plus the one after the last proposal.
    q: ``(gamma, V)`` floating. ``q[i]`` is the distribution ``draft[i]`` was
      actually sampled from (after temperature, top-k, top-p).
    draft: ``(gamma,)`` integer token ids in ``[0, V)``.
    uniforms: ``(gamma + 1,)`` floating, each in ``[0, 1)``.
    num_draft: optional int32 scalar (traced) in ``[0, gamma]``: how many leading
      proposals are real, for ragged batches padded to a common ``gamma``. Positions
      at or after it are ignored and the bonus token comes from ``p[num_draft]``, so
      the result equals a call on the unpadded arrays with ``uniforms[:num_draft + 1]``.
      Out-of-range values are clipped and flagged with ``ErrorCode.BAD_NUM_DRAFT``.
      ``None`` (default) means ``gamma``.
    pad_id: static int written into the unused slots of ``tokens``.

  Returns:
    :class:`VerifyResult` with ``tokens`` of shape ``(gamma + 1,)``.

  Example:
    >>> import jax.numpy as jnp
    >>> p = jnp.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
    >>> q = jnp.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    >>> u = jnp.array([0.7, 0.9, 0.1])
    >>> verify(p, q, jnp.array([1, 2]), u).tokens.tolist()
    [1, 2, 0]
    >>> verify(p, q, jnp.array([0, 2]), u).tokens.tolist()
    [2, -1, -1]

    Batched and ragged: ``jax.vmap(verify)(p_b, q_b, draft_b, uniforms_b, num_draft=n_b)``.

  Reference:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
    Decoding", ICML 2023, arXiv:2211.17192; Chen et al., "Accelerating Large
    Language Model Decoding with Speculative Sampling", arXiv:2302.01318.
  """


def _verify_with_key(key, p, q, draft, *, num_draft=None, pad_id: int = -1) -> VerifyResult:
  gamma, _ = _check_shapes(p, q, draft, jnp.zeros(draft.shape[0] + 1, p.dtype),
                           name="verify_with_key")
  dtype = compute_dtype(p.dtype, q.dtype)
  uniforms = jax.random.uniform(key, (gamma + 1,), dtype=dtype)
  return _verify(p, q, draft, uniforms, num_draft=num_draft, pad_id=pad_id)


verify_with_key = jax.jit(_verify_with_key, static_argnames=("pad_id",))
verify_with_key.__doc__ = """:func:`verify` with its ``gamma + 1`` uniforms drawn from a key.

  The uniforms are ``jax.random.uniform(key, (gamma + 1,), dtype)`` in the
  computation dtype (float32 for float32/float16/bfloat16 inputs, float64 under
  x64), i.e. in ``[0, 1)`` with 23 (52) random mantissa bits. A uniform of exactly
  0 can occur (probability ``2**-23`` per draw in float32) and is handled by the
  rule: it accepts every draft token with ``p(x) > 0`` and never one with ``p(x) == 0``,
  and samples the first token of positive probability. All ``gamma + 1`` numbers
  are drawn whether or not they are read, so results are reproducible per key.

  For a batch, split the key once per sequence, the usual way::

    keys = jax.random.split(key, batch)
    jax.vmap(verify_with_key)(keys, p, q, draft, num_draft=num_draft)

  Args:
    key: a ``jax.random`` key (typed ``jax.random.key`` or raw ``PRNGKey``).
    p: ``(gamma + 1, V)`` target distributions.
    q: ``(gamma, V)`` draft distributions.
    draft: ``(gamma,)`` integer token ids.
    num_draft: optional int32 scalar in ``[0, gamma]``, as in :func:`verify`.
    pad_id: static int for the unused slots.

  Returns:
    :class:`VerifyResult`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> p = jnp.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
    >>> q = jnp.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    >>> r = verify_with_key(jax.random.key(0), p, q, jnp.array([1, 2]))
    >>> 1 <= int(r.num_tokens) <= 3
    True

  Reference:
    Leviathan, Kalman, Matias (2023), arXiv:2211.17192.
  """
