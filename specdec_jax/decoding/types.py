"""The results of the decoding loops and the state they carry (NamedTuples, no logic)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax

from specdec_jax._logits.process import SamplingParams


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


class GrammarOutcome(NamedTuple):
  """What a constrained loop (``grammar=`` given) reports about each row.

  Attributes:
    state: int32 ``(B,)``: the row's grammar state after its output.
    complete: bool ``(B,)``: the output is a whole match of the row's grammar (its state is
      final; an unconstrained row's always is). A row cut by ``max_new_tokens`` or the buffer
      before its text was complete is not: it ended without ``eos_id``.
    forced: int32 ``(B,)``: draft tokens proposed for free because the grammar forced them
      (speculative loops; 0 for :func:`generate`).
    forced_accepted: int32 ``(B,)``: how many of those the verifier accepted.
  """

  state: jax.Array
  complete: jax.Array
  forced: jax.Array
  forced_accepted: jax.Array


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
      ``TOKEN_OUT_OF_RANGE`` for a prompt id outside ``[0, V)``, ``BAD_LENGTH`` for a traced
      prompt length outside ``[1, P]`` (the row keeps its clipped prompt and generates
      nothing), ``BAD_PARAMS`` for traced out-of-range sampling parameters or ``eos_id``
      (-1 included), ``OUT_OF_ROOM`` when the row stopped
      because the buffer (``max_len``) or the model's context was full before
      ``max_new_tokens`` or ``eos_id``.
    logprobs: float32 ``(B, max_len)`` with ``logprobs=k`` (else None): each generated token's
      log-probability under the target's processed distribution it was drawn from (the
      request's penalties, bans and bias at that step included; ``logprobs_mode="raw"``: the
      raw logits' softmax), NaN at the prompt and past the row's length.
    top_ids, top_logprobs: ``(B, max_len, k)`` with ``logprobs=k > 0`` (else None): the ``k``
      most likely tokens of that distribution and their logprobs (ties toward the lower id);
      ``pad_id`` and NaN where no token was generated.
    grammar: :class:`GrammarOutcome` with ``grammar=`` (else None).
  """

  tokens: jax.Array
  lengths: jax.Array
  num_new: jax.Array
  stats: DecodeStats
  error: jax.Array
  logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None
  grammar: GrammarOutcome | None = None


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
    logprobs, top_ids, top_logprobs: as in :class:`GenerateResult`: each emitted token's
      logprob under the target's processed row it was drawn from (an accepted draft token's
      row, the replacement's and the bonus token's alike), with the draft tokens before it
      counted as output.
    grammar: :class:`GrammarOutcome` with ``grammar=`` (else None).
  """

  tokens: jax.Array
  lengths: jax.Array
  num_new: jax.Array
  stats: DecodeStats
  error: jax.Array
  logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None
  grammar: GrammarOutcome | None = None


class ModelFns(NamedTuple):
  """The static half of a :class:`Model` (hashable: a jit static argument)."""

  apply: Callable[..., Any]
  init_cache: Callable[[int, int], Any]
  vocab_size: int
  apply_features: Callable[..., Any] | None = None
  label: str = "the model"  # "generate: `model`": who to name when its logits are malformed


class Common(NamedTuple):
  """Per-row constants shared by both loops (traced arrays)."""

  row_keys: jax.Array  # (B,) keys, or (B, 2) raw keys
  prompt_lengths: jax.Array  # (B,) int32
  stop_len: jax.Array  # (B,) int32: a row is finished once its length reaches it
  params: SamplingParams  # fields (B,) or None
  eos_id: jax.Array  # () int32, -1 for none
  room: jax.Array  # (B,) bool: the row's budget does not fit its buffer / context
  prompt_ids: jax.Array | None = None  # (B, P) int32, -1 past the prompt: repetition penalty
  grammar: Any = None  # structured.Grammar, or None: no row is constrained
  grammar_start: jax.Array | None = None  # (B,) int32: each row's initial grammar state


class Logprobs(NamedTuple):
  """The logprobs buffers a loop fills when asked (``logprobs=k``): ``logprobs`` float32
  ``(B, max_len)``, and for ``k > 0`` ``top_ids`` int32 / ``top_logprobs`` float32
  ``(B, max_len, k)`` (else None); NaN (``pad_id``) where no token was generated."""

  logprobs: jax.Array
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None


class GenerateState(NamedTuple):
  """Loop state of :func:`generate`.

  Attributes:
    tokens: int32 ``(B, max_len)`` token buffer.
    lengths: int32 ``(B,)``.
    done: bool ``(B,)``.
    cache: the target's cache.
    target_calls: int32 ``()``.
    row_calls: int32 ``(B,)``.
    error: int32 ``(B,)``.
    logprobs: :class:`Logprobs` of the tokens so far, or None when not asked for.
    grammar: int32 ``(B,)``: each row's grammar state after its tokens, or None.
  """

  tokens: jax.Array
  lengths: jax.Array
  done: jax.Array
  cache: Any
  target_calls: jax.Array
  row_calls: jax.Array
  error: jax.Array
  logprobs: Logprobs | None = None
  grammar: jax.Array | None = None


class SpecState(NamedTuple):
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
    adapt: float32 ``(B, 2)`` decayed accepted / rejected counts of adaptive speculation
      (:mod:`specdec_jax.decoding.adaptive`; zeros when it is off).
    costs: float32 ``(gamma + 1,)`` adaptive speculation's cost of an iteration by call width
      (the host replaces it between chunks when it observes costs), or None when it is off.
    logprobs: :class:`Logprobs` of the tokens so far, or None when not asked for.
    grammar: int32 ``(B,)``: each row's grammar state after its tokens, or None.
    forced: int32 ``(B, 2)``: draft tokens proposed because the grammar forced them, and how
      many of those were accepted (None without a grammar).
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
  adapt: Any = None
  costs: Any = None
  logprobs: Logprobs | None = None
  grammar: jax.Array | None = None
  forced: jax.Array | None = None
