"""The verifier matrix: every rule in every layout, from probabilities or logits, any randomness.

Each cell {token, block, tree} x {single, packed / packed tree, vocab-parallel, vocab-parallel
packed} x {probabilities, logits + per-request SamplingParams with greedy rows mixed in} x
{uniforms, one key, one key per request} is checked token for token (and flag for flag)
against one reference: the single-device, padded, one-sequence rule under ``jax.vmap`` on
probabilities processed eagerly (``process_logits``) with the same uniforms. The reference's
law is covered by the chi-square tests of tests/rules/test_exactness.py, test_block.py and
test_tree.py, so agreement carries exactness to every cell. Vocabulary shards: 8 host devices
(conftest.py), V / n = 40 (and the HLO test reads what crosses devices).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specdec_jax as sd
from specdec_jax._logits.lazy import CANDIDATES
from tests._helpers import largest_collective

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

B, GAMMA, V = 8, 3, 320
PARENTS = np.array([-1, 0, 0, 1, 1, 2], np.int32)
N = len(PARENTS)
PARAMS = sd.SamplingParams(
  np.array([0.0, 0.8, 1.0, 0.6, 0.0, 1.3, 0.9, 1.0], np.float32),
  np.array([0, 5, 0, 40, 3, 0, 12, 0], np.int32),
  np.array([1.0, 1.0, 0.9, 0.8, 1.0, 0.95, 1.0, 0.7], np.float32))
RULES = ("token", "block")
SOURCES = ("uniforms", "key", "keys")


def _logits(rng, shape):
  """LM-like rows: a Zipf-shaped background plus noise, a few ties."""
  base = -1.1 * np.log(np.arange(1, shape[-1] + 1))
  noise = rng.normal(scale=1.5, size=shape)
  rows = (base[rng.permutation(shape[-1])] + noise).astype(np.float32)
  rows[..., :4] = rows[..., 4:5]  # ties
  return rows


@functools.cache
def _case(seed: int = 0):
  rng = np.random.default_rng(seed)
  tl, dl = _logits(rng, (B, GAMMA + 1, V)), _logits(rng, (B, GAMMA, V))
  p = np.asarray(jax.vmap(lambda x, t, k, pp: sd.process_logits(x, sd.SamplingParams(t, k, pp)))(
    tl, *PARAMS[:3]))
  q = np.asarray(jax.vmap(lambda x, t, k, pp: sd.process_logits(x, sd.SamplingParams(t, k, pp)))(
    dl, *PARAMS[:3]))
  draft = np.stack([[rng.choice(V, p=q[b, i] / q[b, i].sum()) for i in range(GAMMA)]
                    for b in range(B)]).astype(np.int32)
  draft[1, 0] = np.argmax(p[1, 0])  # one certain acceptance
  num_draft = np.array([3, 2, 0, 3, 1, 3, 2, 3], np.int32)
  return tl, dl, p, q, draft, num_draft


def _uniforms(source: str, count: int):
  """``(randomness kwargs, the uniforms they mean)`` for a batch of B."""
  key = jax.random.key(11)
  if source == "uniforms":
    u = np.asarray(jax.random.uniform(jax.random.key(5), (B, count)))
    return {"uniforms": u}, u
  if source == "key":
    return {"key": key}, np.asarray(jax.random.uniform(key, (B, count)))
  keys = jax.random.split(key, B)
  return {"key": keys}, np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (count,)))(keys))


def _same(got, want, fields=("tokens", "num_tokens", "num_accepted", "num_uniforms", "valid",
                             "error")):
  for field in fields:
    np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                  np.asarray(getattr(want, field)), err_msg=field)


def _chain_reference(rule, u):
  _, _, p, q, draft, n = _case()
  body = sd.verify if rule == "token" else sd.block_verify
  return jax.vmap(lambda p, q, d, u, n: body(p, q, d, u, num_draft=n))(p, q, draft, u, n)


def _packed(rows_per_request, array):
  return np.concatenate([array[b, :rows_per_request(b)] for b in range(B)])


# --- chains: single, packed, vocab-parallel, vocab-parallel packed --------------------------


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_single_sequence_cells(rule, logits):
  """One sequence (batched by vmap, one key per sequence under vmap)."""
  tl, dl, p, q, draft, n = _case()
  for source in ("uniforms", "keys"):
    kwargs, u = _uniforms(source, GAMMA + 1)
    want = _chain_reference(rule, u)
    rnd = kwargs.get("uniforms", kwargs.get("key"))
    if logits:
      def call(t, d, x, r, n, temp, k, pp, source=source):
        extra = {"uniforms": r} if source == "uniforms" else {"key": r}
        return sd.verify_logits(t, d, x, params=sd.SamplingParams(temp, k, pp), num_draft=n,
                                rule=rule, **extra)
      got = jax.vmap(call)(tl, dl, draft, rnd, n, *PARAMS[:3])
    else:
      body = sd.verify if rule == "token" else sd.block_verify

      def call(p, q, x, r, n, source=source, body=body):
        extra = {"uniforms": r} if source == "uniforms" else {"key": r}
        return body(p, q, x, num_draft=n, **extra)
      got = jax.vmap(call)(p, q, draft, rnd, n)
    _same(got, want)


def test_the_key_argument_draws_the_documented_uniforms():
  """``key=`` is ``uniforms=jax.random.uniform(key, (count,))`` in the computation dtype (the
  one randomness form: the ``*_with_key`` twins were removed before 1.0)."""
  tl, dl, p, q, draft, _ = _case()
  key = jax.random.key(3)
  uniforms = jax.random.uniform(key, (p.shape[1],), jnp.float32)
  chain, logits = (p[0], q[0], draft[0]), (tl[0], dl[0], draft[0])
  for body, args in ((sd.verify, chain), (sd.block_verify, chain), (sd.verify_logits, logits)):
    _same(body(*args, key=key), body(*args, uniforms=uniforms))
  assert not any(name.endswith("_with_key") for name in sd.__all__)
  assert not hasattr(sd, "PackedTreeResult")


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("sharded", [False, True], ids=["packed", "vocab-parallel-packed"])
def test_packed_cells(rule, logits, sharded):
  tl, dl, p, q, draft, n = _case()
  ids = np.concatenate([draft[b, :n[b]] for b in range(B)]).astype(np.int32)
  target = _packed(lambda b: n[b] + 1, tl if logits else p)
  drafts = _packed(lambda b: n[b], dl if logits else q)
  rows = (dict(target_logits=target, draft_logits=drafts, params=PARAMS) if logits
          else dict(target_probs=target, draft_probs=drafts))
  if sharded:
    fn = sd.vocab_parallel_packed_verify(jax.make_mesh((8,), ("model",)), "model",
                                         max_spec_len=GAMMA, rule=rule)
  else:
    fn = functools.partial(sd.packed_verify, max_spec_len=GAMMA, rule=rule)
  for source in SOURCES:
    kwargs, u = _uniforms(source, GAMMA + 1)
    _same(fn(ids, n, **rows, **kwargs), _chain_reference(rule, u))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_vocab_parallel_cells(rule, logits):
  tl, dl, p, q, draft, n = _case()
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  fn = sd.vocab_parallel_verify(mesh, "model", "data", rule=rule,
                                inputs="logits" if logits else "probs")
  for source in SOURCES:
    kwargs, u = _uniforms(source, GAMMA + 1)
    if logits:
      got = fn(tl, dl, draft, params=PARAMS, num_draft=n, **kwargs)
    else:
      got = fn(p, q, draft, num_draft=n, **kwargs)
    _same(got, _chain_reference(rule, u))


def test_point_mass_drafts_in_every_chain_layout():
  """``q=None`` / no draft rows: the drafts are point masses (q = e_x) in every layout."""
  _, _, p, _, draft, n = _case()
  onehot = np.asarray(jax.nn.one_hot(draft, V, dtype=jnp.float32))
  kwargs, u = _uniforms("keys", GAMMA + 1)
  want = jax.vmap(lambda p, q, d, u, n: sd.verify(p, q, d, u, num_draft=n))(p, onehot, draft, u, n)
  got = jax.vmap(lambda p, d, u, n: sd.verify(p, None, d, u, num_draft=n))(p, draft, u, n)
  _same(got, want)
  fn = sd.vocab_parallel_verify(jax.make_mesh((8,), ("model",)), "model")
  _same(fn(p, None, draft, u, n), want)
  ids = np.concatenate([draft[b, :n[b]] for b in range(B)]).astype(np.int32)
  target = _packed(lambda b: n[b] + 1, p)
  _same(sd.packed_verify(ids, n, max_spec_len=GAMMA, target_probs=target, **kwargs), want)
  # Vocab-parallel packed: each device compares the draft id with its own global columns.
  packed = sd.vocab_parallel_packed_verify(jax.make_mesh((8,), ("model",)), "model",
                                           max_spec_len=GAMMA)
  _same(packed(ids, n, target_probs=target, **kwargs), want)


# --- trees: single, packed tree, vocab-parallel, vocab-parallel packed tree ----------------------


@functools.cache
def _tree_case():
  rng = np.random.default_rng(7)
  tl, dl = _logits(rng, (B, N, V)), _logits(rng, (B, N, V))
  process = jax.vmap(jax.vmap(lambda x, t, k, pp: sd.process_logits(
    x, sd.SamplingParams(t, k, pp)), in_axes=(0, None, None, None)))
  p, q = np.asarray(process(tl, *PARAMS[:3])), np.asarray(process(dl, *PARAMS[:3]))
  tokens = np.stack([[rng.choice(V, p=q[b, max(PARENTS[c], 0)] / q[b, max(PARENTS[c], 0)].sum())
                      for c in range(N)] for b in range(B)]).astype(np.int32)
  first = np.full(N, -1, np.int32)
  sibling = np.full(N, -1, np.int32)
  for c in range(1, N):
    kids = [k for k in range(1, N) if PARENTS[k] == PARENTS[c]]
    if kids[0] == c:
      first[PARENTS[c]] = c
    if kids.index(c) + 1 < len(kids):
      sibling[c] = kids[kids.index(c) + 1]
  return tl, dl, p, q, tokens, np.tile(first, (B, 1)), np.tile(sibling, (B, 1))


def _tree_reference(u, law="iid", layout="sequential"):
  _, _, p, q, tokens, _, _ = _tree_case()
  return jax.vmap(lambda p, q, t, u: sd.tree_verify(p, q, PARENTS, t, u, law=law,
                                                    uniform_layout=layout))(p, q, tokens, u)


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_single_tree_cells(logits):
  tl, dl, p, q, tokens, _, _ = _tree_case()
  for source in ("uniforms", "keys"):
    kwargs, u = _uniforms(source, N)
    rnd = kwargs.get("uniforms", kwargs.get("key"))

    def call(t, d, x, r, temp, k, pp, source=source):
      extra = {"uniforms": r} if source == "uniforms" else {"key": r}
      if logits:
        return sd.tree_verify_logits(t, d, PARENTS, x, params=sd.SamplingParams(temp, k, pp),
                                     **extra)
      return sd.tree_verify(t, d, PARENTS, x, **extra)

    rows = (tl, dl) if logits else (p, q)
    _same(jax.vmap(call)(*rows, tokens, rnd, *PARAMS[:3]), _tree_reference(u),
          ("tokens", "num_tokens", "num_accepted", "num_uniforms", "valid", "error", "path"))


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
@pytest.mark.parametrize("sharded", [False, True], ids=["packed-tree", "vp-packed-tree"])
def test_packed_tree_cells(logits, sharded):
  tl, dl, p, q, tokens, first, sibling = _tree_case()
  def flat(a):
    return a.reshape(B * N, V)

  rows = (dict(target_logits=flat(tl), draft_logits=flat(dl), params=PARAMS) if logits
          else dict(target_probs=flat(p), draft_probs=flat(q)))
  static = dict(max_depth=N - 1, law="iid", uniform_layout="sequential")
  if sharded:
    fn = sd.vocab_parallel_packed_tree_verify(jax.make_mesh((8,), ("model",)), "model", **static)
  else:
    fn = functools.partial(sd.packed_tree_verify, **static)
  for source in SOURCES:
    kwargs, u = _uniforms(source, N)
    got = fn(tokens, first, sibling, **rows, **kwargs)
    _same(got, _tree_reference(u), ("tokens", "num_tokens", "num_accepted", "num_uniforms",
                                    "valid", "error", "path"))


@pytest.mark.parametrize("logits", [False, True], ids=["probs", "logits"])
def test_vocab_parallel_tree_cells(logits):
  tl, dl, p, q, tokens, _, _ = _tree_case()
  fn = sd.vocab_parallel_tree_verify(jax.make_mesh((2, 4), ("data", "model")), "model", "data",
                                     inputs="logits" if logits else "probs")
  for source in SOURCES:
    kwargs, u = _uniforms(source, N)
    got = (fn(tl, dl, PARENTS, tokens, params=PARAMS, **kwargs) if logits
           else fn(p, q, PARENTS, tokens, **kwargs))
    _same(got, _tree_reference(u), ("tokens", "num_tokens", "num_accepted", "num_uniforms",
                                    "valid", "error", "path"))


# --- one result shape, what crosses devices --------------------------------------------------


def test_every_result_starts_with_the_same_six_fields():
  head = ("tokens", "num_tokens", "num_accepted", "num_uniforms", "valid", "error")
  for result in (sd.VerifyResult, sd.TreeVerifyResult, sd.PackedVerifyResult,
                 sd.PackedTreeVerifyResult):
    assert result._fields[:6] == head, result


def _vocab_parallel_hlo(layout: str, vocab: int) -> str:
  """Compiled HLO of a vocab-parallel verifier from logits with per-request top-k/top-p."""
  rng = np.random.default_rng(0)
  tl = rng.normal(size=(B, GAMMA + 1, vocab)).astype(np.float32)
  dl = rng.normal(size=(B, GAMMA, vocab)).astype(np.float32)
  draft = rng.integers(0, vocab, (B, GAMMA)).astype(np.int32)
  mesh = jax.make_mesh((8,), ("model",))
  key = jax.random.split(jax.random.key(0), B)
  if layout == "padded":
    fn = sd.vocab_parallel_verify(mesh, "model", inputs="logits")
    return fn.lower(tl, dl, draft, params=PARAMS, key=key).compile().as_text()
  fn = sd.vocab_parallel_packed_verify(mesh, "model", max_spec_len=GAMMA)
  n = np.full(B, GAMMA, np.int32)
  return fn.lower(draft.reshape(-1), n, target_logits=tl.reshape(-1, vocab),
                  draft_logits=dl.reshape(-1, vocab), params=PARAMS,
                  key=key).compile().as_text()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_vocab_parallel_logits_move_only_row_statistics(layout):
  """From vocab-sharded logits with per-request top-k/top-p: no collective carries a row.

  What crosses devices per row is scalars plus each shard's ``CANDIDATES`` largest logits and
  their ids, a bound that does not grow with ``V``: the largest collective is the same at
  ``V / n = 1000`` and ``4000``, and at most ``n * CANDIDATES`` per row (a gathered row slice
  would be ``V / n``; ``test_sharding`` shows that the same count catches one).
  """
  rows = B * (GAMMA + 1)
  small, large = (largest_collective(_vocab_parallel_hlo(layout, 8 * v)) for v in (1000, 4000))
  assert small == large
  assert small <= rows * 8 * CANDIDATES
