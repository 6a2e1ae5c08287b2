"""Block verification: agreement with the float64 oracle, exactness, negative controls, gains.

Exactness evidence mirrors ``test_exactness.py``: exact enumeration of every draft sequence
(every prefix's conditional law equals the target row to 1e-10) and chi-square tests per
position on 200,000 vmapped ``block_verify`` calls with a fixed seed, at family-wise
``ALPHA = 0.01`` with a Bonferroni correction over at most ``NUM_TESTS`` tests. Each
negative control (a plausible wrong rule) must fail the very same checks.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import ErrorCode
from specdec_jax import UniformStream
from specdec_jax import reference
from specdec_jax import theory
from specdec_jax import verify
from specdec_jax._rules.block import block_verify
from specdec_jax.decoding import VERIFIERS
from specdec_jax.decoding import generate
from specdec_jax.decoding import speculative_generate
from tests._helpers import KINDS
from tests._helpers import P_EXAMPLE
from tests._helpers import Q_EXAMPLE
from tests._helpers import U_EXAMPLE
from tests._helpers import assert_same_distribution
from tests._helpers import conditional_errors
from tests._helpers import dirichlet_case
from tests._helpers import keyed
from tests._helpers import per_position
from tests._helpers import random_case
from tests._helpers import sample_rows

ALPHA = 0.01
NUM_TESTS = 20  # upper bound on the chi-square tests of the correct rule below (Bonferroni)
ALPHA_EACH = ALPHA / NUM_TESTS
TRIALS = 200_000




CASES = {
  "worked_example": (P_EXAMPLE, Q_EXAMPLE),
  "dirichlet_g4_v5": dirichlet_case(0, 4, 5),
  "zeros_g3_v5": dirichlet_case(1, 3, 5, zeros=True),
}
ENUMERATION_CASES = {
  **CASES,
  "zeros_g2_v4": dirichlet_case(2, 2, 4, zeros=True),
  "equal_g3_v3": (lambda p: (p, p[:3].copy()))(dirichlet_case(3, 3, 3)[0]),
  "one_hot_g2_v3": (np.eye(3)[[0, 1, 2]], np.eye(3)[[0, 2]]),
}


# ---------------------------------------------------------------------------------------------
# Agreement with the float64 oracle, on the same uniforms.


def test_agrees_with_reference_on_random_float64_cases():
  """>= 500 random cases (all kinds, gamma 0..4, V 1 and 5): same tokens, same num_uniforms."""
  rng = np.random.default_rng(0)
  batched = jax.jit(jax.vmap(block_verify))
  checked = 0
  with jax.enable_x64(True):
    for gamma, vocab in itertools.product(range(5), (1, 5)):
      cases = [random_case(rng, gamma, vocab, KINDS[k % len(KINDS)]) for k in range(52)]
      p, q, d = (np.stack(x) for x in zip(*cases, strict=True))
      u = rng.random((len(cases), gamma + 1))
      out = jax.device_get(batched(jnp.asarray(p), jnp.asarray(q), jnp.asarray(d),
                                   jnp.asarray(u)))
      for b in range(len(cases)):
        want = reference.block_speculative_step(p[b], q[b], d[b], UniformStream(u[b]))
        got = out.tokens[b, : out.num_tokens[b]].tolist()
        assert got == want, (gamma, vocab, b, got, want)
        assert out.num_uniforms[b] == gamma + 1
        assert out.num_accepted[b] == out.num_tokens[b] - 1
        assert (out.tokens[b, out.num_tokens[b]:] == -1).all()
        assert out.valid[b], (gamma, vocab, b, out.error[b])
        checked += 1
  assert checked >= 500


def test_worked_example_and_uniform_order():
  p, q = (jnp.asarray(a, jnp.float32) for a in (P_EXAMPLE, Q_EXAMPLE))
  u = jnp.asarray(U_EXAMPLE, jnp.float32)
  r = block_verify(p, q, jnp.array([1, 2]), u)
  assert r.tokens.tolist() == [1, 2, 0] and int(r.num_uniforms) == 3 and bool(r.valid)
  # draft [0, 2]: b_1 = 0.4, b_2 = min(1, 0.4 * 0.8 / 0.6) = 0.533; eta_2 = 0.9 >= b_2 (h_2 = b_2,
  # h_1 <= b_1 = 0.4 < eta_1 = 0.7): tau = 0 and the residual max(p[0] - q[0], 0) with u = 0.1.
  r = block_verify(p, q, jnp.array([0, 2]), u)
  assert r.tokens.tolist() == [1, -1, -1] and int(r.num_uniforms) == 3
  r = block_verify(p, q, jnp.array([0, 2]), jnp.array([0.7, 0.5, 0.1], jnp.float32))
  assert r.tokens.tolist() == [0, 2, 0]  # eta_2 = 0.5 < b_2: token 0 is kept (token-wise: rejected)
  more = (([0, 2], U_EXAMPLE), ([0, 2], [0.7, 0.5, 0.1]), ([1, 1], [0.3, 0.2, 0.9]))
  for draft, uniforms in more:
    got = block_verify(p, q, jnp.array(draft), jnp.asarray(uniforms, jnp.float32))
    want = reference.block_speculative_step(P_EXAMPLE, Q_EXAMPLE, draft, UniformStream(uniforms))
    assert got.tokens[: int(got.num_tokens)].tolist() == want


# ---------------------------------------------------------------------------------------------
# Exact enumeration.




def _mistaken_law(p, q, mistake: str) -> dict[tuple[int, ...], float]:
  """Enumerated law of block verification with one plausible mistake."""
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  gamma, vocab = q.shape
  law: dict[tuple[int, ...], float] = {}
  for draft in itertools.product(range(vocab), repeat=gamma):
    weight = math.prod(q[i, x] for i, x in enumerate(draft))
    if weight == 0:
      continue
    b = reference._block_weights(p, q, draft)
    h, rows = [1.0], []
    for i in range(gamma):
      if mistake == "token_residual":  # the token-wise residual max(p - q, 0)
        res = np.maximum(p[i] - q[i], 0)
      else:
        res = np.maximum(b[i] * p[i] - q[i], 0)
      rows.append(res / res.sum() if res.sum() > 0 else p[i])
      z = np.maximum(b[i] * p[i] - q[i], 0).sum()
      if i:
        den = z + b[i] if mistake == "h_plus_b" else z + 1 - b[i]
        h.append(z / den if den > 0 else 1.0)
    h.append(b[gamma])
    rows.append(p[gamma])
    later = 1.0
    for i in range(gamma, -1, -1):
      mass = weight * later * h[i]
      later *= 1 - h[i]
      for y in range(vocab):
        law[(*draft[:i], y)] = law.get((*draft[:i], y), 0.0) + mass * rows[i][y]
  return law


MISTAKES = ("h_plus_b", "token_residual")


@pytest.mark.parametrize("name", sorted(ENUMERATION_CASES))
def test_enumeration_every_prefix_gets_the_target_row(name):
  p, q = ENUMERATION_CASES[name]
  law = reference.block_output_distribution(p, q)
  assert abs(sum(law.values()) - 1) < 1e-10
  assert conditional_errors(law, np.asarray(p, np.float64)) < 1e-10


@pytest.mark.parametrize("mistake", MISTAKES)
def test_enumeration_negative_controls_are_caught(mistake):
  p, q = CASES["dirichlet_g4_v5"]
  assert conditional_errors(_mistaken_law(p, q, "none"), p) < 1e-10  # the helper is right
  assert conditional_errors(_mistaken_law(p, q, mistake), p) > 1e-3


# ---------------------------------------------------------------------------------------------
# Chi-square on the jitted, vmapped implementation.


@functools.cache
def _simulate(name: str, seed: int = 0):
  p, q = (np.asarray(a, np.float64) for a in CASES[name])
  rng = np.random.default_rng(seed)
  drafts = sample_rows(rng, q, TRIALS).astype(np.int32)
  uniforms = rng.random((TRIALS, q.shape[0] + 1)).astype(np.float32)
  batch = jax.jit(jax.vmap(block_verify, in_axes=(None, None, 0, 0)))
  result = batch(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32),
                 jnp.asarray(drafts), jnp.asarray(uniforms))
  return jax.device_get(result)




@pytest.mark.parametrize("name", sorted(CASES))
def test_chi_square_per_position(name):
  p = np.asarray(CASES[name][0])
  result = _simulate(name)
  assert np.all(result.valid)
  assert per_position(result.tokens, result.num_tokens, p, ALPHA_EACH, name) >= 2


def test_chi_square_whole_outputs_against_enumeration():
  p, q = CASES["worked_example"]
  law = reference.block_output_distribution(p, q)
  keys = sorted(law)
  index = {k: i for i, k in enumerate(keys)}
  result = _simulate("worked_example")
  observed = [index[tuple(row[:n].tolist())]
              for row, n in zip(result.tokens, result.num_tokens, strict=True)]
  assert_same_distribution(np.array(observed), np.array([law[k] for k in keys]), ALPHA_EACH,
                           "whole outputs")


def _sample_law(law, n: int, seed: int):
  """``n`` outputs drawn from an enumerated law, padded to arrays like VerifyResult's."""
  keys = sorted(law)
  probs = np.array([law[k] for k in keys])
  picks = np.random.default_rng(seed).choice(len(keys), size=n, p=probs / probs.sum())
  width = max(len(k) for k in keys)
  tokens = np.full((len(keys), width), -1)
  for i, k in enumerate(keys):
    tokens[i, : len(k)] = k
  return tokens[picks], np.array([len(k) for k in keys])[picks]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_negative_controls_fail_the_chi_square(mistake):
  """TRIALS outputs of each mistaken rule fail the same per-position chi-square."""
  p, q = CASES["zeros_g3_v5"]
  tokens, num = _sample_law(_mistaken_law(p, q, mistake), TRIALS, seed=5)
  with pytest.raises(AssertionError, match="chi-square"):
    per_position(tokens, num, np.asarray(p), ALPHA_EACH, mistake)


