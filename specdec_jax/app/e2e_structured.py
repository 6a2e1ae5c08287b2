"""Structured output end to end on SmolLM2: a JSON-extraction task, `--json-schema`, `--regex`.

The grammar (a JSON schema or a regex) is compiled once over SmolLM2's vocabulary with
outlines-core (:func:`~specdec_jax.structured.compile_json_schema`, the ``structured`` extra)
into device tables; plain constrained decoding and speculative constrained decoding run the
same request side by side (:mod:`specdec_jax.app.e2e`), every output is checked (``jsonschema``
or a full regex match), and this module prints what the grammar did: how much of each answer
the grammar forced and drafted for free, how much of that the target accepted, and the
grammar's own cost per iteration beside a target step.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdec_jax.structured import Grammar
from specdec_jax.structured import compile_json_schema
from specdec_jax.structured import compile_regex
from specdec_jax.structured import stack_grammars
from specdec_jax.structured import state_bitmask
from specdec_jax.structured import token_bytes_from_byte_level
from specdec_jax.structured import walk

#: The demo's and bench-e2e's JSON task: extract a record with nested objects, an array, an
#: enum, a bounded integer and strings from a paragraph.
JSON_SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 60},
    "role": {"enum": ["admin", "editor", "viewer"]},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "address": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30},
                               "country": {"type": "string", "maxLength": 30}},
                "required": ["city", "country"], "additionalProperties": False},
  },
  "required": ["name", "age", "email", "role", "skills", "address"],
  "additionalProperties": False,
}
JSON_PROMPT = (
  "Extract the person described below as JSON with the fields name, age, email, role (admin, "
  "editor or viewer), skills and address (city, country).\n\n"
  "Maria Lopez is 34 and joined the Madrid office of our company last spring as an editor. "
  "She writes Python and SQL, speaks Spanish and English, and can be reached at "
  "maria.lopez@example.com. Her address is Calle Mayor 12, Madrid, Spain."
)
#: The task's name in the tables.
JSON_TASK = "json-extract"
#: The task's token budget: room for any answer the schema allows that SmolLM2 writes (its
#: answers take 55-80 tokens), so that no run is cut before its JSON is complete.
JSON_MAX_NEW_TOKENS = 192


class Constraint(NamedTuple):
  """A compiled grammar for the loops and the check of a finished text."""

  grammar: Grammar
  check: Callable[[str], str | None]  # None when the text is valid, else why not
  label: str  # "JSON schema" or "regex ..."
  compile_seconds: float
  states: int
  max_new_tokens: int | None = None  # the prompt's own budget (None: the run's)


@functools.cache
def _token_bytes(tokenizer) -> tuple[bytes | None, ...]:
  """Each SmolLM2 token id's raw bytes (byte-level BPE), None for the control tokens."""
  vocab = tokenizer.hf.get_vocab(with_added_tokens=True)
  strings: list[str | None] = [None] * tokenizer.vocab_size
  for text, i in vocab.items():
    if 0 <= i < len(strings):
      strings[i] = text
  return tuple(token_bytes_from_byte_level(strings, tokenizer.special_tokens.values()))


def json_checker(schema: dict) -> Callable[[str], str | None]:
  """``check(text)``: None when ``text`` parses and validates against ``schema``."""
  import jsonschema

  def check(text: str) -> str | None:
    try:
      jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as err:
      return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None

  return check


def regex_checker(pattern: str) -> Callable[[str], str | None]:
  def check(text: str) -> str | None:
    return None if re.fullmatch(pattern, text) else f"does not fully match {pattern!r}"

  return check


def build(tokenizer, *, schema: dict | None = None, regex: str | None = None,
          max_new_tokens: int | None = None) -> Constraint:
  """Compile ``schema`` (compact JSON) or ``regex`` over ``tokenizer``'s vocabulary; forced
  text is encoded by the tokenizer itself (its first token is proposed for free)."""
  start = time.perf_counter()
  token_bytes = list(_token_bytes(tokenizer))
  if schema is not None:
    compiled = compile_json_schema(schema, token_bytes, tokenizer.eos_id,
                                   encode=tokenizer.encode)
    check, label = json_checker(schema), "JSON schema"
  else:
    compiled = compile_regex(regex, token_bytes, tokenizer.eos_id, encode=tokenizer.encode)
    check, label = regex_checker(regex), f"regex {regex!r}"
  grammar = stack_grammars([compiled], tokenizer.vocab_size)
  return Constraint(grammar, check, label, time.perf_counter() - start,
                    int(compiled.stats["states"]), max_new_tokens)


def grammar_cost_ms(grammar: Grammar, gamma: int, vocab: int, repeats: int = 50) -> float:
  """Median ms of the grammar's own work in one chain iteration at batch 1: the states along
  ``gamma`` proposals, the ``gamma + 1`` target rows' masks applied to their logits, the
  forced-token lookups, and the state after ``gamma + 1`` emitted tokens."""
  @jax.jit
  def work(grammar, state, draft, logits):
    states = walk(grammar, state, draft, jnp.int32(gamma))
    words = state_bitmask(grammar, states)  # (gamma + 1, W)
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    masked = jnp.where(bits.reshape(gamma + 1, -1)[:, :vocab] != 0, logits, -jnp.inf)
    forced = grammar.forced[jnp.maximum(states, 0)]
    after = walk(grammar, state, jnp.concatenate([draft, forced[:1]]), jnp.int32(gamma + 1))
    return masked.max(axis=-1), after

  state = grammar.starts[1]
  draft = jnp.zeros((gamma,), jnp.int32)
  logits = jax.random.normal(jax.random.key(0), (gamma + 1, vocab))
  jax.block_until_ready(work(grammar, state, draft, logits))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(work(grammar, state, draft, logits))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def report(runs: Sequence, constraints: dict[str, Constraint], costs, *, gamma: int,
           vocab: int, out=sys.stdout) -> bool:
  """Print, per constrained run, whether its text is valid, how much of it the grammar forced
  and how much of that was accepted; then the grammar's cost per iteration beside a target
  step. Returns whether every complete constrained output was valid (a text the budget cut
  is a prefix of a valid one: reported, not counted as invalid)."""
  ok = True
  for name, constraint in constraints.items():
    print(f"structured output, {name} ({constraint.label}: {constraint.states} states, "
          f"compiled in {constraint.compile_seconds:.1f} s):", file=out)
    for r in (r for r in runs if r.prompt == name):
      problem = constraint.check(r.text) if r.complete else (
        "cut by the token budget before the text was complete (raise --max-new-tokens)")
      ok = ok and (problem is None or not r.complete)
      forced = (f"{r.forced} forced proposals ({r.forced / max(r.new_tokens, 1):.0%} of the "
                f"answer), {r.forced_accepted} accepted" if r.draft != "plain" else "")
      print(f"  {r.draft:<16} T={r.temperature:g} seed {r.seed}: "
            f"{'valid' if problem is None else 'INVALID: ' + problem}"
            f"{'; ' + forced if forced else ''}", file=out)
    cost = grammar_cost_ms(constraint.grammar, gamma, vocab)
    print(f"  grammar cost per iteration (gamma {gamma}): {cost:.3f} ms = "
          f"{cost / costs.target_step:.1%} of a target step ({costs.target_step:.1f} ms)",
          file=out, flush=True)
  return ok
