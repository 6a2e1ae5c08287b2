"""Adaptive speculation: each row's number of proposals per iteration, from its past acceptance.

The rule is Leviathan et al.'s Theorem 3.8 applied per row and per iteration with a cost model
of the step. With a per-token acceptance rate ``alpha``, ``k`` proposals yield on average
``E(k) = (1 - alpha^(k + 1)) / (1 - alpha)`` tokens per target call, and the iteration costs

  ``C(k) = 1 + [k > 0] * fixed_cost + k * (draft_cost + verify_cost)``

target decoding steps: ``draft_cost`` per draft step, ``verify_cost`` for each extra token the
target scores in its call, ``fixed_cost`` for speculating at all (the draft's sync call,
proposal bookkeeping, verification instead of plain sampling). The row proposes
``k* = argmax_k E(k) / C(k)`` over ``k = 0 .. gamma``: nothing when proposals keep failing.

``alpha`` is estimated per row from its own history, as a Beta posterior mean with exponential
forgetting: after an iteration with ``k > 0`` proposals of which ``n`` were accepted,
``S <- decay * S + n`` and ``F <- decay * F + [n < k]`` (the truncated-geometric likelihood of
the step), and ``alpha = (a + S) / (a + b + S + F)``. Iterations without proposals only
decay ``S`` and ``F``, by the slower ``idle_decay``, so the estimate drifts back to the prior
mean ``a / (a + b)`` and the row probes again after a while: it goes back up when proposals
succeed. Each probe of a draft that keeps failing costs what speculating costs, so the probe
rate bounds the loss against plain decoding: under the cost model (``fixed_cost = 0.1``,
``verify_cost = 0.04``), a draft that never hits loses 6.5% when idle iterations decay as
fast as ``decay = 0.9`` (a probe every few iterations) and 2.5% at the default
``idle_decay = 0.98``, while a draft accepted 20% of the time still gains 3.9% (4.7% at 0.9),
and one accepted 40% or more gains the same either way (:func:`policy_efficiency`, ``gamma = 4``,
``draft_cost = 0``).

The costs are constants given when the policy is built, or (``observe = n > 0``) they follow
the costs observed while the loop runs: the loop runs in jitted chunks of ``n`` iterations, the
host times each chunk and :class:`CostFit` refits ``C(k)``, the cost of an iteration whose
target call scores ``k + 1`` tokens, from the chunks' wall times and the widths their
iterations ran at (a ridge regression toward the constants' curve, scaled to the observed
time, with exponential forgetting), and the next chunk chooses with the refitted table. So a
machine where calls on more tokens cost more than the constants say (another process on the
cores, a larger batch) gets fewer proposals, and one where they are cheaper gets more.

The choice reads only tokens the row has already emitted, never the coins of the current
step, so the output distribution is untouched (exactness holds for any ``num_draft`` that is
independent of the current step's randomness; observed costs depend on wall time, which is
independent of the coins too, but then two runs with the same key may choose differently and
so emit different samples of the same distribution; greedy output is unchanged).

Reference: Leviathan, Kalman, Matias, ICML 2023, arXiv:2211.17192 (Theorem 3.8); the
per-step choice of the lookahead follows the idea of Mamou et al., "Dynamic Speculation
Lookahead Accelerates Speculative Decoding of Large Language Models", arXiv:2405.04304, with
the cost model in place of their classifier.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class AdaptiveSpeculation(NamedTuple):
  """The cost model and estimator of adaptive speculation (static; see the module docstring).

  Costs are in units of one target decoding step (one ``apply`` on one token plus sampling);
  measure them on the machine (``make bench-e2e`` prints them) for the best choice.

  Attributes:
    draft_cost: one draft step (0 for prompt lookup; about 0.05 for a one-layer EAGLE draft
      of SmolLM2-135M on a CPU).
    verify_cost: each extra token in the target's call (about 0.04 for SmolLM2-135M, batch 1,
      on a 2-core CPU: 5 tokens cost 22.2 ms against 19.2 ms for one).
    fixed_cost: speculating at all in an iteration, beyond the per-token costs.
    decay: forgetting factor of the acceptance estimate per iteration with proposals, in
      ``(0, 1)``.
    prior_accepted: ``a``, pseudo-count of accepted proposals (``> 0``).
    prior_rejected: ``b``, pseudo-count of rejections (``> 0``).
    observe: ``0`` (the default): the costs above, constant. ``n >= 1``: follow the costs
      observed while running: the loop runs in jitted chunks of ``n`` iterations that the
      host times (:class:`CostFit`); the constants above are then only the starting curve.
      Needs the batch on this process's devices and a call outside ``jax.jit``.
    idle_decay: forgetting factor per iteration without proposals, in ``(0, 1]``: how soon a
      row whose proposals failed tries again (about ``ln 2 / (1 - idle_decay)`` iterations to
      halve the evidence; 1: never, once the estimate says speculating does not pay).

  Example:
    >>> policy = AdaptiveSpeculation(draft_cost=0.0, verify_cost=0.04, fixed_cost=0.1)
    >>> import jax.numpy as jnp
    >>> choose_num_draft(policy, jnp.array([[0.0, 8.0], [9.0, 0.0]]), gamma=4).tolist()
    [0, 4]
  """

  draft_cost: float = 0.0
  verify_cost: float = 0.04
  fixed_cost: float = 0.1
  decay: float = 0.9
  prior_accepted: float = 1.0
  prior_rejected: float = 1.0
  observe: int = 0
  idle_decay: float = 0.98


_LARGEST = 1e30


def check_policy(policy: AdaptiveSpeculation, name: str) -> AdaptiveSpeculation:
  """The policy with float fields, or ``ValueError`` naming the bad field."""
  if not isinstance(policy, AdaptiveSpeculation):
    raise TypeError(f"{name}: `adaptive` must be an AdaptiveSpeculation or None, got "
                    f"{type(policy).__name__} instead.")
  observe = policy.observe
  if (not isinstance(observe, int | np.integer) or isinstance(observe, bool)
      or not 0 <= observe < 2**31):
    raise ValueError(f"{name}: `adaptive.observe` must be an int >= 0 (iterations per timed "
                     f"chunk; 0 keeps the costs constant), got {observe!r} instead.")
  values = {}
  for field, value in policy._asdict().items():
    if field == "observe":
      continue
    try:
      values[field] = float(value)
    except (TypeError, ValueError):
      raise TypeError(f"{name}: `adaptive.{field}` must be a real number, got {value!r} "
                      "instead.") from None
    # The estimate runs in float32: a value it cannot hold with room for sums (inf, 1e300)
    # would become inf or NaN there and silently switch speculation off.
    if not abs(values[field]) <= _LARGEST:
      raise ValueError(f"{name}: `adaptive.{field}` must be finite and at most {_LARGEST:g} in "
                       f"magnitude (the estimate runs in float32), got {value!r} instead.")
  for field in ("draft_cost", "verify_cost", "fixed_cost"):
    if not values[field] >= 0:
      raise ValueError(f"{name}: `adaptive.{field}` must be >= 0, got {values[field]} instead.")
  if not 0 < values["decay"] < 1:
    raise ValueError(f"{name}: `adaptive.decay` must be in (0, 1), got {values['decay']}.")
  if not 0 < values["idle_decay"] <= 1:
    raise ValueError(f"{name}: `adaptive.idle_decay` must be in (0, 1], got "
                     f"{values['idle_decay']}.")
  for field in ("prior_accepted", "prior_rejected"):
    if not values[field] > 0:
      raise ValueError(f"{name}: `adaptive.{field}` must be > 0, got {values[field]} instead.")
  return AdaptiveSpeculation(**values, observe=int(observe))


def acceptance(policy: AdaptiveSpeculation, counts: jax.Array) -> jax.Array:
  """The estimated acceptance rate ``(B,)`` of each row from its ``(B, 2)`` decayed counts."""
  a, b = policy.prior_accepted, policy.prior_rejected
  return (a + counts[:, 0]) / (a + b + counts[:, 0] + counts[:, 1])


def cost_curve(policy: AdaptiveSpeculation, gamma: int) -> jax.Array:
  """The constants' ``C(k)`` ``(gamma + 1,)`` float32, ``k = 0 .. gamma``, in target steps."""
  k = jnp.arange(gamma + 1, dtype=jnp.float32)
  return 1.0 + jnp.where(k > 0, policy.fixed_cost, 0.0) + k * (policy.draft_cost
                                                              + policy.verify_cost)


