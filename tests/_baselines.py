"""Baselines the core tests compare the library against (test-only; the application keeps its
own copy of :func:`sorted_process_row` for the packed benchmark, checked equal to this one in
``tests/app/test_bench.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import scaled_logits
from specdec_jax._logits.transform import kept_set_keys


def sorted_process_row(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """``process_logits`` on one row by one stable argsort: the version before the sort-free
  threshold search.

  The reference the sort-free top-k / top-p is tested against (ties go to the lower id through
  the stable sort).
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
