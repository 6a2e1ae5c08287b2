"""Decoding loops: greedy agreement, sampling exactness, ragged batches, stops, stats, retracing.

Toy models (:mod:`specdec_jax.models.toy`) follow the model protocol exactly (a cache
slot per position, rollback by length) and make the target's sequence distribution
enumerable: the logits after position ``t`` depend only on the tokens at ``t - 1`` and ``t``.

Chi-square tests use fixed seeds and a family-wise ``ALPHA = 0.01`` over the exactness
tests of this module (Bonferroni); each negative control must be rejected at ``1e-6``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import ErrorCode
from specdec_jax import SamplingParams
from specdec_jax import verify
from specdec_jax.decoding import VERIFIERS
from specdec_jax.decoding import DecodeStats
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding import PromptLookup
from specdec_jax.decoding import generate
from specdec_jax.decoding import speculative_generate
from specdec_jax.decoding import tree_speculative_generate
from specdec_jax.decoding.drafts import lookup_row
from specdec_jax.models import Model
from specdec_jax.models.toy import make_toy_model
from tests._helpers import TOY_PROMPT_LENGTHS
from tests._helpers import TOY_PROMPTS
from tests.decoding import _exact as exact

ALPHA = 0.01
NUM_EXACT_TESTS = 3  # two speculative drafts and the plain baseline
GREEDY = SamplingParams(temperature=0.0)
GAMMAS = (1, 2, 5)  # the smallest, a small one and a long one

# Greedy and ragged tests: V = 16, prompts of lengths 1 .. 6 (right-padded with junk).
V = 16
TRACES = [0]  # how often the target's (and NEAR's) apply has been traced


def _counting(model: Model) -> Model:
  def apply(params, tokens, positions, cache):
    TRACES[0] += 1
    return model.apply(params, tokens, positions, cache)

  return model._replace(apply=apply)


TARGET = _counting(make_toy_model(jax.random.key(0), V, name="target"))
SMALL = make_toy_model(jax.random.key(1), V, context=1, name="draft")
# The draft is the target's table, perturbed: it agrees often, not always (ragged acceptance).
NEAR = Model({"table": TARGET.params["table"] + 1.5 * jax.random.normal(
  jax.random.key(2), TARGET.params["table"].shape)}, TARGET.apply, TARGET.init_cache, V, "near")
PROMPTS, PROMPT_LENGTHS = TOY_PROMPTS, TOY_PROMPT_LENGTHS
MAX_NEW = 12
DRAFTS = {"model": NEAR, "lookup": PromptLookup(max_ngram=3)}


def _model_draft(gamma: int) -> Model:
  """Two different draft models across the gammas (each gamma is one compilation)."""
  return SMALL if gamma % 2 == 0 else NEAR


@functools.cache
def _plain_greedy():
  return generate(TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), max_new_tokens=MAX_NEW,
                  params=GREEDY)


@functools.cache
def _spec_greedy(kind: str, gamma: int):
  draft = _model_draft(gamma) if kind == "model" else DRAFTS[kind]
  return speculative_generate(TARGET, draft, PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                              gamma=gamma, max_new_tokens=MAX_NEW, params=GREEDY)


def _check_stats(stats: DecodeStats, num_new, gamma: int, draft_kind: str | None,
                 eos: bool = False):
  """Invariants every run satisfies (and exact bookkeeping when no eos cut a step)."""
  s = jax.tree.map(np.asarray, stats)
  num_new = np.asarray(num_new)
  np.testing.assert_array_equal(s.emitted, num_new)
  np.testing.assert_allclose(s.tokens_per_call, num_new / np.maximum(s.row_target_calls, 1),
                             rtol=1e-6)
  assert int(s.target_calls) == s.row_target_calls.max()
  np.testing.assert_array_equal(s.accepted, s.accepted_at.sum(-1))
  np.testing.assert_array_equal(s.proposals, s.proposed_at.sum(-1))
  assert (s.accepted_at <= s.proposed_at).all()
  assert (np.diff(s.accepted_at, axis=-1) <= 0).all()  # accepted at i needs accepted before i
  assert s.accepted_at.shape == (num_new.shape[0], gamma)
  if not eos:
    # The prefill emits one token; each verification emits accepted + 1 tokens.
    np.testing.assert_array_equal(num_new, s.row_target_calls + s.accepted)
  if draft_kind == "model":
    assert int(s.draft_calls) == 1 + gamma * (int(s.target_calls) - 1)
  else:
    assert int(s.draft_calls) == 0


# ---------------------------------------------------------------------------------------------
# Greedy: speculative output is the plain greedy output, token for token.


def test_plain_greedy_is_argmax_chain():
  """generate at temperature 0 follows the argmax of the toy table, row by row."""
  out = _plain_greedy()
  table = np.asarray(TARGET.params["table"])
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  np.testing.assert_array_equal(out.num_new, MAX_NEW)
  np.testing.assert_array_equal(lengths, PROMPT_LENGTHS + MAX_NEW)
  for b in range(len(PROMPTS)):
    row = tokens[b, : lengths[b]]
    np.testing.assert_array_equal(row[: PROMPT_LENGTHS[b]], PROMPTS[b, : PROMPT_LENGTHS[b]])
    assert (tokens[b, lengths[b]:] == -1).all()
    for t in range(PROMPT_LENGTHS[b], lengths[b]):
      prev = row[t - 2] if t >= 2 else V
      assert row[t] == np.argmax(table[prev, row[t - 1]])
  assert int(out.stats.target_calls) == MAX_NEW
  np.testing.assert_array_equal(out.stats.row_target_calls, MAX_NEW)


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_greedy_speculative_equals_plain(kind):
  plain = _plain_greedy()
  accepted = 0
  for gamma in GAMMAS:
    out = _spec_greedy(kind, gamma)
    np.testing.assert_array_equal(out.tokens, plain.tokens, err_msg=f"{kind}, gamma={gamma}")
    np.testing.assert_array_equal(out.lengths, plain.lengths)
    np.testing.assert_array_equal(out.num_new, MAX_NEW)
    np.testing.assert_array_equal(out.error, 0)
    _check_stats(out.stats, out.num_new, gamma, kind)
    accepted += int(out.stats.accepted.sum())
  assert accepted > 0, "the draft never helped: the test would not exercise acceptance"


def test_draft_equal_to_target_accepts_everything():
  plain = _plain_greedy()
  same = speculative_generate(TARGET, TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), gamma=3,
                              max_new_tokens=MAX_NEW, params=GREEDY)
  np.testing.assert_array_equal(same.tokens, plain.tokens)
  # 1 prefill token, then 11 tokens in steps of 4, 4, 3 (the last one cut to the budget).
  np.testing.assert_array_equal(same.stats.row_target_calls, 4)
  np.testing.assert_array_equal(same.stats.proposals, [3 + 3 + 2] * len(PROMPTS))
  np.testing.assert_array_equal(same.stats.proposals, same.stats.accepted)
  np.testing.assert_allclose(same.stats.tokens_per_call, MAX_NEW / 4)
  _check_stats(same.stats, same.num_new, 3, "model")


def test_mixed_params_per_row():
  """Per-row temperatures: the greedy rows of a mixed batch equal plain greedy."""
  temperature = jnp.array([0.0, 1.0, 0.0, 0.7, 0.0, 1.3], jnp.float32)
  plain = _plain_greedy()
  for draft in (NEAR, PromptLookup()):
    out = speculative_generate(TARGET, draft, PROMPTS, PROMPT_LENGTHS, jax.random.key(5), gamma=3,
                               max_new_tokens=MAX_NEW, params=SamplingParams(temperature))
    greedy_rows = np.asarray(temperature) == 0
    np.testing.assert_array_equal(np.asarray(out.tokens)[greedy_rows],
                                  np.asarray(plain.tokens)[greedy_rows])
    np.testing.assert_array_equal(out.num_new, MAX_NEW)


#: Per-row temperature, top-k and top-p, greedy rows mixed in (the engines' input).
MIXED = SamplingParams(np.array([0.0, 1.0, 0.0, 0.7, 0.9, 1.3], np.float32),
                       np.array([0, 5, 3, 0, 8, 0], np.int32),
                       np.array([1.0, 0.9, 1.0, 0.8, 1.0, 0.95], np.float32))


@pytest.mark.parametrize("name, draft", [("token", NEAR), ("block", PromptLookup())],
                         ids=["token-model", "block-lookup"])
def test_named_verifiers_read_the_logits_lazily_and_agree_with_processed_rows(name, draft):
  """The named verifiers run on lazily processed target logits (the candidate selection's
  ``top_k`` is in the program, no processed ``(B, gamma + 1, V)`` array is made); a function
  verifier gets the processed probabilities. With the same keys both give the same tokens."""
  named = VERIFIERS[name]

  def as_function(p, q, draft, uniforms, *, num_draft):
    return named(p, q, draft, uniforms, num_draft=num_draft)

  def run(verifier):
    return speculative_generate(TARGET, draft, PROMPTS, PROMPT_LENGTHS, jax.random.key(5),
                                gamma=3, max_new_tokens=MAX_NEW, params=MIXED, verifier=verifier)

  lazy, eager = run(name), run(as_function)
  for field in ("tokens", "num_new", "error"):
    np.testing.assert_array_equal(getattr(lazy, field), getattr(eager, field), err_msg=field)
  np.testing.assert_array_equal(lazy.stats.accepted_at, eager.stats.accepted_at)
  np.testing.assert_array_equal(lazy.error, 0)
  assert "top_k" in str(jax.make_jaxpr(lambda: run(name))())
  assert "top_k" not in str(jax.make_jaxpr(lambda: run(as_function))())


# ---------------------------------------------------------------------------------------------
# Sampling exactness: the distribution of whole generated sequences.

# The shared setup (tests/decoding/_exact.py); prompt lookup's cell truncates by top-p, the
# plain baseline not at all.
EXACT_PARAMS = {
  "model": exact.PARAMS,
  "lookup": SamplingParams(0.8, top_p=0.9),
  "plain": SamplingParams(0.8),
}


def _wrong_q_verifier(kind: str):
  """A verifier handed a q that is not the law the draft sampled from (negative control)."""

  def wrong(p, q, draft, uniforms, *, num_draft):
    if kind == "model":  # q at temperature 0.8 / 2: the tokens came from 0.8
      q = q**2 / jnp.sum(q**2, axis=-1, keepdims=True)
    else:  # a uniform q instead of the point mass
      q = jnp.full_like(q, 1.0 / q.shape[-1])
    return verify(p, q, draft, uniforms, num_draft=num_draft)

  return wrong


_WRONG = {kind: _wrong_q_verifier(kind) for kind in ("model", "lookup")}


def _sample_sequences(kind: str, verifier, seed: int):
  draft = exact.DRAFT if kind == "model" else PromptLookup(max_ngram=2)
  return speculative_generate(exact.TARGET, draft, *exact.batch(), jax.random.key(seed), gamma=2,
                              max_new_tokens=exact.NEW, params=EXACT_PARAMS[kind],
                              verifier=verifier)


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_sampled_sequences_follow_target(kind):
  assert (exact.probs(EXACT_PARAMS[kind]) == 0).sum() > 0  # truncation removed some sequences
  out = _sample_sequences(kind, "token", seed=100 + len(kind))
  np.testing.assert_array_equal(out.error, 0)
  _check_stats(out.stats, out.num_new, 2, kind)
  stats = jax.tree.map(np.asarray, out.stats)
  # Every path is exercised: rejections, acceptances, full acceptances with a bonus token.
  assert (stats.accepted == 0).any() and (stats.accepted_at[:, 1] > 0).any()
  assert (stats.row_target_calls > 2).any()
  _, _, pvalue, detail = exact.chi_square(out, EXACT_PARAMS[kind])
  assert pvalue >= ALPHA / NUM_EXACT_TESTS, f"{kind}: chi-square p = {pvalue:.3g}; {detail}"


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_wrong_q_is_detected(kind):
  """Negative control: the same check rejects verification with the wrong q."""
  out = _sample_sequences(kind, _WRONG[kind], seed=200 + len(kind))
  _, _, pvalue, detail = exact.chi_square(out, EXACT_PARAMS[kind])
  assert pvalue < 1e-6, f"{kind}: the wrong q went undetected (p = {pvalue:.3g}); {detail}"


def test_plain_sampling_follows_target():
  """The baseline itself: generate's sequences follow the enumerated distribution."""
  out = generate(exact.TARGET, *exact.batch(), jax.random.key(300), max_new_tokens=exact.NEW,
                 params=EXACT_PARAMS["plain"])
  _, _, pvalue, detail = exact.chi_square(out, EXACT_PARAMS["plain"])
  assert pvalue >= ALPHA / NUM_EXACT_TESTS, f"generate: chi-square p = {pvalue:.3g}; {detail}"


