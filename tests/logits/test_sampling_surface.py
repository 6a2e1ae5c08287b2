"""The whole sampling surface of a request, exact under speculation (issue 45).

At draft position ``i`` a request's processed distribution depends on the draft prefix: the
penalties count ``draft[:i]``, ``min_tokens`` counts the accepted prefix, bad words match across
it, a grammar's mask is the one after it. These tests hold every verifier to
``specdec_jax.reference.process_logits`` (float64, vLLM's order) at the same prefix:

* the lazy statistics with row edits equal the eager ``process_logits`` and the reference, on
  hypothesis rows with every parameter and a history;
* exactness per position and prefix (chi-square, ALPHA below, fixed seeds): each parameter
  alone and all of them together through ``verify_logits``, the mix through every layout
  (token, block, tree x single, packed, packed tree, vocab-parallel); negative controls that
  must fail: penalties counted without the draft prefix (the peers' bug), the mask left off the
  bonus row, a draft processed without the penalties;
* logprobs against the float64 reference (``1e-5``) in every cell, top-k ids with ties to the
  lower id, processed and raw;
* a row that allows nothing emits nothing (``NO_ALLOWED_TOKEN``), never token 0;
* vLLM's own ``test_frequency_penalties``, ``test_bad_words`` and ``test_allowed_token_ids``
  through an adapter that only renames arguments;
* bad input: clear errors on the host, ``BAD_PARAMS`` under jit;
* no ``T x V`` processed or penalised copy in the compiled packed verifier.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from jax.sharding import AxisType

import specdec_jax as sd
from specdec_jax import reference
from specdec_jax._logits.adjust import adjusted_row
from specdec_jax._logits.lazy import request_rows
from specdec_jax._logits.lazy import row_probs
from tests._helpers import assert_same_distribution

V = 8
GAMMA = 2
TRIALS = 40_000
#: Family-wise false-failure rate of each exactness test (Bonferroni over its chi-squares).
ALPHA = 0.01

PROMPT = np.array([1, 2, 2, -1], np.int32)
OUTPUT = np.array([3, 4, 4, 1, -1, -1], np.int32)

#: One parameter at a time, then all of them (the values make each one matter on these rows).
CASES = {
  "repetition": dict(repetition_penalty=1.8),
  "frequency": dict(frequency_penalty=0.9),
  "presence": dict(presence_penalty=1.2),
  "logit_bias": dict(logit_bias_ids=np.array([5, 0, -1], np.int32),
                     logit_bias_values=np.array([1.5, -2.0, 0.0], np.float32)),
  "allowed": dict(allowed_token_ids=np.array([0, 1, 3, 4, 6, -1], np.int32)),
  "bad_words": dict(bad_words=np.array([[1, 6, -1], [4, 2, 5], [7, -1, -1]], np.int32)),
  "min_tokens": dict(min_tokens=np.int32(6), stop_token_ids=np.array([0, 3, -1], np.int32)),
  "min_p": dict(min_p=np.float32(0.08)),
  "mix": dict(min_p=np.float32(0.02), repetition_penalty=1.3, frequency_penalty=0.4,
              presence_penalty=0.3, logit_bias_ids=np.array([5, -1], np.int32),
              logit_bias_values=np.array([1.0, 0.0], np.float32),
              allowed_token_ids=np.array([0, 1, 2, 3, 4, 5, 6, -1], np.int32),
              bad_words=np.array([[4, 1, 2], [6, -1, -1]], np.int32), min_tokens=np.int32(5),
              stop_token_ids=np.array([0, -1], np.int32)),
}


def params_of(case: str, temperature=0.9, top_k=None, top_p=None) -> sd.SamplingParams:
  return sd.SamplingParams(np.float32(temperature), top_k, top_p, **CASES[case])


def reference_kwargs(params: sd.SamplingParams, output) -> dict:
  """The reference's keyword arguments for ``params`` at a position after ``output``."""
  def ids(a):
    return None if a is None else [int(t) for t in np.asarray(a).ravel() if t >= 0]
  bias = None
  if params.logit_bias_ids is not None:  # a repeated id's biases add up
    bias = {}
    for t, v in zip(np.asarray(params.logit_bias_ids), np.asarray(params.logit_bias_values),
                    strict=True):
      if t >= 0:
        bias[int(t)] = bias.get(int(t), 0.0) + float(v)
  bad = None if params.bad_words is None else [
    [int(t) for t in w if t >= 0] for w in np.asarray(params.bad_words)]
  return dict(min_p=None if params.min_p is None else float(params.min_p),
              allowed_token_ids=ids(params.allowed_token_ids), bad_words=bad,
              min_tokens=None if params.min_tokens is None else int(params.min_tokens),
              stop_token_ids=ids(params.stop_token_ids) or (), logit_bias=bias,
              repetition_penalty=params.repetition_penalty,
              frequency_penalty=params.frequency_penalty,
              presence_penalty=params.presence_penalty, prompt_ids=PROMPT, output_ids=output)


def target_law(logits, params, prefix, bitmask=None) -> np.ndarray:
  """The processed target distribution at the position after ``prefix`` (float64)."""
  output = [t for t in OUTPUT if t >= 0] + list(prefix)
  kw = reference_kwargs(params, output)
  return reference.process_logits(logits, float(params.temperature), params.top_k,
                                  params.top_p, bitmask=bitmask, **kw)


def rows_case(seed: int, vocab: int = V):
  """Target logits ``(gamma + 1, V)`` and draft logits ``(gamma, V)``: the draft near the
  target, every token with some mass."""
  rng = np.random.default_rng(seed)
  target = rng.normal(size=(GAMMA + 1, vocab)).astype(np.float32) * 1.5
  draft = (target[:GAMMA] + rng.normal(size=(GAMMA, vocab)) * 0.7).astype(np.float32)
  return target, draft


def history() -> sd.History:
  return sd.History(PROMPT, OUTPUT)


def drafted(key, draft_logits, params, bitmask=None, penalised=True):
  """Draft tokens sampled one position at a time with ``sample_draft``, each after the history
  plus the tokens drafted before it (``penalised=False``: the draft ignores the history)."""
  tokens, rows = [], []
  keys = jax.random.split(key, draft_logits.shape[0])
  for i in range(draft_logits.shape[0]):
    output = jnp.concatenate([jnp.asarray(OUTPUT[OUTPUT >= 0]),
                              jnp.asarray(tokens, jnp.int32).reshape(-1)])
    h = sd.History(PROMPT, output) if penalised else None
    s = sd.sample_draft(keys[i], draft_logits[i], params, h,
                        None if bitmask is None else bitmask[i])
    tokens.append(s.token)
    rows.append(s.probs)
  return jnp.stack(tokens), jnp.stack(rows)


