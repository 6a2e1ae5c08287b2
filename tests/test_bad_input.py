"""Bad input gives a clear error naming the argument, what was expected and what was received."""

import random

import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import UniformStream
from specdec_jax import sample
from specdec_jax import speculative_step
from specdec_jax import verify
from tests._helpers import P_EXAMPLE
from tests._helpers import Q_EXAMPLE


class _BadRng:
  def __init__(self, value):
    self.value = value

  def random(self):
    return self.value


RNG = np.random.default_rng(0)


@pytest.mark.parametrize(
  ("p", "q", "draft", "error", "match"),
  [
    (P_EXAMPLE[0], Q_EXAMPLE, [1, 2], ValueError, r"`p` must have rank 2, got shape \(3,\)"),
    (P_EXAMPLE, Q_EXAMPLE[0], [1, 2], ValueError, r"`q` must have rank 2"),
    (P_EXAMPLE[:2], Q_EXAMPLE, [1, 2], ValueError,
     r"`p` must have shape \(gamma \+ 1, V\) = \(3, 3\).*got \(2, 3\)"),
    (P_EXAMPLE, Q_EXAMPLE[:1], [1, 2], ValueError,
     r"`q` must have shape \(gamma, V\) = \(2, 3\).*got \(1, 3\)"),
    (P_EXAMPLE, Q_EXAMPLE[:, :2], [1, 2], ValueError, r"`q` must have shape"),
    (P_EXAMPLE, Q_EXAMPLE, [[1, 2]], ValueError, r"`draft` must have shape \(gamma,\)"),
    (P_EXAMPLE, Q_EXAMPLE, [1.0, 2.0], TypeError, r"`draft` must hold integer token ids.*float64"),
    (P_EXAMPLE, Q_EXAMPLE, [1, 3], ValueError,
     r"`draft` ids must be in \[0, V\) = \[0, 3\), got 3"),
    (P_EXAMPLE, Q_EXAMPLE, [-1, 2], ValueError, r"got -1 at position 0"),
    ([["a", "b", "c"]] * 3, Q_EXAMPLE, [1, 2], TypeError, r"`p` must hold real floating-point"),
    (P_EXAMPLE, Q_EXAMPLE, [1, 2, 0], ValueError, r"`p` must have shape"),
  ],
)
def test_speculative_step_shapes_and_types(p, q, draft, error, match):
  with pytest.raises(error, match=match):
    speculative_step(p, q, draft, RNG)


@pytest.mark.parametrize(
  ("name", "row", "col", "value", "match"),
  [
    ("p", 0, 1, np.nan, r"`p` must be finite, got nan at index \(0, 1\)"),
    ("q", 1, 0, np.inf, r"`q` must be finite"),
    ("p", 2, 0, -0.1, r"`p` must be non-negative, got -0.1 at index \(2, 0\)"),
    ("q", 0, 0, 0.6, r"every row of `q` must sum to 1 within .* got a sum of 1.1.*\(row 0\)"),
    ("p", 1, 2, 0.7, r"every row of `p` must sum to 1"),
  ],
)
def test_speculative_step_values(name, row, col, value, match):
  p, q = P_EXAMPLE.copy(), Q_EXAMPLE.copy()
  (p if name == "p" else q)[row, col] = value
  with pytest.raises(ValueError, match=match):
    speculative_step(p, q, [1, 2], RNG)


def test_tolerance_is_dtype_aware():
  p = P_EXAMPLE.copy()
  p[:, 0] += 1e-5  # within float32's sqrt(eps) = 3.5e-4, far outside float64's 1.5e-8
  speculative_step(p.astype(np.float32), Q_EXAMPLE.astype(np.float32), [1, 2], RNG)
  with pytest.raises(ValueError, match=r"within 1.5e-08 \(for float64\)"):
    speculative_step(p, Q_EXAMPLE, [1, 2], RNG)


@pytest.mark.parametrize(
  ("rng", "error", "match"),
  [
    (object(), TypeError, r"`rng` must have a \.random\(\) method.*got object"),
    (_BadRng(1.0), ValueError, r"`rng.random\(\)` must return a float in \[0, 1\), got 1.0"),
    (_BadRng(-0.25), ValueError, r"got -0.25"),
    (_BadRng("0.5"), ValueError, r"got '0.5'"),
    (_BadRng(float("nan")), ValueError, r"got nan"),
  ],
)
def test_bad_rng(rng, error, match):
  with pytest.raises(error, match=match):
    speculative_step(P_EXAMPLE, Q_EXAMPLE, [1, 2], rng)
  with pytest.raises(error, match=match):
    sample([0.5, 0.5], rng)


def test_sample_bad_probs():
  with pytest.raises(ValueError, match=r"`probs` must have rank 1, got shape \(1, 2\)"):
    sample([[0.5, 0.5]], RNG)
  with pytest.raises(ValueError, match=r"`probs` must have at least one entry"):
    sample([], RNG)
  with pytest.raises(ValueError, match=r"`probs` must be non-negative"):
    sample([1.5, -0.5], RNG)
  message = r"`probs` must sum to 1 within 1.5e-08 \(for float64\), got a sum of 0.9\."
  with pytest.raises(ValueError, match=message):
    sample([0.4, 0.5], RNG)


def test_uniform_stream_exhausted_and_shape():
  stream = UniformStream([0.5])
  stream.random()
  with pytest.raises(IndexError, match=r"UniformStream exhausted: all 1 uniforms were used"):
    stream.random()
  with pytest.raises(ValueError, match=r"`uniforms` must be 1-D, got shape \(1, 1\)"):
    UniformStream([[0.5]])
  # An exhausted stream surfaces through the stateful API too.
  with pytest.raises(IndexError, match="exhausted"):
    speculative_step(P_EXAMPLE, Q_EXAMPLE, [1, 2], UniformStream([0.1, 0.1]))


def test_rng_is_not_advanced_before_validation():
  gen = random.Random(3)
  state = gen.getstate()
  with pytest.raises(ValueError):
    speculative_step(P_EXAMPLE, Q_EXAMPLE, [1, 5], gen)
  assert gen.getstate() == state


@pytest.mark.parametrize(
  ("args", "error", "match"),
  [
    ((P_EXAMPLE[None], Q_EXAMPLE, [1, 2], [0.1] * 3), ValueError,
     r"verify: `p` must have rank 2, got shape \(1, 3, 3\).*For a batch, use jax.vmap"),
    ((P_EXAMPLE, Q_EXAMPLE, [1, 2], [0.1] * 2), ValueError,
     r"`uniforms` must have shape \(gamma \+ 1,\) = \(3,\) for gamma = 2, got \(2,\)"),
    ((P_EXAMPLE, Q_EXAMPLE[:1], [1, 2], [0.1] * 3), ValueError, r"`q` must have shape"),
    ((P_EXAMPLE[:, :2], Q_EXAMPLE, [1, 2], [0.1] * 3), ValueError, r"`q` must have shape"),
    ((P_EXAMPLE, Q_EXAMPLE, [1.0, 2.0], [0.1] * 3), TypeError, r"`draft` must have an integer"),
    ((P_EXAMPLE.astype(int), Q_EXAMPLE, [1, 2], [0.1] * 3), TypeError,
     r"`p` must have a floating dtype, got int32"),
  ],
)
def test_verify_trace_time_errors(args, error, match):
  arrays = [jnp.asarray(a) for a in args]
  with pytest.raises(error, match=match):
    verify(*arrays)
