"""Fuzzing the engines' layouts: ``packed_verify`` (counts, draft ids, static arguments, host
and traced) and ``packed_tree_verify`` (first-child / next-sibling links).

Invariants (see :mod:`tests._fuzz_strategies`): ids in ``[0, V)`` or ``pad_id``; a host mistake
is a clear error naming the function and the argument; a traced one is flagged on the request
it concerns; clean requests are valid and equal the padded one-sequence rule
(``jax.vmap(verify)`` / ``tree_verify``). Link encodings are judged by an independent oracle:
a walk of the links from the root, as sglang's kernel walks them, that must visit every node
exactly once, each child after its parent and each sibling after the previous one.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import specdec_jax as sd
from tests._fuzz_strategies import PAD
from tests._fuzz_strategies import SEEDS
from tests._fuzz_strategies import check_host_error
from tests._fuzz_strategies import clean_rows
from tests._fuzz_strategies import fuzz

B, GAMMA, V = 3, 3, 8
COUNT_MISTAKES = ("none", "count_negative", "count_high", "counts_overflow", "id_high",
                  "id_negative", "counts_length")
STATIC_MISTAKES = {"max_spec_len": -1, "pad_id": 2.5, "convention": "vLLM", "rule": "blocks",
                   "bonus_rows": "no"}


def _packed_case(rng):
  counts = rng.integers(0, GAMMA + 1, size=B).astype(np.int32)
  total = int(counts.sum())
  p = clean_rows(rng, total + B, V).astype(np.float32)
  q = clean_rows(rng, total, V).astype(np.float32)
  ids = np.array([rng.choice(V, p=row / row.sum()) for row in q], np.int32).reshape(total)
  u = rng.random((B, GAMMA + 1)).astype(np.float32)
  return counts, ids, p, q, u


def _padded_reference(counts, ids, p, q, u):
  """Each request on its own rows, padded to ``GAMMA``: ``jax.vmap(verify)``."""
  pp = np.zeros((B, GAMMA + 1, V), np.float32)
  qq = np.full((B, GAMMA, V), 1.0 / V, np.float32)
  dd = np.zeros((B, GAMMA), np.int32)
  start = 0
  for b, n in enumerate(counts):
    pp[b, :n + 1] = p[start + b:start + b + n + 1]
    qq[b, :n] = q[start:start + n]
    dd[b, :n] = ids[start:start + n]
    start += n
  return _vmapped_verify(pp, qq, dd, u, counts)


@functools.cache
def _jitted_verify():
  return jax.jit(jax.vmap(lambda p, q, d, u, n: sd.verify(p, q, d, u, num_draft=n, pad_id=PAD)))


def _vmapped_verify(*args):
  return _jitted_verify()(*args)


@functools.cache
def _traced_packed():
  return jax.jit(lambda ids, counts, p, q, u: sd.packed_verify(
    ids, counts, max_spec_len=GAMMA, target_probs=p, draft_probs=q, uniforms=u, pad_id=PAD))


@pytest.mark.parametrize("mistake", COUNT_MISTAKES)
@pytest.mark.parametrize("traced", [False, True], ids=["host", "traced"])
@fuzz(4)
@given(seed=SEEDS)
def test_packed_counts_and_ids(mistake, traced, seed):
  rng = np.random.default_rng(seed)
  counts, ids, p, q, u = _packed_case(rng)
  want = _padded_reference(counts, ids, p, q, u)
  request = int(rng.integers(0, B))
  if mistake == "count_negative":
    counts[request] = -1
  elif mistake == "count_high":
    counts[request] = GAMMA + 1
  elif mistake == "counts_overflow":  # claims more drafts than the arrays hold
    counts[request] += 1 if counts[request] < GAMMA else 0
    counts[(request + 1) % B] += 1 if counts[request] == GAMMA else 0
  elif mistake in ("id_high", "id_negative") and ids.size:
    ids[int(rng.integers(0, ids.size))] = V + 5 if mistake == "id_high" else -1
  elif mistake == "counts_length":
    counts = np.append(counts, 1).astype(np.int32)
  id_mistake = mistake in ("id_high", "id_negative") and ids.size > 0
  bad = mistake != "none" and not (mistake.startswith("id") and ids.size == 0)
  try:
    if traced:
      got = _traced_packed()(ids, counts, p, q, u)
    else:
      got = sd.packed_verify(ids, counts, max_spec_len=GAMMA, target_probs=p, draft_probs=q,
                             uniforms=u, pad_id=PAD)
  except (ValueError, TypeError) as err:
    assert bad and not id_mistake, f"refused ({mistake}): {err!r}"
    check_host_error(err, "packed_verify", ("num_draft_tokens", "uniforms"))  # B from counts
    return
  tokens, error = np.asarray(got.tokens), np.asarray(got.error)
  assert tokens.shape == (B, GAMMA + 1)
  assert np.all((tokens == PAD) | ((tokens >= 0) & (tokens < V))), tokens
  num = np.asarray(got.num_tokens)
  for b in range(B):
    assert np.all(tokens[b, num[b]:] == PAD) and 1 <= num[b] <= GAMMA + 1
  if not bad:
    assert np.all(error == 0), [sd.describe_error(int(e)) for e in error]
    np.testing.assert_array_equal(tokens, np.asarray(want.tokens))
  elif id_mistake:
    # An id out of range is read only if its position is tested; if read, it is flagged.
    assert np.all((error == 0) | (error & sd.ErrorCode.DRAFT_OUT_OF_RANGE)), error
  else:
    assert traced, "a concrete bad count was not refused on the host"
    flagged = error & sd.ErrorCode.BAD_NUM_DRAFT
    assert flagged[request] if mistake in ("count_negative", "count_high") else flagged.any(), (
      f"{mistake} not flagged: {[sd.describe_error(int(e)) for e in error]}")


@pytest.mark.parametrize("arg", sorted(STATIC_MISTAKES))
def test_packed_static_arguments(arg):
  counts, ids, p, q, u = _packed_case(np.random.default_rng(0))
  kwargs = dict(max_spec_len=GAMMA, target_probs=p, draft_probs=q, uniforms=u)
  kwargs[arg] = STATIC_MISTAKES[arg]
  with pytest.raises((ValueError, TypeError)) as info:
    sd.packed_verify(ids, counts, **kwargs)
  check_host_error(info.value, "packed_verify", (arg,))


# --- packed trees: links ----------------------------------------------------------------------

N = 6
LINK_MISTAKES = ("none", "backward_sibling", "sibling_cycle", "reached_twice", "link_high",
                 "link_minus_two", "link_to_root", "root_sibling", "unreachable")


def _links(parents):
  """sglang's encoding: first child, next sibling (siblings in increasing order)."""
  first, sibling = np.full(N, -1, np.int32), np.full(N, -1, np.int32)
  for c in range(N - 1, 0, -1):
    sibling[c] = first[parents[c]]
    first[parents[c]] = c
  return first, sibling


