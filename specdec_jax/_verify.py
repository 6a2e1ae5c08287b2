"""The pure, jit-compiled verification step for one sequence."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._checks import FLOAT
from specdec_jax._checks import INT
from specdec_jax._checks import KEY
from specdec_jax._checks import check_chain
from specdec_jax._checks import check_key
from specdec_jax._checks import check_scalar
from specdec_jax._checks import compute_dtype
from specdec_jax._checks import public_jit
from specdec_jax._errors import ErrorCode
from specdec_jax._errors import flag
from specdec_jax._errors import or_reduce
from specdec_jax._errors import psum_if
from specdec_jax._errors import row_tolerance
from specdec_jax._errors import stop_row_error
from specdec_jax._errors import uniform_codes
from specdec_jax._errors import value_codes
from specdec_jax._rule import accepts
from specdec_jax._sampling import BLOCK
from specdec_jax._sampling import block_masses
from specdec_jax._sampling import mask_block
from specdec_jax._sampling import sample_blocks
from specdec_jax._sampling import sanitize
from specdec_jax._stream import anchored
from specdec_jax._stream import branch
from specdec_jax._stream import per_sequence
from specdec_jax._stream import point_reader
from specdec_jax._stream import reader
from specdec_jax._stream import shifted


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


def clip_count(count, low: int, high: int) -> tuple[jax.Array, jax.Array]:
  """``(clipped int32, was_out_of_range)`` for an optional traced count (``None``: ``high``).

  The comparison happens in the count's own dtype, before the int32 cast, so a wide
  value cannot wrap into range.
  """
  if count is None:
    return jnp.int32(high), jnp.asarray(False)
  count = jnp.asarray(count)
  bad = (count < low) | (count > high)
  return jnp.clip(count, low, high).astype(jnp.int32), bad


def id_in_range(ids: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
  """``(in_range, safe_ids)``: ids in ``[0, V)`` (checked in their own dtype, before the int32
  cast, so a wide id cannot wrap into range) and the ids clipped into it as int32."""
  in_range = (ids >= 0) & (ids < vocab)
  return in_range, jnp.where(in_range, ids, jnp.clip(ids, 0, vocab - 1)).astype(jnp.int32)


def prepare(p, q, draft, uniforms, num_draft, vocab: int) -> Prepared:
  """Dtypes, the clipped ``num_draft`` and the clipped draft ids, shared by the verifiers.

  ``q=None`` (point-mass drafts) takes both from ``p``.
  """
  gamma = draft.shape[0]
  q_dtype = p.dtype if q is None else q.dtype
  tol = max(row_tolerance(p.dtype), row_tolerance(q_dtype))
  dtype = compute_dtype(p.dtype, q_dtype)
  limit, bad_limit = clip_count(num_draft, 0, gamma)
  in_range, safe_draft = id_in_range(draft, vocab)
  return Prepared(tol, dtype, uniforms.astype(dtype), limit, bad_limit, in_range, safe_draft,
                  jnp.arange(gamma, dtype=jnp.int32))


def packed_rows(offset, positions, num_rows: int) -> jax.Array:
  """Row indices ``offset + positions`` of one sequence in an array of ``num_rows`` rows, clipped.

  A sequence's rows may sit anywhere in a packed array (``offset``: its first row); positions
  past its own rows are clipped into the array (they are never tested, see ``limit``).
  """
  return jnp.clip(offset + positions, 0, max(num_rows - 1, 0)).astype(jnp.int32)


def gather_draft_probs(p, q, prep: Prepared, axis_name: str | None = None, *, p_offset=0,
                       q_offset=0):
  """``(p_x, q_x)``: the ``2 * gamma`` probabilities of the draft tokens, in the compute dtype.

  The sequence's rows start at ``p_offset``/``q_offset`` of ``p``/``q`` (packed layouts).
  ``q=None`` means point-mass drafts: ``q_x = 1``. With ``axis_name`` the rows hold this
  device's ``V / n`` columns; the device that holds an id contributes its value and a
  ``psum`` gives every device both scalars.
  """
  positions, ids, dtype = prep.positions, prep.safe_draft, prep.dtype
  p_rows = packed_rows(p_offset, positions, p.shape[0])
  ones = jnp.ones(positions.shape, dtype)
  if axis_name is None:
    q_x = ones if q is None else q[packed_rows(q_offset, positions, q.shape[0]), ids]
    return p[p_rows, ids].astype(dtype), q_x.astype(dtype)
  local_vocab = p.shape[-1]
  local = ids - lax.axis_index(axis_name).astype(jnp.int32) * local_vocab
  mine = (local >= 0) & (local < local_vocab)
  local = jnp.clip(local, 0, local_vocab - 1)
  zero = jnp.zeros((), dtype)
  p_x = lax.psum(jnp.where(mine, p[p_rows, local].astype(dtype), zero), axis_name)
  if q is None:
    return p_x, ones + jnp.zeros_like(p_x)
  q_rows = packed_rows(q_offset, positions, q.shape[0])
  q_x = lax.psum(jnp.where(mine, q[q_rows, local].astype(dtype), zero), axis_name)
  return p_x, q_x


def assemble(prep: Prepared, p_x, q_x, *, num_accepted, token, num_uniforms, tested,
             row_error, pad_id: int) -> VerifyResult:
  """The :class:`VerifyResult` of a chain verifier (token-wise or block), written once.

  Args:
    prep: what :func:`prepare` derived.
    p_x, q_x: ``(gamma,)`` the gathered probabilities of the draft tokens.
    num_accepted: int32 scalar, how many draft tokens are kept.
    token: int32 scalar, the replacement or bonus token, in ``[0, V)``.
    num_uniforms: int32 scalar, how many uniforms the rule read (slots ``0 .. n - 1``).
    tested: ``(gamma,)`` bool, the positions whose id and probabilities were read.
    row_error: int32 error bits of the full rows that were read.
    pad_id: written into the unused slots.
  """
  gamma = prep.positions.shape[0]
  slots = jnp.arange(gamma + 1, dtype=jnp.int32)
  kept = jnp.take(prep.safe_draft, jnp.minimum(slots, gamma - 1)) if gamma else slots
  tokens = jnp.where(slots < num_accepted, kept, jnp.int32(pad_id))
  tokens = jnp.where(slots == num_accepted, token, tokens)
  position_codes = jnp.where(
    tested,
    flag(~prep.in_range, ErrorCode.DRAFT_OUT_OF_RANGE) | value_codes(p_x, prep.tol)
    | value_codes(q_x, prep.tol),
    0,
  )
  u_codes = uniform_codes(prep.uniforms, slots < num_uniforms)
  error = (or_reduce(jnp.concatenate([position_codes, u_codes]))
           | flag(prep.bad_limit, ErrorCode.BAD_NUM_DRAFT) | row_error)
  return VerifyResult(tokens=tokens, num_tokens=num_accepted + 1, num_accepted=num_accepted,
                      num_uniforms=num_uniforms, valid=error == 0, error=error)


class RowStats(NamedTuple):
  """What token-wise verification needs of the stop row, from one fused read.

  Attributes:
    masses: ``(ceil(V / block),)`` block sums of the sampling weights (the residual
      ``max(p - q, 0)`` after a rejection, else ``p``), with every negative input
      entry replaced by ``-inf`` so that the sum reveals it (NaN propagates).
    p_masses: ``(ceil(V / block),)`` block sums of the ``p`` row, negative entries
      again as ``-inf`` (its total checks normalisation; it is the fallback when the
      residual is empty). Equal to ``masses`` when nothing was rejected.
    q_sum: ``()`` sum of the ``q`` row after a rejection, else 0 (not read).
  """

  masses: jax.Array
  p_masses: jax.Array
  q_sum: jax.Array


def weights(p_part, q_part, use_residual, dtype):
  """Sampling weights of a slice of the stop row: ``max(p - q, 0)`` or ``p`` (unsanitised)."""
  p_part = p_part.astype(dtype)
  if q_part is None:
    return p_part
  return jnp.where(use_residual, jnp.maximum(p_part - q_part.astype(dtype), 0), p_part)


def stop_row_stats(read_p, read_q, row, q_row_index, rejected, *, vocab: int, block: int,
                   dtype, bonus_given: bool = False, looped: bool = True) -> RowStats:
  """:class:`RowStats` of ``p[row]`` and (after a rejection) ``q[q_row_index]``, one pass.

  The body of :func:`~specdec_jax._stream.per_sequence` in :func:`verify_rows`: a real
  branch per sequence (and in the CPU batch loop), a select under plain ``vmap``. With
  ``bonus_given`` nothing is read when every proposal was accepted (the caller's bonus token
  is emitted): the statistics are zeros.
  """
  def accepted_all():  # the bonus row: one pass; its masses are p's
    if bonus_given:
      zeros = anchored(jnp.zeros((-(-vocab // block),), dtype), read_p(row, 0, 1))
      return RowStats(zeros, zeros, zeros[0])
    p_row = read_p(row, 0, vocab).astype(dtype)
    masses = block_masses(jnp.where(p_row < 0, -jnp.inf, p_row), block)
    return RowStats(masses, masses, jnp.zeros_like(p_row[0]))  # typed like the row (shard_map)

  def rejection():  # residual masses, and the sums that check both rows
    p_row = read_p(row, 0, vocab).astype(dtype)
    q_row = read_q(q_row_index, 0, vocab).astype(dtype)
    negative = (p_row < 0) | (q_row < 0)
    raw = jnp.where(negative, -jnp.inf, jnp.maximum(p_row - q_row, 0))
    poisoned_p = jnp.where(p_row < 0, -jnp.inf, p_row)
    return RowStats(block_masses(raw, block), block_masses(poisoned_p, block), jnp.sum(q_row))

  return branch(looped, rejected, rejection, accepted_all)


def chain_readers(readers, p_offset, q_offset, points, first_column, dtype):
  """``(read_p, read_q)`` of one sequence, relative to its first row.

  ``readers`` read ``p`` (and ``q``, unless ``points`` is given: then ``q`` is the one-hot of
  ``points[row]``, see :func:`~specdec_jax._stream.point_reader`) of a packed array whose
  rows for this sequence start at ``p_offset``/``q_offset``.
  """
  read_p = shifted(readers[0], p_offset)
  if points is not None:  # point-mass drafts: there is no q array
    return read_p, point_reader(points, first_column, dtype)
  return read_p, shifted(readers[1], q_offset)


def first_column(local_vocab: int, axis_name: str | None) -> jax.Array:
  """The global id of this device's first column (0 without ``axis_name``)."""
  if axis_name is None:
    return jnp.int32(0)
  return lax.axis_index(axis_name).astype(jnp.int32) * local_vocab


