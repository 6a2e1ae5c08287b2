"""Tree drafts in the decoding loop: greedy agreement, sequence exactness, ragged rows, budgets.

The toy models' ``tree_apply`` reads each node's parent slot (tree attention for an n-gram
model), so their sequence distribution stays enumerable. The toy feature draft (EAGLE-style,
:func:`~specdec_jax.models.toy.make_toy_feature_draft`) reads the previous token off the feature
it is handed, so without noise it is the target exactly when every tree node gets its parent's
feature. Chi-square tests use fixed seeds and a family-wise ``ALPHA = 0.01`` over the four
exactness tests of this module (Bonferroni); each negative control must be rejected at ``1e-6``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import ErrorCode
from specdec_jax import SamplingParams
from specdec_jax import tree_verify
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding import generate
from specdec_jax.decoding import tree_speculative_generate
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model
from tests._helpers import TOY_PROMPT_LENGTHS
from tests._helpers import TOY_PROMPTS
from tests.decoding import _exact as exact

ALPHA = 0.01
NUM_EXACT_TESTS = 4  # one per drafting law and draft kind (model, feature)
GREEDY = SamplingParams(temperature=0.0)
V = 16
TARGET = make_toy_model(jax.random.key(0), V, name="target")
SMALL = make_toy_model(jax.random.key(1), V, context=1, name="small")
NEAR = TARGET._replace(params={"table": TARGET.params["table"] + 1.5 * jax.random.normal(
  jax.random.key(2), TARGET.params["table"].shape)}, name="near")
PERFECT_FEATURES = make_toy_feature_draft(TARGET)
NOISY_FEATURES = make_toy_feature_draft(TARGET, noise=1.5, key=jax.random.key(3),
                                        vocab_ids=np.arange(0, V, 2))  # q = 0 on odd ids
PROMPTS, PROMPT_LENGTHS = TOY_PROMPTS[:5], TOY_PROMPT_LENGTHS[:5]
MAX_NEW = 12
TREES = {
  "chain": DraftTree.from_branching((1, 1, 1)),
  "wide": DraftTree.from_branching((4, 2)),
  "eagle": DraftTree.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0),
                                 (0, 0, 0, 0)]),
}


@functools.cache
def _plain_greedy():
  return generate(TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), max_new_tokens=MAX_NEW,
                  params=GREEDY)


def _check_stats(out, tree: DraftTree, eos: bool = False):
  s = jax.tree.map(np.asarray, out.stats)
  np.testing.assert_array_equal(s.emitted, out.num_new)
  assert s.accepted_at.shape == (len(PROMPTS), tree.depth)
  np.testing.assert_array_equal(s.accepted, s.accepted_at.sum(-1))
  assert (s.accepted_at <= s.proposed_at).all()
  assert (np.diff(s.accepted_at, axis=-1) <= 0).all()
  assert int(s.target_calls) == s.row_target_calls.max()
  assert int(s.draft_calls) == 1 + tree.depth * (int(s.target_calls) - 1)
  assert (s.proposals <= (tree.size - 1) * (s.row_target_calls - 1)).all()
  if not eos:
    np.testing.assert_array_equal(out.num_new, s.row_target_calls + s.accepted)


SMALL_TREE = DraftTree.from_branching((2, 1))


def test_the_default_verifier_reads_the_logits_lazily_and_agrees_with_processed_rows():
  """The default tree verifier runs on lazily processed target logits (the candidate
  selection's ``top_k`` is in the program); a function verifier gets the processed
  probabilities. Per-row temperature, top-k and top-p with greedy rows: the same tokens."""
  params = SamplingParams(np.array([0.0, 1.0, 0.7, 0.0, 1.3], np.float32),
                          np.array([0, 5, 0, 3, 8], np.int32),
                          np.array([1.0, 0.9, 0.8, 1.0, 0.95], np.float32))

  def as_function(p, q, parents, tokens, uniforms, *, num_nodes):
    return tree_verify(p, q, parents, tokens, uniforms, num_nodes=num_nodes, law="iid",
                       max_depth=SMALL_TREE.depth)

  def run(tree_verifier):
    return tree_speculative_generate(TARGET, NEAR, PROMPTS, PROMPT_LENGTHS, jax.random.key(4),
                                     tree=SMALL_TREE, law="iid", max_new_tokens=MAX_NEW,
                                     params=params, tree_verifier=tree_verifier)

  lazy, eager = run(None), run(as_function)
  for field in ("tokens", "num_new", "error"):
    np.testing.assert_array_equal(getattr(lazy, field), getattr(eager, field), err_msg=field)
  np.testing.assert_array_equal(lazy.error, 0)
  assert "top_k" in str(jax.make_jaxpr(lambda: run(None))())  # (test_chain has the control)


# ---------------------------------------------------------------------------------------------
# The tree's shape.


def test_draft_tree_shapes():
  tree = DraftTree.from_branching((3, 2, 1))
  assert tree.size == 1 + 3 + 6 + 6 and tree.depth == 3
  assert tree.parents[:6] == (-1, 0, 0, 0, 1, 1) and tree.ranks[:6] == (0, 0, 1, 2, 0, 1)
  depths = tree.depths()
  assert (np.diff(depths) >= 0).all()  # breadth-first
  mask = tree.ancestors()
  for c in range(tree.size):
    chain, node = {c}, c
    while node > 0:
      node = tree.parents[node]
      chain.add(node)
    assert set(np.flatnonzero(mask[c])) == chain
  # Paths are sorted into breadth-first order; duplicates are merged.
  paths = DraftTree.from_paths([(0, 0), (1,), (0,), (0,)])
  assert paths == DraftTree((-1, 0, 0, 1), (0, 0, 1, 0))
  with pytest.raises(ValueError, match="prefix"):
    DraftTree.from_paths([(0, 0)])
  with pytest.raises(ValueError, match="sibling"):
    DraftTree.from_paths([(0,), (2,)])
  with pytest.raises(ValueError, match=">= 1"):
    DraftTree.from_branching((2, 0))


# ---------------------------------------------------------------------------------------------
# Greedy: the tree loop emits plain greedy decoding, token for token.


@pytest.mark.parametrize("tree_name, law, draft_name", [
  ("chain", "deterministic", "small"), ("wide", "iid", "near"), ("eagle", "deterministic", "small"),
  pytest.param("chain", "iid", "near", marks=pytest.mark.slow),
  pytest.param("wide", "deterministic", "small", marks=pytest.mark.slow),
  pytest.param("eagle", "iid", "near", marks=pytest.mark.slow)])
def test_greedy_tree_equals_plain(tree_name, law, draft_name):
  tree = TREES[tree_name]
  draft = {"near": NEAR, "small": SMALL}[draft_name]
  out = tree_speculative_generate(TARGET, draft, PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                                  tree=tree, max_new_tokens=MAX_NEW, params=GREEDY, law=law)
  np.testing.assert_array_equal(out.tokens, _plain_greedy().tokens)
  np.testing.assert_array_equal(out.error, 0)
  _check_stats(out, tree)
  assert int(out.stats.accepted.sum()) > 0, "no proposal was accepted: acceptance is untested"


def test_draft_equal_to_target_accepts_the_deepest_path():
  """With the target as its own draft, the top-1 path is always accepted to full depth."""
  tree = TREES["eagle"]  # depth 4
  out = tree_speculative_generate(TARGET, TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                                  tree=tree, max_new_tokens=MAX_NEW, params=GREEDY)
  np.testing.assert_array_equal(out.tokens, _plain_greedy().tokens)
  # 1 token from the prefill, then 11 in steps of 5, 5, 1 (the last one cut to the budget).
  np.testing.assert_array_equal(out.stats.row_target_calls, 4)
  np.testing.assert_array_equal(out.stats.accepted, 4 + 4)
  np.testing.assert_array_equal(out.stats.proposals, 8 + 8 + 0)
  _check_stats(out, tree)


@pytest.mark.parametrize("law", ["deterministic", pytest.param("iid", marks=pytest.mark.slow)])
def test_feature_draft_tree_greedy_equals_plain(law):
  """An EAGLE-style feature draft builds the tree: greedy output is plain greedy, and the
  perfect feature draft (right features at every node) is accepted to full depth."""
  tree = TREES["eagle"]
  plain = _plain_greedy()
  perfect = tree_speculative_generate(TARGET, PERFECT_FEATURES, PROMPTS, PROMPT_LENGTHS,
                                      jax.random.key(0), tree=tree, max_new_tokens=MAX_NEW,
                                      params=GREEDY, law=law)
  np.testing.assert_array_equal(perfect.tokens, plain.tokens)
  np.testing.assert_array_equal(perfect.error, 0)
  np.testing.assert_array_equal(perfect.stats.row_target_calls, 4)  # 1 + 11 in 5, 5, 1
  np.testing.assert_array_equal(perfect.stats.accepted, 4 + 4)
  _check_stats(perfect, tree)
  noisy = tree_speculative_generate(TARGET, NOISY_FEATURES, PROMPTS, PROMPT_LENGTHS,
                                    jax.random.key(0), tree=TREES["wide"], max_new_tokens=MAX_NEW,
                                    params=GREEDY, law=law)
  np.testing.assert_array_equal(noisy.tokens, plain.tokens)
  np.testing.assert_array_equal(noisy.error, 0)
  _check_stats(noisy, TREES["wide"])
  assert 0 < int(noisy.stats.accepted.sum()) < int(perfect.stats.accepted.sum())


def test_feature_tree_needs_the_feature_forms():
  args = (PROMPTS, PROMPT_LENGTHS, jax.random.key(0))
  tree = TREES["wide"]
  with pytest.raises(ValueError, match="no `tree_apply_features`"):
    tree_speculative_generate(TARGET._replace(tree_apply_features=None), PERFECT_FEATURES, *args,
                              tree=tree, max_new_tokens=4)
  with pytest.raises(ValueError, match="has no `tree_apply`"):
    tree_speculative_generate(TARGET, PERFECT_FEATURES._replace(tree_apply=None), *args,
                              tree=tree, max_new_tokens=4)
  few = make_toy_feature_draft(TARGET, vocab_ids=[1, 2, 3])
  with pytest.raises(ValueError, match=r"top 4 candidates per node.*only 3 ids"):
    tree_speculative_generate(TARGET, few, *args, tree=tree, max_new_tokens=4)
  tree_speculative_generate(TARGET, few, *args, tree=tree, max_new_tokens=4, law="iid")


@pytest.mark.slow  # a performance property of the drafts, not a correctness check
def test_tree_beats_chain_in_tokens_per_call():
  """A wider tree of the same depth accepts more per target call on the perturbed draft."""
  common = dict(max_new_tokens=24, params=SamplingParams(1.0))
  keys = jax.random.split(jax.random.key(3), 64)
  prompts = np.tile(PROMPTS[:1], (64, 1))
  lengths = np.full(64, 6, np.int32)
  per_call = {}
  for name, tree in (("chain", DraftTree.from_branching((1, 1))),
                     ("tree", DraftTree.from_branching((4, 4)))):
    out = tree_speculative_generate(TARGET, NEAR, prompts, lengths, keys, tree=tree, **common)
    per_call[name] = float(np.sum(out.num_new) / np.sum(out.stats.row_target_calls))
  assert per_call["tree"] > per_call["chain"] + 0.1, per_call


# ---------------------------------------------------------------------------------------------
# Sampling exactness: whole sequences against exact enumeration.

# The shared setup (tests/decoding/_exact.py).
EXACT_TREES = {"deterministic": DraftTree.from_branching((3, 2)),
               "iid": DraftTree.from_branching((2, 2))}


def _sample(law: str, seed: int, rule_law: str | None = None, draft=exact.DRAFT):
  tree = EXACT_TREES[law]
  verifier = None
  if rule_law is not None:
    verifier = functools.partial(tree_verify, law=rule_law, max_depth=tree.depth)
  return tree_speculative_generate(exact.TARGET, draft, *exact.batch(), jax.random.key(seed),
                                   tree=tree, max_new_tokens=exact.NEW, params=exact.PARAMS,
                                   law=law, tree_verifier=verifier)


@pytest.mark.parametrize("kind", ["model", "feature"])
@pytest.mark.parametrize("law", ["deterministic", "iid"])
def test_sampled_sequences_follow_target(law, kind):
  assert (exact.probs() == 0).sum() > 0  # top-k removed some sequences
  draft = exact.DRAFT if kind == "model" else exact.FEATURES
  out = _sample(law, seed=400 + len(law) + 10 * len(kind), draft=draft)
  np.testing.assert_array_equal(out.error, 0)
  stats = jax.tree.map(np.asarray, out.stats)
  # Rejections, acceptances at both depths, and acceptance of a non-first sibling all happen.
  assert (stats.accepted == 0).any() and (stats.accepted_at[:, 1] > 0).any()
  _, _, pvalue, detail = exact.chi_square(out)
  assert pvalue >= ALPHA / NUM_EXACT_TESTS, f"{law}, {kind}: chi-square p = {pvalue:.3g}; {detail}"


@pytest.mark.parametrize(("law", "rule_law", "kind"), [
  ("deterministic", "iid", "model"), ("iid", "without_replacement", "model"),
  ("deterministic", "iid", "feature")])
def test_wrong_law_is_detected(law, rule_law, kind):
  """Negative controls: top-k children verified with the draft's q as their law (deterministic
  children are not samples of q), and i.i.d. children verified as if drawn without replacement.

  (Verifying sampled children with the point-mass rule is *not* a mistake: that rule is exact
  for any proposal chosen independently of the verification's uniforms, only less efficient.)
  """
  draft = exact.DRAFT if kind == "model" else exact.FEATURES
  out = _sample(law, seed=500 + len(law), rule_law=rule_law, draft=draft)
  _, _, pvalue, detail = exact.chi_square(out)
  assert pvalue < 1e-6, f"{law} drafted, {rule_law} rule: undetected (p = {pvalue:.3g}); {detail}"


# ---------------------------------------------------------------------------------------------
# Ragged batches, stops and budgets.


def test_ragged_rows_are_independent():
  keys = jax.random.split(jax.random.key(7), len(PROMPTS))
  run = functools.partial(tree_speculative_generate, TARGET, NEAR, tree=TREES["eagle"],
                          max_new_tokens=MAX_NEW, params=SamplingParams(0.9))
  batch = run(PROMPTS, PROMPT_LENGTHS, keys)
  assert len(set(np.asarray(batch.stats.accepted).tolist())) > 1, "the batch was not ragged"
  _check_stats(batch, TREES["eagle"])
  flipped = run(PROMPTS[::-1].copy(), PROMPT_LENGTHS[::-1].copy(), keys[::-1])
  np.testing.assert_array_equal(np.asarray(flipped.tokens)[::-1], batch.tokens)
  for b in (0, 3):
    alone = run(PROMPTS[b : b + 1], PROMPT_LENGTHS[b : b + 1], keys[b : b + 1])
    np.testing.assert_array_equal(alone.tokens[0], batch.tokens[b], err_msg=f"row {b}")


def test_eos_and_small_buffers():
  plain = generate(TARGET, PROMPTS, PROMPT_LENGTHS, jax.random.key(0), max_new_tokens=MAX_NEW,
                   params=GREEDY, eos_id=9)
  out = tree_speculative_generate(TARGET, NEAR, PROMPTS, PROMPT_LENGTHS, jax.random.key(0),
                                  tree=TREES["wide"], max_new_tokens=MAX_NEW, params=GREEDY,
                                  eos_id=9)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.lengths, plain.lengths)
  assert (np.asarray(out.num_new) < MAX_NEW).any()  # some rows stopped at the eos
  _check_stats(out, TREES["wide"], eos=True)
  # A buffer of 7 (with traced lengths: concrete ones that do not fit raise): the rows get
  # 1, 2, 4 and 6 new tokens, budgets below the tree's depth, and say they ran out of room.
  small = dict(max_new_tokens=MAX_NEW, params=GREEDY, max_len=7)
  ref = jax.jit(lambda n: generate(TARGET, PROMPTS, n, jax.random.key(0), **small))(
    PROMPT_LENGTHS)
  out = jax.jit(lambda n: tree_speculative_generate(TARGET, NEAR, PROMPTS, n, jax.random.key(0),
                                                    tree=TREES["eagle"], **small))(PROMPT_LENGTHS)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.num_new, np.minimum(PROMPT_LENGTHS + MAX_NEW, 7)
                                - PROMPT_LENGTHS)
  np.testing.assert_array_equal(out.error, ref.error)
  assert (np.asarray(out.error) == ErrorCode.OUT_OF_ROOM).any()
  _check_stats(out, TREES["eagle"])


def test_bad_arguments():
  args = (PROMPTS, PROMPT_LENGTHS, jax.random.key(0))
  tree = TREES["wide"]
  plain_model = TARGET._replace(tree_apply=None, copy_slots=None, name="no-tree")
  with pytest.raises(ValueError, match="`draft` must provide `tree_apply`"):
    tree_speculative_generate(TARGET, plain_model, *args, tree=tree, max_new_tokens=4)
  with pytest.raises(ValueError, match="law"):
    tree_speculative_generate(TARGET, NEAR, *args, tree=tree, max_new_tokens=4, law="greedy")
  with pytest.raises(ValueError, match="breadth-first"):
    tree_speculative_generate(TARGET, NEAR, *args, tree=DraftTree((-1, 0, 1, 0), (0, 0, 0, 1)),
                              max_new_tokens=4)
  with pytest.raises(ValueError, match="ranks"):
    tree_speculative_generate(TARGET, NEAR, *args, tree=DraftTree((-1, 0, 0), (0, 1, 0)),
                              max_new_tokens=4)
  with pytest.raises(ValueError, match="at least one node"):
    tree_speculative_generate(TARGET, NEAR, *args, tree=DraftTree((-1,), (0,)), max_new_tokens=4)
  with pytest.raises(TypeError, match="DraftTree"):
    tree_speculative_generate(TARGET, NEAR, *args, tree=(2, 2), max_new_tokens=4)
  with pytest.raises(ValueError, match="vocabulary"):
    tree_speculative_generate(TARGET, make_toy_model(jax.random.key(0), V + 1), *args, tree=tree,
                              max_new_tokens=4)


def test_jit_cache_is_reused():
  """Same static arguments, new traced values: no recompilation of the loop."""
  from specdec_jax.decoding.tree import tree_loop

  run = functools.partial(tree_speculative_generate, TARGET, NEAR, tree=TREES["wide"],
                          max_new_tokens=MAX_NEW)
  run(PROMPTS, PROMPT_LENGTHS, jax.random.key(0), params=SamplingParams(0.5))
  size = tree_loop._cache_size()
  run(PROMPTS[::-1].copy(), PROMPT_LENGTHS, jax.random.key(1),
      params=SamplingParams(jnp.linspace(0, 1, len(PROMPTS))), eos_id=3)
  assert tree_loop._cache_size() == size
