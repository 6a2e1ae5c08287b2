"""The rows a decoding loop processes: a request's history and draft prefix, adjusted and
lazily processed target rows, and the logprobs recorded beside the tokens."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax._core.checks import compute_dtype
from specdec_jax._logits.adjust import History
from specdec_jax._logits.adjust import adjusted_row
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.adjust import rows_edits
from specdec_jax._logits.lazy import LogitRows
from specdec_jax._logits.lazy import request_rows
from specdec_jax._logits.params import take_rows
from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import process_unchecked
from specdec_jax._logits.transform import process_row
from specdec_jax._rows.logprobs import entry_logprobs
from specdec_jax._rows.logprobs import top_logprobs
from specdec_jax.decoding.types import Common
from specdec_jax.decoding.types import Logprobs
from specdec_jax.structured.tables import Grammar
from specdec_jax.structured.tables import prefix_state
from specdec_jax.structured.tables import state_bitmask

#: The parameters that read a request's history (its prompt, its output, the draft prefix).
HISTORY_FIELDS = ("repetition_penalty", "frequency_penalty", "presence_penalty", "bad_words",
                  "min_tokens")


class Constrained(NamedTuple):
  """A loop's rows under a grammar: each request's :class:`~specdec_jax.History` (or None)
  and its grammar state before the rows' draft prefixes.

  Where a loop hands ``history`` to :func:`processed`, :func:`adjusted` or
  :func:`lazy_processed`, this form masks every row with its grammar state after the row's
  draft prefix (the draft's rows and the target's, bonus row included, alike)."""

  history: History | None
  grammar: Grammar
  state: jax.Array  # (B,) int32


def split_history(history) -> tuple[History | None, Constrained | None]:
  """``(History or None, Constrained or None)`` of a loop's ``history`` argument."""
  if isinstance(history, Constrained):
    return history.history, history
  return history, None


def edits_needed(params: SamplingParams, history) -> bool:
  """Whether rows under ``params`` and ``history`` need edits (static): a parameter adjusts
  the logits, or a grammar masks them."""
  return isinstance(history, Constrained) or needs_edits(params, None)


def row_states(history, owners: jax.Array, prefix, prefix_len) -> jax.Array | None:
  """int32 ``(R,)``: the grammar state of each row (its request ``owners[r]``'s state after
  ``prefix[r, :prefix_len[r]]``), or None without a grammar."""
  _, constrained = split_history(history)
  if constrained is None:
    return None
  state = constrained.state[owners]
  if prefix is None:
    return state
  return jax.vmap(lambda s, p, n: prefix_state(constrained.grammar, s, p, n))(
    state, prefix, prefix_len)


def row_bitmask(history, owners: jax.Array, prefix, prefix_len) -> jax.Array | None:
  """int32 ``(R, W)``: each row's grammar bitmask (:func:`row_states`), or None."""
  states = row_states(history, owners, prefix, prefix_len)
  return None if states is None else state_bitmask(split_history(history)[1].grammar, states)


def batch_rows(batch: int) -> jax.Array:
  return jnp.arange(batch, dtype=jnp.int32)


def model_ids(tokens: jax.Array, vocab: int) -> jax.Array:
  """Tokens as a model sees them: padding (``pad_id``, stale slots) clipped into ``[0, V)``."""
  return jnp.clip(tokens, 0, vocab - 1)


def processed(logits: jax.Array, params: SamplingParams, history: History | None = None,
              prefix: jax.Array | None = None, prefix_len: jax.Array | None = None) -> jax.Array:
  """Processed distributions of ``(B, V)`` or ``(B, R, V)`` logits with per-request params.

  ``params`` fields ``(B, ...)``; ``history``: each request's :class:`~specdec_jax.History`
  (fields ``(B, n)``, from :func:`loop_history`) or None; ``prefix`` ``(B, G)`` (``(B, R, G)``)
  the draft tokens before each row's position, ``-1`` padded, of which ``prefix_len`` ``(B,)``
  (``(B, R)``) count: a row follows its request's history, then those draft tokens (output
  too). Without parameters that adjust the logits this is the plain processing, unchanged.
  """
  if not edits_needed(params, history):
    return jax.vmap(process_unchecked)(logits, params)
  flat, row_params, edits = _edited_rows(logits, params, history, prefix, prefix_len)
  probs = jax.vmap(lambda x, p, e: process_row(x, p, None, e))(flat, row_params, edits)
  return probs.reshape(logits.shape)


def adjusted(logits: jax.Array, params: SamplingParams, history: History | None = None,
             prefix: jax.Array | None = None, prefix_len: jax.Array | None = None) -> jax.Array:
  """The adjusted logits (penalties, bias, bans, allowed ids applied; before the temperature)
  of ``(B, V)`` or ``(B, R, V)`` logits, written out (a draft's candidate choice reads them);
  arguments as in :func:`processed`. The logits themselves when nothing adjusts them."""
  if not edits_needed(params, history):
    return logits
  flat, _, edits = _edited_rows(logits, params, history, prefix, prefix_len)
  return jax.vmap(adjusted_row)(flat, edits).reshape(logits.shape)