def verify_rows(p, q, draft, uniforms, num_draft, *, pad_id: int, vocab: int,
                axis_name: str | None = None, p_offset=0, q_offset=0,
                bonus_token=None) -> VerifyResult:
  """The rule on one sequence whose rows may be packed or vocab-sharded: the single body.

  ``p``/``q`` hold this device's ``(rows, V / n)`` slice when ``axis_name`` is set
  (inside ``shard_map``), the whole rows otherwise. Everything but the ``2 * gamma``
  gathered scalars, three row statistics and the final sample is replicated.

  Packed layouts (:mod:`~specdec_jax._packed`): the sequence's rows are ``p[p_offset + i]``
  and ``q[q_offset + i]`` of arrays shared by the batch (read in place, never copied);
  ``q=None`` means point-mass drafts (``q[i]`` is the one-hot of ``draft[i]``, computed
  where it is read); with ``bonus_token`` (a traced id) a sequence that accepts every
  proposal emits it instead of sampling from ``p[num_draft]``, which is then never read.
  """
  gamma = draft.shape[0]
  local_vocab = p.shape[-1]
  prep = prepare(p, q, draft, uniforms, num_draft, vocab)
  dtype, limit, uniforms = prep.dtype, prep.limit, prep.uniforms
  # Only 2 * gamma scalars are gathered for the accept scan.
  p_x, q_x = gather_draft_probs(p, q, prep, axis_name, p_offset=p_offset, q_offset=q_offset)

  def keep_going(state):
    i, rejected = state
    return (i < limit) & ~rejected

  def test_one(state):
    i, _ = state
    ok = accepts(uniforms[i], p_x[i], q_x[i]) & prep.in_range[i]
    return i + ok.astype(jnp.int32), ~ok

  # The carry starts as a zero that depends on every input the loop reads, so that
  # under vmap it is batched (and sharded, on meshes with explicit axes) like them.
  zero = (jnp.zeros_like(uniforms[0], jnp.int32) + jnp.zeros_like(limit)
          + jnp.zeros_like(p_x[:1].sum(), jnp.int32) + jnp.zeros_like(q_x[:1].sum(), jnp.int32)
          + jnp.zeros_like(draft[:1].sum(), jnp.int32))
  start = (zero, zero > 0)
  num_accepted, rejected = lax.while_loop(keep_going, test_one, start) if gamma else start
  num_tests = num_accepted + rejected.astype(jnp.int32)
  rejected = rejected & (gamma > 0)

  # The stop row: the residual max(p[n] - q[n], 0) after a rejection at n, or p[n]
  # for the bonus (n = limit). One streamed read of it gives the block masses of the
  # sampling weights, the block sums of p[n] and the sum of q[n]; then one block of each
  # row is read again for the inverse CDF. No (gamma + 1, V) array is ever formed.
  row = num_accepted
  q_row_index = jnp.minimum(row, max(gamma - 1, 0))
  block = min(BLOCK, local_vocab)
  column = first_column(local_vocab, axis_name)
  point_mass = q is None
  arrays = (p,) if point_mass else (p, q)
  given = bonus_token is not None
  p_offset = jnp.asarray(p_offset, jnp.int32)
  q_offset = jnp.asarray(q_offset, jnp.int32)

  def stats(readers, row, q_row_index, rejected, p_offset, q_offset, ids, column, *, looped):
    points = ids if point_mass else None
    read_p, read_q = chain_readers(readers, p_offset, q_offset, points, column, dtype)
    return stop_row_stats(read_p, read_q, row, q_row_index, rejected, vocab=local_vocab,
                          block=block, dtype=dtype, bonus_given=given, looped=looped)

  masses, p_masses, q_sum = per_sequence(stats, arrays, row, q_row_index, rejected,
                                         p_offset, q_offset, prep.safe_draft, column)
  q_sum = psum_if(q_sum, axis_name)
  p_sum = psum_if(jnp.sum(p_masses), axis_name)

  clean = jnp.where(jnp.isfinite(masses) & (masses > 0), masses, 0)
  clean_p = jnp.where(jnp.isfinite(p_masses) & (p_masses > 0), p_masses, 0)
  use_residual = rejected & (psum_if(jnp.sum(clean), axis_name) > 0)  # else fall back to p[n]
  clean = jnp.where(use_residual | ~rejected, clean, clean_p)
  read_p, read_q = chain_readers([reader(a) for a in arrays], p_offset, q_offset,
                                 prep.safe_draft if point_mass else None, column, dtype)

  def block_values(lo, start, size):
    p_part = read_p(row, start, size)
    q_part = read_q(q_row_index, start, size) if gamma else None
    return mask_block(sanitize(weights(p_part, q_part, use_residual, dtype)), lo, start)

  final_u = uniforms[num_tests]
  token = sample_blocks(clean, block_values, final_u, local_vocab, axis_name)

  row_error = stop_row_error(masses, p_sum, q_sum, rejected, prep.tol, axis_name)
  num_uniforms = num_tests + 1
  if given:  # every proposal accepted: the caller's token, nothing read, no uniform used
    bonus_ok, safe_bonus = id_in_range(bonus_token, vocab)
    use_bonus = ~rejected
    token = jnp.where(use_bonus, safe_bonus, token)
    row_error = jnp.where(use_bonus, flag(~bonus_ok, ErrorCode.TOKEN_OUT_OF_RANGE), row_error)
    num_uniforms = num_tests + rejected.astype(jnp.int32)

  # What the step read: per tested position the draft id and its two gathered
  # probabilities, the uniforms of the tests and of the final sample, the stop row(s).
  positions = prep.positions
  return assemble(prep, p_x, q_x, num_accepted=num_accepted, token=token,
                  num_uniforms=num_uniforms, tested=positions < num_tests,
                  row_error=row_error, pad_id=pad_id)


