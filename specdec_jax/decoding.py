"""Decoding loops: plain autoregressive sampling and exact speculative decoding, fully jitted.

Both loops run a whole batch inside one compiled ``jax.lax.while_loop`` with fixed
shapes. Every row has its own length (ragged batches), its own keys and its own stop
(``eos_id`` or ``max_new_tokens``); finished rows stop changing while the others go on.
Models enter through the :class:`~specdec_jax.models.protocol.Model` protocol: a
cache slot per position, so rolling back rejected proposals is just moving a length.

* :func:`generate`: one target call per token (the baseline).
* :func:`speculative_generate`: a draft proposes ``gamma`` tokens, the target scores
  them in one call and a verifier (default :func:`~specdec_jax.verify`) keeps a prefix
  plus one token of its own, so the output is distributed exactly as :func:`generate`'s.
  The draft is another :class:`Model` (a small model, or the target with layers
  skipped) or :class:`PromptLookup` (n-gram matches in the context, no model at all).
* :func:`tree_speculative_generate`: a draft model proposes a :class:`DraftTree` of
  candidates, the target scores every node in one call with tree attention and
  :func:`~specdec_jax.tree_verify` keeps one path plus a token of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax._block import block_verify
from specdec_jax._checks import INT
from specdec_jax._checks import host_array
from specdec_jax._checks import is_concrete
from specdec_jax._errors import ErrorCode
from specdec_jax._errors import flag
from specdec_jax._logits import SamplingParams
from specdec_jax._logits import check_params
from specdec_jax._logits import params_error
from specdec_jax._logits import process_logits
from specdec_jax._logits import sample_draft
from specdec_jax._sampling import sample_index
from specdec_jax._tree import tree_verify
from specdec_jax._verify import VerifyResult
from specdec_jax._verify import verify
from specdec_jax.models.protocol import Model

#: ``verifier(p (gamma + 1, V), q (gamma, V), draft (gamma,), uniforms (gamma + 1,), *,
#: num_draft) -> VerifyResult`` for one sequence, the signature of :func:`verify`.
Verifier = Callable[..., VerifyResult]

#: Verifiers selectable by name in :func:`speculative_generate`.
VERIFIERS: dict[str, Verifier] = {"token": verify, "block": block_verify}


class PromptLookup(NamedTuple):
  """A draft without a model: propose what followed the last n-gram the last time it occurred.

  At each step the row's last ``n`` tokens are looked up in its own context (prompt
  and generated tokens), for ``n = max_ngram`` down to ``min_ngram``; at the most
  recent earlier occurrence, the tokens that followed it are proposed (repeating the
  matched period if fewer than ``gamma`` follow). Without any match the last token is
  repeated. Each proposal comes with a point mass as its ``q`` row, which the
  verification rule handles exactly at any temperature (accept ``x`` with probability
  ``p(x)``, else sample from ``p`` with ``x`` removed), so the output distribution is
  the target's whatever is proposed.

  Attributes:
    max_ngram: longest n-gram to match (static).
    min_ngram: shortest n-gram to match, ``1 <= min_ngram <= max_ngram``.

  Reference:
    Saxena, "Prompt Lookup Decoding", 2023, github.com/apoorvumang/prompt-lookup-decoding;
    Yang et al., "Inference with Reference: Lossless Acceleration of Large Language
    Models" (LLMA), arXiv:2304.04487.
  """

  max_ngram: int = 3
  min_ngram: int = 1


#: A draft for :func:`speculative_generate`: another :class:`Model` (same vocabulary as the
#: target) or :class:`PromptLookup`.
Draft = Model | PromptLookup


class DecodeStats(NamedTuple):
  """Counters of a decoding run (:func:`generate` fills only the target fields).

  Attributes:
    target_calls: int32 ``()``. ``apply`` calls on the target for the whole batch,
      the prefill included.
    draft_calls: int32 ``()``. ``apply`` calls on the draft model for the whole batch,
      its prefill included (0 for :class:`PromptLookup` and for :func:`generate`).
    row_target_calls: int32 ``(B,)``. Target calls while the row was unfinished
      (prefill included); each of them emitted at least one token of the row.
    proposals: int32 ``(B,)``. Draft tokens handed to verification.
    accepted: int32 ``(B,)``. Draft tokens the verifier accepted (before truncation at
      ``eos_id``; proposals never run past ``max_new_tokens``).
    proposed_at: int32 ``(B, gamma)``. How often a token was proposed at draft position ``i``.
    accepted_at: int32 ``(B, gamma)``. How often the token at draft position ``i`` was
      accepted; ``accepted_at / proposed_at`` is the acceptance rate by position.
    emitted: int32 ``(B,)``. New tokens written (equals the result's ``num_new``).
    tokens_per_call: float32 ``(B,)``. ``emitted / row_target_calls``.
  """

  target_calls: jax.Array
  draft_calls: jax.Array
  row_target_calls: jax.Array
  proposals: jax.Array
  accepted: jax.Array
  proposed_at: jax.Array
  accepted_at: jax.Array
  emitted: jax.Array
  tokens_per_call: jax.Array


class GenerateResult(NamedTuple):
  """What :func:`generate` produced.

  Attributes:
    tokens: int32 ``(B, max_len)``. Each row's prompt, then its new tokens (the
      ``eos_id`` token included when it stopped the row), then ``pad_id``.
    lengths: int32 ``(B,)``. Prompt plus new tokens.
    num_new: int32 ``(B,)``. New tokens, ``<= max_new_tokens``.
    stats: :class:`DecodeStats`.
    error: int32 ``(B,)``. :class:`~specdec_jax.ErrorCode` bits of the row (0 when all was
      well; decode with :func:`~specdec_jax.describe_error`): ``NONFINITE`` when a
      distribution the row sampled from was NaN (NaN or ``+inf`` logits from the model),
      ``TOKEN_OUT_OF_RANGE`` for a prompt id outside ``[0, V)``, ``BAD_PARAMS`` for traced
      out-of-range sampling parameters or ``eos_id``, ``OUT_OF_ROOM`` when the row stopped
      because the buffer (``max_len``) or the model's context was full before
      ``max_new_tokens`` or ``eos_id``.
  """

  tokens: jax.Array
  lengths: jax.Array
  num_new: jax.Array
  stats: DecodeStats
  error: jax.Array


class SpeculativeResult(NamedTuple):
  """What :func:`speculative_generate` produced.

  Attributes:
    tokens: int32 ``(B, max_len)``. As in :class:`GenerateResult`.
    lengths: int32 ``(B,)``. Prompt plus new tokens.
    num_new: int32 ``(B,)``. New tokens, ``<= max_new_tokens``.
    stats: :class:`DecodeStats`.
    error: int32 ``(B,)``. Bitwise OR of the verifier's
      :class:`~specdec_jax.ErrorCode` masks over the row's steps and the loop's own bits
      (as in :class:`GenerateResult`); 0 when everything was valid (decode with
      :func:`~specdec_jax.describe_error`).
  """

  tokens: jax.Array
  lengths: jax.Array
  num_new: jax.Array
  stats: DecodeStats
  error: jax.Array


class _Fns(NamedTuple):
  """The static half of a :class:`Model` (hashable: a jit static argument)."""

  apply: Callable[..., Any]
  init_cache: Callable[[int, int], Any]
  vocab_size: int


class _Common(NamedTuple):
  """Per-row constants shared by both loops (traced arrays)."""

  row_keys: jax.Array  # (B,) keys, or (B, 2) raw keys
  prompt_lengths: jax.Array  # (B,) int32
  stop_len: jax.Array  # (B,) int32: a row is finished once its length reaches it
  params: SamplingParams  # fields (B,) or None
  eos_id: jax.Array  # () int32, -1 for none
  room: jax.Array  # (B,) bool: the row's budget does not fit its buffer / context


class _GenerateState(NamedTuple):
  """Loop state of :func:`generate`.

  Attributes:
    tokens: int32 ``(B, max_len)`` token buffer.
    lengths: int32 ``(B,)``.
    done: bool ``(B,)``.
    cache: the target's cache.
    target_calls: int32 ``()``.
    row_calls: int32 ``(B,)``.
    error: int32 ``(B,)``.
  """

  tokens: jax.Array
  lengths: jax.Array
  done: jax.Array
  cache: Any
  target_calls: jax.Array
  row_calls: jax.Array
  error: jax.Array


class _SpecState(NamedTuple):
  """Loop state of :func:`speculative_generate` and :func:`tree_speculative_generate`.

  Attributes:
    tokens: int32 ``(B, max_len)`` token buffer.
    lengths: int32 ``(B,)``.
    done: bool ``(B,)``.
    target_cache: the target's cache.
    draft_cache: the draft model's cache (``None`` for prompt lookup).
    target_calls: int32 ``()``.
    draft_calls: int32 ``()``.
    row_calls: int32 ``(B,)``.
    proposals: int32 ``(B,)``.
    accepted: int32 ``(B,)``.
    proposed_at: int32 ``(B, gamma)`` (``(B, depth)`` for a tree).
    accepted_at: int32 ``(B, gamma)`` (``(B, depth)`` for a tree).
    error: int32 ``(B,)``.
  """

  tokens: jax.Array
  lengths: jax.Array
  done: jax.Array
  target_cache: Any
  draft_cache: Any
  target_calls: jax.Array
  draft_calls: jax.Array
  row_calls: jax.Array
  proposals: jax.Array
  accepted: jax.Array
  proposed_at: jax.Array
  accepted_at: jax.Array
  error: jax.Array


# ---------------------------------------------------------------------------------------------
# Host-side argument handling (runs once per call, outside jit).


def _fns(model: Model, name: str, arg: str) -> _Fns:
  if not isinstance(model, Model):
    raise TypeError(
      f"{name}: `{arg}` must be a specdec_jax.models.Model, got {type(model).__name__} instead."
    )
  return _Fns(model.apply, model.init_cache, int(model.vocab_size))


def _check_prompt(prompt_tokens, prompt_lengths, name: str, vocab: int):
  """Shapes and dtypes always; values when the host can read them (raise), else flagged in jit."""
  prompt_tokens = jnp.asarray(host_array(name, "prompt_tokens", prompt_tokens, INT))
  prompt_lengths = jnp.asarray(host_array(name, "prompt_lengths", prompt_lengths, INT))
  if prompt_tokens.ndim != 2 or prompt_tokens.shape[1] < 1:
    raise ValueError(
      f"{name}: `prompt_tokens` must have shape (B, P) with P >= 1, got "
      f"{tuple(prompt_tokens.shape)} instead."
    )
  if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
    raise TypeError(f"{name}: `prompt_tokens` must be integer, got {prompt_tokens.dtype} instead.")
  batch, width = prompt_tokens.shape
  if prompt_lengths.shape != (batch,) or not jnp.issubdtype(prompt_lengths.dtype, jnp.integer):
    raise ValueError(
      f"{name}: `prompt_lengths` must be an integer array of shape (B,) = ({batch},), got "
      f"{prompt_lengths.dtype}{tuple(prompt_lengths.shape)} instead."
    )
  if is_concrete(prompt_lengths):
    lengths = np.asarray(prompt_lengths)
    if lengths.size and not ((lengths >= 1).all() and (lengths <= width).all()):
      raise ValueError(
        f"{name}: `prompt_lengths` must be in [1, P] = [1, {width}], got {lengths.tolist()} "
        "instead."
      )
    if is_concrete(prompt_tokens):
      tokens = np.asarray(prompt_tokens)
      real = np.arange(width)[None, :] < lengths[:, None]
      bad = real & ((tokens < 0) | (tokens >= vocab))
      if bad.any():
        row, col = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
          f"{name}: `prompt_tokens` ids must be in [0, V) = [0, {vocab}) within each row's "
          f"length, got {int(tokens[row, col])} at (row {row}, position {col})."
        )
  # Compare in the tokens' own dtype before the int32 cast, so nothing wraps into range.
  tokens_ok = (prompt_tokens >= 0) & (prompt_tokens < vocab)
  return prompt_tokens.astype(jnp.int32), prompt_lengths.astype(jnp.int32), tokens_ok


def _row_keys(key, batch: int, name: str) -> jax.Array:
  """One key per row: ``split(key, B)`` for a single key, or ``key`` itself if it has B rows."""
  key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
  typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
  single_ndim = 0 if typed else 1
  if key.ndim == single_ndim:
    return jax.random.split(key, batch)
  if key.ndim == single_ndim + 1 and key.shape[0] == batch:
    return key
  raise ValueError(
    f"{name}: `key` must be one key or a batch of B = {batch} keys, got shape "
    f"{tuple(key.shape)} ({key.dtype}) instead."
  )


def _batch_params(params: SamplingParams, batch: int, name: str) -> SamplingParams:
  """Check (:func:`~specdec_jax._logits.check_params`) and broadcast every field to ``(B,)``."""
  check_params(params, name, batch)
  dtypes = {"temperature": jnp.float32, "top_k": jnp.int32, "top_p": jnp.float32}
  fields = {}
  for field, value in zip(params._fields, params, strict=True):
    if value is None:
      fields[field] = None
      continue
    array = jnp.asarray(value)
    if field == "top_k":  # clip in its own dtype before the cast (no wrap-around)
      array = jnp.clip(array, -1, np.iinfo(np.int32).max)
    fields[field] = jnp.broadcast_to(array.astype(dtypes[field]), (batch,))
  return SamplingParams(**fields)


def _check_budget(max_new_tokens, max_len, width: int, lengths, name: str,
                  contexts: tuple[tuple[str, int | None], ...]) -> tuple[int, int | None]:
  """``(max_len, context)``: the static buffer length and the models' context (``None``: none).

  A row needs ``length + max_new_tokens`` slots; with concrete lengths a budget that does
  not fit the buffer or a model's context raises, with traced lengths the rows that run out
  of room stop early and are flagged ``OUT_OF_ROOM``.
  """
  if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer)
      or max_new_tokens < 1):
    raise ValueError(f"{name}: `max_new_tokens` must be an int >= 1, got {max_new_tokens!r}.")
  if max_len is None:
    max_len = width + int(max_new_tokens)
  elif isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < width:
    raise ValueError(
      f"{name}: `max_len` must be an int >= P = {width} (the prompt width), got {max_len!r} "
      "instead."
    )
  known = [(arg, int(c)) for arg, c in contexts if c is not None]
  context = min((c for _, c in known), default=None)
  if is_concrete(lengths):
    need = int(np.max(np.asarray(lengths))) + int(max_new_tokens)
    if need > max_len:
      raise ValueError(
        f"{name}: `max_len` = {max_len} has no room for the longest prompt plus "
        f"`max_new_tokens` = {need} tokens; pass max_len >= {need} (or None)."
      )
    for arg, c in known:
      if need > c:
        raise ValueError(
          f"{name}: the longest prompt plus `max_new_tokens` is {need} tokens, more than the "
          f"{c} positions the `{arg}` model was trained for (its context_length)."
        )
  return int(max_len), context


def _eos(eos_id, name: str, vocab: int) -> jax.Array:
  if eos_id is None:
    return jnp.int32(-1)
  eos = host_array(name, "eos_id", eos_id, INT)
  if jnp.shape(eos) != ():
    raise ValueError(f"{name}: `eos_id` must be one token id, got shape {jnp.shape(eos)}.")
  if is_concrete(eos) and not 0 <= int(eos) < vocab:
    raise ValueError(
      f"{name}: `eos_id` must be a token id in [0, V) = [0, {vocab}) or None, got {eos_id!r}."
    )
  return jnp.clip(jnp.asarray(eos), -1, vocab).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Shared pieces of both loops (traced).


def _rows(batch: int) -> jax.Array:
  return jnp.arange(batch, dtype=jnp.int32)


def _ids(tokens: jax.Array, vocab: int) -> jax.Array:
  """Tokens as a model sees them: padding (``pad_id``, stale slots) clipped into ``[0, V)``."""
  return jnp.clip(tokens, 0, vocab - 1)


def _probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Processed distributions of ``(B, V)`` or ``(B, T, V)`` logits with per-row params."""
  return jax.vmap(process_logits)(logits, params)


