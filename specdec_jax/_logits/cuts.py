"""Where a processed row's kept set ends: settled from its largest logits, or by bisection.

The kept set of a row under ``min_p``, top-k and top-p is a prefix of the order "adjusted logit
descending, ties toward the lower id" (:func:`~specdec_jax._logits.transform.kept_set_keys`), so it
is ``{x > t} | {x == t and id < cut}`` with its normaliser ``S``. :func:`settle` finds ``(t, cut,
S)`` from a list of candidates that holds every entry above a ``floor`` value (the row's
largest logits, and the listed entries of :class:`~specdec_jax._logits.adjust.RowEdits`), when the
cut falls among them; :func:`bisected_row` finds it on a whole row by the sort-free searches
of :mod:`specdec_jax._logits.threshold` (the fallback). Both implement the same definition
(:func:`~specdec_jax._logits.transform.process_row` is its eager form).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._logits.passes import top_candidates
from specdec_jax._logits.threshold import first_column
from specdec_jax._logits.threshold import full_vocab
from specdec_jax._logits.threshold import reduce_if
from specdec_jax._logits.threshold import softmax
from specdec_jax._logits.threshold import top_k_mask
from specdec_jax._logits.threshold import top_p_mask
from specdec_jax._logits.transform import kept_set_keys
from specdec_jax._logits.transform import min_p_keeps

#: Candidates per row for the partial selection: a kept set that ends inside them is settled
#: without another pass over the row; others fall back to the bisection. XLA:CPU's ``TopK``
#: costs about linearly in ``k``: 32 keeps the selection at two floors of V = 32,000.
CANDIDATES = 64


def scaled(x: jax.Array, top, scale) -> jax.Array:
  """``z = (x - top) / scale`` over the finite logits, ``-inf`` elsewhere (as
  :func:`~specdec_jax._logits.transform.scaled_logits`, bit for bit)."""
  return jnp.where(jnp.isfinite(x), (x - top) / scale, -jnp.inf)


def bisected_row(x, top, scale, k_eff, top_p, min_p, *, axis_name, min_p_last: bool = False):
  """``(t, cut, S)`` of one (adjusted) row by the sort-free masks of
  :mod:`specdec_jax._logits.threshold`: exactly :func:`~specdec_jax._logits.transform.process_row`'s
  kept set and normaliser. A step that does not cut this row is skipped (``lax.cond``)."""
  dtype = x.dtype
  vocab = full_vocab(x.shape[-1], axis_name)
  z = scaled(x, top, scale)
  key = kept_set_keys(x)  # cut on the (adjusted) logits, as process_row
  every = (z == z) | True  # typed like the row (inside shard_map: varying over its axis)
  keep = every
  if min_p is not None and not min_p_last:
    keep = min_p_keeps(z, min_p)
    key = jnp.where(keep, key, -jnp.inf)
  if k_eff is not None:
    keep = keep & lax.cond(k_eff < vocab, lambda: top_k_mask(key, k_eff, axis_name),
                           lambda: every)
  if top_p is not None:
    clipped = jnp.clip(top_p, jnp.finfo(dtype).tiny, 1)
    masked = jnp.where(keep, z, -jnp.inf)
    masked_key = jnp.where(keep, key, -jnp.inf)
    keep = keep & lax.cond(
      clipped < 1,
      lambda: top_p_mask(masked_key, softmax(masked, axis_name), clipped, axis_name),
      lambda: every)
  if min_p is not None and min_p_last:  # sglang-jax's order: min_p after top-k and top-p
    keep = keep & min_p_keeps(z, min_p)
  first = 0 if axis_name is None else lax.axis_index(axis_name).astype(jnp.int32) * x.shape[-1]
  ids = first + jnp.arange(x.shape[-1], dtype=jnp.int32)
  t = reduce_if(lax.pmin, jnp.min(jnp.where(keep, x, jnp.inf)), axis_name)
  cut = reduce_if(lax.pmax, jnp.max(jnp.where(keep & (x == t), ids, -1)), axis_name) + 1
  norm = reduce_if(lax.psum, jnp.sum(jnp.where(keep, jnp.exp(z), jnp.zeros((), dtype))),
                   axis_name)
  return t, cut.astype(jnp.int32), norm


def sort_candidates(vals: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Candidates ``(R, n)`` in the kept-set order: value descending, ties toward the lower id."""
  neg, ids = lax.sort((-vals, idx.astype(jnp.int32)), dimension=-1, num_keys=2)
  return -neg, ids


