"""Tree (multi-draft) verification: exactness under each drafting law, and the contract.

Exactness is checked as in ``test_exactness.py``, on trees whose root has ``k``
children and every child ``m`` children (grandchildren are leaves):

* exact enumeration over every drafted tree (float64, the rule written out
  recursively): for every emitted prefix the conditional law of the next token
  equals the target row, to 1e-12;
* chi-square tests per position (position 0; position 1 given the first token;
  position 2 given the first two) on ``TRIALS`` vmapped ``tree_verify`` calls with
  fixed seeds. Family-wise ``ALPHA = 0.01`` with a Bonferroni correction over
  ``NUM_TESTS`` (an upper bound on the tests below), so a correct implementation
  fails a freshly seeded run with probability at most 1%.

Negative control: deterministic top-k children verified with the i.i.d. rule and
the draft's own ``q`` (a common mistake) fail both checks.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import ErrorCode
from specdec_jax import UniformStream
from specdec_jax import reference
from specdec_jax import verify
from specdec_jax._rules.tree import tree_verify
from tests._helpers import assert_same_distribution
from tests._helpers import random_case

ALPHA = 0.01
# (cases x laws + the per-node layout's 3 laws on one case) x (position 0, 1 | prefix, 2 | prefix)
NUM_TESTS = (2 * 3 + 3) * (1 + 4 + 16)
ALPHA_EACH = ALPHA / NUM_TESTS
TRIALS = 100_000
LAWS = ("iid", "without_replacement", "deterministic")


# ---------------------------------------------------------------------------------------------
# A fixed-shape tree: root, k children, m children each. Target and draft depend on the path.


class Case:
  """Target rows ``P1 (V,)``, ``P2 (V, V)``, ``P3 (V, V, V)`` and draft rows ``Q1``, ``Q2``."""

  def __init__(self, seed: int, vocab: int, k: int, m: int):
    rng = np.random.default_rng(seed)
    self.vocab, self.k, self.m = vocab, k, m
    self.p1 = rng.dirichlet(np.ones(vocab))
    self.p2 = rng.dirichlet(np.ones(vocab), size=vocab)
    self.p3 = rng.dirichlet(np.ones(vocab), size=(vocab, vocab))
    self.q1 = rng.dirichlet(np.ones(vocab))
    self.q2 = rng.dirichlet(np.ones(vocab), size=vocab)
    self.size = 1 + k + k * m
    self.parents = np.array([-1] + [0] * k + [1 + i for i in range(k) for _ in range(m)],
                            np.int32)

  def target(self, prefix: tuple[int, ...]) -> np.ndarray:
    return (self.p1, self.p2[prefix[0]] if prefix else None,
            self.p3[prefix[:2]] if len(prefix) >= 2 else None)[len(prefix)]

  def rows(self, tokens: np.ndarray):
    """``p, q`` of shape ``(..., N, V)`` for node tokens ``(..., N)``."""
    k, vocab = self.k, self.vocab
    child = tokens[..., 1 : 1 + k]
    grand = tokens[..., 1 + k :]
    parent_tok = np.repeat(child, self.m, axis=-1)
    batch = tokens.shape[:-1]
    p = np.concatenate([np.broadcast_to(self.p1, (*batch, 1, vocab)), self.p2[child],
                        self.p3[parent_tok, grand]], axis=-2)
    q = np.concatenate([np.broadcast_to(self.q1, (*batch, 1, vocab)), self.q2[child],
                        np.full((*batch, k * self.m, vocab), 1.0 / vocab)], axis=-2)
    return p, q


CASES = {"v3_k2_m2": Case(0, 3, 2, 2), "v4_k3_m1": Case(1, 4, 3, 1)}


def draw_children(rng: np.random.Generator, rows: np.ndarray, count: int, law: str) -> np.ndarray:
  """``count`` sibling tokens per row of ``rows (n, V)`` under ``law``: shape ``(n, count)``."""
  n = rows.shape[0]
  if law == "deterministic":  # top-k, ties by index
    return np.argsort(-rows, axis=-1, kind="stable")[:, :count]
  out = np.zeros((n, count), np.int64)
  weights = rows.copy()
  for j in range(count):
    cdf = np.cumsum(weights / weights.sum(-1, keepdims=True), axis=-1)
    cdf[:, -1] = np.inf
    out[:, j] = np.argmax(rng.random((n, 1)) < cdf, axis=-1)
    if law == "without_replacement":
      weights[np.arange(n), out[:, j]] = 0.0
  return out


def draw_trees(rng: np.random.Generator, case: Case, n: int, law: str) -> np.ndarray:
  """Node tokens ``(n, N)`` of ``n`` trees drafted under ``law`` (root token 0)."""
  child = draw_children(rng, np.broadcast_to(case.q1, (n, case.vocab)), case.k, law)
  grand = [draw_children(rng, case.q2[child[:, i]], case.m, law) for i in range(case.k)]
  return np.concatenate([np.zeros((n, 1), np.int64), child, *grand], axis=-1).astype(np.int32)


def sibling_probability(q: np.ndarray, tokens: tuple[int, ...], law: str) -> float:
  """Probability that the drafter produces the sibling tokens ``tokens`` from ``q``."""
  if law == "deterministic":
    return float(tuple(np.argsort(-q, kind="stable")[: len(tokens)]) == tokens)
  mass, left = 1.0, 1.0
  for j, x in enumerate(tokens):
    if law == "without_replacement":
      if x in tokens[:j]:
        return 0.0
      mass *= q[x] / left
      left -= q[x]
    else:
      mass *= q[x]
  return mass


# ---------------------------------------------------------------------------------------------
# The rule written out recursively in float64: the exact law of the emitted tokens of one tree.


def _normalize(w: np.ndarray) -> np.ndarray:
  return w / w.sum()


def node_law(p, q, parents, tokens, node: int, law: str, rule_law: str | None = None):
  """``{emitted tokens: probability}`` of the walk from ``node``."""
  rule_law = rule_law or law
  vocab = p.shape[1]
  children = [c for c in range(node + 1, len(parents)) if parents[c] == node]
  r = p[node].copy()
  q_left = q[node].copy()
  reach, out = 1.0, {}
  for c in children:
    x = int(tokens[c])
    if rule_law == "deterministic":
      q_j = np.eye(vocab)[x]
    elif rule_law == "without_replacement":
      q_j = _normalize(q_left)
    else:
      q_j = q[node]
    accept = 1.0 if q_j[x] == 0 and r[x] > 0 else min(1.0, r[x] / q_j[x]) if q_j[x] > 0 else 0.0
    for seq, mass in node_law(p, q, parents, tokens, c, law, rule_law).items():
      out[(x, *seq)] = out.get((x, *seq), 0.0) + reach * accept * mass
    reach *= 1 - accept
    w = np.maximum(r - q_j, 0)
    r = _normalize(w) if w.sum() > 0 else p[node]
    q_left[x] = 0.0
  for y in range(vocab):
    out[(y,)] = out.get((y,), 0.0) + reach * r[y]
  return out


def enumerate_law(case: Case, law: str, rule_law: str | None = None):
  """Exact law of the emitted tokens over every tree drafted under ``law``."""
  total: dict[tuple[int, ...], float] = {}
  v = range(case.vocab)
  for child in itertools.product(v, repeat=case.k):
    w_child = sibling_probability(case.q1, child, law)
    if w_child == 0:
      continue
    sibling_sets = list(itertools.product(v, repeat=case.m))
    for grand in itertools.product(*[sibling_sets] * case.k):
      weight = w_child * np.prod([sibling_probability(case.q2[c], g, law)
                                  for c, g in zip(child, grand, strict=True)])
      if weight == 0:
        continue
      tokens = np.array([0, *child, *itertools.chain(*grand)])
      p, q = case.rows(tokens)
      for seq, mass in node_law(p, q, case.parents, tokens, 0, law, rule_law).items():
        total[seq] = total.get(seq, 0.0) + weight * mass
  return total


def conditional_error(law_of_outputs: dict[tuple[int, ...], float], case: Case) -> float:
  """Largest |P(y_j = v | y_<j = prefix) - target(prefix)[v]| over all emitted prefixes."""
  rows: dict[tuple[int, ...], np.ndarray] = {}
  for seq, mass in law_of_outputs.items():
    for j in range(len(seq)):
      rows.setdefault(seq[:j], np.zeros(case.vocab))[seq[j]] += mass
  return max(float(np.max(np.abs(row / row.sum() - case.target(prefix))))
             for prefix, row in rows.items() if row.sum() > 0)


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_enumeration_every_prefix_gets_the_target_row(name, law):
  law_of_outputs = enumerate_law(CASES[name], law)
  assert abs(sum(law_of_outputs.values()) - 1) < 1e-12
  assert conditional_error(law_of_outputs, CASES[name]) < 1e-12


@pytest.mark.parametrize("name", sorted(CASES))
def test_enumeration_negative_control_topk_with_iid_rule_is_caught(name):
  law_of_outputs = enumerate_law(CASES[name], "deterministic", rule_law="iid")
  assert abs(sum(law_of_outputs.values()) - 1) < 1e-12
  assert conditional_error(law_of_outputs, CASES[name]) > 1e-3


def walk(p, q, parents, tokens, law: str, rng, per_node=None,
         per_parent=None) -> tuple[list[int], list[int], int]:
  """The rule written out in float64 with uniforms from ``rng``: ``(tokens, path, draws)``.

  ``per_node``: the engines' layout instead, child ``c``'s test reads ``per_node[c]`` and the
  final sample ``per_node[0]``. ``per_parent`` (sglang's): the tests among ``u``'s children
  read ``per_parent[u]``, rescaled to ``(coin - a) / (1 - a)`` after a rejection of acceptance
  probability ``a``, and the final sample reads the last node's coin."""
  vocab = p.shape[1]
  node, out, path, draws = 0, [], [], 0
  while True:
    r, q_left, removed, accepted = p[node].copy(), q[node].copy(), False, None
    coin = None if per_parent is None else per_parent[node]
    for c in (c for c in range(node + 1, len(parents)) if parents[c] == node):
      x = int(tokens[c])
      if law == "deterministic":
        q_j = np.eye(vocab)[x]
      elif law == "without_replacement" and removed:
        q_j = _normalize(q_left)
      else:
        q_j = q_left if law == "without_replacement" else q[node]
      u = rng.random() if per_node is None and coin is None else (
        coin if coin is not None else per_node[c])
      draws += 1
      ratio = np.inf if q_j[x] == 0 and r[x] > 0 else r[x] / q_j[x] if q_j[x] > 0 else 0.0
      if u < ratio:
        accepted = c
        break
      if coin is not None:
        a = min(1.0, ratio)
        coin = (coin - a) / (1 - a)
      w = np.maximum(r - q_j, 0)
      r = _normalize(w) if w.sum() > 0 else p[node]
      if law == "without_replacement":
        q_left[x], removed = 0.0, True
    if accepted is None:
      final = (UniformStream([coin]) if coin is not None else
               rng if per_node is None else UniformStream([per_node[0]]))
      return [*out, reference.sample(r / r.sum(), final)], path, draws + 1
    out.append(int(tokens[accepted]))
    path.append(accepted)
    node = accepted


@pytest.mark.parametrize("layout", ["sequential", "per_node", "per_parent"])
@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_agrees_with_the_rule_written_out(name, law, layout):
  """Uniform for uniform, float64: each law's sibling distribution q_j, the residual update and
  its normalisation, the fallback, the order in which uniforms are read (both layouts)."""
  case = CASES[name]
  rng = np.random.default_rng(11)
  trees = draw_trees(rng, case, 200, "iid")  # any tokens: duplicates, ids of q = 0, ...
  p, q = case.rows(trees)
  uniforms = rng.random((200, case.size))
  with jax.enable_x64(True):
    run = jax.jit(functools.partial(tree_verify, law=law, uniform_layout=layout))
    for b in range(200):
      r = run(p[b], q[b], case.parents, trees[b], uniforms[b])
      per_node = uniforms[b] if layout == "per_node" else None
      per_parent = uniforms[b] if layout == "per_parent" else None
      want, path, draws = walk(p[b], q[b], case.parents, trees[b], law,
                               UniformStream(uniforms[b]), per_node, per_parent)
      assert np.asarray(r.tokens)[: int(r.num_tokens)].tolist() == want, b
      assert np.asarray(r.path)[: int(r.num_accepted)].tolist() == path, b
      assert int(r.num_uniforms) == draws, b


# ---------------------------------------------------------------------------------------------
# Chi-square on the jitted, vmapped implementation.


@functools.cache
def _simulate(name: str, law: str, rule_law: str | None = None, seed: int = 0,
              layout: str = "sequential", share_final_with_child_1: bool = False,
              siblings_share_a_coin: bool = False):
  case = CASES[name]
  rng = np.random.default_rng(seed)
  tokens = draw_trees(rng, case, TRIALS, law)
  p, q = case.rows(tokens)
  uniforms = rng.random((TRIALS, case.size)).astype(np.float32)
  if share_final_with_child_1:  # the negative control: one coin read twice
    uniforms[:, 0] = uniforms[:, 1]
  if siblings_share_a_coin:  # per node, every child reads its parent's coin, not rescaled
    uniforms[:, 1:] = uniforms[:, np.maximum(case.parents[1:], 0)]
  run = jax.jit(jax.vmap(functools.partial(tree_verify, law=rule_law or law,
                                           uniform_layout=layout),
                         in_axes=(0, 0, None, 0, 0)))
  result = run(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32),
               jnp.asarray(case.parents), jnp.asarray(tokens), jnp.asarray(uniforms))
  return jax.device_get(result)


