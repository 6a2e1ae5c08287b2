"""The sort-free top-k / top-p of ``process_logits`` against the stable-sort version it replaced."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

import specdec_jax._logits.threshold as threshold
from specdec_jax import SamplingParams
from specdec_jax import process_logits
from specdec_jax._logits.threshold import first_true
from specdec_jax._logits.threshold import order_key
from specdec_jax._logits.threshold import top_k_mask
from specdec_jax._logits.threshold import top_p_mask
from specdec_jax._logits.transform import process_row
from tests._baselines import sorted_process_row

TINY = float(np.finfo(np.float32).tiny)


def batched(row_fn):
  """``jit(vmap(row_fn))`` with per-row temperature, top_k and top_p."""
  return jax.jit(jax.vmap(lambda x, t, k, p: row_fn(x, SamplingParams(t, k, p))))


OLD, NEW = batched(sorted_process_row), batched(process_row)


def near_top_p(logits, temperature, top_k, top_p):
  """Tokens whose exact (float64) preceding mass is within rounding of ``top_p``: the only
  ones on which summing in sorted order and summing by level may round to different sides."""
  x = np.asarray(logits, np.float64)
  tol = max(1e-5, 4 * len(x) * 2.0**-24)
  finite = np.isfinite(x)
  if not temperature > 0 or not finite.any() or np.isnan(x).any() or (x == np.inf).any():
    return np.zeros(len(x), bool)
  z = np.where(finite, (x - x[finite].max()) / temperature, -np.inf)
  order = np.argsort(-z, kind="stable")
  if top_k > 0:
    z[order[top_k:]] = -np.inf
  p = np.exp(z - z.max())
  p /= p.sum()
  before = np.zeros(len(x))
  before[order] = np.cumsum(p[order]) - p[order]
  return (np.abs(before - top_p) <= tol) & (top_p < 1)


def assert_same(logits, temperature, top_k, top_p):
  """New equals old: the same support exactly and the same probabilities (``1e-6``), except
  that on a row with a token within rounding of ``top_p`` only that token may differ."""
  args = (logits, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
          jnp.asarray(top_p, jnp.float32))
  old, new = np.asarray(OLD(*args)), np.asarray(NEW(*args))
  rows = np.asarray(logits.astype(jnp.float32))
  for b in range(len(rows)):
    near = near_top_p(rows[b], temperature[b], top_k[b], top_p[b])
    where = f"row {rows[b]}, T={temperature[b]}, k={top_k[b]}, p={top_p[b]}"
    differ = (old[b] > 0) != (new[b] > 0)
    if differ.any():  # only on a token within rounding of top_p
      assert not np.any(differ & ~near), where
      assert abs(new[b].sum() - 1) < 1e-5, where
    else:
      np.testing.assert_allclose(new[b], old[b], rtol=1e-6, atol=1e-6, err_msg=where)


BATCH = 6


@st.composite
def rows(draw):
  """A batch of rows with many ties (small integer logits), ``-inf`` entries and equal rows."""
  vocab = draw(st.sampled_from([1, 2, 3, 5, 8, 13, 40]))
  dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  x = rng.integers(-3, 4, size=(BATCH, vocab)).astype(np.float32)
  kind = rng.integers(0, 4, size=BATCH)
  x[kind == 1] = rng.integers(-2, 3)  # all equal
  x[kind == 2] *= np.float32(rng.choice([0.3, 1.7, 11.0]))  # non-integer spacing
  x[(rng.random((BATCH, vocab)) < 0.25) & (kind[:, None] != 1)] = -np.inf
  x[kind == 3, rng.integers(0, vocab)] = rng.integers(-2, 3)  # at least one finite entry
  if draw(st.booleans()):
    x[rng.integers(0, BATCH)] = -np.inf  # a broken row: NaN on both sides
  temperature = rng.choice([0.0, 0.5, 1.0, 2.0], size=BATCH)
  top_k = np.array([draw(st.sampled_from([0, 1, 2, vocab - 1, vocab, vocab + 3]))
                    for _ in range(BATCH)])
  top_p = np.array([draw(st.one_of(st.sampled_from([TINY, 1e-6, 0.25, 0.5, 0.75, 1.0]),
                                   st.floats(2.0**-20, 1.0, width=32))) for _ in range(BATCH)])
  return jnp.asarray(x, dtype), temperature, np.maximum(top_k, 0), top_p


@settings(derandomize=True, max_examples=60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(batch=rows())
def test_threshold_matches_the_sorted_version(batch):
  logits, temperature, top_k, top_p = batch
  assert_same(logits, temperature, top_k, top_p)


@pytest.mark.parametrize("vocab", [257, 700, 1024])
def test_ties_across_blocks(vocab):
  """Rows longer than ``threshold.BLOCK`` with long runs of ties cut at every ``k``."""
  rng = np.random.default_rng(vocab)
  x = rng.integers(-2, 1, size=(8, vocab)).astype(np.float32)
  x[1] = 0
  x[2, ::3] = -np.inf
  temperature = np.array([1.0, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 0.0])
  top_k = np.array([vocab // 2, vocab - 5, 300, 0, 257, 1, vocab, 3])
  top_p = np.array([0.3, 0.61, 0.9, 0.99, 1.0, 0.5, 0.45, 0.9])
  assert_same(jnp.asarray(x), temperature, top_k, top_p)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 512])
def test_exact_boundaries_with_power_of_two_masses(n):
  """``m`` tied survivors (a power of two) of mass ``1/m`` each: every sum is exact, so with
  ``top_p = i/m`` exactly ``i`` survive (the token whose preceding mass equals ``top_p`` is
  dropped) on both sides and the probabilities agree bit for bit."""
  vocab = 2 * n + 3
  x = np.full(vocab, -np.inf, np.float32)
  x[1::2][:n] = 0.0
  x[2] = -1.0  # the lowest survivor of top-k = 0, cut by every top-k below n + 1
  cases = [(m, i / m) for m in 2 ** np.arange(n.bit_length()) for i in range(1, m + 1)]
  top_k = np.array([k for k, _ in cases])
  top_p = np.array([q for _, q in cases])
  logits = jnp.asarray(np.tile(x, (len(cases), 1)))
  args = (logits, jnp.ones(len(cases), jnp.float32), jnp.asarray(top_k, jnp.int32),
          jnp.asarray(top_p, jnp.float32))
  old, new = np.asarray(OLD(*args)), np.asarray(NEW(*args))
  assert np.array_equal(old, new)
  survivors = np.sum(new > 0, axis=1)
  assert survivors.tolist() == [round(q * k) for k, q in cases]
  assert np.all(new.max(axis=1) == np.float32(1) / survivors.astype(np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("params", [SamplingParams(0.8, top_k=3), SamplingParams(0.8, top_p=0.6),
                                    SamplingParams(1.0, 0, 1.0), SamplingParams(0.0, 2, 0.5),
                                    SamplingParams(1.3, 40, 0.07)])
def test_process_logits_agrees_for_scalar_params_and_none(dtype, params):
  rng = np.random.default_rng(3)
  logits = jnp.asarray(rng.integers(-4, 4, size=(5, 33)).astype(np.float32), dtype)
  old = jax.vmap(sorted_process_row, in_axes=(0, None))(logits, params)
  np.testing.assert_array_equal(np.asarray(process_logits(logits, params) > 0),
                                np.asarray(old > 0))
  np.testing.assert_allclose(np.asarray(process_logits(logits, params)), np.asarray(old),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ways", [4, 16])
def test_wider_passes_give_the_same_masks(monkeypatch, ways):
  monkeypatch.setattr(threshold, "WAYS", ways)
  rng = np.random.default_rng(ways)
  x = rng.integers(-3, 4, size=(4, 300)).astype(np.float32)
  x[0, ::2] = -np.inf
  args = (jnp.asarray(x), jnp.ones(4, jnp.float32), jnp.asarray([0, 7, 150, 299], jnp.int32),
          jnp.asarray([0.5, 1.0, 0.9, 0.2], jnp.float32))
  new = batched(process_row)(*args)  # traced after the patch
  np.testing.assert_allclose(np.asarray(new), np.asarray(OLD(*args)), rtol=1e-6, atol=1e-6)


def test_float64_under_x64():
  with jax.enable_x64(True):
    rng = np.random.default_rng(5)
    z = jnp.asarray(rng.integers(-3, 1, size=50).astype(np.float64))
    z = z.at[4].set(-jnp.inf)
    for k in (0, 1, 9, 30, 50):
      mask = np.asarray(top_k_mask(z, k))
      order = np.argsort(-np.asarray(z), kind="stable")
      want = np.zeros(50, bool)
      want[order[:k or 50]] = True
      assert np.array_equal(mask, want), k
    probs = jax.nn.softmax(z)
    keep = np.asarray(top_p_mask(z, probs, 0.5))
    p = np.asarray(probs)[order]
    want = np.zeros(50, bool)
    want[order] = (np.cumsum(p) - p) < 0.5
    assert np.array_equal(keep, want)


def test_order_key_is_monotone():
  values = np.array([-np.inf, -3e38, -1.0, -1e-30, -0.0, 0.0, 1e-30, 2.5, 3e38, np.inf],
                    np.float32)
  keys = np.asarray(order_key(jnp.asarray(values))).astype(np.int64)
  assert np.all(np.diff(keys[:5]) > 0)
  assert keys[4] == keys[5]  # -0.0 == 0.0
  assert np.all(np.diff(keys[5:]) > 0)


@pytest.mark.parametrize("vocab", [1, 5, 255, 256, 257, 600])
def test_first_true_matches_a_prefix_count(vocab):
  rng = np.random.default_rng(vocab)
  for density in (0.0, 0.1, 0.5, 1.0):
    mask = rng.random(vocab) < density
    for n in (-1, 0, 1, 2, int(mask.sum()) // 2, int(mask.sum()), int(mask.sum()) + 1):
      want = mask & ((np.cumsum(mask) - mask) < n)
      assert np.array_equal(np.asarray(first_true(jnp.asarray(mask), jnp.int32(n))), want)


def test_no_sort_in_the_jaxpr():
  sort = re.compile(r"(?<!\w)sort\[")  # the primitive, not `indices_are_sorted`
  logits = jnp.zeros(64, jnp.float32)
  params = SamplingParams(0.7, top_k=jnp.int32(5), top_p=jnp.float32(0.9))
  assert not sort.search(str(jax.make_jaxpr(lambda x: process_logits(x, params))(logits)))
  args = (jnp.zeros((3, 64), jnp.bfloat16), jnp.ones(3), jnp.ones(3, jnp.int32), jnp.ones(3))
  assert not sort.search(str(jax.make_jaxpr(NEW)(*args)))
  assert sort.search(str(jax.make_jaxpr(OLD)(*args)))  # the pattern does find a sort