def prefix_cells(tokens: np.ndarray, num_tokens: np.ndarray, positions: int, least: int = 400):
  """``[(j, prefix, rows)]``: every position ``j`` and draft prefix ``tokens[:, :j]`` that at
  least ``least`` trials emitted a token after (the cells a per-position chi-square tests)."""
  cells = []
  for j in range(positions):
    emitted = num_tokens > j
    for prefix in {tuple(r[:j]) for r in tokens[emitted]}:
      at = emitted & np.all(tokens[:, :j] == np.array(prefix, dtype=tokens.dtype), axis=1)
      if at.sum() >= least:
        cells.append((j, prefix, at))
  return cells


def check_positions(tokens, num_tokens, target_logits, params, label, bitmask=None,
                    alpha=ALPHA):
  """Chi-square of every position's token given its prefix against the reference law there,
  over the (position, prefix) cells with enough samples (Bonferroni over them)."""
  tokens, num_tokens = np.asarray(tokens), np.asarray(num_tokens)
  cells = prefix_cells(tokens, num_tokens, target_logits.shape[0])
  assert cells, label
  for j, prefix, at in cells:
    law = target_law(target_logits[j], params, prefix,
                     None if bitmask is None else bitmask[j])
    assert_same_distribution(tokens[at, j], law, alpha / len(cells),
                             f"{label} position {j} after {prefix}")
  return len(cells)


@functools.cache
def _single_trials(case: str, layout: str, seed: int = 0):
  target, draft_logits = rows_case(seed)
  params = params_of(case)

  @jax.jit
  def trial(key):
    k_draft, k_verify = jax.random.split(key)
    draft, _ = drafted(k_draft, jnp.asarray(draft_logits), params)
    if layout == "tree":
      r = sd.tree_verify_logits(jnp.asarray(target), jnp.concatenate(
        [jnp.asarray(draft_logits), jnp.zeros((1, V), jnp.float32)]),
        jnp.array([-1, 0, 1]), jnp.concatenate([jnp.zeros(1, jnp.int32), draft]),
        params=params, key=k_verify, history=history(), law="iid")
    else:
      r = sd.verify_logits(jnp.asarray(target), jnp.asarray(draft_logits), draft, params=params,
                           key=k_verify, history=history(), rule=layout)
    return r.tokens, r.num_tokens, r.error

  keys = jax.random.split(jax.random.key(seed + 11), TRIALS)
  return jax.vmap(trial)(keys), target, params


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_parameter_is_exact_at_every_draft_position(case):
  """verify_logits (token rule) with each parameter: every position's law given its prefix."""
  (tokens, num_tokens, error), target, params = _single_trials(case, "token")
  assert not np.asarray(error).any()
  assert check_positions(tokens, num_tokens, target, params, case) >= 3


@pytest.mark.parametrize("layout", ["block", "tree"])
def test_the_mix_is_exact_in_the_block_and_tree_rules(layout):
  (tokens, num_tokens, error), target, params = _single_trials("mix", layout)
  assert not np.asarray(error).any()
  assert check_positions(tokens, num_tokens, target, params, f"mix {layout}") >= 3


def _packed_case(seed: int, vocab: int, tree: bool, batch: int = 3):
  """A packed batch: requests with 2, 1 and 0 drafts (trees: every request a full chain of 2, as
  sglang's trees reach every node); ``vocab`` columns of which the first 8 carry the mass."""
  rng = np.random.default_rng(seed)
  counts = np.array([GAMMA] * batch if tree else [GAMMA, 1, 0][:batch], np.int32)
  total = int(counts.sum())
  target = np.full((total + batch, vocab), -30.0, np.float32)
  target[:, :V] = rng.normal(size=(total + batch, V)) * 1.5
  draft = np.full((max(total, 1), vocab), -30.0, np.float32)
  draft[:, :V] = rng.normal(size=(max(total, 1), V)) * 1.5
  return counts, target, draft[:total]


def _packed_trials(vocab: int, fn, tree: bool, seed: int = 3):
  """``TRIALS`` packed steps of the mix: each request's drafts drawn with ``sample_draft`` at its
  history + prefix, then ``fn``. Returns per request ``(tokens, num_tokens, error)`` and rows."""
  counts, target, draft_logits = _packed_case(seed, vocab, tree)
  params = params_of("mix")
  batch = counts.shape[0]
  starts = np.cumsum(counts) - counts
  history_b = sd.History(np.tile(PROMPT, (batch, 1)), np.tile(OUTPUT, (batch, 1)))
  bparams = sd.SamplingParams(*(None if v is None else np.broadcast_to(
    np.asarray(v), (batch, *np.shape(v))) for v in params))

  @jax.jit
  def trial(key):
    k_draft, k_verify = jax.random.split(key)
    ids = []
    for b in range(batch):
      if counts[b]:
        d, _ = drafted(jax.random.fold_in(k_draft, b),
                       jnp.asarray(draft_logits[starts[b]:starts[b] + counts[b]]), params)
        ids.append(d)
    ids = jnp.concatenate(ids)
    if tree:  # each request's chain as a tree: node j + 1 child of node j
      size = GAMMA + 1
      cand = jnp.zeros((batch, size), jnp.int32)
      first = np.full((batch, size), -1, np.int32)
      t_rows = np.full((batch * size, vocab), -30.0, np.float32)
      d_rows = np.full((batch * size, vocab), -30.0, np.float32)
      for b in range(batch):
        n = counts[b]
        cand = cand.at[b, 1:n + 1].set(ids[starts[b]:starts[b] + n])
        first[b, :n] = np.arange(1, n + 1)
        t_rows[b * size:b * size + n + 1] = target[starts[b] + b:starts[b] + b + n + 1]
        d_rows[b * size:b * size + n] = draft_logits[starts[b]:starts[b] + n]
      r = fn(cand, jnp.asarray(first), jnp.full((batch, size), -1, jnp.int32),
             target_logits=jnp.asarray(t_rows), draft_logits=jnp.asarray(d_rows),
             params=bparams, key=jax.random.split(k_verify, batch), history=history_b)
    else:
      r = fn(ids, counts, target_logits=jnp.asarray(target),
             draft_logits=jnp.asarray(draft_logits), params=bparams,
             key=jax.random.split(k_verify, batch), history=history_b)
    return r.tokens, r.num_tokens, r.error

  out = jax.vmap(trial)(jax.random.split(jax.random.key(seed), TRIALS // 2))
  return out, counts, target, params


def _mesh():
  return jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,))


