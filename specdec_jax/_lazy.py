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
of the rows is written (:class:`LogitRows` is read through :func:`~specdec_jax._rows.reader`).

The statistics cost what the batch uses (batch-level ``lax.cond``): every row gets one pass for
the max, the argmax and the flags; a pass for ``S`` only if some row samples (not greedy); a
partial selection ``lax.top_k`` of the :data:`CANDIDATES` largest logits only if some row uses
top-k or top-p, which settles ``t``, ``cut`` and ``S`` of every row whose kept set ends inside
the candidates (the top-k/top-p of LM rows); rows it does not settle (a ``top_k`` above the
bound, a flat row whose nucleus is wider) are processed by the sort-free bisection of
:mod:`specdec_jax._threshold`, one row at a time. Vocabulary-sharded rows (``axis_name``) take
the same passes over each device's columns: the per-row maxima, flags, argmax and normalisers
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

from specdec_jax._checks import compute_dtype
from specdec_jax._process import kept_set_keys
from specdec_jax._process import temperature_scale
from specdec_jax._row_passes import block_maxima
from specdec_jax._row_passes import exp_sums
from specdec_jax._row_passes import first_max
from specdec_jax._row_passes import nan_rows
from specdec_jax._row_passes import top_candidates
from specdec_jax._threshold import any_if
from specdec_jax._threshold import first_column
from specdec_jax._threshold import full_vocab
from specdec_jax._threshold import reduce_if
from specdec_jax._threshold import softmax
from specdec_jax._threshold import top_k_mask
from specdec_jax._threshold import top_p_mask

#: Candidates per row for the partial selection: a kept set that ends inside them is settled
#: without another pass over the row; others fall back to the bisection. XLA:CPU's ``TopK``
#: costs about linearly in ``k``: 32 keeps the selection at two floors of V = 32,000.
CANDIDATES = 64

class LogitStats(NamedTuple):
  """Per-row statistics of processed logits (each field ``(R,)``, or scalars for one row).

  Attributes:
    top: the largest finite logit (0 for a broken row).
    scale: the temperature (1 for greedy rows; capped:
      :func:`~specdec_jax._process.temperature_scale`).
    norm: ``S``, the sum of ``exp(z)`` over the kept set.
    cut_value: ``t``, a logit: entries with ``x > t`` are kept ...
    cut_id: ... and those with ``x == t`` and a global id ``< cut_id``.
    argmax: the lowest global id of the largest logit (greedy rows: a point mass there).
    greedy: temperature not ``> 0``.
    broken: a NaN or ``+inf`` logit, or no finite one: the row reads as NaN.
  """

  top: jax.Array
  scale: jax.Array
  norm: jax.Array
  cut_value: jax.Array
  cut_id: jax.Array
  argmax: jax.Array
  greedy: jax.Array
  broken: jax.Array


class LogitRows(NamedTuple):
  """Logit rows ``(R, V)`` (``V / n`` per device when sharded) and their :class:`LogitStats`.

  A row source for every rule: :func:`~specdec_jax._rows.reader` reads probabilities from it.
  ``column``: the global id of the first column held here (0 unsharded).
  """

  logits: jax.Array
  stats: LogitStats
  column: jax.Array

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


def scaled(x: jax.Array, top, scale) -> jax.Array:
  """``z = (x - top) / scale`` over the finite logits, ``-inf`` elsewhere (as
  :func:`~specdec_jax._process.scaled_logits`, bit for bit)."""
  return jnp.where(jnp.isfinite(x), (x - top) / scale, -jnp.inf)


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


def row_loop(fn, xs):
  """``fn`` over the leading axis of ``xs``: a loop on XLA:CPU (each row read once while it is
  in cache, and ``lax.cond`` inside ``fn`` skips work per row), ``jax.vmap`` elsewhere."""
  def looped(*xs):
    return lax.map(lambda row: fn(*row), xs)

  def vectorised(*xs):
    return jax.vmap(fn)(*xs)

  return lax.platform_dependent(*xs, cpu=looped, default=vectorised)


