"""One definition of the kept set everywhere (issue 44, items 1-3 and 13).

The kept set of top-k / top-p is cut on the raw logits, ties toward the lower id
(:func:`specdec_jax._logits.transform.kept_set_keys`); ``specdec_jax.reference.process_logits``
states it in float64. These tests hold every place that processes logits to it:

* rows whose top logits are an ulp apart (a temperature rounds them to one value) at several
  temperatures, through ``process_logits``, ``sample_draft``, the lazy statistics and every
  logits cell of the verifier matrix (token, block, tree x single, packed, packed tree,
  vocab-parallel): the same support as the reference, every emitted token inside it;
* huge finite temperatures (every scaled logit flushes to one value) keep the ``k`` largest;
* ``temperature = inf`` with a masked logit is valid whatever else the batch holds;
* the lazy statistics' bisection fallback (``top_k`` above the candidates) on tied,
  bfloat16-like rows equals the stable-sort reference;
* a hypothesis fuzz of the edge rows (ulp clusters, huge and infinite temperatures, masked
  entries, mixed batches) comparing the lazy path, ``process_logits`` and ``sample_draft``
  with the float64 reference.
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
from specdec_jax import reference
from specdec_jax._logits.lazy import CANDIDATES
from specdec_jax._logits.lazy import logit_stats
from specdec_jax._logits.lazy import row_probs
from tests._baselines import sorted_process_row

V = 104  # divisible by 2, 4 and 8 (the vocab-parallel cells)
ONE_UP = float(np.nextafter(np.float32(1.0), np.float32(2.0)))
F32_MAX = float(np.finfo(np.float32).max)
TEMPERATURES = (0.5, 1.0, 3.0, 10.0, 1e20, 1e36, 1e38, np.inf)


def issue_row() -> np.ndarray:
  """The row of issue 44, item 1: -20 everywhere, id 0 at 10, id 3 at 1.0 and id 7 one ulp
  above (at ``T = 10`` both scale to one value)."""
  x = np.full(V, -20.0, np.float32)
  x[0], x[3], x[7] = 10.0, 1.0, ONE_UP
  return x


def fallback_row() -> np.ndarray:
  """A row whose top-69 cut (above the candidates: the bisection fallback) falls between two
  ulp-apart logits, the larger at the higher id (a cut on the scaled logits keeps the other).
  V = 208: 68 distinct large logits (ids 132..199), id 60 one ulp above id 10."""
  x = np.full(2 * V, -20.0, np.float32)
  x[200 - 68:200] = 10.0 + 0.5 * np.arange(68, dtype=np.float32)
  x[10], x[60] = 1.0, ONE_UP
  return x


@jax.jit
def lazy_probs(x, params):
  """Every entry of rows ``x`` ``(R, V)`` read through the lazy statistics."""
  stats = logit_stats(x, params)
  ids = jnp.arange(x.shape[-1], dtype=jnp.int32)[None, :]
  return row_probs(jax.tree.map(lambda s: s[:, None], stats), x, ids)


def support(probs) -> set[int]:
  return set(np.flatnonzero(np.asarray(probs) > 0).tolist())


def as_params(batch: int, temperature, top_k, top_p) -> sd.SamplingParams:
  return sd.SamplingParams(jnp.full(batch, temperature, jnp.float32),
                           None if top_k is None else jnp.full(batch, top_k, jnp.int32),
                           None if top_p is None else jnp.full(batch, top_p, jnp.float32))


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize(("row", "top_k", "top_p"),
                         [(issue_row, 2, None), (issue_row, 3, None), (issue_row, None, 0.7),
                          (fallback_row, 69, None), (fallback_row, 70, 0.999)],
                         ids=["k2", "k3", "p.7", "fallback-k69", "fallback-k70-p"])
def test_ulp_apart_logits_keep_one_set_everywhere(row, top_k, top_p, temperature):
  """``process_logits``, ``sample_draft`` and the lazy statistics keep the reference's set."""
  x = row()
  want = reference.process_logits(x, temperature, top_k, top_p)
  eager = np.asarray(sd.process_logits(x, sd.SamplingParams(temperature, top_k, top_p)))
  draft = sd.sample_draft(jax.random.key(0), x, sd.SamplingParams(temperature, top_k, top_p))
  lazy = np.asarray(lazy_probs(x[None], as_params(1, temperature, top_k, top_p)))[0]
  assert support(want) == support(eager) == support(draft.probs) == support(lazy), (
    support(want), support(eager), support(lazy))
  for got in (eager, np.asarray(draft.probs), lazy):
    np.testing.assert_allclose(got, want, atol=1e-6)