PACKED = {
  "packed_verify": (V, False, lambda: functools.partial(sd.packed_verify, max_spec_len=GAMMA)),
  "packed_tree_verify": (V, True, lambda: functools.partial(
    sd.packed_tree_verify, max_depth=GAMMA, law="iid", uniform_layout="sequential")),
  "vocab_parallel_packed_verify": (64, False, lambda: sd.vocab_parallel_packed_verify(
    _mesh(), "model", max_spec_len=GAMMA)),
  "vocab_parallel_packed_tree_verify": (64, True, lambda: sd.vocab_parallel_packed_tree_verify(
    _mesh(), "model", max_depth=GAMMA, law="iid", uniform_layout="sequential")),
}


@pytest.mark.skipif(jax.device_count() < 2, reason="the vocab-parallel cells need 2 devices")
@pytest.mark.parametrize("cell", sorted(PACKED))
def test_the_mix_is_exact_in_every_packed_layout(cell):
  """Every request of a packed batch (2, 1 and 0 drafts), per position and prefix."""
  vocab, tree, make = PACKED[cell]
  (tokens, num_tokens, error), counts, target, params = _packed_trials(vocab, make(), tree)
  assert not np.asarray(error).any(), np.unique(np.asarray(error))
  starts = np.cumsum(counts) - counts
  tested = 0
  for b in range(counts.shape[0]):
    rows = target[starts[b] + b:starts[b] + b + counts[b] + 1][:, :vocab]
    tested += check_positions(np.asarray(tokens)[:, b], np.asarray(num_tokens)[:, b], rows,
                              params, f"{cell} request {b}", alpha=ALPHA / counts.shape[0])
  assert tested >= 3


# --- negative controls ----------------------------------------------------------------------


def test_negative_control_penalties_counted_without_the_draft_prefix():
  """The peers' bug: the target's rows penalised for the history only, not ``draft[:i]``."""
  target, draft_logits = rows_case(0)
  params = params_of("frequency")
  wrong_p = jnp.stack([sd.process_logits(target[i], params, history())
                       for i in range(GAMMA + 1)])

  @jax.jit
  def trial(key):
    k_draft, k_verify = jax.random.split(key)
    draft, q = drafted(k_draft, jnp.asarray(draft_logits), params)
    r = sd.verify(wrong_p, q, draft, key=k_verify)
    return r.tokens, r.num_tokens

  tokens, num_tokens = jax.vmap(trial)(jax.random.split(jax.random.key(5), TRIALS))
  with pytest.raises(AssertionError, match="chi-square"):
    check_positions(tokens, num_tokens, target, params, "prefix left out")


def test_negative_control_a_draft_sampled_without_the_penalties():
  """The draft samples from its unpenalised law while the verifier is told it was penalised."""
  target, draft_logits = rows_case(0)
  params = params_of("repetition")

  @jax.jit
  def trial(key):
    k_draft, k_verify = jax.random.split(key)
    draft, _ = drafted(k_draft, jnp.asarray(draft_logits), params, penalised=False)
    r = sd.verify_logits(jnp.asarray(target), jnp.asarray(draft_logits), draft, params=params,
                         key=k_verify, history=history())
    return r.tokens, r.num_tokens

  tokens, num_tokens = jax.vmap(trial)(jax.random.split(jax.random.key(6), TRIALS))
  with pytest.raises(AssertionError, match="chi-square"):
    check_positions(tokens, num_tokens, target, params, "unpenalised draft")


# --- grammar bitmasks -----------------------------------------------------------------------


def grammar(prefix: jax.Array) -> jax.Array:
  """A toy grammar's words after ``prefix``: tokens ``t`` with ``(t + sum(prefix)) % 3 != 0``."""
  allowed = (jnp.arange(V) + jnp.sum(prefix)) % 3 != 0
  return jnp.sum(jnp.where(allowed, jnp.left_shift(jnp.uint32(1), jnp.arange(
    V, dtype=jnp.uint32)), jnp.uint32(0)), dtype=jnp.uint32)[None].view(jnp.int32)


def grammar_np(prefix) -> np.ndarray:
  return np.asarray(grammar(jnp.asarray(list(prefix), jnp.int32)))


def _grammar_trials(bonus_masked: bool):
  target, draft_logits = rows_case(1)
  params = params_of("presence")

  @jax.jit
  def trial(key):
    k_draft, k_verify = jax.random.split(key)
    tokens, rows = [], []
    keys = jax.random.split(k_draft, GAMMA)
    for i in range(GAMMA):  # the draft samples inside the mask after its own prefix
      prefix = jnp.asarray(tokens, jnp.int32).reshape(-1)
      output = jnp.concatenate([jnp.asarray(OUTPUT[OUTPUT >= 0]), prefix])
      s = sd.sample_draft(keys[i], draft_logits[i], params, sd.History(PROMPT, output),
                          grammar(prefix))
      tokens.append(s.token)
      rows.append(grammar(prefix))
    draft = jnp.stack(tokens)
    masks = jnp.stack([grammar(draft[:i]) for i in range(GAMMA + 1)])
    if not bonus_masked:
      masks = masks.at[GAMMA].set(-1)  # the bonus row left unmasked
    r = sd.verify_logits(jnp.asarray(target), jnp.asarray(draft_logits), draft, params=params,
                         key=k_verify, history=history(), target_bitmask=masks,
                         draft_bitmask=jnp.stack(rows))
    return r.tokens, r.num_tokens, r.error

  return jax.vmap(trial)(jax.random.split(jax.random.key(7), TRIALS)), target, params


def check_grammar_positions(tokens, num_tokens, target, params, label):
  tokens, num_tokens = np.asarray(tokens), np.asarray(num_tokens)
  cells = prefix_cells(tokens, num_tokens, GAMMA + 1)
  for j, prefix, at in cells:
    law = target_law(target[j], params, prefix, bitmask=grammar_np(prefix))
    assert_same_distribution(tokens[at, j], law, ALPHA / len(cells),
                             f"{label} position {j} after {prefix}")
  return len(cells)


def test_grammar_masks_at_every_position_and_the_bonus_are_exact():
  """Target rows masked per position (the bonus position included), the draft sampling inside
  its masks: every emitted token is allowed after its prefix, and each position's law is the
  masked target law."""
  (tokens, num_tokens, error), target, params = _grammar_trials(bonus_masked=True)
  assert not np.asarray(error).any()
  tokens, num_tokens = np.asarray(tokens), np.asarray(num_tokens)
  for j in range(GAMMA + 1):
    at = num_tokens > j
    sums = tokens[at, :j].sum(axis=1)
    assert np.all((tokens[at, j] + sums) % 3 != 0), f"a token outside the grammar at {j}"
  assert check_grammar_positions(tokens, num_tokens, target, params, "grammar") >= 3