# ---------------------------------------------------------------------------------------------
# Ragged batches, stops and budgets.


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_ragged_batch_rows_are_independent(kind):
  """Sampled rows accept different numbers of tokens; each row depends only on its own key.

  The batch is run again with its rows (and their keys) in reverse order, and for the
  model draft each row also alone (batch of 1): every row comes out the same.
  """
  keys = jax.random.split(jax.random.key(7), len(PROMPTS))
  run = functools.partial(speculative_generate, TARGET, DRAFTS[kind], gamma=3,
                          max_new_tokens=MAX_NEW, params=SamplingParams(0.9))
  batch = run(PROMPTS, PROMPT_LENGTHS, keys)
  assert len(set(np.asarray(batch.stats.accepted).tolist())) > 1, "the batch was not ragged"
  assert len(set(np.asarray(batch.stats.row_target_calls).tolist())) > 1
  np.testing.assert_array_equal(batch.num_new, MAX_NEW)
  _check_stats(batch.stats, batch.num_new, 3, kind)
  flipped = run(PROMPTS[::-1].copy(), PROMPT_LENGTHS[::-1].copy(), keys[::-1])
  np.testing.assert_array_equal(np.asarray(flipped.tokens)[::-1], batch.tokens)
  np.testing.assert_array_equal(np.asarray(flipped.stats.accepted_at)[::-1],
                                batch.stats.accepted_at)
  if kind == "model":
    for b in range(len(PROMPTS)):
      alone = run(PROMPTS[b : b + 1], PROMPT_LENGTHS[b : b + 1], keys[b : b + 1])
      np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b], err_msg=f"row {b}")
      assert int(alone.stats.accepted[0]) == int(batch.stats.accepted[b])
  # The first token comes from the prefill with the same key use as generate.
  plain = generate(TARGET, PROMPTS, PROMPT_LENGTHS, keys, max_new_tokens=MAX_NEW,
                   params=SamplingParams(0.9))
  rows = np.arange(len(PROMPTS))
  np.testing.assert_array_equal(np.asarray(batch.tokens)[rows, PROMPT_LENGTHS],
                                np.asarray(plain.tokens)[rows, PROMPT_LENGTHS])


