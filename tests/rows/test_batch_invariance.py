"""Batch invariance: with one key per request, a request's result never depends on the rest of
its batch (issue 44), in every batched cell of the verifier matrix.

A hypothesis test draws a request (ragged draft count, per-request temperature / top-k / top-p
among the edge values: greedy, ``T = inf``, a top-k above the lazy statistics' candidates, a
nucleus; rows with masked entries) and two random batches around it, at another position in
each; the request's tokens, counts and error bits must be the same in both. The other requests
are drawn so that the batch-level branches of the lazy statistics (a whole-row normaliser, the
candidates, the bisection fallback) are taken in one batch and not in the other: item 3's bug
(``T = inf`` with a masked logit reported ``NONFINITE`` only beside requests that needed the
whole-row normaliser) fails it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from jax.sharding import AxisType

import specdec_jax as sd

B, S, V = 4, 3, 104  # requests, max_spec_len, vocabulary (divisible by the 2-device mesh)
N = 4  # tree nodes per request: a root, two children, one grandchild
FIRST_CHILD = np.array([1, 3, -1, -1])
NEXT_SIBLING = np.array([-1, 2, -1, -1])
PARENTS = np.array([-1, 0, 0, 1])


def _request(rng: np.random.Generator) -> dict:
  """One request's rows, drafts, parameters and key."""
  scale = np.float32(rng.choice([1, 4]))
  x = rng.normal(size=(2 * S + 1 + 2 * N, V)).astype(np.float32) * scale
  if rng.random() < 0.5:
    x[:, rng.choice(V, size=int(rng.integers(1, 8)), replace=False)] = -np.inf
  return {
    "rows": x,
    "count": int(rng.integers(0, S + 1)),
    "draft": rng.integers(0, V, size=S).astype(np.int32),
    "tree_tokens": rng.integers(0, V, size=N).astype(np.int32),
    "temperature": float(rng.choice([0.0, 0.7, 1.0, np.inf])),
    "top_k": int(rng.choice([0, 3, 70])),
    "top_p": float(rng.choice([1.0, 0.8])),
    "key": int(rng.integers(0, 2**31)),
  }


def _params(requests) -> sd.SamplingParams:
  return sd.SamplingParams(np.array([r["temperature"] for r in requests], np.float32),
                           np.array([r["top_k"] for r in requests], np.int32),
                           np.array([r["top_p"] for r in requests], np.float32))


def _keys(requests) -> jax.Array:
  return jnp.stack([jax.random.key(r["key"]) for r in requests])


def _packed_args(requests) -> dict:
  """vLLM's packed layout of the batch: drafts ``[T]`` in a buffer of ``B * S``, target rows
  ``[T + B, V]`` (bonus rows interleaved) and draft rows ``[T, V]``, zero-padded."""
  ids, target, draft = [], [], []
  for r in requests:
    n = r["count"]
    ids.append(r["draft"][:n])
    target.append(r["rows"][:n + 1])
    draft.append(r["rows"][S + 1:S + 1 + n])
  def pad(parts, rows):
    a = np.concatenate(parts)
    return np.concatenate([a, np.zeros((rows - len(a), *a.shape[1:]), a.dtype)])
  return dict(draft_token_ids=pad(ids, B * S), num_draft_tokens=np.array(
    [r["count"] for r in requests], np.int32), target_logits=pad(target, B * S + B),
    draft_logits=pad(draft, B * S), params=_params(requests), key=_keys(requests))


def _padded_args(requests) -> tuple:
  """``(keys, target (B, S + 1, V), draft logits (B, S, V), drafts (B, S), counts (B,),
  params)`` for the vmapped one-sequence verifiers."""
  return (_keys(requests), np.stack([r["rows"][:S + 1] for r in requests]),
          np.stack([r["rows"][S + 1:2 * S + 1] for r in requests]),
          np.stack([r["draft"] for r in requests]),
          np.array([r["count"] for r in requests], np.int32), _params(requests))


def _tree_args(requests) -> dict:
  rows = lambda lo: np.concatenate([r["rows"][lo:lo + N] for r in requests])  # noqa: E731
  candidates = np.stack([r["tree_tokens"] for r in requests])
  return dict(candidates=candidates, retrive_next_token=np.tile(FIRST_CHILD, (B, 1)),
              retrive_next_sibling=np.tile(NEXT_SIBLING, (B, 1)),
              target_logits=rows(2 * S + 1), draft_logits=rows(2 * S + 1 + N),
              params=_params(requests), key=_keys(requests))


def _mesh():
  return jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,))


