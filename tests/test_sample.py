"""The inverse-CDF sampler: one draw, SPEC semantics, frequencies, edge rows.

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
