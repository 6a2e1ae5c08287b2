"""Logits to probabilities for one row or a batch of rows: the traced body of ``process_logits``.

Temperature (:func:`scaled_logits`), then the sort-free top-k and top-p masks of
:mod:`specdec_jax._logits.threshold`, then a softmax; greedy rows are a point mass on the argmax.
Every function here also runs vocabulary-parallel (``axis_name``, inside ``jax.shard_map``), moving
only a few scalars per row between devices.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._core.checks import compute_dtype
from specdec_jax._logits.adjust import adjusted_row
from specdec_jax._logits.adjust import row_edits
from specdec_jax._logits.params import clipped
from specdec_jax._logits.threshold import any_if
from specdec_jax._logits.threshold import first_column
from specdec_jax._logits.threshold import full_vocab
from specdec_jax._logits.threshold import reduce_if
from specdec_jax._logits.threshold import softmax
from specdec_jax._logits.threshold import top_k_mask
from specdec_jax._logits.threshold import top_p_mask

if TYPE_CHECKING:
  from specdec_jax._logits.params import SamplingParams


def scaled_logits(logits: jax.Array, temperature,
                  axis_name: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(z, greedy, broken)`` for one row: the temperature-scaled logits and two flags.

  ``z = (x - max(x)) / T`` over the finite logits (``-inf`` stays ``-inf``): every entry is
  ``<= 0`` and the largest is 0, so no positive temperature, however small or large, can
  turn a row into NaN (a tiny ``T`` sends the others to ``-inf``, i.e. probability 0; a huge
  or infinite ``T`` is capped, :func:`temperature_scale`, so that a masked ``-inf`` logit stays
  ``-inf`` in every fusion instead of ``-inf / inf = NaN``).
  ``greedy`` is ``~(T > 0)`` (0, negative or NaN). ``broken`` marks a row the model got
  wrong: a NaN or ``+inf`` logit, or no finite logit at all. With ``axis_name`` (the row split
  over that mesh axis), ``logits`` and ``z`` are this device's slice; the max and the flags are
  those of the full row (``pmax``).
  """
  dtype = compute_dtype(logits.dtype)
  x = logits.astype(dtype)
  temperature = jnp.asarray(temperature, dtype)
  greedy = ~(temperature > 0)
  finite = jnp.isfinite(x)
  bad = any_if(jnp.any(jnp.isnan(x) | (x == jnp.inf)), axis_name)
  broken = bad | ~any_if(jnp.any(finite), axis_name)
  top = reduce_if(lax.pmax, jnp.max(jnp.where(finite, x, -jnp.inf)), axis_name)
  scale = temperature_scale(temperature, greedy)
  z = jnp.where(finite, (x - jnp.where(broken, 0, top)) / scale, -jnp.inf)
  return z, greedy, broken


def temperature_scale(temperature: jax.Array, greedy: jax.Array) -> jax.Array:
  """What the logits are divided by: the temperature, 1 for greedy rows, at most ``1 / tiny``.

  ``1 / finfo.tiny`` (``2**126``, about ``8.5e37``, in float32) is the largest divisor whose
  reciprocal is a normal float: XLA may divide by multiplying with the reciprocal, and the
  reciprocal of a larger ``T`` (``1e38``, ``inf``) flushes to 0, making a masked ``-inf`` logit
  ``-inf * 0 = NaN`` (a broken row) in the lazy statistics' unselected passes
  (:func:`~specdec_jax._logits.passes.exp_sums`). Capped, ``(x - max) / T`` still rounds to 0 for
  every logit below ``1e30`` in magnitude, so the law is the uniform one over the kept tokens,
  as ``T = inf`` promises.
  """
  dtype = temperature.dtype
  cap = jnp.asarray(1 / jnp.finfo(dtype).tiny, dtype)
  return jnp.where(greedy, jnp.ones((), dtype), jnp.minimum(temperature, cap))


