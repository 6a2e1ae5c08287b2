"""The token-wise rule (Leviathan et al. 2023; Chen et al. 2023) and its one-sequence entry."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from specdec_jax._core.accept import accepts
from specdec_jax._core.checks import INT
from specdec_jax._core.checks import check_chain
from specdec_jax._core.checks import check_scalar
from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.checks import public_jit
from specdec_jax._core.errors import psum_if
from specdec_jax._core.errors import stop_row_error
from specdec_jax._core.results import VerifyResult
from specdec_jax._core.sampling import BLOCK
from specdec_jax._core.sampling import mask_block
from specdec_jax._core.sampling import sample_blocks
from specdec_jax._core.sampling import sanitize
from specdec_jax._logits.params import check_bitmask
from specdec_jax._logits.threshold import first_column
from specdec_jax._rows.batching import anchored
from specdec_jax._rows.batching import branch
from specdec_jax._rows.batching import per_sequence
from specdec_jax._rows.chain import CHAIN_ARRAYS
from specdec_jax._rows.chain import chain_randomness
from specdec_jax._rows.chain import finish
from specdec_jax._rows.chain import gather_draft_probs
from specdec_jax._rows.chain import prepare
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax._rows.logprobs import finish_emitted
from specdec_jax._rows.residual import RowStats
from specdec_jax._rows.residual import clean_masses
from specdec_jax._rows.residual import residual_pass
from specdec_jax._rows.residual import weights
from specdec_jax._rows.sources import masked_rows
from specdec_jax._rows.sources import reader
from specdec_jax._rows.sources import sequence_rows


def stop_row_stats(p_rows, q_rows, row, q_row_index, rejected, *, vocab: int, block: int,
                   dtype, bonus_given: bool = False, looped: bool = True) -> RowStats:
  """:class:`~specdec_jax._rows.residual.RowStats` of the stop row: ``max(p - q, 0)`` after a
  rejection, ``p`` after a full acceptance, from one fused read.

  The body of :func:`~specdec_jax._rows.batching.per_sequence` in :func:`verify_rows`: a real
  branch per sequence (and in the CPU batch loop), a select under plain ``vmap``. With
  ``bonus_given`` nothing is read when every proposal was accepted (the caller's bonus token
  is emitted): the statistics are zeros.
  """
  # Both branches' outputs typed like both row sources (inside shard_map: the same varying
  # mesh axes, also when q is computed from the mesh position, as point masses are).
  refs = (p_rows.slice(row, 0, 1), q_rows.slice(q_row_index, 0, 1))

  def accepted_all():  # the bonus row: one pass; its masses are p's
    if bonus_given:
      zeros = jnp.zeros((-(-vocab // block),), dtype)
      return anchored(RowStats(zeros, zeros, zeros[0]), *refs)
    return anchored(residual_pass(p_rows.slice(row, 0, vocab), None, block=block, dtype=dtype),
                    *refs)

  def rejection():  # residual masses, and the sums that check both rows
    return anchored(residual_pass(p_rows.slice(row, 0, vocab),
                                  q_rows.slice(q_row_index, 0, vocab), block=block, dtype=dtype),
                    *refs)

  return branch(looped, rejected, rejection, accepted_all)


def verify_rows(p, q, draft, uniforms, num_draft, *, pad_id: int, vocab: int,
                axis_name: str | None = None, p_offset=0, q_offset=0,
                bonus_token=None) -> VerifyResult:
  """The token-wise rule on one sequence, whatever its row source: the single body.

  ``p``/``q`` hold this device's ``(rows, V / n)`` slice when ``axis_name`` is set
  (inside ``shard_map``), the whole rows otherwise. Everything but the ``2 * gamma``
  gathered scalars, three row statistics and the final sample is replicated.

  Packed layouts (:mod:`~specdec_jax._layouts.packed`): the sequence's rows are ``p[p_offset + i]``
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
  points = prep.safe_draft if q is None else None
  arrays = (p,) if q is None else (p, q)
  given = bonus_token is not None
  offsets = jnp.stack([jnp.asarray(p_offset, jnp.int32), jnp.asarray(q_offset, jnp.int32)])

  column = first_column(local_vocab, axis_name)

  def stats(readers, row, q_row_index, rejected, offsets, points, column, *, looped):
    p_rows, q_rows = sequence_rows(readers, offsets, local_vocab=local_vocab,
                                   axis_name=axis_name, points=points, dtype=dtype, column=column)
    return stop_row_stats(p_rows, q_rows, row, q_row_index, rejected, vocab=local_vocab,
                          block=block, dtype=dtype, bonus_given=given, looped=looped)

  masses, p_masses, q_sum = per_sequence(stats, arrays, row, q_row_index, rejected, offsets,
                                         points, column)
  q_sum = psum_if(q_sum, axis_name)
  p_sum = psum_if(jnp.sum(p_masses), axis_name)

  clean = clean_masses(masses)
  use_residual = rejected & (psum_if(jnp.sum(clean), axis_name) > 0)  # else fall back to p[n]
  clean = jnp.where(use_residual | ~rejected, clean, clean_masses(p_masses))
  p_rows, q_rows = sequence_rows([reader(a) for a in arrays], offsets, local_vocab=local_vocab,
                                 axis_name=axis_name, points=points, dtype=dtype, column=column)

  def block_values(lo, start, size):
    q_part = q_rows.slice(q_row_index, start, size) if gamma else None
    values = weights(p_rows.slice(row, start, size), q_part, dtype)
    values = jnp.where(use_residual, values, p_rows.slice(row, start, size).astype(dtype))
    return mask_block(sanitize(values), lo, start)

  token = sample_blocks(clean, block_values, uniforms[num_tests], local_vocab, axis_name)
  row_error = stop_row_error(masses, p_sum, q_sum, rejected, prep.tol, axis_name)
  # What the step read: per tested position the draft id and its two gathered
  # probabilities, the uniforms of the tests and of the final sample, the stop row(s).
  return finish(prep, p_x, q_x, num_accepted=num_accepted, token=token,
                num_uniforms=num_tests + 1, tested=prep.positions < num_tests,
                row_error=row_error, pad_id=pad_id, vocab=vocab, bonus_token=bonus_token,
                accepted_all=~rejected)




