"""Tree verification in sglang-jax's encoding (:func:`packed_tree_verify`).

* The first-child / next-sibling links convert to the parents they encode (random trees).
* Token for token equal to ``jax.vmap(tree_verify)`` on per-tree arrays (every law and uniform
  layout, probabilities and logits with per-request parameters, greedy rows mixed in).
* Coin for coin, the accept decisions equal a NumPy port of sglang's target-only rule
  (``tree_speculative_sampling_target_only``: one coin per parent against cumulative target mass).
* Chi-square per position on 60,000 packed trees, family-wise ``ALPHA = 0.01`` (Bonferroni over
  this module's tests), with a negative control that must fail.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import ErrorCode
from specdec_jax import SamplingParams
from specdec_jax import packed_tree_verify
from specdec_jax import process_logits
from specdec_jax import tree_verify
from specdec_jax import vocab_parallel_packed_tree_verify
from specdec_jax._layouts.packed_tree import parents_from_links
from tests._helpers import per_position

ALPHA = 0.01
NUM_TESTS = 8
ALPHA_EACH = ALPHA / NUM_TESTS


def random_parents(rng, size):
  return np.array([-1] + [int(rng.integers(0, c)) for c in range(1, size)])


def links(parents):
  """sglang's encoding of ``parents``: first child and next sibling, siblings ascending."""
  size = len(parents)
  first, sibling = np.full(size, -1), np.full(size, -1)
  for c in range(size - 1, 0, -1):  # as sglang builds it: push each node to the front
    sibling[c] = first[parents[c]]
    first[parents[c]] = c
  return first, sibling


def test_links_convert_to_the_parents_they_encode():
  convert = jax.jit(parents_from_links)
  rng = np.random.default_rng(0)
  for size in (1, 2, 5, 9, 17):
    for _ in range(20):
      parents = random_parents(rng, size)
      first, sibling = links(parents)
      np.testing.assert_array_equal(np.asarray(convert(first, sibling)), parents)


def _trees(seed, batch=8, size=7, vocab=12):
  rng = np.random.default_rng(seed)
  parents = np.stack([random_parents(rng, size) for _ in range(batch)])
  encoded = [links(p) for p in parents]
  first = np.stack([e[0] for e in encoded]).astype(np.int32)
  sibling = np.stack([e[1] for e in encoded]).astype(np.int32)
  tokens = rng.integers(0, vocab, (batch, size)).astype(np.int32)
  p = rng.dirichlet(np.full(vocab, 0.5), (batch, size)).astype(np.float32)
  q = rng.dirichlet(np.full(vocab, 0.5), (batch, size)).astype(np.float32)
  coins = rng.random((batch, size)).astype(np.float32)
  return rng, parents, first, sibling, tokens, p, q, coins


@pytest.mark.parametrize("law, layout", [
  ("deterministic", "per_parent"), ("deterministic", "per_node"), ("deterministic", "sequential"),
  ("iid", "per_parent"), ("without_replacement", "per_parent")])
def test_equals_vmapped_tree_verify(law, layout):
  """(Every law under every layout is checked against the written-out rule in test_tree.py.)"""
  for seed in range(3):
    _, parents, first, sibling, tokens, p, q, coins = _trees(seed)
    batch, size, vocab = p.shape
    want = jax.vmap(lambda p, q, par, t, u: tree_verify(p, q, par, t, u, law=law, max_depth=3,
                                                        uniform_layout=layout))(
      p, q, parents, tokens, coins)
    got = packed_tree_verify(tokens, first, sibling, max_depth=3, law=law,
                             target_probs=p.reshape(-1, vocab), uniform_layout=layout,
                             draft_probs=None if law == "deterministic" else q.reshape(-1, vocab),
                             coins=coins)
    for field in ("tokens", "num_accepted", "valid", "error"):
      np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                    np.asarray(getattr(want, field)), err_msg=field)
    rows = np.where(np.asarray(want.path) >= 0,
                    np.arange(batch)[:, None] * size + np.asarray(want.path), -1)
    np.testing.assert_array_equal(np.asarray(got.accept_index)[:, 1:], rows[:, :-1])
    np.testing.assert_array_equal(np.asarray(got.accept_index)[:, 0], np.arange(batch) * size)


