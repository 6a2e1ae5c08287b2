"""The theory toolkit against the paper's numbers and against simulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import verify
from specdec_jax.theory import acceptance_rate
from specdec_jax.theory import expected_tokens
from specdec_jax.theory import expected_tokens_per_position
from specdec_jax.theory import improvement_factor
from specdec_jax.theory import improvement_factor_per_position
from specdec_jax.theory import optimal_gamma
from tests._helpers import sample_rows


def test_leviathan_table_1_example():
  """alpha = 0.8, c = 0, gamma = 5: 3.69x (Leviathan et al. 2023)."""
  assert float(improvement_factor(0.8, 5, 0.0)) == pytest.approx(3.6893, abs=1e-3)
  assert float(expected_tokens(0.8, 5)) == pytest.approx((1 - 0.8 ** 6) / 0.2, rel=1e-6)


def test_limits_and_consistency():
  assert float(expected_tokens(1.0, 4)) == 5.0
  assert float(expected_tokens(0.0, 4)) == 1.0
  np.testing.assert_allclose(float(expected_tokens_per_position(jnp.full(6, 0.7))),
                             float(expected_tokens(0.7, 6)), rtol=1e-6)
  assert float(improvement_factor_per_position(jnp.full(4, 0.7), 0.1)) == pytest.approx(
    float(improvement_factor(0.7, 4, 0.1)), rel=1e-6)


def test_optimal_gamma_maximises_the_factor():
  for alpha, c in [(0.6, 0.05), (0.8, 0.05), (0.9, 0.1), (0.7, 0.2)]:
    best = optimal_gamma(alpha, c)
    value = float(improvement_factor(alpha, best, c))
    for gamma in range(1, 40):
      assert float(improvement_factor(alpha, gamma, c)) <= value + 1e-6
  assert optimal_gamma(0.8, 0.0, max_gamma=20) == 20  # free drafts: propose as many as allowed


def test_acceptance_rate_and_tokens_per_step_match_simulation():
  """Per-position alphas from rows; the mean tokens of 200k vmapped steps is within 5 SE."""
  rng = np.random.default_rng(0)
  gamma, vocab, trials = 4, 6, 200_000
  p = rng.dirichlet(np.ones(vocab), size=gamma + 1)
  q = 0.5 * p[:gamma] + 0.5 * rng.dirichlet(np.ones(vocab), size=gamma)
  alphas = acceptance_rate(p[:gamma], q)
  assert alphas.shape == (gamma,)
  drafts = sample_rows(rng, q, trials).astype(np.int32)
  uniforms = rng.random((trials, gamma + 1)).astype(np.float32)
  result = jax.jit(jax.vmap(verify, in_axes=(None, None, 0, 0)))(
    jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), drafts, uniforms)
  tokens = np.asarray(result.num_tokens)
  expected = float(expected_tokens_per_position(alphas))
  assert abs(tokens.mean() - expected) < 5 * tokens.std() / np.sqrt(trials)