def test_negative_control_the_bonus_row_left_unmasked():
  """vLLM #44292: the bonus position unmasked emits tokens outside the grammar."""
  (tokens, num_tokens, _), target, params = _grammar_trials(bonus_masked=False)
  tokens, num_tokens = np.asarray(tokens), np.asarray(num_tokens)
  at = num_tokens > GAMMA
  outside = (tokens[at, GAMMA] + tokens[at, :GAMMA].sum(axis=1)) % 3 == 0
  assert outside.any()
  with pytest.raises(AssertionError, match="chi-square"):
    check_grammar_positions(tokens, num_tokens, target, params, "unmasked bonus")


def test_a_row_that_allows_nothing_emits_nothing():
  """Every target row's mask empty at the bonus position: the step emits the accepted drafts
  only, flags NO_ALLOWED_TOKEN, and never writes token 0 there."""
  target = np.zeros((GAMMA + 1, V), np.float32)
  draft = np.array([3, 5], np.int32)
  masks = np.full((GAMMA + 1, 1), -1, np.int32)
  masks[GAMMA] = 0
  point = np.full((GAMMA, V), -30.0, np.float32)
  point[np.arange(GAMMA), draft] = 10.0
  r = sd.verify_logits(target, point, draft, params=sd.SamplingParams(0.0),
                       uniforms=np.zeros(GAMMA + 1, np.float32), target_bitmask=masks)
  # greedy on a flat row: argmax 0 != 3, so the first draft is rejected: row 0 allows all
  assert int(r.num_tokens) == 1 and int(r.tokens[0]) == 0
  masks[0] = 0
  r = sd.verify_logits(target, point, draft, params=sd.SamplingParams(0.7),
                       uniforms=np.full(GAMMA + 1, 0.5, np.float32), target_bitmask=masks)
  assert int(r.num_tokens) == 0 and r.tokens.tolist() == [-1] * (GAMMA + 1)
  assert int(r.error) & sd.ErrorCode.NO_ALLOWED_TOKEN
  for probs_masks in (masks,):
    p = np.full((GAMMA + 1, V), 1.0 / V, np.float32)
    r = sd.verify(p, None, draft, uniforms=np.full(GAMMA + 1, 0.5, np.float32),
                  target_bitmask=probs_masks)
    assert int(r.num_tokens) == 0 and int(r.error) & sd.ErrorCode.NO_ALLOWED_TOKEN


# --- logprobs ---------------------------------------------------------------------------------

K = 4


def _raw_law(x) -> np.ndarray:
  x = np.asarray(x, np.float64)
  return np.exp(x - x.max()) / np.exp(x - x.max()).sum()


def check_logprobs(result, rows_of, prefix_of, target, params, mode, label):
  """Every emitted token's logprob and its row's top-K against the reference (1e-5; top-K ids
  in the order probability descending, ties to the lower id)."""
  for j in range(int(result.num_tokens)):
    prefix = prefix_of(j)
    law = (_raw_law(target[rows_of(j)]) if mode == "raw"
           else target_law(target[rows_of(j)], params, prefix))
    token = int(result.tokens[j])
    with np.errstate(divide="ignore"):
      want_lp = np.log(law)
    np.testing.assert_allclose(float(result.logprobs[j]), want_lp[token], atol=1e-5,
                               err_msg=f"{label} slot {j}")
    order = np.lexsort((np.arange(len(law)), -law))[:K]
    assert np.asarray(result.top_ids[j]).tolist() == order.tolist(), (label, j)
    np.testing.assert_allclose(np.asarray(result.top_logprobs[j]), want_lp[order], atol=1e-5,
                               err_msg=f"{label} top-{K} slot {j}")
  assert np.isnan(np.asarray(result.logprobs[int(result.num_tokens):])).all()


def _chain_result(cell, target, draft_logits, draft, params, mode, key):
  kw = dict(params=params, key=key, history=history(), logprobs=K, logprobs_mode=mode)
  if cell in ("token", "block"):
    return sd.verify_logits(target, draft_logits, draft, rule=cell, **kw)
  if cell == "tree":
    return sd.tree_verify_logits(target, np.concatenate([draft_logits, draft_logits[:1]]),
                                 np.array([-1, 0, 1]), np.concatenate([[0], draft]), law="iid",
                                 **kw)
  b = lambda a: np.asarray(a)[None]  # noqa: E731
  bp = sd.SamplingParams(*(None if v is None else b(v) for v in params))
  hist = sd.History(b(PROMPT), b(OUTPUT))
  kw = dict(params=bp, key=key[None], history=hist, logprobs=K, logprobs_mode=mode)
  if cell == "packed":
    r = sd.packed_verify(draft, np.array([GAMMA]), max_spec_len=GAMMA, target_logits=target,
                         draft_logits=draft_logits, **kw)
  else:
    r = sd.packed_tree_verify(np.concatenate([[0], draft])[None], np.array([[1, 2, -1]]),
                              np.full((1, 3), -1), max_depth=GAMMA, target_logits=target,
                              draft_logits=np.concatenate([draft_logits, draft_logits[:1]]),
                              law="iid", uniform_layout="sequential", **kw)
  return jax.tree.map(lambda a: a[0], r)


@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("cell", ["token", "block", "tree", "packed", "packed_tree"])
def test_logprobs_equal_the_reference_in_every_cell(cell, mode):
  """Each emitted token's logprob under its position's processed law (the replacement's too)
  and the top-K, for a few keys: accepted drafts, rejections and bonus tokens all appear."""
  target, draft_logits = rows_case(2)
  params = params_of("mix", top_k=5)
  seen = set()
  for seed in range(6):
    draft, _ = drafted(jax.random.key(seed), jnp.asarray(draft_logits), params)
    draft = np.asarray(draft)
    r = _chain_result(cell, target, draft_logits, draft, params, mode, jax.random.key(100 + seed))
    assert int(r.error) == 0
    seen.add(int(r.num_tokens))
    check_logprobs(r, lambda j: j, lambda j, d=draft: d[:j], target, params, mode,
                   f"{cell} {mode} seed {seed}")
  assert len(seen) > 1


def test_logprobs_of_greedy_rows_and_of_probability_rows():
  """Greedy: 0 for the argmax, -inf after it in id order. Probability rows: their own logs."""
  target, _ = rows_case(3)
  r = sd.verify_logits(target, None, np.array([0, 1]), params=sd.SamplingParams(0.0),
                       uniforms=np.zeros(GAMMA + 1, np.float32), logprobs=3)
  top = int(np.argmax(target[0]))
  assert float(r.logprobs[0]) == 0.0 and int(r.top_ids[0, 0]) == top
  assert r.top_ids[0, 1:].tolist() == [i for i in range(V) if i != top][:2]
  p = np.asarray(jax.nn.softmax(jnp.asarray(target)))
  r = sd.verify(p, None, np.array([0, 1]), uniforms=np.full(GAMMA + 1, 0.3, np.float32),
                logprobs=3)
  for j in range(int(r.num_tokens)):
    np.testing.assert_allclose(float(r.logprobs[j]), np.log(p[j, int(r.tokens[j])]), atol=1e-6)
    assert r.top_ids[j].tolist() == np.argsort(-p[j], kind="stable")[:3].tolist()


