"""Structured generation in the loops: the law of whole constrained sequences, exactly.

A toy model (V = 6: ``a``, ``b``, ``ab``, ``c``, ``ba`` and EOS) samples under the regex
``(ab|ba){1,3}c?``. The law of whole sequences of plain constrained sampling is enumerated in
float64: each step's row masked by the compiled tables (NumPy, on the host), which are checked
against the *language* (its 28 strings, listed): a token the tables allow keeps the text a
prefix of a string of the language, EOS exactly where the text is one. (outlines-core's index
is sound but not complete: after ``a`` it allows ``b`` but not ``ba``, though ``aba`` starts
``abab``; the law follows the tables, the grammar plain sampling uses.) Every loop (plain,
chain with a model draft, prompt lookup, a static iid tree, EAGLE-2's dynamic tree) is
checked against it by chi-square with fixed seeds at a family-wise ``ALPHA = 0.01``
(Bonferroni over the five and a sixth: forced text two tokenizations spell, ``(c|ba)ab(c|ba)+``).
The grammar forces tokens here (``b`` after ``a``, EOS after ``c``): the chain loops propose
them with a point-mass ``q``.

Negative controls, each rejected at ``p < 1e-6``: the bonus position left unmasked, the draft
sampled outside the mask (its ``q`` reported masked), and the grammar state not rolled back
after a rejection (advanced past every proposal).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding import DynamicTree
from specdec_jax.decoding import PromptLookup
from specdec_jax.decoding import chain_loop
from specdec_jax.decoding import drafts
from specdec_jax.decoding import generate
from specdec_jax.decoding import request_rows
from specdec_jax.decoding import speculative_generate
from specdec_jax.decoding import tree_speculative_generate
from specdec_jax.decoding.request_rows import split_history
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model
from specdec_jax.structured import compile_regex
from specdec_jax.structured import next_state
from specdec_jax.structured import stack_grammars
from specdec_jax.structured import walk
from specdec_jax.theory import chi_square_test
from tests._helpers import longest_match_encoder
from tests._helpers import sequence_index

ALPHA = 0.01  # family-wise over the five loops and the forced-text test
V, EOS, NEW, GAMMA = 6, 5, 5, 2
TOKENS = [b"a", b"b", b"ab", b"c", b"ba", None]
LANGUAGE = {b"".join(p) + c for n in (1, 2, 3)
            for p in itertools.product([b"ab", b"ba"], repeat=n) for c in (b"", b"c")}
REGEX = r"(ab|ba){1,3}c?"


_encode = longest_match_encoder(TOKENS)


COMPILED = compile_regex(REGEX, TOKENS, EOS, encode=_encode)
GRAMMAR = stack_grammars([COMPILED], V)
#: Forced text with two spellings: every text starts "ab", spelled ``a`` + ``b`` or ``ab``; the
#: grammar proposes ``a`` (a point mass) where the target may prefer ``ab``.
FORCED_TEXT = compile_regex(r"(c|ba)ab(c|ba)+", TOKENS, EOS, encode=_encode)
COMPILED_BY_NAME = {"regex": COMPILED, "forced": FORCED_TEXT}
TARGET = make_toy_model(jax.random.key(30), V, scale=1.5, name="target")
DRAFT = make_toy_model(jax.random.key(31), V, context=1, scale=1.5, name="draft")
FEATURES = make_toy_feature_draft(TARGET, noise=1.0, key=jax.random.key(32))
PROMPT = np.array([0, 1, 3, 0, 1], np.int32)  # repeats: prompt lookup finds matches
ROWS = 6_000
PARAMS = SamplingParams(temperature=np.float32(1.0))


def language_mask(text: bytes) -> np.ndarray:
  """bool ``(V,)``: what the language allows after ``text`` (independent of the tables)."""
  mask = np.array([t is not None and any(s.startswith(text + t) for s in LANGUAGE)
                   for t in TOKENS])
  mask[EOS] = text in LANGUAGE
  return mask


def table_mask(tokens, compiled=COMPILED) -> np.ndarray:
  """bool ``(V,)``: what the compiled tables allow after ``tokens`` (host NumPy walk)."""
  state = compiled.initial_state
  for t in tokens:
    state = compiled.next_state[state, compiled.token_class[t]]
  return compiled.next_state[state, compiled.token_class] >= 0


def test_the_tables_are_sound_and_eos_exact():
  """Along every token sequence the tables allow (up to 6 tokens), each allowed token is one
  the language allows, and EOS is allowed exactly where the text is a whole string."""
  frontier, checked = [[]], 0
  for _ in range(6):
    grown = []
    for tokens in frontier:
      mask, truth = table_mask(tokens), language_mask(text_of(tokens))
      assert not (mask & ~truth).any(), (tokens, mask, truth)
      assert mask[EOS] == truth[EOS], tokens
      assert mask[:EOS].any() or mask[EOS], tokens  # no dead end
      grown += [[*tokens, int(t)] for t in np.flatnonzero(mask[:EOS])]
      checked += 1
    frontier = grown
  assert checked > 50


def text_of(tokens) -> bytes:
  return b"".join(TOKENS[t] for t in tokens if 0 <= t < EOS)


@functools.cache
def exact_law(name: str = "regex") -> np.ndarray:
  """P(outcome) over the ``V ** NEW`` sequences (after EOS every slot reads EOS) under the
  grammar ``COMPILED_BY_NAME[name]``."""
  compiled = COMPILED_BY_NAME[name]
  conts = np.array(list(itertools.product(range(V), repeat=NEW)), np.int32)
  seqs = np.concatenate([np.tile(PROMPT, (len(conts), 1)), conts], axis=1)
  positions = np.broadcast_to(np.arange(seqs.shape[1], dtype=np.int32), seqs.shape)
  logits, _ = TARGET.apply(TARGET.params, jnp.asarray(seqs), jnp.asarray(positions),
                           TARGET.init_cache(*seqs.shape))
  logits = np.asarray(logits, np.float64)
  law = np.zeros(len(conts))
  for n, cont in enumerate(conts):
    p, ended = 1.0, False
    for i in range(NEW):
      if ended:
        p *= cont[i] == EOS
        continue
      row = np.exp(logits[n, len(PROMPT) - 1 + i] - logits[n, len(PROMPT) - 1 + i].max())
      row = np.where(table_mask(cont[:i], compiled), row, 0.0)
      p *= row[cont[i]] / row.sum()
      ended = cont[i] == EOS
      if p == 0:
        break
    law[n] = p
  return law / law.sum()


def _run(kind: str, key: jax.Array, params=PARAMS, rows: int = ROWS, grammar=GRAMMAR):
  prompts = np.tile(PROMPT, (rows, 1))
  lengths = np.full((rows,), len(PROMPT), np.int32)
  run = dict(max_new_tokens=NEW, params=params, eos_id=EOS, grammar=grammar)
  if kind == "plain":
    return generate(TARGET, prompts, lengths, key, **run)
  if kind == "tree":
    return tree_speculative_generate(TARGET, DRAFT, prompts, lengths, key, law="iid",
                                     tree=DraftTree.from_branching((2, 1)), **run)
  if kind == "dynamic":
    return tree_speculative_generate(TARGET, FEATURES, prompts, lengths, key,
                                     tree=DynamicTree(2, 2, 3), **run)
  draft = {"model": DRAFT, "lookup": PromptLookup(max_ngram=2)}[kind]
  return speculative_generate(TARGET, draft, prompts, lengths, key, gamma=GAMMA, **run)


KINDS = ("plain", "model", "lookup", "tree", "dynamic")


@functools.cache
def _out(kind: str):
  return _run(kind, jax.random.key(900 + KINDS.index(kind)))


def _chi_square(out, name: str = "regex") -> tuple[float, str]:
  new = np.asarray(out.tokens)[:, len(PROMPT):len(PROMPT) + NEW]
  new = np.where(new < 0, EOS, new)  # pad after EOS
  counts = np.bincount(sequence_index(new, V), minlength=V ** NEW)
  _, _, pvalue, detail = chi_square_test(counts, exact_law(name))
  return pvalue, detail


def _check_valid(out) -> None:
  """Every output is inside the language: a prefix of one of its strings, a whole string
  where the row ended with EOS; ``complete`` exactly where the text is a whole string."""
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  complete = np.asarray(out.grammar.complete)
  for b in range(tokens.shape[0]):
    new = tokens[b, len(PROMPT):lengths[b]].tolist()
    text = text_of(new)
    assert any(s.startswith(text) for s in LANGUAGE), (b, new)
    ended = bool(new) and new[-1] == EOS
    assert bool(complete[b]) == (text in LANGUAGE), (b, new)
    assert not ended or text in LANGUAGE, (b, new)


@pytest.mark.parametrize("kind", KINDS)
def test_constrained_sequences_follow_the_enumerated_law(kind):
  """Chi-square over the ``6 ** 5`` sequences at ALPHA / 5; every output valid."""
  out = _out(kind)
  np.testing.assert_array_equal(out.error, 0)
  _check_valid(out)
  law = exact_law()
  assert (law > 0).sum() > 20 and (law == 0).sum() > len(law) / 2
  if kind in ("model", "lookup"):  # forced tokens were proposed and accepted
    forced, taken = np.asarray(out.grammar.forced), np.asarray(out.grammar.forced_accepted)
    assert forced.sum() > ROWS / 2 and 0 < taken.sum() <= forced.sum()
  pvalue, detail = _chi_square(out)
  assert pvalue >= ALPHA / (len(KINDS) + 1), f"{kind}: chi-square p = {pvalue:.3g}; {detail}"


def test_forced_text_proposals_follow_the_law():
  """Forced text two tokenizations spell (``ab`` after ``c`` or ``ba``): the chain proposes the
  grammar's ``a`` with a point-mass ``q`` (not the draft's masked draw over ``a`` and ``ab``);
  the target takes
  ``ab`` often enough that some are rejected, and the law of whole sequences is still plain
  constrained sampling's (chi-square at ALPHA / 6)."""
  grammar = stack_grammars([FORCED_TEXT], V)
  assert int(FORCED_TEXT.forced[FORCED_TEXT.next_state[0, FORCED_TEXT.token_class[3]]]) == 0
  assert table_mask([3], FORCED_TEXT)[[0, 2]].all()  # after "c": "a" (forced) or "ab"
  out = _run("model", jax.random.key(990), grammar=grammar)
  np.testing.assert_array_equal(out.error, 0)
  forced, taken = np.asarray(out.grammar.forced), np.asarray(out.grammar.forced_accepted)
  assert 0 < taken.sum() < forced.sum()
  pvalue, detail = _chi_square(out, "forced")
  assert pvalue >= ALPHA / (len(KINDS) + 1), f"forced text: chi-square p = {pvalue:.3g}; {detail}"


