"""The packed, ragged entry point (:func:`packed_verify`): agreement, exactness, structure, errors.

* Agreement: on random ragged batches every layout (interleaved bonus rows, drafts-only rows
  with caller-sampled bonus tokens, static buffers longer than ``T``), every draft kind
  (probabilities, logits, point masses) and both rules give, token for token and flag for
  flag, what ``jax.vmap(verify)`` (``block_verify``, ``verify_logits``) gives on the padded
  arrays built by hand in NumPy (one-hot ``q`` rows, one-hot bonus rows).
* Exactness: chi-square per position on 120,000 packed requests per case, family-wise
  ``ALPHA = 0.01`` (Bonferroni over every test in this module), with negative controls that
  must fail the same check.
* Structure: the compiled program forms no ``(B, S, V)`` array.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from specdec_jax import ErrorCode
from specdec_jax import PackedVerifyResult
from specdec_jax import SamplingParams
from specdec_jax import block_verify
from specdec_jax import engine_params
from specdec_jax import flat_tokens
from specdec_jax import packed_verify
from specdec_jax import process_logits
from specdec_jax import verify
from specdec_jax import verify_logits
from specdec_jax import vocab_parallel_packed_verify
from tests._helpers import per_position
from tests._helpers import sample_rows

ALPHA = 0.01
NUM_TESTS = 40  # upper bound on the chi-square tests of this module (Bonferroni)
ALPHA_EACH = ALPHA / NUM_TESTS
RULES = {"token": verify, "block": block_verify}


def _batch(seed, batch=9, spec=4, vocab=40):
  """A ragged batch: padded arrays (for the reference) and their packed forms."""
  rng = np.random.default_rng(seed)
  n = rng.integers(0, spec + 1, batch)
  n[rng.integers(batch)] = 0  # always one request without drafts
  p = rng.dirichlet(np.full(vocab, 0.4), (batch, spec + 1)).astype(np.float32)
  q = rng.dirichlet(np.full(vocab, 0.4), (batch, spec)).astype(np.float32)
  d = rng.integers(0, vocab, (batch, spec)).astype(np.int32)
  u = rng.random((batch, spec + 1)).astype(np.float32)
  pack = {
    "interleaved": np.concatenate([p[i, :n[i] + 1] for i in range(batch)]),
    "drafts_only": np.concatenate([p[i, :n[i]] for i in range(batch)] + [p[0, :0]]),
    "q": np.concatenate([q[i, :n[i]] for i in range(batch)] + [q[0, :0]]),
    "ids": np.concatenate([d[i, :n[i]] for i in range(batch)] + [d[0, :0]]),
  }
  return rng, n, p, q, d, u, pack


def _same(want, got: PackedVerifyResult, label: str):
  for field in ("tokens", "num_tokens", "num_accepted", "valid", "error"):
    np.testing.assert_array_equal(np.asarray(getattr(want, field)),
                                  np.asarray(getattr(got, field)), err_msg=f"{label}: {field}")


def _grow(a, rows, fill):
  """A static engine buffer: ``a`` followed by ``rows`` rows of garbage that must not be read."""
  return np.concatenate([a, np.full((rows, *a.shape[1:]), fill, a.dtype)])


def _fit(a, rows, fill):
  """``a`` in a static buffer of ``rows`` rows (one shape for every seed: one compilation)."""
  return _grow(a, rows - len(a), fill)


CAP = 9 * 4  # the draft buffer of _batch's default B = 9, S = 4


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("seed", range(6))
def test_probabilities_interleaved_equal_the_padded_verifier(rule, seed):
  _, n, p, q, d, u, pack = _batch(seed)
  want = jax.vmap(RULES[rule])(p, q, d, u, num_draft=n)
  got = packed_verify(_fit(pack["ids"], CAP, 7), n, max_spec_len=4, rule=rule,
                      target_probs=_fit(pack["interleaved"], CAP + 9, np.nan),
                      draft_probs=_fit(pack["q"], CAP, np.nan), uniforms=u)
  _same(want, got, f"{rule} seed {seed}")


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("seed", range(6))
def test_point_mass_drafts_equal_one_hot_q(rule, seed):
  _, n, p, _, d, u, pack = _batch(seed)
  d = np.where(np.arange(4) % 2 == 0, p[:, :4].argmax(-1), d).astype(np.int32)  # often kept
  pack["ids"] = np.concatenate([d[i, :n[i]] for i in range(len(n))] + [d[0, :0]])
  one_hot = np.eye(p.shape[-1], dtype=np.float32)[d]
  want = jax.vmap(RULES[rule])(p, one_hot, d, u, num_draft=n)
  got = packed_verify(_fit(pack["ids"], CAP, 7), n, max_spec_len=4, rule=rule,
                      target_probs=_fit(pack["interleaved"], CAP + 9, np.nan), uniforms=u)
  _same(want, got, f"{rule} point mass seed {seed}")


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("seed", range(6))
def test_caller_bonus_tokens_equal_a_one_hot_bonus_row(rule, seed):
  rng, n, p, q, d, u, pack = _batch(seed)
  bonus = rng.integers(0, p.shape[-1], len(n)).astype(np.int32)
  padded = p.copy()
  padded[np.arange(len(n)), n] = np.eye(p.shape[-1], dtype=np.float32)[bonus]
  want = jax.vmap(RULES[rule])(padded, q, d, u, num_draft=n)
  got = packed_verify(_fit(pack["ids"], CAP, 7), n, max_spec_len=4, rule=rule,
                      bonus_token_ids=bonus, target_probs=_fit(pack["drafts_only"], CAP, np.nan),
                      draft_probs=_fit(pack["q"], CAP, np.nan), uniforms=u)
  # The bonus is not sampled: one uniform fewer is read, nothing else differs.
  _same(want, got, f"{rule} bonus seed {seed}")
  # Interleaved rows with a given bonus: the bonus rows are not read either.
  target = pack["interleaved"].copy()
  target[np.cumsum(n + 1) - 1] = np.nan
  got = packed_verify(_fit(pack["ids"], CAP, 7), n, max_spec_len=4, rule=rule,
                      bonus_token_ids=bonus, bonus_rows=True,
                      target_probs=_fit(target, CAP + 9, np.nan),
                      draft_probs=_fit(pack["q"], CAP, np.nan), uniforms=u)
  _same(want, got, f"{rule} bonus, interleaved, seed {seed}")


@pytest.mark.parametrize("seed", range(4))
def test_logits_with_per_request_params_equal_verify_logits(seed):
  rng, n, _, _, d, u, _ = _batch(seed)
  batch, spec, vocab = len(n), 4, 40
  target = (rng.normal(size=(batch, spec + 1, vocab)) * 3).astype(np.float32)
  draft = (rng.normal(size=(batch, spec, vocab)) * 3).astype(np.float32)
  target[..., :4] = 2.0  # ties at the top: greedy and top-k must break them to the lower id
  params = SamplingParams(
    temperature=rng.choice([0.0, 0.5, 1.0, 1.7], batch).astype(np.float32),
    top_k=rng.choice([0, 1, 3, 12], batch).astype(np.int32),
    top_p=rng.choice([1.0, 0.9, 0.5], batch).astype(np.float32))
  want = jax.vmap(verify_logits)(target, draft, d, u, params, num_draft=n)
  got = packed_verify(
    _fit(np.concatenate([d[i, :n[i]] for i in range(batch)] + [d[0, :0]]), CAP, 3), n,
    max_spec_len=spec, params=params, uniforms=u,
    target_logits=_fit(np.concatenate([target[i, :n[i] + 1] for i in range(batch)]), CAP + 9,
                       np.nan),
    draft_logits=_fit(np.concatenate([draft[i, :n[i]] for i in range(batch)] + [draft[0, :0]]),
                      CAP, np.nan))
  _same(want, got, f"logits seed {seed}")


def test_keys_one_per_batch_or_per_request():
  _, n, _, _, _, _, pack = _batch(0)
  kw = dict(target_probs=pack["interleaved"], draft_probs=pack["q"], max_spec_len=4)
  key = jax.random.key(3)
  got = packed_verify(pack["ids"], n, key=key, **kw)
  _same(packed_verify(pack["ids"], n, uniforms=jax.random.uniform(key, (len(n), 5)), **kw),
        got, "one key")
  keys = jax.random.split(key, len(n))
  got = packed_verify(pack["ids"], n, key=keys, **kw)
  want = jax.vmap(lambda k: jax.random.uniform(k, (5,)))(keys)
  _same(packed_verify(pack["ids"], n, uniforms=want, **kw), got, "per-request keys")
  # Per-request keys: a request's result does not depend on the rest of the batch.
  solo = packed_verify(pack["ids"][: n[0]], n[:1], key=keys[:1],
                       target_probs=pack["interleaved"][: n[0] + 1],
                       draft_probs=pack["q"][: n[0]], max_spec_len=4)
  np.testing.assert_array_equal(solo.tokens[0], got.tokens[0])


def test_flat_tokens_is_tpu_inference_layout():
  rng, n, _, _, _, u, pack = _batch(1)
  bonus = rng.integers(0, 40, len(n)).astype(np.int32)
  result = packed_verify(pack["ids"], n, max_spec_len=4, target_probs=pack["drafts_only"],
                         draft_probs=pack["q"], bonus_token_ids=bonus, uniforms=u)
  slots = int(n.sum()) + 3
  flat = np.asarray(flat_tokens(result, n, num_slots=slots))
  want = np.full(slots + len(n), -1)
  start = 0
  for i, count in enumerate(n):  # tpu-inference: main tokens per draft slot, bonuses appended
    tokens, emitted = np.asarray(result.tokens[i]), int(result.num_tokens[i])
    for j in range(count):
      if j < emitted:
        want[start + j] = tokens[j]
    if emitted == count + 1:
      want[slots + i] = tokens[count]
      assert tokens[count] == bonus[i]
    start += count
  np.testing.assert_array_equal(flat, want)


def test_flat_tokens_refuses_a_buffer_that_drops_tokens_and_bad_counts():
  """Issue 23, items 4 and 17: fewer slots than drafts, a negative or non-int ``num_slots``,
  counts of the wrong length or beyond int32: a clear error, never tokens dropped silently."""
  _, n, _, _, _, u, pack = _batch(1)
  result = packed_verify(pack["ids"], n, max_spec_len=4, target_probs=pack["interleaved"],
                         draft_probs=pack["q"], uniforms=u, bonus_rows=True)
  total = int(n.sum())
  with pytest.raises(ValueError, match=rf"flat_tokens: `num_slots` must be >= .*\({total}\)"):
    flat_tokens(result, n, num_slots=total - 1)
  for slots in (-1, 2.5, "8"):
    with pytest.raises(ValueError, match="flat_tokens: `num_slots` must be a static int"):
      flat_tokens(result, n, num_slots=slots)
  with pytest.raises(ValueError, match=r"`num_draft_tokens` must have shape \(\d+,\)"):
    flat_tokens(result, n[:-1], num_slots=total)
  with pytest.raises(ValueError, match="fit in int32"):
    flat_tokens(result, n.astype(np.int64) + 2**32, num_slots=total)
  assert flat_tokens(result, n, num_slots=total).shape == (total + len(n),)  # exactly enough


@pytest.mark.parametrize("form", ["bonus_ids", "bonus_rows", "logits", "point_mass",
                                  "vocab_parallel"])
def test_a_step_without_drafts_emits_each_bonus_token(form):
  """T = 0 (no request proposed anything; issue 23, item 15): every request emits its bonus
  token, the caller's or the one sampled from its bonus row with uniform 0 as the padded
  ``verify`` does; a count claiming a draft under jit is flagged, not read from a padding."""
  batch, vocab, spec = 3, 16, 2
  rng = np.random.default_rng(7)
  u = rng.random((batch, spec + 1)).astype(np.float32)
  bonus_ids = np.array([3, 4, 5], np.int32)
  rows = rng.dirichlet(np.ones(vocab), batch).astype(np.float32)
  logits = rng.normal(size=(batch, vocab)).astype(np.float32)
  empty_ids, empty_rows = np.zeros(0, np.int32), np.zeros((0, vocab), np.float32)
  kwargs = {
    "bonus_ids": dict(target_probs=empty_rows, draft_probs=empty_rows, bonus_token_ids=bonus_ids),
    "bonus_rows": dict(target_probs=rows, draft_probs=empty_rows, bonus_rows=True),
    "logits": dict(target_logits=logits, draft_logits=empty_rows, bonus_rows=True),
    "point_mass": dict(target_probs=empty_rows, bonus_token_ids=bonus_ids),
    "vocab_parallel": dict(target_probs=rows, draft_probs=empty_rows),
  }[form]
  if form == "vocab_parallel":
    call = functools.partial(vocab_parallel_packed_verify(
      jax.make_mesh((8,), ("model",)), "model", max_spec_len=spec, bonus_rows=True), **kwargs)
  else:
    call = functools.partial(packed_verify, max_spec_len=spec, **kwargs)
  result = call(empty_ids, np.zeros(batch, np.int32), uniforms=u)
  if "bonus_token_ids" in kwargs:
    want = bonus_ids
  else:
    target = rows if form != "logits" else np.asarray(process_logits(logits, SamplingParams()))
    padded = np.zeros((batch, spec + 1, vocab), np.float32)
    padded[:, 0] = target
    ref = jax.vmap(functools.partial(verify, num_draft=0))(
      padded, np.full((batch, spec, vocab), 1.0 / vocab, np.float32),
      np.zeros((batch, spec), np.int32), u)
    want = np.asarray(ref.tokens[:, 0])
  np.testing.assert_array_equal(np.asarray(result.tokens[:, 0]), want)
  assert np.all(np.asarray(result.tokens[:, 1:]) == -1)
  assert np.asarray(result.num_tokens).tolist() == [1] * batch
  assert np.all(np.asarray(result.valid)), result.error
  # Counts that claim a draft T = 0 does not hold: flagged (the later requests' offsets shift
  # with it, so they are flagged too), never read from the padding row.
  claimed = jax.jit(lambda n: call(empty_ids, n, uniforms=u))(np.array([1, 0, 0], np.int32))
  assert not np.any(np.asarray(claimed.valid))
  assert np.all(np.asarray(claimed.error) & int(ErrorCode.BAD_NUM_DRAFT))


@pytest.mark.parametrize("convention", ["specdec", "vllm"])
def test_an_all_greedy_batch_needs_no_randomness(convention):
  """Issue 23, item 21: all-greedy requests (temperature 0, or vLLM's ``temperature=None``)
  need neither a key nor uniforms, and give what any uniforms give; one sampled request brings
  the requirement back."""
  rng = np.random.default_rng(8)
  n, vocab = np.array([2, 0, 1], np.int32), 12
  total = int(n.sum())
  logits = rng.normal(size=(total + len(n), vocab)).astype(np.float32)
  ids = rng.integers(0, vocab, total).astype(np.int32)
  ids[0] = np.argmax(logits[0])  # one accepted draft
  call = functools.partial(packed_verify, ids, n, target_logits=logits, max_spec_len=2,
                           bonus_rows=True, convention=convention)
  greedy = SamplingParams(None) if convention == "vllm" else SamplingParams(np.zeros(3, np.float32))
  free = call(params=greedy)
  assert np.all(np.asarray(free.valid))
  for seed in range(3):
    keyed = call(params=greedy, key=jax.random.key(seed))
    np.testing.assert_array_equal(np.asarray(free.tokens), np.asarray(keyed.tokens))
  assert int(free.num_accepted[0]) >= 1
  with pytest.raises(ValueError, match="pass exactly one of `key` and `uniforms`, got neither"):
    call(params=SamplingParams(np.array([0.0, 0.7, 0.0], np.float32)))


@pytest.mark.parametrize("convention", ["vllm", "tpu_inference", "sglang"])
def test_a_nan_temperature_under_an_engine_convention_is_flagged(convention):
  """Issue 23, item 27: NaN is not "below the greedy threshold": it stays NaN and the request
  is flagged BAD_PARAMS (a NaN mapped to greedy would give a plausible token, valid)."""
  mapped = engine_params(SamplingParams(np.array([np.nan, 0.5], np.float32)), convention)
  assert np.isnan(np.asarray(mapped.temperature)[0])
  logits = np.random.default_rng(9).normal(size=(4, 8)).astype(np.float32)
  result = packed_verify(np.array([1, 2], np.int32), np.array([1, 1], np.int32),
                         target_logits=logits, max_spec_len=1, bonus_rows=True,
                         params=SamplingParams(np.array([np.nan, 0.5], np.float32)),
                         convention=convention, uniforms=np.full((2, 2), 0.5, np.float32))
  assert np.asarray(result.valid).tolist() == [False, True]
  assert int(result.error[0]) & int(ErrorCode.BAD_PARAMS)


@pytest.mark.parametrize("rule", ["token", "block"])
def test_greedy_requests_may_leave_their_draft_rows_unfilled(rule):
  """Issue 23, item 22: engines leave a greedy request's draft-probability rows as zeros
  (greedy never reads them). The result is the one with point-mass drafts, valid; a sampled
  request beside it is untouched, and a negative entry (which would change the residual)
  stays flagged."""
  rng = np.random.default_rng(10)
  n, vocab = np.array([3, 2, 3], np.int32), 10
  total = int(n.sum())
  logits = rng.normal(size=(total + 3, vocab)).astype(np.float32)
  q = rng.dirichlet(np.ones(vocab), total).astype(np.float32)
  ids = rng.integers(0, vocab, total).astype(np.int32)
  rows = np.repeat(np.arange(3), n)
  greedy = np.array([True, False, True])
  ids[0] = np.argmax(logits[0])  # an accepted greedy draft, then (likely) a rejection
  q[greedy[rows]] = 0.0
  params = SamplingParams(np.where(greedy, 0.0, 0.8).astype(np.float32))
  u = rng.random((3, 4)).astype(np.float32)
  call = functools.partial(packed_verify, ids, n, target_logits=logits, params=params,
                           max_spec_len=3, bonus_rows=True, uniforms=u, rule=rule)
  got = call(draft_probs=q)
  assert np.all(np.asarray(got.valid)), got.error
  points = call()  # point-mass drafts: what a greedy request's rows cannot change
  for g in np.nonzero(greedy)[0]:
    np.testing.assert_array_equal(np.asarray(got.tokens[g]), np.asarray(points.tokens[g]))
  q_full = q.copy()
  q_full[greedy[rows]] = 1.0 / vocab  # filled rows: the sampled request is the same
  np.testing.assert_array_equal(np.asarray(got.tokens[1]),
                                np.asarray(call(draft_probs=q_full).tokens[1]))
  negative = q.copy()
  negative[rows == 0] = -0.1  # every row request 0 may read
  bad = call(draft_probs=negative)
  assert not bool(bad.valid[0]) and int(bad.error[0]) & int(ErrorCode.NEGATIVE)


def test_engine_conventions_map_to_greedy_and_disabled():
  t = np.array([-1.0, 0.0, 1e-7, 0.5], np.float32)
  k = np.array([-1, 0, 5, 1 << 30], np.int32)
  for convention in ("vllm", "tpu_inference", "sglang"):
    mapped = engine_params(SamplingParams(t, k, np.ones(4, np.float32)), convention)
    assert np.asarray(mapped.temperature).tolist() == [0.0, 0.0, 0.0, 0.5], convention
    assert np.asarray(mapped.top_k).tolist() == [0, 0, 5, 1 << 30], convention
  same = engine_params(SamplingParams(t, k), "specdec")
  assert same.temperature is t
  with pytest.raises(ValueError, match="engine_params: `convention` must be one of"):
    engine_params(SamplingParams(), "sglang-jax")


def test_tpu_inference_greedy_sentinel_gives_argmax_rows():
  """temperature -1 (tpu-inference greedy) in a batch mixed with sampled rows."""
  rng, n, _, _, _, u, pack = _batch(2)
  logits = (rng.normal(size=(int(n.sum()) + len(n), 40)) * 2).astype(np.float32)
  temperature = np.where(np.arange(len(n)) % 2 == 0, -1.0, 0.8).astype(np.float32)
  params = SamplingParams(temperature, np.full(len(n), -1, np.int32), np.ones(len(n)))
  got = packed_verify(pack["ids"], n, max_spec_len=4, target_logits=logits, params=params,
                      convention="tpu_inference", uniforms=u)
  assert np.asarray(got.valid).all()
  rows = np.cumsum(n + 1) - (n + 1)
  for i in range(0, len(n), 2):  # greedy rows: accepted while draft == argmax, then the argmax
    argmax = logits[rows[i]: rows[i] + n[i] + 1].argmax(-1)
    k = int(got.num_accepted[i])
    assert (pack["ids"][rows[i] - i: rows[i] - i + k] == argmax[:k]).all()
    assert int(got.tokens[i, k]) == argmax[k]
  with pytest.raises(ValueError, match=r"packed_verify: `params.temperature` must be >= 0"):
    packed_verify(pack["ids"], n, max_spec_len=4, target_logits=logits, params=params, uniforms=u)


# --- exactness -------------------------------------------------------------------------------

TRIALS = 120_000
P_ROWS = np.array([[0.1, 0.4, 0.3, 0.2, 0.0], [0.25, 0.05, 0.3, 0.2, 0.2],
                   [0.5, 0.1, 0.1, 0.1, 0.2], [0.05, 0.05, 0.1, 0.3, 0.5]])
Q_ROWS = np.array([[0.3, 0.3, 0.1, 0.1, 0.2], [0.1, 0.1, 0.5, 0.2, 0.1],
                   [0.2, 0.2, 0.2, 0.2, 0.2]])


@functools.cache
def _simulate(case: str, seed: int = 0):
  """TRIALS requests with ragged counts, all on the rows P_ROWS (drafts drawn from Q_ROWS)."""
  rng = np.random.default_rng(seed)
  spec = Q_ROWS.shape[0]
  n = rng.integers(0, spec + 1, TRIALS)
  drafts = sample_rows(rng, Q_ROWS, TRIALS).astype(np.int32)
  ids = np.concatenate([drafts[i, :n[i]] for i in range(TRIALS)])
  position = np.arange(len(ids)) - np.repeat(np.cumsum(n) - n, n)
  u = rng.random((TRIALS, spec + 1)).astype(np.float32)
  kw = dict(max_spec_len=spec, uniforms=u, rule="block" if "block" in case else "token")
  if case in ("probs", "block", "wrong_offsets"):
    interleaved_pos = np.concatenate([np.arange(k + 1) for k in n])
    target = P_ROWS[interleaved_pos].astype(np.float32)
    if case == "wrong_offsets":  # a plausible integration bug: drafts-only offsets on [T + B]
      return packed_verify(ids, n, target_probs=target, draft_probs=Q_ROWS[position].astype(
        np.float32), bonus_token_ids=np.zeros(TRIALS, np.int32), bonus_rows=False, **kw), n
    return packed_verify(ids, n, target_probs=target,
                         draft_probs=Q_ROWS[position].astype(np.float32), **kw), n
  if case == "point_as_q":  # deterministic drafts (the Q rows' argmax) declared as drawn from Q
    ids = Q_ROWS.argmax(-1)[position].astype(np.int32)
  if case in ("point", "point_block", "point_as_q"):
    # Drafts drawn from Q but verified as point masses: exact for any drafter independent of
    # the uniforms. Bonus tokens sampled by the caller from the bonus row.
    cdf = np.cumsum(P_ROWS[n], axis=1)
    bonus = np.minimum((rng.random((TRIALS, 1)) >= cdf).sum(1), 4).astype(np.int32)
    target = P_ROWS[position].astype(np.float32)
    draft = Q_ROWS[position].astype(np.float32) if case == "point_as_q" else None
    kw["rule"] = "block" if case == "point_block" else "token"
    return packed_verify(ids, n, target_probs=target, draft_probs=draft,
                         bonus_token_ids=bonus, **kw), n
  raise ValueError(case)


@pytest.mark.parametrize("case", ["probs", "block", "point", "point_block"])
def test_chi_square_per_position(case):
  result, _ = _simulate(case)
  assert np.asarray(result.valid).all()
  tested = per_position(np.asarray(result.tokens), np.asarray(result.num_tokens),
                        P_ROWS, ALPHA_EACH, case)
  # Point masses accept with probability p(x) only: position 3 is reached too rarely to test.
  assert tested >= (3 if "point" in case else P_ROWS.shape[0])


@pytest.mark.parametrize("case", ["wrong_offsets", "point_as_q"])
def test_negative_controls_fail_the_chi_square(case):
  """Rows read at the wrong offsets; deterministic drafts declared as drawn from q."""
  result, _ = _simulate(case)
  with pytest.raises(AssertionError, match="chi-square"):
    per_position(np.asarray(result.tokens), np.asarray(result.num_tokens), P_ROWS, ALPHA_EACH,
                 case)


def test_chi_square_logits_mixed_greedy_and_sampled():
  """Processed targets: per request temperature/top-k/top-p, greedy requests mixed in."""
  rng = np.random.default_rng(5)
  logits = np.log(P_ROWS + 0.02).astype(np.float32) * 1.5
  trials, spec = TRIALS, 3
  params = SamplingParams(np.float32(0.8), np.int32(4), np.float32(0.85))
  want = np.asarray(process_logits(logits, params), np.float64)
  n = rng.integers(0, spec + 1, trials)
  drafts = sample_rows(rng, Q_ROWS, trials).astype(np.int32)
  ids = np.concatenate([drafts[i, :n[i]] for i in range(trials)])
  rows = logits[np.concatenate([np.arange(k + 1) for k in n])]
  greedy = rng.random(trials) < 0.25
  temps = np.where(greedy, 0.0, 0.8).astype(np.float32)
  per_request = SamplingParams(temps, np.full(trials, 4, np.int32), np.full(trials, 0.85,
                                                                          np.float32))
  result = packed_verify(ids, n, max_spec_len=spec, target_logits=rows, params=per_request,
                         uniforms=rng.random((trials, spec + 1)).astype(np.float32))
  tokens, num = np.asarray(result.tokens), np.asarray(result.num_tokens)
  assert np.asarray(result.valid).all()
  per_position(tokens[~greedy], num[~greedy], want, ALPHA_EACH, "logits sampled")
  argmax = logits.argmax(-1)
  for j in range(spec + 1):  # greedy requests: the argmax at every emitted position
    emitted = greedy & (num > j)
    assert (tokens[emitted, j] == argmax[j]).all()


# --- structure, sharding, bad input ----------------------------------------------------------


def _largest_computed(hlo: str) -> int:
  """Element count of the largest array an instruction of compiled HLO computes (not params)."""
  largest = 0
  for line in hlo.splitlines():
    if " = " not in line or any(op in line for op in ("parameter(", "get-tuple-element(",
                                                       " tuple(", "bitcast(")):
      continue  # headers, and views of the inputs rather than computed arrays
    lhs = line.split(" = ", 1)[1]
    for dims in re.findall(r"[a-z]+\d*\[([\d,]+)\]", lhs.split("(")[0]):
      largest = max(largest, int(np.prod([int(x) for x in dims.split(",")])))
  return largest


def test_no_padded_copy_in_the_compiled_program():
  batch, spec, vocab = 16, 8, 4096
  n = np.array([1, 0, 2, 1] * 4, np.int32)  # T = 16 draft rows, T + B = 32 target rows
  total = int(n.sum())
  args = dict(max_spec_len=spec, bonus_rows=True, rule="token", pad_id=-1)
  from specdec_jax._layouts.packed import packed_jit

  lowered = packed_jit.lower(
    np.zeros(total, np.int32), n, np.zeros((total + batch, vocab), np.float32), None,
    np.zeros((total, vocab), np.float32), None, None, None,
    np.zeros((batch, spec + 1), np.float32), None, **args)
  largest = _largest_computed(lowered.compile().as_text())
  # A gather to the padded layout would form B * (S + 1) * V = 589,824 elements; reading in
  # place needs rows of V and block sums of B * V / 256.
  assert largest < 2 * vocab * 2, largest


@pytest.mark.parametrize("rule, bonus", [("token", False), ("block", True)])
def test_vocab_parallel_packed_agrees_with_single_device(rule, bonus):
  mesh = jax.make_mesh((8,), ("model",))
  fails = 0
  for seed in range(4):
    rng, n, _, _, _, u, pack = _batch(seed, batch=12, vocab=64)
    ids = rng.integers(0, 64, len(n)).astype(np.int32) if bonus else None
    target = pack["drafts_only"] if bonus else pack["interleaved"]
    fn = vocab_parallel_packed_verify(mesh, "model", max_spec_len=4, bonus_rows=not bonus,
                                      rule=rule)
    got = fn(pack["ids"], n, target_probs=target, uniforms=u, draft_probs=pack["q"],
             bonus_token_ids=ids)
    want = packed_verify(pack["ids"], n, max_spec_len=4, target_probs=target, rule=rule,
                         draft_probs=pack["q"], bonus_token_ids=ids, uniforms=u)
    for field in ("num_accepted", "valid", "error"):
      np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                    np.asarray(getattr(want, field)))
    fails += int((np.asarray(got.tokens) != np.asarray(want.tokens)).sum())
  assert fails == 0  # (a token may differ only within rounding of a CDF boundary: none here)


def test_flags_under_jit_and_ids_in_range():
  _, n, _, _, _, u, pack = _batch(3)
  ids = pack["ids"].copy()
  ids[0] = 99  # out of range: rejected and flagged
  target = pack["interleaved"].copy()
  counts = n.copy()
  counts[-1] = 9  # more than max_spec_len: clipped and flagged
  bonus = np.full(len(n), 40, np.int32)  # == V: flagged when used

  @jax.jit
  def run(ids, counts, target, bonus):
    return packed_verify(ids, counts, max_spec_len=4, target_probs=target[: len(target)],
                         draft_probs=pack["q"], bonus_token_ids=bonus, bonus_rows=True,
                         uniforms=u)

  r = run(ids, counts, target, bonus)
  tokens, error = np.asarray(r.tokens), np.asarray(r.error)
  assert ((tokens == -1) | ((tokens >= 0) & (tokens < 40))).all()
  first = int(np.argmax(n > 0))
  assert error[first] & ErrorCode.DRAFT_OUT_OF_RANGE
  assert error[-1] & ErrorCode.BAD_NUM_DRAFT
  took_bonus = np.asarray(r.num_accepted) == np.minimum(counts, 4)
  assert (error[took_bonus] & ErrorCode.TOKEN_OUT_OF_RANGE).all()
  assert not np.asarray(r.valid)[took_bonus].any()


@pytest.mark.parametrize("kwargs, message", [
  (dict(num_draft_tokens=np.array([5, 0])), r"`num_draft_tokens` must be in \[0, max_spec_len\]"),
  (dict(num_draft_tokens=np.array([2, 2])), r"sums to 4, more than the 3 entries"),
  (dict(target_logits=np.zeros((5, 6), np.float32)), "exactly one of `target_probs`"),
  (dict(uniforms=None), "exactly one of `key` and `uniforms`"),
  (dict(params=SamplingParams(0.5)), "`params` apply to logits"),
  (dict(bonus_rows=False), "`bonus_rows` must be True"),
  (dict(target_probs=np.zeros((4, 6), np.float32)), r"at least T \+ B .* = 5 rows"),
  (dict(uniforms=np.zeros((2, 3), np.float32)), r"`uniforms` must have shape \(B, max_spec"),
  (dict(draft_probs=np.zeros((3, 5), np.float32)), r"`draft_probs` must have V = 6 columns"),
  (dict(draft_probs=np.zeros((2, 6), np.float32)), r"`draft_probs` must have at least T = 3 rows"),
  (dict(rule="tree"), "`rule` must be one of"),
  (dict(max_spec_len=-1), "`max_spec_len` must be a static int >= 0"),
  (dict(draft_token_ids=[[1, 2, 3]]), "`draft_token_ids` must have rank 1"),
])
def test_bad_input_is_a_clear_error(kwargs, message):
  args = dict(draft_token_ids=np.array([1, 2, 3], np.int32), num_draft_tokens=np.array([2, 1]),
              max_spec_len=4, target_probs=np.full((5, 6), 1 / 6, np.float32),
              uniforms=np.zeros((2, 5), np.float32))
  args.update(kwargs)
  with pytest.raises((ValueError, TypeError), match=f"packed_verify: .*{message}"):
    packed_verify(**args)


# --- fuzzing: garbage in, flags out ----------------------------------------------------------

FUZZ_B, FUZZ_S, FUZZ_V, FUZZ_T = 5, 3, 16, 12


@functools.cache
def _fuzz_fn(rule: str, bonus: bool, point: bool):
  @jax.jit
  def run(ids, counts, target, draft, bonus_ids, uniforms):
    return packed_verify(ids, counts, max_spec_len=FUZZ_S, target_probs=target,
                         draft_probs=None if point else draft,
                         bonus_token_ids=bonus_ids if bonus else None, bonus_rows=not bonus,
                         uniforms=uniforms, rule=rule)
  return run


@settings(derandomize=True, max_examples=60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), rule=st.sampled_from(sorted(RULES)),
       bonus=st.booleans(), point=st.booleans(), garbage=st.sets(st.sampled_from(
         ["counts", "ids", "nan", "negative", "bonus", "uniforms"])))
def test_fuzz_under_jit_outputs_stay_in_range_and_clean_inputs_are_valid(seed, rule, bonus,
                                                                         point, garbage):
  rng = np.random.default_rng(seed)
  counts = rng.integers(0, FUZZ_S + 1, FUZZ_B)
  while counts.sum() > FUZZ_T:
    counts[rng.integers(FUZZ_B)] = 0
  rows = FUZZ_T + (0 if bonus else FUZZ_B)
  target = rng.dirichlet(np.ones(FUZZ_V), rows).astype(np.float32)
  draft = rng.dirichlet(np.ones(FUZZ_V), FUZZ_T).astype(np.float32)
  ids = rng.integers(0, FUZZ_V, FUZZ_T)
  bonus_ids = rng.integers(0, FUZZ_V, FUZZ_B)
  uniforms = rng.random((FUZZ_B, FUZZ_S + 1)).astype(np.float32)
  if "counts" in garbage:
    counts[rng.integers(FUZZ_B)] = rng.choice([-3, FUZZ_S + 2, 2**31 - 1])
  if "ids" in garbage:
    ids[rng.integers(FUZZ_T)] = rng.choice([-1, FUZZ_V, 2**31 - 1])
  if "nan" in garbage:
    target[rng.integers(rows), rng.integers(FUZZ_V)] = np.nan
  if "negative" in garbage:
    target[rng.integers(rows)] *= -1
  if "bonus" in garbage:
    bonus_ids[:] = rng.choice([-7, FUZZ_V])
  if "uniforms" in garbage:
    uniforms[rng.integers(FUZZ_B), rng.integers(FUZZ_S + 1)] = rng.choice([1.0, -0.5, np.nan])
  result = _fuzz_fn(rule, bonus, point)(ids.astype(np.int32), counts.astype(np.int32), target,
                                        draft, bonus_ids.astype(np.int32), uniforms)
  tokens, num = np.asarray(result.tokens), np.asarray(result.num_tokens)
  assert ((tokens >= 0) & (tokens < FUZZ_V) | (tokens == -1)).all()
  assert ((num >= 1) & (num <= FUZZ_S + 1)).all()
  slots = np.arange(FUZZ_S + 1)[None, :]
  assert (tokens[slots >= num[:, None]] == -1).all() and (tokens[slots < num[:, None]] >= 0).all()
  assert (np.asarray(result.valid) == (np.asarray(result.error) == 0)).all()
  if not garbage:
    assert np.asarray(result.valid).all()
  if "counts" in garbage:
    assert not np.asarray(result.valid).all()
