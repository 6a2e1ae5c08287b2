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
  "adjust_logits",
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


def adjust_logits(logits, *, allowed_token_ids=None, bitmask=None, bad_words=None,
                  min_tokens=None, stop_token_ids=(), logit_bias=None, repetition_penalty=None,
                  frequency_penalty=None, presence_penalty=None, prompt_ids=(),
                  output_ids=()) -> np.ndarray:
  """A request's adjustments before the temperature, in float64, in vLLM's order.

  1. ``allowed_token_ids``: every other token ``-inf``; ``bitmask``: a grammar's int32 words
     (token ``32 j + i`` allowed iff bit ``i`` of word ``j``), the others ``-inf``.
  2. ``bad_words`` (lists of ids): a word's last token ``-inf`` when its other tokens are the
     last ones of ``output_ids`` (a one-token word: always).
  3. ``min_tokens``: ``stop_token_ids`` ``-inf`` while ``len(output_ids) < min_tokens``.
  4. ``logit_bias`` (``{id: bias}``): added.
  5. ``repetition_penalty`` on tokens of the prompt or the output (divide a positive logit,
     multiply a negative one), then ``frequency_penalty`` times each token's count in the
     output, then ``presence_penalty`` once per token of the output, subtracted.

  Example:
    >>> adjust_logits([1.0, 2.0, -1.0], repetition_penalty=2.0, output_ids=[1, 2]).tolist()
    [1.0, 1.0, -2.0]
  """
  x = np.asarray(logits, dtype=np.float64).copy()
  vocab = len(x)
  output = [int(t) for t in output_ids if t >= 0]
  prompt = [int(t) for t in prompt_ids if t >= 0]
  if allowed_token_ids is not None:
    keep = np.zeros(vocab, bool)
    keep[[int(t) for t in allowed_token_ids if 0 <= t < vocab]] = True
    x[~keep] = -np.inf
  if bitmask is not None:
    words = np.asarray(bitmask).astype(np.uint32)
    allowed = np.array([(int(words[t // 32]) >> (t % 32)) & 1 for t in range(vocab)], bool)
    x[~allowed] = -np.inf
  for word in bad_words or ():
    word = [int(t) for t in word if t >= 0]
    if word and len(word) - 1 <= len(output) and (
        len(word) == 1 or output[len(output) - (len(word) - 1):] == word[:-1]):
      x[word[-1]] = -np.inf
  if min_tokens is not None and len(output) < min_tokens:
    x[[int(t) for t in stop_token_ids if 0 <= t < vocab]] = -np.inf
  for token, bias in (logit_bias or {}).items():
    x[int(token)] += bias
  counts = np.bincount(np.asarray(output, np.int64), minlength=vocab)[:vocab]
  if repetition_penalty is not None:
    seen = counts > 0
    seen[[t for t in prompt if t < vocab]] = True
    x = np.where(seen, np.where(x > 0, x / repetition_penalty, x * repetition_penalty), x)
  if frequency_penalty is not None:
    x = x - frequency_penalty * counts
  if presence_penalty is not None:
    x = x - presence_penalty * (counts > 0)
  return x


def process_logits(logits, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None, *,
                   min_p_last: bool = False, **adjustments) -> np.ndarray:
  """The processed distribution of one logit row, in float64: the one definition the library
  follows (:func:`specdec_jax.process_logits`, the lazy verifiers, ``sample_draft``).

  0. ``adjustments`` (the keyword arguments of :func:`adjust_logits`): masks, bans, bias and
     penalties, before everything else.
  1. A row with a NaN or ``+inf`` logit, or without a finite one, is broken: all NaN.
  2. ``temperature`` not ``> 0``: a point mass on the first largest logit.
  3. Order the tokens by logit, descending, ties toward the lower id (``-inf`` last).
  4. ``z = (x - max x) / temperature`` on the finite logits, ``-inf`` elsewhere; ``min_p > 0``
     keeps ``z >= log(min_p)`` (a probability at least ``min_p`` times the largest).
  5. ``top_k > 0`` keeps the first ``top_k`` of the order that ``min_p`` kept.
  6. Over what survived, ``softmax(z)``; ``top_p < 1`` keeps each token whose preceding mass
     in the order is ``< top_p`` (the first always).
  7. ``softmax(z)`` over the kept tokens.

  The kept set is a prefix of the logit order: two logits a temperature rounds to one value
  stay in that order, and ``temperature = inf`` is the uniform law over the kept tokens.
  ``min_p_last``: ``min_p`` after top-k and top-p instead (sglang-jax's order; the verifiers'
  ``convention="sglang"``).

  Example:
    >>> process_logits([0.0, 1.0, 1.0, 2.0], 1.0, top_k=2).round(3).tolist()
    [0.0, 0.269, 0.0, 0.731]
  """
  x = adjust_logits(logits, **adjustments) if adjustments else np.asarray(logits, np.float64)
  vocab = len(x)
  finite = np.isfinite(x)
  if np.isnan(x).any() or (x == np.inf).any() or not finite.any():
    return np.full(vocab, np.nan)
  if not temperature > 0:
    return np.eye(vocab)[int(np.argmax(x))]
  order = np.lexsort((np.arange(vocab), -np.where(finite, x, -np.inf)))
  keep = finite.copy()
  with np.errstate(invalid="ignore"):
    z = np.where(finite, (x - x[finite].max()) / temperature, -np.inf)
  minp = np.ones(vocab, bool) if min_p is None or min_p <= 0 else z >= np.log(min_p)
  if not min_p_last:
    keep &= minp
  if top_k is not None and top_k > 0:
    ranked = order[keep[order]]
    keep[ranked[top_k:]] = False
  z = np.where(keep, z, -np.inf)
  probs = np.exp(z - z.max())
  probs /= probs.sum()
  if top_p is not None and top_p < 1:
    before = np.cumsum(probs[order]) - probs[order]
    drop = order[(before >= top_p) & (np.arange(vocab) > 0)]
    probs[drop] = 0.0
    probs /= probs.sum()
  if min_p_last:
    probs = np.where(minp, probs, 0.0)
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