def test_logits_with_per_request_params_and_greedy_rows():
  rng, parents, first, sibling, tokens, _, _, coins = _trees(4)
  batch, size = tokens.shape
  logits = (rng.normal(size=(batch, size, 12)) * 2).astype(np.float32)
  params = SamplingParams(np.array([0, 0.7, 1, 0, 1.3, 0.5, 0, 1], np.float32),
                          np.array([0, 5, 0, 3, 2, 0, 0, 8], np.int32),
                          np.array([1, 0.9, 0.6, 1, 1, 0.8, 1, 1], np.float32))
  probs = np.asarray(jax.vmap(lambda x, t, k, p: process_logits(x, SamplingParams(t, k, p)))(
    logits, *params[:3]))
  want = jax.vmap(lambda p, par, t, u: tree_verify(p, p, par, t, u, law="deterministic",
                                                   uniform_layout="per_parent"))(
    probs, parents, tokens, coins)
  got = packed_tree_verify(tokens, first, sibling, max_depth=size - 1,
                           target_logits=logits.reshape(-1, 12), params=params, coins=coins)
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  assert np.asarray(got.valid).all()


def sglang_target_only(candidates, first, sibling, target, coins, depth, final_coin=None):
  """NumPy port of sglang-jax's ``tree_speculative_sampling_target_only`` accept decisions
  (``threshold_single = threshold_acc = 1``): at each node, one coin; sibling ``i`` is accepted
  when the coin is at most the cumulative target mass of the siblings tested so far.
  Returns ``(accepted node indices, their tokens)`` of one tree; with ``final_coin`` the tokens
  end with the final one: ``relu(target - draft_probs)`` at the last accepted node (the tokens
  rejected there zeroed, unless the path is ``depth`` long) by inverse CDF at
  ``final_coin * mass``."""
  node, path, rejected = 0, [], []
  for _ in range(depth):
    coin, mass, child, accepted, rejected = coins[node], 0.0, first[node], None, []
    while child != -1:
      mass += target[node, candidates[child]]
      if coin <= mass:
        accepted = child
        break
      rejected.append(int(candidates[child]))
      child = sibling[child]
    if accepted is None:
      break
    path.append(accepted)
    node, rejected = accepted, []
  emitted = [int(candidates[c]) for c in path]
  if final_coin is not None:
    row = target[node].astype(np.float64).copy()
    if len(path) < depth:
      row[rejected] = 0.0
    emitted.append(int(np.argmax(np.cumsum(row) > final_coin * row.sum())))
  return path, emitted


def test_accept_decisions_equal_sglang_target_only_coin_for_coin():
  agree = 0
  for seed in range(5):
    _, parents, first, sibling, tokens, p, _, coins = _trees(seed + 10, batch=16, size=9)
    for b in range(len(tokens)):  # distinct sibling tokens: sglang would double-count repeats
      for u in range(9):
        kids = np.flatnonzero(parents[b] == u)
        tokens[b, kids] = np.arange(len(kids)) + 3 * (u % 3)
    final = np.random.default_rng(seed).random(len(tokens)).astype(np.float32)
    got = packed_tree_verify(tokens, first, sibling, max_depth=4,
                             target_probs=p.reshape(-1, p.shape[-1]), coins=coins,
                             final_coins=final)
    predicts = np.asarray(got.predicts).reshape(len(tokens), 9)
    for b in range(len(tokens)):
      path, emitted = sglang_target_only(tokens[b], first[b], sibling[b], p[b], coins[b], 4,
                                         final[b])
      k = int(got.num_accepted[b])
      assert k == len(path), (seed, b)
      assert np.asarray(got.tokens[b, :k + 1]).tolist() == emitted  # the final token too
      assert (np.asarray(got.accept_index[b, 1:k + 1]) - b * 9).tolist() == path
      # sglang's predicts: the token after each node of the path, pad_id elsewhere.
      want = np.full(9, -1)
      want[[0, *path]] = emitted
      np.testing.assert_array_equal(predicts[b], want)
      agree += 1
  assert agree == 80


def final_token_reference(target_row, rejected, coin):
  """The final token at the walk's last node under ``"deterministic"``: the target row without
  the tokens rejected there (``p`` itself if that leaves nothing), by inverse CDF at ``coin``."""
  row = target_row.astype(np.float64).copy()
  row[rejected] = 0.0
  if not row.sum() > 0:
    row = target_row.astype(np.float64)
  return int(np.argmax(np.cumsum(row) > coin * row.sum()))


