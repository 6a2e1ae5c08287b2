"""The decoding loops with every sampling parameter: penalties, bias, bans, ``min_tokens``,
allowed ids and ``min_p`` beside temperature / top-k, and logprobs of the generated tokens.

A row's history is its buffer: the prompt (repetition penalty) and the tokens it generated
(penalty counts, ``min_tokens``'s count, bad words' prefixes); inside a speculative iteration
the draft tokens before a position count as output for the draft's ``q`` and the target's
``p`` alike. The law of whole sequences is enumerated in float64 with
:func:`specdec_jax.reference.process_logits` (the history at each step spelled out) and every
loop is checked against it by chi-square with fixed seeds at a family-wise ``ALPHA = 0.01``
(Bonferroni over the four exactness tests); the negative control (the target's rows blind to
the draft prefix, a bug engines have shipped) must be rejected at ``1e-6``.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams
from specdec_jax import reference
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding import DynamicTree
from specdec_jax.decoding import PromptLookup
from specdec_jax.decoding import chain_loop
from specdec_jax.decoding import generate
from specdec_jax.decoding import speculative_generate
from specdec_jax.decoding import tree_speculative_generate
from specdec_jax.decoding.plain import generate_loop
from specdec_jax.decoding.tree import tree_loop
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model
from specdec_jax.theory import chi_square_test
from tests._helpers import sequence_index

ALPHA = 0.01  # family-wise, over the exactness tests (Bonferroni)
K = 2  # top logprobs asked for


def sampling_params(spec: dict) -> SamplingParams:
  """One request's :class:`SamplingParams` from its spec (the reference's keyword
  arguments: ``logit_bias`` a dict, ``bad_words`` lists of ids)."""
  def array(key, dtype):
    return None if spec.get(key) is None else np.asarray(spec[key], dtype)

  bias, words = spec.get("logit_bias"), spec.get("bad_words")
  width = max(len(w) for w in words) if words else 0
  return SamplingParams(
    temperature=np.float32(spec["temperature"]), top_k=array("top_k", np.int32),
    min_p=array("min_p", np.float32), repetition_penalty=array("repetition_penalty", np.float32),
    frequency_penalty=array("frequency_penalty", np.float32),
    presence_penalty=array("presence_penalty", np.float32),
    logit_bias_ids=None if bias is None else np.array(list(bias), np.int32),
    logit_bias_values=None if bias is None else np.array(list(bias.values()), np.float32),
    allowed_token_ids=array("allowed_token_ids", np.int32),
    bad_words=None if not words else np.array([list(w) + [-1] * (width - len(w))
                                               for w in words], np.int32),
    min_tokens=array("min_tokens", np.int32), stop_token_ids=array("stop_token_ids", np.int32))


def reference_probs(logits, spec: dict, prompt, output) -> np.ndarray:
  """The float64 processed distribution of one logit row after ``prompt`` and ``output``."""
  adjust = {k: spec[k] for k in ("allowed_token_ids", "bad_words", "min_tokens", "logit_bias",
                                 "repetition_penalty", "frequency_penalty", "presence_penalty",
                                 "stop_token_ids") if spec.get(k) is not None}
  return reference.process_logits(np.asarray(logits, np.float64), spec["temperature"],
                                  spec.get("top_k"), spec.get("top_p"), spec.get("min_p"),
                                  prompt_ids=list(prompt), output_ids=list(output), **adjust)


def model_logits(model, tokens: np.ndarray) -> np.ndarray:
  """The model's logits ``(n, T, V)`` at every position of sequences ``tokens`` ``(n, T)``."""
  tokens = np.clip(np.asarray(tokens), 0, model.vocab_size - 1)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  logits, _ = model.apply(model.params, jnp.asarray(tokens), jnp.asarray(positions),
                          model.init_cache(*tokens.shape))
  return np.asarray(logits, np.float64)


def exact_law(model, prompt: np.ndarray, new: int, spec: dict) -> np.ndarray:
  """P(continuation) of every ``V ** new`` continuation in lexicographic order, each step's
  distribution processed after the prompt and the continuation so far (float64)."""
  vocab = model.vocab_size
  conts = np.array(list(itertools.product(range(vocab), repeat=new)), np.int32)
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
  logits = model_logits(model, seqs)
  start = len(prompt)
  law = np.ones(len(conts))
  for n, cont in enumerate(conts):
    for i in range(new):
      law[n] *= reference_probs(logits[n, start - 1 + i], spec, prompt, cont[:i])[cont[i]]
      if law[n] == 0:
        break
  return law / law.sum()


