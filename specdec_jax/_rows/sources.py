"""Row sources: how every rule reads the rows of one sequence, wherever and however they are held.

A rule (token-wise, block, tree) never indexes an array itself. It asks a *row source* for a
slice of one row (``rows.slice(row, start, size)``, for the streamed passes and the final
sample) or for single entries (``rows.entry(row, token)``, the gathered ``p(x)``, ``q(x)``).
The source hides the layout:

* padded rows of one sequence, or one sequence's rows inside a packed batch array (an
  offset, :func:`shifted`), read in place;
* point-mass drafts (``q[i] = e_{draft[i]}``, :class:`PointRows`): computed where read, never
  stored;
* a vocabulary shard (``axis_name``): the rows hold this device's ``V / n`` columns; an entry
  is contributed by the device that holds it and summed over the mesh axis (one scalar).

Inside :func:`~specdec_jax._rows.batching.per_sequence` the raw readers come from the batching
rule (a batch index on CPU, plain slices under ``vmap``); :class:`ArrayRows` wraps them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._logits.adjust import bits
from specdec_jax._logits.adjust import edited_entries
from specdec_jax._logits.adjust import edited_slice
from specdec_jax._logits.lazy import LogitRows
from specdec_jax._logits.lazy import row_probs
from specdec_jax._logits.threshold import first_column

#: ``read(row, start, size) -> (size,)``: a slice of one row of one sequence's array.
Reader = Callable[[jax.Array, jax.Array, int], jax.Array]


def reader(array, batch_index: jax.Array | None = None, batched=None) -> Reader:
  """A :data:`Reader` of ``array`` (``(R, V)``, or ``(B, R, V)`` with ``batch_index``).

  ``array`` may be :class:`~specdec_jax._logits.lazy.LogitRows`: the reader then returns the
  processed probabilities of the slice, computed from the logits and the row's statistics
  (``batched``: which of its leaves carry the batch axis that ``batch_index`` indexes; all by
  default). An array without rows (``q`` when ``gamma == 0``) reads as zeros.
  """
  if isinstance(array, LogitRows):
    return _logit_reader(array, batch_index, batched)
  if isinstance(array, MaskedRows):
    return _masked_reader(array, batch_index, batched)
  if array.shape[-2] == 0:
    return lambda _row, _start, size: jnp.zeros((size,), array.dtype)

  def read(row, start, size: int) -> jax.Array:
    row = jnp.asarray(row, jnp.int32)
    start = jnp.asarray(start, jnp.int32)
    if batch_index is None:
      return lax.dynamic_slice(array, (row, start), (1, size))[0]
    index = jnp.asarray(batch_index, jnp.int32)
    return lax.dynamic_slice(array, (index, row, start), (1, 1, size))[0, 0]

  return read


def _logit_reader(rows: LogitRows, batch_index, batched) -> Reader:
  """The reader of :class:`~specdec_jax._logits.lazy.LogitRows`: raw slices made probabilities."""
  if batched is None:
    batched = jax.tree.map(lambda _: batch_index is not None, rows)
  if batch_index is not None:
    index = jnp.asarray(batch_index, jnp.int32)
    stats = jax.tree.map(lambda s, b: s[index] if b else s, rows.stats, batched.stats)
    column = rows.column[index] if batched.column else rows.column
    edits = jax.tree.map(lambda s, b: s[index] if b else s, rows.edits, batched.edits)
  else:
    stats, column, edits = rows.stats, rows.column, rows.edits
  raw = reader(rows.logits, batch_index if batched.logits else None)
  dtype = rows.dtype

  def read(row, start, size: int) -> jax.Array:
    if rows.logits.shape[-2] == 0:
      return jnp.zeros((size,), dtype)
    at = jnp.clip(jnp.asarray(row, jnp.int32), 0, rows.logits.shape[-2] - 1)
    row_stats = jax.tree.map(lambda s: s[at], stats)
    # dynamic_slice clamps the start so that the slice fits: the ids follow the clamp.
    first = jnp.clip(jnp.asarray(start, jnp.int32), 0, rows.logits.shape[-1] - size)
    ids = column + first + jnp.arange(size, dtype=jnp.int32)
    x = raw(row, start, size).astype(dtype)
    if edits is not None:  # the request's adjustments: the mask, then the listed entries
      x = edited_slice(jax.tree.map(lambda e: e[at], edits), x, first, ids)
    return row_probs(row_stats, x, ids)

  return read


class MaskedRows(NamedTuple):
  """Probability rows ``(R, V)`` under a grammar bitmask: ``p * allowed / mass``, computed where
  read (``V / n`` columns and words per device when sharded).

  Attributes:
    probs: ``(R, V_local)`` the rows as given.
    words: uint32 ``(R, W_local)`` bitmask words (bit ``i`` of word ``j``: local column
      ``32 j + i`` allowed).
    mass: ``(R,)`` each row's allowed mass (summed over the devices); 0: the row allows
      nothing (it reads as NaN).
  """

  probs: jax.Array
  words: jax.Array
  mass: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return self.probs.shape

  @property
  def ndim(self) -> int:
    return self.probs.ndim

  @property
  def dtype(self) -> jnp.dtype:
    return jnp.promote_types(self.probs.dtype, jnp.float32)


def masked_rows(probs: jax.Array, words: jax.Array | None, axis_name: str | None = None):
  """``probs`` under the bitmask ``words`` (:class:`MaskedRows`), or ``probs`` without one."""
  if words is None:
    return probs
  words = words.astype(jnp.uint32)
  dtype = jnp.promote_types(probs.dtype, jnp.float32)
  allowed = bits(words, probs.shape[-1])
  mass = jnp.sum(jnp.where(allowed, probs.astype(dtype), 0), axis=-1)
  if axis_name is not None:
    mass = lax.psum(mass, axis_name)
  return MaskedRows(probs, words, mass)


def _bit(words: jax.Array, local: jax.Array) -> jax.Array:
  """Whether local columns ``local`` are allowed by ``words`` (leading shapes alike)."""
  word = jnp.take_along_axis(words, (local // 32)[..., None], axis=-1)[..., 0]
  return ((word >> (local % 32).astype(jnp.uint32)) & 1) != 0


def _masked_reader(rows: MaskedRows, batch_index, batched) -> Reader:
  """The reader of :class:`MaskedRows`: slices of the rows times their mask, renormalised."""
  if batched is None:
    batched = jax.tree.map(lambda _: batch_index is not None, rows)
  index = None if batch_index is None else jnp.asarray(batch_index, jnp.int32)
  raw = reader(rows.probs, index if batched.probs else None)
  words = reader(rows.words, index if batched.words else None)
  mass = rows.mass[index] if (index is not None and batched.mass) else rows.mass
  dtype = rows.dtype

  def read(row, start, size: int) -> jax.Array:
    if rows.probs.shape[-2] == 0:
      return jnp.zeros((size,), dtype)
    at = jnp.clip(jnp.asarray(row, jnp.int32), 0, rows.probs.shape[-2] - 1)
    first = jnp.clip(jnp.asarray(start, jnp.int32), 0, rows.probs.shape[-1] - size)
    local = first + jnp.arange(size, dtype=jnp.int32)
    word = words(row, 0, rows.words.shape[-1])[local // 32]
    allowed = ((word >> (local % 32).astype(jnp.uint32)) & 1) != 0
    return jnp.where(allowed, raw(row, start, size).astype(dtype) / mass[at], 0)

  return read


def entries(array, rows: jax.Array, local: jax.Array) -> jax.Array:
  """``array[rows, local]`` (gathered entries), processed for
  :class:`~specdec_jax._logits.lazy.LogitRows` (``local``: this device's column indices)."""
  if isinstance(array, MaskedRows):
    bit = _bit(array.words[rows], local)
    return jnp.where(bit, array.probs[rows, local] / array.mass[rows], 0).astype(array.dtype)
  if not isinstance(array, LogitRows):
    return array[rows, local]
  stats = jax.tree.map(lambda s: s[rows], array.stats)
  x = array.logits[rows, local].astype(array.dtype)
  if array.edits is not None:
    x = edited_entries(jax.tree.map(lambda e: e[rows], array.edits), x, local, array.column)
  return row_probs(stats, x, local + array.column)


def shifted(read: Reader, offset) -> Reader:
  """``read`` of the rows ``offset, offset + 1, ...``: one sequence's rows in a packed array.

  Rows past the array are clipped by ``dynamic_slice`` (a rule never uses them).
  """
  return lambda row, start, size: read(offset + row, start, size)


def sharded_entry(read_local: Callable[[jax.Array], jax.Array], token, local_vocab: int,
                  axis_name: str | None, column=None) -> jax.Array:
  """Entry ``token`` (a global id) of a row split over ``axis_name``, on every device.

  ``read_local(local_ids)`` returns the row's values at local column indices (any shape). The
  device that holds ``token`` contributes its value and a ``psum`` gives every device the
  scalar: one number per entry crosses devices. Without ``axis_name`` it is a plain read.
  """
  token = jnp.asarray(token, jnp.int32)
  if axis_name is None:
    return read_local(token)
  local = token - (first_column(local_vocab, axis_name) if column is None else column)
  mine = (local >= 0) & (local < local_vocab)
  value = read_local(jnp.clip(local, 0, local_vocab - 1))
  return lax.psum(jnp.where(mine, value, jnp.zeros_like(value)), axis_name)


class ArrayRows:
  """A row source over stored rows: padded, packed (with an offset) or a vocabulary shard.

  Args:
    read: a :data:`Reader` of the sequence's rows (row 0 is the sequence's first row).
    local_vocab: the columns this device holds (``V``, or ``V / n`` with ``axis_name``).
    axis_name: the mesh axis the vocabulary is split over, or None.
  """

  def __init__(self, read: Reader, local_vocab: int, axis_name: str | None = None,
               column=None):
    self.read, self.local_vocab, self.axis_name = read, local_vocab, axis_name
    self.column = column

  def first_column(self) -> jax.Array:
    """The global id of the first column this device holds (given, or from the mesh axis)."""
    if self.column is not None:
      return self.column
    return first_column(self.local_vocab, self.axis_name)

  def slice(self, row, start, size: int) -> jax.Array:
    """Local columns ``[start, start + size)`` of ``row``."""
    return self.read(row, start, size)

  def entry(self, row, token) -> jax.Array:
    """``row[token]`` (a global id), the same scalar on every device."""
    return sharded_entry(lambda local: self.read(row, local, 1)[0], token, self.local_vocab,
                         self.axis_name, self.column)


class PointRows:
  """The rows ``e_{ids[row]}`` of point-mass drafts (n-gram, prompt lookup, greedy heads).

  Computed where read, never stored; an entry needs no collective (every device knows ids).
  """

  def __init__(self, ids: jax.Array, local_vocab: int, axis_name: str | None = None,
               dtype=jnp.float32, column=None):
    self.ids, self.local_vocab, self.axis_name, self.dtype = ids, local_vocab, axis_name, dtype
    self.column = column

  def first_column(self) -> jax.Array:
    """The global id of the first column this device holds (given, or from the mesh axis)."""
    if self.column is not None:
      return self.column
    return first_column(self.local_vocab, self.axis_name)

  def slice(self, row, start, size: int) -> jax.Array:
    """Local columns ``[start, start + size)`` of the one-hot row ``row``."""
    if self.ids.shape[0] == 0:
      return jnp.zeros((size,), self.dtype)
    columns = self.first_column() + start + jnp.arange(size, dtype=jnp.int32)
    return (columns == self.ids[row]).astype(self.dtype)

  def entry(self, row, token) -> jax.Array:
    """``1`` where ``token == ids[row]``, else ``0``."""
    if self.ids.shape[0] == 0:
      return jnp.zeros((), self.dtype)
    return (jnp.asarray(token, jnp.int32) == self.ids[row]).astype(self.dtype)


def sequence_rows(readers, offsets, *, local_vocab: int, axis_name: str | None, points=None,
                  dtype=jnp.float32, column=None):
  """``(p_rows, q_rows)`` of one sequence from the batching rule's raw readers.

  ``readers[0]`` reads ``p`` (and ``readers[1]`` reads ``q``) of arrays shared by the batch;
  the sequence's rows start at ``offsets = (p_offset, q_offset)``. With ``points`` (the
  sequence's draft ids) the drafts are point masses and ``q`` is :class:`PointRows`.
  ``column``: this device's first global id, computed outside the batching rule and passed in
  as an argument (so that inside ``shard_map`` it is typed like the rows it indexes).
  """
  p_rows = ArrayRows(shifted(readers[0], offsets[0]), local_vocab, axis_name, column)
  if points is not None:
    return p_rows, PointRows(points, local_vocab, axis_name, dtype, column)
  return p_rows, ArrayRows(shifted(readers[1], offsets[1]), local_vocab, axis_name, column)
