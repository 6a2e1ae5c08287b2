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
