"""Sort-free top-k and top-p masks: threshold searches by bisection instead of a sort over ``V``.

Serving engines select the top-k / top-p survivors without sorting the vocabulary: they
search for the threshold value by bisection, each step one counting (or mass) pass over the
row (tpu-inference ``layers/common/binary_search.py``; FlashInfer's top-k / top-p renorm
kernels). This module does the same on one row ``(V,)``, with a fixed trip count so that every
parameter may be traced (per-row values under ``jax.vmap``), and reproduces exactly the
semantics of a stable sort by value, descending, ties toward the lower token id.

The search runs over an order-preserving integer key of the float value (:func:`order_key`),
so it ends on an actual value of the row after ``nbits`` steps (32 for float32) whatever the
spread of the values; ties at the threshold are then split by token id (:func:`first_true`).

Vocabulary-parallel: every function takes an optional ``axis_name``. Inside ``jax.shard_map``
with the row split into contiguous equal blocks over that mesh axis (device ``i`` holds columns
``[i * V_local, (i + 1) * V_local)``), it returns this device's slice of the unsharded result.
Only scalars per row cross devices: the key range (``pmin`` / ``pmax``), each pass's ``(ways -
1,)`` pivot counts or masses (``psum``), and the ``n`` per-device tie counts (``all_gather``) that
:func:`first_true` needs to split ties by global id.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_UNSIGNED = {4: jnp.uint32, 8: jnp.uint64}

#: Entries per block in :func:`first_true`.
BLOCK = 256

#: Pivots per pass plus one, a power of two: ``WAYS = 16`` tests 15 pivots per pass and needs 8
#: passes for float32 instead of 32. Plain bisection (2) is the fastest on CPU, where a pass is
#: bound by compute, not by memory.
WAYS = 2


def reduce_if(op, x: jax.Array, axis_name: str | None) -> jax.Array:
  """``op(x, axis_name)`` for a ``lax`` collective ``op`` (``lax.psum``...), or ``x`` itself."""
  return x if axis_name is None else op(x, axis_name)


def any_if(flag: jax.Array, axis_name: str | None) -> jax.Array:
  """A bool flag or'ed over ``axis_name`` (``lax.pmax`` of int32), or ``flag`` itself."""
  if axis_name is None:
    return flag
  return lax.pmax(flag.astype(jnp.int32), axis_name) > 0


def first_column(vocab_local: int, axis_name: str | None) -> jax.Array | int:
  """The global id of this device's first column: ``axis_index * V_local`` (0 unsharded)."""
  return 0 if axis_name is None else lax.axis_index(axis_name) * vocab_local


def full_vocab(vocab_local: int, axis_name: str | None) -> int:
  """The row length ``V`` over all devices of ``axis_name`` (static)."""
  return vocab_local if axis_name is None else vocab_local * lax.axis_size(axis_name)


def softmax(z: jax.Array, axis_name: str | None = None) -> jax.Array:
  """``jax.nn.softmax`` of one row ``(V_local,)``; sharded: ``pmax`` of the max, ``psum`` of the
  local sum of ``exp`` (the normaliser is summed in another order than unsharded)."""
  if axis_name is None:
    return jax.nn.softmax(z)
  e = jnp.exp(z - lax.stop_gradient(lax.pmax(jnp.max(z), axis_name)))
  return e / lax.psum(jnp.sum(e), axis_name)