def test_the_forced_tokens_are_the_grammars():
  """The compiled tables force ``b`` after ``a`` and EOS after ``c``; after ``ab`` nothing is
  forced (EOS is allowed there)."""
  state = GRAMMAR.starts[1]
  after_a = next_state(GRAMMAR, state, 0)
  assert int(GRAMMAR.forced[after_a]) == 1
  after_c = walk(GRAMMAR, state, jnp.array([2, 3]), 2)[-1]
  assert int(GRAMMAR.forced[after_c]) == EOS and bool(GRAMMAR.final[after_c])
  assert int(GRAMMAR.forced[walk(GRAMMAR, state, jnp.array([2]), 1)[-1]]) == -1


def _control(monkeypatch, patches, kind="model"):
  for module, name, value in patches:
    monkeypatch.setattr(module, name, value)
  chain_loop.speculative_loop.clear_cache()  # trace the loop again, with the bug
  try:
    return _run(kind, jax.random.key(950))
  finally:
    chain_loop.speculative_loop.clear_cache()  # no later call may reuse the buggy program


def test_the_bonus_position_unmasked_is_rejected(monkeypatch):
  """Negative control: the target's bonus row (after all ``gamma`` proposals) read without the
  grammar mask, as vLLM #44292 shipped. The loop's last guard cuts the tokens the grammar
  refuses (GRAMMAR), so nothing invalid is written, but the law is wrong."""
  real = request_rows.row_bitmask

  def unmasked_bonus(history, owners, prefix, prefix_len):
    mask = real(history, owners, prefix, prefix_len)
    if mask is None or prefix is None:
      return mask
    return jnp.where((prefix_len == GAMMA)[:, None], -1, mask)

  out = _control(monkeypatch, [(request_rows, "row_bitmask", unmasked_bonus)])
  _check_valid(out)
  pvalue, detail = _chi_square(out)
  assert pvalue < 1e-6, f"an unmasked bonus row went undetected (p = {pvalue:.3g}); {detail}"


