"""The theory of speculative decoding as functions: acceptance, tokens per step, speed-up.

All formulas are from Leviathan, Kalman, Matias, "Fast Inference from Transformers
via Speculative Decoding" (ICML 2023, arXiv:2211.17192): the acceptance rate
``alpha = sum_x min(p(x), q(x))`` (Definition 3.1, Corollary 3.6), the expected
number of tokens per step ``(1 - alpha^(gamma+1)) / (1 - alpha)`` under the i.i.d.
assumption (Equation 1), the expected wall-time improvement factor
``(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1))`` with ``c`` the cost of a draft
call relative to a target call (Theorem 3.8), and the optimal ``gamma`` (Section 3.5).
With acceptance that differs by position, ``alpha_i`` being the probability
that position ``i`` is accepted given that every earlier one was, the expected number
of tokens is ``1 + sum_i prod_{j <= i} alpha_j``. The decoding loop's statistics
(:class:`specdec_jax.decoding.DecodeStats`) give the measured ``alpha_i`` to feed these.

Every function is pure ``jax.numpy`` and accepts arrays (batched by broadcasting).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def acceptance_rate(p, q) -> jax.Array:
  """Probability that a token drawn from ``q`` is accepted against ``p``: ``sum min(p, q)``.

  Args:
    p: ``(..., V)`` target distributions.
    q: ``(..., V)`` draft distributions (broadcastable with ``p``).

  Returns:
    ``(...)`` acceptance rate ``alpha`` per row (per position for ``(gamma, V)`` inputs).

  Example:
    >>> round(float(acceptance_rate(jnp.array([0.2, 0.5, 0.3]), jnp.array([0.5, 0.3, 0.2]))), 6)
    0.7

  Reference:
    Leviathan et al. 2023, Definition 3.1 and Corollary 3.6.
  """
  return jnp.sum(jnp.minimum(jnp.asarray(p), jnp.asarray(q)), axis=-1)


def expected_tokens(alpha, gamma) -> jax.Array:
  """Expected tokens per step for i.i.d. acceptance: ``(1 - alpha^(gamma+1)) / (1 - alpha)``.

  Args:
    alpha: acceptance rate(s) in ``[0, 1]``.
    gamma: number of proposals per step (broadcastable).

  Returns:
    Expected number of tokens emitted per verification step (``gamma + 1`` at ``alpha = 1``).

  Example:
    >>> round(float(expected_tokens(0.8, 5)), 2)
    3.69

  Reference:
    Leviathan et al. 2023, Equation 1.
  """
  alpha = jnp.asarray(alpha, jnp.float32)
  gamma = jnp.asarray(gamma, jnp.float32)
  safe = jnp.where(alpha < 1, alpha, 0.5)
  return jnp.where(alpha < 1, (1 - safe ** (gamma + 1)) / (1 - safe), gamma + 1)


def expected_tokens_per_position(alphas) -> jax.Array:
  """Expected tokens per step when position ``i`` is accepted with probability ``alphas[i]``.

  ``alphas[i]`` is the probability of accepting position ``i`` given that positions
  ``0 .. i-1`` were accepted; the step emits ``1 + sum_i prod_{j <= i} alphas[j]``
  tokens on average. Equals :func:`expected_tokens` when all ``alphas`` are equal.

  Args:
    alphas: ``(..., gamma)`` conditional acceptance rates.

  Returns:
    ``(...)`` expected tokens per step.

  Example:
    >>> round(float(expected_tokens_per_position(jnp.array([0.8] * 5))), 2)
    3.69
  """
  alphas = jnp.asarray(alphas, jnp.float32)
  return 1 + jnp.sum(jnp.cumprod(alphas, axis=-1), axis=-1)


def improvement_factor(alpha, gamma, cost_ratio) -> jax.Array:
  """Expected wall-time speed-up over plain decoding: ``tokens per step / (gamma c + 1)``.

  Args:
    alpha: acceptance rate (a scalar or array), or, with a trailing ``gamma`` axis,
      use :func:`improvement_factor_per_position` instead.
    gamma: proposals per step.
    cost_ratio: ``c``, the time of one draft call over one target call.

  Returns:
    The expected improvement factor (Theorem 3.8).

  Example:
    >>> round(float(improvement_factor(0.8, 5, 0.0)), 2)
    3.69

  Reference:
    Leviathan et al. 2023, Theorem 3.8.
  """
  gamma_f = jnp.asarray(gamma, jnp.float32)
  return expected_tokens(alpha, gamma) / (gamma_f * jnp.asarray(cost_ratio, jnp.float32) + 1)


def improvement_factor_per_position(alphas, cost_ratio, verify_cost: float = 1.0) -> jax.Array:
  """Theorem 3.8 with per-position acceptance and a measured cost of the verification call.

  ``speed-up = (1 + sum_i prod_{j<=i} alpha_j) / (gamma c + v)`` where ``c`` is a draft
  call and ``v`` the target's ``gamma + 1``-token verification call, both in units of
  one plain decoding step of the target (``v = 1`` in the paper's idealisation; on a
  CPU scoring ``gamma + 1`` tokens costs more than one).

  Args:
    alphas: ``(..., gamma)`` conditional acceptance rates.
    cost_ratio: ``c``.
    verify_cost: ``v``.

  Returns:
    ``(...)`` predicted speed-up.
  """
  alphas = jnp.asarray(alphas, jnp.float32)
  gamma = alphas.shape[-1]
  return expected_tokens_per_position(alphas) / (gamma * jnp.asarray(cost_ratio) + verify_cost)


def optimal_gamma(alpha: float, cost_ratio: float, max_gamma: int = 64) -> int:
  """The ``gamma >= 1`` that maximises :func:`improvement_factor` (host-side, exact search).

  Args:
    alpha: acceptance rate in ``[0, 1)``.
    cost_ratio: ``c > 0`` (with ``c = 0`` the factor grows with ``gamma``: ``max_gamma``).
    max_gamma: upper end of the search.

  Returns:
    The optimal number of proposals per step.

  Example:
    >>> optimal_gamma(0.8, 0.05)
    8

  Reference:
    Leviathan et al. 2023, Section 3.5 (choosing gamma).
  """
  gammas = np.arange(1, max_gamma + 1)
  factors = np.asarray(improvement_factor(alpha, gammas, cost_ratio))
  return int(gammas[int(np.argmax(factors))])


def token_expected_tokens(p, q) -> float:
  """Exact expected tokens per step of token-wise verification for given rows (host-side).

  Position ``i`` is accepted with probability ``alpha_i = sum_v min(p[i, v], q[i, v])``
  whatever came before, so this is :func:`expected_tokens_per_position` of those rates.

  Args:
    p: ``(gamma + 1, V)`` target distributions.
    q: ``(gamma, V)`` draft distributions.

  Returns:
    Expected number of tokens per step, in ``[1, gamma + 1]``.

  Example:
    >>> p = [[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]
    >>> q = [[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]
    >>> round(token_expected_tokens(p, q), 4)
    2.26

  Reference:
    Leviathan et al. 2023, Equation 1 (with per-position rates).
  """
  p = jnp.asarray(p)
  q = jnp.asarray(q)
  return float(expected_tokens_per_position(acceptance_rate(p[: q.shape[0]], q)))


def block_expected_tokens(p, q) -> float:
  """Exact expected tokens per step of block verification for given rows, by enumeration.

  Sums ``len(output) * P(output)`` over :func:`specdec_jax.reference.block_output_distribution`
  (every draft sequence drawn from ``q``). Cost ``O(V ** gamma)``: small ``V`` and ``gamma``.
  Block verification emits at least as many tokens as token-wise verification in
  expectation, for every ``(p, q)``: ``block_expected_tokens(p, q) >=
  token_expected_tokens(p, q)`` (Sun et al. 2025, Theorem 2: block verification is optimal
  among valid verification rules that keep a prefix of the draft).

  Args:
    p: ``(gamma + 1, V)`` target distributions.
    q: ``(gamma, V)`` draft distributions.

  Returns:
    Expected number of tokens per step, in ``[1, gamma + 1]``.

  Example:
    >>> p = [[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]
    >>> q = [[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]
    >>> block_expected_tokens(p, q) >= token_expected_tokens(p, q)
    True

  Reference:
    Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh, "Block Verification
    Accelerates Speculative Decoding", ICLR 2025, arXiv:2403.10444.
  """
  from specdec_jax import reference  # the enumeration lives with the oracle

  law = reference.block_output_distribution(p, q)
  return float(sum(len(tokens) * mass for tokens, mass in law.items()))


class ChiSquare(NamedTuple):
  """The result of :func:`chi_square_test`.

  Attributes:
    statistic: Pearson's statistic ``sum (observed - expected)^2 / expected`` over the bins
      (``inf`` when a count falls on a probability-0 bin).
    df: degrees of freedom, the number of bins minus one.
    p_value: ``P(chi2_df >= statistic)``; 0 for a count on a probability-0 bin, 1 with one bin.
    detail: expected and observed counts, for messages.
  """

  statistic: float
  df: int
  p_value: float
  detail: str


def _upper_gamma_regularized(a: float, x: float) -> float:
  """``Q(a, x) = Gamma(a, x) / Gamma(a)`` in float64: series below ``a + 1``, else Lentz's
  continued fraction (Press et al., "Numerical Recipes", Section 6.2)."""
  if x <= 0:
    return 1.0
  log_front = a * math.log(x) - x - math.lgamma(a)
  if x < a + 1:  # P(a, x) by its series
    term = total = 1.0 / a
    n = a
    for _ in range(10_000):
      n += 1
      term *= x / n
      total += term
      if abs(term) < abs(total) * 1e-16:
        break
    return max(0.0, 1.0 - total * math.exp(log_front))
  tiny = 1e-300
  b = x + 1 - a
  c = 1 / tiny
  d = 1 / b
  h = d
  for i in range(1, 10_000):
    an = -i * (i - a)
    b += 2
    d = an * d + b
    d = tiny if abs(d) < tiny else d
    c = b + an / c
    c = tiny if abs(c) < tiny else c
    d = 1 / d
    delta = d * c
    h *= delta
    if abs(delta - 1) < 1e-16:
      break
  return math.exp(log_front) * h


def chi_square_test(counts, probs, *, min_expected: float = 5.0) -> ChiSquare:
  """Pearson's chi-square goodness-of-fit test of ``counts`` against ``probs`` (NumPy, float64).

  The exactness checks of this project (tests, notebooks, the demo) use it: a sampler whose
  output law is ``probs`` gives a p-value uniform in ``[0, 1]``. Bins of probability 0 must be
  empty (a count there gives p-value 0 outright) and are left out; bins whose expected count is
  below ``min_expected`` are pooled into one (so the chi-square approximation holds).

  Args:
    counts: ``(K,)`` observed counts.
    probs: ``(K,)`` probabilities of the bins (normalised here).
    min_expected: pool bins expected to hold fewer counts than this.

  Returns:
    :class:`ChiSquare` ``(statistic, df, p_value, detail)``.

  Example:
    >>> round(chi_square_test([48, 52], [0.5, 0.5]).p_value, 3)
    0.689

  Reference:
    Pearson, "On the criterion that a given system of deviations ...", 1900.
  """
  observed = np.asarray(counts, dtype=np.float64)
  probs = np.asarray(probs, dtype=np.float64)
  probs = probs / probs.sum()
  expected = probs * observed.sum()
  detail = f"expected {np.round(expected, 1).tolist()}, observed {observed.astype(int).tolist()}"
  if np.any((probs == 0) & (observed > 0)):
    return ChiSquare(math.inf, int((probs > 0).sum()) - 1, 0.0, detail)
  observed, expected = observed[probs > 0], expected[probs > 0]  # empty bins carry no test
  big = expected >= min_expected
  obs, exp = list(observed[big]), list(expected[big])
  if (~big).any() and expected[~big].sum() > 0:
    obs.append(observed[~big].sum())
    exp.append(expected[~big].sum())
  if len(obs) < 2:
    return ChiSquare(0.0, 0, 1.0, detail)
  obs_a, exp_a = np.array(obs), np.array(exp)
  statistic = float(np.sum((obs_a - exp_a) ** 2 / exp_a))
  df = len(obs) - 1
  return ChiSquare(statistic, df, _upper_gamma_regularized(df / 2, statistic / 2), detail)
