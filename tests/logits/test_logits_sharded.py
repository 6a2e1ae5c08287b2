"""Vocabulary-parallel logits processing: ``process_rows(..., axis_name=...)`` inside
``jax.shard_map`` is this device's slice of the unsharded result, and only scalars cross devices.

The unsharded ``process_rows`` is the reference: kept sets (``probs > 0``) equal exactly, greedy
and broken rows equal, probabilities equal up to the rounding of the normaliser.
"""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from specdec_jax import SamplingParams
from specdec_jax._logits import lazy as lazy
from specdec_jax._logits.lazy import CANDIDATES
from specdec_jax._logits.lazy import LogitStats
from specdec_jax._logits.lazy import logit_stats
from specdec_jax._logits.process import process_rows
from specdec_jax._logits.threshold import WAYS
from specdec_jax._logits.threshold import first_true
from tests._helpers import largest_collective

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

REFERENCE = jax.jit(process_rows)


@functools.cache
def _mesh(n: int) -> jax.sharding.Mesh:
  return jax.make_mesh((n,), ("model",), axis_types=(AxisType.Auto,))


@functools.cache
def sharded(n: int):
  """``process_rows`` with the vocabulary split over ``n`` devices (parameters replicated)."""
  fn = jax.shard_map(lambda x, params: process_rows(x, params, axis_name="model"),
                     mesh=_mesh(n), in_specs=(P(None, "model"), P()),
                     out_specs=P(None, "model"))
  return jax.jit(fn)


def params_of(temperature, top_k, top_p) -> SamplingParams:
  """Per-row parameters as arrays (one compilation per shape); ``None`` drops the step."""
  return SamplingParams(jnp.asarray(temperature, jnp.float32),
                        None if top_k is None else jnp.asarray(top_k, jnp.int32),
                        None if top_p is None else jnp.asarray(top_p, jnp.float32))


def check(logits, params: SamplingParams, n: int) -> np.ndarray:
  """Sharded against unsharded: NaN rows, kept sets and greedy rows exact, probs close."""
  got = np.asarray(sharded(n)(logits, params))
  want = np.asarray(REFERENCE(logits, params))
  nan = np.isnan(want).all(axis=1)
  np.testing.assert_array_equal(np.isnan(got).any(axis=1), nan)
  assert np.isnan(got[nan]).all()
  np.testing.assert_array_equal(got[~nan] > 0, want[~nan] > 0)
  np.testing.assert_allclose(got[~nan], want[~nan], rtol=1e-5, atol=1e-7)
  greedy = ~nan & (np.asarray(params.temperature) == 0)
  np.testing.assert_array_equal(got[greedy], want[greedy])  # exact one-hot rows
  return got


def zipf(rng: np.random.Generator, vocab: int, s: float = 1.1) -> np.ndarray:
  """A peaked row: logit ``-s log(rank)`` at a random permutation of the ids."""
  return (-s * np.log(np.arange(1, vocab + 1)))[rng.permutation(vocab)]


