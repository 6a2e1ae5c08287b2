"""The baselines ``make bench`` times ``verify`` against (and the tests check for exactness).

Not part of the library: they exist to be measured against. Both are exact, and wasteful in
the way the samplers they imitate are: they build the residual over the full vocabulary at
every draft position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import scaled_logits
from specdec_jax._logits.transform import kept_set_keys

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


def sorted_process_row(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """``process_logits`` on one row by one stable argsort per row (the version the sort-free
  threshold search replaced): the ``sorted`` column of the packed benchmark.

  The test suite keeps the same function as its reference (``tests/_baselines.py``; the
  application does not import the tests), and ``tests/app/test_bench.py`` checks the two equal.
  """
  vocab = logits.shape[-1]
  z, greedy, broken = scaled_logits(logits, params.temperature)
  dtype = z.dtype
  neg_inf = jnp.full_like(z, -jnp.inf)
  if params.top_k is not None or params.top_p is not None:
    order = jnp.argsort(-kept_set_keys(logits), stable=True)  # raw logits, ties to lower id
    rank = jnp.zeros(vocab, jnp.int32).at[order].set(jnp.arange(vocab, dtype=jnp.int32))
    if params.top_k is not None:
      k = jnp.asarray(params.top_k)
      k = jnp.where(k > 0, jnp.minimum(k, vocab), vocab).astype(jnp.int32)
      z = jnp.where(rank < k, z, neg_inf)
    if params.top_p is not None:
      top_p = jnp.clip(jnp.asarray(params.top_p, dtype), jnp.finfo(dtype).tiny, 1)
      sorted_probs = jax.nn.softmax(z[order])
      mass_before = jnp.cumsum(sorted_probs) - sorted_probs
      keep_sorted = (mass_before < top_p) | (jnp.arange(vocab) == 0)
      keep = jnp.zeros(vocab, bool).at[order].set(keep_sorted)
      z = jnp.where(keep | (top_p >= 1), z, neg_inf)
  probs = jax.nn.softmax(z)
  one_hot = jax.nn.one_hot(jnp.argmax(logits), vocab, dtype=dtype)
  return jnp.where(broken, jnp.nan, jnp.where(greedy, one_hot, probs))


def sorted_process_rows(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """:func:`sorted_process_row` over ``(R, V)`` rows with ``(R,)`` parameter fields."""
  return jax.vmap(sorted_process_row)(logits, params)


@jax.jit
def eager_packed_sampler(p, q, ids, counts, key):
  """A rejection sampler in the style of vllm-project/tpu-inference on packed rows (exact).

  Inputs as :func:`specdec_jax.packed_verify` with interleaved target rows ``p [T + B, V]``,
  draft rows ``q [T, V]``, ids ``[T]`` and ``counts [B]``. Like tpu-inference's
  ``RejectionSampler``: the target rows of the drafts are gathered (``[T, V]``), each draft is
  tested with its own uniform, a replacement is drawn for *every* draft row from
  ``max(p - q, 0)`` (``p`` if empty) by an exponential race over ``[T, V]``, the bonus tokens by
  one more race over the ``B`` bonus rows, and the first rejection per request picks the
  output. Returns ``(tokens (B, max + 1), num_accepted (B,))`` with ``max = T``-bounded
  ``counts``' static bound taken as ``q``'s rows per request at most ``T``.
  """
  total, batch = ids.shape[0], counts.shape[0]
  starts = jnp.cumsum(counts) - counts
  owner = jnp.repeat(jnp.arange(batch), counts, total_repeat_length=total)
  position = jnp.arange(total) - starts[owner]
  target = p[starts[owner] + owner + position]  # the gather of the draft rows: [T, V]
  k_u, k_rec, k_bonus = jax.random.split(key, 3)
  u = jax.random.uniform(k_u, (total,))
  p_x = jnp.take_along_axis(target, ids[:, None], axis=1)[:, 0]
  q_x = jnp.take_along_axis(q, ids[:, None], axis=1)[:, 0]
  accepted = u * q_x < p_x
  residual = jnp.maximum(target - q, 0)
  residual = jnp.where(jnp.sum(residual, axis=1, keepdims=True) > 0, residual, target)
  race = residual / jax.random.exponential(k_rec, residual.shape)
  recovered = jnp.argmax(race, axis=1).astype(jnp.int32)
  bonus_rows = p[starts + jnp.arange(batch) + counts]
  bonus = jnp.argmax(bonus_rows / jax.random.exponential(k_bonus, bonus_rows.shape),
                     axis=1).astype(jnp.int32)
  first_reject = jax.ops.segment_min(jnp.where(accepted, total, position), owner,
                                     num_segments=batch)
  num_accepted = jnp.minimum(first_reject, counts)
  slot = jnp.clip(starts + num_accepted, 0, max(total - 1, 0))
  final = jnp.where(num_accepted < counts, recovered[slot], bonus)
  width = 8
  columns = jnp.arange(width)[None, :]
  index = jnp.clip(starts[:, None] + columns, 0, max(total - 1, 0))
  kept = ids[index] if total else jnp.zeros((batch, width), jnp.int32)
  tokens = jnp.where(columns < num_accepted[:, None], kept,
                     jnp.where(columns == num_accepted[:, None], final[:, None], PAD_ID))
  return tokens, num_accepted
