"""Logits as a lazily processed row source (specdec_jax._logits.lazy): statistics against
processing.

* The probabilities :func:`row_probs` reads from the per-row statistics equal
  ``process_logits`` (the stable-sort reference of tests/logits/test_logits_threshold.py): the same
  support, probabilities within ``1e-6``, except a token within rounding of ``top_p``. On
  hypothesis rows with heavy ties, ``-inf``, broken rows, ``bfloat16``, and on peaked
  (Zipf-shaped) and flat rows of V = 4,096, with every path of the statistics exercised: the
  partial selection settling a row, the bisection fallback (``top_k`` above the candidates, a
  nucleus wider than them), all-greedy batches, no top-k/top-p at all.
* The batch-level branches change nothing: a row's statistics are the same whatever the other
  rows of its batch use.
* The packed verifier from logits equals the one from eagerly processed probabilities token
  for token (the reference law of tests/rules/test_exactness.py), and its compiled program writes
  no processed copy of the rows.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings

import specdec_jax as sd
import specdec_jax._logits.lazy as lazy
import specdec_jax._logits.passes as row_passes
from specdec_jax._logits.lazy import logit_stats
from specdec_jax._logits.lazy import row_probs
from tests.logits.test_logits_threshold import OLD
from tests.logits.test_logits_threshold import near_top_p
from tests.logits.test_logits_threshold import rows


@jax.jit
def lazy_probs(x, temperature, top_k, top_p):
  """Every entry of every row read through the statistics (what a rule would read)."""
  stats = logit_stats(x, sd.SamplingParams(temperature, top_k, top_p))
  ids = jnp.arange(x.shape[-1], dtype=jnp.int32)[None, :]
  return row_probs(jax.tree.map(lambda s: s[:, None], stats), x, ids)


def assert_same(logits, temperature, top_k, top_p):
  """Lazy equals the stable-sort processing: the same support and probabilities (``1e-6``)
  except a token within rounding of ``top_p``."""
  args = (jnp.asarray(logits), jnp.asarray(temperature, jnp.float32),
          jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))
  old, new = np.asarray(OLD(*args)), np.asarray(lazy_probs(*args))
  x = np.asarray(args[0].astype(jnp.float32))
  for b in range(len(x)):
    where = f"row {b}: T={temperature[b]}, k={top_k[b]}, p={top_p[b]}"
    np.testing.assert_array_equal(np.isnan(old[b]), np.isnan(new[b]), err_msg=where)
    differ = (old[b] > 0) != (new[b] > 0)
    if differ.any():
      near = near_top_p(x[b], temperature[b], top_k[b], top_p[b])
      assert not np.any(differ & ~near), where
      assert abs(new[b].sum() - 1) < 1e-5, where
    else:
      np.testing.assert_allclose(new[b], old[b], rtol=1e-6, atol=1e-6, err_msg=where)


@settings(derandomize=True, max_examples=60, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(batch=rows())
def test_statistics_give_the_processed_rows(batch):
  assert_same(*batch)


@pytest.mark.parametrize("n", [2, 8, 64])
def test_exact_top_p_boundaries(n):
  """``m`` tied survivors of mass ``1/m`` each (a power of two): every sum is exact, so with
  ``top_p = i/m`` exactly ``i`` survive on both sides (the token whose preceding mass equals
  ``top_p`` is dropped), bit for bit."""
  vocab = 2 * n + 3
  x = np.full(vocab, -np.inf, np.float32)
  x[1::2][:n] = 0.0
  x[2] = -1.0
  cases = [(m, i / m) for m in 2 ** np.arange(n.bit_length()) for i in range(1, m + 1)]
  args = (jnp.asarray(np.tile(x, (len(cases), 1))), jnp.ones(len(cases), jnp.float32),
          jnp.asarray([k for k, _ in cases], jnp.int32),
          jnp.asarray([q for _, q in cases], jnp.float32))
  old, new = np.asarray(OLD(*args)), np.asarray(lazy_probs(*args))
  np.testing.assert_array_equal(old, new)
  assert np.sum(new > 0, axis=1).tolist() == [round(q * k) for k, q in cases]


def _lm_rows(rng, count, vocab, flat=False):
  """Zipf-shaped rows (a stand-in for LM logits: a few likely tokens, a long tail), or flat
  ones (every token within a few nats: top-p keeps most of the vocabulary)."""
  if flat:
    return rng.normal(scale=0.3, size=(count, vocab)).astype(np.float32)
  base = -1.2 * np.log(np.arange(1, vocab + 1))
  return np.stack([base[rng.permutation(vocab)] for _ in range(count)]
                  + []).astype(np.float32) + rng.normal(scale=0.5, size=(count, vocab)).astype(
                    np.float32)


@pytest.mark.parametrize("flat", [False, True], ids=["peaked", "flat"])
def test_lm_sized_rows_every_path(flat):
  """V = 4,096: top-k below and above the candidates, narrow and wide nuclei, greedy rows."""
  rng = np.random.default_rng(3)
  x = _lm_rows(rng, 10, 4096, flat)
  x[3, :7] = x[3].max()  # ties at the top
  temperature = np.array([1.0, 0.7, 1.3, 1.0, 0.0, 1.0, 0.9, 1.0, 0.5, 2.0])
  top_k = np.array([0, 20, lazy.CANDIDATES, 5, 0, lazy.CANDIDATES + 1, 1000, 0, 50, 0])
  top_p = np.array([0.9, 1.0, 0.95, 0.5, 0.9, 1.0, 0.8, 0.999, 0.9, 1.0])
  assert_same(x, temperature, top_k, top_p)


@pytest.mark.parametrize("vocab", [40_000, 32_771, 131_072])
def test_long_rows_are_summed_in_pieces(vocab):
  """Rows longer than ``PIECE`` are summed as equal pieces (2 of 20,000; 4 of 32,768); a row
  with no such divisor (the prime 32,771) whole: the normaliser equals float64's to 1e-6."""
  count = row_passes._pieces(vocab)
  assert count == {40_000: 2, 32_771: 1, 131_072: 4}[vocab]
  rng = np.random.default_rng(5)
  x = rng.normal(scale=3.0, size=(3, vocab)).astype(np.float32)
  x[1, ::7] = -np.inf
  top, scale = x.max(-1), np.array([1.0, 0.6, 1.7], np.float32)
  got = np.asarray(jax.jit(row_passes.exp_sums)(x, top, scale))
  want = np.exp((x.astype(np.float64) - top[:, None]) / scale[:, None]).sum(-1)
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("vocab", [257, 300, 513])
def test_top_k_256_on_an_all_equal_row_keeps_exactly_the_lowest_256_ids(vocab):
  """Issue 23, item 28: the 256th tie ends a 256-entry block of the threshold search; an
  off-by-one in the tie count would keep 257. Eager and lazy processing both keep ids 0..255."""
  x = np.zeros((1, vocab), np.float32)
  eager = np.asarray(sd.process_logits(x[0], sd.SamplingParams(1.0, 256)))
  lazy_row = np.asarray(lazy_probs(x, np.ones(1, np.float32), np.array([256]), np.ones(1)))[0]
  for probs in (eager, lazy_row):
    np.testing.assert_array_equal(np.nonzero(probs)[0], np.arange(256))
    np.testing.assert_allclose(probs[:256], 1 / 256, rtol=1e-6)


