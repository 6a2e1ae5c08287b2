"""Logits as a lazily processed row source: a few statistics per row, probabilities where read.

The processed distribution of a logit row ``x`` under temperature ``T``, top-k and top-p
(:func:`~specdec_jax.process_logits`) is ``p_i = exp(z_i) / S`` on a kept set and 0 elsewhere,
with ``z = (x - max(x)) / T``. The kept set is a prefix of the order "logit descending, ties
toward the lower id", so it is ``{x > t} | {x == t and id < cut}`` for a threshold logit ``t``
(the last kept entry's own value: raw logits compare exactly, whereas ``z`` recomputed in
another fusion can differ by an ulp, XLA:CPU's vectorised division not being correctly
rounded) and an id ``cut``; ``S`` is the sum of ``exp(z)`` over it. :func:`logit_stats`
computes, per row, ``(max, T, S, t, cut, argmax, greedy, broken)`` and :func:`row_probs` turns
any slice of the row into its probabilities from them. A verifier then reads processed values
only where its rule reads (the gathered ``p(x)``, ``q(x)`` and the stop row): no processed copy
of the rows is written (:class:`LogitRows` is read through
:func:`~specdec_jax._rows.sources.reader`).

The statistics cost what the batch uses (batch-level ``lax.cond``): every row gets one pass for
the max, the argmax and the flags; a pass for ``S`` only if some row samples (not greedy); a
partial selection ``lax.top_k`` of the :data:`CANDIDATES` largest logits only if some row uses
top-k or top-p, which settles ``t``, ``cut`` and ``S`` of every row whose kept set ends inside
the candidates (the top-k/top-p of LM rows); rows it does not settle (a ``top_k`` above the
bound, a flat row whose nucleus is wider) are processed by the sort-free bisection of
:mod:`specdec_jax._logits.threshold`, one row at a time. Vocabulary-sharded rows (``axis_name``)
take the same passes over each device's columns: the per-row maxima, flags, argmax and normalisers
are combined by one collective of ``(R,)`` values for the whole batch, each device selects its
shard's candidates, the ``n * CANDIDATES`` per row are gathered and merged
(:func:`row_candidates`), and only the rows they do not settle bisect, with scalar collectives.

Reference: the same statistics drive FlashInfer's sorting-free top-k/top-p sampling and
tpu-inference's ``binary_search.py``; here they are kept instead of a processed array.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._core.checks import compute_dtype
from specdec_jax._logits.adjust import History
from specdec_jax._logits.adjust import RowEdits
from specdec_jax._logits.adjust import adjusted_row
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.adjust import rows_edits
from specdec_jax._logits.cuts import CANDIDATES
from specdec_jax._logits.cuts import bisected_row
from specdec_jax._logits.cuts import row_candidates
from specdec_jax._logits.cuts import scaled as scaled
from specdec_jax._logits.cuts import settle
from specdec_jax._logits.cuts import sort_candidates
from specdec_jax._logits.params import clipped
from specdec_jax._logits.params import take_rows
from specdec_jax._logits.passes import block_maxima
from specdec_jax._logits.passes import exp_sums
from specdec_jax._logits.passes import first_max
from specdec_jax._logits.passes import nan_rows
from specdec_jax._logits.passes import row_loop
from specdec_jax._logits.threshold import any_if
from specdec_jax._logits.threshold import first_column
from specdec_jax._logits.threshold import full_vocab
from specdec_jax._logits.threshold import reduce_if
from specdec_jax._logits.transform import temperature_scale


class LogitStats(NamedTuple):
  """Per-row statistics of processed logits (each field ``(R,)``, or scalars for one row).

  Attributes:
    top: the largest finite logit (0 for a broken row).
    scale: the temperature (1 for greedy rows; capped:
      :func:`~specdec_jax._logits.transform.temperature_scale`).
    norm: ``S``, the sum of ``exp(z)`` over the kept set.
    cut_value: ``t``, a logit: entries with ``x > t`` are kept ...
    cut_id: ... and those with ``x == t`` and a global id ``< cut_id``.
    argmax: the lowest global id of the largest logit (greedy rows: a point mass there).
    greedy: temperature not ``> 0``.
    broken: a NaN or ``+inf`` logit, or no finite one: the row reads as NaN.
    empty: the adjusted row allows no token (every entry masked, banned or ``-inf``; only
      with row edits, else all False): it is broken too, and nothing is drawn from it.
    top_values, top_ids: ``(R, k)`` the ``k`` largest adjusted logits in the kept-set order
      and their ids (with ``logprobs=k > 0``), else None.
    raw_top, raw_norm: the raw row's max and ``sum(exp(x - max))`` (``logprobs_mode="raw"``),
      else None; with
    raw_values, raw_ids: ``(R, k)`` the raw row's ``k`` largest logits and ids (``k > 0``).
  """

  top: jax.Array
  scale: jax.Array
  norm: jax.Array
  cut_value: jax.Array
  cut_id: jax.Array
  argmax: jax.Array
  greedy: jax.Array
  broken: jax.Array
  empty: jax.Array | None = None
  top_values: jax.Array | None = None
  top_ids: jax.Array | None = None
  raw_top: jax.Array | None = None
  raw_norm: jax.Array | None = None
  raw_values: jax.Array | None = None
  raw_ids: jax.Array | None = None


class LogitRows(NamedTuple):
  """Logit rows ``(R, V)`` (``V / n`` per device when sharded) and their :class:`LogitStats`.

  A row source for every rule: :func:`~specdec_jax._rows.sources.reader` reads probabilities from
  it. ``column``: the global id of the first column held here (0 unsharded). ``edits``: the rows'
  :class:`~specdec_jax._logits.adjust.RowEdits` (fields ``(R, ...)``) when a request's parameters
  adjust its logits before the temperature, else None: the probabilities are then those of the
  adjusted logits.
  """

  logits: jax.Array
  stats: LogitStats
  column: jax.Array
  edits: RowEdits | None = None

  @property
  def shape(self) -> tuple[int, ...]:
    return self.logits.shape

  @property
  def ndim(self) -> int:
    return self.logits.ndim

  @property
  def dtype(self) -> jnp.dtype:
    """The dtype of the probabilities read (at least float32)."""
    return compute_dtype(self.logits.dtype)


def row_probs(stats: LogitStats, x: jax.Array, ids: jax.Array) -> jax.Array:
  """Probabilities of entries ``x`` (logits) with global ids ``ids`` of the row(s) ``stats``.

  ``stats`` fields broadcast against ``x`` (one row's scalars, or one per entry).
  """
  dtype = stats.norm.dtype
  x = x.astype(dtype)
  z = (x - stats.top) / stats.scale  # `scaled` on rows that are not broken
  kept = (x > stats.cut_value) | ((x == stats.cut_value) & (ids < stats.cut_id))
  probs = jnp.where(kept, jnp.exp(z) / stats.norm, jnp.zeros((), dtype))
  probs = jnp.where(stats.greedy, (ids == stats.argmax).astype(dtype), probs)
  return jnp.where(stats.broken, jnp.asarray(jnp.nan, dtype), probs)


def _per_row(params, name, rows, dtype):
  """Field ``name`` of ``params`` as ``(rows,)`` of ``dtype`` (None stays None)."""
  value = getattr(params, name)
  if value is None:
    return None
  return jnp.broadcast_to(jnp.asarray(value), (rows,)).astype(dtype)


def _sparse_top(values: jax.Array, ids: jax.Array, vocab: int):
  """``(max, lowest id attaining it)`` per row of listed entries ``(R, E)``."""
  if values.shape[-1] == 0:
    return (jnp.full(values.shape[:1], -jnp.inf, values.dtype),
            jnp.full(values.shape[:1], vocab, jnp.int32))
  top = jnp.max(values, axis=-1)
  return top, jnp.min(jnp.where(values == top[:, None], ids, vocab), axis=-1).astype(jnp.int32)


def logit_stats(logits: jax.Array, params, axis_name: str | None = None, *,
                candidates: bool = True, edits: RowEdits | None = None, logprobs: int = 0,
                raw: bool = False, min_p_last: bool = False) -> LogitStats:
  """:class:`LogitStats` of rows ``(R, V)`` with per-row ``params`` (fields ``(R,)``, scalars,
  or None to remove a step at trace time); ``axis_name``: the rows are this device's columns.
  ``candidates=False`` cuts every row by the bisection (the same statistics; for tests and
  benchmarks). ``edits``: the rows' :class:`~specdec_jax._logits.adjust.RowEdits`: the statistics
  are those of the adjusted rows, read as the raw rows under the dense mask (``words``, unpacked
  inside each pass: no adjusted row is written) with the listed entries folded in.
  ``logprobs > 0`` (static) keeps each row's ``logprobs`` largest adjusted logits in the
  kept-set order (one partial selection); ``raw`` (static) adds the raw row's max and
  normaliser (one more pass) and, with ``logprobs``, its largest raw logits. ``min_p_last``
  (static): ``min_p`` after top-k and top-p (sglang-jax's order).

  Out-of-range parameters are clipped as :func:`~specdec_jax._logits.transform.process_row` clips
  them (the caller flags ``BAD_PARAMS``).
  """
  rows, vocab_local = logits.shape
  vocab = full_vocab(vocab_local, axis_name)
  dtype = compute_dtype(logits.dtype)
  x = logits.astype(dtype)
  temperature = jnp.broadcast_to(jnp.asarray(params.temperature, dtype), (rows,))
  k = None if params.top_k is None else jnp.broadcast_to(jnp.asarray(params.top_k), (rows,))
  # Compared in its own dtype before the int32 cast (a wide k cannot wrap into range).
  k_eff = None if k is None else jnp.where(k > 0, jnp.minimum(k, vocab), vocab).astype(jnp.int32)
  top_p = _per_row(params, "top_p", rows, dtype)
  min_p = _per_row(params, "min_p", rows, dtype)
  if min_p is not None:
    min_p = jnp.clip(min_p, 0, 1)
  zeros = jnp.zeros((rows,), dtype)
  column = first_column(vocab_local, axis_name)
  words = None
  if edits is not None:
    listed = edits.values.astype(dtype)
    words = edits.words
  # One read: block maxima; the row max, the flags and (from one block) the argmax follow.
  # Sharded, each is combined over the devices by one collective of (R,) values for the batch.
  # Under a mask (row edits) every pass applies it as it reads, a row at a time: no masked
  # copy of the rows is written (:mod:`specdec_jax._logits.passes`).
  maxima = block_maxima(x, words=words)
  dense_top = jnp.max(maxima, axis=-1)
  argmax = first_max(x, maxima, dense_top, words=words) + column
  local_top = dense_top
  if edits is not None:  # the listed entries held here join the max and the argmax
    listed_top, listed_arg = _sparse_top(listed, edits.ids, vocab)
    local_top = jnp.maximum(dense_top, listed_top)
    argmax = jnp.minimum(jnp.where(dense_top == local_top, argmax, vocab),
                         jnp.where(listed_top == local_top, listed_arg, vocab))
  raw_top = reduce_if(lax.pmax, local_top, axis_name)
  infinite = ~jnp.isfinite(raw_top)  # +inf somewhere or no finite entry: the max tells
  top = jnp.where(infinite, zeros, raw_top.astype(dtype))
  if axis_name is not None:  # the lowest global id attaining the global max
    argmax = lax.pmin(jnp.where(local_top == raw_top, argmax, vocab), axis_name)
  greedy = ~(temperature > 0)
  scale = temperature_scale(temperature, greedy)

  def listed_exp():
    if edits is None or not edits.ids.shape[-1]:
      return jnp.zeros_like(top)
    return jnp.sum(jnp.exp((listed - top[:, None]) / scale[:, None]), axis=-1)

  # A NaN the max may drop (XLA:CPU's does, see `nan_rows`); a sum propagates it. When some
  # row samples from its whole row, one more read gives the normaliser of every row, NaN
  # exactly where a NaN is (each exp is at most 1: no overflow); otherwise a plain sum tells.
  def full_norm():
    # Plain (x - top) / T: equal to `scaled` on every row that is not broken (-inf stays
    # -inf), and 3x faster on XLA:CPU without the select; broken rows read as NaN anyway.
    norm = reduce_if(lax.psum, exp_sums(x, top, scale, words) + listed_exp(), axis_name)
    return norm, jnp.isnan(norm)

  def nan_only():
    nan = nan_rows(x, top, words)
    if edits is not None:
      nan = nan | jnp.any(jnp.isnan(listed), axis=-1)
    return jnp.zeros_like(top), any_if(nan, axis_name)

  # The sampled rows that top-k does not cut need the normaliser of the whole row (a row
  # top-k cuts takes its normaliser from the candidates or the bisection).
  reads_all = ~greedy & ~infinite
  if k_eff is not None:
    reads_all = reads_all & (k_eff >= vocab)
  norm_all, nan = lax.cond(jnp.any(reads_all), full_norm, nan_only)
  broken = infinite | nan
  top = jnp.where(broken, zeros, top)
  sampled = ~greedy & ~broken
  typed = jnp.zeros_like(top)  # typed like the statistics (inside shard_map: the same axes)
  keep_all = (typed - jnp.inf, typed.astype(jnp.int32) + vocab, norm_all)
  cutting = jnp.zeros((rows,), bool)
  if k_eff is not None:
    cutting = cutting | (k_eff < vocab)
  if top_p is not None:
    cutting = cutting | (jnp.clip(top_p, jnp.finfo(dtype).tiny, 1) < 1)
  if min_p is not None:
    cutting = cutting | (min_p > 0)
  cutting = cutting & sampled
  raw_rows = logits.astype(dtype)

  def bisect(rows_to_cut):
    """The bisection, one row at a time (the row stays in cache), for ``rows_to_cut``; a row
    with edits is adjusted first (one ``(V,)`` row at a time, never the batch)."""
    def one(args):
      needed, row, top, scale, k_eff, top_p, min_p, row_edits = args
      zero = jnp.zeros_like(top)  # typed like the row's statistics (shard_map's axes)
      def cut():
        adjusted = adjusted_row(row, row_edits, column)
        return bisected_row(adjusted, top, scale, k_eff, top_p, min_p, axis_name=axis_name,
                            min_p_last=min_p_last)
      return lax.cond(needed, cut,
                      lambda: (zero - jnp.inf, zero.astype(jnp.int32) + vocab, zero))
    return row_loop(lambda *args: one(args),
                    (rows_to_cut, raw_rows, top, scale, k_eff, top_p, min_p, edits))

  merged = None  # with logprobs the candidates are made once, for the cut and the top-k
  if logprobs > 0:
    merged = _merged_candidates(x, words, maxima, edits, listed if edits is not None else None,
                                axis_name)
  extra = _extra_stats(logits, merged, maxima, edits, raw_top, broken, axis_name, logprobs, raw)
  if k is None and top_p is None and min_p is None:
    return LogitStats(top, scale, norm_all, *keep_all[:2], argmax, greedy, broken, **extra)

  def cut_rows():
    xs, order_ids, floor = merged or _merged_candidates(
      x, words, maxima, edits, listed if edits is not None else None, axis_name)
    local = min(CANDIDATES, vocab_local)  # row_candidates' length (static)
    count = local if axis_name is None else min(CANDIDATES, local * lax.axis_size(axis_name))
    complete = count >= vocab
    t, cut, norm, settled = settle(xs, order_ids, floor, top, scale, norm_all, k_eff, top_p,
                                   min_p, vocab, min_p_last)
    if complete:  # every row settles, and no fallback is compiled
      return t, cut, norm
    pending = cutting & ~settled
    slow = lax.cond(jnp.any(pending), lambda: bisect(pending), lambda: (t, cut, norm))
    return tuple(jnp.where(pending, s, f) for s, f in zip(slow, (t, cut, norm), strict=True))

  t, cut, norm = lax.cond(jnp.any(cutting), cut_rows if candidates else lambda: bisect(cutting),
                          lambda: keep_all)
  t, cut, norm = (jnp.where(cutting, a, b) for a, b in zip((t, cut, norm), keep_all, strict=True))
  return LogitStats(top, scale, norm, t, cut.astype(jnp.int32), argmax, greedy, broken,
                    **extra)


def _merged_candidates(x, words, maxima, edits, listed, axis_name):
  """The kept-set-ordered candidates of rows ``x`` (their dense part) with the listed entries
  of ``edits`` merged in: ``(values, ids, floor)``, the list holding every entry above ``floor``
  (``-inf``: every entry, the candidates being the whole row)."""
  values, ids = row_candidates(x, maxima, axis_name, words)
  vocab = full_vocab(x.shape[-1], axis_name)
  complete = values.shape[-1] >= vocab
  floor = jnp.full(values.shape[:1], -jnp.inf, x.dtype) if complete else jnp.min(
    values, axis=-1).astype(x.dtype)
  if edits is not None:  # every listed entry is a candidate (its value from its device)
    shared = listed if axis_name is None else lax.pmax(listed, axis_name)
    values = jnp.concatenate([values.astype(listed.dtype), shared], axis=-1)
    ids = jnp.concatenate([ids.astype(jnp.int32), edits.ids], axis=-1)
  xs, order_ids = sort_candidates(values.astype(x.dtype), ids)
  return xs, order_ids, floor


def _extra_stats(logits, merged, maxima, edits, raw_top, broken, axis_name, logprobs: int,
                 raw: bool) -> dict:
  """The optional :class:`LogitStats` fields: ``empty``, the top candidates for logprobs (from
  ``merged``, :func:`_merged_candidates`), the raw row's statistics."""
  extra = {"empty": (raw_top == -jnp.inf) if edits is not None else jnp.zeros_like(broken)}
  if logprobs > 0:
    xs, ids, _ = merged
    extra.update(top_values=xs[:, :logprobs], top_ids=ids[:, :logprobs])
  if raw:
    dtype = compute_dtype(logits.dtype)
    plain = logits.astype(dtype)
    raw_maxima = maxima if edits is None else block_maxima(plain)
    top = reduce_if(lax.pmax, jnp.max(raw_maxima, axis=-1), axis_name)
    top = jnp.where(jnp.isfinite(top), top, jnp.zeros_like(top))
    norm = reduce_if(lax.psum, exp_sums(plain, top, jnp.ones_like(top)), axis_name)
    extra.update(raw_top=top, raw_norm=norm)
    if logprobs > 0:
      values, ids = row_candidates(plain, raw_maxima, axis_name)
      xs, order_ids = sort_candidates(values.astype(dtype), ids)
      extra.update(raw_values=xs[:, :logprobs], raw_ids=order_ids[:, :logprobs])
  return extra


def lazy_rows(logits: jax.Array, params, axis_name: str | None = None,
              edits: RowEdits | None = None, logprobs: int = 0, raw: bool = False,
              min_p_last: bool = False) -> LogitRows:
  """:class:`LogitRows` of ``(R, V)`` logits (this device's columns with ``axis_name``) and,
  when a request adjusts them, their :class:`~specdec_jax._logits.adjust.RowEdits` ``edits``
  (``logprobs``, ``raw``: as in :func:`logit_stats`)."""
  column = (jnp.int32(0) if axis_name is None
            else lax.axis_index(axis_name).astype(jnp.int32) * logits.shape[-1])
  stats = logit_stats(logits, params, axis_name, edits=edits, logprobs=logprobs, raw=raw,
                      min_p_last=min_p_last)
  return LogitRows(logits, stats, column, edits)


def request_rows(logits: jax.Array, params, owners: jax.Array, axis_name: str | None = None, *,
                 history=None, prefix=None, prefix_len=None, bitmask=None, logprobs: int = 0,
                 raw: bool = False, min_p_last: bool = False) -> LogitRows:
  """:class:`LogitRows` of rows ``(R, V)`` that requests own: row ``r`` belongs to request
  ``owners[r]`` (its ``params`` and ``history`` fields, with a leading ``B`` or shared) and
  follows the draft tokens ``prefix[r, :prefix_len[r]]``; ``bitmask`` ``(R, W)`` masks it. The
  rows' :class:`~specdec_jax._logits.adjust.RowEdits` are made only when something adjusts them
  (``logprobs``, ``raw``: as in :func:`logit_stats`)."""
  rows = logits.shape[0]
  row_params = take_rows(params, owners)
  edits = None
  if needs_edits(params, bitmask):
    if prefix is None:
      prefix, prefix_len = jnp.full((rows, 0), -1, jnp.int32), jnp.zeros(rows, jnp.int32)
    row_history = None if history is None else History(*(
      None if h is None else (jnp.asarray(h)[owners] if jnp.ndim(h) == 2 else
                              jnp.broadcast_to(jnp.asarray(h), (rows, *jnp.shape(h))))
      for h in history))
    edits = rows_edits(logits, clipped(row_params), row_history, prefix, prefix_len, bitmask,
                       first_column(logits.shape[-1], axis_name))
  return lazy_rows(logits, row_params, axis_name, edits, logprobs, raw, min_p_last)


def sequence_params(params, rows: int):
  """One sequence's parameters, broadcast to its ``rows`` rows (None stays None)."""
  return take_rows(params, jnp.zeros((rows,), jnp.int32))


__all__ = ["CANDIDATES", "LogitRows", "LogitStats", "lazy_rows", "logit_stats", "request_rows",
           "row_probs", "scaled"]
