"""The baselines ``make bench`` times ``verify`` against (and the tests check for exactness).

Not part of the library: they exist to be measured against. Both are exact, and wasteful in
the way the samplers they imitate are: they build the residual over the full vocabulary at
every draft position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

PAD_ID = -1


@functools.partial(jax.jit, static_argnames=("pad_id",))
def eager_recovery_verify(p, q, draft, uniforms, key, *, pad_id: int = PAD_ID):
  """Exact but wasteful batched verification: every position's replacement is sampled eagerly.

  The shape of vLLM V1's and vllm-project/tpu-inference's rejection samplers: the accept
  test at every position, the residual ``max(p - q, 0)`` over the full vocabulary at every
  position, a replacement at every position and the bonus token from ``p[:, gamma]`` by an
  exponential race (``argmax(w / E)`` with ``E ~ Exponential(1)`` drawn over
  ``(B, gamma + 1, V)`` is distributed as ``w / sum(w)``), then the output chosen by the
  first rejection. Inputs as ``jax.vmap(verify)`` plus a ``jax.random`` key; returns
  ``(tokens (B, gamma + 1), num_accepted (B,))``.
  """
  batch, gamma, _ = q.shape
  ids = draft[..., None]
  p_x = jnp.take_along_axis(p[:, :gamma], ids, axis=-1)[..., 0]
  q_x = jnp.take_along_axis(q, ids, axis=-1)[..., 0]
  accepted = uniforms[:, :gamma] * q_x < p_x  # u < p/q without dividing: q == 0 < p accepts
  residual = jnp.maximum(p[:, :gamma] - q, 0)  # (B, gamma, V) at every position
  empty = jnp.sum(residual, axis=-1, keepdims=True) <= 0  # p == q: fall back to p
  weights = jnp.concatenate([jnp.where(empty, p[:, :gamma], residual), p[:, gamma:]], axis=1)
  noise = jax.random.exponential(key, weights.shape, weights.dtype)
  race = jnp.where(weights > 0, weights / noise, -1)  # a weight-0 id never wins, even if E == 0
  candidates = jnp.argmax(race, axis=-1).astype(jnp.int32)  # replacements, then the bonus
  num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)
  slots = jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
  stop = num_accepted[:, None]
  kept = jnp.concatenate([draft.astype(jnp.int32), jnp.zeros((batch, 1), jnp.int32)], axis=1)
  final = jnp.take_along_axis(candidates, stop, axis=1)
  tokens = jnp.where(slots < stop, kept, jnp.where(slots == stop, final, pad_id))
  return tokens, num_accepted


def torch_speculative_sampling(p, q, draft, uniforms):
  """Batched PyTorch sampler in the style of HF ``_speculative_sampling`` / vLLM V0.

  The normalised residual and a ``torch.multinomial`` replacement at every position, the
  bonus from ``p[:, gamma]``, the accept mask from the uniforms and the first rejection.
  Args are torch tensors shaped like ``jax.vmap(verify)``'s (``draft`` int64); returns
  ``(tokens (B, gamma + 1), num_accepted (B,))``.
  """
  import torch

  batch, gamma, vocab = q.shape
  p_draft = p[:, :gamma]
  ids = draft.unsqueeze(-1)
  p_x = p_draft.gather(-1, ids).squeeze(-1)
  q_x = q.gather(-1, ids).squeeze(-1)
  accepted = uniforms[:, :gamma] * q_x < p_x
  residual = (p_draft - q).clamp_(min=0)
  mass = residual.sum(-1, keepdim=True)
  residual = torch.where(mass > 0, residual / mass, p_draft)  # normalised; p where p == q
  recovered = torch.multinomial(residual.reshape(-1, vocab), 1).view(batch, gamma)
  bonus = torch.multinomial(p[:, gamma], 1)
  num_accepted = accepted.int().cumprod(-1).sum(-1)
  candidates = torch.cat([recovered, bonus], 1)
  kept = torch.cat([draft, torch.zeros_like(bonus)], 1)
  slots = torch.arange(gamma + 1).unsqueeze(0)
  stop = num_accepted.unsqueeze(-1).long()
  final = candidates.gather(1, stop)
  tokens = torch.where(slots < stop, kept, torch.where(slots == stop, final, PAD_ID))
  return tokens, num_accepted