@pytest.mark.skipif(jax.device_count() < 2, reason="the vocab-parallel cells need 2 devices")
def test_vocab_parallel_logprobs_equal_the_unsharded_ones():
  """vocab_parallel_verify and the packed forms from logits, 2 shards: the same logprobs and
  top-K as the unsharded verifier (V = 64, whole words per device)."""
  rng = np.random.default_rng(4)
  target = rng.normal(size=(1, GAMMA + 1, 64)).astype(np.float32) * 2
  draft_logits = rng.normal(size=(1, GAMMA, 64)).astype(np.float32) * 2
  draft = np.array([[3, 9]], np.int32)
  params = params_of("mix", top_k=5)
  bp = sd.SamplingParams(*(None if v is None else np.asarray(v)[None] for v in params))
  hist = sd.History(PROMPT[None], OUTPUT[None])
  u = np.array([[0.3, 0.6, 0.2]], np.float32)
  want = sd.verify_logits(target[0], draft_logits[0], draft[0], u[0], params, history=history(),
                          logprobs=K)
  fn = sd.vocab_parallel_verify(_mesh(), "model", inputs="logits", logprobs=K)
  got = fn(target, draft_logits, draft, u, bp, history=hist)
  packed = sd.vocab_parallel_packed_verify(_mesh(), "model", max_spec_len=GAMMA, logprobs=K)(
    draft[0], np.array([GAMMA]), target_logits=np.concatenate([target[0]]),
    draft_logits=draft_logits[0], params=bp, uniforms=u, history=hist)
  for r in (got, packed):
    for field in ("tokens", "num_tokens", "top_ids"):
      np.testing.assert_array_equal(np.asarray(getattr(r, field))[0],
                                    np.asarray(getattr(want, field)), err_msg=field)
    np.testing.assert_allclose(np.asarray(r.logprobs)[0], np.asarray(want.logprobs), atol=1e-5)
    np.testing.assert_allclose(np.asarray(r.top_logprobs)[0], np.asarray(want.top_logprobs),
                               atol=1e-5)


# --- vLLM's own rejection-sampler tests -------------------------------------------------------


def vllm_rejection_sample(spec_token_ids, target_logits, bonus_token_ids, meta):
  """In place of vLLM V1's ``RejectionSampler`` for these tests: its arguments renamed, its
  containers laid out as arrays (ragged lists padded with -1, the boolean allowed mask, True =
  disallowed, as bitmask words per target row). The masks, bad words and penalties are applied
  by ``packed_verify``, not here."""
  counts = np.array([len(s) for s in spec_token_ids], np.int32)
  owners = np.repeat(np.arange(len(counts)), counts)
  width = max([len(o) for o in meta["output_token_ids"]] + [1])
  output = np.full((len(counts), width), -1, np.int32)
  for b, ids in enumerate(meta["output_token_ids"]):
    output[b, :len(ids)] = ids
  bad = None
  if meta.get("bad_words_token_ids"):
    words = [w for ws in meta["bad_words_token_ids"].values() for w in ws]
    bad = np.full((len(counts), len(words), max(len(w) for w in words)), -1, np.int32)
    for b, ws in meta["bad_words_token_ids"].items():
      for j, w in enumerate(ws):
        bad[b, j, :len(w)] = w
  mask = meta.get("allowed_token_ids_mask")
  params = sd.SamplingParams(
    np.zeros(len(counts), np.float32),  # all greedy, as in vLLM's tests
    frequency_penalty=meta.get("frequency_penalties"),
    presence_penalty=meta.get("presence_penalties"),
    repetition_penalty=meta.get("repetition_penalties"), bad_words=bad)
  result = sd.packed_verify(
    np.concatenate([np.asarray(s, np.int32) for s in spec_token_ids]), counts,
    max_spec_len=int(counts.max()), target_logits=target_logits, bonus_rows=False,
    bonus_token_ids=np.asarray(bonus_token_ids), params=params, convention="vllm",
    history=sd.History(meta.get("prompt_token_ids"), output),
    target_bitmask=None if mask is None else sd.bitmask_from_mask(~mask[owners]))
  return result.tokens.tolist()


def vllm_logits(output_tokens, override, vocab=100):
  """vLLM's ``create_logits_tensor``: 100 at each token but the last (the bonus), -100
  elsewhere, then column ``override`` set to 99 in every row."""
  rows = []
  for tokens in output_tokens:
    for t in tokens[:-1]:
      row = np.full(vocab, -100.0, np.float32)
      row[t] = 100.0
      rows.append(row)
  logits = np.stack(rows)
  logits[:, override] = 99.0
  return logits


def test_vllm_frequency_penalties():
  spec = [[1, 1, 1], [], [1, 1, 1]]
  outputs = [[1, 1, 1, 1], [7], [1, 1, 1, 1]]
  got = vllm_rejection_sample(spec, vllm_logits(outputs, 15), [o[-1] for o in outputs], {
    "output_token_ids": [[2], [3], [4]],
    "prompt_token_ids": np.array([[5, 6, 7], [6, 7, 8], [7, 8, 9]]),
    "frequency_penalties": np.array([1.5, 1.5, 0.7], np.float32),
    "presence_penalties": np.zeros(3, np.float32),
    "repetition_penalties": np.ones(3, np.float32)})
  assert got == [[1, 15, -1, -1], [7, -1, -1, -1], [1, 1, 15, -1]]


def test_vllm_bad_words():
  spec = [[1, 2, 3], [1, 15, 3], [1, 2, 3]]
  outputs = [[1, 2, 3, 4], [1, 15, 3, 4], [1, 2, 3, 4]]
  got = vllm_rejection_sample(spec, vllm_logits(outputs, 15), [4, 4, 4], {
    "output_token_ids": [[2], [3], [4]], "bad_words_token_ids": {0: [[2]], 2: [[2]]}})
  assert got == [[1, 15, -1, -1], [1, 15, 3, 4], [1, 15, -1, -1]]


