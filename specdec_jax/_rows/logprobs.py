"""Logprobs of the emitted tokens, and the top-k of the rows they were drawn from.

RL training and engines' ``logprobs=k`` need, per emitted token, its log-probability under the
target's processed distribution (the law of that position: an accepted draft's target row, the
replacement's and the bonus token's too, as vLLM reports), and the ``k`` most likely tokens of
that distribution. From logits both come from the row statistics of :mod:`specdec_jax._logits.lazy`:
``log p = (x' - top) / T - log S`` on the kept set (``-inf`` off it; greedy rows: 0 at the
argmax), one gathered entry per token, no pass over a row; the top-k are the statistics' kept
candidates (the largest adjusted logits, ties toward the lower id). ``mode="raw"`` gives them
under the raw logits' softmax instead (``x - max x - log sum exp``, before every adjustment and
the temperature: vLLM's ``raw_logprobs``). From probabilities, ``log p`` of the row as given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from specdec_jax._core.errors import ErrorCode
from specdec_jax._logits.adjust import bits
from specdec_jax._logits.adjust import edited_entries
from specdec_jax._logits.cuts import CANDIDATES
from specdec_jax._logits.cuts import gather
from specdec_jax._logits.lazy import LogitRows
from specdec_jax._rows.sources import MaskedRows
from specdec_jax._rows.sources import entries
from specdec_jax._rows.sources import sharded_entry

#: ``logprobs_mode``: under the processed target distribution, or the raw logits' softmax.
MODES = ("processed", "raw")


def check_logprobs(name: str, logprobs, mode: str, vocab: int | None) -> int | None:
  """The static ``logprobs`` (None, or an int in ``[0, min(64, V)]``) and ``logprobs_mode``."""
  if mode not in MODES:
    raise ValueError(f"{name}: `logprobs_mode` must be one of {MODES}, got {mode!r} instead.")
  if logprobs is None:
    return None
  limit = CANDIDATES if vocab is None else min(CANDIDATES, vocab)
  if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= limit:
    raise ValueError(f"{name}: `logprobs` must be a static int in [0, {limit}] (0: the emitted "
                     f"tokens' own logprobs; k: the top k of each row too), got {logprobs!r} "
                     "instead.")
  return int(logprobs)


def _adjusted(rows: LogitRows, row, local):
  """Adjusted logits of entries at local columns ``local`` of rows ``row`` (any shape)."""
  x = rows.logits[row, local].astype(rows.dtype)
  if rows.edits is None:
    return x
  return edited_entries(jax.tree.map(lambda e: e[row], rows.edits), x, local, rows.column)


def _processed(stats, x, ids, dtype):
  """``log p`` of adjusted logits ``x`` (global ids ``ids``) under rows ``stats``."""
  z = (x - stats.top) / stats.scale
  kept = (x > stats.cut_value) | ((x == stats.cut_value) & (ids < stats.cut_id))
  lp = jnp.where(kept, z - jnp.log(stats.norm), -jnp.inf).astype(dtype)
  lp = jnp.where(stats.greedy, jnp.where(ids == stats.argmax, 0.0, -jnp.inf).astype(dtype), lp)
  return jnp.where(stats.broken, jnp.asarray(jnp.nan, dtype), lp)


def entry_logprobs(source, rows: jax.Array, tokens: jax.Array, *, mode: str,
                   axis_name: str | None = None) -> jax.Array:
  """``log p`` of ``tokens`` (global ids, any shape) in rows ``rows`` of ``source``
  (:class:`~specdec_jax._logits.lazy.LogitRows`, or probability rows ``(R, V_local)``)."""
  local_vocab = source.shape[-1]
  tokens = jnp.asarray(tokens, jnp.int32)
  if not isinstance(source, LogitRows):  # probabilities (under a bitmask, MaskedRows)
    p = sharded_entry(lambda local: entries(source, rows, local), tokens, local_vocab,
                      axis_name)
    return jnp.log(p.astype(jnp.promote_types(source.dtype, jnp.float32)))
  stats = jax.tree.map(lambda s: s[rows], source.stats)
  dtype = source.dtype
  if mode == "raw":
    x = sharded_entry(lambda local: source.logits[rows, local].astype(dtype), tokens,
                      local_vocab, axis_name, source.column)
    return x - stats.raw_top - jnp.log(stats.raw_norm)
  x = sharded_entry(lambda local: _adjusted(source, rows, local), tokens, local_vocab,
                    axis_name, source.column)
  return _processed(stats, x, tokens, dtype)


def top_logprobs(source, rows: jax.Array, k: int, *, mode: str,
                 axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
  """``(ids, logprobs)`` ``(n, k)``: the ``k`` most likely tokens of rows ``rows`` ``(n,)``, in
  order (ties toward the lower id)."""
  if not isinstance(source, LogitRows):
    if isinstance(source, MaskedRows):
      full = jnp.where(bits(source.words[rows], source.shape[-1]),
                       source.probs[rows] / source.mass[rows][:, None], 0)
    else:
      full = source[rows]
    values, ids = lax.top_k(full.astype(jnp.float32), k)
    if axis_name is not None:  # each shard's top k, gathered, merged (device order = id order)
      ids = ids + lax.axis_index(axis_name) * source.shape[-1]
      values, ids = gather(values, axis_name), gather(ids, axis_name)
      values, at = lax.top_k(values, k)
      ids = jnp.take_along_axis(ids, at, axis=-1)
    return ids.astype(jnp.int32), jnp.log(values)
  stats = jax.tree.map(lambda s: s[rows], source.stats)
  if mode == "raw":
    values, ids = stats.raw_values[:, :k], stats.raw_ids[:, :k]
    return ids, values - stats.raw_top[:, None] - jnp.log(stats.raw_norm)[:, None]
  values, ids = stats.top_values[:, :k], stats.top_ids[:, :k]
  expand = jax.tree.map(lambda s: s[:, None], stats)
  lp = _processed(expand, values, ids, source.dtype)
  # Past the kept tokens every logprob is -inf: ties, listed by id (the lowest ids not kept).
  vocab = _vocab(source, axis_name)
  spare = jnp.minimum(jnp.arange(2 * k, dtype=jnp.int32), vocab - 1)[None, :]
  spare_rows = jnp.broadcast_to(rows[:, None], (rows.shape[0], 2 * k))
  spare_lp = entry_logprobs(source, spare_rows, jnp.broadcast_to(spare, spare_rows.shape),
                            mode=mode, axis_name=axis_name)
  kept = jnp.sum(lp > -jnp.inf, axis=-1)  # a prefix of the order
  # The spare ids that are not kept, in id order: rank them, then take the first ones.
  free = spare_lp == -jnp.inf
  rank = jnp.cumsum(free, axis=-1) - 1
  j = jnp.arange(k, dtype=jnp.int32)[None, :]
  want = j - kept[:, None]  # which free id slot j takes (j >= kept)
  pick = jnp.argmax(free[:, None, :] & (rank[:, None, :] == want[:, :, None]), axis=-1)
  fill = jnp.take_along_axis(jnp.broadcast_to(spare, spare_rows.shape), pick, axis=-1)
  use = (j >= kept[:, None]) & ~jnp.isnan(lp)
  return (jnp.where(use, fill, ids).astype(jnp.int32),
          jnp.where(use, jnp.asarray(-jnp.inf, lp.dtype), lp))


def _vocab(source: LogitRows, axis_name: str | None) -> int:
  """The global vocabulary size of a row source (static)."""
  local = source.shape[-1]
  return local if axis_name is None else local * lax.axis_size(axis_name)


def with_logprobs(result, source, rows: jax.Array, emitted: jax.Array, k: int | None, *,
                  mode: str, pad_id: int, axis_name: str | None = None, unknown=None):
  """``result`` (one sequence's, tokens ``(S,)``) with ``logprobs`` ``(S,)`` (NaN in unused
  slots) and, for ``k > 0``, ``top_ids`` ``(S, k)`` (``pad_id`` in unused slots) and
  ``top_logprobs`` ``(S, k)``. ``rows`` ``(S,)``: the row each slot's token was drawn from;
  ``emitted`` ``(S,)``: which slots hold a token; ``unknown`` ``(S,)``: slots whose token came
  from elsewhere (a caller's bonus token): NaN."""
  if k is None:
    return result
  tokens = jnp.where(emitted, result.tokens, 0)
  nan = jnp.asarray(jnp.nan, jnp.float32)
  blank = ~emitted if unknown is None else ~emitted | unknown
  lp = entry_logprobs(source, rows, tokens, mode=mode, axis_name=axis_name)
  out = {"logprobs": jnp.where(blank, nan, lp.astype(jnp.float32))}
  if k > 0:
    ids, values = top_logprobs(source, rows, k, mode=mode, axis_name=axis_name)
    out["top_ids"] = jnp.where(blank[:, None], jnp.int32(pad_id), ids.astype(jnp.int32))
    out["top_logprobs"] = jnp.where(blank[:, None], nan, values.astype(jnp.float32))
  return result._replace(**out)





def result_specs(logprobs: int | None, spec=None) -> tuple:
  """The ``PartitionSpec`` of a result's logprobs fields (``shard_map``'s ``out_specs``)."""
  spec = P() if spec is None else spec
  if logprobs is None:
    return (None, None, None)
  return (spec, spec, spec) if logprobs > 0 else (spec, None, None)


def finish_emitted(result, source, rows: jax.Array, *, pad_id: int, k: int | None, mode: str,
                   axis_name: str | None = None, caller_token=None):
  """One sequence's result after its rule, from its target row source: the final token dropped
  where its row allows no token (``NO_ALLOWED_TOKEN``), then the logprobs.

  ``rows`` ``(S,)``: the target row each slot's token is drawn from (the final token's too);
  ``caller_token``: bool scalar, the final token is a caller's bonus token (its row unread).
  """
  slots = jnp.arange(result.tokens.shape[-1], dtype=jnp.int32)
  final = result.num_tokens - 1
  mine = True if caller_token is None else ~caller_token
  if isinstance(source, MaskedRows):
    empty = ~(source.mass > 0)
  else:
    empty = getattr(getattr(source, "stats", None), "empty", None)
  if empty is not None:
    final_row = jnp.take(rows, jnp.clip(final, 0, rows.shape[0] - 1))
    nothing = empty[final_row] & mine
    tokens = jnp.where(nothing & (slots == final), jnp.int32(pad_id), result.tokens)
    error = result.error | jnp.where(nothing, jnp.int32(ErrorCode.NO_ALLOWED_TOKEN.value), 0)
    result = result._replace(tokens=tokens, num_tokens=result.num_tokens - nothing.astype(
      jnp.int32), error=error, valid=error == 0)
  unknown = None if caller_token is None else caller_token & (slots == final)
  return with_logprobs(result, source, rows, slots < result.num_tokens, k, mode=mode,
                       pad_id=pad_id, axis_name=axis_name, unknown=unknown)


def path_rows(path: jax.Array, offset=0) -> jax.Array:
  """``(max_depth + 1,)``: the row each slot of a tree's tokens is drawn from: the root's for
  the first, then the accepted nodes' (``path`` ``(max_depth + 1,)``, ``-1`` past its end: the
  root's row there, unread)."""
  return offset + jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.maximum(path[:-1], 0)])


__all__ = ["MODES", "check_logprobs", "entry_logprobs", "finish_emitted", "path_rows",
           "result_specs",
           "top_logprobs",
           "with_logprobs"]