@functools.cache
def _cells():
  """Every batched cell as ``fn(requests) -> (tokens, num_tokens, error)``, one row each."""
  def packed(rule, draft, fn=None):
    def run(requests):
      args = _packed_args(requests)
      if not draft:
        args.pop("draft_logits")
      call = fn or functools.partial(sd.packed_verify, max_spec_len=S, rule=rule)
      r = call(**args)
      return r.tokens, r.num_tokens, r.error
    return run

  def packed_tree(law, fn=None):
    def run(requests):
      args = _tree_args(requests)
      if law == "deterministic":
        args.pop("draft_logits")
      call = fn or functools.partial(sd.packed_tree_verify, max_depth=2, law=law)
      r = call(**args)
      return r.tokens, r.num_tokens, r.error
    return run

  def vmapped(rule):
    @jax.jit
    def step(keys, target, draft_logits, draft, counts, params):
      one = lambda k, t, d, x, n, p: sd.verify_logits(  # noqa: E731
        t, d, x, params=p, num_draft=n, rule=rule, key=k)
      return jax.vmap(one)(keys, target, draft_logits, draft, counts, params)

    def run(requests):
      r = step(*_padded_args(requests))
      return r.tokens, r.num_tokens, r.error
    return run

  def vmapped_tree(requests):
    r = jax.jit(jax.vmap(lambda k, t, d, tok, p: sd.tree_verify_logits(
      t, d, jnp.asarray(PARENTS), tok, params=p, law="iid", key=k)))(
      _keys(requests), np.stack([r["rows"][2 * S + 1:2 * S + 1 + N] for r in requests]),
      np.stack([r["rows"][2 * S + 1 + N:2 * S + 1 + 2 * N] for r in requests]),
      np.stack([r["tree_tokens"] for r in requests]), _params(requests))
    return r.tokens, r.num_tokens, r.error

  mesh = _mesh()
  vp_chain = sd.vocab_parallel_verify(mesh, "model", inputs="logits")

  def vocab_parallel(requests):
    keys, target, draft_logits, draft, counts, params = _padded_args(requests)
    r = vp_chain(target, draft_logits, draft, None, params, counts, key=keys)
    return r.tokens, r.num_tokens, r.error

  return {
    "packed_verify": packed("token", True),
    "packed_verify-block": packed("block", True),
    "packed_verify-point-mass": packed("token", False),
    "packed_tree_verify": packed_tree("deterministic"),
    "packed_tree_verify-iid": packed_tree("iid"),
    "vmap-verify_logits": vmapped("token"),
    "vmap-verify_logits-block": vmapped("block"),
    "vmap-tree_verify_logits": vmapped_tree,
    "vocab_parallel_verify": vocab_parallel,
    "vocab_parallel_packed_verify": packed(
      "token", True, sd.vocab_parallel_packed_verify(_mesh(), "model", max_spec_len=S)),
    "vocab_parallel_packed_tree_verify": packed_tree(
      "deterministic", sd.vocab_parallel_packed_tree_verify(_mesh(), "model", max_depth=2)),
  }


@pytest.mark.skipif(jax.device_count() < 2, reason="the vocab-parallel cells need 2 devices")
@pytest.mark.parametrize("cell", ["packed_verify", "packed_verify-block",
                                  "packed_verify-point-mass", "packed_tree_verify",
                                  "packed_tree_verify-iid", "vmap-verify_logits",
                                  "vmap-verify_logits-block", "vmap-tree_verify_logits",
                                  "vocab_parallel_verify", "vocab_parallel_packed_verify",
                                  "vocab_parallel_packed_tree_verify"])
@settings(derandomize=True, max_examples=6, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1))
def test_a_request_does_not_depend_on_its_batch(cell, seed):
  rng = np.random.default_rng(seed)
  request = _request(rng)
  if rng.random() < 0.5:  # item 3's request: T = inf, top-k, a masked logit
    request.update(temperature=np.inf, top_k=3)
    request["rows"][:, 5] = -np.inf
  outputs = []
  for _ in range(2):
    batch = [_request(rng) for _ in range(B)]
    if rng.random() < 0.5:  # neighbours that need the whole-row normaliser, or none that do
      for other in batch:
        other.update(temperature=1.0, top_k=0, top_p=1.0)
    at = int(rng.integers(0, B))
    batch[at] = request
    tokens, num_tokens, error = _cells()[cell](batch)
    outputs.append((np.asarray(tokens)[at].tolist(), int(num_tokens[at]), int(error[at])))
  assert outputs[0] == outputs[1], (cell, request["temperature"], request["top_k"], outputs)
  assert outputs[0][2] == 0, (cell, outputs[0])  # every request here is valid