def _uniform(key: jax.Array, shape=()) -> jax.Array:
  return jax.random.uniform(key, shape, jnp.float32)


def _prefill(fns: _Fns, model_params, prompt, prompt_lengths, cache_len: int):
  """One ``apply`` over the whole prompt; each row's logits at its own last prompt position."""
  batch, width = prompt.shape
  cache = fns.init_cache(batch, cache_len)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None], (batch, width))
  logits, cache = fns.apply(model_params, _ids(prompt, fns.vocab_size), positions, cache)
  return logits[_rows(batch), prompt_lengths - 1], cache


def _init_buffer(prompt, prompt_lengths, max_len: int, pad_id: int) -> jax.Array:
  batch, width = prompt.shape
  slots = jnp.arange(width, dtype=jnp.int32)[None]
  prompt = jnp.where(slots < prompt_lengths[:, None], prompt, jnp.int32(pad_id))
  buffer = jnp.full((batch, max_len), pad_id, jnp.int32)
  return buffer.at[:, :width].set(prompt)


def _advance(tokens, lengths, done, new, counts, common: _Common):
  """Append the first ``counts[b]`` of ``new[b]`` to each unfinished row, cut at eos / budget.

  Args:
    tokens: int32 ``(B, max_len)`` buffer.
    lengths: int32 ``(B,)``.
    done: bool ``(B,)``; finished rows are left alone.
    new: int32 ``(B, K)`` candidate tokens.
    counts: int32 ``(B,)`` how many of them are real.
    common: per-row constants.

  Returns:
    ``(tokens, lengths, done, written)`` with ``written`` int32 ``(B,)``.
  """
  width = new.shape[1]
  slots = jnp.arange(width, dtype=jnp.int32)[None]
  counts = jnp.minimum(counts, common.stop_len - lengths)
  counts = jnp.where(done, 0, jnp.maximum(counts, 0))
  is_eos = (new == common.eos_id) & (slots < counts[:, None])
  has_eos = jnp.any(is_eos, axis=1)
  counts = jnp.where(has_eos, jnp.argmax(is_eos, axis=1).astype(jnp.int32) + 1, counts)
  index = jnp.where(slots < counts[:, None], lengths[:, None] + slots, tokens.shape[1])
  tokens = tokens.at[_rows(tokens.shape[0])[:, None], index].set(new, mode="drop")
  lengths = lengths + counts
  done = done | has_eos | (lengths >= common.stop_len)
  return tokens, lengths, done, counts