def _per_row(params, name, rows, dtype):
  """Field ``name`` of ``params`` as ``(rows,)`` of ``dtype`` (None stays None)."""
  value = getattr(params, name)
  if value is None:
    return None
  return jnp.broadcast_to(jnp.asarray(value), (rows,)).astype(dtype)


def _bisected_row(x, top, scale, k_eff, top_p, *, axis_name):
  """``(t, cut, S)`` of one row by the sort-free masks of :mod:`specdec_jax._threshold`:
  exactly :func:`~specdec_jax._process.process_row`'s kept set and normaliser. A step that
  does not cut this row (``k_eff = V``, ``top_p >= 1``) is skipped (``lax.cond``)."""
  dtype = x.dtype
  vocab = full_vocab(x.shape[-1], axis_name)
  z = scaled(x, top, scale)
  key = kept_set_keys(x)  # cut on the raw logits, as process_row
  every = (z == z) | True  # typed like the row (inside shard_map: varying over its axis)
  keep = every
  if k_eff is not None:
    keep = lax.cond(k_eff < vocab, lambda: top_k_mask(key, k_eff, axis_name), lambda: every)
  if top_p is not None:
    clipped = jnp.clip(top_p, jnp.finfo(dtype).tiny, 1)
    masked = jnp.where(keep, z, -jnp.inf)
    masked_key = jnp.where(keep, key, -jnp.inf)
    keep = keep & lax.cond(
      clipped < 1,
      lambda: top_p_mask(masked_key, softmax(masked, axis_name), clipped, axis_name),
      lambda: every)
  first = 0 if axis_name is None else lax.axis_index(axis_name).astype(jnp.int32) * x.shape[-1]
  ids = first + jnp.arange(x.shape[-1], dtype=jnp.int32)
  t = reduce_if(lax.pmin, jnp.min(jnp.where(keep, x, jnp.inf)), axis_name)
  cut = reduce_if(lax.pmax, jnp.max(jnp.where(keep & (x == t), ids, -1)), axis_name) + 1
  norm = reduce_if(lax.psum, jnp.sum(jnp.where(keep, jnp.exp(z), jnp.zeros((), dtype))),
                   axis_name)
  return t, cut.astype(jnp.int32), norm


def _candidates_settle(vals, idx, top, scale, norm_all, k_eff, top_p, vocab):
  """``(t, cut, S, settled)`` per row from its largest logits ``vals`` (ids ``idx``).

  The candidates are re-ordered by ``(x desc, id asc)``; the kept prefix is cut after top-k,
  then after the first candidate whose preceding top-p mass is ``>= top_p``. The row is
  settled when the cut's tie group lies inside the candidates (its logit is above the smallest
  candidate's), or every entry is a candidate.
  """
  dtype = top.dtype
  candidates = vals.shape[-1]
  neg, ids = lax.sort((-vals.astype(dtype), idx.astype(jnp.int32)), dimension=-1, num_keys=2)
  xs = -neg
  zs = scaled(xs, top[:, None], scale[:, None])
  j = jnp.arange(candidates, dtype=jnp.int32)[None, :]
  if k_eff is None:
    k_eff = jnp.full(top.shape, vocab, jnp.int32)
  in_k = j < k_eff[:, None]
  e = jnp.where(in_k, jnp.exp(zs), jnp.zeros((), dtype))
  k_cuts = k_eff < vocab
  norm_k = jnp.where(k_cuts, jnp.sum(e, axis=-1), norm_all)
  kept = jnp.minimum(k_eff, candidates)
  p_cuts = jnp.zeros(top.shape, bool)
  if top_p is not None:
    clipped = jnp.clip(top_p, jnp.finfo(dtype).tiny, 1)
    mass = e / norm_k[:, None]
    before = jnp.concatenate([jnp.zeros_like(mass[:, :1]), jnp.cumsum(mass, axis=-1)[:, :-1]],
                             axis=-1)
    fits = in_k & ((before < clipped[:, None]) | (clipped[:, None] >= 1))
    p_cuts = clipped < 1
    kept = jnp.where(p_cuts, jnp.sum(fits, axis=-1, dtype=jnp.int32), kept)
  last = jnp.maximum(kept - 1, 0)
  t = jnp.take_along_axis(xs, last[:, None], axis=-1)[:, 0]
  cut = jnp.take_along_axis(ids, last[:, None], axis=-1)[:, 0] + 1
  norm = jnp.sum(jnp.where(j < kept[:, None], e, jnp.zeros((), dtype)), axis=-1)
  keep_all = ~k_cuts & ~p_cuts
  # Settled: the cut's tie group lies inside the candidates, and so does the top-k set
  # whose normaliser top-p reads.
  settled = keep_all | (((candidates >= vocab) | (t > xs[:, -1]))
                        & (~k_cuts | (k_eff <= candidates)))
  t = jnp.where(keep_all, -jnp.inf, t)
  cut = jnp.where(keep_all, vocab, cut)
  norm = jnp.where(keep_all, norm_all, norm)
  return t, cut.astype(jnp.int32), norm, settled