def edge_rows(vocab: int, seed: int = 0):
  """``(logits (R, V) float32, temperature, top_k, top_p)``: ties within and across devices and
  across 256-entry blocks, ``-inf`` entries, broken rows, peaked and flat rows, mixed params."""
  rng = np.random.default_rng(seed)
  b = vocab // 8  # a device boundary for 2, 4 and 8 devices
  rows = []

  def add(x, t=1.0, k=0, p=1.0):
    rows.append((np.asarray(x, np.float32), t, k, p))

  equal = np.zeros(vocab)
  cuts = sorted({1, 255, 256, 257, 258, b - 1, b + 1, vocab // 2 - 1, vocab // 2 + 1,
                 3 * b + 256, 3 * b + 257, vocab - 1})
  for c in cuts:  # every cut of an all-equal row: top-k, and top-p keeping c entries
    add(equal, k=c)
    add(equal, t=0.8, p=(c - 0.5) / vocab)
  add(equal, t=0.0)  # greedy at id 0
  add(equal, k=vocab + 5, p=1.0)  # top_k >= V keeps all
  add(equal, k=vocab)
  small = rng.integers(0, 3, vocab).astype(np.float64)  # values from a small set
  add(small, k=vocab // 3)
  add(small, t=0.7, p=0.37)
  add(small, t=1.3, k=vocab // 5, p=0.81)
  add(small, t=2.0, k=1)
  add(np.floor(rng.normal(size=vocab) * 2), t=0.5, k=b + 3, p=0.93)
  straddle = rng.normal(size=vocab) * 0.1 - 5
  for lo, hi in ((b - 7, b + 7), (2 * b - 3, 2 * b + 3), (vocab // 2 - 5, vocab // 2 + 5)):
    straddle[lo:hi] = 3.0  # top ties across device boundaries
  for k in (3, 9, 16, 20, 25, 30):
    add(straddle, k=k)
  add(straddle, p=0.5)
  add(straddle, t=0.3, k=12, p=0.7)
  add(straddle, t=0.0)  # greedy: the first tie, b - 7
  tied_max = rng.normal(size=vocab)
  tied_max[[vocab // 2 - 1, vocab // 2, vocab - 1]] = 9.0
  add(tied_max, t=0.0)  # greedy tie across the middle boundary: vocab // 2 - 1
  add(tied_max, k=2)
  last = rng.normal(size=vocab)
  last[vocab - 1] = 7.0
  add(last, t=0.0)  # greedy on the last device
  zeros = np.full(vocab, -1.0)
  zeros[b - 1], zeros[b] = -0.0, 0.0  # -0.0 == 0.0: ties
  add(zeros, t=0.0)
  add(zeros, k=1)
  holes = zipf(rng, vocab)
  holes[::3] = -np.inf
  add(holes, k=50, p=0.9)
  add(holes, t=0.0)
  one = np.full(vocab, -np.inf)
  one[vocab - 3] = 2.0
  add(one, k=5, p=0.5)
  add(one, t=0.0)
  add(one)
  add(np.full(vocab, -np.inf))  # no finite logit: NaN
  nan = rng.normal(size=vocab)
  nan[b + 2] = np.nan
  add(nan, t=0.0)  # NaN even greedy
  inf = rng.normal(size=vocab)
  inf[vocab - 2] = np.inf
  add(inf, k=4)
  add(zipf(rng, vocab), p=0.9)
  add(zipf(rng, vocab, 2.0), t=0.6, k=100, p=0.75)
  add(zipf(rng, vocab), t=0.0, k=3, p=0.5)  # greedy with top-k / top-p set
  flat = rng.normal(size=vocab) * 1e-3
  add(flat, k=1)
  add(flat, t=2.0, k=vocab + 1)
  add(flat, k=vocab, p=0.999)
  add(rng.normal(size=vocab), t=0.5)  # temperature only
  add(rng.normal(size=vocab) * 3, t=1e-3, p=0.3)
  x, t, k, p = zip(*rows, strict=True)
  return np.stack(x), np.array(t), np.array(k), np.array(p)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_sharded_rows_equal_the_unsharded_slices(n):
  x, t, k, p = edge_rows(8 * 300)  # V_local = 1200, 600, 300: all past one 256-entry block
  got = check(jnp.asarray(x), params_of(t, k, p), n)
  assert got.shape == x.shape


def test_uneven_blocks_and_bfloat16():
  x, t, k, p = edge_rows(2 * 257)  # V_local = 257: one entry past the first block
  check(jnp.asarray(x), params_of(t, k, p), 2)
  x, t, k, p = edge_rows(8 * 300, seed=1)
  check(jnp.asarray(x, jnp.bfloat16), params_of(t, k, p), 4)


def test_steps_removed_at_trace_time():
  x, t, k, p = edge_rows(8 * 300, seed=2)
  logits = jnp.asarray(x)
  check(logits, params_of(t, None, None), 8)
  check(logits, params_of(t, k, None), 4)
  check(logits, params_of(t, None, p), 2)


@functools.cache
def _first_true_sharded(n: int):
  row = functools.partial(first_true, axis_name="model")
  return jax.jit(jax.shard_map(jax.vmap(row), mesh=_mesh(n), in_specs=(P(None, "model"), P()),
                               out_specs=P(None, "model")))


@pytest.mark.parametrize(("n", "vocab"), [(2, 2 * 257), (8, 8 * 300)])
def test_first_true_counts_ties_on_lower_devices(n, vocab):
  rng = np.random.default_rng(vocab)
  masks, counts = [], []
  for density in (0.0, 0.05, 0.5, 1.0):
    for _ in range(4):
      mask = rng.random(vocab) < density
      total = int(mask.sum())
      for c in (-1, 0, 1, 2, 255, 256, 257, total // 2, total - 1, total, total + 1):
        masks.append(mask)
        counts.append(c)
  masks, counts = np.stack(masks), np.asarray(counts, np.int32)
  want = masks & ((np.cumsum(masks, axis=1) - masks) < counts[:, None])
  got = np.asarray(_first_true_sharded(n)(jnp.asarray(masks), jnp.asarray(counts)))
  np.testing.assert_array_equal(got, want)


HYPO_VOCAB = 8 * 70  # V_local = 280 on 2 devices, 70 on 8


@settings(max_examples=30, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1), levels=st.integers(1, 5), n=st.sampled_from([2, 8]),
       holes=st.sampled_from([0.0, 0.1, 0.9]),
       temperature=st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=8, max_size=8),
       top_k=st.lists(st.integers(0, HYPO_VOCAB + 2), min_size=8, max_size=8),
       top_p=st.lists(st.sampled_from([0.05, 0.37, 0.61, 0.93, 1.0]), min_size=8, max_size=8))
def test_random_tied_rows(seed, levels, n, holes, temperature, top_k, top_p):
  rng = np.random.default_rng(seed)
  x = rng.integers(0, levels, (8, HYPO_VOCAB)).astype(np.float32) * rng.uniform(0.1, 3.0)
  x[rng.random(x.shape) < holes] = -np.inf
  x[0, rng.integers(HYPO_VOCAB)] = 0.0  # at least one finite logit in the first row
  check(jnp.asarray(x), params_of(temperature, top_k, top_p), n)


def test_only_scalars_per_row_cross_devices():
  """Structural check: no collective carries a vocabulary slice (V_local = 1000 here)."""
  n, rows, vocab = 8, 4, 8 * 1000
  params = params_of(np.ones(rows), np.full(rows, 5), np.full(rows, 0.9))
  text = sharded(n).lower(jnp.zeros((rows, vocab)), params).compile().as_text()
  assert largest_collective(text) <= rows * max(n, WAYS)
  assert largest_collective(text) < vocab // n


# --- the lazy statistics (what the verifiers read from sharded logits) -----------------------


@functools.cache
def sharded_stats(n: int):
  """``logit_stats`` with the vocabulary split over ``n`` devices: per-row statistics, the same
  on every device (``out_specs=P()`` fails to trace if any of them is not)."""
  fn = jax.shard_map(lambda x, params: logit_stats(x, params, axis_name="model"),
                     mesh=_mesh(n), in_specs=(P(None, "model"), P()), out_specs=P())
  return jax.jit(fn)


def check_stats(logits, params: SamplingParams, n: int) -> LogitStats:
  """Sharded statistics against unsharded ones: kept sets (``t``, ``cut``), maxima, argmax and
  flags exactly, the normaliser up to the order of its summation."""
  got = sharded_stats(n)(logits, params)
  want = jax.jit(logit_stats)(logits, params)
  ok = ~np.asarray(want.broken)
  np.testing.assert_array_equal(np.asarray(got.broken), ~ok)
  for field in ("top", "scale", "cut_value", "cut_id", "argmax", "greedy"):
    np.testing.assert_array_equal(np.asarray(getattr(got, field))[ok],
                                  np.asarray(getattr(want, field))[ok], err_msg=field)
  sampled = ok & ~np.asarray(want.greedy)
  np.testing.assert_allclose(np.asarray(got.norm)[sampled], np.asarray(want.norm)[sampled],
                             rtol=1e-5)
  return got


@pytest.mark.parametrize(("n", "vocab"), [(2, 2 * 257), (4, 8 * 300), (8, 8 * 300), (8, 8 * 40)])
def test_sharded_statistics_equal_the_unsharded_ones(n, vocab):
  """Rows the shards' candidates settle and rows they do not (``top_k`` above
  ``CANDIDATES``, flat rows whose nucleus is wider, ties across device boundaries, every cut of
  an all-equal row), ``-inf`` and broken rows; ``V / n = 40`` is below ``CANDIDATES``."""
  x, t, k, p = edge_rows(vocab)
  assert (k > CANDIDATES).any() and ((k > 0) & (k <= CANDIDATES)).any()
  check_stats(jnp.asarray(x), params_of(t, k, p), n)
  check_stats(jnp.asarray(x), params_of(t, None, p), n)
  check_stats(jnp.asarray(x, jnp.bfloat16), params_of(t, k, None), n)


def test_sharded_candidates_settle_lm_rows_without_bisecting():
  """Peaked rows with LM-like top-k / top-p are settled by the gathered candidates: the result
  is the same with the bisection made to return garbage (so the fallback was not taken), and
  a row the candidates cannot settle (top-k above them) does change (negative control)."""
  rng = np.random.default_rng(3)
  vocab, rows = 8 * 500, 6
  x = jnp.asarray(np.stack([zipf(rng, vocab, 1.3) * 4 for _ in range(rows)]), jnp.float32)
  params = params_of(np.full(rows, 0.8), [0, 20, 40, 0, 50, 8], [0.9, 1.0, 0.8, 0.5, 0.95, 1.0])
  want = check_stats(x, params, 8)
  wide = params._replace(top_k=jnp.asarray([0, 20, 40, 0, 50, CANDIDATES + 100], jnp.int32))

  def garbage(*_args, **_kwargs):
    return jnp.float32(0), jnp.int32(0), jnp.float32(1)

  with mock.patch.object(lazy, "bisected_row", garbage):
    sharded_stats.cache_clear()
    try:
      got = sharded_stats(8)(x, params)
      changed = sharded_stats(8)(x, wide)
    finally:
      sharded_stats.cache_clear()
  np.testing.assert_array_equal(np.asarray(got.cut_id), np.asarray(want.cut_id))
  np.testing.assert_array_equal(np.asarray(got.norm), np.asarray(want.norm))
  assert np.asarray(changed.cut_id)[-1] == 0  # the garbage of the fallback