@pytest.mark.parametrize("kind", ["model", "lookup"])
def test_eos_stops_rows(kind):
  plain = np.asarray(_plain_greedy().tokens)
  # An eos that some rows emit (at different steps) and some never do.
  new = [plain[b, PROMPT_LENGTHS[b] : PROMPT_LENGTHS[b] + MAX_NEW] for b in range(len(PROMPTS))]
  counts = np.bincount(np.concatenate([np.unique(r) for r in new]), minlength=V)
  eos = int(np.argmax(np.where(counts < len(PROMPTS), counts, 0)))
  out = speculative_generate(TARGET, DRAFTS[kind], PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                             gamma=3, max_new_tokens=MAX_NEW, params=GREEDY, eos_id=eos)
  ref = generate(TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), max_new_tokens=MAX_NEW,
                 params=GREEDY, eos_id=eos)
  stopped = 0
  for b, row in enumerate(new):
    hits = np.flatnonzero(row == eos)
    expect = hits[0] + 1 if len(hits) else MAX_NEW
    stopped += bool(len(hits))
    assert int(out.num_new[b]) == expect, f"row {b}"
    length = PROMPT_LENGTHS[b] + expect
    np.testing.assert_array_equal(np.asarray(out.tokens)[b, :length], plain[b, :length])
    assert (np.asarray(out.tokens)[b, length:] == -1).all()
  assert 0 < stopped < len(PROMPTS)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  _check_stats(out.stats, out.num_new, 3, kind, eos=True)