def _per_prefix(tokens: np.ndarray, num_tokens: np.ndarray, case: Case, label: str) -> int:
  tested = 0
  for j in range(3):
    emitted = num_tokens > j
    for prefix in itertools.product(range(case.vocab), repeat=j):
      rows = emitted & np.all(tokens[:, :j] == np.array(prefix, np.int32), axis=-1)
      if rows.sum() < 500:  # too few to test this prefix
        continue
      assert_same_distribution(tokens[rows, j], case.target(prefix), ALPHA_EACH,
                               f"{label} position {j} after {prefix}")
      tested += 1
  return tested


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_chi_square_per_position(name, law):
  result = _simulate(name, law)
  assert np.all(result.valid)
  tokens, num = np.asarray(result.tokens), np.asarray(result.num_tokens)
  assert np.all((tokens[:, 0] >= 0) & (tokens[:, 0] < CASES[name].vocab))
  assert _per_prefix(tokens, num, CASES[name], f"{name} {law}") >= 2
  assert (num >= 2).mean() > 0.2  # the trees do get used


@pytest.mark.parametrize("law", LAWS)
def test_chi_square_per_position_with_one_uniform_per_node(law):
  """The engines' layout: child c's test reads uniforms[c], the final sample uniforms[0]."""
  result = _simulate("v3_k2_m2", law, layout="per_node", seed=1)
  assert np.all(result.valid)
  tokens, num = np.asarray(result.tokens), np.asarray(result.num_tokens)
  assert _per_prefix(tokens, num, CASES["v3_k2_m2"], f"per-node {law}") >= 2