def test_a_draft_sampled_outside_the_mask_is_rejected(monkeypatch):
  """Negative control: the draft draws its token from its unmasked distribution while the
  ``q`` handed to the verifier is the masked one (the mask applied after sampling)."""
  real = drafts.draft_sampler

  def sampler(step_keys, params, vocab, vocab_ids=None, history=None):
    masked = real(step_keys, params, vocab, vocab_ids, history)
    free = real(step_keys, params, vocab, vocab_ids, split_history(history)[0])

    def sample(j, logits, proposed=None):
      return free(j, logits, proposed)[0], masked(j, logits, proposed)[1]

    return sample

  out = _control(monkeypatch, [(drafts, "draft_sampler", sampler)])
  pvalue, detail = _chi_square(out)
  assert pvalue < 1e-6, f"a draft outside the mask went undetected (p = {pvalue:.3g}); {detail}"


def test_a_state_not_rolled_back_is_rejected(monkeypatch):
  """Negative control: the grammar state advanced past every proposal (committed before the
  verifier decided), then past the emitted token after them."""
  seen, real_positions, real_after = {}, chain_loop.forced_positions, chain_loop.after_verify

  def positions(grammar, state, draft, eos_id):
    seen["draft"] = draft
    return real_positions(grammar, state, draft, eos_id)

  def after_verify(s, result, common, **kwargs):
    new = real_after(s, result, common, **kwargs)
    draft = seen["draft"]
    gamma = draft.shape[1]
    moved = jax.vmap(lambda st, t: walk(common.grammar, st, t, jnp.int32(gamma))[-1])(
      s.grammar, draft)
    last = result.tokens[jnp.arange(draft.shape[0]), jnp.maximum(result.num_tokens - 1, 0)]
    wrong = next_state(common.grammar, moved, last)
    return new._replace(grammar=jnp.where(~s.done, wrong, new.grammar))

  out = _control(monkeypatch, [(chain_loop, "forced_positions", positions),
                               (chain_loop, "after_verify", after_verify)])
  pvalue, detail = _chi_square(out)
  assert pvalue < 1e-6, f"a state not rolled back went undetected (p = {pvalue:.3g}); {detail}"