def _mesh(n: int = 2):
  return jax.make_mesh((n,), ("model",), axis_types=(AxisType.Auto,))


@functools.cache
def _cells():
  """Every logits cell as ``fn(rows (B, V), params (B,), uniforms (B,)) -> emitted (B,)``, each
  request verifying no drafts (the emitted token is drawn from its processed row)."""
  none = jnp.zeros((0,), jnp.int32)

  def chain(rule):
    def one(x, params, u):
      return sd.verify_logits(x[None], None, none, u[None], params, rule=rule).tokens[0]
    return jax.jit(jax.vmap(one))

  def tree(x, params, u):
    return sd.tree_verify_logits(x[None], None, jnp.array([-1]), jnp.array([0]), u[None], params,
                                 law="deterministic").tokens[0]

  def packed(rule, fn=sd.packed_verify):
    def run(x, params, u):
      batch = x.shape[0]
      extra = {"rule": rule, "max_spec_len": 0} if fn is sd.packed_verify else {}
      return fn(jnp.zeros((0,), jnp.int32), jnp.zeros(batch, jnp.int32), target_logits=x,
                params=params, uniforms=u[:, None], **extra).tokens[:, 0]
    return run

  def packed_tree(fn=sd.packed_tree_verify, **kw):
    def run(x, params, u):
      batch = x.shape[0]
      links = -jnp.ones((batch, 1), jnp.int32)
      return fn(jnp.zeros((batch, 1), jnp.int32), links, links, target_logits=x, params=params,
                uniforms=u[:, None], **kw).tokens[:, 0]
    return run

  mesh = _mesh()
  vp_chain = {rule: sd.vocab_parallel_verify(mesh, "model", rule=rule, inputs="logits")
              for rule in ("token", "block")}
  vp_tree = sd.vocab_parallel_tree_verify(mesh, "model", inputs="logits", law="deterministic")
  return {
    "verify_logits": chain("token"),
    "verify_logits-block": chain("block"),
    "tree_verify_logits": jax.jit(jax.vmap(tree)),
    "packed_verify": packed("token"),
    "packed_verify-block": packed("block"),
    "packed_tree_verify": packed_tree(max_depth=0),
    "vocab_parallel_verify": lambda x, p, u: vp_chain["token"](
      x[:, None], None, jnp.zeros((x.shape[0], 0), jnp.int32), u[:, None], p).tokens[:, 0],
    "vocab_parallel_verify-block": lambda x, p, u: vp_chain["block"](
      x[:, None], None, jnp.zeros((x.shape[0], 0), jnp.int32), u[:, None], p).tokens[:, 0],
    "vocab_parallel_tree_verify": lambda x, p, u: vp_tree(
      x[:, None], None, -jnp.ones((x.shape[0], 1), jnp.int32),
      jnp.zeros((x.shape[0], 1), jnp.int32), u[:, None], p).tokens[:, 0],
    "vocab_parallel_packed_verify": packed(
      "token", sd.vocab_parallel_packed_verify(mesh, "model", max_spec_len=0)),
    "vocab_parallel_packed_tree_verify": packed_tree(
      sd.vocab_parallel_packed_tree_verify(mesh, "model", max_depth=0)),
  }


CELLS = ("verify_logits", "verify_logits-block", "tree_verify_logits", "packed_verify",
         "packed_verify-block", "packed_tree_verify", "vocab_parallel_verify",
         "vocab_parallel_verify-block", "vocab_parallel_tree_verify",
         "vocab_parallel_packed_verify", "vocab_parallel_packed_tree_verify")


@pytest.mark.skipif(jax.device_count() < 2, reason="the vocab-parallel cells need 2 devices")
@pytest.mark.parametrize("cell", CELLS)
def test_every_logits_cell_emits_inside_the_one_kept_set(cell):
  """The issue's row, u on a grid of 64: at ``T = 10, top_k = 2`` the reference keeps ids 0 and
  7 (7 with probability 0.29), so the grid reaches both (at ``T = inf`` too); ``process_logits``
  keeps the same set and no cell emits outside it (before the fix ``process_logits`` kept 3
  instead of 7 while every cell emitted 7)."""
  u = jnp.asarray((np.arange(64) + 0.5) / 64, jnp.float32)
  for temperature in (10.0, 1.0, np.inf):
    want = support(reference.process_logits(issue_row(), temperature, 2))
    assert want == {0, 7}
    assert support(sd.process_logits(issue_row(), sd.SamplingParams(temperature, 2))) == want
    rows = jnp.asarray(np.tile(issue_row(), (64, 1)))
    emitted = set(np.asarray(_cells()[cell](rows, as_params(64, temperature, 2, None), u))
                  .tolist())
    # At T = 1 token 7 has probability 1.2e-4: the grid only reaches token 0 there.
    assert emitted == want or (temperature == 1.0 and emitted == {0}), (cell, temperature,
                                                                        emitted)