def kept_set_keys(logits: jax.Array) -> jax.Array:
  """The values the kept set of top-k / top-p is defined on: the raw logits (``-inf`` where not
  finite), in the processing dtype.

  **The one definition of the kept set.** Tokens are ordered by raw logit, descending, ties
  toward the lower id; top-k keeps the first ``k`` of that order, top-p each token whose
  preceding mass (in that order, under the temperature-scaled softmax of what top-k kept) is
  ``< top_p``. It is the raw logits, not the scaled ones, that are compared: dividing by a
  temperature can round two distinct logits to one value (``1.0`` and ``nextafter(1.0, 2)`` at
  ``T = 10``; every logit at ``T = 1e38``), and the lazy statistics, which cut on the raw
  logits, would then keep another set. :func:`process_row`, the lazy statistics
  (:mod:`specdec_jax._logits.lazy`), :func:`~specdec_jax.sample_draft`, the decoding loops and every
  verifier follow it; ``specdec_jax.reference.process_logits`` is its float64 statement.
  """
  x = logits.astype(compute_dtype(logits.dtype))
  return jnp.where(jnp.isfinite(x), x, -jnp.inf)


def _argmax_one_hot(logits: jax.Array, axis_name: str) -> jax.Array:
  """This device's slice of ``one_hot(argmax(row))`` for a row split over ``axis_name``: the
  global max by ``pmax``, then the lowest global id attaining it by ``pmin``."""
  vocab = logits.shape[-1]
  x = logits.astype(compute_dtype(logits.dtype))
  local = jnp.argmax(x).astype(jnp.int32)
  first = first_column(vocab, axis_name)
  attains = x[local] == lax.pmax(jnp.max(x), axis_name)
  winner = lax.pmin(jnp.where(attains, first + local, full_vocab(vocab, axis_name)), axis_name)
  return jnp.arange(vocab, dtype=jnp.int32) + first == winner


def min_p_keeps(z: jax.Array, min_p) -> jax.Array:
  """``min_p``'s mask on scaled logits ``z``: ``p >= min_p * max p``, i.e. ``z >= log(min_p)``
  (``z``'s largest entry is 0); ``min_p <= 0`` keeps everything."""
  min_p = jnp.asarray(min_p, z.dtype)
  return (z >= jnp.log(jnp.maximum(min_p, jnp.finfo(z.dtype).tiny))) | (min_p <= 0)


def process_row(logits: jax.Array, params: SamplingParams, axis_name: str | None = None,
                edits=None, min_p_last: bool = False) -> jax.Array:
  """One row ``(V,)`` of logits to probabilities (float32 at least); with ``axis_name``, this
  device's ``(V_local,)`` slice of the row split over that mesh axis (see :func:`process_rows`).

  ``edits``: the row's :class:`~specdec_jax._logits.adjust.RowEdits` (what a request's penalties,
  bias, masks and bans do before the temperature), applied first; then the temperature,
  ``min_p``, top-k and top-p on the adjusted logits (``min_p_last``, static: sglang-jax's order,
  ``min_p`` after top-k and top-p)."""
  vocab = logits.shape[-1]
  x = adjusted_row(logits.astype(compute_dtype(logits.dtype)), edits,
                   first_column(vocab, axis_name))
  z, greedy, broken = scaled_logits(x, params.temperature, axis_name)
  dtype = z.dtype
  neg_inf = jnp.full_like(z, -jnp.inf)
  key = kept_set_keys(x)  # the kept set is cut on the (adjusted) logits (kept_set_keys)

  min_p = getattr(params, "min_p", None)
  if min_p is not None:
    min_p = jnp.clip(jnp.asarray(min_p, dtype), 0, 1)
  if min_p is not None and not min_p_last:
    keep = min_p_keeps(z, min_p)
    z, key = jnp.where(keep, z, neg_inf), jnp.where(keep, key, neg_inf)
  if params.top_k is not None:
    keep = top_k_mask(key, params.top_k, axis_name)
    z, key = jnp.where(keep, z, neg_inf), jnp.where(keep, key, neg_inf)
  if params.top_p is not None:
    top_p = jnp.clip(jnp.asarray(params.top_p, dtype), jnp.finfo(dtype).tiny, 1)
    keep = top_p_mask(key, softmax(z, axis_name), top_p, axis_name)
    z = jnp.where(keep | (top_p >= 1), z, neg_inf)
  if min_p is not None and min_p_last:
    z = jnp.where(min_p_keeps(z, min_p), z, neg_inf)

  probs = softmax(z, axis_name)
  if axis_name is None:
    one_hot = jax.nn.one_hot(jnp.argmax(x), vocab, dtype=dtype)
  else:
    one_hot = _argmax_one_hot(x, axis_name).astype(dtype)
  # A broken row is NaN at every temperature (greedy too), so whoever reads it flags it.
  return jnp.where(broken, jnp.nan, jnp.where(greedy, one_hot, probs))


