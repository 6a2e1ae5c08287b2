"""A constraint the jitted loops carry: a token-level automaton as device-resident tables.

A compiled grammar (a JSON schema or a regex, :mod:`specdec_jax.structured.compile`) is a
deterministic automaton over the model's tokens. Its tables stay small because tokens that act
the same in every state share a *class* (a JSON schema over SmolLM2's 49,152 tokens: 264
classes), and states share their allowed-token bitmask rows (239 distinct rows for 2,772
states). A row of a decoding loop carries one int32, its state; the loop reads

* the allowed tokens of a state: :func:`state_bitmask` (``ceil(V / 32)`` int32 words, the
  layout of xgrammar and llguidance, which the verifiers take as ``target_bitmask``);
* the state after a token: :func:`next_state` (two gathers; ``-1`` once a token leaves the
  grammar);
* the state after a draft prefix: :func:`walk` (``O(gamma)`` gathers). Rejected proposals are
  rolled back by taking the state after the emitted tokens only: nothing is replayed.

No host call per step. Several grammars are stacked into one :class:`Grammar`
(:func:`stack_grammars`), so each row of a batch may follow its own schema; state 0 is the
*free* state (every token allowed), for the rows that are not constrained.

References: Willard & Louf 2023, "Efficient Guided Generation for Large Language Models"
(token-level automata; outlines-core); Dong et al. 2024, "XGrammar" (bitmask layout).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

#: The state of an unconstrained row in every :class:`Grammar`: all tokens allowed, forever.
FREE = 0


class Grammar(NamedTuple):
  """Token-level automata of one or more grammars, stacked (device arrays, a pytree).

  ``S`` states (state :data:`FREE` first), ``G`` grammars, ``C`` token classes (the most any
  grammar has), ``M`` distinct bitmask rows, ``W = ceil(V / 32)`` words.

  Attributes:
    token_class: int32 ``(G + 1, V)``: each token's class in each grammar (row 0: the free
      state's single class).
    next_state: int32 ``(S, C)``: the state after a token of class ``c`` in state ``s``;
      ``-1`` where the token is not allowed. A final state maps EOS to itself.
    state_grammar: int32 ``(S,)``: which row of ``token_class`` a state reads.
    mask_id: int32 ``(S,)``: each state's row of ``mask_rows``.
    mask_rows: int32 ``(M, W)``: allowed-token bitmasks (bit ``i`` of word ``j``: token
      ``32 j + i``), exactly the tokens with ``next_state >= 0``.
    final: bool ``(S,)``: states where the text is complete (EOS allowed there only).
    forced: int32 ``(S,)``: the token the grammar forces next, a draft proposed for free:
      the only allowed token, or the first token of the tokenizer's encoding of the text every
      continuation starts with (a key, ``":"``; when one token spells all of that text, the
      longest allowed token inside it, since its end may merge with the free text after it
      in the model's own tokenization); ``-1`` where the next token is free.
    fallback: int32 ``(S,)``: the lowest allowed token (what a proposal outside the grammar is
      replaced by).
    starts: int32 ``(G + 1,)``: each grammar's initial state (``starts[0] = FREE``).
  """

  token_class: jax.Array
  next_state: jax.Array
  state_grammar: jax.Array
  mask_id: jax.Array
  mask_rows: jax.Array
  final: jax.Array
  forced: jax.Array
  fallback: jax.Array
  starts: jax.Array

  @property
  def vocab_size(self) -> int:
    return int(self.token_class.shape[1])

  @property
  def num_states(self) -> int:
    return int(self.next_state.shape[0])


def next_state(grammar: Grammar, state: jax.Array, token: jax.Array) -> jax.Array:
  """The state after ``token`` in ``state`` (any matching shapes); ``-1`` when the token is
  not allowed there, the state is ``-1`` (already outside the grammar) or the token is outside
  ``[0, V)``.

  Example:
    >>> from specdec_jax.structured import compile_regex
    >>> grammar = stack_grammars(compile_regex("(yes|no)", [b"yes", b"no", None], 2))
    >>> start = grammar.starts[1]
    >>> bool(next_state(grammar, start, 0) >= 0), bool(next_state(grammar, start, 2) >= 0)
    (True, False)
  """
  state = jnp.asarray(state, jnp.int32)
  token = jnp.asarray(token, jnp.int32)
  vocab = grammar.token_class.shape[1]
  ok = (state >= 0) & (state < grammar.next_state.shape[0]) & (token >= 0) & (token < vocab)
  s = jnp.clip(state, 0, grammar.next_state.shape[0] - 1)
  cls = grammar.token_class[grammar.state_grammar[s], jnp.clip(token, 0, vocab - 1)]
  return jnp.where(ok, grammar.next_state[s, cls], -1)


def state_bitmask(grammar: Grammar, state: jax.Array) -> jax.Array:
  """int32 ``(..., W)``: the allowed-token bitmask of each ``state`` (``(...)``).

  A state outside the table (``-1``: a row that already left the grammar, which only a
  position the verifier never reaches can have) reads the free state's row, so that no
  unreachable row reports an empty mask.
  """
  s = jnp.asarray(state, jnp.int32)
  s = jnp.where((s >= 0) & (s < grammar.next_state.shape[0]), s, FREE)
  return grammar.mask_rows[grammar.mask_id[s]]


def walk(grammar: Grammar, state: jax.Array, tokens: jax.Array, count: jax.Array) -> jax.Array:
  """int32 ``(n + 1,)``: the states of one row after each prefix of ``tokens[:count]``.

  Entry ``i`` is the state after ``tokens[:min(i, count)]``: entry 0 is ``state``, entries
  past ``count`` repeat the state after all ``count`` tokens. ``O(n)`` gathers, no replay of
  the row's earlier output: the loops call it on the ``gamma + 1`` tokens of one iteration.

  Args:
    grammar: the :class:`Grammar`.
    state: int32 ``()``, the row's state before ``tokens``.
    tokens: int32 ``(n,)``.
    count: int32 ``()``: how many of ``tokens`` are real.
  """
  def step(s, x):
    i, token = x
    new = jnp.where(i < count, next_state(grammar, s, token), s)
    return new, new

  _, states = jax.lax.scan(step, jnp.asarray(state, jnp.int32),
                           (jnp.arange(tokens.shape[0], dtype=jnp.int32), tokens))
  return jnp.concatenate([jnp.asarray(state, jnp.int32)[None], states])


def prefix_state(grammar: Grammar, state: jax.Array, prefix: jax.Array,
                 prefix_len: jax.Array) -> jax.Array:
  """The state of one row after ``prefix[:prefix_len]`` (``prefix`` ``(G,)``): the state a
  draft position (or tree node) starts from."""
  if prefix.shape[0] == 0:
    return jnp.asarray(state, jnp.int32)
  return walk(grammar, state, prefix, prefix_len)[-1]


def allowed(grammar: Grammar, state: jax.Array, token: jax.Array) -> jax.Array:
  """Whether ``token`` is allowed in ``state`` (bool, matching shapes)."""
  return next_state(grammar, state, token) >= 0


def start_states(grammar: Grammar, which) -> jax.Array:
  """int32 ``(B,)``: the initial state of grammar ``which[b]`` for each row (``0`` or ``-1``:
  unconstrained, the free state; ``g >= 1``: the ``g``-th grammar given to
  :func:`stack_grammars`)."""
  which = jnp.asarray(which, jnp.int32)
  return jnp.where(which >= 1, grammar.starts[jnp.clip(which, 0, grammar.starts.shape[0] - 1)],
                   FREE)


def stack_grammars(compiled, vocab_size: int | None = None) -> Grammar:
  """One :class:`Grammar` on the device from compiled grammars (host tables).

  Args:
    compiled: a :class:`~specdec_jax.structured.CompiledGrammar` or a sequence of them (the
      same vocabulary): grammar ``g`` (1-based, in this order) starts at ``starts[g]``.
    vocab_size: the model's vocabulary size; a grammar compiled over another size is refused.

  Returns:
    The stacked :class:`Grammar`, state 0 free.

  Example:
    >>> from specdec_jax.structured import compile_regex
    >>> vocab = [b"yes", b"no", b"0", b"1", None]
    >>> grammar = stack_grammars([compile_regex("(yes|no)", vocab, 4),
    ...                           compile_regex("[01]+", vocab, 4)])
    >>> start_states(grammar, jnp.array([1, 2, 0])).tolist() == [
    ...     grammar.starts[1], grammar.starts[2], 0]
    True
  """
  items = [compiled] if hasattr(compiled, "next_state") else list(compiled)
  if not items:
    raise ValueError("stack_grammars: `compiled` is empty; expected one or more "
                     "CompiledGrammar (from compile_regex / compile_json_schema).")
  vocab = items[0].token_class.shape[0]
  for i, c in enumerate(items):
    if c.token_class.shape[0] != vocab or (vocab_size is not None and vocab != vocab_size):
      raise ValueError(
        f"stack_grammars: `compiled[{i}]` was compiled over {c.token_class.shape[0]} tokens; "
        f"expected {vocab_size if vocab_size is not None else vocab} (the model's vocabulary: "
        "compile every grammar with the tokenizer of the model that runs it).")
  words = (vocab + 31) // 32
  classes = max(max(c.next_state.shape[1] for c in items), 1)
  full = np.full((words,), -1, np.int32)
  if vocab % 32:
    full[-1] = np.int32(np.uint32((1 << (vocab % 32)) - 1).view(np.int32))
  token_class = [np.zeros((vocab,), np.int32)]
  next_rows = [np.full((1, classes), -1, np.int32)]
  next_rows[0][0, 0] = FREE
  state_grammar, mask_id, final, forced, fallback = [[0], [0], [True], [-1], [0]]
  mask_rows, starts, offset, rows = [full[None]], [FREE], 1, 1
  for g, c in enumerate(items, start=1):
    table = np.full((c.next_state.shape[0], classes), -1, np.int32)
    table[:, :c.next_state.shape[1]] = np.where(c.next_state >= 0, c.next_state + offset, -1)
    next_rows.append(table)
    token_class.append(c.token_class.astype(np.int32))
    state_grammar += [g] * c.next_state.shape[0]
    mask_id += (c.mask_id + rows).tolist()
    mask_rows.append(c.mask_rows.astype(np.int32))
    final += c.final.tolist()
    forced += c.forced.tolist()
    fallback += c.fallback.tolist()
    starts.append(offset + c.initial_state)
    offset += c.next_state.shape[0]
    rows += c.mask_rows.shape[0]
  return Grammar(
    jnp.asarray(np.stack(token_class)), jnp.asarray(np.concatenate(next_rows)),
    jnp.asarray(state_grammar, jnp.int32), jnp.asarray(mask_id, jnp.int32),
    jnp.asarray(np.concatenate(mask_rows)), jnp.asarray(final, bool),
    jnp.asarray(forced, jnp.int32), jnp.asarray(fallback, jnp.int32),
    jnp.asarray(starts, jnp.int32))


__all__ = ["FREE", "Grammar", "allowed", "next_state", "prefix_state", "stack_grammars",
           "start_states", "state_bitmask", "walk"]