@pytest.mark.parametrize("law", LAWS)
def test_chi_square_per_position_with_one_coin_per_parent(law):
  """sglang's layout: the tests among u's children read uniforms[u], rescaled after each
  rejection; the final sample the last node's coin."""
  result = _simulate("v3_k2_m2", law, layout="per_parent", seed=2)
  assert np.all(result.valid)
  tokens, num = np.asarray(result.tokens), np.asarray(result.num_tokens)
  assert _per_prefix(tokens, num, CASES["v3_k2_m2"], f"per-parent {law}") >= 2


def test_negative_control_siblings_reading_one_coin_unrescaled_fails_the_chi_square():
  """One coin per parent read as is by every sibling (no rescaling after a rejection)."""
  result = _simulate("v3_k2_m2", "deterministic", layout="per_node", seed=2,
                     siblings_share_a_coin=True)
  with pytest.raises(AssertionError, match="chi-square"):
    _per_prefix(np.asarray(result.tokens), np.asarray(result.num_tokens), CASES["v3_k2_m2"],
                "siblings share a coin")


def test_negative_control_a_coin_read_twice_fails_the_chi_square():
  """Per node, but the final sample reuses child 1's coin: after rejecting child 1 the
  replacement depends on why it was rejected, and the first token's law is off."""
  result = _simulate("v3_k2_m2", "iid", layout="per_node", seed=1,
                     share_final_with_child_1=True)
  with pytest.raises(AssertionError, match="chi-square"):
    _per_prefix(np.asarray(result.tokens), np.asarray(result.num_tokens), CASES["v3_k2_m2"],
                "coin read twice")


