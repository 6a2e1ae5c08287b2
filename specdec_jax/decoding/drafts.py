"""The drafts of the chain loop: another model (sampled with its ``q``) or prompt lookup."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._logits import sample_draft
from specdec_jax.decoding.common import batch_rows
from specdec_jax.decoding.common import model_ids
from specdec_jax.decoding.types import ModelFns
from specdec_jax.models.protocol import Model


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



def propose_model(draft: ModelFns, draft_params, cache, tokens, lengths, step_keys, params,
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
  rows = batch_rows(batch)
  last = lengths - 1
  positions = jnp.stack([jnp.maximum(last - 1, 0), last], axis=1)
  positions = jnp.clip(positions, 0, cache_len - 1)
  sync = tokens[rows[:, None], positions]
  logits, cache = draft.apply(draft_params, model_ids(sync, draft.vocab_size), positions, cache)

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


def lookup_row(row: jax.Array, length: jax.Array, spec: PromptLookup, gamma: int) -> jax.Array:
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


def propose_lookup(spec: PromptLookup, tokens, lengths, *, gamma: int, vocab: int):
  """Prompt-lookup proposals with point-mass ``q``: ``(draft (B, gamma), q (B, gamma, V))``."""
  draft = jax.vmap(lookup_row, in_axes=(0, 0, None, None))(tokens, lengths, spec, gamma)
  draft = model_ids(draft, vocab)
  return draft, jax.nn.one_hot(draft, vocab, dtype=jnp.float32)
