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
decay ``S`` and ``F``, so the estimate drifts back to the prior mean ``a / (a + b)`` and the
row probes again after a while: it goes back up when proposals succeed.

The choice reads only tokens the row has already emitted, never the coins of the current
step, so the output distribution is untouched (exactness holds for any ``num_draft`` that is
independent of the current step's randomness).

Reference: Leviathan, Kalman, Matias, ICML 2023, arXiv:2211.17192 (Theorem 3.8); the
per-step choice of the lookahead follows the idea of Mamou et al., "Dynamic Speculation
Lookahead Accelerates Speculative Decoding of Large Language Models", arXiv:2405.04304, with
the cost model in place of their classifier.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


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
    decay: forgetting factor of the acceptance estimate, in ``(0, 1)``.
    prior_accepted: ``a``, pseudo-count of accepted proposals (``> 0``).
    prior_rejected: ``b``, pseudo-count of rejections (``> 0``).

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


_LARGEST = 1e30


def check_policy(policy: AdaptiveSpeculation, name: str) -> AdaptiveSpeculation:
  """The policy with float fields, or ``ValueError`` naming the bad field."""
  if not isinstance(policy, AdaptiveSpeculation):
    raise TypeError(f"{name}: `adaptive` must be an AdaptiveSpeculation or None, got "
                    f"{type(policy).__name__} instead.")
  values = {}
  for field, value in policy._asdict().items():
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
  for field in ("prior_accepted", "prior_rejected"):
    if not values[field] > 0:
      raise ValueError(f"{name}: `adaptive.{field}` must be > 0, got {values[field]} instead.")
  return AdaptiveSpeculation(**values)


def acceptance(policy: AdaptiveSpeculation, counts: jax.Array) -> jax.Array:
  """The estimated acceptance rate ``(B,)`` of each row from its ``(B, 2)`` decayed counts."""
  a, b = policy.prior_accepted, policy.prior_rejected
  return (a + counts[:, 0]) / (a + b + counts[:, 0] + counts[:, 1])


def choose_num_draft(policy: AdaptiveSpeculation, counts: jax.Array, *, gamma: int) -> jax.Array:
  """``k* (B,)`` int32 in ``[0, gamma]``: the proposals that maximise ``E(k) / C(k)``."""
  alpha = jnp.clip(acceptance(policy, counts), 0.0, 1.0 - 1e-6)[:, None]
  k = jnp.arange(gamma + 1, dtype=jnp.float32)[None]
  expected = (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)
  cost = 1.0 + jnp.where(k > 0, policy.fixed_cost, 0.0) + k * (policy.draft_cost
                                                              + policy.verify_cost)
  return jnp.argmax(expected / cost, axis=1).astype(jnp.int32)


def update_counts(policy: AdaptiveSpeculation, counts: jax.Array, proposed: jax.Array,
                  accepted: jax.Array, active: jax.Array) -> jax.Array:
  """The ``(B, 2)`` counts after an iteration with ``proposed`` and ``accepted`` ``(B,)``."""
  rejected = (proposed > 0) & (accepted < proposed)
  new = jnp.stack([accepted.astype(jnp.float32), rejected.astype(jnp.float32)], axis=1)
  return jnp.where(active[:, None], policy.decay * counts + new, counts)
