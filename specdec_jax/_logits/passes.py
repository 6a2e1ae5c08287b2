"""Streamed passes over logit rows for the lazy statistics (:mod:`specdec_jax._logits.lazy`).

Each reads rows ``(R, V)`` once, in a shape XLA:CPU reduces fast: the maxima of blocks of
:data:`BLOCK` entries (from which the row max, the argmax and the candidates follow), the
normaliser ``sum(exp((x - top) / T))`` summed in pieces of at most :data:`PIECE` entries, and the
``count`` largest entries of each row from the blocks with the largest maxima.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

#: Entries per block of the block maxima (the first pass): the candidates are the largest
#: entries of the ``CANDIDATES`` blocks with the largest maxima.
BLOCK = 32


#: Longest stretch of a row that one summation reads (see :func:`exp_sums`).
PIECE = 32768


def _pieces(vocab: int) -> int:
  """The fewest equal pieces, each at most :data:`PIECE` long, that a row of ``vocab`` splits
  into (1 when ``vocab`` has no such divisor below 64: the row is summed whole)."""
  for count in range(1, 65):
    if vocab % count == 0 and vocab // count <= PIECE:
      return count
  return 1


def _shifts(ndim: int) -> jax.Array:
  """The 32 bit positions, shaped to broadcast against ``(..., words, 1)``."""
  return jnp.arange(32, dtype=jnp.uint32).reshape((1,) * (ndim - 1) + (32,))


def row_loop(fn, xs):
  """``fn`` over the leading axis of ``xs``: a loop on XLA:CPU (each row read once while it is
  in cache, and ``lax.cond`` inside ``fn`` skips work per row), ``jax.vmap`` elsewhere."""
  def looped(*xs):
    return lax.map(lambda row: fn(*row), xs)

  def vectorised(*xs):
    return jax.vmap(fn)(*xs)

  return lax.platform_dependent(*xs, cpu=looped, default=vectorised)


def _per_row_masked(fn, x: jax.Array, words: jax.Array, *rest):
  """``fn(masked row (1, V), *row's rest)`` for each row of ``x`` under its ``words``, one row
  at a time: XLA:CPU does not fuse the mask's unpacking into a reduction, so a batched select
  would write a masked copy of all the rows; a row at a time it is one ``(V,)`` buffer."""
  def one(row, row_words, *row_rest):
    return fn(masked_copy(row[None], row_words[None]), *(r[None] for r in row_rest))[0]
  return row_loop(one, (x, words, *rest))


def masked_copy(x: jax.Array, words: jax.Array | None) -> jax.Array:
  """Rows ``x`` with ``-inf`` where ``words`` clears a bit (bitmask words ``(..., ceil(V /
  32))``; a copy: the passes make it one row at a time)."""
  if words is None:
    return x
  unpacked = (words.astype(jnp.uint32)[..., None] >> _shifts(words.ndim + 1)) & 1
  bits = unpacked.reshape(*words.shape[:-1], -1)[..., :x.shape[-1]] != 0
  return jnp.where(bits, x, jnp.asarray(-jnp.inf, x.dtype))


def _gathered_bits(words: jax.Array, columns: jax.Array) -> jax.Array:
  """Whether entries ``columns`` ``(R, n)`` of rows with mask ``words`` ``(R, W)`` are allowed."""
  word = jnp.take_along_axis(words.astype(jnp.uint32), columns // 32, axis=-1)
  return ((word >> (columns % 32).astype(jnp.uint32)) & 1) != 0


def exp_sums(x: jax.Array, top: jax.Array, scale: jax.Array, words=None) -> jax.Array:
  """``sum(exp((x - top) / scale))`` per row of ``x`` ``(R, V)`` (``top``, ``scale`` ``(R,)``).

  A long row is summed as equal pieces of at most :data:`PIECE` entries, laid out as rows of
  their own, then the pieces added: XLA:CPU's reduction of rows of V = 128,256 costs 7x more
  per entry, over a batch of 800 rows, than the same entries as rows of 32,064 (measured:
  238 ms -> 35 ms). The reshape is free (the pieces are contiguous).
  """
  rows, vocab = x.shape
  count = _pieces(vocab)
  if words is not None:  # masked (bitmask words ``(R, ceil(V / 32))``): a row at a time
    return _per_row_masked(exp_sums, x, words, top, scale)
  if count == 1:
    return jnp.sum(jnp.exp((x - top[:, None]) / scale[:, None]), axis=-1)
  pieces = x.reshape(rows * count, vocab // count)
  sums = jnp.sum(jnp.exp((pieces - jnp.repeat(top, count)[:, None])
                         / jnp.repeat(scale, count)[:, None]), axis=-1)
  return jnp.sum(sums.reshape(rows, count), axis=-1)


def nan_rows(x: jax.Array, top: jax.Array, words=None) -> jax.Array:
  """``(R,)`` bool: which rows of ``x`` ``(R, V)`` hold a NaN (or ``+inf``), given each row's
  largest finite entry ``top`` ``(R,)`` (any finite value for a row without one).

  The block maxima cannot tell: XLA:CPU's vectorised max reductions drop NaN (measured, jax
  0.10.2: ``jnp.max`` over rows of 2,400 entries or more with a NaN returns the largest of the
  others), while a sum propagates it. The sum is of ``x - top``: every finite term is ``<= 0``
  and ``-inf`` stays ``-inf``, so it never meets ``+inf`` and is NaN only for a NaN (or an
  ``+inf`` entry). One streamed read, long rows in pieces as in :func:`exp_sums` (a multiply
  in place of the subtraction made XLA:CPU's reduction 10x slower).
  """
  rows, vocab = x.shape
  count = _pieces(vocab)
  if words is not None:
    return _per_row_masked(nan_rows, x, words, top)
  pieces = x.reshape(rows * count, vocab // count)
  sums = jnp.sum(pieces - jnp.repeat(top.astype(x.dtype), count)[:, None], axis=-1)
  return jnp.isnan(jnp.sum(sums.reshape(rows, count), axis=-1))


def block_maxima(x: jax.Array, block: int = BLOCK, words=None) -> jax.Array:
  """``(R, ceil(V / block))`` maxima of consecutive blocks of rows ``x`` ``(R, V)``: one
  streamed read. NaN may or may not propagate (see :func:`nan_rows`). ``words``: the rows'
  mask (bitmask words, ``V`` a multiple of 32 = :data:`BLOCK`), applied block by block."""
  rows, vocab = x.shape
  if words is not None:
    return _per_row_masked(lambda r: block_maxima(r, block), x, words)
  full = vocab // block * block
  parts = []
  if full:
    parts.append(jnp.max(x[:, :full].reshape(rows, full // block, block), axis=-1))
  if vocab > full:
    parts.append(jnp.max(x[:, full:], axis=-1, keepdims=True))
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def _block_columns(blocks: jax.Array, vocab: int, block: int) -> tuple[jax.Array, jax.Array]:
  """``(columns (R, n * block), inside)``: the ids of the entries of ``blocks`` ``(R, n)``."""
  columns = (blocks[..., None] * block + jnp.arange(block, dtype=jnp.int32)[None, None, :]
             ).reshape(blocks.shape[0], -1)
  return jnp.minimum(columns, vocab - 1), columns < vocab


def top_candidates(x: jax.Array, maxima: jax.Array, count: int,
                   block: int = BLOCK, words=None) -> tuple[jax.Array, jax.Array]:
  """``(values, ids)`` ``(R, count)``: the ``count`` largest entries of each row, descending.

  Two small selections instead of one over ``V``: the ``count`` blocks with the largest maxima
  hold every entry above the ``count``-th largest (each other block's maximum is below
  ``count`` entries of those blocks), so the largest ``count`` of their entries are the row's.
  Which of several entries tied at the smallest value is returned is unspecified (callers
  check that their cut lies above it).
  """
  vocab = x.shape[-1]
  nblocks = maxima.shape[-1]
  _, blocks = lax.top_k(maxima, min(count, nblocks))
  columns, inside = _block_columns(blocks.astype(jnp.int32), vocab, block)
  if words is not None:  # the gathered entries under the mask
    inside = inside & _gathered_bits(words, columns)
  values = jnp.where(inside, jnp.take_along_axis(x, columns, axis=-1),
                     jnp.asarray(-jnp.inf, x.dtype))
  values, at = lax.top_k(values, min(count, values.shape[-1]))
  return values, jnp.take_along_axis(columns, at, axis=-1)


def first_max(x: jax.Array, maxima: jax.Array, top: jax.Array, block: int = BLOCK,
              words=None):
  """The lowest id of each row's maximum ``top`` (``jnp.argmax`` for rows without NaN/+inf),
  from the block maxima: the first block that attains it, then the first entry in it."""
  nblocks = maxima.shape[-1]
  index = jnp.arange(nblocks, dtype=jnp.int32)
  first_block = jnp.min(jnp.where(maxima == top[:, None], index, nblocks - 1), axis=-1)
  columns, inside = _block_columns(first_block[:, None], x.shape[-1], block)
  if words is not None:
    inside = inside & _gathered_bits(words, columns)
  hits = inside & (jnp.take_along_axis(x, columns, axis=-1) == top[:, None])
  return jnp.min(jnp.where(hits, columns, x.shape[-1] - 1), axis=-1).astype(jnp.int32)


__all__ = ["BLOCK", "PIECE", "block_maxima", "exp_sums", "first_max", "masked_copy",
           "nan_rows", "row_loop", "top_candidates"]