def test_max_len_and_small_budgets():
  """A buffer shorter than prompt + max_new_tokens: raises when the lengths are concrete; with
  traced lengths each row stops when it is full and says so (``OUT_OF_ROOM``).

  With ``max_len = 7`` the rows get 1 (the prefill token only), 2, 4 and 6 new tokens:
  budgets at and below ``gamma + 1``, where the proposals are cut to fit.
  """
  plain = np.asarray(_plain_greedy().tokens)
  max_len = 7
  common = dict(max_new_tokens=MAX_NEW, params=GREEDY, max_len=max_len)
  for fn in (generate, functools.partial(speculative_generate, draft=NEAR, gamma=5)):
    with pytest.raises(ValueError, match=r"`max_len` = 7 has no room for the longest prompt"):
      fn(TARGET, prompt_tokens=PROMPTS, prompt_lengths=PROMPT_LENGTHS, key=jax.random.key(0),
         **common)
  gen = jax.jit(lambda lengths: generate(TARGET, PROMPTS, lengths, jax.random.key(0), **common))(
    PROMPT_LENGTHS)
  spec = jax.jit(lambda lengths: speculative_generate(
    TARGET, NEAR, PROMPTS, lengths, jax.random.key(0), gamma=5, **common))(PROMPT_LENGTHS)
  expected = np.minimum(PROMPT_LENGTHS + MAX_NEW, max_len)
  cut = PROMPT_LENGTHS + MAX_NEW > max_len
  for out in (gen, spec):
    assert out.tokens.shape == (len(PROMPTS), max_len)
    np.testing.assert_array_equal(out.lengths, expected)
    np.testing.assert_array_equal(out.num_new, expected - PROMPT_LENGTHS)
    np.testing.assert_array_equal(out.tokens, plain[:, :max_len])
    np.testing.assert_array_equal(out.error, np.where(cut, int(ErrorCode.OUT_OF_ROOM), 0))
  _check_stats(spec.stats, spec.num_new, 5, "model")
  np.testing.assert_array_equal(spec.stats.row_target_calls[PROMPT_LENGTHS == 6], 1)
  np.testing.assert_array_equal(spec.stats.proposals[PROMPT_LENGTHS == 6], 0)
  assert int(spec.stats.target_calls) == spec.stats.row_target_calls.max()