@pytest.mark.parametrize("layout", ["per_parent", "per_node", "sequential"])
def test_final_coins_draw_the_final_token_under_every_layout(layout):
  """Issue 44, item 14: ``final_coins`` replace the layout's coin for the final token under every
  layout, not only sglang's ``"per_parent"``. Two runs differ only in ``final_coins`` (0.01 vs
  0.99): the accept decisions are the same, the final token is the reference's for each coin,
  and it changes wherever the reference's does."""
  _, parents, first, sibling, tokens, p, _, coins = _trees(10, batch=16, size=9)
  batch, _, vocab = p.shape
  low, high = np.full(batch, 0.01, np.float32), np.full(batch, 0.99, np.float32)
  run = [packed_tree_verify(tokens, first, sibling, max_depth=4,
                            target_probs=p.reshape(-1, vocab), coins=coins, final_coins=f,
                            uniform_layout=layout) for f in (low, high)]
  for field in ("num_accepted", "path", "valid"):
    np.testing.assert_array_equal(np.asarray(getattr(run[0], field)),
                                  np.asarray(getattr(run[1], field)), err_msg=field)
  assert np.asarray(run[0].valid).all()
  changed = 0
  for b in range(batch):
    k = int(run[0].num_accepted[b])
    node = int(run[0].path[b, k - 1]) if k else 0
    # The walk stopped at `node`: below max_depth every child of it was tested and rejected.
    rejected = tokens[b, parents[b] == node] if k < 4 else np.zeros(0, np.int32)
    want = [final_token_reference(p[b, node], rejected, f[b]) for f in (low, high)]
    got = [int(r.tokens[b, k]) for r in run]
    assert got == want, (layout, b)
    np.testing.assert_array_equal(np.asarray(run[0].tokens[b, :k]),
                                  np.asarray(run[1].tokens[b, :k]))
    changed += want[0] != want[1]
  assert changed >= batch // 2, changed  # the final token moved with the final coin alone


@pytest.mark.parametrize("convention, greedy_temperature", [("specdec", 0.0), ("sglang", 1e-7)])
def test_an_all_greedy_batch_needs_no_coins(convention, greedy_temperature):
  """Issue 44, item 11: as :func:`packed_verify`, an all-greedy batch (host-known temperatures
  greedy under ``convention``) needs neither a key nor coins, and gives what any coins give
  (sglang's ``verify_tree_greedy``); one sampled request brings the requirement back."""
  rng, parents, first, sibling, tokens, _, _, coins = _trees(4)
  batch, size = tokens.shape
  logits = (rng.normal(size=(batch, size, 12)) * 2).astype(np.float32)
  for b in range(batch):  # the first child of each node drafts its parent's argmax
    for u in range(size):
      kids = np.flatnonzero(parents[b] == u)
      if len(kids):
        tokens[b, kids[0]] = np.argmax(logits[b, u])
  logits = logits.reshape(-1, 12)
  params = SamplingParams(np.full(batch, greedy_temperature, np.float32),
                          np.zeros(batch, np.int32), np.ones(batch, np.float32))
  call = functools.partial(packed_tree_verify, tokens, first, sibling, max_depth=size - 1,
                           target_logits=logits, params=params, convention=convention)
  free = call()
  assert np.asarray(free.valid).all()
  assert np.asarray(free.num_accepted).min() >= 1
  for kwargs in (dict(coins=coins), dict(coins=1 - coins - 1e-7),
                 dict(key=jax.random.key(1))):
    np.testing.assert_array_equal(np.asarray(call(**kwargs).tokens), np.asarray(free.tokens))
  # The vocabulary-parallel entry goes through the same host checks.
  parallel = vocab_parallel_packed_tree_verify(jax.make_mesh((1,), ("model",)), "model",
                                               max_depth=size - 1, convention=convention)
  np.testing.assert_array_equal(
    np.asarray(parallel(tokens, first, sibling, target_logits=logits, params=params).tokens),
    np.asarray(free.tokens))
  mixed = params._replace(temperature=np.where(np.arange(batch) == 3, 0.7,
                                               greedy_temperature).astype(np.float32))
  with pytest.raises(ValueError, match=r"packed_tree_verify: pass exactly one of `key` and "
                     r"`uniforms` .*got neither; only a batch whose requests are all greedy"):
    call(params=mixed)


