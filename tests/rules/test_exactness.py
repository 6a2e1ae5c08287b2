"""Exactness: the emitted tokens are distributed as the target's, position by position.

Two kinds of evidence, each with a negative control that must fail the same check:

* exact enumeration of the whole step on small cases (every draft sequence, its
  accept probabilities and residuals): for every position and every prefix the
  conditional law of the next emitted token equals the target row, to 1e-12;
* chi-square tests per position on >= 200,000 vmapped ``verify`` calls with fixed
  seeds. Family-wise significance ``ALPHA = 0.01`` with a Bonferroni correction
  over every (case, position) test in this module, so a correct implementation
  fails a freshly seeded run with probability at most 1%.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import accepts
from specdec_jax import reference
from specdec_jax import verify
from tests._helpers import P_EXAMPLE
from tests._helpers import Q_EXAMPLE
from tests._helpers import assert_same_distribution
from tests._helpers import conditional_errors
from tests._helpers import dirichlet_case
from tests._helpers import per_position
from tests._helpers import sample_rows

ALPHA = 0.01
NUM_TESTS = 40  # upper bound on the chi-square tests below (Bonferroni)
ALPHA_EACH = ALPHA / NUM_TESTS
TRIALS = 200_000




CASES = {
  "worked_example": (P_EXAMPLE, Q_EXAMPLE),
  "dirichlet_g4_v6": dirichlet_case(0, 4, 6),
  "zeros_g3_v5": dirichlet_case(1, 3, 5, zeros=True),
}


# ---------------------------------------------------------------------------------------------
# Exact enumeration.




def _wrong_rule_law(p, q):
  """Enumerated law of a plausible mistake: the replacement is drawn from p, not the residual."""
  gamma, vocab = q.shape
  law: dict[tuple[int, ...], float] = {}
  for draft in itertools.product(range(vocab), repeat=gamma):
    reach = math.prod(q[i, x] for i, x in enumerate(draft))
    for i, x in enumerate(draft):
      accept = min(1.0, reference.acceptance_probability(p[i, x], q[i, x]))
      for y in range(vocab):
        key = (*draft[:i], y)
        law[key] = law.get(key, 0.0) + reach * (1 - accept) * p[i, y]
      reach *= accept
    for y in range(vocab):
      law[(*draft, y)] = law.get((*draft, y), 0.0) + reach * p[gamma, y]
  return law


@pytest.mark.parametrize("name", sorted(CASES))
def test_enumeration_every_prefix_gets_the_target_row(name):
  p, q = CASES[name]
  law = reference.output_distribution(p, q)
  assert abs(sum(law.values()) - 1) < 1e-12
  assert conditional_errors(law, np.asarray(p)) < 1e-12


@pytest.mark.parametrize("name", sorted(CASES))
def test_enumeration_negative_control_wrong_rule_is_caught(name):
  p, q = CASES[name]
  assert conditional_errors(_wrong_rule_law(p, q), np.asarray(p)) > 1e-3


def test_enumeration_negative_control_wrong_q_is_caught():
  """Drafts drawn from one law but verified against another `q` are biased."""
  p, q = CASES["worked_example"]
  q_used = np.array([[1 / 3] * 3, [1 / 3] * 3])
  law = reference.output_distribution(p, q)  # the law of the rule with the true q ...
  assert conditional_errors(law, p) < 1e-12
  # ... and of the same drafts (from q) verified against q_used: enumerate by hand.
  gamma, vocab = q.shape
  wrong: dict[tuple[int, ...], float] = {}
  for draft in itertools.product(range(vocab), repeat=gamma):
    reach = math.prod(q[i, x] for i, x in enumerate(draft))
    for i, x in enumerate(draft):
      accept = min(1.0, p[i, x] / q_used[i, x])
      res = reference.residual(p[i], q_used[i])
      for y in range(vocab):
        wrong[(*draft[:i], y)] = wrong.get((*draft[:i], y), 0.0) + reach * (1 - accept) * res[y]
      reach *= accept
    for y in range(vocab):
      wrong[(*draft, y)] = wrong.get((*draft, y), 0.0) + reach * p[gamma, y]
  assert conditional_errors(wrong, p) > 1e-3


# ---------------------------------------------------------------------------------------------
# Chi-square on the jitted, vmapped implementation.


@functools.cache
def _simulate(name: str, seed: int = 0, q_override: bool = False):
  """Run TRIALS vmapped verifications; drafts are drawn from CASES[name]'s q."""
  p, q = (np.asarray(a, np.float64) for a in CASES[name])
  rng = np.random.default_rng(seed)
  drafts = sample_rows(rng, q, TRIALS).astype(np.int32)
  uniforms = rng.random((TRIALS, q.shape[0] + 1)).astype(np.float32)
  q_given = np.full_like(q, 1.0 / q.shape[1]) if q_override else q
  batch = jax.jit(jax.vmap(verify, in_axes=(None, None, 0, 0)))
  result = batch(jnp.asarray(p, jnp.float32), jnp.asarray(q_given, jnp.float32),
                 jnp.asarray(drafts), jnp.asarray(uniforms))
  return jax.device_get(result), drafts, uniforms