def row_candidates(logits: jax.Array, maxima: jax.Array,
                   axis_name: str | None = None) -> tuple[jax.Array, jax.Array]:
  """``(values, ids)`` ``(R, C)``: the ``C = min(CANDIDATES, V)`` largest logits of each row
  and their global ids (which of several entries tied at the smallest value is unspecified).

  ``maxima``: the rows' block maxima (:func:`~specdec_jax._row_passes.block_maxima`). Sharded
  (``axis_name``), each device selects its own shard's ``C`` largest, the ``n * C`` per row are
  gathered (a few statistics per row, independent of ``V``: no device gathers a row) and the
  ``C`` largest of them kept:
  every entry above the ``C``-th largest of the row is among its shard's ``C`` largest.
  ``-0.0`` may come back as ``+0.0`` (equal values, as everywhere in the kept-set order).
  """
  vocab_local = logits.shape[-1]
  values, ids = top_candidates(logits, maxima, min(CANDIDATES, vocab_local))
  if axis_name is None:
    return values, ids
  values, ids = (_gather(a, axis_name) for a in (values, ids + first_column(vocab_local,
                                                                             axis_name)))
  values, at = lax.top_k(values, min(CANDIDATES, values.shape[-1]))
  return values, jnp.take_along_axis(ids, at, axis=-1)


def _gather(a: jax.Array, axis_name: str) -> jax.Array:
  """``(R, C)`` per device -> ``(R, n * C)``, device ``i``'s at ``[:, i * C:]``, the same on
  every device: a ``psum`` of each device's block in its own slot, zeros elsewhere (exact:
  ``x + 0 = x``), so that the result is typed as replicated, which ``lax.all_gather``'s is not
  and every ``lax.cond`` on it needs."""
  n = lax.axis_size(axis_name)
  mine = jnp.arange(n)[None, :, None] == lax.axis_index(axis_name)
  spread = jnp.where(mine, a[:, None, :], jnp.zeros((), a.dtype))  # (R, n, C)
  return lax.psum(spread, axis_name).reshape(a.shape[0], -1)