def choose_num_draft(policy: AdaptiveSpeculation, counts: jax.Array, *, gamma: int,
                     costs: jax.Array | None = None) -> jax.Array:
  """``k* (B,)`` int32 in ``[0, gamma]``: the proposals that maximise ``E(k) / C(k)``.

  ``costs``: ``C(k)`` ``(gamma + 1,)`` in any unit (observed, :class:`CostFit`), or None for
  the policy's constants (:func:`cost_curve`).
  """
  alpha = jnp.clip(acceptance(policy, counts), 0.0, 1.0 - 1e-6)[:, None]
  k = jnp.arange(gamma + 1, dtype=jnp.float32)[None]
  expected = (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)
  cost = cost_curve(policy, gamma) if costs is None else costs
  return jnp.argmax(expected / cost[None], axis=1).astype(jnp.int32)


def update_counts(policy: AdaptiveSpeculation, counts: jax.Array, proposed: jax.Array,
                  accepted: jax.Array, active: jax.Array) -> jax.Array:
  """The ``(B, 2)`` counts after an iteration with ``proposed`` and ``accepted`` ``(B,)``:
  ``decay * counts + (accepted, failed)`` where the row proposed, ``idle_decay * counts`` where
  it did not, unchanged where it is not ``active``."""
  rejected = (proposed > 0) & (accepted < proposed)
  new = jnp.stack([accepted.astype(jnp.float32), rejected.astype(jnp.float32)], axis=1)
  decay = jnp.where(proposed > 0, jnp.float32(policy.decay), jnp.float32(policy.idle_decay))
  return jnp.where(active[:, None], decay[:, None] * counts + new, counts)