@pytest.mark.parametrize("kind", KINDS[1:])
def test_greedy_rows_equal_plain_constrained_greedy(kind):
  """Temperature 0: every loop writes plain constrained greedy's tokens, rows with different
  prompts (and so different argmax chains) side by side."""
  greedy = SamplingParams(temperature=np.float32(0.0))
  rows = 16
  rng = np.random.default_rng(3)
  prompts = rng.integers(0, EOS, (rows, len(PROMPT))).astype(np.int32)
  lengths = np.full((rows,), len(PROMPT), np.int32)
  run = dict(max_new_tokens=NEW + 2, params=greedy, eos_id=EOS, grammar=GRAMMAR)
  plain = generate(TARGET, prompts, lengths, jax.random.key(1), **run)
  if kind in ("tree", "dynamic"):
    tree = DraftTree.from_branching((2, 1)) if kind == "tree" else DynamicTree(2, 2, 3)
    fast = tree_speculative_generate(TARGET, DRAFT if kind == "tree" else FEATURES, prompts,
                                     lengths, jax.random.key(1), tree=tree, **run)
  else:
    draft = DRAFT if kind == "model" else PromptLookup(max_ngram=2)
    fast = speculative_generate(TARGET, draft, prompts, lengths, jax.random.key(1),
                                gamma=GAMMA, **run)
  np.testing.assert_array_equal(fast.tokens, plain.tokens)
  np.testing.assert_array_equal(fast.grammar.complete, plain.grammar.complete)
  assert np.asarray(plain.grammar.complete).any()
