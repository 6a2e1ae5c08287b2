"""Adaptive speculation that follows the costs it observes (``AdaptiveSpeculation.observe``).

:class:`~specdec_jax.decoding.adaptive.CostFit` is checked on synthetic chunks with known
costs; the loop is checked with the host's clock replaced by one that charges each chunk a
known cost per call width (``_clocked``), so which widths it runs is deterministic. The
chi-square test: fixed seed, its own ``ALPHA = 0.01``; its negative control must be rejected
at 1e-6.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax import SamplingParams
from specdec_jax import verify
from specdec_jax.decoding import AdaptiveSpeculation
from specdec_jax.decoding import PromptLookup
from specdec_jax.decoding import chain_loop
from specdec_jax.decoding import generate
from specdec_jax.decoding import speculative_generate
from specdec_jax.decoding.adaptive import CostFit
from specdec_jax.decoding.adaptive import choose_num_draft
from specdec_jax.decoding.adaptive import cost_curve
from specdec_jax.models.toy import make_toy_feature_draft
from specdec_jax.models.toy import make_toy_model
from tests._helpers import TOY_PROMPT_LENGTHS
from tests._helpers import TOY_PROMPTS
from tests.decoding import _exact as exact

GAMMA = 3
POLICY = AdaptiveSpeculation(draft_cost=0.05, verify_cost=0.04, fixed_cost=0.1)


# ---------------------------------------------------------------------------------------------
# CostFit on synthetic chunks.


def _chunks(rng, costs, count, chunk=8, widths=None):
  """``count`` chunks of ``chunk`` iterations at random widths (or only ``widths``), each
  timed as the sum of its iterations' costs with 3% multiplicative noise."""
  widths = np.arange(len(costs)) if widths is None else np.asarray(widths)
  for _ in range(count):
    n = np.bincount(rng.choice(widths, size=chunk, p=rng.dirichlet(np.ones(len(widths)))),
                    minlength=len(costs))
    yield n, float(n @ costs) * rng.lognormal(0.0, 0.03)


def test_cost_fit_recovers_the_cost_of_each_width():
  true = np.array([10.0, 12.0, 30.0, 45.0]) * 1e-3  # wide calls far dearer than the constants
  fit = CostFit(POLICY, GAMMA)
  np.testing.assert_allclose(fit.table(), cost_curve(POLICY, GAMMA))  # before any chunk
  for n, t in _chunks(np.random.default_rng(0), true, 60):
    fit.add(n, t)
  np.testing.assert_allclose(fit.table(), true, rtol=0.1)
  # Negative control: the constants' curve at the best scale misses the wide calls by far.
  curve = np.asarray(cost_curve(POLICY, GAMMA))
  scaled = curve * (true @ curve) / (curve @ curve)
  assert np.max(np.abs(scaled / true - 1)) > 0.3


def test_cost_fit_keeps_the_constants_shape_where_it_has_no_data():
  true = np.array([10.0, 11.0, 12.0, 13.0]) * 1e-3
  fit = CostFit(POLICY, GAMMA)
  for n, t in _chunks(np.random.default_rng(1), true, 40, widths=[0, 3]):
    fit.add(n, t)
  table = fit.table()
  np.testing.assert_allclose(table[[0, 3]], true[[0, 3]], rtol=0.1)
  curve = np.asarray(cost_curve(POLICY, GAMMA))
  scale = table[0] / curve[0]
  # widths 1 and 2 never ran: the constants' curve at the observed scale, roughly
  np.testing.assert_allclose(table[1:3], scale * curve[1:3], rtol=0.15)


def test_cost_fit_follows_a_change_of_machine():
  quiet = np.array([10.0, 10.5, 11.0, 11.5]) * 1e-3
  busy = np.array([20.0, 26.0, 32.0, 38.0]) * 1e-3  # another process on the cores
  rng = np.random.default_rng(2)
  fit = CostFit(POLICY, GAMMA)
  for n, t in _chunks(rng, quiet, 30):
    fit.add(n, t)
  np.testing.assert_allclose(fit.table(), quiet, rtol=0.1)
  for n, t in _chunks(rng, busy, 40):
    fit.add(n, t)
  np.testing.assert_allclose(fit.table(), busy, rtol=0.1)


