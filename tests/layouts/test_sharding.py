"""Sharded and vocab-parallel verification on a mesh of 8 CPU devices (conftest.py asks for 8)."""


import jax
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdec_jax import SamplingParams
from specdec_jax import block_verify
from specdec_jax import tree_verify
from specdec_jax import verify
from specdec_jax import verify_logits
from specdec_jax import vocab_parallel_tree_verify
from specdec_jax import vocab_parallel_verify
from tests._helpers import largest_collective
from tests._helpers import random_case

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def _batch(seed, batch, gamma, vocab, kinds=("overlap", "peaked", "equal", "disjoint")):
  rng = np.random.default_rng(seed)
  cases = [random_case(rng, gamma, vocab, str(rng.choice(kinds))) for _ in range(batch)]
  p, q, draft = (np.stack(parts) for parts in zip(*cases, strict=True))
  uniforms = rng.random((batch, gamma + 1)).astype(np.float32)
  num_draft = rng.integers(0, gamma + 1, batch).astype(np.int32)
  return p.astype(np.float32), q.astype(np.float32), draft, uniforms, num_draft


def _single(p, q, draft, uniforms, num_draft):
  return jax.jit(jax.vmap(verify))(p, q, draft, uniforms, num_draft=num_draft)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_batch_sharded_equals_unsharded(axis_type):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  args = _batch(0, 64, 4, 50)
  want = _single(*args)
  shard = NamedSharding(mesh, P("data"))
  placed = [jax.device_put(a, shard) for a in args]
  with jax.set_mesh(mesh):  # explicit axes need the mesh in context, as JAX documents
    got = jax.jit(jax.vmap(verify))(*placed[:4], num_draft=placed[4])
  assert got.tokens.sharding.spec[0] == "data"
  for field in want._fields[:6]:  # the logprobs fields are None here
    np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))