def check_logprobs(out, model, prompt_lengths, specs, rows) -> None:
  """Each generated token's logprob (and the top ``K``) in rows ``rows`` equals the float64
  reference's at its step (``specs[b]``: row ``b``'s parameters); NaN (and ``pad_id = -1``)
  before and after the generated tokens."""
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  lp, ids, top = (np.asarray(a) for a in (out.logprobs, out.top_ids, out.top_logprobs))
  rows = list(rows)
  logits = model_logits(model, tokens[rows])
  vocab = model.vocab_size
  for n, b in enumerate(rows):
    start, end = int(prompt_lengths[b]), int(lengths[b])
    seq = tokens[b]
    assert np.isnan(lp[b, :start]).all() and np.isnan(lp[b, end:]).all()
    assert (ids[b, :start] == -1).all() and (ids[b, end:] == -1).all()
    for t in range(start, end):
      ref = reference_probs(logits[n, t - 1], specs[b], seq[:start], seq[start:t])
      with np.errstate(divide="ignore"):
        np.testing.assert_allclose(lp[b, t], np.log(ref[seq[t]]), atol=1e-5,
                                   err_msg=f"row {b}, position {t}")
        order = np.lexsort((np.arange(vocab), -ref))[:K]  # most likely first, ties: lower id
        np.testing.assert_array_equal(ids[b, t], order, err_msg=f"row {b}, position {t}")
        np.testing.assert_allclose(top[b, t], np.log(ref[order]), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# One batch per loop: sampled rows for the law, greedy rows with their own parameters beside
# them (rows are independent: a row's output depends only on its key, prompt and parameters),
# so each loop compiles once for every check.

V, NEW = 6, 4  # 6 ** 4 continuations
SAMPLED_ROWS, GREEDY_ROWS = 20_000, 48
TARGET = make_toy_model(jax.random.key(20), V, scale=1.5, name="target")
DRAFT = make_toy_model(jax.random.key(21), V, context=1, scale=1.5, name="draft")
#: An EAGLE-style draft over a subset of the vocabulary (q = 0 on tokens 3 and 5).
FEATURES = make_toy_feature_draft(TARGET, noise=1.0, key=jax.random.key(22),
                                  vocab_ids=[0, 1, 2, 4])
PROMPT = np.array([3, 1, 2, 3, 1], np.int32)  # repeats: prompt lookup finds matches
#: The sampled rows: a mix of every adjustment. 5 not allowed, 2 banned right after 1 and 4
#: right after 4, 3 (the stop id, pushed up by the bias) held back for two tokens, the
#: penalties, min_p and top-k.
SAMPLED = dict(temperature=0.9, top_k=4, min_p=0.05, repetition_penalty=1.3,
               frequency_penalty=0.4, presence_penalty=0.3, logit_bias={3: 1.5, 0: -0.5},
               allowed_token_ids=[0, 1, 2, 3, 4], bad_words=[[1, 2], [4, 4]], min_tokens=2,
               stop_token_ids=[3])


def _greedy_spec(row: int) -> dict:
  """Greedy row ``row``'s parameters: the argmax of the adjusted logits, penalties that the
  toy model's repeating argmax chains feel at almost every step."""
  rng = np.random.default_rng(row)
  return dict(SAMPLED, temperature=0.0, top_k=0, min_p=0.0,
              repetition_penalty=float(rng.uniform(1.0, 3.0)),
              frequency_penalty=float(rng.uniform(-0.5, 1.0)),
              presence_penalty=float(rng.uniform(0.0, 1.0)),
              logit_bias={3: float(rng.uniform(-1, 2)), 0: float(rng.uniform(-1, 1))},
              min_tokens=int(rng.integers(0, 4)))


SPECS = [SAMPLED] * SAMPLED_ROWS + [_greedy_spec(b) for b in range(GREEDY_ROWS)]
GREEDY = slice(SAMPLED_ROWS, SAMPLED_ROWS + GREEDY_ROWS)


def _batch():
  """Prompts, lengths and per-row :class:`SamplingParams` of the whole batch."""
  rng = np.random.default_rng(0)
  prompts = np.concatenate([np.tile(PROMPT, (SAMPLED_ROWS, 1)),
                            rng.integers(0, V, (GREEDY_ROWS, len(PROMPT)))]).astype(np.int32)
  lengths = np.concatenate([np.full(SAMPLED_ROWS, len(PROMPT)),
                            rng.integers(1, len(PROMPT) + 1, GREEDY_ROWS)]).astype(np.int32)
  rows = [sampling_params(spec) for spec in (SAMPLED, *SPECS[GREEDY])]
  index = np.concatenate([np.zeros(SAMPLED_ROWS, np.int32), 1 + np.arange(GREEDY_ROWS)])
  params = jax.tree.map(lambda *fields: np.stack(fields)[index], *rows)
  return prompts, lengths, params


PROMPTS, PROMPT_LENGTHS, PARAMS = _batch()
KINDS = ("plain", "model", "lookup", "tree", "features", "dynamic")


def _run(kind: str, key: jax.Array, params: SamplingParams = PARAMS, logprobs: int | None = K):
  args = (PROMPTS, PROMPT_LENGTHS, key)
  run = dict(max_new_tokens=NEW, params=params, logprobs=logprobs)
  if kind == "plain":
    return generate(TARGET, *args, **run)
  if kind == "tree":  # iid: the children of a node are samples of its q
    return tree_speculative_generate(TARGET, DRAFT, *args, tree=DraftTree.from_branching((2, 1)),
                                     law="iid", **run)
  if kind == "dynamic":  # EAGLE-2's tree, top-k candidates of the adjusted draft logits
    return tree_speculative_generate(TARGET, FEATURES, *args, tree=DynamicTree(2, 2, 3), **run)
  draft = {"model": DRAFT, "lookup": PromptLookup(max_ngram=2), "features": FEATURES}[kind]
  return speculative_generate(TARGET, draft, *args, gamma=2, **run)


@functools.cache
def _out(kind: str):
  return _run(kind, jax.random.key(700 + KINDS.index(kind)))


@functools.cache
def _law() -> np.ndarray:
  return exact_law(TARGET, PROMPT, NEW, SAMPLED)


def _chi_square(out) -> tuple[float, str]:
  probs = _law()
  new = np.asarray(out.tokens)[:SAMPLED_ROWS, len(PROMPT):]
  counts = np.bincount(sequence_index(new, V), minlength=len(probs))
  _, _, pvalue, detail = chi_square_test(counts, probs)
  return pvalue, detail


# ---------------------------------------------------------------------------------------------
# Sampling exactness: the law of whole sequences.


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_sequences_follow_the_enumerated_law(kind):
  """Chi-square over the 6 ** 4 continuations at ALPHA / 6; the speculative runs reject,
  accept and take bonus tokens."""
  out = _out(kind)
  np.testing.assert_array_equal(out.num_new, NEW)
  np.testing.assert_array_equal(out.error, 0)
  probs = _law()
  assert (probs == 0).sum() > len(probs) / 2  # the masks and bans remove most sequences
  if kind != "plain":  # (prompt lookup's second proposals are nearly all banned here)
    accepted = np.asarray(out.stats.accepted)[:SAMPLED_ROWS]
    at = np.asarray(out.stats.accepted_at)[:SAMPLED_ROWS]
    deepest = 0 if kind == "lookup" else 1
    assert (accepted == 0).any() and (at[:, deepest] > 0).any()
  pvalue, detail = _chi_square(out)
  assert pvalue >= ALPHA / len(KINDS), f"{kind}: chi-square p = {pvalue:.3g}; {detail}"


def test_target_rows_blind_to_the_draft_prefix_are_rejected(monkeypatch):
  """Negative control: the target's rows verified without the proposals before them (their
  prefixes emptied), as an engine that counts only emitted tokens would; here under prompt
  lookup (point-mass proposals; a model draft's run is rejected alike, at p = 0). The same
  chi-square rejects it."""
  see = chain_loop.chain_prefixes

  def blind(draft, rows):
    prefix, _ = see(draft, rows)
    return jnp.full_like(prefix, -1), jnp.zeros((rows,), jnp.int32)

  monkeypatch.setattr(chain_loop, "chain_prefixes", blind)
  chain_loop.speculative_loop.clear_cache()  # trace the loop again, with the bug
  try:
    out = _run("lookup", jax.random.key(800), logprobs=None)
  finally:
    chain_loop.speculative_loop.clear_cache()  # no later call may reuse the buggy program
  pvalue, detail = _chi_square(out)
  assert pvalue < 1e-6, f"blind target rows went undetected (p = {pvalue:.3g}); {detail}"


# ---------------------------------------------------------------------------------------------
# Greedy rows: speculative output is plain greedy output, token for token; logprobs.


def test_plain_greedy_rows_follow_the_adjusted_argmax():
  """The baseline against the reference (each token the argmax of its adjusted row: logprob
  0, the reference's point mass), and the adjustments matter: in most rows some token is not
  the argmax of the raw logits."""
  out = _out("plain")
  greedy = np.arange(SAMPLED_ROWS, SAMPLED_ROWS + GREEDY_ROWS)
  check_logprobs(out, TARGET, PROMPT_LENGTHS, SPECS, greedy)
  tokens, lengths = np.asarray(out.tokens)[GREEDY], np.asarray(out.lengths)[GREEDY]
  raw = model_logits(TARGET, tokens).argmax(-1)  # raw[b, t - 1]: the raw argmax at t
  slots = np.arange(tokens.shape[1])[None, 1:]
  new = (slots >= PROMPT_LENGTHS[GREEDY][:, None]) & (slots < lengths[:, None])
  differ = (new & (tokens[:, 1:] != raw[:, :-1])).any(axis=1)
  assert differ.mean() > 0.5, differ


@pytest.mark.parametrize("kind", KINDS[1:])
def test_greedy_rows_equal_plain_greedy(kind):
  """Tokens, logprobs and top logprobs of the greedy rows, bit for bit."""
  plain, out = _out("plain"), _out(kind)
  for field in ("tokens", "lengths", "logprobs", "top_ids", "top_logprobs"):
    np.testing.assert_array_equal(np.asarray(getattr(out, field))[GREEDY],
                                  np.asarray(getattr(plain, field))[GREEDY],
                                  err_msg=f"{kind}: {field}")
  if kind != "lookup":
    assert int(np.asarray(out.stats.accepted)[GREEDY].sum()) > 0, f"{kind}: never accepted"


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_logprobs_match_the_reference(kind):
  """Each sampled token's logprob and its row's top 2 against the float64 reference, for the
  first sampled rows (1e-5)."""
  check_logprobs(_out(kind), TARGET, PROMPT_LENGTHS, SPECS, range(30))


# ---------------------------------------------------------------------------------------------
# Compilation: values are traced, None fields remove their work.


def test_new_parameter_values_reuse_the_compiled_loops():
  """Other penalties, bias, bans, stop ids and temperatures of the same shapes: no
  recompilation, and the results change."""
  other = PARAMS._replace(
    temperature=np.full(len(PROMPTS), 0.5, np.float32),
    frequency_penalty=-PARAMS.frequency_penalty, bad_words=np.array([[2, 1], [0, -1]], np.int32),
    min_tokens=np.full(len(PROMPTS), 3, np.int32),
    logit_bias_ids=np.broadcast_to(np.array([1, 4], np.int32), PARAMS.logit_bias_values.shape))
  _out("plain"), _out("tree")  # (the chain loop's cache is cleared by the negative control)
  sizes = generate_loop._cache_size(), tree_loop._cache_size()
  plain, tree = _run("plain", jax.random.key(1), other), _run("tree", jax.random.key(1), other)
  assert (generate_loop._cache_size(), tree_loop._cache_size()) == sizes
  assert (np.asarray(plain.tokens) != np.asarray(_out("plain").tokens)).any()
  np.testing.assert_array_equal(tree.error, 0)


def test_unset_fields_leave_the_plain_program():
  """Temperature / top-k alone: no history is gathered and no row edited (the jaxpr sorts no
  list of ids: only the top-k candidates, by value and id), as before these parameters
  existed; one penalty brings the sorted id lists in."""
  def jaxpr(params):
    return str(jax.make_jaxpr(lambda key: speculative_generate(
      TARGET, DRAFT, PROMPTS[:4], PROMPT_LENGTHS[:4], key, gamma=2, max_new_tokens=NEW,
      params=params))(jax.random.key(0)))

  plain = SamplingParams(0.7, top_k=3)
  assert " sort[" in jaxpr(plain) and "num_keys=1]" not in jaxpr(plain)
  assert "num_keys=1]" in jaxpr(plain._replace(frequency_penalty=0.5))
