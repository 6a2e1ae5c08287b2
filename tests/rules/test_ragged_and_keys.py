"""Ragged draft lengths (``num_draft``) and key-based uniforms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import ErrorCode
from specdec_jax import verify
from tests._helpers import assert_same_distribution
from tests._helpers import keyed
from tests._helpers import random_case
from tests._helpers import sample_rows

GAMMA, VOCAB, BATCH = 6, 11, 48


def _padded_batch(seed: int):
  rng = np.random.default_rng(seed)
  num_draft = rng.integers(0, GAMMA + 1, size=BATCH).astype(np.int32)
  ps, qs, drafts, unpadded = [], [], [], []
  for n in num_draft:
    p, q, draft = random_case(rng, int(n), VOCAB, str(rng.choice(["overlap", "peaked", "equal"])))
    u = rng.random(int(n) + 1).astype(np.float32)
    unpadded.append((p.astype(np.float32), q.astype(np.float32), draft, u))
    pad = GAMMA - int(n)
    # Padding is garbage on purpose: it must never be read.
    ps.append(np.concatenate([p, np.full((pad, VOCAB), np.nan)]).astype(np.float32))
    qs.append(np.concatenate([q, np.full((pad, VOCAB), -1.0)]).astype(np.float32))
    drafts.append(np.concatenate([draft, np.full(pad, 12345)]).astype(np.int32))
  uniforms = rng.random((BATCH, GAMMA + 1)).astype(np.float32)
  for b, (_, _, _, u) in enumerate(unpadded):
    uniforms[b, : len(u)] = u
  return (jnp.asarray(np.stack(ps)), jnp.asarray(np.stack(qs)), jnp.asarray(np.stack(drafts)),
          jnp.asarray(uniforms), jnp.asarray(num_draft), unpadded)


def test_ragged_batch_equals_unpadded_calls_row_by_row():
  p, q, draft, uniforms, num_draft, unpadded = _padded_batch(0)
  batched = jax.jit(jax.vmap(verify))(p, q, draft, uniforms, num_draft=num_draft)
  assert np.all(np.asarray(batched.valid)), "padding was read"
  for b, (pb, qb, db, ub) in enumerate(unpadded):
    single = verify(jnp.asarray(pb), jnp.asarray(qb), jnp.asarray(db), jnp.asarray(ub))
    n = len(db)
    assert int(batched.num_tokens[b]) == int(single.num_tokens) <= n + 1
    assert int(batched.num_uniforms[b]) == int(single.num_uniforms)
    np.testing.assert_array_equal(np.asarray(batched.tokens[b, : n + 1]),
                                  np.asarray(single.tokens))
    assert np.all(np.asarray(batched.tokens[b, n + 1 :]) == -1)


def test_num_draft_values_do_not_recompile():
  p, q, draft, uniforms, num_draft, _ = _padded_batch(1)
  traces = []

  @jax.jit
  def step(p, q, draft, uniforms, num_draft):
    traces.append(1)
    return jax.vmap(verify)(p, q, draft, uniforms, num_draft=num_draft)

  step(p, q, draft, uniforms, num_draft)
  step(p, q, draft, uniforms, (num_draft + 1) % (GAMMA + 1))
  step(p, q, draft, uniforms, jnp.zeros_like(num_draft))
  assert len(traces) == 1


def test_num_draft_zero_is_one_token_from_p0():
  p = jnp.asarray([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
  q = jnp.asarray([[1.0, 0.0, 0.0]])
  result = verify(p, q, jnp.asarray([0]), jnp.asarray([0.5, 0.5]), num_draft=0)
  assert result.tokens.tolist() == [1, -1]
  assert int(result.num_uniforms) == 1


@pytest.mark.parametrize("bad", [-1, 7, 100])
def test_num_draft_out_of_range_is_clipped_and_flagged_under_jit(bad):
  p, q, draft, uniforms, _, _ = _padded_batch(2)
  result = verify(p[0], q[0], draft[0], uniforms[0], num_draft=jnp.int32(bad))
  assert int(result.error) & ErrorCode.BAD_NUM_DRAFT
  n = int(result.num_tokens)
  assert 1 <= n <= GAMMA + 1


@pytest.mark.parametrize("bad", [-3, GAMMA + 1, 100])
def test_out_of_range_num_draft_acts_as_its_clipped_value(bad):
  """q = p accepts every proposal: an unclipped num_draft would test (and emit) more than gamma."""
  rng = np.random.default_rng(5)
  p, _, draft = random_case(rng, GAMMA, VOCAB, "overlap")
  p = jnp.asarray(p, jnp.float32)
  args = (p, p[:GAMMA], jnp.asarray(draft), jnp.full(GAMMA + 1, 0.5, jnp.float32))
  got = verify(*args, num_draft=jnp.int32(bad))
  want = verify(*args, num_draft=jnp.int32(min(max(bad, 0), GAMMA)))
  assert got.tokens.tolist() == want.tokens.tolist()
  assert (int(got.num_tokens), int(got.num_uniforms)) == (int(want.num_tokens),
                                                           int(want.num_uniforms))
  assert int(got.error) == ErrorCode.BAD_NUM_DRAFT and bool(want.valid)


def test_num_draft_wrong_shape_or_dtype_fails_at_trace_time():
  p, q, draft, uniforms, num_draft, _ = _padded_batch(3)
  with pytest.raises(ValueError, match=r"`num_draft` must be a scalar.*got shape \(48,\)"):
    verify(p[0], q[0], draft[0], uniforms[0], num_draft=num_draft)
  with pytest.raises(TypeError, match=r"`num_draft` must be an integer, got dtype float32"):
    verify(p[0], q[0], draft[0], uniforms[0], num_draft=jnp.float32(2))


# --- keys ---------------------------------------------------------------------------------------


def test_key_determinism_and_equivalence_to_explicit_uniforms():
  p, q, draft, _, num_draft, _ = _padded_batch(4)
  key = jax.random.key(7)
  a = verify(p[0], q[0], draft[0], num_draft=num_draft[0], key=key)
  b = verify(p[0], q[0], draft[0], num_draft=num_draft[0], key=key)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  u = jax.random.uniform(key, (GAMMA + 1,), jnp.float32)
  c = verify(p[0], q[0], draft[0], u, num_draft=num_draft[0])
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(c.tokens))
  # Raw uint32 keys work too.
  verify(p[0], q[0], draft[0], key=jax.random.PRNGKey(0))


def test_split_keys_over_a_batch():
  p, q, draft, _, num_draft, _ = _padded_batch(5)
  keys = jax.random.split(jax.random.key(0), BATCH)
  batched = jax.vmap(keyed(verify))(keys, p, q, draft, num_draft=num_draft)
  for b in range(0, BATCH, 7):
    single = verify(p[b], q[b], draft[b], num_draft=num_draft[b], key=keys[b])
    np.testing.assert_array_equal(np.asarray(batched.tokens[b]), np.asarray(single.tokens))
  assert len({tuple(t) for t in np.asarray(batched.tokens).tolist()}) > 1


def test_key_based_verification_is_exact_per_position():
  """200k split keys; chi-square per position at alpha 1e-3 each (3 positions: FWER 0.3%)."""
  rng = np.random.default_rng(9)
  p = rng.dirichlet(np.ones(5), size=3)
  q = 0.5 * p[:2] + 0.5 * rng.dirichlet(np.ones(5), size=2)
  trials = 200_000
  drafts = jnp.asarray(sample_rows(rng, q, trials).astype(np.int32))
  keys = jax.random.split(jax.random.key(3), trials)
  run = jax.jit(jax.vmap(keyed(verify), in_axes=(0, None, None, 0)))
  result = run(keys, jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), drafts)
  tokens, counts = np.asarray(result.tokens), np.asarray(result.num_tokens)
  for j in range(3):
    assert_same_distribution(tokens[counts > j, j], p[j], 1e-3, f"key position {j}")
  # Negative control: the same keys with a q the drafts were not drawn from.
  wrong = run(keys, jnp.asarray(p, jnp.float32), jnp.full((2, 5), 0.2, jnp.float32), drafts)
  with pytest.raises(AssertionError, match="chi-square"):
    assert_same_distribution(np.asarray(wrong.tokens)[:, 0], p[0], 1e-3, "wrong q")
