"""A plain, literal NumPy float64 implementation of the rule: the oracle for tests and docs.

Written to be read, not to be fast. Every line does what the rule says (Leviathan et al.
2023, Algorithm 1; Chen et al. 2023), in the order it says it, with one ``rng.random()`` per
accept test and one for the final sample, so the library's jitted code can be checked
against it token for token.

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
  "block_output_distribution",
  "block_speculative_step",
  "output_distribution",
  "process_logits",
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


def process_logits(logits, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> np.ndarray:
  """The processed distribution of one logit row, in float64: the one definition the library
  follows (:func:`specdec_jax.process_logits`, the lazy verifiers, ``sample_draft``).

  1. A row with a NaN or ``+inf`` logit, or without a finite one, is broken: all NaN.
  2. ``temperature`` not ``> 0``: a point mass on the first largest logit.
  3. Order the tokens by raw logit, descending, ties toward the lower id (``-inf`` last).
     ``top_k > 0`` keeps the first ``top_k`` of that order.
  4. ``z = (x - max x) / temperature`` on the finite logits, ``-inf`` elsewhere; over what
     top-k kept, ``softmax(z)``; ``top_p < 1`` keeps each token whose preceding mass in that
     order is ``< top_p`` (the first always).
  5. ``softmax(z)`` over the kept tokens.

  The kept set is a prefix of the raw-logit order: two logits a temperature rounds to one
  value stay in that order, and ``temperature = inf`` is the uniform law over the kept tokens.

  Example:
    >>> process_logits([0.0, 1.0, 1.0, 2.0], 1.0, top_k=2).round(3).tolist()
    [0.0, 0.269, 0.0, 0.731]
  """
  x = np.asarray(logits, dtype=np.float64)
  vocab = len(x)
  finite = np.isfinite(x)
  if np.isnan(x).any() or (x == np.inf).any() or not finite.any():
    return np.full(vocab, np.nan)
  if not temperature > 0:
    return np.eye(vocab)[int(np.argmax(x))]
  order = np.lexsort((np.arange(vocab), -np.where(finite, x, -np.inf)))
  keep = np.ones(vocab, bool)
  if top_k is not None and 0 < top_k < vocab:
    keep[order[top_k:]] = False
  with np.errstate(invalid="ignore"):
    z = np.where(finite & keep, (x - x[finite].max()) / temperature, -np.inf)
  probs = np.exp(z - z.max())
  probs /= probs.sum()
  if top_p is not None and top_p < 1:
    before = np.cumsum(probs[order]) - probs[order]
    drop = order[(before >= top_p) & (np.arange(vocab) > 0)]
    probs[drop] = 0.0
    probs /= probs.sum()
  return probs


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
  """The verification step of speculative sampling, literally.

  For ``i = 0 .. gamma - 1`` with ``x = draft[i]``: draw ``u``; accept ``x`` if
  ``u < p[i, x] / q[i, x]``, else sample a replacement from :func:`residual` and stop. If
  every proposal is accepted, sample a bonus token from ``p[gamma]``. Sampling is
  :func:`sample` (inverse CDF, one draw).

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


def _block_weights(p, q, draft) -> list[float]:
  """``b_0 .. b_gamma`` of block verification, literally: ``b_i = min(1, b_{i-1} p/q)``.

  ``b_{i-1} == 0`` or ``p(x) == 0`` gives 0 (no ``0 * inf``).
  """
  weights = [1.0]
  for i, x in enumerate(draft):
    x = int(x)
    if weights[-1] == 0 or p[i, x] == 0:
      weights.append(0.0)
    else:
      weights.append(min(1.0, weights[-1] * acceptance_probability(p[i, x], q[i, x])))
  return weights