# ---------------------------------------------------------------------------------------------
# Block emits at least as many tokens as token-wise verification.


def test_block_expected_tokens_at_least_token_wise():
  rng = np.random.default_rng(7)
  gains = []
  for k in range(100):
    gamma, vocab = 1 + k % 3, 2 + k % 3
    p, q, _ = random_case(rng, gamma, vocab, ("overlap", "peaked", "disjoint", "flat")[k % 4])
    block = theory.block_expected_tokens(p, q)
    token = theory.token_expected_tokens(p, q)
    assert 1 - 1e-9 <= block <= gamma + 1 + 1e-9
    assert block >= token - 1e-5, (k, block, token)
    gains.append(block - token)
  assert sum(g > 1e-3 for g in gains) >= 10


def test_measured_tokens_per_step_match_theory():
  p, q = CASES["dirichlet_g4_v5"]
  result = _simulate("dirichlet_g4_v5")
  mean, std = result.num_tokens.mean(), result.num_tokens.std()
  assert abs(mean - theory.block_expected_tokens(p, q)) < 5 * std / math.sqrt(TRIALS)
  token = jax.vmap(verify, in_axes=(None, None, 0, 0))(
    jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32),
    jnp.asarray(sample_rows(np.random.default_rng(0), q, TRIALS), jnp.int32),
    jnp.asarray(np.random.default_rng(1).random((TRIALS, 5)), jnp.float32))
  assert mean > float(np.asarray(token.num_tokens).mean())