def policy_efficiency(policy: AdaptiveSpeculation, alpha: float, *, gamma: int,
                      iterations: int = 20_000, seed: int = 0) -> float:
  """Tokens per unit of cost of the policy, relative to plain decoding, under its own cost
  model (:func:`cost_curve`), for a draft whose proposals are accepted independently with
  probability ``alpha``: a host-side simulation of the estimator (no model, no clock).

  Above 1 the policy beats plain decoding; at ``alpha = 0`` what it loses is the price of
  its probes (see the module docstring).

  Example:
    >>> policy = AdaptiveSpeculation(draft_cost=0.0, verify_cost=0.04, fixed_cost=0.1)
    >>> round(policy_efficiency(policy, 0.0, gamma=4), 3)
    0.975
    >>> round(policy_efficiency(policy._replace(idle_decay=0.9), 0.0, gamma=4), 3)
    0.935
  """
  rng = np.random.default_rng(seed)
  curve = np.asarray(cost_curve(policy, gamma), np.float64)
  k = np.arange(gamma + 1)
  a, b = policy.prior_accepted, policy.prior_rejected
  hits = failures = tokens = cost = 0.0
  for _ in range(iterations):
    rate = min((a + hits) / (a + b + hits + failures), 1.0 - 1e-6)
    width = int(np.argmax((1.0 - rate ** (k + 1.0)) / (1.0 - rate) / curve))
    if width == 0:
      hits, failures = policy.idle_decay * hits, policy.idle_decay * failures
      tokens, cost = tokens + 1.0, cost + float(curve[0])
      continue
    accepted = int(np.argmin(np.append(rng.random(width) < alpha, False)))  # leading hits
    hits = policy.decay * hits + accepted
    failures = policy.decay * failures + (accepted < width)
    tokens, cost = tokens + accepted + 1.0, cost + float(curve[width])
  return tokens / cost