@pytest.mark.parametrize("as_jax", [False, True], ids=["numpy", "jax"])
@pytest.mark.parametrize("kwargs, message", [
  (dict(target_probs=np.full((6, 4), 1, np.int32)), "`target_probs` must have a floating dtype"),
  (dict(target_probs=None, target_logits=np.zeros((6, 4), np.int32)),
   "`target_logits` must have a floating dtype"),
  (dict(law="iid", draft_probs=np.full((6, 4), 1, np.int32)),
   "`draft_probs` must have a floating dtype"),
  (dict(law="iid", target_probs=None, target_logits=np.zeros((6, 4), np.float32),
        draft_logits=np.zeros((6, 4), np.int32)), "`draft_logits` must have a floating dtype"),
  (dict(candidates=np.zeros((2, 3), np.float32)), "`candidates` must have an integer dtype"),
  (dict(retrive_next_token=np.full((2, 3), -1.0)),
   "`retrive_next_token` must have an integer dtype"),
  (dict(retrive_next_sibling=np.full((2, 3), -1.0)),
   "`retrive_next_sibling` must have an integer dtype"),
  (dict(coins=np.zeros((2, 3), np.int32)), "`coins` must have a floating dtype"),
  (dict(coins=None, uniforms=np.zeros((2, 3), np.int32)),
   "`uniforms` must have a floating dtype"),
  (dict(final_coins=np.zeros(2, np.int32)), "`final_coins` must have a floating dtype"),
  (dict(coins=None, key=np.zeros(2, np.float32)), "`key` must be .*jax.random key"),
], ids=["target_probs", "target_logits", "draft_probs", "draft_logits", "candidates",
        "retrive_next_token", "retrive_next_sibling", "coins", "uniforms", "final_coins", "key"])
def test_wrong_dtypes_are_a_clear_error(kwargs, message, as_jax):
  """Issue 44, item 12: every array argument of the wrong dtype, as NumPy or as JAX values
  (which skip the host conversion), is refused naming the function and the argument (an
  integer ``draft_probs`` used to raise NumPy's "data type int32 not inexact")."""
  args = dict(candidates=np.zeros((2, 3), np.int32), retrive_next_token=np.full((2, 3), -1),
              retrive_next_sibling=np.full((2, 3), -1), max_depth=2,
              target_probs=np.full((6, 4), 0.25, np.float32), coins=np.zeros((2, 3), np.float32))
  args.update(kwargs)
  if as_jax:
    args = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
  with pytest.raises(TypeError, match=f"packed_tree_verify: {message}"):
    packed_tree_verify(**args)


# --- exactness -------------------------------------------------------------------------------

TRIALS = 60_000
ROWS = np.array([[0.4, 0.3, 0.2, 0.1, 0.0], [0.1, 0.2, 0.3, 0.2, 0.2],
                 [0.25, 0.25, 0.25, 0.15, 0.1]])  # the target's law at depth 0, 1, 2
Q = np.array([0.2, 0.2, 0.2, 0.2, 0.2])
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 2])  # two children per node, depth 2
DEPTH = np.array([0, 1, 1, 2, 2, 2, 2])


def _simulate(law: str, drafted: str, seed: int = 0):
  """Packed trees whose target rows depend on the depth only; children drafted by ``drafted``."""
  rng = np.random.default_rng(seed)
  first, sibling = links(PARENTS)
  size = len(PARENTS)
  tokens = np.zeros((TRIALS, size), np.int32)
  for u in (0, 1, 2):
    kids = np.flatnonzero(PARENTS == u)
    if drafted == "iid":
      tokens[:, kids] = rng.choice(5, (TRIALS, len(kids)), p=Q)
    else:  # top-2 of the row: distinct, deterministic
      tokens[:, kids] = np.argsort(-ROWS[DEPTH[u]], kind="stable")[: len(kids)]
  p = np.broadcast_to(ROWS[DEPTH], (TRIALS, size, 5)).reshape(-1, 5).astype(np.float32)
  q = np.broadcast_to(Q, (TRIALS * size, 5)).astype(np.float32)
  result = packed_tree_verify(
    tokens, np.broadcast_to(first, (TRIALS, size)).astype(np.int32),
    np.broadcast_to(sibling, (TRIALS, size)).astype(np.int32), max_depth=2, target_probs=p,
    law=law, draft_probs=None if law == "deterministic" else q,
    coins=rng.random((TRIALS, size)).astype(np.float32))
  return np.asarray(result.tokens), np.asarray(result.num_tokens), np.asarray(result.valid)