#: The array arguments of the chain verifiers, converted on the host by ``public_jit``.
CHAIN_ARRAYS = {"key": KEY, "p": FLOAT, "q": FLOAT, "draft": INT, "uniforms": FLOAT,
                "num_draft": INT}


def key_uniforms(fn: str, key, count: int, dtype) -> jax.Array:
  """``count`` uniforms in ``[0, 1)`` of ``dtype`` from ``key``: the ``*_with_key`` forms' draw."""
  check_key(fn, key)
  return jax.random.uniform(key, (count,), dtype=dtype)


@public_jit(arrays=CHAIN_ARRAYS, static_argnames=("pad_id",))
def verify(p, q, draft, uniforms, *, num_draft=None, pad_id: int = -1) -> VerifyResult:
  """Exact speculative-sampling verification of one draft sequence (pure, jitted).

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
  was wrong. Shapes and dtypes are checked at trace time. Host values (lists, NumPy)
  are converted before the call with clear errors for what JAX cannot hold: ragged
  lists, ``float128``, and integer ids outside int32 (which would wrap when cast).

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    p: ``(gamma + 1, V)`` floating. Target distributions at the ``gamma``
      proposed positions plus the one after the last proposal.
    q: ``(gamma, V)`` floating. ``q[i]`` is the distribution ``draft[i]`` was
      actually sampled from (after temperature, top-k, top-p).
    draft: ``(gamma,)`` integer token ids in ``[0, V)``.
    uniforms: ``(gamma + 1,)`` floating, each in ``[0, 1)``.
    num_draft: optional integer scalar (traced) in ``[0, gamma]``: how many leading
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
  _, vocab = check_chain("verify", p, q, draft, uniforms)
  check_scalar("verify", "num_draft", num_draft, INT)
  return verify_rows(p, q, draft, uniforms, num_draft, pad_id=pad_id, vocab=vocab)


@public_jit(arrays=CHAIN_ARRAYS, static_argnames=("pad_id",))
def verify_with_key(key, p, q, draft, *, num_draft=None, pad_id: int = -1) -> VerifyResult:
  """:func:`verify` with its ``gamma + 1`` uniforms drawn from a key.

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

  Multi-host: a global array that spans several processes (``jax.distributed``) is
  accepted and never read on the host; its values are checked under ``jit`` and flagged in
  ``error``.

  Args:
    key: a ``jax.random`` key (typed ``jax.random.key`` or raw ``PRNGKey``).
    p: ``(gamma + 1, V)`` target distributions.
    q: ``(gamma, V)`` draft distributions.
    draft: ``(gamma,)`` integer token ids.
    num_draft: optional integer scalar in ``[0, gamma]``, as in :func:`verify`.
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
  name = "verify_with_key"
  gamma, vocab = check_chain(name, p, q, draft, None)
  check_scalar(name, "num_draft", num_draft, INT)
  uniforms = key_uniforms(name, key, gamma + 1, compute_dtype(p.dtype, q.dtype))
  return verify_rows(p, q, draft, uniforms, num_draft, pad_id=pad_id, vocab=vocab)