# ---------------------------------------------------------------------------------------------
# Ragged num_draft, transforms, keys.


def test_num_draft_equals_unpadded_call():
  rng = np.random.default_rng(3)
  gamma, vocab = 4, 6
  for k in range(8):
    p, q, d = (np.asarray(a) for a in random_case(rng, gamma, vocab, KINDS[k % 4]))
    u = rng.random(gamma + 1).astype(np.float32)
    p32, q32 = p.astype(np.float32), q.astype(np.float32)
    for n in range(gamma + 1):
      padded = block_verify(p32, q32, d, u, num_draft=jnp.int32(n))
      short = block_verify(p32[: n + 1], q32[:n], d[:n], u[: n + 1])
      assert padded.tokens[: n + 1].tolist() == short.tokens.tolist()
      assert (padded.tokens[n + 1:] == -1).all()
      assert int(padded.num_uniforms) == int(short.num_uniforms) == n + 1
  batched = jax.vmap(block_verify)(
    jnp.tile(p32, (gamma + 1, 1, 1)), jnp.tile(q32, (gamma + 1, 1, 1)), jnp.tile(d, (gamma + 1, 1)),
    jnp.tile(u, (gamma + 1, 1)), num_draft=jnp.arange(gamma + 1))
  for n in range(gamma + 1):
    assert batched.tokens[n].tolist() == block_verify(p32, q32, d, u, num_draft=n).tokens.tolist()