# ---------------------------------------------------------------------------------------------
# Prompt lookup proposals.


LOOKUP_CASES = [
  # (row, length, max_ngram, expected proposals for gamma = 5)
  ([1, 2, 3, 9, 1, 2], 6, 3, [3, 9, 1, 2, 3]),  # 2-gram [1, 2] at 0: what followed, periodic
  ([1, 2, 3, 1, 2, 5, 7, 1, 2], 9, 3, [5, 7, 1, 2, 5]),  # the most recent occurrence wins
  ([4, 1, 2, 8, 3, 1, 2, 6, 4, 1, 2], 11, 3, [8, 3, 1, 2, 6]),  # the 3-gram [4, 1, 2] first
  ([4, 1, 2, 8, 3, 1, 2, 6, 4, 1, 2], 11, 2, [6, 4, 1, 2, 6]),  # without it, [1, 2] at 5
  ([5, 6, 7], 3, 3, [7, 7, 7, 7, 7]),  # no match: repeat the last token
  ([5, 5, 5, 5], 4, 3, [5, 5, 5, 5, 5]),
  ([3], 1, 3, [3, 3, 3, 3, 3]),  # length 1
]


def test_lookup_proposals():
  lookup = jax.jit(lookup_row, static_argnums=(2, 3))
  for row, length, max_ngram, expected in LOOKUP_CASES:
    # Junk after the row's length must not matter (it may hold stale tokens).
    padded = jnp.asarray(row + [1, 2, 3, 9, 4, 1, 2, 8][: 12 - len(row)], jnp.int32)
    got, found = lookup(padded, jnp.int32(length), PromptLookup(max_ngram=max_ngram), 5)
    assert got.tolist() == expected, (row, max_ngram)
    assert bool(found) == (expected != [row[length - 1]] * 5 or row == [5, 5, 5, 5]), row


# ---------------------------------------------------------------------------------------------
# Compilation and arguments.


def test_no_retrace_on_second_call():
  """New values of every traced argument (prompts, lengths, keys, params, eos, weights)."""
  run = functools.partial(speculative_generate, TARGET, NEAR, gamma=3, max_new_tokens=MAX_NEW)
  run(PROMPTS, PROMPT_LENGTHS, jax.random.key(0), params=SamplingParams(0.5))
  generate(TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), max_new_tokens=MAX_NEW)
  traced = TRACES[0]
  assert traced > 0
  run(PROMPTS[::-1].copy(), PROMPT_LENGTHS[::-1].copy(), jax.random.key(1),
      params=SamplingParams(jnp.linspace(0, 1, len(PROMPTS))), eos_id=3)
  moved = NEAR._replace(params=jax.tree.map(lambda x: x + 1, NEAR.params))
  speculative_generate(TARGET, moved, PROMPTS, PROMPT_LENGTHS, jax.random.key(2), gamma=3,
                       max_new_tokens=MAX_NEW, params=SamplingParams(0.0), eos_id=4)
  generate(TARGET, PROMPTS[::-1].copy(), PROMPT_LENGTHS, jax.random.key(9),
           max_new_tokens=MAX_NEW, params=SamplingParams(0.3), eos_id=2)
  assert TRACES[0] == traced