def _nonfinite(probs: jax.Array) -> jax.Array:
  """``NONFINITE`` for each row ``(B, ..., V)`` whose processed distribution is NaN, else 0."""
  bad = jnp.isnan(jnp.sum(probs, axis=-1))
  return flag(bad.reshape(bad.shape[0], -1).any(axis=1), ErrorCode.NONFINITE)


def _common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id, *, max_new_tokens: int,
            max_len: int, context: int | None, vocab: int) -> tuple[_Common, jax.Array]:
  """The per-row constants of a loop and each row's error bits from its arguments.

  A row stops at ``min(length + max_new_tokens, max_len, context)``; ``room`` marks the rows
  whose budget does not fit. Bits: a prompt id outside ``[0, V)`` (TOKEN_OUT_OF_RANGE), a
  sampling parameter or ``eos_id`` out of range (BAD_PARAMS; traced values only, concrete
  ones raised on the host).
  """
  capacity = max_len if context is None else min(max_len, context)
  want = prompt_lengths + max_new_tokens
  stop_len = jnp.minimum(want, capacity)
  real = jnp.arange(prompt.shape[1], dtype=jnp.int32)[None] < prompt_lengths[:, None]
  bad_eos = (eos_id < -1) | (eos_id >= vocab)  # -1: no eos
  error = (flag(jnp.any(real & ~tokens_ok, axis=1), ErrorCode.TOKEN_OUT_OF_RANGE)
           | jax.vmap(params_error)(params) | flag(bad_eos, ErrorCode.BAD_PARAMS))
  return _Common(row_keys, prompt_lengths, stop_len, params, eos_id, want > capacity), error


def _out_of_room(error, tokens, lengths, common: _Common) -> jax.Array:
  """Add ``OUT_OF_ROOM`` to the rows that stopped at a full buffer or context, not at eos."""
  last = tokens[_rows(tokens.shape[0]), jnp.maximum(lengths - 1, 0)]
  cut = common.room & (lengths >= common.stop_len) & (last != common.eos_id)
  return error | flag(cut, ErrorCode.OUT_OF_ROOM)


def _first_token(logits, common: _Common):
  """Each row's first new token from its prefill logits (key ``fold_in(row_key, 0)``), and
  ``NONFINITE`` bits for rows whose distribution was NaN."""
  probs = _probs(logits, common.params)
  u = jax.vmap(lambda k: _uniform(jax.random.fold_in(k, 0)))(common.row_keys)
  return jax.vmap(sample_index)(probs, u)[:, None], _nonfinite(probs)


def _start(target: _Fns, target_params, prompt, common: _Common, max_len: int, cache_len: int,
           pad_id: int):
  """Prefill the target, emit the first token: ``(tokens, lengths, done, cache, error)``."""
  tokens = _init_buffer(prompt, common.prompt_lengths, max_len, pad_id)
  logits, cache = _prefill(target, target_params, prompt, common.prompt_lengths, cache_len)
  lengths = common.prompt_lengths
  done = lengths >= common.stop_len
  first, error = _first_token(logits, common)
  ones = jnp.ones_like(lengths)
  tokens, lengths, done, _ = _advance(tokens, lengths, done, first, ones, common)
  return tokens, lengths, done, cache, jnp.where(common.prompt_lengths < common.stop_len, error, 0)


def _stats(target_calls, draft_calls, row_calls, proposals, accepted, proposed_at, accepted_at,
           num_new) -> DecodeStats:
  per_call = num_new.astype(jnp.float32) / jnp.maximum(row_calls, 1).astype(jnp.float32)
  return DecodeStats(target_calls, draft_calls, row_calls, proposals, accepted, proposed_at,
                     accepted_at, num_new, per_call)


def _after_verify(s: _SpecState, result, common: _Common, *, active, target_cache, draft_cache,
                  draft_calls, proposals, depth) -> _SpecState:
  """The loop state after one verification (chain or tree) of every row.

  Appends each active row's emitted tokens (cut at eos / budget) and updates the
  counters: ``proposals`` (B,) draft tokens verified, ``depth`` (B,) how many draft
  positions (chain) or depths (tree) could be accepted this iteration.
  """
  counts = jnp.where(active, result.num_tokens, 0)
  tokens, lengths, done, _ = _advance(s.tokens, s.lengths, s.done, result.tokens, counts, common)
  accepted = jnp.where(active, result.num_accepted, 0)
  at = jnp.arange(s.proposed_at.shape[1], dtype=jnp.int32)[None]
  return _SpecState(
    tokens=tokens,
    lengths=lengths,
    done=done,
    target_cache=target_cache,
    draft_cache=draft_cache,
    target_calls=s.target_calls + 1,
    draft_calls=draft_calls,
    row_calls=s.row_calls + active.astype(jnp.int32),
    proposals=s.proposals + proposals,
    accepted=s.accepted + accepted,
    proposed_at=s.proposed_at + (at < depth[:, None]).astype(jnp.int32),
    accepted_at=s.accepted_at + (at < accepted[:, None]).astype(jnp.int32),
    error=s.error | jnp.where(active, result.error, 0),
  )


def _speculative_result(s: _SpecState, common: _Common) -> SpeculativeResult:
  num_new = s.lengths - common.prompt_lengths
  stats = _stats(s.target_calls, s.draft_calls, s.row_calls, s.proposals, s.accepted,
                 s.proposed_at, s.accepted_at, num_new)
  error = _out_of_room(s.error, s.tokens, s.lengths, common)
  return SpeculativeResult(s.tokens, s.lengths, num_new, stats, error)


# ---------------------------------------------------------------------------------------------
# Plain autoregressive decoding.


