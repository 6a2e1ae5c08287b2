"""Drafting under a grammar: forced tokens proposed for free, proposals kept inside the grammar.

Where a row's grammar state forces the next token (:class:`~specdec_jax.structured.Grammar`
``forced``), the draft proposes it with a point-mass ``q``, whatever the draft model would
have drawn: the rule is unchanged (a point-mass proposal is accepted with probability
``p(token)``, otherwise the residual is ``p`` without it), so the loop stays exact, and a token
the target agrees with costs no draft choice. Prompt lookup's proposals that the grammar
refuses are replaced (by the forced token, or the state's lowest allowed one): they could
never be accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec_jax.decoding.request_rows import batch_rows
from specdec_jax.decoding.request_rows import row_states
from specdec_jax.decoding.request_rows import split_history
from specdec_jax.structured.tables import Grammar
from specdec_jax.structured.tables import allowed
from specdec_jax.structured.tables import next_state
from specdec_jax.structured.tables import walk


def _forced(grammar: Grammar, state: jax.Array) -> jax.Array:
  """int32: the token ``state`` forces, ``-1`` where none (or outside the grammar)."""
  inside = (state >= 0) & (state < grammar.forced.shape[0])
  return jnp.where(inside, grammar.forced[jnp.clip(state, 0, grammar.forced.shape[0] - 1)], -1)


def force(history, prefix, prefix_len, token: jax.Array, probs: jax.Array):
  """``(token (B,), probs (B, V))`` of a draft position with the grammar's forced tokens in
  place of the draft's draw (a one-hot ``probs``); unchanged without a grammar.

  ``history``: the loop's rows (:class:`~specdec_jax.decoding.request_rows.Constrained`
  under a grammar); ``prefix`` ``(B, G)`` / ``prefix_len`` ``(B,)``: the proposals before this
  position (None at the first).
  """
  _, constrained = split_history(history)
  if constrained is None:
    return token, probs
  state = row_states(history, batch_rows(token.shape[0]), prefix, prefix_len)
  forced = _forced(constrained.grammar, state)
  hot = jax.nn.one_hot(jnp.maximum(forced, 0), probs.shape[-1], dtype=probs.dtype)
  return (jnp.where(forced >= 0, forced, token).astype(token.dtype),
          jnp.where((forced >= 0)[:, None], hot, probs))


def constrain_proposals(grammar: Grammar, state: jax.Array, draft: jax.Array) -> jax.Array:
  """int32 ``(B, gamma)``: point-mass proposals ``draft`` (prompt lookup) walked through each
  row's grammar from ``state`` ``(B,)``: a forced token replaces the proposal, a proposal the
  grammar refuses becomes the state's lowest allowed token."""
  def row(s, tokens):
    def step(s, token):
      forced = _forced(grammar, s)
      keep = allowed(grammar, s, token)
      fallback = grammar.fallback[jnp.clip(s, 0, grammar.fallback.shape[0] - 1)]
      token = jnp.where(forced >= 0, forced, jnp.where(keep, token, fallback))
      return next_state(grammar, s, token), token
    return jax.lax.scan(step, s, tokens)[1]

  return jax.vmap(row)(state, draft).astype(jnp.int32)


def forced_positions(grammar: Grammar, state: jax.Array, draft: jax.Array,
                     eos_id: jax.Array) -> jax.Array:
  """bool ``(B, gamma)``: the draft positions whose state (after the proposals before them)
  forces a token, i.e. whose proposal was the grammar's, not the draft's (positions after a
  proposed ``eos_id`` excluded: they are never emitted)."""
  gamma = draft.shape[1]
  states = jax.vmap(lambda s, t: walk(grammar, s, t, jnp.int32(gamma)))(state, draft)
  eos = (draft == eos_id).astype(jnp.int32)
  after_eos = (jnp.cumsum(eos, axis=1) - eos) > 0
  return (_forced(grammar, states[:, :gamma]) >= 0) & ~after_eos
