"""Structured generation: JSON-schema and regex grammars compiled to device tables, in every loop.

Validity: random toy models (every token of a 103-token character vocabulary likely somewhere)
generate under a JSON schema with nested objects, arrays, enums, bounded integers and strings,
sampled over many seeds and greedy, in every loop (plain, chain with a model draft and with
prompt lookup, a static tree, EAGLE-2's dynamic tree), with rows of two grammars and free rows
in one batch: every constrained output must parse and validate (``jsonschema``) or fully match
its regex. Then the tables' invariants and bad input, on the host and under ``jit``.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdec_jax import ErrorCode
from specdec_jax import SamplingParams
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding import DynamicTree
from specdec_jax.decoding import PromptLookup
from specdec_jax.decoding import generate
from specdec_jax.decoding import speculative_generate
from specdec_jax.decoding import tree_speculative_generate
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model
from specdec_jax.structured import FREE
from specdec_jax.structured import compile_json_schema
from specdec_jax.structured import compile_regex
from specdec_jax.structured import stack_grammars
from specdec_jax.structured import start_states
from specdec_jax.structured import state_bitmask
from specdec_jax.structured import token_bytes_from_byte_level
from tests._fuzz_strategies import fuzz
from tests._helpers import longest_match_encoder

TOKENS = [bytes([c]) for c in range(32, 127)] + [b'{"', b'":', b'","', b'"}', b"name", b"role",
                                                    b"admin"] + [None]
V = len(TOKENS)
EOS = V - 1
SCHEMA = {
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 5},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
             "required": ["city"], "additionalProperties": False},
  },
  "required": ["name", "age", "role", "tags", "home"],
  "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2}"
NEW = 200  # more than the longest text either grammar accepts


_encode = longest_match_encoder(TOKENS)


@functools.cache
def _grammar():
  return stack_grammars([compile_json_schema(SCHEMA, TOKENS, EOS, encode=_encode),
                         compile_regex(REGEX, TOKENS, EOS, encode=_encode)], V)


TARGET = make_toy_model(jax.random.key(40), V, scale=2.0, name="target")
DRAFT = make_toy_model(jax.random.key(41), V, context=1, scale=2.0, name="draft")
FEATURES = make_toy_feature_draft(TARGET, noise=1.0, key=jax.random.key(42))
SAMPLED, GREEDY = 24, 4


def _batch():
  """Rows: sampled and greedy under the schema (grammar 1), a few under the regex (2), and two
  free rows."""
  which = np.array([1] * (SAMPLED + GREEDY) + [2] * 6 + [0] * 2, np.int32)
  rows = len(which)
  temperature = np.ones(rows, np.float32)
  temperature[SAMPLED:SAMPLED + GREEDY] = 0.0
  prompts = np.random.default_rng(0).integers(0, V - 1, (rows, 3)).astype(np.int32)
  return which, prompts, np.full(rows, 3, np.int32), SamplingParams(temperature=temperature)


def _run(kind: str, seed: int):
  which, prompts, lengths, params = _batch()
  grammar = _grammar()
  run = dict(max_new_tokens=NEW, params=params, eos_id=EOS, grammar=grammar,
             grammar_state=start_states(grammar, which))
  key = jax.random.key(seed)
  if kind == "plain":
    return generate(TARGET, prompts, lengths, key, **run)
  if kind == "tree":
    return tree_speculative_generate(TARGET, DRAFT, prompts, lengths, key,
                                     tree=DraftTree.from_branching((2, 2)), law="iid", **run)
  if kind == "dynamic":
    return tree_speculative_generate(TARGET, FEATURES, prompts, lengths, key,
                                     tree=DynamicTree(3, 2, 4), **run)
  draft = DRAFT if kind == "model" else PromptLookup(max_ngram=2)
  return speculative_generate(TARGET, draft, prompts, lengths, key, gamma=4, **run)


def _texts(out) -> list[str]:
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  texts = []
  for b in range(tokens.shape[0]):
    new = tokens[b, 3:lengths[b]].tolist()
    assert (new and new[-1] == EOS) or b >= SAMPLED + GREEDY + 6, (b, new)
    texts.append(b"".join(TOKENS[t] for t in new if t != EOS).decode())
  return texts


@pytest.mark.parametrize("kind", ["plain", "model", "lookup", "tree", "dynamic"])
def test_every_constrained_output_validates(kind):
  """Three seeds per loop (72 sampled JSON texts, greedy and regex rows beside them): each
  schema row's text parses and validates, each regex row's fully matches; every constrained
  row ended with EOS and reports ``complete``; the speculative loops proposed forced tokens
  (keys, quotes, braces), a good share accepted (one after a rejected proposal is not)."""
  which = _batch()[0]
  for seed in range(3):
    out = _run(kind, seed)
    np.testing.assert_array_equal(out.error, 0)
    for b, text in enumerate(_texts(out)):
      if which[b] == 1:
        jsonschema.validate(json.loads(text), SCHEMA)
      elif which[b] == 2:
        assert re.fullmatch(REGEX, text), (b, text)
    assert np.asarray(out.grammar.complete).all()
    if kind in ("model", "lookup"):
      forced, taken = out.grammar.forced, out.grammar.forced_accepted
      assert int(forced[:SAMPLED].sum()) > 10 * SAMPLED
      assert int(taken.sum()) > 0.3 * int(forced.sum())


@pytest.mark.parametrize("kind", ["model", "lookup", "tree"])
def test_greedy_constrained_output_equals_plain(kind):
  plain, fast = _run("plain", 7), _run(kind, 7)
  rows = slice(SAMPLED, SAMPLED + GREEDY)
  np.testing.assert_array_equal(np.asarray(fast.tokens)[rows], np.asarray(plain.tokens)[rows])


def test_the_tables_agree_with_their_masks():
  """``mask_rows`` is exactly ``next_state >= 0`` over the token classes; EOS exactly at final
  states; a forced token is allowed; every state allows some token (no dead end)."""
  g = jax.device_get(_grammar())
  vocab_bits = np.unpackbits(g.mask_rows.view(np.uint8), axis=1, bitorder="little")[:, :V]
  for s in range(g.next_state.shape[0]):
    cls = g.token_class[g.state_grammar[s]]
    allowed = g.next_state[s, cls] >= 0
    np.testing.assert_array_equal(vocab_bits[g.mask_id[s]].astype(bool), allowed)
    assert allowed[EOS] == g.final[s] or s == FREE
    assert allowed.any()
    if g.forced[s] >= 0:
      assert allowed[g.forced[s]]
  bits = np.asarray(state_bitmask(_grammar(), jnp.array([-1, FREE])))
  np.testing.assert_array_equal(bits[0], bits[1])  # outside the table: the free row


def test_byte_level_tokens_decode_to_their_bytes():
  assert token_bytes_from_byte_level(["Ġthe", "Ċ", "<s>", None], special_ids=[2]) == [
    b" the", b"\n", None, None]
  with pytest.raises(ValueError, match="token_bytes_from_byte_level: token 0"):
    token_bytes_from_byte_level(["\u4e00"])


@pytest.mark.parametrize("schema, match", [
  ("{not json", "compile_json_schema: `schema` is not valid JSON"),
  ({"type": 5}, "compile_json_schema: `schema` is not a valid JSON Schema"),
  ({"$ref": "#/definitions/missing"}, "compile_json_schema: outlines-core cannot compile"),
  ([1, 2], "compile_json_schema: `schema` must be a JSON object"),
])
def test_bad_schemas_are_refused_by_name(schema, match):
  with pytest.raises(ValueError, match=re.escape(match)):
    compile_json_schema(schema, TOKENS, EOS)


def test_bad_regexes_and_vocabularies_are_refused_by_name():
  with pytest.raises(ValueError, match="compile_regex: outlines-core cannot compile"):
    compile_regex("(unclosed", TOKENS, EOS)
  with pytest.raises(ValueError, match="compile_regex: outlines-core cannot compile"):
    compile_regex("\u4e00+", TOKENS, EOS)  # no token spells it
  with pytest.raises(ValueError, match=r"compile_regex: `eos_id` must be a token id"):
    compile_regex("a", TOKENS, V)
  with pytest.raises(ValueError, match=r"compile_regex: `token_bytes\[1\]` is str"):
    compile_regex("a", [b"a", "b", None], 2)
  with pytest.raises(ValueError, match="compile_regex: `regex` must be a non-empty str"):
    compile_regex("", TOKENS, EOS)


def test_a_grammar_over_another_vocabulary_is_refused():
  """A tokenizer mismatch: the tables' vocabulary is not the model's."""
  small = make_toy_model(jax.random.key(0), 8)
  with pytest.raises(ValueError, match="generate: `grammar` was compiled over 103 tokens but "
                                       "the model's vocabulary has 8"):
    generate(small, np.zeros((1, 2), np.int32), np.array([2]), jax.random.key(0),
             max_new_tokens=2, grammar=_grammar())
  with pytest.raises(ValueError, match="stack_grammars: `compiled\\[0\\]` was compiled over 103"):
    stack_grammars([compile_regex(REGEX, TOKENS, EOS)], vocab_size=8)
  with pytest.raises(TypeError, match="speculative_generate: `grammar` must be a "):
    speculative_generate(TARGET, PromptLookup(), np.zeros((1, 2), np.int32), np.array([2]),
                         jax.random.key(0), gamma=2, max_new_tokens=2, grammar="{}")


def test_initial_states_are_checked_on_the_host_and_flagged_under_jit():
  grammar = _grammar()
  prompts, lengths = np.zeros((2, 2), np.int32), np.array([2, 2])
  with pytest.raises(ValueError, match=r"generate: `grammar_state` must be in \[0, "):
    generate(TARGET, prompts, lengths, jax.random.key(0), max_new_tokens=2, grammar=grammar,
             grammar_state=np.array([1, grammar.num_states]))
  with pytest.raises(ValueError, match="generate: `grammar_state` was given without `grammar`"):
    generate(TARGET, prompts, lengths, jax.random.key(0), max_new_tokens=2, grammar_state=1)

  @jax.jit
  def run(state):
    return speculative_generate(TARGET, PromptLookup(), prompts, lengths, jax.random.key(0),
                                gamma=2, max_new_tokens=4, eos_id=EOS, grammar=grammar,
                                grammar_state=state)

  out = run(jnp.array([int(grammar.starts[2]), -3], jnp.int32))
  assert int(out.error[0]) == 0 and int(out.num_new[0]) == 4
  assert int(out.error[1]) & ErrorCode.GRAMMAR and int(out.num_new[1]) == 0


def test_a_batch_split_over_a_mesh_gives_the_unsplit_tokens():
  """Data-parallel: prompts split over a mesh axis run one loop per shard (shard_map), the
  grammar tables replicated, each row's state its own; the result equals the unsplit run."""
  from jax.sharding import AxisType
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  which, prompts, lengths, params = _batch()
  rows = 8
  which, prompts, lengths = which[:rows], prompts[:rows], lengths[:rows]
  params = jax.tree.map(lambda a: a[:rows], params)
  grammar = _grammar()
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,))
  split = NamedSharding(mesh, P("data"))
  run = dict(max_new_tokens=24, params=params, eos_id=EOS, grammar=grammar)
  for loop in ("plain", "lookup"):
    outs = []
    for shard in (False, True):
      put = (lambda a: jax.device_put(a, split)) if shard else jnp.asarray
      args = (put(prompts), put(lengths), jax.random.key(5))
      state = put(np.asarray(start_states(grammar, which)))
      outs.append(generate(TARGET, *args, grammar_state=state, **run) if loop == "plain" else
                  speculative_generate(TARGET, PromptLookup(), *args, gamma=3,
                                       grammar_state=state, **run))
    np.testing.assert_array_equal(outs[1].tokens, outs[0].tokens)
    np.testing.assert_array_equal(outs[1].grammar.state, outs[0].grammar.state)