def _generate_impl(target_params, prompt, prompt_lengths, tokens_ok, row_keys, params, eos_id, *,
                   target: _Fns, max_new_tokens: int, max_len: int, context: int | None,
                   pad_id: int):
  batch = prompt.shape[0]
  rows = _rows(batch)
  common, error = _common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id,
                          max_new_tokens=max_new_tokens, max_len=max_len, context=context,
                          vocab=target.vocab_size)
  tokens, lengths, done, cache, first_error = _start(target, target_params, prompt, common,
                                                     max_len, max_len, pad_id)
  zero = jnp.int32(0)
  state = _GenerateState(tokens, lengths, done, cache, zero + 1,
                         (prompt_lengths < common.stop_len).astype(jnp.int32),
                         error | first_error)

  def cond(s: _GenerateState):
    return jnp.any(~s.done) & (s.target_calls <= max_new_tokens)

  def body(s: _GenerateState):
    last = s.lengths - 1
    inputs = _ids(s.tokens[rows, last], target.vocab_size)[:, None]
    logits, cache = target.apply(target_params, inputs, last[:, None], s.cache)
    probs = _probs(logits[:, 0], params)
    num_new = s.lengths - prompt_lengths
    u = jax.vmap(lambda k, n: _uniform(jax.random.fold_in(k, n)))(row_keys, num_new)
    new = jax.vmap(sample_index)(probs, u)[:, None]
    active = ~s.done
    tokens, lengths, done, _ = _advance(s.tokens, s.lengths, s.done, new,
                                        jnp.ones_like(s.lengths), common)
    return _GenerateState(tokens, lengths, done, cache, s.target_calls + 1,
                          s.row_calls + active.astype(jnp.int32),
                          s.error | jnp.where(active, _nonfinite(probs), 0))

  s = lax.while_loop(cond, body, state)
  num_new = s.lengths - prompt_lengths
  empty = jnp.zeros((batch, 0), jnp.int32)
  stats = _stats(s.target_calls, zero, s.row_calls, jnp.zeros_like(num_new),
                 jnp.zeros_like(num_new), empty, empty, num_new)
  return GenerateResult(s.tokens, s.lengths, num_new, stats,
                        _out_of_room(s.error, s.tokens, s.lengths, common))


_generate_jit = jax.jit(
  _generate_impl, static_argnames=("target", "max_new_tokens", "max_len", "context", "pad_id"))


def generate(model: Model, prompt_tokens: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
             *, max_new_tokens: int, params: SamplingParams = SamplingParams(),
             eos_id: int | None = None, max_len: int | None = None,
             pad_id: int = -1) -> GenerateResult:
  """Plain autoregressive decoding: one target call per token, as one jitted while loop.

  The prompt is prefilled with one ``apply`` call (``T = P``, positions ``0 .. P - 1``;
  right padding is fine, each row's padding slots are overwritten before they are
  read) and the first token is sampled from each row's logits at its own last prompt
  position. Then a ``lax.while_loop`` feeds each row's last token and samples the next
  from ``process_logits(logits, params)`` by inverse CDF
  (:func:`~specdec_jax.sample_index`; ``temperature == 0`` is greedy). Row ``b``'s
  ``n``-th new token (from 0) uses the uniform ``uniform(fold_in(row_key[b], n))``, so
  a row's output does not depend on the rest of the batch. A row stops after
  ``max_new_tokens`` new tokens, after emitting ``eos_id``, or when the buffer is full.

  Args:
    model: the target :class:`Model`. Its ``apply``/``init_cache`` are static: reuse
      the same functions to reuse the compiled loop.
    prompt_tokens: int ``(B, P)`` right-padded prompts.
    prompt_lengths: int ``(B,)`` in ``[1, P]``.
    key: one ``jax.random`` key (split into one per row) or ``B`` keys, one per row.
    max_new_tokens: static int ``>= 1``.
    params: :class:`~specdec_jax.SamplingParams`; each field a scalar or ``(B,)``.
    eos_id: optional token id that ends a row (it is kept in the output).
    max_len: static buffer and cache length, ``>= P``; default ``P + max_new_tokens``.
    pad_id: static int written after each row's last token.

  Returns:
    :class:`GenerateResult` with ``tokens`` ``(B, max_len)``, ``lengths``, ``num_new``
    ``(B,)`` and :class:`DecodeStats`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from specdec_jax import SamplingParams
    >>> from specdec_jax.models.toy import make_toy_model
    >>> model = make_toy_model(jax.random.key(0), vocab_size=8)
    >>> out = generate(model, jnp.array([[1, 2, 3], [4, 0, 0]]), jnp.array([3, 1]),
    ...                jax.random.key(1), max_new_tokens=4, params=SamplingParams(0.0))
    >>> out.num_new.tolist(), out.lengths.tolist(), int(out.stats.target_calls)
    ([4, 4], [7, 5], 4)

  Reference:
    Radford et al., "Language Models are Unsupervised Multitask Learners", 2019
    (autoregressive sampling); Holtzman et al. 2020, arXiv:1904.09751 (top-p).
  """
  name = "generate"
  fns = _fns(model, name, "model")
  prompt, lengths, tokens_ok = _check_prompt(prompt_tokens, prompt_lengths, name, fns.vocab_size)
  batch, width = prompt.shape
  max_len, context = _check_budget(max_new_tokens, max_len, width, lengths, name,
                                   (("model", model.context_length),))
  return _generate_jit(model.params, prompt, lengths, tokens_ok, _row_keys(key, batch, name),
                       _batch_params(params, batch, name), _eos(eos_id, name, fns.vocab_size),
                       target=fns, max_new_tokens=int(max_new_tokens), max_len=max_len,
                       context=context, pad_id=int(pad_id))


# ---------------------------------------------------------------------------------------------
# Drafts.


def _propose_model(draft: _Fns, draft_params, cache, tokens, lengths, step_keys, params,
                   *, gamma: int, cache_len: int):
  """``gamma`` proposals from a draft model: one ``T = 2`` sync call, then ``gamma - 1`` steps.

  The draft has processed every token before position ``L - 2`` (after a full
  acceptance the last two tokens are new to it, after a rejection only the last), so
  it is fed the tokens at ``L - 2`` and ``L - 1``. For ``L = 1`` both inputs are the
  token at position 0 (the slot is written twice with the same token).

  Returns:
    ``(draft (B, gamma) int32, q (B, gamma, V), cache)``.
  """
  batch = tokens.shape[0]
  rows = _rows(batch)
  last = lengths - 1
  positions = jnp.stack([jnp.maximum(last - 1, 0), last], axis=1)
  positions = jnp.clip(positions, 0, cache_len - 1)
  sync = tokens[rows[:, None], positions]
  logits, cache = draft.apply(draft_params, _ids(sync, draft.vocab_size), positions, cache)

  def sample(j, logits):
    keys = jax.vmap(lambda k: jax.random.fold_in(k, j))(step_keys)
    return jax.vmap(sample_draft)(keys, logits, params)

  first = sample(0, logits[:, -1])

  def step(carry, j):
    token, position, cache = carry
    position = jnp.minimum(position + 1, cache_len - 1)
    logits, cache = draft.apply(draft_params, token[:, None], position[:, None], cache)
    out = sample(j, logits[:, 0])
    return (out.token, position, cache), out

  (_, _, cache), rest = lax.scan(step, (first.token, last, cache),
                                 jnp.arange(1, gamma, dtype=jnp.int32))
  draft_tokens = jnp.concatenate([first.token[:, None], jnp.swapaxes(rest.token, 0, 1)], axis=1)
  q = jnp.concatenate([first.probs[:, None], jnp.swapaxes(rest.probs, 0, 1)], axis=1)
  return draft_tokens, q, cache


def _lookup_row(row: jax.Array, length: jax.Array, spec: PromptLookup, gamma: int) -> jax.Array:
  """Prompt-lookup proposals for one row ``(max_len,)`` of length ``length``: ``(gamma,)``.

  For the longest ``n`` with a match, the most recent start ``s`` with
  ``row[s : s + n] == row[L - n : L]`` and ``s + n <= L - 1`` gives the period
  ``d = L - n - s``; the proposals are ``row[L - d + (j mod d)]``, i.e. the tokens that
  followed the match, repeated with the period if fewer than ``gamma`` follow. No
  match: ``d = 1``, the last token repeated. All comparisons are vectorised over the row.
  """
  size = row.shape[0]
  starts = jnp.arange(size, dtype=jnp.int32)
  period = jnp.int32(1)
  found = jnp.asarray(False)
  for n in range(spec.max_ngram, spec.min_ngram - 1, -1):
    match = (starts + n <= length - 1) & (length - n >= 0)
    for k in range(n):
      suffix = row[jnp.clip(length - n + k, 0, size - 1)]
      match = match & (row[jnp.clip(starts + k, 0, size - 1)] == suffix)
    start = jnp.max(jnp.where(match, starts, -1))
    take = ~found & (start >= 0)
    period = jnp.where(take, length - n - start, period)
    found = found | take
  j = jnp.arange(gamma, dtype=jnp.int32)
  return row[jnp.clip(length - period + j % period, 0, size - 1)]