def test_cost_fit_ignores_empty_and_broken_chunks():
  fit = CostFit(POLICY, GAMMA)
  fit.add(np.array([4, 0, 0, 0]), 0.04)
  before = fit.table()
  for n, t in ((np.zeros(4), 1.0), (np.array([1, 0, 0, 0]), 0.0),
               (np.array([1, 0, 0, 0]), float("nan")), (np.array([1, 0, 0, 0]), -1.0),
               (np.array([4, 0, 0, 0]), 4 * 0.01 * 5)):  # 5x the fit: a compilation, say
    fit.add(n, t)
  np.testing.assert_array_equal(fit.table(), before)
  assert np.all(np.isfinite(before)) and np.all(before > 0)
  fit.add(np.array([4, 0, 0, 0]), 4 * 0.01 * 2)  # twice as slow: a busier machine, kept
  assert fit.table()[0] > before[0] * 1.05


def test_choose_num_draft_reads_the_cost_table():
  counts = jnp.array([[9.0, 0.0], [0.0, 0.0], [0.0, 9.0]], jnp.float32)  # good, prior, bad rows
  constants = choose_num_draft(POLICY, counts, gamma=GAMMA)
  np.testing.assert_array_equal(
    choose_num_draft(POLICY, counts, gamma=GAMMA, costs=cost_curve(POLICY, GAMMA)), constants)
  free = choose_num_draft(POLICY, counts, gamma=GAMMA, costs=jnp.ones(GAMMA + 1))
  dear = choose_num_draft(POLICY, counts, gamma=GAMMA,
                          costs=jnp.array([1.0, 3.0, 5.0, 7.0], jnp.float32))
  np.testing.assert_array_equal(free, [GAMMA, GAMMA, GAMMA])
  np.testing.assert_array_equal(dear, [0, 0, 0])
  assert constants[0] == GAMMA and constants[2] == 0


# ---------------------------------------------------------------------------------------------
# The loop with a clock that charges known costs.

V = 16
TARGET = make_toy_model(jax.random.key(0), V, name="target")
NOISY = make_toy_feature_draft(TARGET, noise=1.5, key=jax.random.key(3), vocab_ids=np.arange(12))
MAX_NEW = 24


def _clocked(monkeypatch, costs=None, tables=None):
  """Replace the loop's :class:`CostFit` by one whose clock charges ``costs[k]`` seconds per
  iteration at width ``k`` (or whose table cycles through ``tables``, one per chunk)."""
  class Clocked(CostFit):
    def __init__(self, *args, **kw):
      super().__init__(*args, **kw)
      self.chunks = 0

    def stop(self, widths):
      self.chunks += 1
      self.add(np.asarray(widths), float(np.asarray(widths) @ costs) if costs is not None
               else 1.0)

    def table(self):
      if tables is not None:
        return np.asarray(tables[self.chunks % len(tables)], np.float32)
      return super().table()

  monkeypatch.setattr(chain_loop, "CostFit", Clocked)


def _run(draft, adaptive, temperature=0.0, prompts=TOY_PROMPTS, lengths=TOY_PROMPT_LENGTHS,
         max_new=MAX_NEW, **kw):
  return speculative_generate(TARGET, draft, prompts, lengths, jax.random.key(4), gamma=GAMMA,
                              max_new_tokens=max_new, params=SamplingParams(temperature),
                              adaptive=adaptive, **kw)


@functools.cache
def _plain():
  return generate(TARGET, TOY_PROMPTS, TOY_PROMPT_LENGTHS, jax.random.key(4),
                  max_new_tokens=MAX_NEW, params=SamplingParams(0.0))


