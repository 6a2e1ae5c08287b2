"""What a request's sampling parameters do to a logit row before the temperature: row edits.

An engine's request carries more than temperature / top-k / top-p: allowed token ids, bad
words, ``min_tokens`` with stop ids, a logit bias and repetition / frequency / presence
penalties, and a grammar's token bitmask. Each turns the raw logits ``x`` of a row into the
*adjusted* logits ``x'`` that the temperature, ``min_p``, top-k and top-p then process
(:mod:`specdec_jax._logits.transform`, :mod:`specdec_jax._logits.lazy`). The order is vLLM's
sampler's:

1. allowed token ids (``-inf`` for the others), and a grammar's bitmask;
2. bad words: a token that would complete a banned sequence, its prefix just produced;
3. ``min_tokens``: the stop ids while fewer than ``min_tokens`` tokens were produced;
4. the logit bias (added);
5. penalties: repetition (``x / r`` if ``x > 0`` else ``x * r``, on tokens of the prompt or
   the output), then frequency (``- f * count``) and presence (``- p * [count > 0]``) on
   tokens of the output.

At a draft position the output is the request's history *plus the draft prefix* before that
position: penalty counts, ``min_tokens``'s count and bad words' prefixes run through it.

No adjusted row is ever written. A row's adjustment is held as :class:`RowEdits`: ``words``,
a bitmask in the layout grammar engines emit (``int32``/``uint32``, ``ceil(V / 32)`` words,
bit ``i`` of word ``j`` for token ``32 j + i``) of the tokens whose adjusted logit is the raw
one, and a short sorted list of the other tokens (``ids``) with their adjusted logits
(``values``, ``-inf`` for a banned one). Every token the penalties, the bias, bad words or
``min_tokens`` can touch is in the list (the prompt, the output, the draft prefix, the bias
ids, the stop ids, each bad word's last token), so its size is static and the dense rest of
the row is the raw logits under a mask: the statistics' passes read the raw row through the
mask and fold the list in (:func:`~specdec_jax._logits.lazy.logit_stats`), readers overwrite the
listed entries of a slice (:func:`edited_slice`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

#: The id written into unused slots of an edit list: larger than any token id, so it sorts
#: last and matches no column.
NO_ID = jnp.iinfo(jnp.int32).max

#: Bits per bitmask word (xgrammar's and llguidance's layout).
WORD = 32


class History(NamedTuple):
  """A request's tokens so far, which penalties, ``min_tokens`` and bad words read.

  One request's arrays (a leading ``B`` axis for a batch); ``-1`` pads. The engines' form
  (vLLM's ``prompt_token_ids`` and ``output_token_ids``); a request holding output *counts*
  instead converts them with :func:`~specdec_jax.output_ids_from_counts`.

  Attributes:
    prompt_ids: int ``(P,)`` the prompt's ids (repetition penalty), ``-1`` padded anywhere.
    output_ids: int ``(L,)`` the tokens generated so far, oldest first, then ``-1``: the
      penalties' counts, ``min_tokens``'s count and bad words' prefixes.
  """

  prompt_ids: jax.Array | None = None
  output_ids: jax.Array | None = None


class RowEdits(NamedTuple):
  """How one row's (or, with a leading axis, rows') adjusted logits differ from the raw ones.

  Attributes:
    words: uint32 ``(W,)``, ``W = ceil(V / 32)`` (``V / n / 32`` per device when sharded):
      bit set where the adjusted logit is the raw one; clear for a masked token and for every
      listed one.
    ids: int32 ``(E,)`` the listed tokens' global ids, ascending, then :data:`NO_ID`.
    values: ``(E,)`` their adjusted logits (``-inf`` where banned or unused).
  """

  words: jax.Array
  ids: jax.Array
  values: jax.Array


def word_count(vocab: int) -> int:
  """``ceil(V / 32)``: the words of a bitmask row over ``vocab`` tokens."""
  return -(-vocab // WORD)


def bits(words: jax.Array, vocab: int) -> jax.Array:
  """``(..., V)`` bool from bitmask words ``(..., ceil(V / 32))`` (bit ``i`` of word ``j``:
  token ``32 j + i``)."""
  shifts = jnp.arange(WORD, dtype=jnp.uint32).reshape((1,) * words.ndim + (WORD,))
  unpacked = (words.astype(jnp.uint32)[..., None] >> shifts) & 1
  return unpacked.reshape(*words.shape[:-1], -1)[..., :vocab] != 0


def id_bits(ids: jax.Array, words: int, first=0) -> jax.Array:
  """uint32 ``(words,)``: the bitmask of distinct ``ids`` (others: :data:`NO_ID` or outside
  ``[first, first + 32 words)``, dropped). Distinct ids set distinct bits, so adding them is
  or'ing them."""
  local = ids - first
  inside = (local >= 0) & (local < words * WORD)
  bit = jnp.left_shift(jnp.uint32(1), (local % WORD).astype(jnp.uint32))
  slot = jnp.where(inside, local // WORD, words)  # out of range: dropped
  return jnp.zeros(words, jnp.uint32).at[slot].add(jnp.where(inside, bit, 0), mode="drop")


def unique_sorted(ids: jax.Array) -> jax.Array:
  """``ids`` ascending with repeats and negative ids replaced by :data:`NO_ID` (last)."""
  if ids.shape[0] == 0:
    return ids.astype(jnp.int32)
  s = jnp.sort(jnp.where(ids < 0, NO_ID, ids).astype(jnp.int32))
  repeat = jnp.concatenate([jnp.zeros((1,), bool), s[1:] == s[:-1]])
  return jnp.sort(jnp.where(repeat, NO_ID, s))


def count_in(sorted_ids: jax.Array, ids: jax.Array) -> jax.Array:
  """How often each of ``ids`` occurs in ascending ``sorted_ids`` (two binary searches)."""
  if sorted_ids.shape[0] == 0:
    return jnp.zeros(ids.shape, jnp.int32)
  hi = jnp.searchsorted(sorted_ids, ids, side="right")
  lo = jnp.searchsorted(sorted_ids, ids, side="left")
  return (hi - lo).astype(jnp.int32)


def _tail(output_ids, prefix, prefix_len, size: int) -> jax.Array:
  """The last ``size`` tokens of ``output ++ prefix[:prefix_len]`` (``-2`` before the start)."""
  n_out = jnp.sum(output_ids >= 0, dtype=jnp.int32)
  total = n_out + prefix_len
  pos = total - size + jnp.arange(size, dtype=jnp.int32)
  from_out = output_ids[jnp.clip(pos, 0, max(output_ids.shape[0] - 1, 0))] if (
    output_ids.shape[0]) else jnp.full((size,), -2, jnp.int32)
  from_prefix = prefix[jnp.clip(pos - n_out, 0, max(prefix.shape[0] - 1, 0))] if (
    prefix.shape[0]) else jnp.full((size,), -2, jnp.int32)
  return jnp.where(pos < 0, -2, jnp.where(pos < n_out, from_out, from_prefix))


def compact_words(bad_words) -> jax.Array:
  """``bad_words`` ``(NB, Lb)`` with each row's tokens (``>= 0``) moved to its front in order and
  ``-1`` after them: a ``-1`` anywhere in a word is padding, as the reference reads it."""
  width = bad_words.shape[-1]
  slot = jnp.arange(width, dtype=jnp.int32)
  order = jnp.argsort(jnp.where(bad_words >= 0, slot, width + slot), axis=-1)
  return jnp.take_along_axis(bad_words, order, axis=-1)


def banned_by_bad_words(bad_words, output_ids, prefix, prefix_len) -> jax.Array:
  """``(NB,)`` bool: bad word ``j`` (a row of ``bad_words`` ``(NB, Lb)``, ``-1`` padded,
  :func:`compact_words`) bans its last token here, its other tokens being the last ones
  produced (a word of one token: always)."""
  bad_words = compact_words(bad_words)
  _, width = bad_words.shape
  lengths = jnp.sum(bad_words >= 0, axis=-1, dtype=jnp.int32)
  if width == 1:
    return lengths > 0
  tail = _tail(output_ids, prefix, prefix_len, width - 1)  # (Lb - 1,)
  # Token k of word j (k < n - 1) must equal tail[(Lb - 1) - (n - 1) + k].
  k = jnp.arange(width - 1, dtype=jnp.int32)[None, :]
  at = jnp.clip((width - 1) - (lengths[:, None] - 1) + k, 0, width - 2)
  matches = (bad_words[:, :-1] == tail[at]) | (k >= lengths[:, None] - 1)
  return (lengths > 0) & jnp.all(matches, axis=-1)


def last_tokens(bad_words) -> jax.Array:
  """``(NB,)`` each bad word's last token (``-1`` for an empty word)."""
  bad_words = compact_words(bad_words)
  lengths = jnp.sum(bad_words >= 0, axis=-1, dtype=jnp.int32)
  return jnp.take_along_axis(bad_words, jnp.maximum(lengths - 1, 0)[:, None], axis=-1)[:, 0]


def _concat(parts, empty) -> jax.Array:
  parts = [jnp.asarray(p).reshape(-1).astype(jnp.int32) for p in parts if p is not None]
  return jnp.concatenate(parts) if parts else empty


def needs_edits(params, bitmask) -> bool:
  """Whether rows under ``params`` (and a grammar ``bitmask``, or None) need
  :class:`RowEdits` (static: which fields are set)."""
  fields = ("repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias_ids",
            "allowed_token_ids", "bad_words")
  return (bitmask is not None or any(getattr(params, f, None) is not None for f in fields)
          or (getattr(params, "min_tokens", None) is not None
              and getattr(params, "stop_token_ids", None) is not None))


def row_edits(x: jax.Array, params, history: History | None, prefix: jax.Array, prefix_len,
              bitmask: jax.Array | None, *, first=0) -> RowEdits | None:
  """:class:`RowEdits` of one row ``x`` (``(V_local,)``, raw logits; the global columns
  ``[first, first + V_local)`` when sharded) at a position after ``prefix[:prefix_len]``.

  ``params``: one request's :class:`~specdec_jax.SamplingParams` (scalars, and the list fields'
  rows); ``history``: its :class:`History` or None; ``prefix`` ``(G,)``: the draft tokens
  before this row's position (``-1`` padded); ``bitmask``: the row's grammar words ``(W,)``
  or None. Returns None when nothing adjusts the row (the plain path, removed at trace time).
  """
  penalties = [params.repetition_penalty, params.frequency_penalty, params.presence_penalty]
  counted = any(v is not None for v in penalties)
  min_tokens = params.min_tokens is not None and params.stop_token_ids is not None
  listed = [
    history.prompt_ids if (history is not None and params.repetition_penalty is not None)
    else None,
    history.output_ids if (history is not None and counted) else None,
    prefix if counted else None,
    params.logit_bias_ids,
    params.stop_token_ids if min_tokens else None,
    None if params.bad_words is None else last_tokens(params.bad_words),
  ]
  allowed = params.allowed_token_ids
  if not needs_edits(params, bitmask):
    return None
  local_vocab = x.shape[-1]
  words = word_count(local_vocab)
  dtype = x.dtype
  ids = unique_sorted(_concat(listed, jnp.zeros((0,), jnp.int32)))
  # Values of the listed ids held here (others: -inf, read on the device that holds them).
  local = ids - first
  here = (local >= 0) & (local < local_vocab)
  raw = jnp.where(here, x[jnp.clip(local, 0, local_vocab - 1)] if ids.shape[0] else
                  jnp.zeros(ids.shape, dtype), -jnp.inf)
  ok = here
  dense = jnp.full((words,), jnp.uint32(0xFFFFFFFF))
  if local_vocab % WORD:  # the last word's bits past V are clear
    dense = dense.at[-1].set(jnp.uint32((1 << (local_vocab % WORD)) - 1))
  if allowed is not None:
    allowed_ids = unique_sorted(jnp.asarray(allowed).reshape(-1))
    ok = ok & (count_in(allowed_ids, ids) > 0)
    dense = dense & id_bits(allowed_ids, words, first)
  if bitmask is not None:
    grammar = bitmask.astype(jnp.uint32)
    dense = dense & grammar
    word_of = jnp.clip(local // WORD, 0, words - 1)
    ok = ok & (((grammar[word_of] >> (local % WORD).astype(jnp.uint32)) & 1) != 0)
  output = None if history is None else history.output_ids
  output = jnp.zeros((0,), jnp.int32) if output is None else jnp.asarray(output, jnp.int32)
  prefix_len = jnp.asarray(prefix_len, jnp.int32)
  banned = jnp.zeros(ids.shape, bool)
  if params.bad_words is not None:
    bad = jnp.asarray(params.bad_words, jnp.int32)
    hit = banned_by_bad_words(bad, output, prefix, prefix_len)
    banned = banned | (count_in(unique_sorted(jnp.where(hit, last_tokens(bad), -1)), ids) > 0)
  if min_tokens:
    produced = jnp.sum(output >= 0, dtype=jnp.int32) + prefix_len
    stops = unique_sorted(jnp.asarray(params.stop_token_ids).reshape(-1))
    banned = banned | ((produced < params.min_tokens) & (count_in(stops, ids) > 0))
  value = jnp.where(ok & ~banned, raw, -jnp.inf)
  if params.logit_bias_ids is not None:
    bias_ids = jnp.asarray(params.logit_bias_ids, jnp.int32).reshape(-1)
    bias = jnp.asarray(params.logit_bias_values, dtype).reshape(-1)
    matches = ids[:, None] == bias_ids[None, :]
    value = value + jnp.sum(jnp.where(matches, bias[None, :], 0), axis=-1)
  if counted:
    in_prefix = jnp.arange(prefix.shape[0]) < prefix_len
    count = count_in(jnp.sort(jnp.where(output >= 0, output, NO_ID)), ids) + jnp.sum(
      (ids[:, None] == prefix[None, :]) & in_prefix[None, :], axis=-1, dtype=jnp.int32)
    seen = count > 0
    if params.repetition_penalty is not None:
      r = jnp.asarray(params.repetition_penalty, dtype)
      prompt = history.prompt_ids if history is not None else None
      if prompt is not None:
        sorted_prompt = jnp.sort(jnp.where(jnp.asarray(prompt) >= 0, prompt, NO_ID)
                                 .astype(jnp.int32))
        seen_r = seen | (count_in(sorted_prompt, ids) > 0)
      else:
        seen_r = seen
      value = jnp.where(seen_r, jnp.where(value > 0, value / r, value * r), value)
    if params.frequency_penalty is not None:
      value = value - jnp.asarray(params.frequency_penalty, dtype) * count.astype(dtype)
    if params.presence_penalty is not None:
      value = value - jnp.asarray(params.presence_penalty, dtype) * seen.astype(dtype)
  value = jnp.where(here & (ids != NO_ID), value, -jnp.inf)
  dense = dense & ~id_bits(ids, words, first)
  return RowEdits(dense, ids, value)


def adjusted_row(x: jax.Array, edits: RowEdits | None, first=0) -> jax.Array:
  """The adjusted logits of one row ``(V_local,)`` written out (the eager path and the
  statistics' per-row fallback; never a batch of rows)."""
  if edits is None:
    return x
  vocab = x.shape[-1]
  out = jnp.where(bits(edits.words, vocab), x, -jnp.inf)
  local = edits.ids - first
  inside = (local >= 0) & (local < vocab)
  return out.at[jnp.where(inside, local, vocab)].set(edits.values, mode="drop")


def edited_slice(edits: RowEdits | None, raw: jax.Array, start, ids: jax.Array) -> jax.Array:
  """Adjusted logits of a slice ``raw`` of one row whose global ids are ``ids`` (contiguous,
  from ``ids[0]``): the dense mask, then the listed entries that fall in it overwritten.

  Only the ``min(E, size)`` listed ids from the first one ``>= ids[0]`` can fall inside (they
  are distinct and ascending), so a window of that many is read, not the whole list.
  """
  if edits is None:
    return raw
  size = raw.shape[-1]
  words = edits.words
  local_start = start  # the slice's first local column
  word_ids = (local_start + jnp.arange(size, dtype=jnp.int32)) // WORD
  bit = (words[jnp.clip(word_ids, 0, words.shape[-1] - 1)]
         >> ((local_start + jnp.arange(size, dtype=jnp.int32)) % WORD).astype(jnp.uint32)) & 1
  out = jnp.where(bit != 0, raw, -jnp.inf)
  count = edits.ids.shape[-1]
  if count == 0:
    return out
  window = min(count, size)
  lo = jnp.searchsorted(edits.ids, ids[0], side="left")
  lo = jnp.clip(lo, 0, count - window)
  wid = lax.dynamic_slice(edits.ids, (lo,), (window,))
  wval = lax.dynamic_slice(edits.values, (lo,), (window,))
  at = wid - ids[0]
  inside = (at >= 0) & (at < size)
  return out.at[jnp.where(inside, at, size)].set(wval, mode="drop")


def edited_entries(edits: RowEdits | None, raw: jax.Array, local: jax.Array,
                   first=0) -> jax.Array:
  """Adjusted logits of single entries: ``raw`` at local columns ``local`` of one row each
  (``edits`` fields with the same leading shape as ``local``)."""
  if edits is None:
    return raw
  word = jnp.take_along_axis(edits.words, (local // WORD)[..., None], axis=-1)[..., 0]
  bit = (word >> (local % WORD).astype(jnp.uint32)) & 1
  out = jnp.where(bit != 0, raw, -jnp.inf)
  if edits.ids.shape[-1] == 0:
    return out
  target = (local + first)[..., None]
  at = jnp.sum(edits.ids < target, axis=-1)  # the listed id's slot, if listed
  at = jnp.minimum(at, edits.ids.shape[-1] - 1)
  listed = jnp.take_along_axis(edits.ids, at[..., None], axis=-1)[..., 0] == target[..., 0]
  value = jnp.take_along_axis(edits.values, at[..., None], axis=-1)[..., 0]
  return jnp.where(listed, value, out)


__all__ = ["NO_ID", "WORD", "History", "RowEdits", "adjusted_row", "bits", "edited_entries",
           "edited_slice", "row_edits", "word_count"]


def chain_prefixes(draft: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """``(prefix (rows, G), length (rows,))`` of a chain's rows: row ``i`` follows ``draft[:i]``
  (``-1`` past it)."""
  gamma = draft.shape[-1]
  i = jnp.arange(rows, dtype=jnp.int32)[:, None]
  j = jnp.arange(gamma, dtype=jnp.int32)[None, :]
  prefix = jnp.where(j < i, jnp.asarray(draft, jnp.int32)[None, :], -1)
  return prefix, jnp.minimum(jnp.arange(rows, dtype=jnp.int32), gamma)


def tree_prefixes(parents: jax.Array, tokens: jax.Array,
                  max_depth: int) -> tuple[jax.Array, jax.Array]:
  """``(prefix (N, max_depth), depth (N,))`` of a tree's rows: row ``u`` follows the tokens of
  the path from the root (excluded) to ``u`` (included), root first, ``-1`` past it."""
  size = parents.shape[-1]
  nodes = jnp.arange(size, dtype=jnp.int32)
  safe = jnp.clip(jnp.asarray(parents, jnp.int32), -1, size - 1)

  def up(carry, _):  # walk every node's path one step toward the root
    at, path = carry
    token = jnp.where(at > 0, jnp.asarray(tokens, jnp.int32)[jnp.maximum(at, 0)], -1)
    nxt = jnp.where(at > 0, safe[jnp.maximum(at, 0)], -1)
    return (nxt, path), token

  (_, _), walked = lax.scan(up, (nodes, None), None, length=max_depth)  # (D, N) leaf first
  walked = walked.T  # (N, D): the path's tokens from u upward
  depth = jnp.sum(walked >= 0, axis=-1, dtype=jnp.int32)
  # Reverse each row's first `depth` entries: root first.
  j = jnp.arange(max_depth, dtype=jnp.int32)[None, :]
  at = jnp.clip(depth[:, None] - 1 - j, 0, max(max_depth - 1, 0))
  prefix = jnp.where(j < depth[:, None], jnp.take_along_axis(walked, at, axis=-1), -1)
  return prefix, depth


def rows_edits(logits: jax.Array, params, history: History | None, prefix: jax.Array,
               prefix_len: jax.Array, bitmask: jax.Array | None, first=0) -> RowEdits | None:
  """:func:`row_edits` of rows ``(R, V_local)``: ``params`` and ``history`` with a leading
  ``R`` (each row's request's), ``prefix`` ``(R, G)``, ``prefix_len`` ``(R,)``, ``bitmask``
  ``(R, W)`` or None. None when nothing adjusts the rows (known at trace time)."""
  if not needs_edits(params, bitmask):
    return None
  x = logits.astype(logits.dtype if jnp.dtype(logits.dtype).itemsize >= 4 else jnp.float32)
  return jax.vmap(lambda xr, p, h, pre, n, m: row_edits(xr, p, h, pre, n, m, first=first))(
    x, params, history, prefix, prefix_len, bitmask)
