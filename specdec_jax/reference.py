"""A plain, literal NumPy float64 implementation of the rule: the oracle for tests and docs.

Written to be read next to SPEC.md, not to be fast. Every line does what the
specification says, in the order it says it, so the library's jitted code can be
checked against it token for token.

Example:
  >>> import numpy as np
  >>> from specdec_jax import UniformStream
  >>> p = [[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]
  >>> q = [[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]
  >>> speculative_step(p, q, [1, 2], UniformStream([0.7, 0.9, 0.1]))
  [1, 2, 0]
  >>> speculative_step(p, q, [0, 2], UniformStream([0.7, 0.9, 0.1]))
  [2]
"""

from __future__ import annotations

import itertools
import math

import numpy as np

__all__ = [
  "acceptance_probability",
  "output_distribution",
  "residual",
  "sample",
  "speculative_step",
]


def sample(probs, rng) -> int:
  """Inverse-CDF sample with exactly one ``rng.random()`` call.

  Returns the smallest ``k`` with ``u < cumsum(probs)[k]``; if rounding leaves
  ``u`` at or above the last cumulative sum, the largest ``k`` with ``probs[k] > 0``.
  """
  probs = np.asarray(probs, dtype=np.float64)
  u = rng.random()
  cdf = np.cumsum(probs)
  (hits,) = np.nonzero(u < cdf)
  if hits.size > 0:
    return int(hits[0])
  return int(np.nonzero(probs > 0)[0][-1])


def acceptance_probability(p_x: float, q_x: float) -> float:
  """``p(x) / q(x)`` as the accept test uses it.

  ``inf`` if ``q(x) == 0 < p(x)``, ``0`` if both are 0.
  """
  if q_x > 0:
    return p_x / q_x
  return math.inf if p_x > 0 else 0.0


def residual(p_row, q_row) -> np.ndarray:
  """The residual distribution ``max(p - q, 0) / sum(max(p - q, 0))``; ``p`` if that sum is 0."""
  p_row = np.asarray(p_row, dtype=np.float64)
  diff = np.maximum(p_row - np.asarray(q_row, dtype=np.float64), 0.0)
  total = diff.sum()
  if total > 0:
    return diff / total
  return p_row


def speculative_step(p, q, draft, rng) -> list[int]:
  """The verification step of speculative sampling, literally as SPEC.md states it.

  Args:
    p: ``(gamma + 1, V)`` target distributions.
    q: ``(gamma, V)`` draft distributions.
    draft: ``(gamma,)`` proposed token ids.
    rng: anything with ``.random()``; called once per accept test, then once for the final sample.

  Returns:
    The new tokens, between 1 and ``gamma + 1`` of them.
  """
  p = np.asarray(p, dtype=np.float64)
  q = np.asarray(q, dtype=np.float64)
  tokens = []
  for i, x in enumerate(draft):
    x = int(x)
    u = rng.random()
    if u < acceptance_probability(p[i, x], q[i, x]):
      tokens.append(x)
      continue
    tokens.append(sample(residual(p[i], q[i]), rng))
    return tokens
  tokens.append(sample(p[len(tokens)], rng))
  return tokens


def output_distribution(p, q) -> dict[tuple[int, ...], float]:
  """Exact law of the tokens one step returns, by enumerating every draft sequence.

  Each ``draft[i]`` is drawn from ``q[i]`` independently (the rows are taken as
  fixed, which is what one verification step sees). For every draft sequence the
  accept probabilities ``min(1, p/q)`` and the residuals are combined into the
  probability of every possible output. Cost ``O(V ** gamma)``: small cases only.

  Returns:
    Mapping from the output token tuple to its probability (sums to 1).
  """
  p = np.asarray(p, dtype=np.float64)
  q = np.asarray(q, dtype=np.float64)
  gamma, vocab = q.shape
  law: dict[tuple[int, ...], float] = {}

  def add(key, mass):
    if mass > 0:
      law[key] = law.get(key, 0.0) + mass

  for draft in itertools.product(range(vocab), repeat=gamma):
    weight = math.prod(q[i, x] for i, x in enumerate(draft))
    if weight == 0:
      continue
    reach = weight  # probability of this draft and of accepting every token before position i
    for i, x in enumerate(draft):
      accept = min(1.0, acceptance_probability(p[i, x], q[i, x]))
      replacement = residual(p[i], q[i])
      for y in range(vocab):
        add((*draft[:i], y), reach * (1.0 - accept) * replacement[y])
      reach *= accept
    for y in range(vocab):
      add((*draft, y), reach * p[gamma, y])
  return law