@pytest.mark.parametrize("name", sorted(CASES))
def test_negative_control_topk_with_iid_rule_fails_the_chi_square(name):
  result = _simulate(name, "deterministic", rule_law="iid")
  with pytest.raises(AssertionError, match="chi-square"):
    _per_prefix(np.asarray(result.tokens), np.asarray(result.num_tokens), CASES[name], "wrong")


def test_num_uniforms_is_tests_plus_one():
  """Tests performed = rejected siblings along the path + accepted children."""
  result = _simulate("v3_k2_m2", "iid")
  num = np.asarray(result.num_uniforms)
  assert np.all((num >= result.num_tokens) & (num <= CASES["v3_k2_m2"].size))


# ---------------------------------------------------------------------------------------------
# The contract.

P_DOC = np.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]], np.float32)
Q_DOC = np.array([[0.5, 0.3, 0.2], [1 / 3] * 3, [1 / 3] * 3], np.float32)
PARENTS_DOC = np.array([-1, 0, 0], np.int32)
TOKENS_DOC = np.array([0, 0, 1], np.int32)


def test_worked_example_and_uniform_order():
  # Child 1 (token 0): 0.7 >= 0.2/0.5, rejected; residual [0, 2/3, 1/3]. Child 2 (token 1):
  # 0.9 < (2/3)/0.3, accepted. Node 2 is a leaf: bonus from p[2] with 0.1 -> token 0.
  r = tree_verify(P_DOC, Q_DOC, PARENTS_DOC, TOKENS_DOC, np.array([0.7, 0.9, 0.1], np.float32))
  assert r.tokens.tolist() == [1, 0, -1] and r.path.tolist() == [2, -1, -1]
  assert (int(r.num_tokens), int(r.num_accepted), int(r.num_uniforms)) == (2, 1, 3)
  assert bool(r.valid)
  # Both rejected: child 2 (token 0) has residual 0, so it is rejected too; the residual
  # becomes max([0, 2/3, 1/3] - q[0], 0) ~ [0, 0.73, 0.27], sampled with 0.5 -> token 1.
  r = tree_verify(P_DOC, Q_DOC, PARENTS_DOC, np.array([0, 0, 0], np.int32),
                  np.array([0.7, 0.9, 0.5], np.float32))
  assert r.tokens.tolist() == [1, -1, -1] and int(r.num_uniforms) == 3
  # Accepted at once: the second child is never tested; slot 2 is never read (NaN is fine).
  r = tree_verify(P_DOC, Q_DOC, PARENTS_DOC, TOKENS_DOC,
                  np.array([0.1, 0.3, np.nan], np.float32))
  assert r.tokens.tolist() == [0, 2, -1] and r.path.tolist() == [1, -1, -1]
  assert int(r.num_uniforms) == 2 and bool(r.valid)