def test_vllm_allowed_token_ids():
  spec = [[1, 2, 10], [10, 5, 3], [7, 10, 12]]
  outputs = [[1, 2, 10, 5], [10, 5, 10, 5], [7, 10, 12, 5]]
  mask = np.zeros((3, 100), bool)  # vLLM's create_allowed_token_ids: even rows only
  for i in (0, 2):
    mask[i, i:i + 5] = True
  got = vllm_rejection_sample(spec, vllm_logits(outputs, 15), [5, 5, 5], {
    "output_token_ids": [[], [], []], "allowed_token_ids_mask": mask})
  assert got == [[15, -1, -1, -1], [10, 5, 10, -1], [7, 10, 12, 5]]


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "history", "message"), [
  (dict(repetition_penalty=0.0), None, r"`params.repetition_penalty` must be > 0"),
  (dict(frequency_penalty=np.nan), None, r"`params.frequency_penalty` must be finite"),
  (dict(min_p=1.5), None, r"`params.min_p` must be in \[0, 1\]"),
  (dict(allowed_token_ids=np.array([1, V])), None, r"`params.allowed_token_ids` must hold"),
  (dict(logit_bias_ids=np.array([1]), logit_bias_values=np.array([np.inf], np.float32)), None,
   r"`params.logit_bias_values` must be finite"),
  (dict(logit_bias_ids=np.array([1])), None, r"go together"),
  (dict(min_tokens=np.int32(2)), None, r"needs `params.stop_token_ids`"),
  (dict(bad_words=np.array([1, 2])), None, r"`params.bad_words` must be an array of rank 2"),
  (dict(), sd.History(np.array([0, V + 3]), None), r"`history.prompt_ids` must hold"),
])
def test_bad_parameters_raise_on_the_host(params, history, message):
  x = np.zeros(V, np.float32)
  for fn in (lambda p, h: sd.process_logits(x, p, h),
             lambda p, h: sd.sample_draft(jax.random.key(0), x, p, h)):
    with pytest.raises((ValueError, TypeError), match=message):
      fn(sd.SamplingParams(1.0, **params), history)


def test_bad_bitmasks_and_bias_lists_raise():
  x = np.zeros((GAMMA + 1, 40), np.float32)
  with pytest.raises(ValueError, match=r"`target_bitmask` must have shape \(rows, ceil"):
    sd.verify_logits(x, None, np.array([0, 1]), np.zeros(3, np.float32),
                     target_bitmask=np.zeros((GAMMA + 1, 1), np.int32))
  with pytest.raises(TypeError, match=r"`bitmask` must (be int32|have an integer dtype)"):
    sd.process_logits(x[0], bitmask=np.zeros(2, np.float32))
  with pytest.raises(ValueError, match=r"at most 2 entries \(the static size\), got 3"):
    sd.logit_bias_arrays([{1: 1.0}, {1: 1.0, 2: 2.0, 3: 0.5}], 2)


def test_bad_values_under_jit_are_flagged():
  """Traced parameters cannot raise: ``BAD_PARAMS``, outputs in range."""
  x = jnp.zeros((GAMMA + 1, V), jnp.float32)

  @jax.jit
  def run(penalty, allowed, prompt):
    params = sd.SamplingParams(jnp.float32(1.0), repetition_penalty=penalty,
                               allowed_token_ids=allowed)
    return sd.verify_logits(x, None, jnp.array([0, 1]), jnp.full(3, 0.5, jnp.float32), params,
                            history=sd.History(prompt, None))

  ok = run(jnp.float32(1.2), jnp.array([0, 1, 2]), jnp.array([1, 2]))
  assert int(ok.error) == 0
  for args in ((jnp.float32(-1.0), jnp.array([0, 1, 2]), jnp.array([1, 2])),
               (jnp.float32(jnp.nan), jnp.array([0, 1, 2]), jnp.array([1, 2])),
               (jnp.float32(1.2), jnp.array([0, 1, V + 5]), jnp.array([1, 2])),
               (jnp.float32(1.2), jnp.array([0, 1, 2]), jnp.array([1, -7]))):
    r = run(*args)
    assert int(r.error) & sd.ErrorCode.BAD_PARAMS, args
    assert np.all((np.asarray(r.tokens) >= -1) & (np.asarray(r.tokens) < V))


# --- no processed copy ------------------------------------------------------------------------