class CostFit:
  """The host's estimate of ``C(k)``, an iteration's cost at call width ``k``, from timed chunks.

  Each timed chunk gives its wall time ``t`` and ``n_k``, the iterations it ran at each width
  (``k``: the batch's largest proposal count, the target call scores ``k + 1`` tokens). The
  cost has the constants' form, ``C(k) = a + [k > 0] b + k c`` (a plain iteration, what
  speculating at all adds, each proposal: draft step and scored token), so a chunk's time is
  ``x . (a, b, c)`` with ``x = (iterations, iterations with k > 0, sum of k)``. With
  exponential forgetting ``decay`` per chunk, ``(a, b, c)`` minimises

    ``sum_chunks w * (t - x . theta)^2 + |theta - s * theta_0|^2``

  where ``theta_0 = (1, fixed_cost, draft_cost + verify_cost)`` are the constants and ``s``
  their least-squares scale to the observed times (seconds per target step): the prior
  weighs one iteration, so the observed times take over within a chunk or two, and what
  they cannot tell apart keeps the constants' split.

  A loop that never runs at width 0 cannot tell ``a`` from ``b``, i.e. whether speculating
  still pays on this machine now. So :meth:`next_table` explores: once the decayed count
  of width-0 iterations is under one, and at most once every ``explore_every`` chunks (not
  before that many: short runs do not pay for it), the next chunk's table makes every
  proposal cost ``inf``, so that chunk runs plain iterations. A chunk that took over four
  times what the current fit predicts (a compilation, a collection, a preempted process) is
  left out.

  Example:
    >>> fit = CostFit(AdaptiveSpeculation(verify_cost=0.0, fixed_cost=0.0), gamma=2)
    >>> for _ in range(20):
    ...   fit.add(np.array([4, 0, 0]), 4 * 0.010)  # width 0: 10 ms per iteration
    ...   fit.add(np.array([0, 0, 4]), 4 * 0.030)  # width 2: 30 ms
    >>> [round(float(c) * 1e3, 1) for c in fit.table()]  # ms; width 1 never ran
    [10.2, 22.0, 30.0]
  """

  def __init__(self, policy: AdaptiveSpeculation, gamma: int, *, decay: float = 0.9,
               explore_every: int = 8, clock=time.perf_counter):
    self.prior = np.array([1.0, policy.fixed_cost, policy.draft_cost + policy.verify_cost])
    k = np.arange(gamma + 1, dtype=np.float64)
    self.design = np.stack([np.ones_like(k), (k > 0).astype(np.float64), k], axis=1)
    self.decay = decay
    self.clock = clock
    self.explore_every = explore_every
    self.since_explore = 0
    self.gram = np.zeros((3, 3))
    self.moment = np.zeros(3)
    self.scale_num = 0.0
    self.scale_den = 0.0
    self.plain = 0.0  # decayed count of width-0 iterations
    self._started = None

  def start(self) -> None:
    """Mark the start of a chunk (:meth:`stop` times it)."""
    self._started = self.clock()

  def stop(self, widths) -> None:
    """End the chunk started last: add its wall time with its ``(gamma + 1,)`` widths."""
    self.add(np.asarray(widths), self.clock() - self._started)

  def add(self, widths: np.ndarray, seconds: float) -> None:
    """Add one chunk: ``widths[k]`` iterations at width ``k`` took ``seconds`` in all."""
    n = np.asarray(widths, np.float64)
    if not n.sum() > 0 or not np.isfinite(seconds) or seconds <= 0:
      return
    if self.scale_den > 0 and seconds > 4 * float(n @ self.table()):
      return  # a compilation, a collection or a preempted process, not the loop's cost
    x = n @ self.design
    d = self.decay
    self.gram = d * self.gram + np.outer(x, x)
    self.moment = d * self.moment + x * seconds
    units = float(x @ self.prior)
    self.scale_num = d * self.scale_num + units * seconds
    self.scale_den = d * self.scale_den + units * units
    self.plain = d * self.plain + n[0]

  def table(self) -> np.ndarray:
    """``C(k)`` ``(gamma + 1,)`` float32 in seconds (the constants' curve before any chunk)."""
    curve = self.design @ self.prior
    if self.scale_den <= 0:
      return curve.astype(np.float32)
    prior = self.scale_num / self.scale_den * self.prior
    theta = np.linalg.solve(self.gram + np.eye(3), self.moment + prior)
    # C(k) > 0 keeps E(k) / C(k) meaningful whatever the noise did.
    scaled = self.scale_num / self.scale_den * curve
    return np.maximum(self.design @ theta, 0.05 * scaled).astype(np.float32)

  def next_table(self) -> np.ndarray:
    """The table for the next chunk: :meth:`table`, or an exploring one (see the class)."""
    table = self.table()
    self.since_explore += 1
    if self.since_explore > self.explore_every and self.plain < 1.0:
      self.since_explore = 0
      table = table.copy()
      table[1:] = np.inf
    return table