def order_key(z: jax.Array) -> jax.Array:
  """An unsigned integer key with the order of the float values ``z``.

  The sign-magnitude bit trick: a non-negative float gets its bits with the sign bit set, a
  negative one its bits inverted, so ``z_i < z_j`` iff ``key_i < key_j``. ``-inf`` has the
  smallest key of any non-NaN value and ``-0.0`` gets the key of ``+0.0`` (they compare equal,
  as in ``jnp.sort``; so do subnormals where the backend flushes them to zero). NaN gets some
  key (above ``+inf`` or below ``-inf``); callers overwrite such rows.

  Args:
    z: float32 or float64 array.

  Returns:
    ``uint32`` (``uint64`` for float64) array of the shape of ``z``.
  """
  unsigned = _UNSIGNED[jnp.dtype(z.dtype).itemsize]
  nbits = 8 * jnp.dtype(z.dtype).itemsize
  bits = lax.bitcast_convert_type(z, unsigned)
  bits = jnp.where(z == 0, jnp.zeros_like(bits), bits)  # on the bits: XLA may elide it on floats
  sign = jnp.asarray(1, unsigned) << (nbits - 1)
  return jnp.where((bits & sign) != 0, ~bits, bits | sign)


def key_value(key: jax.Array, dtype) -> jax.Array:
  """The float value of :func:`order_key`'s ``key`` (its inverse; ``-0.0`` comes back as
  ``0.0``, which compares equal to it)."""
  unsigned = _UNSIGNED[jnp.dtype(dtype).itemsize]
  sign = jnp.asarray(1, unsigned) << (8 * jnp.dtype(dtype).itemsize - 1)
  bits = jnp.where((key & sign) != 0, key ^ sign, ~key)
  return lax.bitcast_convert_type(bits, dtype)


