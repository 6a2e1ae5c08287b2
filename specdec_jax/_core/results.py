"""The result types: :class:`VerifyResult` (one sequence; its six fields start every result of
the library), and the packed layouts' (those six, then the layout's own)."""

from __future__ import annotations

from typing import NamedTuple

import jax


class VerifyResult(NamedTuple):
  """What one verification step produced (one sequence; add a leading batch axis under vmap).

  Every result type of the library starts with these six fields, in this order.

  Attributes:
    tokens: int32 ``(gamma + 1,)``. The accepted draft tokens, then the replacement
      or bonus token, then ``pad_id`` in the unused slots.
    num_tokens: int32 ``()``. How many leading entries of ``tokens`` are new tokens,
      ``1 <= num_tokens <= gamma + 1``.
    num_accepted: int32 ``()``. How many draft tokens were kept, ``num_tokens - 1``.
    num_uniforms: int32 ``()``. How many uniforms the rule read: ``num_accepted + 2``
      after a rejection, ``gamma + 1`` when every proposal was accepted.
    valid: bool ``()``. True when every value the step read (the tested draft ids,
      their gathered probabilities, the uniforms it read and the full row(s) it
      sampled from) was in range and every row it read sums to 1.
    error: int32 ``()``. :class:`ErrorCode` bit mask that says what was wrong; 0 when
      ``valid``. Decode on the host with :func:`describe_error`.
    logprobs: float32 ``(S,)`` with ``logprobs=k`` (else None): each emitted token's
      log-probability under the target's processed distribution at its position (the
      replacement's too; ``logprobs_mode="raw"``: the raw logits' softmax); NaN in unused slots
      and for a caller's bonus token.
    top_ids, top_logprobs: ``(S, k)`` with ``logprobs=k > 0``: the ``k`` most likely tokens of
      each emitted token's distribution and their logprobs (ties toward the lower id).
  """

  tokens: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  num_uniforms: jax.Array
  valid: jax.Array
  error: jax.Array
  logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None


class PackedVerifyResult(NamedTuple):
  """What :func:`packed_verify` produced for a batch of ``B`` requests.

  Attributes:
    tokens: int32 ``(B, max_spec_len + 1)``: per request its accepted drafts, then the
      replacement (first rejection) or bonus token, then ``pad_id`` (vLLM's layout; see
      :func:`flat_tokens` for tpu-inference's).
    num_tokens: int32 ``(B,)`` new tokens per request, ``num_accepted + 1``.
    num_accepted: int32 ``(B,)`` accepted drafts per request.
    num_uniforms: int32 ``(B,)`` uniforms each request read (slots ``0 .. n - 1`` of its row).
    valid: bool ``(B,)``: everything the request's step read was in range.
    error: int32 ``(B,)`` :class:`~specdec_jax.ErrorCode` bits; 0 when ``valid``.
    logprobs: float32 ``(S,)`` with ``logprobs=k`` (else None): each emitted token's
      log-probability under the target's processed distribution at its position (the
      replacement's too; ``logprobs_mode="raw"``: the raw logits' softmax); NaN in unused slots
      and for a caller's bonus token.
    top_ids, top_logprobs: ``(S, k)`` with ``logprobs=k > 0``: the ``k`` most likely tokens of
      each emitted token's distribution and their logprobs (ties toward the lower id).
  """

  tokens: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  num_uniforms: jax.Array
  valid: jax.Array
  error: jax.Array
  logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None


class PackedTreeVerifyResult(NamedTuple):
  """What :func:`packed_tree_verify` produced for ``B`` trees.

  The first six fields are those of every result (:class:`~specdec_jax.VerifyResult`).

  Attributes:
    tokens: int32 ``(B, max_depth + 1)``: the accepted path's tokens, then the final token
      (replacement or bonus), then ``pad_id``.
    num_tokens: int32 ``(B,)`` new tokens, ``num_accepted + 1``.
    num_accepted: int32 ``(B,)`` accepted draft tokens (sglang's ``accept_length``).
    num_uniforms: int32 ``(B,)`` coins read as fresh uniforms (tests plus the final sample;
      under ``"per_parent"`` a parent's coin is rescaled after each rejection, not re-read).
    valid: bool ``(B,)``.
    error: int32 ``(B,)`` :class:`~specdec_jax.ErrorCode` bits.
    path: int32 ``(B, max_depth + 1)``: the accepted nodes (tree indices ``u``), then ``-1``.
    accept_index: int32 ``(B, max_depth + 1)``: sglang's ``accept_index``, the flat rows
      ``b * N + u`` of the root and then of the accepted nodes, ``-1`` after.
    predicts: int32 ``(B * N,)``: sglang's ``predicts``, the token emitted after each node of
      the accepted path (row ``b * N + u``: the next accepted token, or the final one after
      the last accepted node), ``pad_id`` at every other node.
    logprobs: float32 ``(S,)`` with ``logprobs=k`` (else None): each emitted token's
      log-probability under the target's processed distribution at its position (the
      replacement's too; ``logprobs_mode="raw"``: the raw logits' softmax); NaN in unused slots
      and for a caller's bonus token.
    top_ids, top_logprobs: ``(S, k)`` with ``logprobs=k > 0``: the ``k`` most likely tokens of
      each emitted token's distribution and their logprobs (ties toward the lower id).
  """

  tokens: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  num_uniforms: jax.Array
  valid: jax.Array
  error: jax.Array
  path: jax.Array
  accept_index: jax.Array
  predicts: jax.Array
  logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None


__all__ = ["PackedTreeVerifyResult", "PackedVerifyResult", "VerifyResult"]