def _block_stop_weights(p, q, weights) -> tuple[list[float], list[np.ndarray]]:
  """Stopping weights ``h_0 .. h_gamma`` and residual rows ``max(b_i p[i] - q[i], 0)``."""
  gamma = q.shape[0]
  stops, residuals = [1.0], []
  for i in range(gamma):
    res = np.maximum(weights[i] * p[i] - q[i], 0.0)
    residuals.append(res)
    if i == 0:
      continue
    mass = res.sum()
    den = mass + 1.0 - weights[i]
    stops.append(mass / den if den > 0 else 1.0)
  if gamma:
    stops.append(weights[gamma])
  return stops, residuals


def _block_final_row(p, residuals, stop: int) -> np.ndarray:
  if stop == len(residuals):
    return p[stop]
  res = residuals[stop]
  return res / res.sum() if res.sum() > 0 else p[stop]


def block_speculative_step(p, q, draft, rng) -> list[int]:
  """One step of block verification (Sun et al. 2025, Algorithm 2), literally, in float64.

  With 1-indexed positions: ``b_0 = 1``, ``b_i = min(1, b_{i-1} p[i-1, x_i] / q[i-1, x_i])``;
  ``h_0 = 1``, ``h_i = Z_i / (Z_i + 1 - b_i)`` with ``Z_i = sum max(b_i p[i] - q[i], 0)``
  (1 when the denominator is 0), ``h_gamma = b_gamma``. Draws ``eta_1 .. eta_gamma``, keeps
  ``tau`` = the largest ``i`` with ``eta_i < h_i`` (0 always qualifies) and emits
  ``draft[:tau]`` plus one sample from ``p[gamma]`` (``tau = gamma``) or from the normalised
  residual ``max(b_tau p[tau] - q[tau], 0)`` (``p[tau]`` if that is all zero).

  Args:
    p: ``(gamma + 1, V)`` target distributions.
    q: ``(gamma, V)`` draft distributions.
    draft: ``(gamma,)`` proposed token ids.
    rng: anything with ``.random()``; called ``gamma`` times for the etas, then once for the
      final sample.

  Returns:
    The new tokens, between 1 and ``gamma + 1`` of them.
  """
  p = np.asarray(p, dtype=np.float64)
  q = np.asarray(q, dtype=np.float64)
  gamma = q.shape[0]
  etas = [rng.random() for _ in range(gamma)]
  weights = _block_weights(p, q, draft)
  stops, residuals = _block_stop_weights(p, q, weights)
  tau = 0
  for i in range(1, gamma + 1):
    if etas[i - 1] < stops[i]:
      tau = i
  return [int(x) for x in draft[:tau]] + [sample(_block_final_row(p, residuals, tau), rng)]


def block_output_distribution(p, q) -> dict[tuple[int, ...], float]:
  """Exact law of the tokens one block-verification step returns, by enumeration.

  Like :func:`output_distribution`: each ``draft[i]`` is drawn from ``q[i]``; for every draft
  sequence ``P(tau = i) = h_i prod_{j > i} (1 - h_j)`` is combined with the final row.
  Cost ``O(V ** gamma)``: small cases only.

  Returns:
    Mapping from the output token tuple to its probability (sums to 1).
  """
  p = np.asarray(p, dtype=np.float64)
  q = np.asarray(q, dtype=np.float64)
  gamma, vocab = q.shape
  law: dict[tuple[int, ...], float] = {}
  for draft in itertools.product(range(vocab), repeat=gamma):
    weight = math.prod(q[i, x] for i, x in enumerate(draft))
    if weight == 0:
      continue
    stops, residuals = _block_stop_weights(p, q, _block_weights(p, q, draft))
    later = 1.0  # probability that no j > i was kept
    for i in range(gamma, -1, -1):
      mass = weight * later * stops[i]
      later *= 1.0 - stops[i]
      row = _block_final_row(p, residuals, i)
      for y in range(vocab):
        if mass * row[y] > 0:
          key = (*draft[:i], y)
          law[key] = law.get(key, 0.0) + mass * row[y]
  return law
