"""What the chain rules (token-wise and block) share: preparation, gathering and the result.

A chain rule reads ``gamma`` draft ids, their ``2 * gamma`` probabilities (gathered through the
row sources of :mod:`~specdec_jax._rows.sources`, so packed rows, point-mass drafts and vocabulary
shards read alike), decides how many to keep, and samples one final token. :func:`prepare`
derives what every rule needs from its arguments, :func:`finish` turns the decision into the
:class:`VerifyResult` (the caller's bonus token, when given, replaces the sampled one after a
full acceptance; the validity bits of everything read).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import INT
from specdec_jax._core.checks import KEY
from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.errors import ErrorCode
from specdec_jax._core.errors import flag
from specdec_jax._core.errors import or_reduce
from specdec_jax._core.errors import row_tolerance
from specdec_jax._core.errors import uniform_codes
from specdec_jax._core.errors import value_codes
from specdec_jax._core.keys import key_uniforms
from specdec_jax._core.keys import one_source
from specdec_jax._core.results import VerifyResult
from specdec_jax._rows.sources import entries
from specdec_jax._rows.sources import sharded_entry

#: The array arguments of the chain verifiers, converted on the host by ``public_jit``.
CHAIN_ARRAYS = {"key": KEY, "p": FLOAT, "q": FLOAT, "draft": INT, "uniforms": FLOAT,
                "num_draft": INT, "target_logits": FLOAT, "draft_logits": FLOAT}


class Prepared(NamedTuple):
  """What every chain rule derives from its arguments before reading any probability."""

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
  """Dtypes, the clipped ``num_draft`` and the clipped draft ids, shared by the chain rules.

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


def row_indices(offset, positions, num_rows: int) -> jax.Array:
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
  device's ``V / n`` columns (:func:`~specdec_jax._rows.sources.sharded_entry`: one scalar each).
  """
  positions, ids, dtype = prep.positions, prep.safe_draft, prep.dtype
  local_vocab = p.shape[-1]
  p_rows = row_indices(p_offset, positions, p.shape[0])
  p_x = sharded_entry(lambda local: entries(p, p_rows, local), ids, local_vocab, axis_name)
  if q is None:
    return p_x.astype(dtype), jnp.ones(positions.shape, dtype) + jnp.zeros_like(p_x, dtype)
  q_rows = row_indices(q_offset, positions, q.shape[0])
  q_x = sharded_entry(lambda local: entries(q, q_rows, local), ids, local_vocab, axis_name)
  return p_x.astype(dtype), q_x.astype(dtype)


def finish(prep: Prepared, p_x, q_x, *, num_accepted, token, num_uniforms, tested,
           row_error, pad_id: int, vocab: int, bonus_token=None,
           accepted_all=None) -> VerifyResult:
  """The :class:`VerifyResult` of a chain rule, written once.

  Args:
    prep: what :func:`prepare` derived.
    p_x, q_x: ``(gamma,)`` the gathered probabilities of the draft tokens.
    num_accepted: int32 scalar, how many draft tokens are kept.
    token: int32 scalar, the sampled replacement or bonus token, in ``[0, V)``.
    num_uniforms: int32 scalar, how many uniforms the rule read (slots ``0 .. n - 1``),
      counting the final sample's.
    tested: ``(gamma,)`` bool, the positions whose id and probabilities were read.
    row_error: int32 error bits of the full rows that were read.
    pad_id: written into the unused slots.
    vocab: the global vocabulary size (checks ``bonus_token``).
    bonus_token: optional traced id sampled by the caller: where ``accepted_all`` it is
      emitted instead of ``token`` (whose row was then not read, see the rules) and the final
      uniform is not read.
    accepted_all: bool scalar, every real proposal was kept (with ``bonus_token`` only).
  """
  if bonus_token is not None:
    bonus_ok, safe_bonus = id_in_range(bonus_token, vocab)
    token = jnp.where(accepted_all, safe_bonus, token)
    row_error = jnp.where(accepted_all, flag(~bonus_ok, ErrorCode.TOKEN_OUT_OF_RANGE), row_error)
    num_uniforms = num_uniforms - accepted_all.astype(jnp.int32)
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

def chain_randomness(name: str, key, uniforms, gamma: int, dtype):
  """The ``gamma + 1`` uniforms of a one-sequence chain verifier: given, or drawn from ``key``."""
  one_source(name, key, uniforms)
  return uniforms if key is None else key_uniforms(name, key, gamma + 1, dtype)