def test_a_lambda_verifier_written_at_the_call_site_compiles_once():
  from specdec_jax.decoding.chain import speculative_loop

  def run(pad):
    return speculative_generate(
      TARGET, NEAR, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), gamma=3, max_new_tokens=MAX_NEW,
      verifier=lambda p, q, d, u, num_draft: verify(p, q, d, u, num_draft=num_draft,
                                                    pad_id=pad))

  first = run(-1)
  size = speculative_loop._cache_size()
  second = run(-1)  # a new lambda object, the same code and captured value: no recompilation
  assert speculative_loop._cache_size() == size
  np.testing.assert_array_equal(np.asarray(first.tokens), np.asarray(second.tokens))
  run(-2)  # another captured value is another function: compiled anew
  assert speculative_loop._cache_size() == size + 1


def test_bad_arguments():
  args = (TARGET, NEAR, PROMPTS, PROMPT_LENGTHS, jax.random.key(0))
  with pytest.raises(ValueError, match="gamma"):
    speculative_generate(*args, gamma=0, max_new_tokens=4)
  with pytest.raises(ValueError, match="verifier"):
    speculative_generate(*args, gamma=2, max_new_tokens=4, verifier="no-such-verifier")
  with pytest.raises(ValueError, match="vocabulary"):
    speculative_generate(TARGET, make_toy_model(jax.random.key(0), V + 1), *args[2:], gamma=2,
                         max_new_tokens=4)
  with pytest.raises(ValueError, match="prompt_lengths"):
    speculative_generate(TARGET, NEAR, PROMPTS, PROMPT_LENGTHS * 0, args[-1], gamma=2,
                         max_new_tokens=4)
  with pytest.raises(ValueError, match="max_len"):
    generate(TARGET, PROMPTS, PROMPT_LENGTHS, args[-1], max_new_tokens=4, max_len=3)
  with pytest.raises(ValueError, match="temperature"):
    generate(TARGET, PROMPTS, PROMPT_LENGTHS, args[-1], max_new_tokens=4,
             params=SamplingParams(-1.0))
  with pytest.raises(ValueError, match="min_ngram"):
    speculative_generate(TARGET, PromptLookup(2, 3), *args[2:], gamma=2, max_new_tokens=4)
  with pytest.raises(TypeError, match="Model"):
    generate("model", PROMPTS, PROMPT_LENGTHS, args[-1], max_new_tokens=4)
  assert VERIFIERS["token"] is verify


@pytest.mark.parametrize(("arg", "value"), [
  ("gamma", True), ("gamma", 2.0), ("gamma", "3"), ("chunk_iterations", 0),
  ("chunk_iterations", "4"), ("chunk_iterations", True), ("chunk_iterations", 2.5),
  ("max_new_tokens", True), ("max_new_tokens", np.float32(4)),
])
def test_static_counts_are_checked_not_coerced(arg, value):
  """``gamma=True`` once ran as gamma 1, and ``chunk_iterations`` was checked only with
  ``on_tokens``: each is refused, streaming or not."""
  kwargs = dict(gamma=2, max_new_tokens=4) | {arg: value}
  message = rf"speculative_generate: `{arg}` must be an int >= 1, got {re.escape(repr(value))}"
  with pytest.raises(ValueError, match=message):
    speculative_generate(TARGET, NEAR, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), **kwargs)


def test_the_other_loops_check_their_static_ints_alike():
  args = (PROMPTS, PROMPT_LENGTHS, jax.random.key(0))
  with pytest.raises(ValueError, match=r"generate: `max_new_tokens` must be an int >= 1, got True"):
    generate(TARGET, *args, max_new_tokens=True)
  with pytest.raises(ValueError, match=r"generate: `max_len` must be an int >= P"):
    generate(TARGET, *args, max_new_tokens=4, max_len=True)
  with pytest.raises(ValueError, match=r"tree_speculative_generate: `max_new_tokens` must be an "
                                       r"int >= 1, got '4'"):
    tree_speculative_generate(TARGET, SMALL, *args, tree=DraftTree.from_branching((2,)),
                              max_new_tokens="4")
  with pytest.raises(ValueError, match=r"tree_speculative_generate: `pad_id` must be a static int"):
    tree_speculative_generate(TARGET, SMALL, *args, tree=DraftTree.from_branching((2,)),
                              max_new_tokens=4, pad_id=True)