def walk_links(first, sibling):
  """The parents the links encode, walked from the root as sglang walks them, or None when the
  walk does not visit every node exactly once with children after their parent and each
  sibling after the previous one."""
  parents = np.full(N, -2)
  parents[0] = -1
  stack = [0]
  while stack:
    node = stack.pop()
    child, previous = int(first[node]), node
    while child != -1:
      if not (0 <= child < N) or child <= previous or parents[child] != -2:
        return None
      parents[child] = node
      stack.append(child)
      previous, child = child, int(sibling[child])
  if np.any(parents == -2) or sibling[0] != -1:
    return None
  return parents


def _corrupt(rng, first, sibling, mistake):
  first, sibling = first.copy(), sibling.copy()
  nodes = rng.permutation(np.arange(1, N))
  with_sibling = [c for c in nodes if sibling[c] != -1]
  if mistake == "backward_sibling" and with_sibling:
    c = with_sibling[0]
    first[np.flatnonzero(first == c)] = sibling[c]  # the later sibling first, then c
    sibling[c], sibling[sibling[c]] = sibling[sibling[c]], c
  elif mistake == "sibling_cycle" and with_sibling:
    sibling[sibling[with_sibling[0]]] = with_sibling[0]
  elif mistake == "reached_twice":
    a = int(rng.integers(0, N))
    first[a] = int(rng.integers(a + 1, N)) if a < N - 1 and first[a] == -1 else first[a]
    sibling[int(nodes[0])] = int(nodes[-1])
  elif mistake == "link_high":
    first[int(rng.integers(0, N))] = N + int(rng.integers(0, 3))
  elif mistake == "link_minus_two":
    sibling[int(nodes[0])] = -2
  elif mistake == "link_to_root":
    first[int(nodes[0])] = 0
  elif mistake == "root_sibling":
    sibling[0] = int(nodes[0])
  elif mistake == "unreachable":
    c = int(nodes[0])
    for arr in (first, sibling):
      arr[arr == c] = -1
  return first, sibling


@functools.cache
def _tree_fns():
  packed = jax.jit(lambda t, f, s, p, u: sd.packed_tree_verify(
    t, f, s, max_depth=N - 1, target_probs=p, coins=u, pad_id=PAD))
  single = jax.jit(lambda p, par, t, u: sd.tree_verify(
    p, p, par, t, u, law="deterministic", uniform_layout="per_parent", pad_id=PAD))
  return packed, single


@pytest.mark.parametrize("mistake", LINK_MISTAKES)
@fuzz(6)
@given(seed=SEEDS, traced=st.booleans())
def test_packed_tree_links(mistake, seed, traced):
  rng = np.random.default_rng(seed)
  parents = np.array([-1] + [int(rng.integers(0, c)) for c in range(1, N)])
  first, sibling = _corrupt(rng, *_links(parents), mistake)
  decoded = walk_links(first, sibling)
  tokens = rng.integers(0, V, size=(1, N)).astype(np.int32)
  p = clean_rows(rng, N, V).astype(np.float32)
  u = rng.random((1, N)).astype(np.float32)
  packed, single = _tree_fns()
  args = (tokens, first[None], sibling[None], p, u)
  got = packed(*args) if traced else sd.packed_tree_verify(
    *args[:3], max_depth=N - 1, target_probs=p, coins=u, pad_id=PAD)
  out, error = np.asarray(got.tokens[0]), int(got.error[0])
  assert np.all((out == PAD) | ((out >= 0) & (out < V))), out
  if decoded is None:
    assert error & sd.ErrorCode.BAD_PARAMS, f"{mistake}: {first} {sibling} not flagged"
    return
  want = single(p, decoded, tokens[0], u[0])
  assert error == 0, (mistake, sd.describe_error(error))
  np.testing.assert_array_equal(out, np.asarray(want.tokens))
  np.testing.assert_array_equal(np.asarray(got.path[0]), np.asarray(want.path))
