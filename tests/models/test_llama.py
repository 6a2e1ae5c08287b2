"""The JAX Llama forward on tiny random configs: reference, cache, rollback, ragged, layers, jit.

Tolerances: the JAX forward runs in float32 and the NumPy reference in float64, so logits are
compared with ``atol = rtol = 1e-4`` (the observed gap is ~1e-6 on logits of size ~1). Two JAX
runs that differ only in how the tokens are split into calls (or batched) do the same float32
arithmetic up to reduction order and are compared with ``atol = rtol = 1e-5``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.models import llama
from specdec_jax.models import llama_reference
from specdec_jax.models.protocol import Model

REF_TOL = {"atol": 1e-4, "rtol": 1e-4}  # float32 JAX vs float64 NumPy
JAX_TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 vs float32, different call splits

CONFIG = llama.LlamaConfig(
  vocab_size=64,
  dim=32,
  n_layers=3,
  n_heads=4,
  n_kv_heads=2,
  head_dim=8,
  ffn_dim=48,
  rope_theta=100.0,  # small base: the angles vary a lot over a dozen positions
  tie_embeddings=False,
  max_position=64,
)
MAX_LEN = 16
T_FULL = 12


def _setup(tie_embeddings: bool):
  config = CONFIG._replace(tie_embeddings=tie_embeddings)
  params = llama.init_params(jax.random.key(0), config)
  tokens = np.random.default_rng(1).integers(0, config.vocab_size, size=T_FULL).astype(np.int32)
  return config, params, llama.make_model(params, config), tokens


@pytest.fixture(scope="module")
def setup():
  """The untied model (separate output head); ``tied`` checks the tied head where it matters."""
  return _setup(tie_embeddings=False)


@pytest.fixture(scope="module")
def tied():
  return _setup(tie_embeddings=True)


def _run(model: Model, tokens, positions, cache):
  logits, cache = model.apply(
    model.params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), cache
  )
  return np.asarray(logits), cache


def _full(model: Model, tokens: np.ndarray) -> np.ndarray:
  """Logits ``(T, V)`` of one call over the whole sequence from an empty cache."""
  T = tokens.shape[0]
  logits, _ = _run(model, tokens[None], np.arange(T)[None], model.init_cache(1, MAX_LEN))
  return logits[0]


def _chunked(model: Model, tokens: np.ndarray, chunk: int, cache=None, start: int = 0):
  """Logits of ``tokens`` fed ``chunk`` at a time from position ``start``."""
  cache = model.init_cache(1, MAX_LEN) if cache is None else cache
  out = []
  for s in range(0, tokens.shape[0], chunk):
    piece = tokens[s : s + chunk]
    positions = start + s + np.arange(piece.shape[0])
    logits, cache = _run(model, piece[None], positions[None], cache)
    out.append(logits[0])
  return np.concatenate(out), cache


def test_model_protocol(setup):
  config, params, model, _ = setup
  assert isinstance(model, Model)
  assert model.vocab_size == config.vocab_size
  cache = model.init_cache(2, MAX_LEN)
  assert cache.k.shape == (config.n_layers, 2, config.n_kv_heads, MAX_LEN, config.head_dim)
  logits, cache2 = model.apply(
    params, jnp.zeros((2, 3), jnp.int32), jnp.tile(jnp.arange(3, dtype=jnp.int32), (2, 1)), cache
  )
  assert logits.shape == (2, 3, config.vocab_size) and logits.dtype == jnp.float32
  assert jax.tree.map(lambda a: (a.shape, a.dtype), cache2) == jax.tree.map(
    lambda a: (a.shape, a.dtype), cache
  )
  # Same shape and layers: the same function objects (a loop using them compiles once).
  again = llama.make_model(params, config)
  assert again.apply is model.apply and again.init_cache is model.init_cache


@pytest.mark.parametrize("fixture", ["setup", "tied"])
def test_matches_numpy_reference(fixture, request):
  config, params, model, tokens = request.getfixturevalue(fixture)
  reference = llama_reference.reference_logits(params, config, tokens)
  assert reference.shape == (T_FULL, config.vocab_size)
  assert reference.std() > 0.3  # logits that actually vary
  np.testing.assert_allclose(_full(model, tokens), reference, **REF_TOL)


@pytest.mark.parametrize("fixture", ["setup", "tied"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_decoding_matches_full_forward(fixture, chunk, request):
  _, _, model, tokens = request.getfixturevalue(fixture)
  logits, _ = _chunked(model, tokens, chunk)
  np.testing.assert_allclose(logits, _full(model, tokens), **JAX_TOL)


def test_rollback_by_overwriting(setup):
  config, _, model, tokens = setup
  full = _full(model, tokens)
  _, cache = _chunked(model, tokens[:6], 3)
  # Speculate 4 junk tokens at positions 6..9, then roll back to length 6 by just continuing
  # from position 6: slots 6..8 are overwritten in the next call, slot 9 stays junk until the
  # call after, and is masked meanwhile.
  junk = (tokens[6:10] + 7) % config.vocab_size
  _, cache = _run(model, junk[None], np.arange(6, 10)[None], cache)
  logits, _ = _chunked(model, tokens[6:], 3, cache=cache, start=6)
  np.testing.assert_allclose(logits, full[6:], **JAX_TOL)


def test_ragged_batch_equals_separate_calls(setup):
  config, _, model, tokens = setup
  other = (tokens[::-1] * 5 + 3) % config.vocab_size
  # Row 0 has 5 tokens, row 1 has 8; one prefill call of T = 8 (row 0's slots 5..7 get junk
  # that the next call overwrites or masks), then one call with each row at its own position.
  prefill = np.stack([np.concatenate([tokens[:5], other[:3]]), other[:8]])
  _, cache = _run(model, prefill, np.tile(np.arange(8), (2, 1)), model.init_cache(2, MAX_LEN))
  step_tokens = np.stack([tokens[5:7], other[8:10]])
  step_positions = np.array([[5, 6], [8, 9]])
  logits, _ = _run(model, step_tokens, step_positions, cache)

  for row, seq, length in ((0, tokens, 5), (1, other, 8)):
    alone, _ = _chunked(model, seq[: length + 2], length)  # prefill, then the 2-token step
    np.testing.assert_allclose(logits[row], alone[length:], **JAX_TOL)


def test_layer_subset_equals_model_with_only_those_layers(setup):
  config, params, _, tokens = setup
  subset = (0, 2)
  draft = llama.make_model(params, config, layers=subset)
  assert draft.init_cache(1, MAX_LEN).k.shape[0] == len(subset)
  assert draft.params is params  # shared, not copied

  small_config = config._replace(n_layers=len(subset))
  small_params = params._replace(layers=jax.tree.map(lambda w: w[np.array(subset)], params.layers))
  small = llama.make_model(small_params, small_config)
  expected = _full(small, tokens)
  np.testing.assert_allclose(_full(draft, tokens), expected, **JAX_TOL)
  logits, _ = _chunked(draft, tokens, 3)
  np.testing.assert_allclose(logits, expected, **JAX_TOL)
  np.testing.assert_allclose(
    expected, llama_reference.reference_logits(params, config, tokens, layers=subset), **REF_TOL
  )
  assert not np.allclose(expected, _full(llama.make_model(params, config), tokens), atol=1e-2)
  with pytest.raises(ValueError, match="out of range"):
    llama.make_model(params, config, layers=(0, 3))


def test_jit_no_retrace_and_loop_safe(setup):
  config, params, _, tokens = setup
  traces = []

  def counted(params, tokens, positions, cache):
    traces.append(tokens.shape)
    return llama.llama_apply(params, tokens, positions, cache, config=config)

  apply = jax.jit(counted)
  cache = llama.init_cache(config, 2, MAX_LEN)
  for start in range(0, 9, 3):  # new values, same shapes
    positions = jnp.tile(jnp.arange(start, start + 3, dtype=jnp.int32), (2, 1))
    toks = jnp.tile(jnp.asarray(tokens[start : start + 3]), (2, 1))
    _, cache = apply(params, toks, positions, cache)
  assert len(traces) == 1

  # Greedy decoding inside lax.fori_loop under jit: the forward is loop- and trace-safe.
  model = llama.make_model(params, config)

  @jax.jit
  def greedy(params, first):
    def step(i, state):
      token, cache, out = state
      logits, cache = model.apply(params, token[None, None], i[None, None], cache)
      token = jnp.argmax(logits[0, 0]).astype(jnp.int32)
      return token, cache, out.at[i].set(token)

    init = (first, model.init_cache(1, MAX_LEN), jnp.zeros(MAX_LEN, jnp.int32))
    return jax.lax.fori_loop(0, 8, step, init)[2][:8]

  out = np.asarray(greedy(params, jnp.int32(tokens[0])))
  seq = np.concatenate([tokens[:1], out[:7]])  # check each greedy step with one full forward
  np.testing.assert_array_equal(_full(model, seq).argmax(-1), out)


def test_vmap_over_independent_caches(setup):
  _, params, model, tokens = setup
  batched = jax.vmap(model.apply, in_axes=(None, 0, 0, 0))
  caches = jax.tree.map(lambda a: jnp.stack([a, a]), model.init_cache(1, MAX_LEN))
  seqs = np.stack([tokens[:6], tokens[6:]])[:, None, :]  # (2 vmapped, B = 1, T = 6)
  positions = jnp.tile(jnp.arange(6, dtype=jnp.int32), (2, 1, 1))
  logits, _ = batched(params, jnp.asarray(seqs), positions, caches)
  for i in range(2):
    np.testing.assert_allclose(np.asarray(logits[i, 0]), _full(model, seqs[i, 0]), **JAX_TOL)


def test_positions_outside_the_cache_raise_when_concrete_and_give_nan_when_traced(setup):
  _, _, model, tokens = setup
  _, cache = _run(model, tokens[None, :4], np.arange(4)[None], model.init_cache(1, 4))
  with pytest.raises(ValueError, match=r"llama apply: `positions` must address cache slots in "
                     r"\[0, max_len\) = \[0, 4\), got 4 at index \(0, 0\)"):
    _run(model, tokens[None, 4:6], np.array([[4, 5]]), cache)
  with pytest.raises(ValueError, match=r"`tokens` ids must be in \[0, V\)"):
    _run(model, np.array([[model.vocab_size]]), np.array([[0]]), cache)
  # Traced: the write is dropped, and the logits of those tokens are NaN (reported downstream),
  # while a token inside the cache in the same call is computed as usual.
  logits, after = jax.jit(model.apply)(model.params, jnp.asarray(tokens[None, 3:5]),
                                       jnp.array([[3, 4]]), cache)
  assert np.isnan(np.asarray(logits[0, 1])).all() and np.isfinite(np.asarray(logits[0, 0])).all()
  np.testing.assert_array_equal(np.asarray(after.k), np.asarray(cache.k))
  np.testing.assert_array_equal(np.asarray(after.v), np.asarray(cache.v))
  assert model.context_length == CONFIG.max_position


# ----------------------------------------------------------------------------------------------
# Tree attention (the protocol's tree_apply) and copy_slots.

TREE_PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3])  # node 0 is the last context token
TREE_DEPTHS = np.array([0, 1, 1, 2, 2, 2, 3])


def _tree_mask() -> np.ndarray:
  mask = np.eye(len(TREE_PARENTS), dtype=bool)
  for c in range(1, len(TREE_PARENTS)):
    mask[c] |= mask[TREE_PARENTS[c]]
  return mask


def _path(node: int) -> list[int]:
  out = [node]
  while TREE_PARENTS[out[-1]] > 0:
    out.append(int(TREE_PARENTS[out[-1]]))
  return out[::-1] if node > 0 else []


@pytest.mark.parametrize("start", [1, 4])
def test_tree_apply_equals_the_forward_of_every_path(setup, start):
  """Each node's logits (and root's) equal a full forward over context + that node's path.

  The context fills slots ``0 .. start - 1`` and node 0 sits at slot ``start`` (position
  ``start``), so every tree slot lies inside the cache (``start + N <= MAX_LEN``); stale
  values beyond the tree must not matter, so the cache is first filled with junk there.
  """
  _, _, model, tokens = setup
  rng = np.random.default_rng(5)
  nodes = rng.integers(0, model.vocab_size, size=len(TREE_PARENTS)).astype(np.int32)
  nodes[0] = tokens[start]
  junk = rng.integers(0, model.vocab_size, size=MAX_LEN).astype(np.int32)
  _, cache = _run(model, junk[None], np.arange(MAX_LEN)[None], model.init_cache(1, MAX_LEN))
  _, cache = _chunked(model, tokens[:start], start, cache=cache)
  positions = (start + TREE_DEPTHS)[None]
  logits, _ = model.tree_apply(model.params, jnp.asarray(nodes[None]), jnp.asarray(positions),
                               cache, jnp.array([start]), jnp.arange(len(nodes)),
                               jnp.asarray(_tree_mask()))
  for node in range(len(nodes)):
    seq = np.concatenate([tokens[: start + 1], nodes[_path(node)]])
    np.testing.assert_allclose(logits[0, node], _full(model, seq)[-1], **JAX_TOL,
                               err_msg=f"node {node}")


def test_copy_slots_commits_an_accepted_path(setup):
  """Tree, then copy the path 0 -> 1 -> 3 -> 6 into place: decoding goes on as if sequential."""
  _, _, model, tokens = setup
  start = 3
  nodes = np.random.default_rng(6).integers(0, model.vocab_size, len(TREE_PARENTS)).astype(np.int32)
  nodes[0] = tokens[start]
  _, cache = _chunked(model, tokens[:start], start)
  _, cache = model.tree_apply(model.params, jnp.asarray(nodes[None]),
                              jnp.asarray((start + TREE_DEPTHS)[None]), cache, jnp.array([start]),
                              jnp.arange(len(nodes)), jnp.asarray(_tree_mask()))
  path = [1, 3, 6]
  src = jnp.asarray([[start + c for c in path]])
  dst = jnp.asarray([[start + 1 + i for i in range(len(path))]])
  cache = model.copy_slots(cache, src, dst)
  nxt = np.array([7], np.int32)
  logits, _ = _run(model, nxt[None], np.array([[start + 1 + len(path)]]), cache)
  seq = np.concatenate([tokens[: start + 1], nodes[path], nxt])
  np.testing.assert_allclose(logits[0, 0], _full(model, seq)[-1], **JAX_TOL)


def test_tree_apply_takes_one_tree_per_row(setup):
  """A mask ``(B, T, N)`` (EAGLE-2's dynamic trees): each row sees its own tree, as a call on
  that row alone with its ``(T, N)`` mask does."""
  _, _, model, tokens = setup
  start = 3
  chain = np.tril(np.ones((len(TREE_PARENTS),) * 2, bool))  # a second tree: one chain
  masks = np.stack([_tree_mask(), chain])
  depths = np.stack([TREE_DEPTHS, np.arange(len(TREE_PARENTS))])
  rng = np.random.default_rng(8)
  nodes = rng.integers(0, model.vocab_size, (2, len(TREE_PARENTS))).astype(np.int32)
  nodes[:, 0] = tokens[start]
  _, cache = _run(model, np.tile(tokens[:start], (2, 1)), np.tile(np.arange(start), (2, 1)),
                  model.init_cache(2, MAX_LEN))
  both, _ = model.tree_apply(model.params, jnp.asarray(nodes), jnp.asarray(start + depths), cache,
                             jnp.array([start, start]), jnp.arange(len(TREE_PARENTS)),
                             jnp.asarray(masks))
  for row in range(2):
    one_cache = jax.tree.map(lambda a, r=row: a[:, r : r + 1] if a.ndim == 5 else a, cache)
    alone, _ = model.tree_apply(model.params, jnp.asarray(nodes[row : row + 1]),
                                jnp.asarray(start + depths[row : row + 1]), one_cache,
                                jnp.array([start]), jnp.arange(len(TREE_PARENTS)),
                                jnp.asarray(masks[row]))
    np.testing.assert_allclose(both[row], alone[0], **JAX_TOL, err_msg=f"row {row}")
  assert not np.allclose(both[0], both[1], **JAX_TOL)  # the two trees differ