def _propose_lookup(spec: PromptLookup, tokens, lengths, *, gamma: int, vocab: int):
  """Prompt-lookup proposals with point-mass ``q``: ``(draft (B, gamma), q (B, gamma, V))``."""
  draft = jax.vmap(_lookup_row, in_axes=(0, 0, None, None))(tokens, lengths, spec, gamma)
  draft = _ids(draft, vocab)
  return draft, jax.nn.one_hot(draft, vocab, dtype=jnp.float32)


# ---------------------------------------------------------------------------------------------
# Speculative decoding.


def _speculative_impl(target_params, draft_params, prompt, prompt_lengths, tokens_ok, row_keys,
                      params, eos_id, *, target: _Fns, draft: _Fns | PromptLookup,
                      verifier: Verifier, gamma: int, max_new_tokens: int, max_len: int,
                      context: int | None, pad_id: int):
  batch = prompt.shape[0]
  rows = _rows(batch)
  vocab = target.vocab_size
  cache_len = max_len + gamma  # positions fed never pass L - 1 + gamma <= max_len + gamma - 1
  common, error = _common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id,
                          max_new_tokens=max_new_tokens, max_len=max_len, context=context,
                          vocab=vocab)
  stop_len = common.stop_len
  tokens, lengths, done, target_cache, first_error = _start(target, target_params, prompt, common,
                                                            max_len, cache_len, pad_id)
  zero = jnp.int32(0)
  is_model = isinstance(draft, _Fns)
  if is_model:
    _, draft_cache = _prefill(draft, draft_params, prompt, prompt_lengths, cache_len)
    draft_calls = zero + 1
  else:
    draft_cache, draft_calls = None, zero
  counts = jnp.zeros((batch,), jnp.int32)
  at = jnp.zeros((batch, gamma), jnp.int32)
  state = _SpecState(tokens, lengths, done, target_cache, draft_cache, zero + 1, draft_calls,
                     (prompt_lengths < stop_len).astype(jnp.int32), counts, counts, at, at,
                     error | first_error)
  slots = jnp.arange(gamma + 1, dtype=jnp.int32)

  def cond(s: _SpecState):
    return jnp.any(~s.done) & (s.target_calls <= max_new_tokens)

  def body(s: _SpecState):
    active = ~s.done
    last = s.lengths - 1
    # Never propose past the budget: then the verifier emits at most `stop_len - L` tokens.
    num_draft = jnp.where(active, jnp.clip(common.stop_len - s.lengths - 1, 0, gamma), 0)
    step_keys = jax.vmap(jax.random.fold_in)(row_keys, s.row_calls)
    if is_model:
      draft_tokens, q, draft_cache = _propose_model(
        draft, draft_params, s.draft_cache, s.tokens, s.lengths, step_keys, params, gamma=gamma,
        cache_len=cache_len)
      draft_calls = s.draft_calls + gamma
    else:
      draft_tokens, q = _propose_lookup(draft, s.tokens, s.lengths, gamma=gamma, vocab=vocab)
      draft_cache, draft_calls = s.draft_cache, s.draft_calls

    # One target call scores the last token and the gamma proposals.
    inputs = jnp.concatenate([s.tokens[rows, last][:, None], draft_tokens], axis=1)
    positions = jnp.clip(last[:, None] + slots[None], 0, cache_len - 1)
    logits, target_cache = target.apply(target_params, _ids(inputs, vocab), positions,
                                        s.target_cache)
    p = _probs(logits, params)
    uniforms = jax.vmap(lambda k: _uniform(jax.random.fold_in(k, gamma), (gamma + 1,)))(step_keys)
    result = jax.vmap(verifier)(p, q, draft_tokens, uniforms, num_draft=num_draft)

    return _after_verify(s, result, common, active=active, target_cache=target_cache,
                         draft_cache=draft_cache, draft_calls=draft_calls, proposals=num_draft,
                         depth=num_draft)

  return _speculative_result(lax.while_loop(cond, body, state), common)


_speculative_jit = jax.jit(
  _speculative_impl,
  static_argnames=("target", "draft", "verifier", "gamma", "max_new_tokens", "max_len", "context",
                   "pad_id"),
)