@pytest.mark.parametrize("temperature", [1e36, 1e38, F32_MAX, np.inf])
def test_huge_temperatures_keep_the_k_largest_logits(temperature):
  """Item 2: the scaled logits all flush to one value, yet the ``k`` largest logits are kept
  (not the ``k`` lowest ids), uniformly."""
  x = np.asarray(jax.random.normal(jax.random.key(0), (200,)), np.float32)
  largest = set(np.argsort(-x)[:5].tolist())
  eager = np.asarray(sd.process_logits(x, sd.SamplingParams(temperature, 5)))
  lazy = np.asarray(lazy_probs(x[None], as_params(1, temperature, 5, None)))[0]
  for probs in (eager, lazy):
    assert support(probs) == largest
    np.testing.assert_allclose(probs[sorted(largest)], 0.2, rtol=1e-6)


def test_infinite_temperature_with_a_masked_logit_is_valid_in_any_batch():
  """Item 3: ``T = inf`` (top-k 3) on a row with a ``-inf`` entry, alone and beside two ``T =
  1`` requests whose rows need the whole-row normaliser: valid, the same token with the same
  key, uniform over the 3 kept tokens as ``process_logits`` says."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(3, V)).astype(np.float32)
  x[0, 5] = -np.inf
  keys = jax.random.split(jax.random.key(1), 3)
  kept = support(sd.process_logits(x[0], sd.SamplingParams(np.inf, 3)))
  assert kept == support(reference.process_logits(x[0], np.inf, 3)) and len(kept) == 3
  for rule in ("token", "block"):
    def run(rows, temperature, top_k, keys, rule=rule):
      return sd.packed_verify(np.zeros(0, np.int32), np.zeros(len(rows), np.int32),
                              max_spec_len=0, target_logits=rows, key=keys, rule=rule,
                              params=sd.SamplingParams(np.asarray(temperature, np.float32),
                                                       np.asarray(top_k, np.int32)))
    alone = run(x[:1], [np.inf], [3], keys[:1])
    mixed = run(x, [np.inf, 1.0, 1.0], [3, 0, 0], keys)
    assert bool(alone.valid[0]) and bool(mixed.valid[0]), (alone.error, mixed.error)
    assert int(alone.tokens[0, 0]) == int(mixed.tokens[0, 0]) and int(alone.tokens[0, 0]) in kept
  stats = logit_stats(jnp.asarray(x), as_params(3, np.inf, None, None))
  assert not np.asarray(stats.broken).any()
  np.testing.assert_allclose(np.asarray(stats.norm), [V - 1, V, V])


def _tied_lm_rows(rng, count, vocab) -> np.ndarray:
  """Zipf-shaped LM-like rows quantised to multiples of 1/8 (bfloat16 holds them exactly):
  long runs of tied logits at every cut."""
  base = -1.2 * np.log(np.arange(1, vocab + 1))
  x = np.stack([base[rng.permutation(vocab)] for _ in range(count)])
  x = np.round((x + rng.normal(scale=0.3, size=x.shape)) * 8) / 8
  return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("top_k", [CANDIDATES + 1, 100, 257, 1000])
def test_bisection_fallback_cuts_tied_rows_like_the_sorted_reference(top_k):
  """Item 13: ``top_k`` above the candidates runs the bisection; on bfloat16-rounded LM rows
  the cut falls inside a tie group whose kept members have lower ids than larger kept logits.
  The lazy statistics keep exactly the stable sort's set (a cut one past the last kept *id*
  instead of one past the last kept *tie* keeps extra ties), and each row sums to 1."""
  rng = np.random.default_rng(top_k)
  x = _tied_lm_rows(rng, 6, 4096)
  params = as_params(6, 1.0, top_k, None)
  params = params._replace(temperature=jnp.asarray([1.0, 0.7, 1.3, 1.0, 2.0, 0.5], jnp.float32),
                           top_p=jnp.asarray([1.0, 1.0, 1.0, 0.999, 1.0, 1.0], jnp.float32))
  want = np.asarray(jax.jit(jax.vmap(sorted_process_row))(jnp.asarray(x), params))
  got = np.asarray(lazy_probs(jnp.asarray(x), params))
  for b in range(len(x)):
    tied_at_cut = np.sum(x[b] == x[b][np.argsort(-x[b], kind="stable")[top_k - 1]])
    assert tied_at_cut > 1, "the cut must fall in a tie group"
    assert support(got[b]) == support(want[b]), b
    assert len(support(got[b])) <= top_k
    np.testing.assert_allclose(got[b].sum(), 1.0, rtol=1e-5)
    np.testing.assert_allclose(got[b], want[b], atol=1e-6)


# --- the fuzz of the edge rows -------------------------------------------------------------

FUZZ_TEMPERATURES = (0.0, 1e-3, 0.3, 1.0, 10.0, 1e20, 1e36, 1e38, np.inf)


@st.composite
def edge_batches(draw):
  """A batch of 4 rows of 96 logits: LM-like values with clusters of ulp-apart logits at the
  top and around the cuts, masked (``-inf``) entries, and per-row temperature / top-k / top-p
  drawn from the edge values (huge and infinite temperatures, top-k above the candidates)."""
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  rows, vocab = 4, 96
  x = (rng.normal(size=(rows, vocab)) * draw(st.sampled_from([0.5, 3.0, 30.0]))).astype(
    np.float32)
  for b in range(rows):
    for _ in range(int(rng.integers(1, 4))):  # clusters of ulp-apart logits
      size = int(rng.integers(2, 6))
      start = np.float32(rng.choice(np.sort(x[b])[-8:]) if rng.random() < 0.7 else x[b].max())
      values = [start]
      for _ in range(size - 1):
        values.append(np.nextafter(values[-1], np.float32(np.inf)))
      x[b, rng.choice(vocab, size=size, replace=False)] = rng.permutation(values)
    if rng.random() < 0.4:
      x[b, rng.choice(vocab, size=int(rng.integers(1, 10)), replace=False)] = -np.inf
  temperature = np.array([draw(st.sampled_from(FUZZ_TEMPERATURES)) for _ in range(rows)])
  top_k = np.array([draw(st.sampled_from([0, 1, 2, 3, 5, 9, 20, CANDIDATES + 3, vocab + 1]))
                    for _ in range(rows)])
  top_p = np.array([draw(st.sampled_from([1.0, 0.999, 0.9, 0.5, 0.1])) for _ in range(rows)])
  return x, temperature.astype(np.float32), top_k.astype(np.int32), top_p.astype(np.float32)


def _near_top_p(x, temperature, top_k, top_p) -> np.ndarray:
  """Tokens whose float64 preceding mass (in the raw-logit order) is within rounding of
  ``top_p``: summing masses in another order may put them on the other side."""
  finite = np.isfinite(x)
  if not temperature > 0 or top_p >= 1:
    return np.zeros(len(x), bool)
  order = np.lexsort((np.arange(len(x)), -np.where(finite, x, -np.inf)))
  probs = reference.process_logits(x, temperature, top_k, None)
  before = np.zeros(len(x))
  before[order] = np.cumsum(probs[order]) - probs[order]
  return np.abs(before - top_p) <= max(1e-5, 4 * len(x) * 2.0**-24)


_PROCESS, _SAMPLE = jax.jit(sd.process_logits), jax.jit(sd.sample_draft)


@settings(derandomize=True, max_examples=40, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(batch=edge_batches())
def test_fuzz_edge_rows_against_the_float64_reference(batch):
  """``process_logits``, ``sample_draft`` (per row) and the lazy statistics (the whole mixed
  batch in one call) against ``reference.process_logits``: the same support, except a token
  within rounding of ``top_p``, and probabilities within ``1e-5``."""
  x, temperature, top_k, top_p = batch
  lazy = np.asarray(lazy_probs(jnp.asarray(x), sd.SamplingParams(
    jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p))))
  for b in range(len(x)):
    params = sd.SamplingParams(temperature[b], top_k[b], top_p[b])  # traced: one compilation
    want = reference.process_logits(x[b], float(temperature[b]), int(top_k[b]),
                                     float(top_p[b]))
    eager = np.asarray(_PROCESS(x[b], params))
    drawn = _SAMPLE(jax.random.key(b), x[b], params)
    near = _near_top_p(x[b], float(temperature[b]), int(top_k[b]), float(top_p[b]))
    where = f"row {b}: T={temperature[b]}, k={top_k[b]}, p={top_p[b]}"
    for name, got in (("process_logits", eager), ("sample_draft", np.asarray(drawn.probs)),
                      ("lazy", lazy[b])):
      # float32 flushes what float64 keeps below ~1e-38 (a tiny temperature): not a cut.
      differ = ((got > 0) != (want > 0)) & ~((got == 0) & (want < 1e-30))
      assert not np.any(differ & ~near), f"{name} {where}: {np.flatnonzero(differ)}"
      if not differ.any():
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{name} {where}")
    assert want[int(drawn.token)] > 0 or near[int(drawn.token)], where