@public_jit(arrays=CHAIN_ARRAYS, static_argnames=("pad_id", "logprobs", "logprobs_mode"))
def verify(p: ArrayLike, q: ArrayLike | None, draft: ArrayLike, uniforms: ArrayLike | None = None,
           *, key: ArrayLike | None = None, num_draft: ArrayLike | None = None,
           pad_id: int = -1, target_bitmask: ArrayLike | None = None,
           draft_bitmask: ArrayLike | None = None, logprobs: int | None = None,
           logprobs_mode: str = "processed") -> VerifyResult:
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

  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    p: ``(gamma + 1, V)`` floating. Target distributions at the ``gamma``
      proposed positions plus the one after the last proposal.
    q: ``(gamma, V)`` floating. ``q[i]`` is the distribution ``draft[i]`` was
      actually sampled from (after temperature, top-k, top-p).
    draft: ``(gamma,)`` integer token ids in ``[0, V)``.
    uniforms: ``(gamma + 1,)`` floating, each in ``[0, 1)``; or
    key: one ``jax.random`` key: the uniforms are ``jax.random.uniform(key, (gamma + 1,))`` in
      the computation dtype, all drawn whether read or not (for a batch, one key per
      sequence: ``jax.vmap(lambda k, *a: verify(*a, key=k))(jax.random.split(key, B), ...)``).
    num_draft: optional integer scalar (traced) in ``[0, gamma]``: how many leading
      proposals are real, for ragged batches padded to a common ``gamma``. Positions
      at or after it are ignored and the bonus token comes from ``p[num_draft]``, so
      the result equals a call on the unpadded arrays with ``uniforms[:num_draft + 1]``.
      Out-of-range values are clipped and flagged with ``ErrorCode.BAD_NUM_DRAFT``.
      ``None`` (default) means ``gamma``.
    pad_id: static int written into the unused slots of ``tokens``.
    target_bitmask: optional grammar words ``(gamma + 1, ceil(V / 32))``: each target row is
      masked (token ``32 j + i`` allowed iff bit ``i`` of word ``j``) and renormalised; a row
      that allows nothing emits nothing (``ErrorCode.NO_ALLOWED_TOKEN``).
    draft_bitmask: optional ``(gamma, ceil(V / 32))``, the draft rows' masks, the same way.
    logprobs: static None, or ``k`` in ``[0, 64]``: the result's ``logprobs`` (each emitted
      token's log-probability under its (masked) target row) and, for ``k > 0``,
      ``top_ids`` / ``top_logprobs`` (the rows' ``k`` most likely tokens, ties to the lower id).
    logprobs_mode: static, ``"processed"`` or ``"raw"``: the same for probabilities.

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
  name = "verify"
  gamma, vocab = check_chain(name, p, q, draft, uniforms)
  check_scalar(name, "num_draft", num_draft, INT)
  dtype = compute_dtype(p.dtype, (p if q is None else q).dtype)
  uniforms = chain_randomness(name, key, uniforms, gamma, dtype)
  p = masked_rows(p, check_bitmask(name, "target_bitmask", target_bitmask, gamma + 1, vocab))
  if q is not None:
    q = masked_rows(q, check_bitmask(name, "draft_bitmask", draft_bitmask, gamma, vocab))
  result = verify_rows(p, q, draft, uniforms, num_draft, pad_id=pad_id, vocab=vocab)
  return finish_emitted(result, p, jnp.arange(gamma + 1, dtype=jnp.int32), pad_id=pad_id,
                        k=check_logprobs(name, logprobs, logprobs_mode, vocab),
                        mode=logprobs_mode)