def speculative_generate(target: Model, draft: Draft, prompt_tokens: jax.Array,
                         prompt_lengths: jax.Array, key: jax.Array, *, gamma: int,
                         max_new_tokens: int, params: SamplingParams = SamplingParams(),
                         eos_id: int | None = None, max_len: int | None = None,
                         verifier: str | Verifier = "token",
                         pad_id: int = -1) -> SpeculativeResult:
  """Exact speculative decoding of a batch, as one jitted ``lax.while_loop`` with fixed shapes.

  The target prefills the prompt and samples each row's first token as
  :func:`generate` does (same key use, so the first token is the same). Then each
  iteration, for every unfinished row of length ``L``:

  1. the draft proposes ``gamma`` tokens and the distributions ``q`` they were drawn
     from: a draft :class:`Model` samples with :func:`~specdec_jax.sample_draft` under
     the same ``params`` (its cache is synced by feeding the tokens at ``L - 2, L - 1``,
     then ``gamma - 1`` single steps); :class:`PromptLookup` proposes from n-gram
     matches with point-mass ``q`` and calls no model;
  2. the target scores the token at ``L - 1`` and the proposals in ONE ``apply``
     (``T = gamma + 1``, positions ``L - 1 .. L + gamma - 1``), giving ``p`` via
     :func:`~specdec_jax.process_logits`;
  3. ``jax.vmap(verifier)`` keeps a prefix of the proposals plus one token, and the
     row grows by that many (cut after ``eos_id``). Only
     ``num_draft = min(gamma, max_new_tokens - emitted - 1)`` proposals are verified,
     so a row never overshoots ``max_new_tokens``. Rejected positions are rolled back
     by the length alone: the caches' stale slots are overwritten before being read.

  The output is distributed exactly as :func:`generate`'s (the target's processed
  distribution), for any draft; ``temperature == 0`` gives the greedy sequence token
  for token. Each row draws its randomness from its own key and its own iteration
  count (``fold_in(row_key, i)``: draft step ``j`` uses ``fold_in(., j)``, the
  verifier's ``gamma + 1`` uniforms ``fold_in(., gamma)``), so a row's output does not
  depend on the rest of the batch.

  Args:
    target: the target :class:`Model`.
    draft: a draft :class:`Model` with the target's vocabulary (a small model, or the
      target with layers skipped: self-speculation), or :class:`PromptLookup`.
    prompt_tokens: int ``(B, P)`` right-padded prompts.
    prompt_lengths: int ``(B,)`` in ``[1, P]``.
    key: one ``jax.random`` key (split into one per row) or ``B`` keys, one per row.
    gamma: static int ``>= 1``, proposals per iteration.
    max_new_tokens: static int ``>= 1``.
    params: :class:`~specdec_jax.SamplingParams` for both draft and target; each field
      a scalar or ``(B,)``.
    eos_id: optional token id that ends a row (kept in the output).
    max_len: static buffer length, ``>= P``; default ``P + max_new_tokens``. The
      caches have ``max_len + gamma`` slots.
    verifier: ``"token"`` (:func:`~specdec_jax.verify`) or a function with
      :func:`~specdec_jax.verify`'s signature ``(p, q, draft, uniforms, *, num_draft)
      -> VerifyResult`` for one sequence (static: pass the same object to reuse the
      compiled loop).
    pad_id: static int written after each row's last token.

  Returns:
    :class:`SpeculativeResult`: ``tokens`` ``(B, max_len)``, ``lengths``, ``num_new``
    ``(B,)``, :class:`DecodeStats` and the verifier's ``error`` bits per row.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from specdec_jax import SamplingParams
    >>> from specdec_jax.models.toy import make_toy_model
    >>> target = make_toy_model(jax.random.key(0), vocab_size=8)
    >>> small = make_toy_model(jax.random.key(1), vocab_size=8, context=1)
    >>> prompt, lengths = jnp.array([[1, 2, 3], [4, 0, 0]]), jnp.array([3, 1])
    >>> greedy = SamplingParams(temperature=0.0)
    >>> plain = generate(target, prompt, lengths, jax.random.key(2), max_new_tokens=6,
    ...                  params=greedy)
    >>> fast = speculative_generate(target, small, prompt, lengths, jax.random.key(2), gamma=3,
    ...                             max_new_tokens=6, params=greedy)
    >>> bool((fast.tokens == plain.tokens).all()), fast.num_new.tolist()
    (True, [6, 6])
    >>> lookup = speculative_generate(target, PromptLookup(), prompt, lengths,
    ...                               jax.random.key(2), gamma=3, max_new_tokens=6, params=greedy)
    >>> bool((lookup.tokens == plain.tokens).all()), int(lookup.stats.draft_calls)
    (True, 0)

  Reference:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
    Decoding", ICML 2023, arXiv:2211.17192; Chen et al., "Accelerating Large Language
    Model Decoding with Speculative Sampling", arXiv:2302.01318; Zhang et al., "Draft &
    Verify: Lossless Large Language Model Acceleration via Self-Speculative Decoding",
    arXiv:2309.08168; Saxena 2023 (prompt lookup decoding); Yang et al. 2023 (LLMA),
    arXiv:2304.04487.
  """
  name = "speculative_generate"
  target_fns = _fns(target, name, "target")
  if isinstance(draft, PromptLookup):
    if not 1 <= draft.min_ngram <= draft.max_ngram:
      raise ValueError(
        f"{name}: PromptLookup needs 1 <= min_ngram <= max_ngram, got min_ngram = "
        f"{draft.min_ngram}, max_ngram = {draft.max_ngram} instead."
      )
    draft_static, draft_params = PromptLookup(int(draft.max_ngram), int(draft.min_ngram)), None
  else:
    draft_static, draft_params = _fns(draft, name, "draft"), draft.params
    if draft_static.vocab_size != target_fns.vocab_size:
      raise ValueError(
        f"{name}: the draft must share the target's vocabulary, got V = "
        f"{draft_static.vocab_size} for the draft and V = {target_fns.vocab_size} for the target."
      )
  if isinstance(verifier, str):
    if verifier not in VERIFIERS:
      raise ValueError(
        f"{name}: `verifier` must be one of {sorted(VERIFIERS)} or a function, got "
        f"{verifier!r} instead."
      )
    verifier = VERIFIERS[verifier]
  elif not callable(verifier):
    raise TypeError(f"{name}: `verifier` must be a name or a function, got {verifier!r}.")
  if not isinstance(gamma, int | np.integer) or gamma < 1:
    raise ValueError(f"{name}: `gamma` must be an int >= 1, got {gamma!r} instead.")
  vocab = target_fns.vocab_size
  prompt, lengths, tokens_ok = _check_prompt(prompt_tokens, prompt_lengths, name, vocab)
  batch, width = prompt.shape
  contexts = (("target", target.context_length),
              ("draft", None if isinstance(draft, PromptLookup) else draft.context_length))
  max_len, context = _check_budget(max_new_tokens, max_len, width, lengths, name, contexts)
  return _speculative_jit(target.params, draft_params, prompt, lengths, tokens_ok,
                          _row_keys(key, batch, name), _batch_params(params, batch, name),
                          _eos(eos_id, name, vocab), target=target_fns, draft=draft_static,
                          verifier=verifier, gamma=int(gamma),
                          max_new_tokens=int(max_new_tokens), max_len=max_len, context=context,
                          pad_id=int(pad_id))


# ---------------------------------------------------------------------------------------------
# Tree drafts.

#: Tree drafting laws of :func:`tree_speculative_generate`.
TREE_LAWS = ("deterministic", "iid")


class DraftTree(NamedTuple):
  """The static shape of a draft tree: for each node, its parent and which candidate it is.

  Node 0 is the root (the last accepted token). Node ``c >= 1`` holds the
  ``ranks[c]``-th candidate for the position after its parent ``parents[c]``: under
  the ``"deterministic"`` law the ``(ranks[c] + 1)``-th most likely token of the
  draft model (a top-k tree, as in EAGLE-2), under ``"iid"`` the ``ranks[c]``-th of
  independent samples from the draft's distribution (SpecInfer). Nodes are in
  breadth-first order (depths never decrease) and the children of a node carry the
  ranks ``0, 1, 2, ...`` in index order. Build one with :meth:`from_paths` or
  :meth:`from_branching`; the tuples make it hashable (a static argument).

  Attributes:
    parents: ``(N,)`` ints, ``parents[0] == -1``, ``0 <= parents[c] < c``.
    ranks: ``(N,)`` ints, ``ranks[0] == 0``.

  Example:
    >>> tree = DraftTree.from_branching((2, 1))
    >>> tree.parents, tree.ranks, tree.depth
    ((-1, 0, 0, 1, 2), (0, 0, 1, 0, 0), 2)
    >>> DraftTree.from_paths([(0,), (1,), (0, 0)]).parents
    (-1, 0, 0, 1)
  """

  parents: tuple[int, ...]
  ranks: tuple[int, ...]

  @classmethod
  def from_paths(cls, paths) -> DraftTree:
    """A tree from the rank paths of its non-root nodes (Medusa's and EAGLE's "choices").

    ``(0, 1)`` is the second candidate after the first candidate. Every prefix of a
    path must be a path too, and a node's children must use the ranks ``0 .. k - 1``.
    """
    paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks = [-1], [0]
    for path in paths:
      if not path or min(path) < 0:
        raise ValueError(f"DraftTree.from_paths: paths must be non-empty tuples of ranks >= 0, "
                         f"got {path!r}.")
      if path[:-1] not in index:
        raise ValueError(f"DraftTree.from_paths: the prefix {path[:-1]!r} of {path!r} is missing.")
      if path[-1] > 0 and (*path[:-1], path[-1] - 1) not in index:
        raise ValueError(f"DraftTree.from_paths: {path!r} needs its sibling "
                         f"{(*path[:-1], path[-1] - 1)!r} (ranks 0 .. k - 1).")
      index[path] = len(parents)
      parents.append(index[path[:-1]])
      ranks.append(path[-1])
    return cls(tuple(parents), tuple(ranks))

  @classmethod
  def from_branching(cls, branching) -> DraftTree:
    """The full tree with ``branching[d]`` children per node at depth ``d``.

    ``(4, 2, 1)``: 4 candidates after the root, 2 after each of those, then 1 more
    each: ``1 + 4 + 8 + 8 = 21`` nodes, depth 3. ``(1,) * gamma`` is a chain.
    """
    branching = tuple(int(b) for b in branching)
    if any(b < 1 for b in branching):
      raise ValueError(f"DraftTree.from_branching: expected counts >= 1, got {branching}.")
    level, paths = [()], []
    for width in branching:
      level = [(*p, r) for p in level for r in range(width)]
      paths.extend(level)
    return cls.from_paths(paths)

  @property
  def size(self) -> int:
    """``N``, the number of nodes, root included."""
    return len(self.parents)

  @property
  def depth(self) -> int:
    """The most draft tokens one iteration can accept."""
    return int(self.depths().max())

  def depths(self) -> np.ndarray:
    """int32 ``(N,)``: the depth of each node (the root has depth 0)."""
    depths = np.zeros(self.size, np.int32)
    for c in range(1, self.size):
      depths[c] = depths[self.parents[c]] + 1
    return depths

  def ancestors(self) -> np.ndarray:
    """bool ``(N, N)``: ``[c, j]`` is True when ``j`` is ``c`` or one of its ancestors."""
    mask = np.eye(self.size, dtype=bool)
    for c in range(1, self.size):
      mask[c] |= mask[self.parents[c]]
    return mask


