"""Every known trap of the rule, under jit (flags, in-range ids) and on the host (errors):
``q[i, x] == 0``, an all-zero or rounding-noise residual, float32 cumulative sums at V = 128k,
and NaN, negative, unnormalised or out-of-range values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from specdec_jax import ErrorCode
from specdec_jax import UniformStream
from specdec_jax import describe_error
from specdec_jax import sample_index
from specdec_jax import speculative_step
from specdec_jax import verify

ONE_MINUS = float(np.nextafter(np.float32(1), np.float32(0)))  # largest float32 below 1


def _verify(p, q, draft, uniforms, dtype=jnp.float32):
  return verify(jnp.asarray(p, dtype), jnp.asarray(q, dtype), jnp.asarray(draft, jnp.int32),
                jnp.asarray(uniforms, dtype))


# --- q[i, x] == 0 -------------------------------------------------------------------------------


def test_zero_q_positive_p_is_always_accepted():
  p = [[0.5, 0.5], [0.5, 0.5]]
  q = [[1.0, 0.0]]
  result = _verify(p, q, [1], [ONE_MINUS, 0.0])
  assert int(result.num_accepted) == 1 and int(result.tokens[0]) == 1


def test_zero_q_zero_p_is_rejected_not_divided():
  p = [[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]]
  q = [[0.0, 0.0, 1.0]]
  for u in (0.0, 0.5):
    result = _verify(p, q, [1], [u, 0.3])
    assert int(result.num_accepted) == 0
    assert int(result.tokens[0]) == 0  # the only token the residual allows


def test_zero_p_is_rejected_even_when_u_is_exactly_zero():
  p = [[0.0, 1.0], [0.5, 0.5]]
  q = [[0.5, 0.5]]
  result = _verify(p, q, [0], [0.0, 0.0])
  assert int(result.num_accepted) == 0
  assert int(result.tokens[0]) == 1
  assert speculative_step(p, q, [0], UniformStream([0.0, 0.0])) == [1]


def test_u_zero_samples_the_first_positive_token_not_index_zero():
  p = [[0.0, 0.0, 0.25, 0.75]]
  result = _verify(p, np.zeros((0, 4)), np.zeros(0, np.int32), [0.0])
  assert int(result.tokens[0]) == 2


# --- residual all zero or rounding noise ---------------------------------------------------------


def test_all_zero_residual_falls_back_to_p():
  """q = p * (1 + 1e-6): the token is rejected with u just below 1 and max(p - q, 0) == 0."""
  p_row = np.array([0.0, 0.25, 0.25, 0.5], np.float32)
  q_row = p_row * np.float32(1 + 1e-6)
  assert np.all(np.maximum(p_row - q_row, 0) == 0)
  p = np.stack([p_row, p_row])
  result = _verify(p, q_row[None], [3], [ONE_MINUS, 0.0])
  assert int(result.num_accepted) == 0
  token = int(result.tokens[0])
  assert token == 1  # first positive entry of p for u = 0, never index 0 (p == 0 there)
  assert bool(result.valid)


FALLBACK_USES = [0.0, 0.1, 0.3, 0.49, 0.6, 0.9, ONE_MINUS]


@pytest.mark.parametrize("u", FALLBACK_USES)
def test_empty_residual_samples_p_at_every_uniform(u):
  """The fallback row is ``p[n]`` itself: the final uniform picks its token by p's inverse CDF
  (u = 0 alone cannot tell p[n] from "the first positive token")."""
  p_row = np.array([0.0, 0.25, 0.25, 0.5], np.float32)
  p = np.stack([p_row, [0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
  want = int(np.searchsorted(np.cumsum(p_row), u, side="right"))
  # Rounding noise: q = p * (1 + 1e-6) rejects token 3 for u just below 1, max(p - q, 0) == 0.
  q_noise = np.stack([p_row * np.float32(1 + 1e-6), p[1]])
  result = _verify(p, q_noise, [3, 0], [ONE_MINUS, u, 0.0])
  assert (int(result.num_accepted), int(result.tokens[0])) == (0, want)
  # Exactly empty: q == p and a draft token of probability 0 under both (rejected).
  q_equal = np.stack([p_row, p[1]])
  result = _verify(p, q_equal, [0, 0], [0.5, u, 0.0])
  assert (int(result.num_accepted), int(result.tokens[0])) == (0, want)
  assert bool(result.valid)
  assert speculative_step(p.astype(np.float64), q_equal.astype(np.float64), [0, 0],
                          UniformStream([0.5, u])) == [want]


def test_rounding_noise_residual_gives_a_token_the_target_prefers():
  p_row = np.array([0.0, 0.5, 0.5], np.float32)
  q_row = np.array([0.0, np.nextafter(np.float32(0.5), np.float32(0)), 0.5], np.float32)
  q_row[2] = np.float32(1) - q_row[1]
  p = np.stack([p_row, p_row])
  # Force a rejection of token 2 if p/q < 1 there; otherwise it is accepted.
  result = _verify(p, q_row[None], [2], [ONE_MINUS, 0.5])
  token = int(result.tokens[0])
  assert 0 <= token < 3 and p_row[token] > 0


# --- float32 cumulative sums at V = 128k ------------------------------------------------------


@pytest.mark.parametrize("tail_zeros", [0, 1000])
def test_float32_drift_at_128k_never_gives_out_of_range_or_zero_probability(tail_zeros):
  vocab = 128_256
  rng = np.random.default_rng(0)
  row = rng.random(vocab).astype(np.float32) ** 4
  if tail_zeros:
    row[-tail_zeros:] = 0
  row = (row / row.sum(dtype=np.float64)).astype(np.float32)
  drift = float(np.cumsum(row, dtype=np.float32)[-1]) - 1.0
  assert drift != 0.0  # the drift the trap is about really is here
  us = jnp.asarray(np.concatenate([
    np.float32(1) - np.arange(1, 2001, dtype=np.float32) * np.float32(2 ** -24),
    rng.random(2000).astype(np.float32)]))
  tokens = np.asarray(jax.jit(jax.vmap(sample_index, in_axes=(None, 0)))(jnp.asarray(row), us))
  assert tokens.min() >= 0 and tokens.max() < vocab
  assert np.all(row[tokens] > 0)
  result = _verify(np.stack([row]), np.zeros((0, vocab)), np.zeros(0, np.int32), [ONE_MINUS])
  token = int(result.tokens[0])
  assert 0 <= token < vocab and row[token] > 0


# --- NaN, negative, unnormalised, out-of-range values under jit ---------------------------------


GOOD_P = np.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
GOOD_Q = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])


@pytest.mark.parametrize(
  ("mutate", "draft", "uniforms", "flag"),
  [
    (lambda p, _q: p.__setitem__((0, 1), np.nan), [1, 2], [0.1, 0.1, 0.1], ErrorCode.NONFINITE),
    (lambda p, _q: p.__setitem__((0, 2), -0.1), [0, 2], [0.9, 0.1, 0.1], ErrorCode.NEGATIVE),
    (lambda _p, q: q.__setitem__((0, 2), np.inf), [0, 2], [0.9, 0.1, 0.1], ErrorCode.NONFINITE),
    (lambda p, _q: p.__setitem__(2, [0.5, 0.5, 0.5]), [1, 2], [0.1, 0.1, 0.1],
     ErrorCode.NOT_NORMALIZED),
    (lambda p, _q: p.__setitem__(2, [0.0, 0.0, 0.0]), [1, 2], [0.1, 0.1, 0.1],
     ErrorCode.NOT_NORMALIZED),
    # Read only as gathered values: position 0 is accepted, its rows are never read in full.
    (lambda p, _q: p.__setitem__((0, 1), 1.5), [1, 2], [0.1, 0.1, 0.1], ErrorCode.NOT_NORMALIZED),
    # The q row of a rejection is read in full (the residual) and must sum to 1.
    (lambda _p, q: q.__setitem__(0, [0.5, 0.3, 0.5]), [0, 2], [0.9, 0.1, 0.1],
     ErrorCode.NOT_NORMALIZED),
    (lambda _p, _q: None, [7, 2], [0.1, 0.1, 0.1], ErrorCode.DRAFT_OUT_OF_RANGE),
    (lambda _p, _q: None, [-1, 2], [0.1, 0.1, 0.1], ErrorCode.DRAFT_OUT_OF_RANGE),
    (lambda _p, _q: None, [1, 2], [0.1, 1.0, 0.1], ErrorCode.UNIFORM_OUT_OF_RANGE),
    (lambda _p, _q: None, [1, 2], [np.nan, 0.1, 0.1], ErrorCode.UNIFORM_OUT_OF_RANGE),
    (lambda _p, _q: None, [1, 2], [0.1, 0.1, -0.5], ErrorCode.UNIFORM_OUT_OF_RANGE),
  ],
)
def test_bad_values_under_jit_are_flagged_and_ids_stay_in_range(mutate, draft, uniforms, flag):
  p, q = GOOD_P.copy(), GOOD_Q.copy()
  mutate(p, q)
  result = jax.jit(verify)(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32),
                           jnp.asarray(draft, jnp.int32), jnp.asarray(uniforms, jnp.float32))
  n = int(result.num_tokens)
  assert not bool(result.valid)
  assert int(result.error) & flag, describe_error(int(result.error))
  emitted = np.asarray(result.tokens[:n])
  assert np.all((emitted >= 0) & (emitted < 3))
  assert np.all(np.asarray(result.tokens[n:]) == -1)


def test_out_of_range_draft_is_never_emitted():
  result = _verify(GOOD_P, GOOD_Q, [5, 2], [0.0, 0.1, 0.1])
  assert int(result.num_accepted) == 0
  assert 0 <= int(result.tokens[0]) < 3


def test_nan_row_does_not_become_a_plausible_silent_token():
  p = GOOD_P.copy()
  p[2] = np.nan
  result = _verify(p, GOOD_Q, [1, 2], [0.1, 0.1, 0.5])
  assert not bool(result.valid)
  assert describe_error(int(result.error)) == "NONFINITE"


@settings(max_examples=150, deadline=None)
@given(
  st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=20, max_size=20),
  st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=15, max_size=15),
  st.lists(st.integers(-3, 7), min_size=3, max_size=3),
  st.lists(st.floats(-0.5, 1.5, width=32) | st.just(float("nan")), min_size=4, max_size=4),
)
def test_any_values_give_in_range_ids_and_a_consistent_flag(p_flat, q_flat, draft, uniforms):
  p = np.asarray(p_flat, np.float32).reshape(4, 5)
  q = np.asarray(q_flat, np.float32).reshape(3, 5)
  result = _verify(p, q, draft, uniforms)
  n = int(result.num_tokens)
  assert 1 <= n <= 4
  assert np.all((np.asarray(result.tokens[:n]) >= 0) & (np.asarray(result.tokens[:n]) < 5))
  assert np.all(np.asarray(result.tokens[n:]) == -1)
  assert bool(result.valid) == (int(result.error) == 0)
  assert 1 <= int(result.num_uniforms) <= 4