def process_unchecked(logits: jax.Array, params: SamplingParams,
                      axis_name: str | None = None, history=None, bitmask=None) -> jax.Array:
  """:func:`process_logits` without its checks, and without NaN rows for out-of-range
  parameters: for callers that flag ``ErrorCode.BAD_PARAMS`` themselves (the verifiers from
  logits, the decoding loops). ``axis_name``: as in :func:`process_rows`. ``history`` (a
  :class:`~specdec_jax.History`) and ``bitmask`` (grammar words ``(W,)``, or ``(rows, W)``)
  feed the parameters that adjust the logits before the temperature."""
  def row(x, mask):
    first = first_column(x.shape[-1], axis_name)
    none = jnp.zeros((0,), jnp.int32)
    edits = row_edits(x.astype(compute_dtype(x.dtype)), clipped(params), history, none, 0,
                      mask, first=first)
    return process_row(x, params, axis_name, edits)
  if logits.ndim == 1:
    return row(logits, bitmask)
  mask_axis = None if bitmask is None or bitmask.ndim == 1 else 0
  return jax.vmap(row, in_axes=(0, mask_axis))(logits, bitmask)


def process_rows(logits: jax.Array, params: SamplingParams,
                 axis_name: str | None = None) -> jax.Array:
  """``(R, V)`` logits to probabilities with per-row parameters (fields ``(R,)`` or None).

  The traced body of :func:`process_logits` for packed rows (no checks: the caller's).

  Vocabulary-parallel: with ``axis_name``, call it inside ``jax.shard_map`` with the columns
  split into contiguous equal blocks over that mesh axis (device ``i`` holds columns
  ``[i * V_local, (i + 1) * V_local)``); it returns this device's slice of the unsharded result:
  the same kept tokens (top-k ties by global id, greedy at the lowest global argmax, NaN rows),
  probabilities equal up to the rounding of the normaliser, and top-p equal except where a
  preceding mass is within rounding of ``top_p`` (see :func:`process_logits`). Only a few
  scalars per row cross devices per pass (:mod:`specdec_jax._logits.threshold`).

  Args:
    logits: ``(R, V)`` logits (``(R, V_local)`` with ``axis_name``).
    params: :class:`SamplingParams` with fields ``(R,)`` or None (replicated when sharded).
    axis_name: optional mesh axis the vocabulary is split over.

  Returns:
    ``(R, V)`` probabilities (``(R, V_local)``), float32 (float64 for float64 input).

  Example:
    >>> from jax.sharding import PartitionSpec as P
    >>> from specdec_jax import SamplingParams
    >>> mesh = jax.make_mesh((2,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> fn = jax.jit(jax.shard_map(lambda x, p: process_rows(x, p, axis_name="model"),
    ...                            mesh=mesh, in_specs=(P(None, "model"), P()),
    ...                            out_specs=P(None, "model")))
    >>> params = SamplingParams(jnp.ones(1), jnp.array([2], jnp.int32))
    >>> fn(jnp.array([[0.0, 1.0, 1.0, 0.5]]), params).round(3).tolist()
    [[0.0, 0.5, 0.5, 0.0]]
  """
  return jax.vmap(functools.partial(process_row, axis_name=axis_name))(logits, params)