def _check_draft_tree(tree: DraftTree, name: str) -> DraftTree:
  if not isinstance(tree, DraftTree):
    raise TypeError(f"{name}: `tree` must be a DraftTree, got {type(tree).__name__} instead.")
  parents = tuple(int(x) for x in tree.parents)
  ranks = tuple(int(x) for x in tree.ranks)
  if len(parents) != len(ranks) or not parents or parents[0] != -1 or ranks[0] != 0:
    raise ValueError(f"{name}: `tree` needs parents and ranks of equal length N >= 1 with "
                     f"parents[0] = -1 and ranks[0] = 0, got {tree!r}.")
  tree = DraftTree(parents, ranks)
  depths = [0] * len(parents)
  children: dict[int, int] = {}
  for c in range(1, len(parents)):
    if not 0 <= parents[c] < c:
      raise ValueError(f"{name}: `tree.parents[{c}]` must be in [0, {c}), got {parents[c]}.")
    depths[c] = depths[parents[c]] + 1
    if depths[c] < depths[c - 1]:
      raise ValueError(f"{name}: `tree` nodes must be in breadth-first order; node {c} has depth "
                       f"{depths[c]} after a node of depth {depths[c - 1]}.")
    expected = children.get(parents[c], 0)
    if ranks[c] != expected:
      raise ValueError(f"{name}: `tree.ranks[{c}]` must be {expected} (the children of node "
                       f"{parents[c]} take ranks 0, 1, ... in order), got {ranks[c]}.")
    children[parents[c]] = expected + 1
  return tree


def _tree_candidates(logits, key, params, width: int, law: str):
  """``width`` candidate tokens after one node and the law they follow: ``(ids (width,), q (V,))``.

  ``"deterministic"``: the top-``width`` tokens of the draft's raw logits (ties to the
  lower id), whatever ``params``; ``"iid"``: ``width`` independent inverse-CDF samples
  from the draft's processed distribution.
  """
  q = process_logits(logits, params)
  if law == "deterministic":
    return lax.top_k(logits, width)[1].astype(jnp.int32), q
  u = _uniform(key, (width,))
  return jax.vmap(sample_index, in_axes=(None, 0))(q, u), q


def _tree_impl(target_params, draft_params, prompt, prompt_lengths, tokens_ok, row_keys, params,
               eos_id, *, target: _Fns, draft: _Fns, tree: DraftTree, law: str, tree_verifier,
               max_new_tokens: int, max_len: int, context: int | None, pad_id: int):
  batch = prompt.shape[0]
  rows = _rows(batch)
  vocab = target.vocab_size
  size, depth = tree.size, tree.depth
  parents = np.asarray(tree.parents, np.int32)
  ranks = np.asarray(tree.ranks, np.int32)
  depths = tree.depths()
  mask = jnp.asarray(tree.ancestors())
  width = max(1, int(ranks.max()) + 1)  # candidates drafted per node
  need_q = law != "deterministic" or tree_verifier is not _default_tree_verifier(law, depth)
  levels = [np.flatnonzero(depths == d).astype(np.int32) for d in range(depth + 1)]
  # Nodes of depth <= d are a prefix (breadth-first order): num_nodes for a depth budget d.
  level_end = jnp.asarray([int((depths <= d).sum()) for d in range(depth + 1)], jnp.int32)
  cache_len = max_len + size - 1  # tree slots reach root + N - 1 <= max_len + N - 2
  common, error = _common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id,
                          max_new_tokens=max_new_tokens, max_len=max_len, context=context,
                          vocab=vocab)
  stop_len = common.stop_len
  tokens, lengths, done, target_cache, first_error = _start(target, target_params, prompt, common,
                                                            max_len, cache_len, pad_id)
  _, draft_cache = _prefill(draft, draft_params, prompt, prompt_lengths, cache_len)
  zero = jnp.int32(0)
  counts = jnp.zeros((batch,), jnp.int32)
  at = jnp.zeros((batch, depth), jnp.int32)
  state = _SpecState(tokens, lengths, done, target_cache, draft_cache, zero + 1, zero + 1,
                     (prompt_lengths < stop_len).astype(jnp.int32), counts, counts, at, at,
                     error | first_error)
  slots = jnp.arange(depth, dtype=jnp.int32)
  all_nodes = jnp.arange(size, dtype=jnp.int32)
  candidates = jax.vmap(jax.vmap(_tree_candidates, in_axes=(0, 0, None, None, None)),
                        in_axes=(0, 0, 0, None, None))

  def cond(s: _SpecState):
    return jnp.any(~s.done) & (s.target_calls <= max_new_tokens)

  def body(s: _SpecState):
    active = ~s.done
    root = s.lengths - 1  # slot and position of node 0
    budget = jnp.where(active, jnp.clip(common.stop_len - s.lengths - 1, 0, depth), 0)
    num_nodes = level_end[budget]
    step_keys = jax.vmap(jax.random.fold_in)(row_keys, s.row_calls)
    node_keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 1), size))(step_keys)

    # Draft the tree level by level: a T = 2 sync call gives the root's candidates, then
    # one tree-attention call per level gives the candidates after each of its nodes.
    node_tokens = jnp.zeros((batch, size), jnp.int32).at[:, 0].set(s.tokens[rows, root])
    # The point-mass rule never reads q: then no draft distribution is materialised.
    q = jnp.zeros((batch, size, vocab), jnp.float32) if need_q else None
    sync = jnp.clip(jnp.stack([jnp.maximum(root - 1, 0), root], axis=1), 0, cache_len - 1)
    logits, draft_cache = draft.apply(draft_params, _ids(s.tokens[rows[:, None], sync], vocab),
                                      sync, s.draft_cache)
    ids, q_root = candidates(logits[:, -1:], node_keys[:, :1], params, width, law)
    cands = jnp.zeros((batch, size, width), jnp.int32).at[:, :1].set(ids)
    q = q.at[:, :1].set(q_root) if need_q else None
    for d in range(1, depth + 1):
      level = levels[d]
      node_tokens = node_tokens.at[:, level].set(cands[:, parents[level], ranks[level]])
      if d < depth:  # the deepest level's candidates are never needed
        positions = jnp.broadcast_to((root + d)[:, None], (batch, len(level)))
        logits, draft_cache = draft.tree_apply(
          draft_params, node_tokens[:, level], jnp.clip(positions, 0, cache_len - 1),
          draft_cache, root, jnp.asarray(level), mask[level])
        ids, q_level = candidates(logits, node_keys[:, level], params, width, law)
        cands = cands.at[:, level].set(ids)
        q = q.at[:, level].set(q_level) if need_q else None

    # One target call scores every node with tree attention.
    positions = jnp.clip(root[:, None] + jnp.asarray(depths)[None], 0, cache_len - 1)
    logits, target_cache = target.tree_apply(target_params, _ids(node_tokens, vocab), positions,
                                             s.target_cache, root, all_nodes, mask)
    p = _probs(logits, params)
    uniforms = jax.vmap(lambda k: _uniform(jax.random.fold_in(k, 0), (size,)))(step_keys)
    tree_parents = jnp.asarray(parents)
    result = jax.vmap(lambda p, q, t, u, n: tree_verifier(p, q, tree_parents, t, u, num_nodes=n))(
      p, p if q is None else q, node_tokens, uniforms, num_nodes)

    accepted = jnp.where(active, result.num_accepted, 0)
    # Move the accepted path from its tree slots to the slots of its positions.
    dst = jnp.clip(root[:, None] + 1 + slots[None], 0, cache_len - 1)
    src = jnp.where(slots[None] < accepted[:, None], root[:, None] + result.path[:, :depth], dst)
    src = jnp.clip(src, 0, cache_len - 1)
    target_cache = target.copy_slots(target_cache, src, dst)
    draft_cache = draft.copy_slots(draft_cache, src, dst)
    return _after_verify(s, result, common, active=active, target_cache=target_cache,
                         draft_cache=draft_cache, draft_calls=s.draft_calls + depth,
                         proposals=jnp.where(active, num_nodes - 1, 0), depth=budget)

  return _speculative_result(lax.while_loop(cond, body, state), common)


_tree_jit = jax.jit(
  _tree_impl,
  static_argnames=("target", "draft", "tree", "law", "tree_verifier", "max_new_tokens",
                   "max_len", "context", "pad_id"),
)


