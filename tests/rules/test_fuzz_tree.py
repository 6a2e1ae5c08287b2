"""Fuzzing ``tree_verify`` and its ``key=`` form (see :mod:`tests._fuzz_strategies`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import specdec_jax as sd
from specdec_jax import reference
from tests._fuzz_strategies import BF16
from tests._fuzz_strategies import CORRUPTIONS
from tests._fuzz_strategies import F32
from tests._fuzz_strategies import PAD
from tests._fuzz_strategies import SEEDS
from tests._fuzz_strategies import U_KINDS
from tests._fuzz_strategies import as_input
from tests._fuzz_strategies import clean_rows
from tests._fuzz_strategies import corrupt
from tests._fuzz_strategies import fuzz
from tests._fuzz_strategies import margin_uniform
from tests._fuzz_strategies import pick_interior
from tests._fuzz_strategies import row_bad
from tests._fuzz_strategies import tolerance
from tests._fuzz_strategies import uniform_bad
from tests._fuzz_strategies import value_bad

TREE_CASES = (  # (V, parents of nodes 1.., dtype, law)
  (3, (0, 0, 1, 1, 2), F32, "iid"),
  (3, (0, 0, 1, 1, 2), F32, "without_replacement"),
  (3, (0, 0, 1, 1, 2), F32, "deterministic"),
  (257, (0, 0, 1), BF16, "iid"),
  (4097, (0, 1, 1), F32, "without_replacement"),
)


def tree_reads(res, p, q, parents, tokens, uniforms, num_nodes, law, tol, max_depth):
  """Whether what the walk read was invalid, following the path it reports.

  At each node on the path the walk reads the tested children's ids and their gathered
  probabilities (``q`` only when the law uses it); the full rows of a node are read only where
  a residual is formed (after a rejection there: ``p`` and ``q``) and at the last node, where
  the final token is sampled (``p``; ``q`` too if a child was rejected there).
  """
  size, vocab = p.shape
  uses_q = law != "deterministic"
  real = min(max(num_nodes, 1), size)
  bad = real != num_nodes
  bad_parent = [0 < c < real and not 0 <= parents[c] < c for c in range(size)]
  bad |= any(bad_parent)
  is_node = [0 < c < real and not bad_parent[c] for c in range(size)]
  depth = int(res.num_accepted)
  path = np.asarray(res.path).tolist()
  assert all(c == -1 for c in path[depth:]) and all(0 < c < size for c in path[:depth]), path
  visited = [0, *path[:depth]]
  tests = 0
  for d, node in enumerate(visited):
    children = [c for c in range(size) if is_node[c] and parents[c] == node]
    children = children if d < max_depth else []
    if d < depth:
      assert path[d] in children, (path, node, children)
      tested = children[: children.index(path[d]) + 1]
      assert 0 <= tokens[path[d]] < vocab  # an out-of-range id is never accepted
      rejected = len(tested) > 1
    else:
      tested = children
      rejected = len(tested) > 0
    for c in tested:
      if not 0 <= tokens[c] < vocab:
        bad = True
        continue
      bad |= value_bad(p[node, tokens[c]], tol)
      if uses_q:
        bad |= value_bad(q[node, tokens[c]], tol)
    if rejected or d == depth:
      bad |= row_bad(p[node], tol)[0]
    if rejected and uses_q:
      bad |= row_bad(q[node], tol)[0]
    tests += len(tested)
  assert int(res.num_uniforms) == tests + 1
  bad |= any(uniform_bad(u) for u in uniforms[: tests + 1])
  return bool(bad)


@fuzz(400)
@given(case=st.sampled_from(TREE_CASES), seed=SEEDS, p_kind=st.sampled_from(CORRUPTIONS),
       q_kind=st.sampled_from(CORRUPTIONS),
       tree_kind=st.sampled_from(["clean", "clean", "bad_token", "bad_parent", "num_nodes_low",
                                  "num_nodes_high", "num_nodes_random"]),
       u_kind=st.sampled_from(U_KINDS), as_jax=st.booleans(), with_key=st.booleans())
def test_tree_verify_garbage(case, seed, p_kind, q_kind, tree_kind, u_kind, as_jax, with_key):
  vocab, parent_list, dtype, law = case
  rng = np.random.default_rng(seed)
  parents = np.array([-1, *parent_list], np.int32)
  size = len(parents)
  p = corrupt(rng, clean_rows(rng, size, vocab), p_kind).astype(dtype)
  q = corrupt(rng, clean_rows(rng, size, vocab), q_kind).astype(dtype)
  tokens = rng.integers(0, vocab, size=size).astype(np.int32)
  num_nodes = size
  if tree_kind == "bad_token":
    tokens[rng.integers(1, size)] = rng.choice([-1, vocab, 2**31 - 1])
  elif tree_kind == "bad_parent":
    c = int(rng.integers(1, size))
    parents[c] = rng.choice([-1, c, c + 1, 2**31 - 1])
  elif tree_kind == "num_nodes_low":
    num_nodes = int(rng.choice([0, -1, -(2**31)]))
  elif tree_kind == "num_nodes_high":
    num_nodes = size + 1 + int(rng.integers(0, 3))
  elif tree_kind == "num_nodes_random":
    num_nodes = int(rng.integers(1, size + 1))
  uniforms = rng.random(size).astype(np.float32)
  if u_kind != "clean":
    uniforms[rng.integers(0, size)] = {"negative": -0.25, "one": 1.0, "above": 1.5,
                                       "nan": np.nan, "inf": np.inf}[u_kind]
  args = (as_input(p, as_jax), as_input(q, as_jax), as_input(parents, as_jax),
          as_input(tokens, as_jax))
  if with_key and case == TREE_CASES[0]:  # one compilation of the keyed form
    key = jax.random.key(seed % 1000)
    res = sd.tree_verify(*args, num_nodes=num_nodes, law=law, pad_id=PAD, key=key)
    uniforms = np.asarray(jax.random.uniform(key, (size,), jnp.float32))
  else:
    res = sd.tree_verify(*args, as_input(uniforms, as_jax), num_nodes=num_nodes, law=law,
                         pad_id=PAD)
  out = np.asarray(res.tokens)
  depth = int(res.num_accepted)
  max_depth = size - 1
  assert out.shape == (max_depth + 1,) and int(res.num_tokens) == depth + 1
  assert 0 <= out[depth] < vocab and np.all(out[depth + 1 :] == PAD)
  assert out[:depth].tolist() == [int(tokens[c]) for c in np.asarray(res.path)[:depth]]
  assert bool(res.valid) == (int(res.error) == 0)
  p32, q32 = p.astype(np.float32), q.astype(np.float32)
  bad = tree_reads(res, p32, q32, parents.tolist(), tokens.tolist(), uniforms, num_nodes, law,
                   tolerance(dtype), max_depth)
  assert bool(res.valid) == (not bad), (sd.describe_error(int(res.error)), bad)


def tree_walk(rng, p, q, parents, tokens, law: str):
  """The rule in float64, drawing its uniforms from ``rng`` away from every boundary."""
  size, vocab = p.shape
  node, out, us = 0, [], []
  while True:
    r, q_left, removed = p[node].copy(), q[node].copy(), False
    accepted = None
    for c in (c for c in range(1, size) if parents[c] == node):
      x = int(tokens[c])
      if law == "iid":
        q_j = q[node]
      elif law == "without_replacement":
        q_j = q_left / q_left.sum() if removed else q_left
      else:
        q_j = np.eye(vocab)[x]
      ratio = reference.acceptance_probability(r[x], q_j[x])
      us.append(margin_uniform(rng, ratio))
      if us[-1] < ratio:
        accepted = c
        break
      w = np.maximum(r - q_j, 0)
      r = w / w.sum() if w.sum() > 0 else p[node]
      if law == "without_replacement":
        q_left[x], removed = 0.0, True
    if accepted is None:
      k, u = pick_interior(rng, r)
      return [*out, k], [*us, u]
    out.append(int(tokens[accepted]))
    node = accepted


@fuzz(25)
@given(case=st.sampled_from([c for c in TREE_CASES if c[2] == F32]), seed=SEEDS)
def test_clean_trees_are_valid_and_exact(case, seed):
  vocab, parent_list, _, law = case
  rng = np.random.default_rng(seed)
  parents = np.array([-1, *parent_list], np.int32)
  size = len(parents)
  p = clean_rows(rng, size, vocab).astype(np.float32)
  q = clean_rows(rng, size, vocab).astype(np.float32)
  tokens = rng.integers(0, vocab, size=size).astype(np.int32)
  want, us = tree_walk(rng, p.astype(np.float64), q.astype(np.float64), parents, tokens, law)
  uniforms = np.concatenate([us, rng.random(size - len(us))]).astype(np.float32)
  res = sd.tree_verify(p, q, parents, tokens, uniforms, num_nodes=size, law=law, pad_id=PAD)
  assert bool(res.valid), sd.describe_error(int(res.error))
  assert np.asarray(res.tokens)[: int(res.num_tokens)].tolist() == want
  assert int(res.num_uniforms) == len(us)

