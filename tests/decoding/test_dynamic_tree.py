"""EAGLE-2's dynamic draft tree (:class:`DynamicTree`): construction, agreement, exactness.

The construction is checked against a plain-Python EAGLE-2 (expansion then reranking, written
over token paths) on a draft whose logits depend on the whole path; the loop against plain
greedy decoding, against the static trees it must reduce to, and against exact enumeration of
the sequence law (chi-square at ``ALPHA = 0.01``, fixed seeds; the negative control, the same
tree verified with a rule that treats the top-k children as samples of ``q``, must be rejected
at ``1e-6``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams
from specdec_jax import tree_verify
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding import DynamicTree
from specdec_jax.decoding import generate
from specdec_jax.decoding import tree_speculative_generate
from specdec_jax.decoding.dynamic_tree import draft_dynamic_tree
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model
from specdec_jax.theory import chi_square_test
from tests._helpers import TOY_PROMPT_LENGTHS
from tests._helpers import TOY_PROMPTS
from tests.decoding import _exact as exact

GREEDY = SamplingParams(temperature=0.0)
V = 16
TARGET = make_toy_model(jax.random.key(0), V, name="target")
PERFECT = make_toy_feature_draft(TARGET)
NOISY = make_toy_feature_draft(TARGET, noise=1.5, key=jax.random.key(3),
                               vocab_ids=np.arange(0, V, 2))  # q = 0 on odd ids
PROMPTS, PROMPT_LENGTHS = TOY_PROMPTS[:5], TOY_PROMPT_LENGTHS[:5]
MAX_NEW = 12


# ---------------------------------------------------------------------------------------------
# The construction against a plain-Python EAGLE-2.

K_DRAFT, ROWS = 7, 3
TABLE = np.round(np.random.default_rng(0).normal(size=(97, K_DRAFT)), 1) + 0.0  # ties; no -0.0
IDS = np.array([3, 9, 0, 14, 5, 11, 7], np.int32)  # the draft vocabulary's target ids


def _code(path: tuple[int, ...], row: int) -> int:
  code = row + 1
  for token in path:
    code = (code * 31 + int(token) + 1) % 9973
  return code


def _logits(path, row) -> np.ndarray:
  return TABLE[_code(path, row) % len(TABLE)]


def _reference(tree: DynamicTree, row: int):
  """EAGLE-2 over token paths: ``[(path, score)]`` of the chosen nodes in candidate order."""
  def top(path, score):
    logits = _logits(path, row)
    logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    order = np.argsort(-logits, kind="stable")[: tree.top_k]
    return [((*path, int(IDS[i])), score + logp[i]) for i in order]

  levels = [top((), 0.0)]
  for _ in range(1, tree.depth):
    best = sorted(range(len(levels[-1])), key=lambda i: (-levels[-1][i][1], i))[: tree.top_k]
    levels.append([child for i in best for child in top(*levels[-1][i])])
  candidates = [c for level in levels for c in level]
  best = sorted(range(len(candidates)), key=lambda i: (-candidates[i][1], i))[: tree.num_draft]
  return [candidates[i] for i in sorted(best)]


def _level_call(tokens, features, positions, cache, nodes, mask):
  """A draft whose features carry a code of the path, and whose logits are ``TABLE[code]``;
  the cache records what each call was given."""
  code = (features[..., 0].astype(jnp.int32) * 31 + tokens + 1) % 9973
  cache.append((np.asarray(features[..., 0]), np.asarray(code), np.asarray(positions),
                np.asarray(nodes), np.asarray(mask)))
  return jnp.asarray(TABLE, jnp.float32)[code % len(TABLE)], code[..., None].astype(
    jnp.float32), cache


def _check_draft_calls(calls, tree: DynamicTree, root_codes, root):
  """Each level's call: ``top_k`` new slots at position ``root + d``, each seeing its own slot
  and its ancestors' (found by the codes: a node reads the code its parent's call wrote)."""
  slot_code = {(b, 0): int(c) for b, c in enumerate(root_codes)}
  ancestors = {(b, 0): {0} for b in range(len(root_codes))}
  assert len(calls) == tree.depth - 1
  for d, (parent_codes, codes, positions, nodes, mask) in enumerate(calls, start=1):
    np.testing.assert_array_equal(nodes, np.arange(1 + (d - 1) * tree.top_k, 1 + d * tree.top_k))
    np.testing.assert_array_equal(positions, np.broadcast_to(root[:, None] + d, positions.shape))
    for b in range(len(root_codes)):
      for t, slot in enumerate(nodes):
        parent = [s for (r, s), c in slot_code.items() if r == b and c == parent_codes[b, t]]
        assert len(parent) == 1, (d, b, t)
        ancestors[b, slot] = ancestors[b, parent[0]] | {int(slot)}
        assert set(np.flatnonzero(mask[b, t]).tolist()) == ancestors[b, slot], (d, b, t)
      for t, slot in enumerate(nodes):
        slot_code[b, int(slot)] = int(codes[b, t])


@pytest.mark.parametrize("tree", [DynamicTree(3, 3, 7), DynamicTree(2, 4, 12),
                                  DynamicTree(4, 2, 20), DynamicTree(1, 3, 3)])
def test_expansion_and_reranking_match_a_plain_python_eagle2(tree):
  rows = np.arange(ROWS)
  root_logits = jnp.asarray(np.stack([_logits((), r) for r in rows]), jnp.float32)
  root_features = jnp.asarray((rows + 1)[:, None], jnp.float32)
  root = np.array([4, 9, 6], np.int32)
  drafted, calls = draft_dynamic_tree(tree, _level_call, jnp.zeros(ROWS, jnp.int32), root_logits,
                                      root_features, [], jnp.asarray(root),
                                      vocab_ids=jnp.asarray(IDS), vocab=16)
  _check_draft_calls(calls, tree, rows + 1, root)
  tokens, parents, depths, mask = (np.asarray(a) for a in drafted[:4])
  assert drafted.q is None
  for row in rows:
    paths = [()]
    for c in range(1, tree.size):
      assert 0 <= parents[row, c] < c and depths[row, c] == depths[row, parents[row, c]] + 1
      paths.append((*paths[parents[row, c]], int(tokens[row, c])))
      assert mask[row, c].sum() == depths[row, c] + 1 and mask[row, c, c]
      np.testing.assert_array_equal(mask[row, c], mask[row, parents[row, c]] | (
        np.arange(tree.size) == c))
    assert (np.diff(depths[row]) >= 0).all()
    expected = [path for path, _ in _reference(tree, row)]
    assert paths[1:] == expected, f"row {row}"
    for c in range(tree.size):  # siblings are distinct tokens
      siblings = tokens[row, 1:][parents[row, 1:] == c]
      assert len(set(siblings.tolist())) == len(siblings)


# ---------------------------------------------------------------------------------------------
# The loop: greedy agreement, reduction to static trees.


@functools.cache
def _plain_greedy():
  return generate(TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), max_new_tokens=MAX_NEW,
                  params=GREEDY)


@pytest.mark.parametrize("draft", ["perfect", "noisy"])
def test_greedy_equals_plain_greedy(draft):
  out = tree_speculative_generate(TARGET, {"perfect": PERFECT, "noisy": NOISY}[draft], PROMPTS,
                                  PROMPT_LENGTHS, jax.random.key(0),
                                  tree=DynamicTree(4, 3, 8), max_new_tokens=MAX_NEW,
                                  params=GREEDY)
  np.testing.assert_array_equal(out.tokens, _plain_greedy().tokens)
  np.testing.assert_array_equal(out.error, 0)
  s = jax.tree.map(np.asarray, out.stats)
  np.testing.assert_array_equal(out.num_new, s.row_target_calls + s.accepted)
  assert (s.proposals <= 8 * (s.row_target_calls - 1)).all()
  if draft == "perfect":  # the draft is the target: more than 2 tokens per call
    assert s.emitted.sum() > 2.5 * s.row_target_calls.sum(), s.row_target_calls


@pytest.mark.parametrize(("dynamic", "static"), [
  (DynamicTree(1, 3, 3), DraftTree.from_branching((1, 1, 1))),
  (DynamicTree(3, 2, 12), DraftTree.from_branching((3, 3)))])
def test_reduces_to_the_static_tree_it_spans(dynamic, static):
  """One candidate per level is a chain; depth 2 with every candidate kept is the full tree:
  sampled token for token alike (the same uniforms, the same tree in the same order)."""
  keys = jax.random.split(jax.random.key(5), len(PROMPTS))
  run = functools.partial(tree_speculative_generate, TARGET, NOISY, PROMPTS, PROMPT_LENGTHS,
                          keys, max_new_tokens=MAX_NEW, params=SamplingParams(1.0))
  a, b = run(tree=dynamic), run(tree=static)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.stats.accepted_at, b.stats.accepted_at)


# ---------------------------------------------------------------------------------------------
# Sampling exactness: whole sequences against exact enumeration.

# The shared setup (tests/decoding/_exact.py).
EXACT_TREE = DynamicTree(2, 3, 5)


def _counts(seed: int, verifier=None):
  out = tree_speculative_generate(exact.TARGET, exact.FEATURES, *exact.batch(),
                                  jax.random.key(seed), tree=EXACT_TREE,
                                  max_new_tokens=exact.NEW, params=exact.PARAMS,
                                  tree_verifier=verifier)
  np.testing.assert_array_equal(out.error, 0)
  return exact.counts(out), out


def test_sampled_sequences_follow_the_target():
  """Chi-square over all 256 continuations at ALPHA = 0.01 (the false-failure rate)."""
  probs = exact.probs()
  counts, out = _counts(seed=600)
  stats = jax.tree.map(np.asarray, out.stats)
  assert (stats.accepted == 0).any() and (stats.accepted_at[:, 1] > 0).any()
  _, _, pvalue, detail = chi_square_test(counts, probs)
  assert pvalue >= 0.01, f"chi-square p = {pvalue:.3g}; {detail}"
  # The negative control: top-k children verified as if they were samples of q.
  wrong = functools.partial(tree_verify, law="iid", max_depth=EXACT_TREE.depth)
  counts, _ = _counts(seed=601, verifier=wrong)
  _, _, pvalue, detail = chi_square_test(counts, probs)
  assert pvalue < 1e-6, f"the iid rule on top-k children went undetected (p = {pvalue:.3g})"


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize(("kwargs", "match"), [
  (dict(tree=DynamicTree(0, 2, 1)), r"`tree.top_k` must be an int >= 1, got 0"),
  (dict(tree=DynamicTree(2, 2, 7)), r"`tree.num_draft` must be at most .* = 6 .* got 7"),
  (dict(tree=DynamicTree(2, 2.0, 3)), r"`tree.depth` must be an int >= 1, got 2.0"),
  (dict(tree=DynamicTree(9, 2, 3)), r"the tree asks for the top 9 candidates per node, but the "
                                     r"draft's vocabulary has only 8"),
  (dict(tree=DynamicTree(2, 2, 3), law="iid"), r"a DynamicTree \(EAGLE-2\) needs a FeatureDraft "
                                                r"and law='deterministic'"),
  (dict(tree=DynamicTree(2, 2, 3), draft=TARGET), r"a DynamicTree .* got a Model draft"),
])
def test_bad_dynamic_trees_are_named(kwargs, match):
  draft = kwargs.pop("draft", NOISY)
  with pytest.raises(ValueError, match="tree_speculative_generate: " + match):
    tree_speculative_generate(TARGET, draft, PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                              max_new_tokens=4, **kwargs)
