"""Logits processing (temperature, top-k, top-p, greedy), the draft helper and verify_logits."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import ErrorCode
from specdec_jax import SamplingParams
from specdec_jax import process_logits
from specdec_jax import sample_draft
from specdec_jax import verify_logits
from tests._helpers import assert_same_distribution
from tests._helpers import keyed


def _softmax(x):
  e = np.exp(x - x.max())
  return e / e.sum()


def _reference_process(logits, temperature, top_k, top_p):
  """Straightforward NumPy float64 version of the documented order and tie-breaking."""
  x = np.asarray(logits, np.float64)
  vocab = x.shape[0]
  if temperature == 0:
    out = np.zeros(vocab)
    out[np.argmax(x)] = 1
    return out
  x = x / temperature
  order = np.argsort(-x, kind="stable")
  keep = np.ones(vocab, bool)
  if top_k:
    keep[order[top_k:]] = False
  x = np.where(keep, x, -np.inf)
  probs = _softmax(x)
  if top_p < 1:
    sorted_p = probs[order]
    before = np.cumsum(sorted_p) - sorted_p
    keep_sorted = before < top_p
    keep_sorted[0] = True
    keep2 = np.zeros(vocab, bool)
    keep2[order] = keep_sorted
    probs = _softmax(np.where(keep2, x, -np.inf))
  return probs


@pytest.mark.parametrize("temperature", [0.0, 0.3, 1.0, 2.5])
@pytest.mark.parametrize("top_k", [0, 1, 3, 10])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 1.0])
def test_process_logits_matches_numpy(temperature, top_k, top_p):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=10) * 2
  logits[3] = logits[7]  # a tie
  got = process_logits(jnp.asarray(logits, jnp.float32),
                       SamplingParams(temperature, jnp.int32(top_k), jnp.float32(top_p)))
  want = _reference_process(logits, temperature, top_k, top_p)
  np.testing.assert_allclose(np.asarray(got), want, atol=2e-6)


def test_ties_go_to_the_lower_token_id():
  logits = jnp.asarray([1.0, 2.0, 2.0, 2.0, 0.0])
  probs = process_logits(logits, SamplingParams(top_k=2))
  assert np.asarray(probs > 0).tolist() == [False, True, True, False, False]
  assert np.asarray(process_logits(logits, SamplingParams(temperature=0.0))).tolist() == [
    0.0, 1.0, 0.0, 0.0, 0.0]


def test_top_p_keeps_tokens_while_the_mass_before_them_is_below_top_p():
  """The token whose preceding mass equals ``top_p`` exactly is dropped: ``< top_p``, not ``<=``."""
  probs = process_logits(jnp.zeros(4, jnp.float32), SamplingParams(top_p=0.5))
  assert np.asarray(probs).tolist() == [0.5, 0.5, 0.0, 0.0]
  probs = process_logits(jnp.zeros(4, jnp.float32), SamplingParams(top_p=jnp.float32(0.75)))
  np.testing.assert_allclose(np.asarray(probs), [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
  probs = process_logits(jnp.asarray([0.0, -jnp.inf, 0.0, -jnp.inf]),
                         SamplingParams(top_p=jnp.float32(0.5), top_k=jnp.int32(0)))
  assert np.asarray(probs).tolist() == [1.0, 0.0, 0.0, 0.0]  # masked ids, exact halves


def test_none_skips_the_threshold_search_at_trace_time_and_nothing_sorts():
  logits = jnp.asarray(np.random.default_rng(1).normal(size=64), jnp.float32)
  text = str(jax.make_jaxpr(lambda x: process_logits(x, SamplingParams(0.7)))(logits))
  assert "while[" not in text and "scan[" not in text and re.search(r"(?<!\w)sort\[", text) is None
  for params in (SamplingParams(0.7, top_k=5), SamplingParams(0.7, top_p=0.9)):
    text = str(jax.make_jaxpr(lambda x, params=params: process_logits(x, params))(logits))
    assert "while[" in text or "scan[" in text  # the bisection
    assert re.search(r"(?<!\w)sort\[", text) is None


def test_stable_for_large_logits_and_bfloat16_accumulates_in_float32():
  logits = jnp.asarray([1e4, 1e4 - 1.0, -1e4], jnp.float32)
  probs = np.asarray(process_logits(logits))
  np.testing.assert_allclose(probs, _softmax(np.asarray([1e4, 1e4 - 1, -1e4])), rtol=1e-6)
  vocab = 50_000
  bf = jnp.zeros(vocab, jnp.bfloat16)
  probs = process_logits(bf)
  assert probs.dtype == jnp.float32
  assert abs(float(jnp.sum(probs)) - 1) < 1e-5  # a bfloat16 sum of 50k entries would be far off


def test_bad_parameters_raise_when_concrete():
  logits = jnp.zeros(4)
  with pytest.raises(ValueError, match=r"`params.temperature` must be >= 0, got -1.0"):
    process_logits(logits, SamplingParams(temperature=-1.0))
  with pytest.raises(ValueError, match=r"`params.top_k` must be >= 0 \(0 disables\), got -2"):
    process_logits(logits, SamplingParams(top_k=-2))
  with pytest.raises(ValueError, match=r"`params.top_p` must be in \(0, 1\], got 1.5"):
    process_logits(logits, SamplingParams(top_p=1.5))
  with pytest.raises(ValueError, match=r"`params.top_p` must be in \(0, 1\], got 0.0"):
    process_logits(logits, SamplingParams(top_p=0.0))
  with pytest.raises(TypeError, match=r"`params.top_k` must be an integer"):
    process_logits(logits, SamplingParams(top_k=2.5))
  with pytest.raises(ValueError, match=r"`params.temperature` must be a scalar per sequence"):
    process_logits(logits, SamplingParams(temperature=jnp.ones(3)))
  with pytest.raises(TypeError, match=r"`params` must be a SamplingParams, got tuple"):
    process_logits(logits, (1.0, 0, 1.0))


@pytest.mark.parametrize(
  "params",
  [SamplingParams(-1.0, jnp.int32(0), jnp.float32(1.0)),
   SamplingParams(1.0, jnp.int32(-3), jnp.float32(1.0)),
   SamplingParams(1.0, jnp.int32(0), jnp.float32(0.0)),
   SamplingParams(1.0, jnp.int32(0), jnp.float32(2.0)),
   SamplingParams(jnp.float32(np.nan), jnp.int32(0), jnp.float32(1.0))],
)
def test_bad_parameters_under_jit_are_flagged_and_in_range(params):
  target, draft_logits = jnp.zeros((3, 6)), jnp.zeros((2, 6))
  result = verify_logits(target, draft_logits, jnp.asarray([1, 2]), jnp.full(3, 0.5), params)
  assert int(result.error) & ErrorCode.BAD_PARAMS
  assert not bool(result.valid)
  n = int(result.num_tokens)
  assert np.all((np.asarray(result.tokens[:n]) >= 0) & (np.asarray(result.tokens[:n]) < 6))


def test_mismatched_vocabularies_fail_at_trace_time():
  with pytest.raises(ValueError, match=r"same vocabulary size, got V = 6 and V = 5"):
    verify_logits(jnp.zeros((3, 6)), jnp.zeros((2, 5)), jnp.asarray([1, 2]), jnp.full(3, 0.5))


def test_mixed_parameters_in_one_batch_do_not_recompile():
  traces = []

  @jax.jit
  def step(key, target, drafts_logits, draft, params):
    traces.append(1)
    keys = jax.random.split(key, target.shape[0])
    return jax.vmap(keyed(verify_logits))(keys, target, drafts_logits, draft, params)

  rng = np.random.default_rng(2)
  batch, gamma, vocab = 6, 3, 20
  target = jnp.asarray(rng.normal(size=(batch, gamma + 1, vocab)), jnp.float32)
  dl = jnp.asarray(rng.normal(size=(batch, gamma, vocab)), jnp.float32)
  draft = jnp.asarray(rng.integers(0, vocab, (batch, gamma)), jnp.int32)
  for seed in range(3):
    r = np.random.default_rng(seed)
    params = SamplingParams(
      jnp.asarray(r.choice([0.0, 0.5, 1.0], batch), jnp.float32),
      jnp.asarray(r.integers(0, 5, batch), jnp.int32),
      jnp.asarray(r.choice([0.5, 0.9, 1.0], batch), jnp.float32))
    step(jax.random.key(seed), target, dl, draft, params)
  assert len(traces) == 1


# --- exactness against the processed target -------------------------------------------------------

PARAM_SETS = {
  "t0.7": SamplingParams(0.7, jnp.int32(0), jnp.float32(1.0)),
  "t1.3_k4": SamplingParams(1.3, jnp.int32(4), jnp.float32(1.0)),
  "t0.9_p0.8": SamplingParams(0.9, jnp.int32(0), jnp.float32(0.8)),
  "t1_k5_p0.9": SamplingParams(1.0, jnp.int32(5), jnp.float32(0.9)),
}
TRIALS = 150_000
ALPHA_EACH = 0.01 / (len(PARAM_SETS) * 3)  # family-wise 1%, Bonferroni over cases x positions


NEGATIVE_TRIALS = 20_000  # the biased law is rejected at p < 1e-300 already at 30,000


def _trials(trial, n, target, draft_logits):
  """``trial(key, target, draft_logits)`` on ``n`` keys under one jit. The logits are arguments,
  not closed-over constants: XLA would constant-fold their processing broadcast over the whole
  batch (seconds of compile time for a few microseconds of work)."""
  keys = jax.random.split(jax.random.key(11), n)
  return jax.jit(jax.vmap(trial, in_axes=(0, None, None)))(keys, target, draft_logits)


def _drafted(params, key, draft_logits):
  """Draft tokens sampled with sample_draft, so q is what they were drawn from."""
  keys = jax.random.split(key, draft_logits.shape[0])
  return jax.vmap(sample_draft, in_axes=(0, 0, None))(keys, draft_logits, params)


@pytest.mark.parametrize("name", sorted(PARAM_SETS))
def test_verify_logits_is_exact_for_the_processed_target(name):
  params = PARAM_SETS[name]
  rng = np.random.default_rng(4)
  gamma, vocab = 2, 8
  target = jnp.asarray(rng.normal(size=(gamma + 1, vocab)) * 1.5, jnp.float32)
  draft_logits = jnp.asarray(np.asarray(target[:gamma]) + rng.normal(size=(gamma, vocab)),
                             jnp.float32)
  p = np.asarray(process_logits(target, params), np.float64)

  def trial(key, target, draft_logits):
    k_draft, k_verify = jax.random.split(key)
    sampled = _drafted(params, k_draft, draft_logits)
    return verify_logits(target, draft_logits, sampled.token, params=params, key=k_verify)

  result = _trials(trial, TRIALS, target, draft_logits)
  tokens, counts = np.asarray(result.tokens), np.asarray(result.num_tokens)
  assert np.all(np.asarray(result.valid))
  for j in range(gamma + 1):
    assert_same_distribution(tokens[counts > j, j], p[j] / p[j].sum(), ALPHA_EACH,
                             f"{name} position {j}")


def test_negative_control_q_from_other_parameters_fails():
  """Drafts sampled at temperature 1.5 but verified as if sampled at 0.7: biased."""
  rng = np.random.default_rng(4)
  gamma, vocab = 2, 8
  target = jnp.asarray(rng.normal(size=(gamma + 1, vocab)) * 1.5, jnp.float32)
  draft_logits = jnp.asarray(np.asarray(target[:gamma]) + rng.normal(size=(gamma, vocab)),
                             jnp.float32)
  used = SamplingParams(0.7)
  p = np.asarray(process_logits(target, used), np.float64)

  def trial(key, target, draft_logits):
    k_draft, k_verify = jax.random.split(key)
    sampled = _drafted(SamplingParams(1.5), k_draft, draft_logits)
    return verify_logits(target, draft_logits, sampled.token, params=used, key=k_verify)

  result = _trials(trial, NEGATIVE_TRIALS, target, draft_logits)
  with pytest.raises(AssertionError, match="chi-square"):
    assert_same_distribution(np.asarray(result.tokens)[:, 0], p[0] / p[0].sum(), ALPHA_EACH,
                             "temperature mismatch")


# --- greedy ----------------------------------------------------------------------------------


def _bigram_tables(seed, vocab=12):
  rng = np.random.default_rng(seed)
  target = rng.normal(size=(vocab, vocab)).astype(np.float32)
  target[:, 5] = target[:, 2]  # ties: argmax must take the lower id
  draft = (target + rng.normal(size=(vocab, vocab)) * 0.8).astype(np.float32)
  return jnp.asarray(target), jnp.asarray(draft)


def _greedy_plain(table, first, steps):
  out = [first]
  for _ in range(steps):
    out.append(int(jnp.argmax(table[out[-1]])))
  return out[1:]


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_decoding_equals_greedy_decoding(gamma):
  target_table, draft_table = _bigram_tables(gamma)
  greedy = SamplingParams(0.0)
  key = jax.random.key(0)
  for first in range(12):
    want = _greedy_plain(target_table, first, 30)
    out, last = [], first
    while len(out) < 30:
      proposal, ctx = [], last
      for _ in range(gamma):
        key, sub = jax.random.split(key)
        ctx = int(sample_draft(sub, draft_table[ctx], greedy).token)
        proposal.append(ctx)
      contexts = [last, *proposal]
      target_logits = target_table[jnp.asarray(contexts)]
      draft_logits = draft_table[jnp.asarray(contexts[:-1])]
      key, sub = jax.random.split(key)
      r = verify_logits(target_logits, draft_logits, jnp.asarray(proposal), params=greedy,
                        key=sub)
      new = np.asarray(r.tokens[: int(r.num_tokens)]).tolist()
      out.extend(new)
      last = new[-1]
    assert out[:30] == want, first


def test_greedy_and_sampled_sequences_share_one_batch():
  rng = np.random.default_rng(5)
  batch, gamma, vocab = 64, 3, 10
  target = jnp.asarray(rng.normal(size=(batch, gamma + 1, vocab)), jnp.float32)
  draft_logits = jnp.asarray(rng.normal(size=(batch, gamma, vocab)), jnp.float32)
  draft = jnp.asarray(rng.integers(0, vocab, (batch, gamma)), jnp.int32)
  temperature = jnp.asarray(np.where(np.arange(batch) % 2 == 0, 0.0, 0.8), jnp.float32)
  params = SamplingParams(temperature, jnp.zeros(batch, jnp.int32), jnp.ones(batch, jnp.float32))
  uniforms = jnp.asarray(rng.random((batch, gamma + 1)), jnp.float32)
  result = jax.jit(jax.vmap(verify_logits))(target, draft_logits, draft, uniforms, params)
  argmax = np.asarray(jnp.argmax(target, axis=-1))
  for b in range(0, batch, 2):  # greedy rows: accept while draft == argmax, then the argmax
    n_acc = 0
    while n_acc < gamma and int(draft[b, n_acc]) == argmax[b, n_acc]:
      n_acc += 1
    want = [*np.asarray(draft[b, :n_acc]).tolist(), int(argmax[b, n_acc])]
    assert np.asarray(result.tokens[b, : n_acc + 1]).tolist() == want
    assert int(result.num_tokens[b]) == n_acc + 1
  sampled_rows = np.asarray(result.tokens[1::2])
  assert np.all(np.asarray(result.valid))
  assert sampled_rows.shape[0] == batch // 2