def _edited_rows(logits, params, history, prefix, prefix_len):
  """``(rows (B R, V), their params, their RowEdits)`` of ``(B, V)`` or ``(B, R, V)`` logits
  (rows in the compute dtype, at least float32)."""
  flat, owners, row_prefix, row_len = _flat_rows(logits, prefix, prefix_len)
  row_params = take_rows(params, owners)
  bitmask = row_bitmask(history, owners, row_prefix, row_len)
  history, _ = split_history(history)
  row_history = None if history is None else History(
    *(None if h is None else h[owners] for h in history))
  flat = flat.astype(compute_dtype(flat.dtype))
  return flat, row_params, rows_edits(flat, row_params, row_history, row_prefix, row_len,
                                      bitmask)


def _flat_rows(logits, prefix, prefix_len, *, empty: bool = True):
  """``(rows (B R, V), owners (B R,), prefix (B R, G), prefix_len (B R,))`` of ``(B, V)`` or
  ``(B, R, V)`` logits; without ``prefix``, an empty one (``empty``) or None."""
  batch, vocab = logits.shape[0], logits.shape[-1]
  count = 1 if logits.ndim == 2 else logits.shape[1]
  owners = jnp.repeat(batch_rows(batch), count)
  flat = logits.reshape(batch * count, vocab)
  if prefix is None:
    if not empty:
      return flat, owners, None, None
    return (flat, owners, jnp.full((batch * count, 0), -1, jnp.int32),
            jnp.zeros((batch * count,), jnp.int32))
  prefix = jnp.asarray(prefix, jnp.int32)
  return (flat, owners, prefix.reshape(batch * count, prefix.shape[-1]),
          jnp.broadcast_to(jnp.asarray(prefix_len, jnp.int32),
                           logits.shape[:-1]).reshape(batch * count))


def loop_history(common: Common, tokens: jax.Array, lengths: jax.Array, size: int,
                 grammar_state: jax.Array | None = None) -> History | Constrained | None:
  """Each row's :class:`~specdec_jax.History`, read from its buffer ``tokens`` ``(B, max_len)``.

  ``prompt_ids``: the prompt (``common.prompt_ids``, only for the repetition penalty);
  ``output_ids`` ``(B, size)``: the ``lengths - prompt_lengths`` tokens generated so far,
  oldest first, then ``-1`` (``size``: the loop's ``max_new_tokens``, the most a row
  generates). None when no parameter reads a history (known at trace time): then nothing is
  gathered. With a grammar (``common.grammar``), a :class:`Constrained` holding that history
  and ``grammar_state`` ``(B,)``, each row's state after its output.
  """
  history = None
  if any(getattr(common.params, f) is not None for f in HISTORY_FIELDS):
    rows = batch_rows(tokens.shape[0])
    at = common.prompt_lengths[:, None] + jnp.arange(size, dtype=jnp.int32)[None]
    output = tokens[rows[:, None], jnp.clip(at, 0, tokens.shape[1] - 1)]
    history = History(common.prompt_ids, jnp.where(at < lengths[:, None], output, -1))
  if common.grammar is None:
    return history
  return Constrained(history, common.grammar, grammar_state)


def draft_prefix(proposed: jax.Array, j) -> tuple[jax.Array, jax.Array]:
  """``(prefix (B, G), prefix_len (B,))``: the first ``j`` (static or traced) of the proposals
  ``(B, G)`` so far, the draft tokens before draft position ``j``."""
  batch, gamma = proposed.shape
  before = jnp.arange(gamma, dtype=jnp.int32)[None] < j
  return (jnp.where(before, proposed, -1).astype(jnp.int32),
          jnp.broadcast_to(jnp.asarray(j, jnp.int32), (batch,)))


def empty_logprobs(batch: int, max_len: int, k: int | None, pad_id: int) -> Logprobs | None:
  """The logprobs buffers before any token (None when ``k`` is None)."""
  if k is None:
    return None
  nan = jnp.full((batch, max_len), jnp.nan, jnp.float32)
  if k == 0:
    return Logprobs(nan)
  return Logprobs(nan, jnp.full((batch, max_len, k), pad_id, jnp.int32),
                  jnp.full((batch, max_len, k), jnp.nan, jnp.float32))


def record_logprobs(buffers: Logprobs | None, lengths, counts, new: Logprobs | None):
  """``buffers`` with the first ``counts[b]`` entries of ``new`` (fields ``(B, S)`` /
  ``(B, S, k)``) written at each row's ``lengths[b]`` onward (the tokens :func:`advance` just
  appended)."""
  if buffers is None:
    return None
  batch, max_len = buffers.logprobs.shape
  width = new.logprobs.shape[1]
  slots = jnp.arange(width, dtype=jnp.int32)[None]
  index = jnp.where(slots < counts[:, None], lengths[:, None] + slots, max_len)
  rows = batch_rows(batch)[:, None]

  def put(buffer, values):
    if buffer is None:
      return None
    return buffer.at[rows, index].set(values.astype(buffer.dtype), mode="drop")

  return Logprobs(*(put(b, v) for b, v in zip(buffers, new, strict=True)))