class _TreeFns(NamedTuple):
  """A model's static functions including the tree ones (hashable)."""

  apply: Callable[..., Any]
  init_cache: Callable[[int, int], Any]
  vocab_size: int
  tree_apply: Callable[..., Any]
  copy_slots: Callable[..., Any]


def _tree_fns(model: Model, name: str, arg: str) -> _TreeFns:
  fns = _fns(model, name, arg)
  if model.tree_apply is None or model.copy_slots is None:
    raise ValueError(
      f"{name}: `{arg}` must provide `tree_apply` and `copy_slots` (tree attention; see "
      f"specdec_jax.models.protocol), got a Model named {model.name!r} without them."
    )
  return _TreeFns(*fns, model.tree_apply, model.copy_slots)


def tree_speculative_generate(target: Model, draft: Model, prompt_tokens: jax.Array,
                              prompt_lengths: jax.Array, key: jax.Array, *, tree: DraftTree,
                              max_new_tokens: int, params: SamplingParams = SamplingParams(),
                              law: str = "deterministic", eos_id: int | None = None,
                              max_len: int | None = None, tree_verifier: Callable | None = None,
                              pad_id: int = -1) -> SpeculativeResult:
  """Exact speculative decoding with a draft *tree*, as one jitted ``lax.while_loop``.

  Each iteration, for every unfinished row of length ``L`` (its last token is the
  tree's root, node 0, at position ``L - 1``):

  1. the draft model builds the tree level by level: one ``apply`` on the tokens at
     ``L - 2, L - 1`` gives the candidates after the root, then one ``tree_apply`` per
     level (tree attention) gives the candidates after each node of that level; node
     ``c`` gets the ``tree.ranks[c]``-th candidate after its parent (``law``:
     ``"deterministic"`` = the draft's top-k tokens, EAGLE-2's top-k tree;
     ``"iid"`` = independent samples from the draft's processed distribution,
     SpecInfer). ``tree.depth`` draft calls per iteration;
  2. the target scores all ``N`` nodes in ONE ``tree_apply`` call: node ``c`` at
     position ``L - 1 + depth(c)`` in slot ``L - 1 + c``, attending to the context
     and its own ancestors;
  3. :func:`~specdec_jax.tree_verify` (recursive rejection sampling with the matching
     law) keeps a path of the tree plus one token of its own; the row grows by that
     many (cut after ``eos_id``), and ``copy_slots`` moves the accepted path's keys and
     values from their tree slots to the slots of their positions in both caches. Only
     the nodes of depth ``<= max_new_tokens - emitted - 1`` are verified, so a row never
     overshoots its budget.

  The output is distributed exactly as :func:`generate`'s for any tree and draft;
  ``temperature == 0`` gives the greedy sequence token for token. The first token
  uses the key as :func:`generate` does; iteration ``i`` of a row uses
  ``fold_in(row_key, i)``: ``fold_in(., 0)`` for the ``N`` uniforms of the
  verification and ``split(fold_in(., 1), N)`` for the ``"iid"`` drafts of each node.

  Args:
    target: the target :class:`Model`, with ``tree_apply`` and ``copy_slots``.
    draft: the draft :class:`Model` (same vocabulary), with ``tree_apply`` and ``copy_slots``.
    prompt_tokens: int ``(B, P)`` right-padded prompts.
    prompt_lengths: int ``(B,)`` in ``[1, P]``.
    key: one ``jax.random`` key (split into one per row) or ``B`` keys, one per row.
    tree: static :class:`DraftTree` (its ``N`` nodes include the root).
    max_new_tokens: static int ``>= 1``.
    params: :class:`~specdec_jax.SamplingParams` for target and draft; fields scalar or ``(B,)``.
    law: static, ``"deterministic"`` (top-k tree) or ``"iid"`` (sampled tree).
    eos_id: optional token id that ends a row (kept in the output).
    max_len: static buffer length, ``>= P``; default ``P + max_new_tokens``. The
      caches have ``max_len + N - 1`` slots.
    tree_verifier: optional static function ``(p (N, V), q (N, V), parents (N,),
      tokens (N,), uniforms (N,), *, num_nodes) -> TreeVerifyResult`` for one tree, to use
      instead of :func:`~specdec_jax.tree_verify` with ``law`` (e.g. a negative control);
      ``q[c]`` is the draft's processed distribution after node ``c``.
    pad_id: static int written after each row's last token.

  Returns:
    :class:`SpeculativeResult`; in its :class:`DecodeStats` the per-position counters
    have ``tree.depth`` columns (position ``i`` = depth ``i + 1``), ``proposals``
    counts tree nodes and ``draft_calls`` counts one per level.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from specdec_jax import SamplingParams
    >>> from specdec_jax.models.toy import make_toy_model
    >>> target = make_toy_model(jax.random.key(0), vocab_size=8)
    >>> small = make_toy_model(jax.random.key(1), vocab_size=8, context=1)
    >>> prompt, lengths = jnp.array([[1, 2, 3], [4, 0, 0]]), jnp.array([3, 1])
    >>> greedy = SamplingParams(temperature=0.0)
    >>> plain = generate(target, prompt, lengths, jax.random.key(2), max_new_tokens=6,
    ...                  params=greedy)
    >>> out = tree_speculative_generate(target, small, prompt, lengths, jax.random.key(2),
    ...                                 tree=DraftTree.from_branching((3, 2)), max_new_tokens=6,
    ...                                 params=greedy)
    >>> bool((out.tokens == plain.tokens).all()), out.num_new.tolist()
    (True, [6, 6])

  Reference:
    Miao et al., "SpecInfer: Accelerating Large Language Model Serving with Tree-based
    Speculative Inference and Verification", arXiv:2305.09781; Li et al., "EAGLE-2: Faster
    Inference of Language Models with Dynamic Draft Trees", arXiv:2406.16858; Cai et al.,
    "Medusa", arXiv:2401.10774 (static trees given as rank paths).
  """
  name = "tree_speculative_generate"
  target_fns = _tree_fns(target, name, "target")
  draft_fns = _tree_fns(draft, name, "draft")
  if draft_fns.vocab_size != target_fns.vocab_size:
    raise ValueError(
      f"{name}: the draft must share the target's vocabulary, got V = {draft_fns.vocab_size} "
      f"for the draft and V = {target_fns.vocab_size} for the target."
    )
  tree = _check_draft_tree(tree, name)
  if tree.size < 2:
    raise ValueError(f"{name}: `tree` must have at least one node besides the root.")
  if law not in TREE_LAWS:
    raise ValueError(f"{name}: `law` must be one of {TREE_LAWS}, got {law!r} instead.")
  if tree_verifier is None:
    tree_verifier = _default_tree_verifier(law, tree.depth)
  elif not callable(tree_verifier):
    raise TypeError(f"{name}: `tree_verifier` must be a function, got {tree_verifier!r}.")
  vocab = target_fns.vocab_size
  prompt, lengths, tokens_ok = _check_prompt(prompt_tokens, prompt_lengths, name, vocab)
  batch, width = prompt.shape
  contexts = (("target", target.context_length), ("draft", draft.context_length))
  max_len, context = _check_budget(max_new_tokens, max_len, width, lengths, name, contexts)
  return _tree_jit(target.params, draft.params, prompt, lengths, tokens_ok,
                   _row_keys(key, batch, name), _batch_params(params, batch, name),
                   _eos(eos_id, name, vocab), target=target_fns, draft=draft_fns, tree=tree,
                   law=law, tree_verifier=tree_verifier, max_new_tokens=int(max_new_tokens),
                   max_len=max_len, context=context, pad_id=int(pad_id))


@functools.cache
def _default_tree_verifier(law: str, depth: int):
  """``tree_verify`` with the law and output length fixed (cached: one object per pair)."""
  return functools.partial(tree_verify, law=law, max_depth=depth)


__all__ = (
  "TREE_LAWS",
  "VERIFIERS",
  "DecodeStats",
  "Draft",
  "DraftTree",
  "GenerateResult",
  "PromptLookup",
  "SpeculativeResult",
  "Verifier",
  "generate",
  "speculative_generate",
  "tree_speculative_generate",
)
