"""Block verification (Sun et al. 2025, Algorithm 2): the jitted, lazily reading step.

Token-wise verification (:func:`specdec_jax.verify`) decides every draft token on its own
and stops at the first rejection. Block verification decides the whole block jointly: it
keeps the longest prefix whose *joint* acceptance weight admits it. With 1-indexed
positions, ``b_0 = 1``, ``b_i = min(1, b_{i-1} p_i(x_i) / q_i(x_i))``, residuals
``R_i = max(b_i p_{i+1} - q_{i+1}, 0)`` of mass ``Z_i``, stopping weights
``h_i = Z_i / (Z_i + 1 - b_i)`` (``h_0 = 1``, ``h_gamma = b_gamma``); ``tau`` is the largest
``i`` with ``eta_i < h_i``, and the step emits ``x_1 .. x_tau`` and one token from ``R_tau``
(``p_{gamma+1}`` when ``tau = gamma``). The output law equals the target's, and the expected
number of tokens is never below token-wise verification's (the paper's Theorem 2).

The scan runs from the end of the block down and stops at the first ``i`` it keeps, so
``h_gamma = b_gamma`` (no row) is tested first and a row ``p[i]``, ``q[i]`` is read only when
``h_i`` is needed. The last row read is the one the final token is sampled from: its block
masses are kept in the loop carry and only one 256-entry block is read again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

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
from specdec_jax._rows.residual import clean_masses
from specdec_jax._rows.residual import residual_pass
from specdec_jax._rows.residual import weights
from specdec_jax._rows.sources import masked_rows
from specdec_jax._rows.sources import sequence_rows


def log_block_weights(p_x: jax.Array, q_x: jax.Array) -> jax.Array:
  """``log b_i`` for ``i = 0 .. gamma``: ``b_0 = 1``, ``b_i = min(1, b_{i-1} p_x[i-1] / q_x[i-1])``.

  Computed in log space. ``p(x) == 0`` gives ``b_i = 0`` (and every later ``b`` stays 0);
  ``q(x) == 0 < p(x)`` gives ratio ``inf`` (``b_i = 1`` unless ``b_{i-1} = 0``). NaN propagates.

  Args:
    p_x: ``(gamma,)`` target probabilities of the draft tokens.
    q_x: ``(gamma,)`` draft probabilities of the draft tokens.

  Returns:
    ``(gamma + 1,)`` log weights, each ``<= 0`` or ``-inf`` (NaN for NaN inputs).
  """
  safe_p = jnp.where(p_x > 0, p_x, 1)
  safe_q = jnp.where(q_x > 0, q_x, 1)
  ratio = jnp.where(p_x > 0, jnp.where(q_x > 0, jnp.log(safe_p) - jnp.log(safe_q), jnp.inf),
                    -jnp.inf)
  ratio = jnp.where(jnp.isnan(p_x) | jnp.isnan(q_x), jnp.nan, ratio)

  def step(prev, r):
    nxt = jnp.where((prev == -jnp.inf) | (r == -jnp.inf), -jnp.inf, jnp.minimum(0, prev + r))
    return nxt, nxt

  zero = jnp.zeros_like(jnp.sum(p_x[:1]) + jnp.sum(q_x[:1]))  # typed (and sharded) like them
  if p_x.shape[0] == 0:
    return zero[None]
  _, rest = lax.scan(step, zero, ratio)
  return jnp.concatenate([zero[None], rest])


def _stop_and_sample(p_rows, q_rows, log_b, uniforms, limit, *, gamma, vocab, dtype, tol,
                     axis_name=None, bonus_given=False, looped=True):
  """Per sequence: find ``tau`` (scan from ``limit`` down) and sample the final token.

  ``p_rows`` / ``q_rows`` are the sequence's row sources (:mod:`~specdec_jax._rows.sources`);
  ``vocab`` is the rows' local length (``V / n`` with ``axis_name``: then the row sums and the
  sample's partial masses are reduced over that mesh axis; only scalars cross devices).
  Returns ``(tau, token, row_error)`` (int32 scalars).
  """
  block = min(BLOCK, vocab)
  b = jnp.exp(log_b)
  # eta_i is uniforms[i - 1]. Since Z_i <= b_i, h_i <= b_i: an i with eta_i >= b_i is never
  # kept, and its row need not be read. Candidates: i = 0 (h_0 = 1) and 0 < i < n with
  # eta_i < b_i; h_n = b_n is decided here without a row.
  index = jnp.arange(gamma + 1, dtype=jnp.int32)
  etas = jnp.concatenate([jnp.zeros((1,), dtype), uniforms[:gamma]])
  candidate = (index == 0) | ((index < limit) & (etas < b))
  below = lax.cummax(jnp.where(candidate, index, 0))  # largest candidate <= i
  keep_all = (limit == 0) | (etas[limit] < b[limit])
  nblocks = -(-vocab // block)
  zeros = jnp.zeros((nblocks,), dtype)

  def cond(state):
    return ~state[1]

  def body(state):
    i, _, _, _, _, err = state
    row_b = b[i]
    masses, p_masses, q_sum = residual_pass(p_rows.slice(i, 0, vocab), q_rows.slice(i, 0, vocab),
                                            block=block, dtype=dtype, a=row_b)
    z = psum_if(jnp.sum(clean_masses(masses)), axis_name)
    den = z + (1 - row_b)
    h = jnp.where(den > 0, z / jnp.where(den > 0, den, 1), 1)
    done = (i == 0) | (etas[i] < h)
    err = err | stop_row_error(masses, psum_if(jnp.sum(p_masses), axis_name),
                               psum_if(q_sum, axis_name), jnp.asarray(True), tol, axis_name)
    return (jnp.where(done, i, below[jnp.maximum(i - 1, 0)]), done, masses, p_masses, z, err)

  # Typed like what the body computes (inside shard_map: the same varying mesh axes): the
  # block masses like the rows, the rest like the replicated inputs.
  scalars = (log_b, uniforms, limit)
  masses0 = anchored(zeros, *scalars, p_rows.slice(0, 0, 1), q_rows.slice(0, 0, 1))
  start = (below[jnp.maximum(limit - 1, 0)], keep_all, masses0, masses0,
           anchored(jnp.zeros((), dtype), *scalars), anchored(jnp.int32(0), *scalars))
  if gamma:
    tau, _, masses, p_masses, z, err = lax.while_loop(cond, body, start)
  else:
    tau, _, masses, p_masses, z, err = start
  tau = jnp.where(keep_all, limit, tau)

  def bonus():
    if bonus_given:  # the caller's bonus token is emitted: the row is not read
      return masses, p_masses, z, jnp.zeros_like(err)
    m = residual_pass(p_rows.slice(limit, 0, vocab), None, block=block, dtype=dtype).masses
    m = anchored(m, q_rows.slice(0, 0, 1))  # typed like the other branch (shard_map)
    return m, m, psum_if(jnp.sum(clean_masses(m)), axis_name), stop_row_error(
      m, psum_if(jnp.sum(m), axis_name), jnp.zeros((), dtype), jnp.asarray(False), tol, axis_name)

  masses, p_masses, z, bonus_err = branch(looped, keep_all, bonus,
                                          lambda: (masses, p_masses, z, jnp.zeros_like(err)))
  err = err | bonus_err
  use_residual = ~keep_all & (z > 0)  # else p[tau] (the bonus row, or the fallback)
  clean = jnp.where(use_residual | keep_all, clean_masses(masses), clean_masses(p_masses))
  b_tau = b[tau]
  q_index = jnp.minimum(tau, max(gamma - 1, 0))

  target_u = uniforms[limit]

  def block_values(lo, start, size):
    p_part = p_rows.slice(tau, start, size).astype(dtype)
    if gamma:
      values = weights(p_part, q_rows.slice(q_index, start, size), dtype, a=b_tau)
      values = jnp.where(use_residual, values, p_part)
    else:
      values = p_part
    return mask_block(sanitize(values), lo, start)

  token = sample_blocks(clean, block_values, target_u, vocab, axis_name)
  return tau.astype(jnp.int32), token.astype(jnp.int32), err


def _stop_rule(p, q, log_b, uniforms, limit, offsets, ids, *, dtype, tol, axis_name=None,
               bonus_given=False):
  """:func:`_stop_and_sample` per sequence, streamed
  (:func:`~specdec_jax._rows.batching.per_sequence`).

  Under ``jax.vmap`` a ``while_loop`` whose rows are picked by a batched index would gather
  whole rows for every lane on every iteration; the streaming rule runs each sequence's scan
  on its own on XLA:CPU, so each sequence reads only the rows it needs. ``offsets`` are the
  sequence's first rows in ``p`` and ``q`` (packed layouts); ``q=None`` means point-mass
  drafts on ``ids``.
  """
  gamma, vocab = ids.shape[0], p.shape[-1]
  arrays = (p,) if q is None else (p, q)
  points = ids if q is None else None

  column = first_column(vocab, axis_name)

  def body(readers, log_b, uniforms, limit, offsets, points, column, *, looped):
    p_rows, q_rows = sequence_rows(readers, offsets, local_vocab=vocab, axis_name=axis_name,
                                   points=points, dtype=dtype, column=column)
    return _stop_and_sample(p_rows, q_rows, log_b, uniforms, limit, gamma=gamma,
                            vocab=vocab, dtype=dtype, tol=tol, axis_name=axis_name,
                            bonus_given=bonus_given, looped=looped)

  return per_sequence(body, arrays, log_b, uniforms, limit, offsets, points, column)


def block_verify_rows(p, q, draft, uniforms, num_draft, *, pad_id: int, vocab: int,
                      axis_name: str | None = None, p_offset=0, q_offset=0,
                      bonus_token=None) -> VerifyResult:
  """The block rule on one sequence: the body of :func:`block_verify`.

  With ``axis_name`` (inside ``shard_map``) ``p``/``q`` hold this device's ``V / n`` columns:
  the ``2 * gamma`` gathered scalars, three statistics per row read and the final sample's
  partial masses and candidate cross devices, nothing of size ``V``. Packed rows
  (``p_offset``, ``q_offset``), point-mass drafts (``q=None``) and a caller-given
  ``bonus_token`` as in :func:`~specdec_jax._rules.tokenwise.verify_rows`.
  """
  prep = prepare(p, q, draft, uniforms, num_draft, vocab)
  p_x, q_x = gather_draft_probs(p, q, prep, axis_name, p_offset=p_offset, q_offset=q_offset)
  # An out-of-range id is never kept: it counts as p(x) = 0 (flagged below).
  log_b = log_block_weights(jnp.where(prep.in_range, p_x, 0), q_x)
  offsets = jnp.stack([jnp.asarray(p_offset, jnp.int32), jnp.asarray(q_offset, jnp.int32)])
  tau, token, row_err = _stop_rule(p, q, log_b, prep.uniforms, prep.limit, offsets,
                                   prep.safe_draft, dtype=prep.dtype, tol=prep.tol,
                                   axis_name=axis_name, bonus_given=bonus_token is not None)
  # Every b_i up to b_n is computed, so every position < n was read.
  return finish(prep, p_x, q_x, num_accepted=tau, token=token, num_uniforms=prep.limit + 1,
                tested=prep.positions < prep.limit, row_error=row_err, pad_id=pad_id,
                vocab=vocab, bonus_token=bonus_token, accepted_all=tau == prep.limit)


@public_jit(arrays=CHAIN_ARRAYS, static_argnames=("pad_id", "logprobs", "logprobs_mode"))
def block_verify(p: ArrayLike, q: ArrayLike | None, draft: ArrayLike,
                 uniforms: ArrayLike | None = None, *, key: ArrayLike | None = None,
                 num_draft: ArrayLike | None = None, pad_id: int = -1,
                 target_bitmask: ArrayLike | None = None,
                 draft_bitmask: ArrayLike | None = None, logprobs: int | None = None,
                 logprobs_mode: str = "processed") -> VerifyResult:
  """Block verification of one draft sequence (pure, jitted): exact, longer.

  Same signature and result as :func:`specdec_jax.verify`, so it plugs into
  ``speculative_generate(..., verifier=block_verify)`` (or ``verifier="block"``). With
  1-indexed positions and ``n = num_draft`` (``gamma`` by default):

  * ``b_0 = 1``, ``b_i = min(1, b_{i-1} p[i-1, x_i] / q[i-1, x_i])`` (log space);
  * ``Z_i = sum_v max(b_i p[i, v] - q[i, v], 0)`` and ``h_i = Z_i / (Z_i + 1 - b_i)``
    (1 when the denominator is 0) for ``0 < i < n``, ``h_n = b_n``, ``h_0 = 1``;
  * ``tau`` = the largest ``i`` in ``0 .. n`` with ``eta_i < h_i``;
  * emit ``draft[:tau]`` and one token drawn from ``p[n]`` if ``tau = n``, else from
    ``max(b_tau p[tau] - q[tau], 0)`` (``p[tau]`` if that is all zero).

  The test is ``eta_i < h_i`` (the paper writes ``<=``; the law is the same for a
  continuous uniform, and ``<`` never keeps a draft token of target probability 0 when a
  float uniform is exactly 0: ``0 <= 0`` would accept it).

  Uniform order: ``eta_i`` is ``uniforms[i - 1]`` for ``i = 1 .. n`` and the final sample
  reads ``uniforms[n]``; ``num_uniforms = n + 1`` always (every ``eta`` is part of the
  rule, whether or not the scan reached it). Slots after ``n`` are never read.

  ``tau`` is found by scanning ``i`` from ``n`` down in a ``lax.while_loop`` that stops at
  the first ``i`` it keeps: ``h_n`` needs no row, each ``h_i`` one fused pass over
  ``p[i]`` and ``q[i]``. The final token uses the two-level inverse CDF of
  :func:`specdec_jax.sample_index` on the block masses of the last row read. Values are
  checked like :func:`specdec_jax.verify`: draft ids, their probabilities and the
  uniforms of positions ``< n``, and every full row read (finite, non-negative, sums to 1);
  ``valid``/``error`` report problems and returned ids are always in ``[0, V)``.

  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    p: ``(gamma + 1, V)`` floating target distributions.
    q: ``(gamma, V)`` floating draft distributions (what ``draft`` was sampled from).
    draft: ``(gamma,)`` integer token ids in ``[0, V)``.
    uniforms: ``(gamma + 1,)`` floating, each in ``[0, 1)``; or
    key: one ``jax.random`` key (uniforms drawn as in :func:`~specdec_jax.verify`).
    num_draft: optional int32 scalar in ``[0, gamma]`` (ragged batches), as in ``verify``.
    pad_id: static int for the unused slots of ``tokens``.
    target_bitmask: optional grammar words ``(gamma + 1, ceil(V / 32))``: each target row is
      masked (token ``32 j + i`` allowed iff bit ``i`` of word ``j``) and renormalised; a row
      that allows nothing emits nothing (``ErrorCode.NO_ALLOWED_TOKEN``).
    draft_bitmask: optional ``(gamma, ceil(V / 32))``, the draft rows' masks, the same way.
    logprobs: static None, or ``k`` in ``[0, 64]``: the result's ``logprobs`` (each emitted
      token's log-probability under its (masked) target row) and, for ``k > 0``,
      ``top_ids`` / ``top_logprobs`` (the rows' ``k`` most likely tokens, ties to the lower id).
    logprobs_mode: static, ``"processed"`` or ``"raw"``: the same for probabilities.

  Returns:
    :class:`VerifyResult`; ``num_accepted = tau``, ``tokens`` of shape ``(gamma + 1,)``.

  Example:
    >>> import jax.numpy as jnp
    >>> p = jnp.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
    >>> q = jnp.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    >>> r = block_verify(p, q, jnp.array([1, 2]), jnp.array([0.7, 0.9, 0.1]))
    >>> r.tokens.tolist(), int(r.num_uniforms)
    ([1, 2, 0], 3)

  Reference:
    Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block Verification
    Accelerates Speculative Decoding", ICLR 2025, arXiv:2403.10444, Algorithm 2.
  """
  name = "block_verify"
  gamma, vocab = check_chain(name, p, q, draft, uniforms)
  check_scalar(name, "num_draft", num_draft, INT)
  dtype = compute_dtype(p.dtype, (p if q is None else q).dtype)
  uniforms = chain_randomness(name, key, uniforms, gamma, dtype)
  p = masked_rows(p, check_bitmask(name, "target_bitmask", target_bitmask, gamma + 1, vocab))
  if q is not None:
    q = masked_rows(q, check_bitmask(name, "draft_bitmask", draft_bitmask, gamma, vocab))
  result = block_verify_rows(p, q, draft, uniforms, num_draft, pad_id=pad_id, vocab=vocab)
  return finish_emitted(result, p, jnp.arange(gamma + 1, dtype=jnp.int32), pad_id=pad_id,
                        k=check_logprobs(name, logprobs, logprobs_mode, vocab),
                        mode=logprobs_mode)