def token_logprobs(source: LogitRows, rows: jax.Array, tokens: jax.Array, k: int,
                   mode: str) -> Logprobs:
  """:class:`Logprobs` of ``tokens`` drawn from rows ``rows`` ``(n,)`` of ``source``: their
  logprobs ``(n,)`` and, for ``k > 0``, the rows' top ``k`` ``(n, k)``."""
  lp = entry_logprobs(source, rows, tokens, mode=mode).astype(jnp.float32)
  if k == 0:
    return Logprobs(lp)
  ids, values = top_logprobs(source, rows, k, mode=mode)
  return Logprobs(lp, ids.astype(jnp.int32), values.astype(jnp.float32))


def result_logprobs(result) -> Logprobs | None:
  """The :class:`Logprobs` fields of a batch of verifier results (None when absent)."""
  if getattr(result, "logprobs", None) is None:
    return None
  return Logprobs(result.logprobs, result.top_ids, result.top_logprobs)


def reads_lazily(logits: jax.Array, params: SamplingParams) -> bool:
  """Whether a loop verifies ``logits`` through :func:`lazy_processed` (static).

  When some request may cut its rows (``top_k`` or ``top_p`` given): processing every row
  first runs the threshold bisection over each of them, the lazy rows settle most from 64
  candidates (measured at batch 1, V = 49,152, top-k 50: 3.7 -> 1.9 ms per verification
  with a model draft, 1.9 -> 0.45 ms with prompt lookup). With temperature only the two
  cost the same within noise (0.4-0.9 ms) and the lazy program takes about 20% longer to
  compile, so the rows are processed first. Parameters that adjust the logits (penalties,
  bias, bans, allowed ids) are read lazily too: their edits are applied where a rule reads,
  never written out as adjusted rows. An empty batch has no rows to take statistics of.
  """
  return bool(logits.size) and (params.top_k is not None or params.top_p is not None
                                or needs_edits(params, None))


def reads_lazily_under(logits: jax.Array, params: SamplingParams, history) -> bool:
  """:func:`reads_lazily`, or a grammar masks the rows (static)."""
  return bool(logits.size) and (reads_lazily(logits, params) or edits_needed(params, history))


def lazy_processed(logits: jax.Array, params: SamplingParams, history: History | None = None,
                   prefix: jax.Array | None = None, prefix_len: jax.Array | None = None, *,
                   logprobs: int = 0, raw: bool = False) -> tuple[LogitRows, LogitRows]:
  """``(B, R, V)`` logits with per-request ``params`` (fields ``(B, ...)``) as a lazily
  processed row source (:mod:`specdec_jax._logits.lazy`): what :func:`processed` would return, read
  where a rule reads it, without the ``(B, R, V)`` copy.

  ``history``, ``prefix`` ``(B, R, G)``, ``prefix_len`` ``(B, R)``: as in :func:`processed`
  (row ``r`` of request ``b`` follows ``prefix[b, r, :prefix_len[b, r]]`` after its history);
  the rows' :class:`~specdec_jax._logits.adjust.RowEdits` are made only when a parameter adjusts the
  logits. ``logprobs``, ``raw``: the statistics the logprobs read
  (:func:`~specdec_jax._logits.lazy.logit_stats`).

  Returns ``(rows, in_axes)``: ``rows`` with statistics (and edits) ``(B, R, ...)``, and the
  ``jax.vmap`` axes that hand each sequence its ``(R, V)`` rows. The statistics are computed
  for the whole batch at once, so their batch-level branches (no top-k work when no row has
  top-k, ...) stay branches: under ``jax.vmap`` a ``lax.cond`` would run both sides.
  """
  batch, count, _ = logits.shape
  flat, owners, row_prefix, row_len = _flat_rows(logits, prefix, prefix_len, empty=False)
  bitmask = row_bitmask(history, owners, row_prefix, row_len)
  source = request_rows(flat, params, owners, history=split_history(history)[0],
                        prefix=row_prefix, prefix_len=row_len, bitmask=bitmask,
                        logprobs=logprobs, raw=raw)

  def split(a):
    return a.reshape(batch, count, *a.shape[1:])

  stats = jax.tree.map(split, source.stats)
  edits = None if source.edits is None else jax.tree.map(split, source.edits)
  axes = LogitRows(0, jax.tree.map(lambda _: 0, stats), None,
                   None if edits is None else jax.tree.map(lambda _: 0, edits))
  return LogitRows(logits, stats, source.column, edits), axes