def test_vocab_sharded_inputs_under_plain_jit_equal_unsharded():
  """GSPMD path: p/q split over the vocabulary, the library code unchanged."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  p, q, draft, uniforms, num_draft = _batch(1, 32, 3, 64)
  want = _single(p, q, draft, uniforms, num_draft)
  rows = NamedSharding(mesh, P("data", None, "model"))
  seq = NamedSharding(mesh, P("data"))
  got = jax.jit(jax.vmap(verify))(jax.device_put(p, rows), jax.device_put(q, rows),
                                  jax.device_put(draft, seq), jax.device_put(uniforms, seq),
                                  num_draft=jax.device_put(num_draft, seq))
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_vocab_sharded_logits_with_sampling_params_equal_unsharded():
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  rng = np.random.default_rng(2)
  batch, gamma, vocab = 16, 3, 64
  target = rng.normal(size=(batch, gamma + 1, vocab)).astype(np.float32)
  dl = rng.normal(size=(batch, gamma, vocab)).astype(np.float32)
  draft = rng.integers(0, vocab, (batch, gamma)).astype(np.int32)
  uniforms = rng.random((batch, gamma + 1)).astype(np.float32)
  params = SamplingParams(np.where(np.arange(batch) % 3 == 0, 0.0, 0.8).astype(np.float32),
                          np.full(batch, 10, np.int32), np.full(batch, 0.9, np.float32))
  fn = jax.jit(jax.vmap(verify_logits))
  want = fn(target, dl, draft, uniforms, params)
  rows = NamedSharding(mesh, P("data", None, "model"))
  got = fn(jax.device_put(target, rows), jax.device_put(dl, rows), draft, uniforms, params)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


@pytest.mark.parametrize("layout", [((8,), ("model",), None), ((2, 4), ("data", "model"), "data")])
def test_vocab_parallel_agrees_with_single_device_on_10k_cases(layout):
  shape, names, batch_axis = layout
  mesh = jax.make_mesh(shape, names)
  fn = vocab_parallel_verify(mesh, "model", batch_axis)
  agree = total = 0
  for seed in range(5):
    args = _batch(10 + seed, 2048, 4, 256)
    want = _single(*args)
    got = fn(*args)
    assert np.all(np.asarray(got.valid) == np.asarray(want.valid))
    # The accept decisions use exactly gathered scalars: identical, always.
    np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
    np.testing.assert_array_equal(np.asarray(got.num_uniforms), np.asarray(want.num_uniforms))
    same = np.all(np.asarray(got.tokens) == np.asarray(want.tokens), axis=1)
    agree += int(same.sum())
    total += same.size
  assert total >= 10_000
  # Only the final sample can differ, and only within float rounding of a boundary.
  assert agree / total >= 0.999, f"agreement {agree}/{total}"


def test_vocab_parallel_tokens_are_valid_where_rounding_differs():
  mesh = jax.make_mesh((8,), ("model",))
  fn = vocab_parallel_verify(mesh, "model")
  p, q, draft, uniforms, num_draft = _batch(20, 512, 3, 128)
  got = fn(p, q, draft, uniforms, num_draft)
  tokens, n = np.asarray(got.tokens), np.asarray(got.num_tokens)
  for b in range(512):
    last = tokens[b, n[b] - 1]
    assert 0 <= last < 128 and p[b, n[b] - 1, last] > 0


def test_vocab_parallel_moves_only_scalars_between_devices():
  """Structural check: no collective in the compiled program carries a vocabulary slice."""
  mesh = jax.make_mesh((8,), ("model",))
  fn = vocab_parallel_verify(mesh, "model")
  batch, gamma, vocab = 4, 3, 8 * 1000  # V / n = 1000 appears in no collective shape
  p, q, draft, uniforms, num_draft = _batch(30, batch, gamma, vocab, kinds=("overlap",))
  text = fn.lower(p, q, draft, uniforms, num_draft).compile().as_text()
  assert largest_collective(text) <= batch * 8  # n partial masses per sequence at most


def test_the_structural_check_catches_a_gathered_row():
  """Negative control: a shard_map that all-gathers its row slice is caught by the same check."""
  mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))

  def gather_rows(x):
    return jax.lax.all_gather(x, "model", axis=1, tiled=True).sum(axis=1)

  fn = jax.jit(jax.shard_map(gather_rows, mesh=mesh, in_specs=P(None, "model"),
                             out_specs=P(None), check_vma=False))
  text = fn.lower(np.zeros((4, 8000), np.float32)).compile().as_text()
  assert largest_collective(text) >= 8000


def test_vocab_parallel_bad_input():
  mesh = jax.make_mesh((8,), ("model",))
  with pytest.raises(ValueError, match=r"`vocab_axis` must name an axis of the mesh"):
    vocab_parallel_verify(mesh, "vocab")
  fn = vocab_parallel_verify(mesh, "model")
  p, q, draft, uniforms, num_draft = _batch(40, 8, 2, 20)
  with pytest.raises(ValueError, match=r"V = 20 must be divisible by the 8 devices"):
    fn(p, q, draft, uniforms, num_draft)
  with pytest.raises(ValueError, match=r"`p` must be batched with rank 3"):
    fn(p[0], q, draft, uniforms)


# ---------------------------------------------------------------------------------------------
# Block and tree verification, vocab-parallel.


@pytest.mark.parametrize("layout", [((8,), ("model",), None), ((2, 4), ("data", "model"), "data")])
def test_vocab_parallel_block_verify_agrees_with_single_device(layout):
  shape, names, batch_axis = layout
  mesh = jax.make_mesh(shape, names)
  fn = vocab_parallel_verify(mesh, "model", batch_axis, rule="block")
  agree = total = 0
  for seed in range(2):
    p, q, draft, uniforms, num_draft = _batch(50 + seed, 1024, 4, 256)
    want = jax.jit(jax.vmap(block_verify))(p, q, draft, uniforms, num_draft=num_draft)
    got = fn(p, q, draft, uniforms, num_draft)
    np.testing.assert_array_equal(np.asarray(got.valid), np.asarray(want.valid))
    # tau comes from h_i = Z_i / (Z_i + 1 - b_i): a sum over the split rows, so it may differ
    # only within float rounding too.
    same_tau = np.asarray(got.num_accepted) == np.asarray(want.num_accepted)
    assert same_tau.mean() >= 0.999
    same = np.all(np.asarray(got.tokens) == np.asarray(want.tokens), axis=1)
    agree, total = agree + int(same.sum()), total + same.size
  assert agree / total >= 0.995, f"agreement {agree}/{total}"


TREE_PARENTS = np.array([-1, 0, 0, 1, 1, 2, 2, 3], np.int32)


def _tree_batch(seed, batch, vocab, law):
  rng = np.random.default_rng(seed)
  n = len(TREE_PARENTS)
  p = rng.dirichlet(np.full(vocab, 0.03), size=(batch, n))  # peaked, like an LM's rows
  q = 0.5 * p + 0.5 * rng.dirichlet(np.full(vocab, 0.03), size=(batch, n))
  tokens = np.zeros((batch, n), np.int32)
  for b in range(batch):
    for c in range(1, n):
      row = q[b, TREE_PARENTS[c]]  # a top-k draft: the target's own top tokens
      tokens[b, c] = (np.argsort(-p[b, TREE_PARENTS[c]], kind="stable")[c % 2]
                      if law == "deterministic" else rng.choice(vocab, p=row / row.sum()))
  uniforms = rng.random((batch, n)).astype(np.float32)
  num_nodes = rng.integers(1, n + 1, batch).astype(np.int32)
  return p.astype(np.float32), q.astype(np.float32), tokens, uniforms, num_nodes


@pytest.mark.parametrize("law", ["iid", "without_replacement", "deterministic"])
def test_vocab_parallel_tree_verify_agrees_with_single_device(law):
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  fn = vocab_parallel_tree_verify(mesh, "model", "data", law=law)
  single = jax.jit(jax.vmap(lambda p, q, pa, t, u, n: tree_verify(p, q, pa, t, u, num_nodes=n,
                                                                law=law),
                            in_axes=(0, 0, None, 0, 0, 0)))
  p, q, tokens, uniforms, num_nodes = _tree_batch(60, 512, 256, law)
  want = single(p, q, TREE_PARENTS, tokens, uniforms, num_nodes)
  got = fn(p, q, TREE_PARENTS, tokens, uniforms, num_nodes)
  np.testing.assert_array_equal(np.asarray(got.valid), np.asarray(want.valid))
  same_path = np.all(np.asarray(got.path) == np.asarray(want.path), axis=1)
  assert same_path.mean() >= 0.995  # residual masses are sums over split rows: rounding only
  same = np.all(np.asarray(got.tokens) == np.asarray(want.tokens), axis=1)
  assert same.mean() >= 0.99, same.mean()
  assert (np.asarray(want.num_accepted) > 0).mean() > 0.2  # the trees do get used


@pytest.mark.parametrize("rule", ["block", "tree"])
def test_block_and_tree_move_only_scalars_between_devices(rule):
  mesh = jax.make_mesh((8,), ("model",))
  vocab = 8 * 1000  # V / n = 1000 appears in no collective shape
  if rule == "block":
    fn = vocab_parallel_verify(mesh, "model", rule="block")
    p, q, draft, uniforms, num_draft = _batch(70, 4, 3, vocab, kinds=("overlap",))
    text = fn.lower(p, q, draft, uniforms, num_draft).compile().as_text()
  else:
    fn = vocab_parallel_tree_verify(mesh, "model", law="iid")
    p, q, tokens, uniforms, num_nodes = _tree_batch(71, 4, vocab, "iid")
    text = fn.lower(p, q, TREE_PARENTS, tokens, uniforms, num_nodes).compile().as_text()
  assert largest_collective(text) <= 4 * 8  # n partial masses per sequence at most


def test_vocab_parallel_tree_bad_input():
  mesh = jax.make_mesh((8,), ("model",))
  with pytest.raises(ValueError, match=r"`law` must be one of"):
    vocab_parallel_tree_verify(mesh, "model", law="greedy")(
      *_tree_batch(72, 8, 64, "iid")[:1], np.zeros((8, 8, 64), np.float32), TREE_PARENTS,
      np.zeros((8, 8), np.int32), np.zeros((8, 8), np.float32))
  fn = vocab_parallel_tree_verify(mesh, "model")
  p, q, tokens, uniforms, _ = _tree_batch(73, 8, 20, "iid")
  with pytest.raises(ValueError, match=r"V = 20 must be divisible by the 8 devices"):
    fn(p, q, TREE_PARENTS, tokens, uniforms)
  with pytest.raises(ValueError, match=r"`rule` must be one of"):
    vocab_parallel_verify(mesh, "model", rule="tree")


@pytest.mark.parametrize("shape", [(8,), (2, 4)])
def test_vocab_parallel_agrees_with_more_than_one_block_per_device(shape):
  """V / n = 300 > 256 (the sampler's block) and not a multiple of it: the global id of the
  final sample must use the slice size, not the block size (every other value test has
  V / n <= 64, where the two are equal). Peaked rows put the final sample anywhere."""
  names = ("model",) if len(shape) == 1 else ("data", "model")
  n = shape[-1]
  vocab = 300 * n
  fn = vocab_parallel_verify(jax.make_mesh(shape, names), "model",
                             None if len(shape) == 1 else "data")
  args = _batch(31, 64, 3, vocab, kinds=("overlap", "peaked", "disjoint"))
  want, got = _single(*args), fn(*args)
  np.testing.assert_array_equal(np.asarray(got.num_tokens), np.asarray(want.num_tokens))
  same = np.all(np.asarray(got.tokens) == np.asarray(want.tokens), axis=1)
  assert same.mean() >= 0.95, f"agreement {same.sum()}/{same.size}"
  tokens, count = np.asarray(got.tokens), np.asarray(got.num_tokens)
  last = tokens[np.arange(64), count - 1]
  assert (last >= 300).sum() >= 32  # most final samples come from devices other than the first