def settle(xs, ids, floor, top, scale, norm_all, k_eff, top_p, min_p, vocab,
           min_p_last: bool = False):
  """``(t, cut, S, settled)`` per row from candidates ``xs`` / ``ids`` ``(R, n)`` in the kept-set
  order (:func:`sort_candidates`) that hold every entry of the row above ``floor`` ``(R,)``
  (``-inf``: every finite entry).

  The kept prefix is cut after ``min_p`` and top-k, then after the first candidate whose
  preceding top-p mass (over what those kept) is ``>= top_p``. A row is settled when its cut
  and its normaliser are known from the candidates: the cut falls on a candidate above
  ``floor`` (so its ties are all candidates), and the set top-p renormalises over either is
  the whole row (``norm_all``) or ends among those candidates too. ``min_p_last`` (static,
  sglang-jax's order): ``min_p`` cuts after top-k and top-p instead of before them.
  """
  dtype = top.dtype
  n = xs.shape[-1]
  zs = scaled(xs, top[:, None], scale[:, None])
  j = jnp.arange(n, dtype=jnp.int32)[None, :]
  complete = floor == -jnp.inf  # every finite entry is a candidate
  known = (xs > floor[:, None]) | complete[:, None]
  n_known = jnp.sum(known, axis=-1, dtype=jnp.int32)
  if k_eff is None:
    k_eff = jnp.full(top.shape, vocab, jnp.int32)
  survive = j < k_eff[:, None]
  minp_cuts = jnp.zeros(top.shape, bool)
  if min_p is not None:
    minp_keep = min_p_keeps(zs, min_p[:, None])
    minp_cuts = min_p > 0
    if not min_p_last:
      survive = survive & minp_keep
  n_survive = jnp.sum(survive, axis=-1, dtype=jnp.int32)
  # nothing before top-p cuts: S over the whole row
  whole = (k_eff >= vocab) & (True if min_p_last else ~minp_cuts)
  ends_known = (n_survive < n_known) | complete  # the survivors end on a known candidate
  e = jnp.where(survive, jnp.exp(zs), jnp.zeros((), dtype))
  norm_s = jnp.where(whole, norm_all, jnp.sum(e, axis=-1))
  kept = n_survive
  p_cuts = jnp.zeros(top.shape, bool)
  if top_p is not None:
    clipped = jnp.clip(top_p, jnp.finfo(dtype).tiny, 1)
    mass = e / norm_s[:, None]
    before = jnp.concatenate([jnp.zeros_like(mass[:, :1]), jnp.cumsum(mass, axis=-1)[:, :-1]],
                             axis=-1)
    fits = survive & ((before < clipped[:, None]) | (clipped[:, None] >= 1))
    p_cuts = clipped < 1
    n_fit = jnp.sum(fits, axis=-1, dtype=jnp.int32)
    kept = jnp.where(p_cuts, n_fit, kept)
    # top-p ends on a known candidate (one that does not fit), or where the survivors end
    p_known = (n_fit < jnp.minimum(n_survive, n_known)) | ((n_fit == n_survive) & ends_known)
    settled = (whole | ends_known) & jnp.where(p_cuts, p_known, ends_known)
  else:
    settled = ends_known
  keep_all = whole & ~p_cuts
  if min_p_last and min_p is not None:  # min_p cuts what top-k and top-p kept
    n_minp = jnp.sum(minp_keep, axis=-1, dtype=jnp.int32)  # a prefix of the candidates
    minp_known = (n_minp < n_known) | complete
    kept = jnp.where(keep_all, n_minp, jnp.minimum(kept, n_minp))
    settled = jnp.where(keep_all, minp_known, settled)
    keep_all = keep_all & ~minp_cuts
  last = jnp.maximum(kept - 1, 0)
  t = jnp.take_along_axis(xs, last[:, None], axis=-1)[:, 0]
  cut = jnp.take_along_axis(ids, last[:, None], axis=-1)[:, 0] + 1
  if min_p_last:  # the kept prefix may end past the survivors' exponentials (min_p alone)
    e = jnp.exp(zs)
  norm = jnp.sum(jnp.where(j < kept[:, None], e, jnp.zeros((), dtype)), axis=-1)
  t = jnp.where(keep_all, -jnp.inf, t)
  cut = jnp.where(keep_all, vocab, cut)
  norm = jnp.where(keep_all, norm_all, norm)
  return t, cut.astype(jnp.int32), norm, keep_all | settled


def row_candidates(logits: jax.Array, maxima: jax.Array, axis_name: str | None = None,
                   words=None) -> tuple[jax.Array, jax.Array]:
  """``(values, ids)`` ``(R, C)``: the ``C = min(CANDIDATES, V)`` largest logits of each row
  and their global ids (which of several entries tied at the smallest value is unspecified).

  ``maxima``: the rows' block maxima (:func:`~specdec_jax._logits.passes.block_maxima`). Sharded
  (``axis_name``), each device selects its own shard's ``C`` largest, the ``n * C`` per row are
  gathered (a few statistics per row, independent of ``V``: no device gathers a row) and the
  ``C`` largest of them kept:
  every entry above the ``C``-th largest of the row is among its shard's ``C`` largest.
  ``-0.0`` may come back as ``+0.0`` (equal values, as everywhere in the kept-set order).
  ``words``: the rows' mask (bitmask words), applied to the gathered entries.
  """
  vocab_local = logits.shape[-1]
  values, ids = top_candidates(logits, maxima, min(CANDIDATES, vocab_local), words=words)
  if axis_name is None:
    return values, ids
  values, ids = (gather(a, axis_name) for a in (values, ids + first_column(vocab_local,
                                                                            axis_name)))
  values, at = lax.top_k(values, min(CANDIDATES, values.shape[-1]))
  return values, jnp.take_along_axis(ids, at, axis=-1)


def gather(a: jax.Array, axis_name: str) -> jax.Array:
  """``(R, C)`` per device -> ``(R, n * C)``, device ``i``'s at ``[:, i * C:]``, the same on
  every device: a ``psum`` of each device's block in its own slot, zeros elsewhere (exact:
  ``x + 0 = x``), so that the result is typed as replicated, which ``lax.all_gather``'s is not
  and every ``lax.cond`` on it needs."""
  n = lax.axis_size(axis_name)
  mine = jnp.arange(n)[None, :, None] == lax.axis_index(axis_name)
  spread = jnp.where(mine, a[:, None, :], jnp.zeros((), a.dtype))  # (R, n, C)
  return lax.psum(spread, axis_name).reshape(a.shape[0], -1)


__all__ = ["CANDIDATES", "bisected_row", "row_candidates", "scaled", "settle", "sort_candidates"]
