"""The performance-critical pieces: the two-level sampler and the lazy stop row.

* ``sample_index`` (two levels: block masses, a prefix over blocks, one block) agrees
  with the straightforward full-cumsum sampler except within rounding of an
  interval boundary: measured on >= 100k draws in float32 and float64.
* The compiled, vmapped ``verify`` contains no ``(gamma, V)``-per-sequence array and
  no cumulative sum over a full row (structural HLO check, with negative controls).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import sample_index
from specdec_jax import verify
from tests._helpers import sample_index_cumsum


def _rows(rng, batch, vocab, dtype):
  rows = rng.random((batch, vocab)) ** 6
  rows[rng.random((batch, vocab)) < 0.3] = 0  # many zeros, also whole zero blocks
  rows[:, -300:] *= rng.random((batch, 1)) < 0.5  # some rows end in a run of zeros
  return (rows / rows.sum(-1, keepdims=True)).astype(dtype)


@pytest.mark.parametrize(("dtype", "min_agreement"), [(np.float32, 0.999), (np.float64, 0.99999)])
def test_two_level_agrees_with_full_cumsum(dtype, min_agreement):
  rng = np.random.default_rng(0)
  vocab, batch, draws_per_row = 5000, 40, 2600  # 104,000 draws
  rows = _rows(rng, batch, vocab, dtype)
  us = rng.random((batch, draws_per_row)).astype(dtype)
  with jax.enable_x64(dtype == np.float64):
    fast = jax.jit(jax.vmap(jax.vmap(sample_index, in_axes=(None, 0))))(rows, us)
    slow = jax.jit(jax.vmap(jax.vmap(sample_index_cumsum, in_axes=(None, 0))))(rows, us)
    fast, slow = np.asarray(fast), np.asarray(slow)
  assert fast.size >= 100_000
  agreement = np.mean(fast == slow)
  assert agreement >= min_agreement, agreement
  # Never out of range, never a zero-probability id.
  assert fast.min() >= 0 and fast.max() < vocab
  assert np.all(np.take_along_axis(rows, fast, axis=1) > 0)
  # Where they differ, the draw sits at an interval boundary within float rounding.
  cdf = np.cumsum(rows.astype(np.float64), axis=1)
  for b, k in zip(*np.nonzero(fast != slow), strict=True):
    u = float(us[b, k])
    i, j = sorted((int(fast[b, k]), int(slow[b, k])))
    boundary = cdf[b, i:j].astype(np.float64)
    assert np.min(np.abs(boundary - u)) < 1e-4 * (1 if dtype == np.float32 else 1e-6)


def test_two_level_on_a_row_shorter_than_a_block_and_not_a_multiple():
  rng = np.random.default_rng(1)
  for vocab in (1, 2, 255, 256, 257, 1000, 32_001):
    row = rng.random(vocab).astype(np.float32)
    row /= row.sum()
    us = rng.random(2000).astype(np.float32)
    fast = np.asarray(jax.vmap(sample_index, in_axes=(None, 0))(row, us))
    slow = np.asarray(jax.vmap(sample_index_cumsum, in_axes=(None, 0))(row, us))
    assert np.mean(fast == slow) > 0.995, vocab


# --- structure of the compiled program -----------------------------------------------------------

B, GAMMA, V = 4, 3, 4096


def _largest_intermediate(hlo: str) -> int:
  """Largest element count of any array an instruction in compiled HLO computes.

  Parameters and instructions that only alias buffers (tuples, loop state) are skipped.
  """
  largest = 0
  aliases = ("parameter(", "get-tuple-element(", " tuple(", " while(", " bitcast(",
             " conditional(", " call(")
  for line in hlo.splitlines():
    # Computation headers and instructions that only alias existing buffers don't count.
    if "=" not in line or ") -> " in line or any(a in line for a in aliases):
      continue
    shape = line.split("=", 1)[1].strip().split(" ", 1)[0]
    for dims in re.findall(r"\w\d+\[([\d,]*)\]", shape):
      largest = max(largest, int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
  return largest


def _has_full_row_scan(stablehlo: str) -> bool:
  """A cumulative sum over >= V elements: a reduce_window that long, before XLA rewrites it."""
  for dims in re.findall(r"window_dimensions = array<i64: ([\d, ]+)>", stablehlo):
    if any(int(d) >= V for d in dims.split(",")):
      return True
  return False


def _compile(fn) -> tuple[str, str]:
  """(compiled HLO, StableHLO) of ``fn`` on a batch of B sequences."""
  p = jnp.full((B, GAMMA + 1, V), 1.0 / V)
  q = jnp.full((B, GAMMA, V), 1.0 / V)
  draft = jnp.zeros((B, GAMMA), jnp.int32)
  u = jnp.full((B, GAMMA + 1), 0.5)
  lowered = jax.jit(fn).lower(p, q, draft, u)
  return lowered.compile().as_text(), lowered.as_text()


def test_verify_forms_no_residual_over_all_positions_and_no_full_cumsum():
  hlo, stablehlo = _compile(jax.vmap(verify))
  # Per sequence at most ~two rows' worth (the stop row of p and of q) is ever formed.
  assert _largest_intermediate(hlo) <= B * 2 * V
  assert not _has_full_row_scan(stablehlo)


def test_negative_control_eager_residuals_and_full_cumsum_are_caught():
  def eager(p, q, _draft, uniforms):
    residual = jnp.maximum(p[:, :GAMMA] - q, 0)  # (B, gamma, V): what we never build
    cdf = jnp.cumsum(residual, axis=-1)
    hit = uniforms[:, :GAMMA, None] * cdf[..., -1:] < cdf
    return jnp.argmax(hit, axis=-1)

  hlo, stablehlo = _compile(eager)
  assert _largest_intermediate(hlo) >= B * GAMMA * V
  assert _has_full_row_scan(stablehlo)
  # ... and the straightforward sampler's full-row cumsum is caught too.
  _, stablehlo = _compile(jax.vmap(lambda p, _q, _d, u: sample_index_cumsum(p[0], u[0])))
  assert _has_full_row_scan(stablehlo)