def logit_stats(logits: jax.Array, params, axis_name: str | None = None, *,
                candidates: bool = True) -> LogitStats:
  """:class:`LogitStats` of rows ``(R, V)`` with per-row ``params`` (fields ``(R,)``, scalars,
  or None to remove a step at trace time); ``axis_name``: the rows are this device's columns.
  ``candidates=False`` cuts every row by the bisection (the same statistics; for tests and
  benchmarks).

  Out-of-range parameters are clipped as :func:`~specdec_jax._process.process_row` clips them
  (the caller flags ``BAD_PARAMS``).
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
  zeros = jnp.zeros((rows,), dtype)
  # One read: block maxima; the row max, the flags and (from one block) the argmax follow.
  # Sharded, each is combined over the devices by one collective of (R,) values for the batch.
  maxima = block_maxima(logits)
  local_top = jnp.max(maxima, axis=-1)
  raw_top = reduce_if(lax.pmax, local_top, axis_name)
  infinite = ~jnp.isfinite(raw_top)  # +inf somewhere or no finite entry: the max tells
  top = jnp.where(infinite, zeros, raw_top.astype(dtype))
  argmax = first_max(logits, maxima, local_top)
  if axis_name is not None:  # the lowest global id attaining the global max
    argmax = lax.pmin(jnp.where(local_top == raw_top, first_column(vocab_local, axis_name)
                                + argmax, vocab), axis_name)
  greedy = ~(temperature > 0)
  scale = temperature_scale(temperature, greedy)

  # A NaN the max may drop (XLA:CPU's does, see `nan_rows`); a sum propagates it. When some
  # row samples from its whole row, one more read gives the normaliser of every row, NaN
  # exactly where a NaN is (each exp is at most 1: no overflow); otherwise a plain sum tells.
  def full_norm():
    # Plain (x - top) / T: equal to `scaled` on every row that is not broken (-inf stays
    # -inf), and 3x faster on XLA:CPU without the select; broken rows read as NaN anyway.
    norm = reduce_if(lax.psum, exp_sums(x, top, scale), axis_name)
    return norm, jnp.isnan(norm)

  def nan_only():
    return jnp.zeros_like(top), any_if(nan_rows(logits, top), axis_name)

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
  cutting = cutting & sampled

  def bisect(rows_to_cut):
    """The bisection, one row at a time (the row stays in cache), for ``rows_to_cut``."""
    def one(args):
      needed, *row = args
      zero = jnp.zeros_like(row[1])  # typed like the row's statistics (shard_map's axes)
      return lax.cond(needed, lambda: _bisected_row(*row, axis_name=axis_name),
                      lambda: (zero - jnp.inf, zero.astype(jnp.int32) + vocab, zero))
    return row_loop(lambda *args: one(args), (rows_to_cut, x, top, scale, k_eff, top_p))

  if k is None and top_p is None:
    return LogitStats(top, scale, norm_all, *keep_all[:2], argmax, greedy, broken)
  def cut_rows():
    values, ids = row_candidates(logits, maxima, axis_name)
    t, cut, norm, settled = _candidates_settle(values, ids, top, scale, norm_all, k_eff,
                                               top_p, vocab)
    if vocab <= CANDIDATES:  # the candidates are the whole row: every row settles,
      return t, cut, norm    # and no fallback is compiled
    pending = cutting & ~settled
    slow = lax.cond(jnp.any(pending), lambda: bisect(pending), lambda: (t, cut, norm))
    return tuple(jnp.where(pending, s, f) for s, f in zip(slow, (t, cut, norm), strict=True))

  t, cut, norm = lax.cond(jnp.any(cutting), cut_rows if candidates else lambda: bisect(cutting),
                          lambda: keep_all)
  t, cut, norm = (jnp.where(cutting, a, b) for a, b in zip((t, cut, norm), keep_all, strict=True))
  return LogitStats(top, scale, norm, t, cut.astype(jnp.int32), argmax, greedy, broken)


def lazy_rows(logits: jax.Array, params, axis_name: str | None = None) -> LogitRows:
  """:class:`LogitRows` of ``(R, V)`` logits (this device's columns with ``axis_name``)."""
  column = (jnp.int32(0) if axis_name is None
            else lax.axis_index(axis_name).astype(jnp.int32) * logits.shape[-1])
  return LogitRows(logits, logit_stats(logits, params, axis_name), column)


def sequence_params(params, rows: int):
  """One sequence's scalar parameters, broadcast to its ``rows`` rows (None stays None)."""
  return type(params)(*(None if v is None else jnp.broadcast_to(jnp.asarray(v), (rows,))
                        for v in params))


__all__ = ["CANDIDATES", "LogitRows", "LogitStats", "lazy_rows", "logit_stats", "row_probs"]
