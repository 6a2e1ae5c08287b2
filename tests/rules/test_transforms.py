"""``verify`` under jit, without jit, under vmap and inside lax loops; no retracing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from specdec_jax import verify
from tests._helpers import random_case


def _batch(seed: int, batch: int, gamma: int, vocab: int):
  rng = np.random.default_rng(seed)
  cases = [random_case(rng, gamma, vocab, "overlap") for _ in range(batch)]
  p, q, draft = (np.stack(parts) for parts in zip(*cases, strict=True))
  uniforms = rng.random((batch, gamma + 1))
  return (jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), jnp.asarray(draft),
          jnp.asarray(uniforms, jnp.float32))


class VerifyVariantsTest(chex.TestCase):
  """The same results compiled and not compiled (chex variants), and under vmap."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters((0, 4), (3, 7), (8, 50))
  def test_variants_match_eager_loop(self, gamma, vocab):
    p, q, draft, uniforms = _batch(gamma, 16, gamma, vocab)
    batched = self.variant(jax.vmap(verify))(p, q, draft, uniforms)
    with jax.disable_jit():  # the scan really runs as Python here
      for b in range(16):
        single = verify(p[b], q[b], draft[b], uniforms[b])
        for field in single._fields[:6]:  # the logprobs fields are None here
          np.testing.assert_array_equal(
            np.asarray(getattr(batched, field)[b]), np.asarray(getattr(single, field)),
            err_msg=f"field {field}, row {b}")


def test_no_retrace_on_second_call_with_same_shapes():
  p, q, draft, uniforms = _batch(0, 1, 5, 11)
  verify(p[0], q[0], draft[0], uniforms[0])
  before = verify._cache_size()
  p2, q2, draft2, uniforms2 = _batch(1, 1, 5, 11)
  verify(p2[0], q2[0], draft2[0], uniforms2[0])
  verify(p[0], q[0], draft[0], uniforms[0] * 0.5)
  assert verify._cache_size() == before

  traced = []

  @jax.jit
  def batched(*args):
    traced.append(1)
    return jax.vmap(verify)(*args)

  batched(*_batch(2, 8, 5, 11))
  batched(*_batch(3, 8, 5, 11))
  assert len(traced) == 1


def test_the_scan_is_a_while_loop_in_the_jaxpr():
  p, q, draft, uniforms = _batch(0, 1, 4, 9)
  text = str(jax.make_jaxpr(verify)(p[0], q[0], draft[0], uniforms[0]))
  assert "while[" in text


def test_inside_lax_scan_decoding_loop():
  """Verification steps inside ``lax.scan`` give what separate calls give."""
  steps, gamma, vocab = 6, 3, 13
  p, q, draft, uniforms = _batch(4, steps, gamma, vocab)

  def body(total, xs):
    result = verify(*xs)
    return total + result.num_tokens, result.tokens

  total, tokens = jax.jit(lambda xs: jax.lax.scan(body, jnp.int32(0), xs))((p, q, draft, uniforms))
  expected = [verify(p[s], q[s], draft[s], uniforms[s]) for s in range(steps)]
  assert int(total) == sum(int(r.num_tokens) for r in expected)
  np.testing.assert_array_equal(np.asarray(tokens), np.stack([r.tokens for r in expected]))


def test_inside_lax_while_loop():
  gamma, vocab = 2, 5
  p, q, draft, uniforms = _batch(5, 1, gamma, vocab)

  def cond(state):
    return state[0] < 4

  def body(state):
    step, count, u = state
    result = verify(p[0], q[0], draft[0], u)
    return step + 1, count + result.num_tokens, jnp.roll(u, 1)

  _, count, _ = jax.jit(lambda: jax.lax.while_loop(cond, body, (0, jnp.int32(0), uniforms[0])))()
  assert 4 <= int(count) <= 4 * (gamma + 1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dtypes_of_the_result(dtype):
  p, q, draft, uniforms = _batch(6, 1, 3, 8)
  result = verify(p[0].astype(dtype), q[0].astype(dtype), draft[0], uniforms[0])
  assert result.tokens.dtype == jnp.int32
  assert result.num_tokens.dtype == jnp.int32
  assert result.num_uniforms.dtype == jnp.int32
  assert result.valid.dtype == jnp.bool_
  assert result.error.dtype == jnp.int32
  assert bool(result.valid)


def test_float64_under_local_x64_agrees_with_float32_on_clear_cases():
  p, q, draft, uniforms = _batch(7, 1, 4, 6)
  r32 = verify(p[0], q[0], draft[0], uniforms[0])
  with jax.enable_x64(True):
    r64 = verify(p[0].astype(jnp.float64), q[0].astype(jnp.float64), draft[0],
                 uniforms[0].astype(jnp.float64))
  np.testing.assert_array_equal(np.asarray(r32.tokens), np.asarray(r64.tokens))
