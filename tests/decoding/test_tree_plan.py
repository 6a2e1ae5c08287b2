"""plan_tree: the tree it picks is the best of every tree (exhaustive search), its expected tokens
are what the top-k tree verifier emits (simulated, chi-square with a negative control), and the
shape follows the cost curve (wide when calls are cheap, a chain or nothing when they are not)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specdec_jax import tree_verify
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding.tree_plan import plan_tree
from specdec_jax.decoding.tree_plan import tree_expected_tokens


def every_tree(depth: int, ranks: int):
  """Every DraftTree within ``depth`` x ``ranks`` (prefix- and sibling-closed sets of paths)."""
  full = [p for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
  for mask in range(1, 1 << len(full)):
    paths = {p for i, p in enumerate(full) if mask >> i & 1}
    if all((len(p) == 1 or p[:-1] in paths) and (p[-1] == 0 or (*p[:-1], p[-1] - 1) in paths)
           for p in paths):
      yield DraftTree.from_paths(paths)


@pytest.mark.parametrize("seed", range(6))
def test_the_plan_is_the_best_tree_of_all(seed):
  """Exhaustive: all 2 x 3 trees (and plain decoding) against the plan's E / C, with draft
  levels priced, on random acceptance tables (decreasing in rank) and cost curves."""
  rng = np.random.default_rng(seed)
  a = np.sort(rng.dirichlet(np.ones(4), size=2)[:, :3], axis=1)[:, ::-1]
  call = np.concatenate([[1.0], 1.0 + np.cumsum(rng.uniform(0.0, 0.25, size=7))])
  draft, fixed = rng.uniform(0, 0.05), rng.uniform(0, 0.1)
  best = 1.0 / call[0]
  for tree in every_tree(2, 3):
    n = tree.size - 1
    if n < call.size:
      best = max(best, tree_expected_tokens(tree, a) / (call[n] + fixed + tree.depth * draft))
  plan = plan_tree(a, call, draft_cost=draft, fixed_cost=fixed)
  assert plan.expected_tokens / plan.cost == pytest.approx(best, rel=1e-12)
  if plan.tree is not None:
    assert tree_expected_tokens(plan.tree, a) == pytest.approx(plan.expected_tokens)
    assert plan.cost == pytest.approx(call[plan.tree.size - 1] + fixed + plan.tree.depth * draft)
  assert plan.speedup == pytest.approx(best * call[0])


def test_the_shape_follows_the_cost_curve():
  acc = np.array([[0.55, 0.15, 0.08, 0.05], [0.5, 0.12, 0.05, 0.02], [0.45, 0.1, 0.0, 0.0]])
  cheap = plan_tree(acc, 1.0 + 0.01 * np.arange(16))
  assert cheap.tree.size - 1 >= 8 and max(np.bincount(cheap.tree.parents[1:])) >= 3
  costly = plan_tree(acc, 1.0 + 0.3 * np.arange(16))  # each token a third of a step
  assert costly.tree is not None and set(costly.tree.ranks) == {0}  # a chain
  assert plan_tree(acc, 1.0 + 1.0 * np.arange(16)).tree is None  # plain decoding is faster
  # The curve reports every size, and its best entry is the plan.
  sizes = [n for n, _, _ in cheap.curve]
  assert sizes == list(range(16))
  assert max(e / c for _, e, c in cheap.curve) == pytest.approx(
    cheap.expected_tokens / cheap.cost)


@pytest.mark.parametrize("bad, match", [
  (dict(acceptance=[0.5, 0.2]), "`acceptance` must be a non-empty"),
  (dict(acceptance=[[0.7, 0.6]]), r"`acceptance\[0\]` must sum to at most 1"),
  (dict(acceptance=[[np.nan, 0.1]]), "`acceptance` entries must be probabilities"),
  (dict(call_cost=[1.0, 0.0]), "`call_cost` must be"),
  (dict(draft_cost=-1.0), "`draft_cost` must be"),
  (dict(fixed_cost=float("inf")), "`fixed_cost` must be"),
])
def test_bad_input_is_named(bad, match):
  args = dict(acceptance=[[0.5, 0.2]], call_cost=[1.0, 1.1, 1.2], draft_cost=0.0, fixed_cost=0.0)
  args.update(bad)
  with pytest.raises(ValueError, match=f"plan_tree: {match}"):
    plan_tree(args.pop("acceptance"), args.pop("call_cost"), **args)


def simulated_accepted(tree: DraftTree, p_by_depth: np.ndarray, n: int, seed: int) -> np.ndarray:
  """Accepted tokens per iteration of ``tree_verify`` (law ``deterministic``) over ``n`` draws,
  where every node at depth ``d`` has the target row ``p_by_depth[d]`` and the rank-``r``
  candidate is token ``r``."""
  depths = tree.depths()
  p = jnp.asarray(p_by_depth[depths], jnp.float32)
  tokens = jnp.asarray(tree.ranks, jnp.int32).at[0].set(0)
  parents = jnp.asarray(tree.parents, jnp.int32)
  uniforms = jax.random.uniform(jax.random.key(seed), (n, tree.size))
  run = jax.jit(jax.vmap(lambda u: tree_verify(p, p, parents, tokens, u,
                                               law="deterministic").num_accepted))
  return np.asarray(run(uniforms))


def test_expected_tokens_are_what_the_top_k_tree_verifier_emits():
  """The law of accepted depths under ``tree_verify(law="deterministic")`` is the plan's model
  with ``a[d, r] = p_d(c_r)``: chi-square on the accepted count, significance 1e-3 (the test's
  false-failure rate); the negative control, the chain rule's ``min(1, p / q)`` with the
  draft's ``q`` (not the law of a top-k tree), must be rejected."""
  tree = DraftTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)])
  p = np.array([[0.35, 0.2, 0.1, 0.2, 0.1, 0.05], [0.4, 0.15, 0.2, 0.1, 0.1, 0.05],
                [1 / 6] * 6])
  n = 40_000
  counts = np.bincount(simulated_accepted(tree, p, n, seed=0), minlength=3)

  def law(a):  # P(accepted = 0, 1, 2) of this tree under the acceptance table a
    reach1 = a[0, :3]
    deeper = reach1[0] * a[1, :2].sum() + reach1[1] * a[1, 0]
    return np.array([1 - reach1.sum(), reach1.sum() - deeper, deeper])

  model = law(p[:2, :3])
  assert counts @ np.arange(3) / n + 1 == pytest.approx(
    tree_expected_tokens(tree, p[:2, :3]), abs=0.02)
  assert stats.chisquare(counts, model * n).pvalue > 1e-3
  q = np.array([0.3, 0.3, 0.2, 0.1, 0.05, 0.05])  # a draft whose top-3 are the candidates
  wrong = np.minimum(1.0, p[:2, :3] / q[:3]) * q[:3]
  assert stats.chisquare(counts, law(wrong) / law(wrong).sum() * n).pvalue < 1e-3
