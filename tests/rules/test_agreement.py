"""Token-for-token agreement with the literal float64 reference on thousands of random cases."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import UniformStream
from specdec_jax import reference
from specdec_jax import speculative_step
from specdec_jax import verify
from tests._helpers import KINDS
from tests._helpers import random_case

VOCABS = (1, 2, 5, 64, 1000)
NUM_CASES = 2100  # at least 2,000 random cases


def _cases(seed: int, num: int, gammas=range(9), vocabs=VOCABS):
  rng = np.random.default_rng(seed)
  for _ in range(num):
    gamma = int(rng.choice(gammas))
    vocab = int(rng.choice(vocabs))
    kind = str(rng.choice(KINDS))
    yield (gamma, vocab, kind, *random_case(rng, gamma, vocab, kind))


def test_speculative_step_shares_one_generator_with_the_reference():
  """Sequential calls on one generator: same tokens every call, same generator state at the end."""
  ours = np.random.default_rng(1234)
  theirs = np.random.default_rng(1234)
  lengths = []
  for gamma, vocab, kind, p, q, draft in _cases(0, NUM_CASES):
    got = speculative_step(p, q, draft, ours)
    want = reference.speculative_step(p, q, draft, theirs)
    assert got == want, f"gamma={gamma} V={vocab} kind={kind}: {got} != {want}"
    lengths.append(len(got))
  assert ours.bit_generator.state == theirs.bit_generator.state
  # The cases exercise rejections at many positions and full acceptance.
  assert len(set(lengths)) >= 8


def test_speculative_step_with_python_random():
  ours, theirs = random.Random(7), random.Random(7)
  for _, _, _, p, q, draft in _cases(1, 200):
    assert speculative_step(p.tolist(), q.tolist(), draft.tolist(), ours) == (
      reference.speculative_step(p, q, draft, theirs)
    )
  assert ours.getstate() == theirs.getstate()


def test_verify_with_uniform_stream_matches_reference_float64():
  """One pre-drawn vector into ``verify`` (float64) and, through UniformStream, the reference."""
  rng = np.random.default_rng(99)
  with jax.enable_x64(True):
    for gamma, vocab, kind, p, q, draft in _cases(2, NUM_CASES):
      uniforms = rng.random(gamma + 1)
      stream = UniformStream(uniforms)
      want = reference.speculative_step(p, q, draft, stream)
      result = verify(jnp.asarray(p), jnp.asarray(q), jnp.asarray(draft), jnp.asarray(uniforms))
      n = int(result.num_tokens)
      assert result.tokens.dtype == jnp.int32
      assert result.tokens[:n].tolist() == want, f"gamma={gamma} V={vocab} kind={kind}"
      assert np.all(np.asarray(result.tokens[n:]) == -1)
      assert int(result.num_uniforms) == stream.position
      assert bool(result.valid), f"gamma={gamma} V={vocab} kind={kind}"


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_inputs_give_in_range_positive_tokens(dtype):
  """float32/float16 inputs: every token in range, the last one of positive target probability."""
  gen = np.random.default_rng(6)
  for _, vocab, _, p, q, draft in _cases(3, 300, gammas=(0, 3, 8), vocabs=(1, 5, 1000)):
    p_low, q_low = p.astype(dtype), q.astype(dtype)
    tokens = speculative_step(p_low, q_low, draft, gen)
    assert all(0 <= t < vocab for t in tokens)
    assert p_low[len(tokens) - 1, tokens[-1]] > 0


@pytest.mark.parametrize("vocab", [5, 300])
def test_verify_matches_reference_slot_for_slot_at_one_shape(vocab):
  """The quick version of the test above: one shape (one compilation), every kind of case, and
  a vocabulary of two blocks. Which uniform each test and the final sample read, which row the
  replacement comes from and the residual's sign all show up here."""
  gamma = 3
  rng = np.random.default_rng(vocab)
  with jax.enable_x64(True):
    step = jax.jit(verify)
    for i in range(300):
      kind = KINDS[i % len(KINDS)]
      p, q, draft = random_case(rng, gamma, vocab, kind)
      uniforms = rng.random(gamma + 1)
      stream = UniformStream(uniforms)
      want = reference.speculative_step(p, q, draft, stream)
      result = step(jnp.asarray(p), jnp.asarray(q), jnp.asarray(draft), jnp.asarray(uniforms))
      n = int(result.num_tokens)
      assert result.tokens[:n].tolist() == want, f"case {i}, kind={kind}"
      assert int(result.num_uniforms) == stream.position