def test_padded_rows_after_num_draft_are_never_read():
  """The bonus row is p[num_draft]; rows after it may hold anything (here NaN and -1), also
  for a vocabulary of several blocks."""
  rng = np.random.default_rng(8)
  gamma, vocab = 3, 600
  p, q, d = random_case(rng, gamma, vocab, "equal")  # q = p: every proposal is kept
  u = rng.random(gamma + 1).astype(np.float32)
  for n in range(gamma):
    p_pad, q_pad, d_pad = p.copy(), q.copy(), d.copy()
    p_pad[n + 1 :], q_pad[n:], d_pad[n:] = np.nan, -1.0, 12345
    padded = block_verify(p_pad.astype(np.float32), q_pad.astype(np.float32), d_pad, u,
                          num_draft=jnp.int32(n))
    short = block_verify(p[: n + 1].astype(np.float32), q[:n].astype(np.float32), d[:n],
                         u[: n + 1])
    assert bool(padded.valid) and bool(short.valid), n
    assert padded.tokens[: n + 1].tolist() == short.tokens.tolist()
    assert int(padded.num_accepted) == n


@pytest.mark.parametrize("u", [0.0, 0.3, 0.6, 0.9])
def test_empty_residual_falls_back_to_p(u):
  """b_1 = 0 (p = q = 0 at the draft token) stops at tau = 0, where max(p - q, 0) = 0 (q = p):
  the final token comes from p[0] itself, at every uniform."""
  p_row = [0.0, 0.25, 0.25, 0.5]
  p = np.array([p_row, [0.5, 0.5, 0.0, 0.0]], np.float32)
  q = np.array([p_row], np.float32)
  r = block_verify(p, q, np.array([0], np.int32), np.array([0.5, u], np.float32))
  want = reference.block_speculative_step(p.astype(np.float64), q.astype(np.float64), [0],
                                          UniformStream([0.5, u]))
  assert want == [int(np.searchsorted(np.cumsum(p_row), u, side="right"))]
  assert r.tokens.tolist()[: int(r.num_tokens)] == want
  assert bool(r.valid)


def test_jit_vmap_and_nested_vmap_agree_with_single_calls():
  rng = np.random.default_rng(4)
  cases = [random_case(rng, 3, 7, "overlap") for _ in range(12)]
  p, q, d = (jnp.asarray(np.stack(x), jnp.float32 if i < 2 else jnp.int32)
             for i, x in enumerate(zip(*cases, strict=True)))
  u = jnp.asarray(rng.random((12, 4)), jnp.float32)
  flat = jax.jit(jax.vmap(block_verify))(p, q, d, u)
  nested = jax.vmap(jax.vmap(block_verify))(*(x.reshape(3, 4, *x.shape[1:]) for x in (p, q, d, u)))
  singles = [block_verify(p[b], q[b], d[b], u[b]) for b in range(12)]
  for field in flat._fields[:6]:  # the logprobs fields are None here
    want = np.stack([np.asarray(getattr(s, field)) for s in singles])
    np.testing.assert_array_equal(np.asarray(getattr(flat, field)), want)
    np.testing.assert_array_equal(np.asarray(getattr(nested, field)).reshape(want.shape), want)


def test_with_key_uses_the_uniforms_of_the_key():
  p, q = (jnp.asarray(a, jnp.float32) for a in (P_EXAMPLE, Q_EXAMPLE))
  key = jax.random.key(3)
  r = block_verify(p, q, jnp.array([0, 2]), key=key)
  u = jax.random.uniform(key, (3,), jnp.float32)
  assert r.tokens.tolist() == block_verify(p, q, jnp.array([0, 2]), u).tokens.tolist()
  keys = jax.random.split(key, 8)
  batch = jax.vmap(keyed(block_verify), in_axes=(0, None, None, None))(
    keys, p, q, jnp.array([1, 2]))
  assert bool(batch.valid.all()) and ((batch.tokens[:, 0] >= 0) & (batch.tokens[:, 0] < 3)).all()


