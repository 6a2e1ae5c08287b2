"""The inverse-CDF sampler: one draw, the smallest ``k`` with ``u < cumsum(probs)[k]``,
frequencies, edge rows.

Chi-square tests use alpha = 1e-3 each (Bonferroni over the 6 rows below: family-wise 0.6%).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import UniformStream
from specdec_jax import reference
from specdec_jax import sample
from specdec_jax import sample_index
from tests._helpers import assert_same_distribution

ROWS = {
  "worked_bonus": [0.3, 0.3, 0.4],
  "last_only": [0.0, 0.0, 1.0],
  "first_only": [1.0, 0.0, 0.0],
  "middle_zeros": [0.25, 0.0, 0.0, 0.5, 0.0, 0.25],
  "single": [1.0],
  "skewed": [0.001, 0.009, 0.09, 0.9],
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_frequencies_match_probabilities(name):
  row = np.asarray(ROWS[name], np.float32)
  u = jax.random.uniform(jax.random.key(0), (200_000,), jnp.float32)
  samples = jax.jit(jax.vmap(sample_index, in_axes=(None, 0)))(jnp.asarray(row), u)
  samples = np.asarray(samples)
  assert samples.dtype == np.int32
  assert_same_distribution(samples, row, 1e-3, name)


def test_negative_control_a_shifted_sampler_fails():
  row = np.asarray(ROWS["worked_bonus"], np.float32)
  u = np.asarray(jax.random.uniform(jax.random.key(0), (200_000,), jnp.float32))
  right = np.searchsorted(np.cumsum(row), u, side="right")
  assert_same_distribution(right, row, 1e-3, "numpy inverse CDF")  # the harness accepts this
  wrong = right + (u < 0.01)  # moves 1% of the mass from token 0 to token 1
  with pytest.raises(AssertionError, match="chi-square"):
    assert_same_distribution(wrong, row, 1e-3, "shifted")


def test_host_sample_draws_exactly_once_and_matches_reference():
  rng = np.random.default_rng(1)
  for _ in range(300):
    vocab = int(rng.integers(1, 40))
    row = rng.dirichlet(np.full(vocab, 0.3))
    row[rng.random(vocab) < 0.3] = 0
    if row.sum() == 0:
      row[0] = 1
    row /= row.sum()
    u = rng.random(3)
    ours, theirs = UniformStream(u), UniformStream(u)
    assert sample(row, ours) == reference.sample(row, theirs)
    assert ours.position == theirs.position == 1


def test_boundaries_follow_smallest_k_with_u_below_cumsum():
  row = [0.25, 0.25, 0.5]
  cases = {0.0: 0, 0.2499: 0, 0.25: 1, 0.4999: 1, 0.5: 2, 0.99: 2}
  for u, want in cases.items():
    assert sample(row, UniformStream([u])) == want, u
    assert reference.sample(row, UniformStream([u])) == want, u


def test_zero_probability_ids_are_never_returned():
  row = jnp.asarray([0.0, 0.5, 0.0, 0.5, 0.0], jnp.float32)
  u = jnp.linspace(0, 1, 10_001, endpoint=False, dtype=jnp.float32)
  got = np.asarray(jax.vmap(sample_index, in_axes=(None, 0))(row, u))
  assert set(got.tolist()) == {1, 3}


def test_unnormalised_weights_scale_u_by_the_total():
  w = jnp.asarray([2.0, 0.0, 6.0], jnp.float32)
  assert int(sample_index(w, jnp.float32(0.24))) == 0
  assert int(sample_index(w, jnp.float32(0.26))) == 2


def test_all_zero_or_nan_weights_stay_in_range():
  for w in ([0.0, 0.0, 0.0], [np.nan, np.nan, np.nan], [-1.0, 0.0, -2.0]):
    k = int(sample_index(jnp.asarray(w, jnp.float32), jnp.float32(0.5)))
    assert 0 <= k < 3
  assert int(sample_index(jnp.asarray([np.nan, 0.5, -1.0], jnp.float32), jnp.float32(0.9))) == 1


ONE_MINUS = np.float32(1) - np.float32(2 ** -24)  # the largest float32 below 1


def _zero_tail_rows(vocab: int, tail: int, rows: int, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  w = rng.random((rows, vocab)).astype(np.float32)
  w[:, vocab - tail :] = 0
  return (w / w.sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)


@pytest.mark.parametrize(("vocab", "tail"), [(4, 2), (300, 10), (300, 100), (1000, 100),
                                             (4097, 1), (4097, 1000), (5000, 2000)])
def test_uniforms_just_below_one_never_give_a_zero_tail_id(vocab, tail):
  """Rounding of the block masses, their prefix and the in-block sums can put ``u * total`` at
  or past the last partial sum, or on a zero-weight entry: the hit must be snapped back to a
  positive weight (the last one), never land in the zero tail or at ``V``."""
  rows = _zero_tail_rows(vocab, tail, 64, seed=vocab + tail)
  near_one = ONE_MINUS - np.arange(64, dtype=np.float32) * np.float32(2 ** -24)
  us = jnp.asarray(np.concatenate([near_one, np.linspace(0, 1, 64, endpoint=False,
                                                         dtype=np.float32)]))
  sampler = jax.jit(jax.vmap(jax.vmap(sample_index, in_axes=(None, 0)), in_axes=(0, None)))
  got = np.asarray(sampler(jnp.asarray(rows), us))
  assert got.min() >= 0 and got.max() < vocab - tail
  assert np.all(rows[np.arange(len(rows))[:, None], got] > 0)
  # The largest uniforms give the last positive id (u * total past every partial sum) or one
  # just before it.
  assert np.all(got[:, 0] >= vocab - tail - 8)


@pytest.mark.parametrize("row", [[0.5, 0.5, 0, 0], [0.75, 0.75, 0, 0], [0.3, 0.3, 0.4, 0, 0]])
def test_largest_uniform_below_one_on_a_zero_tail_row(row):
  w = jnp.asarray(row, jnp.float32)
  last_positive = max(i for i, v in enumerate(row) if v > 0)
  assert int(sample_index(w, jnp.float32(ONE_MINUS))) == last_positive


def test_uniform_at_or_past_one_gives_the_last_positive_id():
  """Out-of-range uniforms (flagged by the verifiers) are read as "past the total"."""
  w = jnp.asarray([0.0, 0.3, 0.3, 0.4, 0.0, 0.0], jnp.float32)
  for u in (1.0, 1.5, np.inf):
    assert int(sample_index(w, jnp.float32(u))) == 3, u
  for vocab in (300, 5000):  # multi-block rows: the last positive block, its last positive id
    row = _zero_tail_rows(vocab, vocab // 3, 1, seed=vocab)[0]
    want = int(np.nonzero(row > 0)[0][-1])
    assert int(sample_index(jnp.asarray(row), jnp.float32(1.0))) == want


def test_nan_and_negative_weights_count_as_zero():
  """Not just kept out of the result: they must not shift the other tokens' intervals."""
  w = jnp.asarray([0.5, np.nan, 0.5], jnp.float32)
  assert [int(sample_index(w, jnp.float32(u))) for u in (0.1, 0.4, 0.6, 0.9)] == [0, 0, 2, 2]
  w = jnp.asarray([0.5, -0.25, 0.5], jnp.float32)  # a total of 0.75 would move the boundary
  assert [int(sample_index(w, jnp.float32(u))) for u in (0.3, 0.45, 0.55, 0.9)] == [0, 0, 2, 2]