@pytest.mark.parametrize("law, drafted", [("deterministic", "top"), ("iid", "iid")])
def test_chi_square_per_position(law, drafted):
  tokens, num, valid = _simulate(law, drafted)
  assert valid.all()
  assert per_position(tokens, num, ROWS, ALPHA_EACH, f"{law} packed tree") == 3


def test_negative_control_top_k_drafts_verified_as_iid_fails():
  """Deterministic top-2 children declared as drawn i.i.d. from Q. (The converse is exact:
  point-mass verification is exact for any drafter independent of the coins.)"""
  tokens, num, _ = _simulate("iid", "top", seed=1)
  with pytest.raises(AssertionError, match="chi-square"):
    per_position(tokens, num, ROWS, ALPHA_EACH, "top-k drafts as iid")


@pytest.mark.parametrize("kwargs, message", [
  (dict(coins=None), "exactly one of `key` and `uniforms`"),
  (dict(law="iid"), r"draft rows \(`draft_probs` or `draft_logits`\) are read under law 'iid'"),
  (dict(uniform_layout="per_row"), "`uniform_layout` must be one of"),
  (dict(target_probs=np.full((5, 4), 0.25, np.float32)), r"\(B \* N, V\) = \(6, V\)"),
  (dict(retrive_next_sibling=np.full((2, 2), -1)), "must have the shape of `candidates`"),
  (dict(params=SamplingParams(0.5)), "`params` and `draft_logits` go with logits"),
  (dict(final_coins=np.zeros(3, np.float32)), r"`final_coins` must have shape \(B,\) = \(2,\)"),
  (dict(final_coins=np.zeros(2, np.float32), coins=None, key=jax.random.key(0)),
   "`final_coins` go with `uniforms`"),
])
def test_bad_input_is_a_clear_error(kwargs, message):
  args = dict(candidates=np.zeros((2, 3), np.int32), retrive_next_token=np.full((2, 3), -1),
              retrive_next_sibling=np.full((2, 3), -1), max_depth=2,
              target_probs=np.full((6, 4), 0.25, np.float32), coins=np.zeros((2, 3), np.float32))
  args.update(kwargs)
  with pytest.raises(ValueError, match=f"packed_tree_verify: .*{message}"):
    packed_tree_verify(**args)


def test_malformed_links_are_flagged_not_walked():
  """Links that break the encoding (a backward sibling link, a cycle, a node reached twice, a
  link outside [-1, N), a link to the root, a root sibling) are flagged BAD_PARAMS; a backward
  sibling link would otherwise be walked in index order, not in the order the links say."""
  first, sibling = links(np.array([-1, 0, 0, 1, 1]))  # [1, 3, -1, -1, -1], [-1, 2, -1, 4, -1]
  cases = {"well formed": (first, sibling)}

  def edit(name, which, node, value):
    f, s = first.copy(), sibling.copy()
    (f if which == "first" else s)[node] = value
    cases[name] = (f, s)

  edit("sibling cycle 1 -> 2 -> 1", "sibling", 2, 1)
  edit("node 3 reached twice", "first", 2, 3)
  edit("first child N", "first", 3, 5)
  edit("sibling -2", "sibling", 4, -2)
  edit("link to the root", "first", 4, 0)
  edit("root sibling", "sibling", 0, 2)
  cases["siblings 2 then 1 (backward)"] = (np.array([2, 3, -1, -1, -1]),
                                          np.array([-1, -1, 1, 4, -1]))
  f = np.stack([c[0] for c in cases.values()]).astype(np.int32)
  s = np.stack([c[1] for c in cases.values()]).astype(np.int32)
  batch, size, vocab = f.shape[0], f.shape[1], 6
  rng = np.random.default_rng(3)
  result = packed_tree_verify(
    rng.integers(0, vocab, (batch, size)), f, s, max_depth=2,
    target_probs=rng.dirichlet(np.ones(vocab), batch * size).astype(np.float32),
    coins=rng.random((batch, size)).astype(np.float32))
  error = np.asarray(result.error)
  assert error[0] == 0
  for (name, _), code in zip(cases.items(), error, strict=True):
    if name != "well formed":
      assert code & ErrorCode.BAD_PARAMS, name
  tokens = np.asarray(result.tokens)
  assert ((tokens == -1) | ((tokens >= 0) & (tokens < vocab))).all()