def test_no_penalised_or_masked_copy_in_the_compiled_program():
  """Penalties, a bias, bad words, min_tokens, allowed ids and per-row grammar masks: the packed
  verifier writes no ``T x V`` array (only statistics, row edits ``R x E`` and bitmask words)."""
  from specdec_jax._layouts.packed import packed_jit
  from tests.logits.test_lazy_logits import _largest_materialised

  batch, spec, vocab = 16, 4, 16384
  n = np.array([1, 0, 2, 1] * 4, np.int32)
  total = int(n.sum())
  words = -(-vocab // 32)
  mix = params_of("mix", top_k=20, top_p=0.9)
  params = sd.SamplingParams(*(None if v is None else np.broadcast_to(
    np.asarray(v), (batch, *np.shape(v))) for v in mix))
  lowered = packed_jit.lower(
    np.zeros(total, np.int32), n, None, np.zeros((total + batch, vocab), np.float32), None,
    np.zeros((total, vocab), np.float32), None, None, np.zeros((batch, spec + 1), np.float32),
    params, sd.History(np.zeros((batch, 64), np.int32), np.zeros((batch, 64), np.int32)),
    np.zeros((total + batch, words), np.int32), np.zeros((total, words), np.int32),
    max_spec_len=spec, bonus_rows=True, rule="token", pad_id=-1)
  largest = _largest_materialised(lowered.compile().as_text())
  assert largest < total * vocab, largest


# --- the fuzz of every field ------------------------------------------------------------------


@st.composite
def requests(draw):
  """A row of 40 logits (ties and masked entries), a history, and every field drawn, each
  sometimes at its neutral value (one structure: one compilation for the whole fuzz)."""
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  vocab = 40
  x = np.round(rng.normal(size=vocab) * 3, int(rng.integers(0, 3))).astype(np.float32)
  if rng.random() < 0.3:
    x[rng.choice(vocab, 5, replace=False)] = -np.inf
  ids = lambda n, p: np.where(rng.random(n) < p, rng.integers(0, vocab, n), -1).astype(  # noqa: E731
    np.int32)
  allowed = ids(12, 1.0) if rng.random() < 0.4 else np.arange(vocab, dtype=np.int32)
  params = sd.SamplingParams(
    np.float32(rng.choice([0.0, 0.5, 1.0, 2.0])), np.int32(rng.choice([0, 1, 3, 10])),
    np.float32(rng.choice([0.5, 0.9, 1.0])), np.float32(rng.choice([0.0, 0.05, 0.3])),
    np.float32(rng.choice([0.7, 1.0, 1.5])), np.float32(rng.choice([-0.5, 0.0, 0.8])),
    np.float32(rng.choice([-1.0, 0.0, 0.4])), ids(4, 0.6),
    rng.normal(size=4).astype(np.float32), allowed,
    np.where(rng.random((3, 3)) < 0.7, rng.integers(0, vocab, (3, 3)), -1).astype(np.int32),
    np.int32(rng.integers(0, 8)), ids(3, 0.7))
  hist = sd.History(ids(6, 0.8), np.concatenate([rng.integers(0, vocab, size=int(
    rng.integers(0, 6))), np.full(6, -1)]).astype(np.int32)[:6])
  bitmask = sd.bitmask_from_mask(rng.random(vocab) < (0.8 if rng.random() < 0.5 else 1.0))
  return x, params, hist, bitmask


@jax.jit
def _three_ways(x, params, hist, bitmask):
  """process_logits, sample_draft's probabilities and the lazy statistics of one row."""
  eager = sd.process_logits(x, params, hist, bitmask)
  drawn = sd.sample_draft(jax.random.key(0), x, params, hist, bitmask)
  rows = request_rows(x[None], params, jnp.zeros((1,), jnp.int32),
                      history=sd.History(*(h[None] for h in hist)), bitmask=bitmask[None])
  edits = jax.tree.map(lambda e: e[0], rows.edits)
  lazy = row_probs(jax.tree.map(lambda s: s[0], rows.stats), adjusted_row(x, edits),
                   jnp.arange(x.shape[0]))
  return eager, drawn.probs, lazy


@settings(derandomize=True, max_examples=60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=requests())
def test_fuzz_every_field_eager_lazy_and_reference_agree(case):
  """process_logits, sample_draft and the lazy statistics (row edits) against the float64
  reference: the same support (except a token at a rounding boundary of top_p or min_p) and
  probabilities within 1e-5; a row that allows nothing is NaN on every side."""
  x, params, hist, bitmask = case
  kw = reference_kwargs(params, hist.output_ids)
  kw["prompt_ids"] = hist.prompt_ids
  # As drawn, and with min_p the only cut (no top-k / top-p fields: its own one-pass cut).
  for request in (params, params._replace(top_k=None, top_p=None)):
    k = None if request.top_k is None else int(request.top_k)
    p = None if request.top_p is None else float(request.top_p)
    want = reference.process_logits(x, float(request.temperature), k, p, bitmask=bitmask,
                                    **{k: v for k, v in kw.items()})
    got = [np.asarray(a) for a in _three_ways(x, request, hist, jnp.asarray(bitmask))]
    if np.isnan(want).all():
      for a in got:
        assert np.isnan(a).all()
      continue
    for name, a in zip(("eager", "sample_draft", "lazy"), got, strict=True):
      differ = ((a > 0) != (want > 0)) & ~((a == 0) & (want < 1e-30))
      if differ.any():  # only at a rounding boundary: one token, the row still sums to 1
        assert np.abs(a.sum() - 1) < 1e-5 and differ.sum() <= 1, (name, np.flatnonzero(differ))
      else:
        np.testing.assert_allclose(a, want, atol=1e-5, err_msg=f"{name}, top-k {k}, top-p {p}")



@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_presence_is_charged_once_per_token_frequency_per_occurrence(field):
  """Flat logits, an output where token 4 occurs twice and token 3 once: a presence penalty takes
  the same from both, a frequency penalty twice as much from token 4 (vLLM's definitions), in
  process_logits, sample_draft and the lazy statistics alike, equal to the float64 reference."""
  x = jnp.zeros(V, jnp.float32)
  params = sd.SamplingParams(np.float32(1.0), **{field: np.float32(0.7)})
  hist = sd.History(PROMPT, OUTPUT)
  want = reference.process_logits(np.zeros(V, np.float32), 1.0, None, None,
                                  **reference_kwargs(params, OUTPUT))
  ratio = want[4] / want[3]
  np.testing.assert_allclose(ratio, 1.0 if field == "presence_penalty" else np.exp(-0.7),
                             rtol=1e-6)
  bitmask = sd.bitmask_from_mask(np.ones(V, bool))
  for name, got in zip(("eager", "sample_draft", "lazy"),
                       _three_ways(x, params, hist, jnp.asarray(bitmask)), strict=True):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6, err_msg=name)

def test_grammar_masks_on_probability_rows_are_exact():
  """From probabilities (``verify`` and ``packed_verify``): each row masked and renormalised,
  the draft's rows too; every position's law given its prefix is the masked target row."""
  target, draft_logits = rows_case(1)
  p = np.asarray(jax.nn.softmax(jnp.asarray(target)))
  q = np.asarray(jax.nn.softmax(jnp.asarray(draft_logits)))

  def masked(row, prefix):
    bits = np.array([(int(grammar_np(prefix)[0]) >> t) & 1 for t in range(V)], bool)
    return np.where(bits, row, 0) / np.where(bits, row, 0).sum()

  @functools.partial(jax.jit, static_argnames="packed")
  def trial(key, packed=False):
    k_draft, k_verify = jax.random.split(key)
    tokens = []
    keys = jax.random.split(k_draft, GAMMA)
    for i in range(GAMMA):
      prefix = jnp.asarray(tokens, jnp.int32).reshape(-1)
      words = grammar(prefix)
      allowed = ((words.view(jnp.uint32)[0] >> jnp.arange(V, dtype=jnp.uint32)) & 1) != 0
      row = jnp.where(allowed, jnp.asarray(q[i]), 0)
      tokens.append(jax.random.categorical(keys[i], jnp.log(row / row.sum())))
    draft = jnp.stack(tokens).astype(jnp.int32)
    t_masks = jnp.stack([grammar(draft[:i]) for i in range(GAMMA + 1)])
    d_masks = t_masks[:GAMMA]
    if packed:
      r = sd.packed_verify(draft, jnp.array([GAMMA]), max_spec_len=GAMMA, target_probs=p,
                           draft_probs=q, key=k_verify[None], target_bitmask=t_masks,
                           draft_bitmask=d_masks)
      return r.tokens[0], r.num_tokens[0], r.error[0]
    r = sd.verify(p, q, draft, key=k_verify, target_bitmask=t_masks, draft_bitmask=d_masks)
    return r.tokens, r.num_tokens, r.error

  for packed in (False, True):
    tokens, num_tokens, error = (np.asarray(a) for a in jax.vmap(
      lambda k, packed=packed: trial(k, packed=packed))(jax.random.split(jax.random.key(8),
                                                                          TRIALS)))
    assert not error.any()
    cells = prefix_cells(tokens, num_tokens, GAMMA + 1)
    assert len(cells) >= 3
    for j, prefix, at in cells:
      assert_same_distribution(tokens[at, j], masked(p[j], prefix), ALPHA / len(cells) / 2,
                               f"probs packed={packed} position {j} after {prefix}")