def test_batch_level_branches_change_no_row():
  """A row's statistics do not depend on what the other rows use (top-k, top-p, greedy, a row
  that needs the fallback), nor on whether a step is removed at trace time (None)."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(_lm_rows(rng, 4, 1000))
  t = jnp.array([0.8, 1.0, 0.0, 1.2], jnp.float32)

  def stats(k, p):
    return logit_stats(x, sd.SamplingParams(t, k, p))

  plain = stats(None, None)
  disabled = stats(jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.float32))
  for a, b in zip(plain, disabled, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Row 0 alone with top-k 10, then beside a row that needs the fallback (k = 900) and one
  # with top-p: row 0's statistics stay bit for bit.
  alone = stats(jnp.array([10, 0, 0, 0], jnp.int32), None)
  mixed = stats(jnp.array([10, 900, 0, 0], jnp.int32), jnp.array([1.0, 1.0, 1.0, 0.5]))
  for a, b in zip(alone, mixed, strict=True):
    a, b = np.asarray(a), np.asarray(b)  # per-row fields; the unused optional ones are 0-d
    assert (a[0] == b[0]).all() if a.ndim else a == b
  # All greedy: no normaliser is computed, the rows read as point masses on the argmax.
  greedy = logit_stats(x, sd.SamplingParams(jnp.zeros(4), jnp.full(4, 5, jnp.int32)))
  ids = jnp.arange(1000)[None, :]
  probs = np.asarray(row_probs(jax.tree.map(lambda s: s[:, None], greedy), x, ids))
  np.testing.assert_array_equal(probs, np.asarray(jax.nn.one_hot(jnp.argmax(x, -1), 1000)))


def _packed_case(seed, batch=12, spec=4, vocab=300):
  """A ragged packed batch whose arrays have the largest size (``batch * spec`` draft rows, rows
  past the counts unread), so that every seed reuses one compiled program."""
  rng = np.random.default_rng(seed)
  n = rng.integers(0, spec + 1, batch).astype(np.int32)
  total = batch * spec
  target = _lm_rows(rng, total + batch, vocab)
  draft = target[:total] + rng.normal(scale=1.0, size=(total, vocab)).astype(np.float32)
  params = sd.SamplingParams(
    rng.choice([0.0, 0.7, 1.0], batch).astype(np.float32),
    rng.choice([0, 5, 40, 200], batch).astype(np.int32),
    rng.choice([1.0, 0.9, 0.6], batch).astype(np.float32))
  ids = rng.integers(0, vocab, total).astype(np.int32)
  return n, target, draft, params, ids, rng.random((batch, spec + 1)).astype(np.float32)


#: process_logits on each row with its own parameters (one compiled call for all rows).
PROCESS = jax.jit(jax.vmap(lambda x, t, k, p: sd.process_logits(x, sd.SamplingParams(t, k, p))))


@pytest.mark.parametrize("rule", ["token", "block"])
def test_packed_from_logits_equals_processed_probabilities(rule):
  """Token for token: packed_verify on logits (lazy rows) and on the rows processed eagerly
  by process_logits with each request's parameters, the same uniforms."""
  for seed in range(3):
    n, target, draft, params, ids, u = _packed_case(seed)
    owners_t = np.resize(np.repeat(np.arange(len(n)), n + 1), len(target))  # (unread rows:
    owners_d = np.resize(np.repeat(np.arange(len(n)), n), len(draft))  # any owner will do)

    def process(rows, owners, params=params):
      return np.asarray(PROCESS(rows, *(np.asarray(f)[owners] for f in params[:3])))

    kw = dict(max_spec_len=4, rule=rule, uniforms=u)
    got = sd.packed_verify(ids, n, target_logits=target, draft_logits=draft, params=params, **kw)
    want = sd.packed_verify(ids, n, target_probs=process(target, owners_t),
                            draft_probs=process(draft, owners_d), **kw)
    for field in ("tokens", "num_tokens", "num_accepted", "num_uniforms", "valid", "error"):
      np.testing.assert_array_equal(np.asarray(getattr(got, field)),
                                    np.asarray(getattr(want, field)), err_msg=field)