@pytest.mark.parametrize("draft", ["feature", "lookup"])
def test_the_loop_follows_the_costs_it_observes(monkeypatch, draft):
  d = NOISY if draft == "feature" else PromptLookup()
  observing = POLICY._replace(observe=2)
  constants = _run(d, POLICY)
  proposals = {}
  for world, costs in (("dear", [1.0, 4.0, 7.0, 10.0]), ("free", [1.0, 1.0, 1.0, 1.0])):
    _clocked(monkeypatch, costs=np.array(costs) * 1e-3)
    out = _run(d, observing)
    np.testing.assert_array_equal(out.tokens, _plain().tokens)  # greedy: the plain output
    np.testing.assert_array_equal(out.error, 0)
    proposals[world] = int(np.sum(out.stats.proposals))
  # Where a wide call costs 4-10 plain steps, speculation stops after the first timed chunks;
  # where it costs nothing extra, every row proposes more than the constants let it.
  assert proposals["dear"] < int(np.sum(constants.stats.proposals)) < proposals["free"]


def test_observing_with_the_real_clock_streams_and_keeps_greedy_output():
  seen = []
  out = _run(NOISY, POLICY._replace(observe=3),
             on_tokens=lambda _, lengths: seen.append(lengths.copy()))
  np.testing.assert_array_equal(out.tokens, _plain().tokens)
  assert len(seen) >= 3  # chunks of 3 iterations, not chunk_iterations' default 4 or one shot
  np.testing.assert_array_equal(seen[-1], out.lengths)


# Exactness: the cost table changes from chunk to chunk, so the widths change with it.

# The shared setup (tests/decoding/_exact.py), with its noisier feature draft.
TABLES = ([1.0, 1.0, 1.0, 1.0], [1.0, 1.2, 9.0, 9.0], [1.0, 9.0, 9.0, 9.0])
ALPHA = 0.01


def _wrong(p, q, draft, uniforms, *, num_draft):
  """Negative control: q squared and renormalised, not the law the draft sampled from."""
  q = q**2 / jnp.maximum(jnp.sum(q**2, axis=-1, keepdims=True), 1e-30)
  return verify(p, q, draft, uniforms, num_draft=num_draft)


def _exact_counts(monkeypatch, verifier, seed):
  _clocked(monkeypatch, tables=TABLES)
  out = speculative_generate(
    exact.TARGET, exact.NOISY_FEATURES, *exact.batch(), jax.random.key(seed), gamma=GAMMA,
    max_new_tokens=exact.NEW, params=exact.PARAMS, verifier=verifier,
    adaptive=AdaptiveSpeculation(draft_cost=0.05, verify_cost=0.04, fixed_cost=0.05, decay=0.5,
                                 idle_decay=0.5, observe=1))
  np.testing.assert_array_equal(out.error, 0)
  return out, exact.chi_square(out)


def test_sampled_sequences_follow_the_target_as_the_costs_change(monkeypatch):
  out, (_, _, pvalue, detail) = _exact_counts(monkeypatch, "token", seed=300)
  stats = jax.tree.map(np.asarray, out.stats)
  assert len(set(stats.proposals.tolist())) > 1 and (stats.accepted_at[:, 1] > 0).any()
  assert pvalue >= ALPHA, f"chi-square p = {pvalue:.3g}; {detail}"
  _, (_, _, pvalue, detail) = _exact_counts(monkeypatch, _wrong, seed=301)
  assert pvalue < 1e-6, f"the wrong q went undetected (p = {pvalue:.3g}); {detail}"


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("observe", [-1, 1.5, True, "2", 2**31])
def test_bad_observe_is_named(observe):
  with pytest.raises(ValueError, match=r"speculative_generate: `adaptive.observe` must be an int"):
    _run(PromptLookup(), POLICY._replace(observe=observe))


def test_observing_inside_jit_is_refused():
  fn = jax.jit(lambda prompts: _run(PromptLookup(), POLICY._replace(observe=2), prompts=prompts,
                                    max_new=4).tokens)
  with pytest.raises(ValueError, match=r"outside jax\.jit"):
    fn(jnp.asarray(TOY_PROMPTS))