def _search(key: jax.Array, pred, aux0, axis_name: str | None = None):
  """The smallest ``t`` in ``[min(key), max(key)]`` with ``pred(t)`` true (``pred`` monotone).

  ``pred(ts)`` takes a ``(ways - 1,)`` vector of pivots and returns ``(ok, aux)`` per pivot;
  ``pred(max(key))`` must hold, and ``aux0`` is its ``aux``. Each pass tests ``ways - 1``
  pivots at once and keeps the one segment where ``ok`` turns true, so the interval shrinks
  ``ways``-fold per pass: a fixed ``ceil(nbits / log2(ways))`` passes reach a single key.
  Returns ``(t, aux of t)``. With ``axis_name``, ``key`` is this device's slice, the range is
  ``pmin`` / ``pmax``'ed and ``pred`` must return the same (all-reduced) values on every device.
  """
  ways = WAYS
  nbits = 8 * jnp.dtype(key.dtype).itemsize
  passes = -(-nbits // (ways.bit_length() - 1))
  j = jnp.arange(1, ways, dtype=key.dtype)

  def step(_, carry):
    lo, hi, aux = carry
    size = (hi - lo) // ways + 1
    ends = jnp.minimum(lo + j * size - 1, hi)  # segment ends, non-decreasing
    ok, end_aux = pred(ends)
    fails = jnp.sum(~ok, dtype=jnp.int32)  # ok is false...false true...true
    last_fail = jnp.maximum(fails - 1, 0)
    first_ok = jnp.minimum(fails, ways - 2)
    new_lo = jnp.where(fails == 0, lo, ends[last_fail] + 1)
    new_hi = jnp.where(fails == ways - 1, hi, ends[first_ok])
    new_aux = jnp.where(fails == ways - 1, aux, end_aux[first_ok])
    return new_lo, new_hi, new_aux

  lo = reduce_if(lax.pmin, jnp.min(key), axis_name)
  hi = reduce_if(lax.pmax, jnp.max(key), axis_name)
  # The state starts typed like the row (inside shard_map: the same varying mesh axes).
  aux0 = jnp.asarray(aux0) + jnp.zeros_like(lo).astype(jnp.asarray(aux0).dtype)
  _, t, aux = lax.fori_loop(0, passes, step, (lo, hi, aux0))
  return t, aux


def first_true(mask: jax.Array, n, axis_name: str | None = None) -> jax.Array:
  """The first ``n`` true entries of ``mask`` by index, without a prefix sum over ``V``.

  Counts per block of ``BLOCK`` entries, a prefix sum over the blocks, and one over the block
  that holds the ``n``-th true entry; the mask is then cut at that entry's index. Sharded, the
  ``n`` per-device counts are gathered and those of lower-id devices subtracted from ``n``.

  Args:
    mask: ``(V,)`` bool (this device's ``(V_local,)`` slice with ``axis_name``).
    n: int scalar, may be traced; ``n <= 0`` keeps none, ``n >= sum(mask)`` all.
    axis_name: optional mesh axis the row is split over (contiguous equal blocks).

  Returns:
    ``(V,)`` bool (``(V_local,)``): ``mask`` and fewer than ``n`` true entries before, by
    global id.

  Example:
    >>> first_true(jnp.array([False, True, True, True]), 2).tolist()
    [False, True, True, False]
  """
  if axis_name is not None:
    counts = lax.all_gather(jnp.sum(mask, dtype=jnp.int32), axis_name)  # (n_devices,)
    lower = jnp.arange(counts.shape[0]) < lax.axis_index(axis_name)
    n = n - jnp.sum(jnp.where(lower, counts, 0), dtype=jnp.int32)
  vocab = mask.shape[-1]
  blocks = -(-vocab // BLOCK)
  flags = jnp.pad(mask.astype(jnp.int32), (0, blocks * BLOCK - vocab)).reshape(blocks, BLOCK)
  upto = jnp.cumsum(jnp.sum(flags, axis=1, dtype=jnp.int32), dtype=jnp.int32)  # to block ends
  block = jnp.sum(upto < n, dtype=jnp.int32)  # the block of the n-th true entry
  before = jnp.where(block > 0, upto[jnp.maximum(block - 1, 0)], 0)
  inner = jnp.cumsum(lax.dynamic_index_in_dim(flags, jnp.minimum(block, blocks - 1), 0, False),
                     dtype=jnp.int32)
  cut = block * BLOCK + jnp.sum(inner < n - before, dtype=jnp.int32) + 1
  cut = jnp.where(n <= 0, 0, jnp.where(block >= blocks, vocab, cut))
  return mask & (jnp.arange(vocab, dtype=jnp.int32) < cut)


def top_k_mask(z: jax.Array, k, axis_name: str | None = None) -> jax.Array:
  """The ``k`` largest entries of one row, ties at the boundary toward the lower index.

  Exactly the first ``k`` positions of ``jnp.argsort(-z, stable=True)``, found by bisection
  for the ``k``-th largest value ``t`` (about ``nbits`` counting passes, no sort): keep
  ``z > t`` and, among ``z == t``, the first ``k - count(z > t)`` by index.

  Args:
    z: ``(V,)`` float32 or float64 values without NaN (``-inf`` allowed; a row with NaN gives
      some mask, without error).
    k: int scalar, may be traced. ``k <= 0`` or ``k >= V`` keeps every entry.
    axis_name: optional mesh axis the row is split over: ``z`` is then this device's
      ``(V_local,)`` slice and the result its slice of the full row's mask (ties by global id).

  Returns:
    ``(V,)`` bool mask with exactly ``min(k, V)`` (``V`` for ``k <= 0``) true entries.

  Example:
    >>> top_k_mask(jnp.array([1.0, 3.0, 3.0, 2.0]), 2).tolist()
    [False, True, True, False]

  Reference:
    tpu-inference ``layers/common/binary_search.py`` (top-k by threshold bisection);
    FlashInfer ``top_k_renorm_probs``.
  """
  vocab = full_vocab(z.shape[-1], axis_name)
  k = jnp.asarray(k)
  k = jnp.where(k > 0, jnp.minimum(k, vocab), vocab).astype(jnp.int32)
  key = order_key(z)

  def few_above(ts):  # the k-th largest key is the smallest t with count(key > t) < k
    count = jnp.sum(key[None, :] > ts[:, None], axis=-1, dtype=jnp.int32)
    count = reduce_if(lax.psum, count, axis_name)
    return count < k, count

  t, count = _search(key, few_above, jnp.int32(0), axis_name)
  # The mask compares the values themselves with the threshold's value (equal to comparing
  # keys): a comparison of integer keys against a per-row threshold miscompiled (an LLVM
  # instruction-selection failure at -O1, `--xla_backend_optimization_level=1`) where the keys
  # were those of raw logits shared by a vmapped batch.
  t_value = key_value(t, z.dtype)
  return (z > t_value) | first_true(z == t_value, k - count, axis_name)


def top_p_mask(z: jax.Array, probs: jax.Array, top_p, axis_name: str | None = None) -> jax.Array:
  """Nucleus mask of one row: keep each entry whose preceding mass is ``< top_p``.

  "Preceding" is in the order of ``jnp.argsort(-z, stable=True)`` (value descending, ties
  toward the lower index) and the mass is that of ``probs``, which must be non-increasing in
  ``z`` with equal values for equal ``z`` (e.g. ``softmax(z)``, or the softmax of a
  temperature-scaled ``z``: the kept set of :func:`~specdec_jax.process_logits` is cut on the raw
  logits, :func:`~specdec_jax._logits.transform.kept_set_keys`). Found without a sort: a
  bisection for the smallest value ``t`` with ``mass(z > t) < top_p``; then ``z > t`` is
  kept, ``z < t`` dropped, and the ``r``-th tie at ``t`` (by index) kept iff
  ``mass(z > t) + r * p_t < top_p``. The first entry in that order is always kept (for
  ``top_p > 0``).

  Masses are summed in a different order than a sorted cumulative sum, so where a preceding
  mass is within rounding of ``top_p`` the two may disagree on that one entry; elsewhere they
  are equal.

  Args:
    z: ``(V,)`` float32 or float64 values without NaN (``-inf`` allowed).
    probs: ``(V,)`` probabilities of ``z``, same dtype.
    top_p: float scalar in ``(0, 1]``, may be traced (``>= 1`` is the caller's to treat as
      "keep all": here it drops only entries after a mass of 1 is reached).
    axis_name: optional mesh axis the row is split over: ``z`` and ``probs`` (the full row's
      probabilities) are this device's ``(V_local,)`` slices, the result is its slice of the mask.

  Returns:
    ``(V,)`` bool mask.

  Reference:
    tpu-inference ``layers/common/binary_search.py`` (top-p by threshold bisection);
    FlashInfer ``top_p_renorm_probs``.
  """
  vocab = full_vocab(z.shape[-1], axis_name)
  key = order_key(z)
  zero = jnp.zeros((), probs.dtype)

  def mass_above(ts):
    mass = jnp.sum(jnp.where(key[None, :] > ts[:, None], probs[None, :], zero), axis=-1)
    mass = reduce_if(lax.psum, mass, axis_name)
    return mass < top_p, mass

  t, mass = _search(key, mass_above, zero, axis_name)
  tied = key == t
  p_t = jnp.max(jnp.where(tied, probs, zero))  # the one probability of the ties
  p_t = reduce_if(lax.pmax, p_t, axis_name)

  def fits(r):  # the r-th tie (from 0) starts below top_p; false from some r on
    return (mass + r.astype(probs.dtype) * p_t < top_p) & (r < vocab)

  def halve(_, bounds):  # the first r in [0, vocab] that does not fit: a scalar bisection
    lo, hi = bounds
    mid = (lo + hi) // 2
    out = ~fits(mid)
    return jnp.where(out, lo, mid + 1), jnp.where(out, mid, hi)

  start = jnp.zeros_like(mass, jnp.int32)  # typed like the row (shard_map's varying axes)
  _, count = lax.fori_loop(0, vocab.bit_length(), halve, (start, start + vocab))
  t_value = key_value(t, z.dtype)  # values, not keys: see top_k_mask
  return (z > t_value) | first_true(tied, count, axis_name)