def _largest_materialised(hlo: str) -> int:
  """Element count of the largest array an instruction of compiled HLO writes to memory: the
  instructions of every computation except the bodies of fusions (whose intermediate values
  stay in registers), and not parameters or views of them."""
  fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
  largest, skip = 0, False
  for line in hlo.splitlines():
    header = re.match(r"\s*(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$", line)
    if header:
      skip = header.group(1) in fused
      continue
    if skip or " = " not in line or any(op in line for op in (
        "parameter(", "get-tuple-element(", " tuple(", "bitcast(")):
      continue
    lhs = line.split(" = ", 1)[1]
    for dims in re.findall(r"[a-z]+\d*\[([\d,]+)\]", lhs.split("(")[0]):
      largest = max(largest, int(np.prod([int(x) for x in dims.split(",")])))
  return largest


def test_no_processed_copy_in_the_compiled_program():
  """From logits with per-request temperature, top-k and top-p: no array of ``T x V`` (a
  processed copy of the draft rows; ``(T + B) x V`` of the target rows) is written to memory:
  only statistics, the rows' block maxima and the candidates ``R x 64 x 32``."""
  from specdec_jax._layouts.packed import packed_jit

  batch, spec, vocab = 16, 4, 16384  # the candidates (R x 64 x 32 entries) are below T x V
  n = np.array([1, 0, 2, 1] * 4, np.int32)
  total = int(n.sum())
  params = sd.SamplingParams(np.ones(batch, np.float32), np.full(batch, 20, np.int32),
                             np.full(batch, 0.9, np.float32))
  lowered = packed_jit.lower(
    np.zeros(total, np.int32), n, None, np.zeros((total + batch, vocab), np.float32), None,
    np.zeros((total, vocab), np.float32), None, None, np.zeros((batch, spec + 1), np.float32),
    params, max_spec_len=spec, bonus_rows=True, rule="token", pad_id=-1)
  largest = _largest_materialised(lowered.compile().as_text())
  assert largest < total * vocab, largest  # one processed copy of the draft rows would be T * V