def test_sglang_convention_applies_min_p_after_top_p():
  """``convention="sglang"``: sglang-jax's order (min_p after top-k and top-p) is the law of
  the emitted tokens; vLLM's order (the default) gives another law on these rows, and each
  convention fails the other's chi-square."""
  x = np.array([3.0, 2.6, 2.2, 1.8, 1.4, 1.0, 0.6, 0.2], np.float32)
  vllm_law = reference.process_logits(x, 1.0, None, 0.6, 0.3)
  sglang_law = reference.process_logits(x, 1.0, None, 0.6, 0.3, min_p_last=True)
  assert np.abs(vllm_law - sglang_law).max() > 0.05
  n = 20_000
  for convention, law, other in (("sglang", sglang_law, vllm_law),
                                 ("specdec", vllm_law, sglang_law)):
    r = sd.packed_verify(np.zeros(0, np.int32), np.zeros(n, np.int32), max_spec_len=0,
                         target_logits=np.tile(x, (n, 1)), convention=convention,
                         params=sd.SamplingParams(np.ones(n, np.float32),
                                                  top_p=np.full(n, 0.6, np.float32),
                                                  min_p=np.full(n, 0.3, np.float32)),
                         key=jax.random.key(9))
    tokens = np.asarray(r.tokens[:, 0])
    assert_same_distribution(tokens, law, ALPHA / 2, convention)
    with pytest.raises(AssertionError, match="chi-square"):
      assert_same_distribution(tokens, other, ALPHA, f"{convention} against the other order")


@pytest.mark.parametrize("candidates", [True, False], ids=["candidates", "bisection"])
def test_min_p_last_statistics_equal_the_reference(candidates):
  """sglang-jax's order in the lazy statistics (the candidates and the bisection) and in
  process_row, on rows of 200 logits at several top-k / top-p / min_p."""
  from specdec_jax._logits.lazy import logit_stats
  from specdec_jax._logits.transform import process_row

  rng = np.random.default_rng(10)
  x = (rng.normal(size=(6, 200)) * 2).astype(np.float32)
  t = np.array([1.0, 0.7, 1.3, 1.0, 2.0, 0.5], np.float32)
  k = np.array([0, 5, 80, 0, 120, 3], np.int32)
  p = np.array([0.6, 1.0, 0.9, 0.95, 0.7, 0.8], np.float32)
  m = np.array([0.3, 0.05, 0.1, 0.02, 0.2, 0.0], np.float32)
  params = sd.SamplingParams(t, k, p, m)
  stats = jax.jit(functools.partial(logit_stats, candidates=candidates, min_p_last=True))(
    jnp.asarray(x), params)
  lazy = np.asarray(row_probs(jax.tree.map(lambda s: s[:, None], stats), jnp.asarray(x),
                              jnp.arange(200)[None, :]))
  eager = np.asarray(jax.vmap(functools.partial(process_row, min_p_last=True))(
    jnp.asarray(x), params))
  for b in range(6):
    want = reference.process_logits(x[b], float(t[b]), int(k[b]), float(p[b]), float(m[b]),
                                    min_p_last=True)
    np.testing.assert_allclose(lazy[b], want, atol=1e-5, err_msg=f"lazy row {b}")
    np.testing.assert_allclose(eager[b], want, atol=1e-5, err_msg=f"eager row {b}")


@pytest.mark.parametrize("candidates", [True, False], ids=["candidates", "bisection"])
def test_min_p_one_keeps_exactly_the_top_tokens(candidates):
  """``min_p = 1`` keeps the tokens at the maximum (``p >= 1 * max p``, ties included) and no
  other, in the lazy statistics, in process_logits and in the reference."""
  from specdec_jax._logits.lazy import logit_stats

  x = np.array([[0.0, 3.0, 1.0, 3.0, -2.0], [0.5, -1.0, 2.0, 1.0, 0.0]], np.float32)
  m = np.array([1.0, 1.0], np.float32)
  params = sd.SamplingParams(np.ones(2, np.float32), min_p=m)
  want = np.array([[0, 0.5, 0, 0.5, 0], [0, 0, 1, 0, 0]])
  stats = jax.jit(functools.partial(logit_stats, candidates=candidates))(jnp.asarray(x), params)
  lazy = np.asarray(row_probs(jax.tree.map(lambda s: s[:, None], stats), jnp.asarray(x),
                              jnp.arange(5)[None, :]))
  np.testing.assert_allclose(lazy, want, atol=1e-6)
  eager = jax.vmap(lambda row: sd.process_logits(row, sd.SamplingParams(1.0, min_p=1.0)))(
    jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(eager), want, atol=1e-6)
  for b in range(2):
    np.testing.assert_allclose(reference.process_logits(x[b], 1.0, None, None, 1.0), want[b],
                               atol=1e-12)


def test_tree_prefixes_run_root_first():
  """A tree node's row follows its path's tokens root first (the order multi-token bad words
  match in), the root excluded and the node included; the chain's row i follows draft[:i]."""
  from specdec_jax._logits.adjust import chain_prefixes
  from specdec_jax._logits.adjust import tree_prefixes

  parents = jnp.array([-1, 0, 1, 2, 0], jnp.int32)
  tokens = jnp.array([3, 7, 8, 9, 4], jnp.int32)
  prefix, depth = tree_prefixes(parents, tokens, 3)
  want = [[-1, -1, -1], [7, -1, -1], [7, 8, -1], [7, 8, 9], [4, -1, -1]]
  np.testing.assert_array_equal(np.asarray(prefix), want)
  np.testing.assert_array_equal(np.asarray(depth), [0, 1, 2, 3, 1])
  prefix, length = chain_prefixes(jnp.array([5, 6]), 3)
  np.testing.assert_array_equal(np.asarray(prefix), [[-1, -1], [5, -1], [5, 6]])
  np.testing.assert_array_equal(np.asarray(length), [0, 1, 2])


def test_a_bad_word_padded_anywhere_is_its_tokens_in_order():
  """``-1`` inside a bad word is padding (the reference reads ``[-1, 4, -1, 2]`` as ``[4, 2]``):
  after the output ``..., 4`` the token 2 is banned, as with the right-padded word."""
  x = jnp.asarray(np.linspace(1.0, 0.0, V), jnp.float32)
  hist = sd.History(jnp.asarray(PROMPT), jnp.asarray(np.array([3, 1, 4, -1, -1, -1], np.int32)))
  gapped = sd.SamplingParams(1.0, bad_words=np.array([[-1, 4, -1, 2]], np.int32))
  padded = sd.SamplingParams(1.0, bad_words=np.array([[4, 2, -1, -1]], np.int32))
  got = np.asarray(sd.process_logits(x, gapped, hist))
  np.testing.assert_array_equal(got, np.asarray(sd.process_logits(x, padded, hist)))
  assert got[2] == 0 and got[1] > 0
  want = reference.process_logits(np.asarray(x), 1.0, bad_words=[[4, 2]],
                                  output_ids=[3, 1, 4])
  np.testing.assert_allclose(got, want, atol=1e-6)