@pytest.mark.parametrize("law", ["iid", "without_replacement"])
@pytest.mark.parametrize("kind", ["overlap", "peaked", "one_hot", "disjoint", "equal", "zero_q"])
def test_single_chain_is_verify(kind, law):
  rng = np.random.default_rng(7)
  gamma, vocab, n = 4, 6, 500
  p, q, draft = random_case(rng, gamma, vocab, kind)
  p32, q32 = jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32)
  q_tree = jnp.concatenate([q32, jnp.full((1, vocab), 1 / vocab, jnp.float32)])
  parents = jnp.arange(-1, gamma, dtype=jnp.int32)
  tokens = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.asarray(draft)])
  uniforms = jnp.asarray(rng.random((n, gamma + 1)), jnp.float32)
  mine = jax.vmap(lambda u: tree_verify(p32, q_tree, parents, tokens, u, law=law))(uniforms)
  theirs = jax.vmap(lambda u: verify(p32, q32, jnp.asarray(draft), u))(uniforms)
  np.testing.assert_array_equal(mine.tokens, theirs.tokens)
  np.testing.assert_array_equal(mine.num_tokens, theirs.num_tokens)
  np.testing.assert_array_equal(mine.num_uniforms, theirs.num_uniforms)
  np.testing.assert_array_equal(mine.valid, theirs.valid)
  expected_path = np.where(np.arange(gamma + 1) < np.asarray(theirs.num_accepted)[:, None],
                           np.arange(1, gamma + 2), -1)
  np.testing.assert_array_equal(mine.path, expected_path)