@pytest.mark.parametrize("name", sorted(CASES))
def test_chi_square_per_position(name):
  p = np.asarray(CASES[name][0])
  result, _, _ = _simulate(name)
  assert np.all(np.asarray(result.valid))
  per_position(np.asarray(result.tokens), np.asarray(result.num_tokens), p, ALPHA_EACH, name)


def test_chi_square_of_whole_outputs_against_enumeration():
  """The joint law of the emitted tuple matches the exactly enumerated law."""
  p, q = CASES["worked_example"]
  law = reference.output_distribution(p, q)
  keys = sorted(law)
  index = {k: i for i, k in enumerate(keys)}
  result, _, _ = _simulate("worked_example")
  tokens, counts = np.asarray(result.tokens), np.asarray(result.num_tokens)
  observed = [index[tuple(row[:n].tolist())] for row, n in zip(tokens, counts, strict=True)]
  assert_same_distribution(np.array(observed), np.array([law[k] for k in keys]), ALPHA_EACH,
                           "whole outputs")


def test_negative_control_wrong_q_fails_the_chi_square():
  p = np.asarray(CASES["dirichlet_g4_v6"][0])
  result, _, _ = _simulate("dirichlet_g4_v6", q_override=True)
  with pytest.raises(AssertionError, match="chi-square"):
    per_position(np.asarray(result.tokens), np.asarray(result.num_tokens), p, ALPHA_EACH,
                 "wrong q")


@pytest.mark.parametrize("mistake", ["replacement_from_p", "accept_min_q_over_p"])
def test_negative_control_wrong_rule_fails_the_chi_square(mistake):
  """A vectorised step with a plausible mistake, fed the very same drafts and uniforms."""
  p, q = (np.asarray(a, np.float64) for a in CASES["worked_example"])
  _, drafts, uniforms = _simulate("worked_example")
  rng = np.random.default_rng(3)
  gamma = q.shape[0]
  n = drafts.shape[0]
  tokens = np.full((n, gamma + 1), -1)
  alive = np.ones(n, bool)
  num = np.zeros(n, int)
  for i in range(gamma):
    x = drafts[:, i]
    if mistake == "accept_min_q_over_p":
      ok = uniforms[:, i] < q[i, x] / p[i, x]
    else:
      p_x, q_x = p[i, x].astype(np.float32), q[i, x].astype(np.float32)
      ok = np.asarray(accepts(uniforms[:, i], p_x, q_x))
    rejected_now = alive & ~ok
    replacement = sample_rows(rng, p[i : i + 1], n)[:, 0] if mistake == "replacement_from_p" else (
      sample_rows(rng, reference.residual(p[i], q[i])[None], n)[:, 0]
    )
    tokens[rejected_now, i] = replacement[rejected_now]
    num[rejected_now] = i + 1
    accepted_now = alive & ok
    tokens[accepted_now, i] = x[accepted_now]
    alive = accepted_now
  bonus = sample_rows(rng, p[gamma : gamma + 1], n)[:, 0]
  tokens[alive, gamma] = bonus[alive]
  num[alive] = gamma + 1
  with pytest.raises(AssertionError, match="chi-square"):
    per_position(tokens, num, p, ALPHA_EACH, mistake)


def test_acceptance_rate_and_tokens_per_step_with_repeated_rows():
  """With the same (p, q) row at every position: P(accept) = alpha, E[tokens] = (1-a^(g+1))/(1-a).

  Tolerance: 5 standard errors (two-sided false-failure rate 6e-7 per check).
  """
  gamma, vocab = 5, 7
  rng = np.random.default_rng(11)
  p_row = rng.dirichlet(np.ones(vocab))
  q_row = 0.6 * p_row + 0.4 * rng.dirichlet(np.ones(vocab))
  alpha = float(np.minimum(p_row, q_row).sum())
  p = np.tile(p_row, (gamma + 1, 1))
  q = np.tile(q_row, (gamma, 1))
  drafts = sample_rows(rng, q, TRIALS).astype(np.int32)
  uniforms = rng.random((TRIALS, gamma + 1)).astype(np.float32)
  result = jax.jit(jax.vmap(verify, in_axes=(None, None, 0, 0)))(
    jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), jnp.asarray(drafts),
    jnp.asarray(uniforms))
  accepted = np.asarray(result.num_accepted)
  first = (accepted > 0).mean()
  se = math.sqrt(alpha * (1 - alpha) / TRIALS)
  assert abs(first - alpha) < 5 * se, (first, alpha)
  tokens = np.asarray(result.num_tokens)
  expected = (1 - alpha ** (gamma + 1)) / (1 - alpha)
  assert abs(tokens.mean() - expected) < 5 * tokens.std() / math.sqrt(TRIALS), (
    tokens.mean(), expected)
  # Per position: P(accept at i | reached i) = alpha.
  for i in range(gamma):
    reached = accepted >= i
    rate = (accepted[reached] > i).mean()
    se_i = math.sqrt(alpha * (1 - alpha) / reached.sum())
    assert abs(rate - alpha) < 5 * se_i, (i, rate, alpha)
