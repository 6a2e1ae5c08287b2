"""The two worked examples of the rule (p and q over three tokens, uniforms 0.7, 0.9, 0.1),
through every entry point, with draw counts."""

import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax
from specdec_jax import UniformStream
from specdec_jax import reference
from specdec_jax import speculative_step
from specdec_jax import verify
from tests._helpers import P_EXAMPLE
from tests._helpers import Q_EXAMPLE
from tests._helpers import U_EXAMPLE

CASES = [
  # draft, expected tokens, expected draws
  ([1, 2], [1, 2, 0], 3),
  ([0, 2], [2], 2),
]


@pytest.mark.parametrize(("draft", "tokens", "draws"), CASES)
@pytest.mark.parametrize("impl", ["speculative_step", "reference"])
def test_stateful_entry_points(impl, draft, tokens, draws):
  step = speculative_step if impl == "speculative_step" else reference.speculative_step
  stream = UniformStream(U_EXAMPLE)
  assert step(P_EXAMPLE.tolist(), Q_EXAMPLE.tolist(), draft, stream) == tokens
  assert stream.position == draws


@pytest.mark.parametrize(("draft", "tokens", "draws"), CASES)
def test_verify(draft, tokens, draws):
  result = verify(jnp.asarray(P_EXAMPLE), jnp.asarray(Q_EXAMPLE), jnp.asarray(draft),
                  jnp.asarray(U_EXAMPLE))
  n = len(tokens)
  assert result.tokens.tolist() == tokens + [-1] * (3 - n)
  assert int(result.num_tokens) == n
  assert int(result.num_accepted) == n - 1
  assert int(result.num_uniforms) == draws
  assert bool(result.valid) and int(result.error) == 0


def test_unread_slot_is_never_read():
  """Rejection at position 0 reads slots 0 and 1 only: slot 2 may hold anything."""
  for last in (0.0, 0.5, np.nan, 7.0):
    u = jnp.asarray([0.7, 0.9, last])
    result = verify(jnp.asarray(P_EXAMPLE), jnp.asarray(Q_EXAMPLE), jnp.asarray([0, 2]), u)
    assert result.tokens.tolist() == [2, -1, -1]
    assert bool(result.valid)


def test_pad_id():
  result = verify(jnp.asarray(P_EXAMPLE), jnp.asarray(Q_EXAMPLE), jnp.asarray([0, 2]),
                  jnp.asarray(U_EXAMPLE), pad_id=99)
  assert result.tokens.tolist() == [2, 99, 99]


def test_sample_on_the_bonus_row():
  assert specdec_jax.sample([0.3, 0.3, 0.4], UniformStream([0.1])) == 0
  assert reference.sample([0.3, 0.3, 0.4], UniformStream([0.1])) == 0
  stream = UniformStream([0.9, 0.0])
  assert specdec_jax.sample([0.0, 2 / 3, 1 / 3], stream) == 2
  assert stream.position == 1