def test_ragged_trees_under_jit_and_vmap():
  case = CASES["v3_k2_m2"]
  rng = np.random.default_rng(3)
  tokens = draw_trees(rng, case, 3, "iid")
  p, q = case.rows(tokens)
  parents = np.tile(case.parents, (3, 1))
  sizes = np.array([7, 3, 1], np.int32)
  # Garbage in the unused nodes must not matter.
  parents[1, 3:], tokens[1, 3:] = rng.integers(-3, 9, size=4), -5
  parents[2, 1:], tokens[2, 1:] = 0, 99
  uniforms = rng.random((3, case.size)).astype(np.float32)
  f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
  batch = jax.jit(jax.vmap(tree_verify))(f32(p), f32(q), jnp.asarray(parents), jnp.asarray(tokens),
                                         f32(uniforms), num_nodes=jnp.asarray(sizes))
  assert np.all(batch.valid)
  for b, size in enumerate(sizes):
    one = tree_verify(f32(p[b, :size]), f32(q[b, :size]), jnp.asarray(parents[b, :size]),
                      jnp.asarray(tokens[b, :size]), f32(uniforms[b, :size]))
    length = int(size)
    np.testing.assert_array_equal(batch.tokens[b, :length], one.tokens)
    assert np.all(np.asarray(batch.tokens[b, length:]) == -1)
    assert int(batch.num_tokens[b]) == int(one.num_tokens)
    assert int(batch.num_uniforms[b]) == int(one.num_uniforms)
  assert int(batch.num_tokens[2]) == 1 and int(batch.num_uniforms[2]) == 1


def test_with_key_matches_explicit_uniforms():
  key = jax.random.key(5)
  a = tree_verify(P_DOC, Q_DOC, PARENTS_DOC, TOKENS_DOC, law="without_replacement", key=key)
  u = jax.random.uniform(key, (3,), jnp.float32)
  b = tree_verify(P_DOC, Q_DOC, PARENTS_DOC, TOKENS_DOC, u, law="without_replacement")
  assert a.tokens.tolist() == b.tokens.tolist() and int(a.num_uniforms) == int(b.num_uniforms)
  keys = jax.random.split(key, 4)
  batch = jax.vmap(lambda k: tree_verify(P_DOC, Q_DOC, PARENTS_DOC, TOKENS_DOC, key=k))(keys)
  assert batch.tokens.shape == (4, 3) and np.all(batch.valid)


def test_max_depth_truncates():
  case = CASES["v3_k2_m2"]
  tokens = draw_trees(np.random.default_rng(0), case, 1, "iid")[0]
  p, q = case.rows(tokens)
  r = tree_verify(jnp.asarray(p, jnp.float32), jnp.asarray(q, jnp.float32), case.parents, tokens,
                  np.full(case.size, 0.0, np.float32), max_depth=1)
  assert r.tokens.shape == (2,) and int(r.num_tokens) <= 2 and bool(r.valid)


def _bad(**changes):
  args = {"p": P_DOC.copy(), "q": Q_DOC.copy(), "parents": PARENTS_DOC.copy(),
          "tokens": TOKENS_DOC.copy(), "uniforms": np.array([0.7, 0.9, 0.1], np.float32)}
  num_nodes = changes.pop("num_nodes", 3)
  law = changes.pop("law", "iid")
  for name, (index, value) in changes.items():
    args[name][index] = value
  return tree_verify(*(jnp.asarray(args[k]) for k in ("p", "q", "parents", "tokens", "uniforms")),
                     num_nodes=jnp.int32(num_nodes), law=law)  # jitted: num_nodes is traced


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize(("changes", "code"), [
  ({"p": ((0, 0), np.nan)}, ErrorCode.NONFINITE),
  ({"p": ((0, 0), -0.2)}, ErrorCode.NEGATIVE),
  ({"p": ((0, 2), 0.9)}, ErrorCode.NOT_NORMALIZED),
  ({"tokens": (1, 7)}, ErrorCode.DRAFT_OUT_OF_RANGE),
  ({"tokens": (1, -1)}, ErrorCode.DRAFT_OUT_OF_RANGE),
  ({"uniforms": (0, 1.5)}, ErrorCode.UNIFORM_OUT_OF_RANGE),
  ({"uniforms": (0, np.nan)}, ErrorCode.UNIFORM_OUT_OF_RANGE),
  ({"parents": (2, 2)}, ErrorCode.BAD_PARAMS),
  ({"num_nodes": 9}, ErrorCode.BAD_NUM_DRAFT),
  ({"num_nodes": 0}, ErrorCode.BAD_NUM_DRAFT),
])
def test_bad_values_are_flagged_under_jit(changes, code, law):
  result = _bad(law=law, **dict(changes))
  assert int(result.error) & code.value, (int(result.error), code)
  assert not bool(result.valid)
  emitted = np.asarray(result.tokens)[: int(result.num_tokens)]
  assert np.all((emitted >= 0) & (emitted < 3))