_FUZZ_ROWS = 6


@functools.cache
def _fuzz_loop():
  grammar = _grammar()

  @jax.jit
  def run(prompts, states, temperature, key):
    return speculative_generate(TARGET, PromptLookup(), prompts, jnp.full((_FUZZ_ROWS,), 3),
                                key, gamma=3, max_new_tokens=12, eos_id=EOS, grammar=grammar,
                                grammar_state=states,
                                params=SamplingParams(temperature=temperature))

  return run


@fuzz(25)
@given(seed=st.integers(0, 2**31 - 1),
       states=st.lists(st.integers(-5, 10_000), min_size=_FUZZ_ROWS, max_size=_FUZZ_ROWS),
       temperature=st.sampled_from([0.0, 0.7, 1.0, 5.0]))
def test_fuzzed_states_and_prompts_never_leave_the_grammar(seed, states, temperature):
  """Any traced initial state (inside the table, outside it, free) and any prompt ids: every id
  written stays in [0, V), a state outside the table sets GRAMMAR and writes nothing, and every
  other row's tokens walk its grammar without leaving it (host NumPy walk of the tables)."""
  grammar = jax.device_get(_grammar())
  prompts = np.random.default_rng(seed).integers(0, V, (_FUZZ_ROWS, 3)).astype(np.int32)
  states = np.asarray(states, np.int32)
  out = _fuzz_loop()(prompts, states, jnp.full((_FUZZ_ROWS,), temperature, jnp.float32),
                     jax.random.key(seed))
  tokens, lengths, error = (np.asarray(a) for a in (out.tokens, out.lengths, out.error))
  assert ((tokens == -1) | ((tokens >= 0) & (tokens < V))).all()
  for b in range(_FUZZ_ROWS):
    outside = not 0 <= states[b] < grammar.next_state.shape[0]
    assert bool(error[b] & ErrorCode.GRAMMAR) == outside, (b, states[b], error[b])
    if outside:
      assert lengths[b] == 3
      continue
    state = states[b]
    for t in tokens[b, 3:lengths[b]]:
      state = grammar.next_state[state, grammar.token_class[grammar.state_grammar[state], t]]
      assert state >= 0, (b, tokens[b])