@pytest.mark.parametrize("vocab", [514, 2400, 32000])
def test_a_nan_anywhere_in_a_long_row_breaks_it(vocab):
  """XLA:CPU's max reductions drop NaN from rows of 2,400 entries or more, so the block
  maxima alone would leave a NaN row unbroken: greedy rows then returned a token with
  ``valid`` set. Every kind of row (greedy, temperature, top-k, top-p) with one NaN, at the
  first, a middle and the last id, reads as broken, in batches where some row reads its
  whole normaliser and in batches where none does; the verifier says so."""
  rng = np.random.default_rng(vocab)
  mixed = sd.SamplingParams(jnp.asarray([0.0, 1.0, 0.7, 0.7, 1.0, 0.0], jnp.float32),
                            jnp.asarray([0, 0, 20, 0, 5, 3], jnp.int32),
                            jnp.asarray([1.0, 1.0, 1.0, 0.9, 0.5, 1.0], jnp.float32))
  # Batches where no row reads its whole row's normaliser (the NaN flag's own pass).
  greedy = sd.SamplingParams(jnp.zeros(6, jnp.float32))
  top_k = sd.SamplingParams(jnp.full(6, 0.8, jnp.float32), jnp.asarray([1, 5, 20, 64, 65, 3]))
  for params in (mixed, greedy, top_k):
    for where in (0, vocab // 2 + 3, vocab - 1):
      x = rng.normal(size=(6, vocab)).astype(np.float32)
      x[:, where] = np.nan
      x[5, where] = 0.0  # the control row: no NaN
      stats = jax.jit(logit_stats)(jnp.asarray(x), params)
      np.testing.assert_array_equal(np.asarray(stats.broken), [True] * 5 + [False])
  # End to end: greedy and sampled sequences whose target rows hold a NaN are not valid.
  draft = rng.integers(0, vocab, 4).astype(np.int32)
  target = rng.normal(size=(6, vocab)).astype(np.float32)
  target[:3, vocab - 7] = np.nan  # the first sequence's rows only
  for temperature in (0.0, 1.0):
    got = sd.packed_verify(draft, np.array([2, 2], np.int32), target_logits=target,
                           draft_logits=rng.normal(size=(4, vocab)).astype(np.float32),
                           params=sd.SamplingParams(jnp.full((2,), temperature)),
                           max_spec_len=2, key=jax.random.split(jax.random.key(0), 2))
    np.testing.assert_array_equal(np.asarray(got.valid), [False, True])
    assert int(got.error[0]) != 0 and int(got.error[1]) == 0


def test_a_cut_tied_with_the_smallest_candidate_waits_for_the_lower_ids():
  """The 64 candidates (the entries of the 64 blocks with the largest maxima) end on two 1.0s,
  ids 1985 and 1986, while a lower id (5) also holds 1.0 in a block gathered later: top-k 63
  cuts on 1.0 and must keep id 5, so a cut on the smallest candidate's value is not settled by
  the candidates (the bisection decides: 63 tokens kept, not 64)."""
  x = np.full((1, 32 * 70), -10.0, np.float32)
  x[0, 32 * np.arange(1, 62)] = 5.0
  x[0, 32 * 62] = 2.0
  x[0, [32 * 62 + 1, 32 * 62 + 2, 5]] = 1.0
  args = (np.array([1.0], np.float32), np.array([63], np.int32), np.array([1.0], np.float32))
  assert_same(x, *args)
  kept = np.asarray(lazy_probs(jnp.asarray(x), *(jnp.asarray(a) for a in args)))[0] > 0
  assert kept.sum() == 63 and kept[5] and not kept[32 * 62 + 1]