def test_bad_values_are_flagged_under_jit():
  p, q = (np.asarray(a, np.float32) for a in (P_EXAMPLE, Q_EXAMPLE))
  d = np.array([1, 2], np.int32)
  u = np.array([0.7, 0.9, 0.1], np.float32)
  f = jax.jit(block_verify)

  def run(p=p, q=q, d=d, u=u, **kw):
    r = f(jnp.asarray(p), jnp.asarray(q), jnp.asarray(d), jnp.asarray(u), **kw)
    tokens = np.asarray(r.tokens)[: int(r.num_tokens)]
    assert ((tokens >= 0) & (tokens < 3)).all()
    return int(r.error)

  assert run() == 0
  nan_p = p.copy()
  nan_p[2, 0] = np.nan
  assert run(p=nan_p) & ErrorCode.NONFINITE  # the bonus row is read
  neg_p = p.copy()
  neg_p[2, 0] = -0.1
  assert run(p=neg_p) & ErrorCode.NEGATIVE
  assert run(p=p * 1.5) & ErrorCode.NOT_NORMALIZED
  assert run(d=np.array([1, 7], np.int32)) & ErrorCode.DRAFT_OUT_OF_RANGE
  assert run(u=np.array([0.7, 1.5, 0.1], np.float32)) & ErrorCode.UNIFORM_OUT_OF_RANGE
  assert run(num_draft=jnp.int32(5)) & ErrorCode.BAD_NUM_DRAFT
  # A residual row that is read (tau < gamma) is checked too.
  bad_q = q.copy()
  bad_q[0] = [0.5, 0.3, 0.5]
  assert run(d=np.array([0, 2], np.int32), q=bad_q) & ErrorCode.NOT_NORMALIZED
  # A draft token the target rules out is never kept, even for a uniform of exactly 0.
  r = f(jnp.asarray(p), jnp.asarray(q), jnp.array([1, 2]), jnp.zeros(3, jnp.float32))
  assert int(r.num_accepted) == 2
  zero_p = p.copy()
  zero_p[1] = [0.5, 0.5, 0.0]
  r = f(jnp.asarray(zero_p), jnp.asarray(q), jnp.array([1, 2]), jnp.zeros(3, jnp.float32))
  assert int(r.num_accepted) <= 1 and int(r.tokens[1]) != 2


def test_shape_errors_at_trace_time():
  p, q = (jnp.asarray(a, jnp.float32) for a in (P_EXAMPLE, Q_EXAMPLE))
  with pytest.raises(ValueError, match="block_verify"):
    block_verify(p, q, jnp.array([1, 2, 0]), jnp.zeros(3))
  with pytest.raises(ValueError, match="uniforms"):
    block_verify(p, q, jnp.array([1, 2]), jnp.zeros(2))


# ---------------------------------------------------------------------------------------------
# The decoding loop.


def test_speculative_generate_block_greedy_equals_plain_greedy():
  from specdec_jax import SamplingParams
  from specdec_jax.models import Model
  from specdec_jax.models.toy import make_toy_model

  assert VERIFIERS["block"] is block_verify
  vocab = 16
  target = make_toy_model(jax.random.key(0), vocab, name="target")
  near = Model({"table": target.params["table"] + 1.5 * jax.random.normal(
    jax.random.key(2), target.params["table"].shape)}, target.apply, target.init_cache, vocab,
    "near")
  prompts = np.array([[3, 7, 3, 7], [5, 9, 9, 9], [1, 2, 3, 1]], np.int32)
  lengths = np.array([4, 1, 3], np.int32)
  greedy = SamplingParams(temperature=0.0)
  plain = generate(target, prompts, lengths, jax.random.key(0), max_new_tokens=10, params=greedy)
  out = speculative_generate(target, near, prompts, lengths, jax.random.key(0), gamma=3,
                             max_new_tokens=10, params=greedy, verifier="block")
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.error, 0)
  assert int(out.stats.accepted.sum()) > 0