@pytest.mark.parametrize("u", [0.0, 0.2, 0.45, 0.55, 0.8, 0.99])
def test_empty_residual_falls_back_to_p_not_q(u):
  """Without replacement, an empty residual is reachable in exact arithmetic.

  Node 0 has children with tokens 0 and 1. Token 0 has p = 0: rejected; the residual is
  ``normalize(max(p - q, 0)) = [0, 0, .5, .5]``, which equals ``q`` with token 0 removed and
  renormalised. Token 1 (draft probability 0, target probability 0) is rejected too, and
  ``max(r - q_j, 0)`` is exactly 0: the final token comes from ``p[0]`` (tokens 2, 3), never
  from ``q[0]`` (whose mass is mostly on token 0).
  """
  p = np.array([[0.0, 0.0, 0.5, 0.5], [0.25] * 4, [0.25] * 4], np.float32)
  q = np.array([[0.5, 0.0, 0.25, 0.25], [0.25] * 4, [0.25] * 4], np.float32)
  parents, tokens = np.array([-1, 0, 0], np.int32), np.array([0, 0, 1], np.int32)
  r = tree_verify(p, q, parents, tokens, np.array([0.3, 0.7, u], np.float32),
                  law="without_replacement")
  want = 2 if u < 0.5 else 3
  assert (int(r.num_accepted), int(r.num_uniforms)) == (0, 3)
  assert r.tokens.tolist() == [want, -1, -1]
  assert bool(r.valid)


@pytest.mark.parametrize("u", [0.2, 0.45, 0.6, 0.9])
def test_fallback_restores_the_target_weight_of_a_rejected_token(u):
  """After an empty residual the walk falls back to ``p[u]`` *whole*: a token rejected earlier
  at that node gets its target weight back (it was frozen at its residual weight).

  ``p[0] = [.5, 0, .25, .25]``, ``q[0] = [.75, 0, .125, .125]``, children with tokens 0 and 1
  drawn without replacement. Coin 0.9 rejects token 0 (accepted with 2/3); the residual is then
  ``[0, 0, .5, .5]``, which is ``q`` without token 0, renormalised: token 1 (q = p = 0) is
  rejected and ``max(r - q_j, 0)`` is exactly 0. The final token comes from ``p[0]``: token 0
  for a final uniform below 0.5, else 2 or 3.
  """
  p = np.array([[0.5, 0.0, 0.25, 0.25], [0.25] * 4, [0.25] * 4], np.float32)
  q = np.array([[0.75, 0.0, 0.125, 0.125], [0.25] * 4, [0.25] * 4], np.float32)
  parents, tokens = np.array([-1, 0, 0], np.int32), np.array([0, 0, 1], np.int32)
  r = tree_verify(p, q, parents, tokens, np.array([0.9, 0.3, u], np.float32),
                  law="without_replacement")
  want = 0 if u < 0.5 else (2 if u < 0.75 else 3)
  assert (int(r.num_accepted), int(r.num_uniforms)) == (0, 3)
  assert r.tokens.tolist() == [want, -1, -1]
  assert bool(r.valid)


def test_bad_q_row_flagged_only_when_read():
  result = _bad(q=((0, 0), np.nan))
  assert int(result.error) & ErrorCode.NONFINITE.value
  result = _bad(q=((0, 0), np.nan), law="deterministic")  # q is not read
  assert bool(result.valid)
  result = _bad(q=((1, 0), np.nan))  # node 1 is rejected, its q row never read
  assert bool(result.valid)


def test_trace_time_checks():
  u = np.zeros(3, np.float32)
  with pytest.raises(ValueError, match="law"):
    tree_verify(P_DOC, Q_DOC, PARENTS_DOC, TOKENS_DOC, u, law="greedy")
  with pytest.raises(ValueError, match="uniforms"):
    tree_verify(P_DOC, Q_DOC, PARENTS_DOC, TOKENS_DOC, u[:2])
  with pytest.raises(ValueError, match="vmap"):
    tree_verify(P_DOC[None], Q_DOC, PARENTS_DOC, TOKENS_DOC, u)
