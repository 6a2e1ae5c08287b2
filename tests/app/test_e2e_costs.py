"""The cost model of the end-to-end runs: adaptive policies and predicted speed-ups from costs."""

from __future__ import annotations

import types

import jax
import pytest

from specdec_jax.app import e2e
from specdec_jax.app import e2e_costs
from specdec_jax.app import e2e_tree
from specdec_jax.models import llama

COSTS = e2e_costs.Costs(target_step=19.0, target_verify={4: 22.2},
                  draft_step={"lookup": 0.0, "eagle": 1.0},
                  draft_sync={"lookup": 0.0, "eagle": 1.5}, prefill={"p": 60.0}, sample=0.2,
                  verify={4: 0.4})


def test_adaptive_policy_from_measured_costs():
  policy = e2e.adaptive_policy(COSTS, "eagle", gamma=4)
  unit = 19.2
  assert policy.draft_cost == pytest.approx(1.0 / unit)
  assert policy.verify_cost == pytest.approx((22.2 - 19.0) / 4 / unit)
  assert policy.fixed_cost == pytest.approx((0.4 - 0.2 + 0.5) / unit)
  lookup = e2e.adaptive_policy(COSTS, "lookup", gamma=4)
  assert lookup.draft_cost == 0.0 and lookup.fixed_cost == pytest.approx(0.2 / unit)


def _run(draft: str, **kw) -> e2e.Run:
  base = dict(prompt="p", draft=draft, temperature=0.0, gamma=4, seconds=1.0, compile_seconds=0.0,
              new_tokens=101, text="", tokens=[])
  return e2e.Run(**(base | kw))


def test_predicted_speedup_is_theorem_3_8_with_costs():
  # alpha = 1 at every position: 5 tokens per iteration, 20 iterations for 100 tokens.
  run = _run("eagle", alphas=(1.0, 1.0, 1.0, 1.0))
  plain = 60.0 + 100 * 19.2
  iteration = 1.5 + 3 * 1.0 + 22.2 + 0.4
  assert e2e_costs.predicted_speedup(run, COSTS) == pytest.approx(plain / (60.0 + 20 * iteration))
  # Nothing accepted: one token per iteration.
  none = _run("lookup", alphas=(0.0, 0.0, 0.0, 0.0))
  assert e2e_costs.predicted_speedup(none, COSTS) == pytest.approx(plain / (60.0 + 100 * 22.6))


def test_each_draft_has_its_own_gamma_unless_one_is_given():
  assert e2e.draft_gamma("eagle-adaptive", None) == e2e.DEFAULT_GAMMA["eagle"]
  assert e2e.draft_gamma("skip+tree", None) == e2e.DEFAULT_GAMMA["skip"]
  assert e2e.draft_gamma("eagle", 3) == 3


def test_predicted_speedup_of_an_adaptive_run_uses_its_counts():
  # 100 iterations without a single proposal: plain decoding plus the fixed cost of each.
  run = _run("lookup-adaptive", target_calls=101, proposals=0)
  policy = e2e.adaptive_policy(COSTS, "lookup", gamma=4)
  expected = (60.0 + 100 * 19.2) / (60.0 + 100 * 19.2 * (1 + policy.fixed_cost))
  assert e2e_costs.predicted_speedup(run, COSTS) == pytest.approx(expected)


def test_the_report_gives_the_cost_of_verifying_rows_a_request_cuts():
  import io

  costs = e2e_costs.Costs(**{**COSTS.__dict__, "verify_cut": {"top-k 50": (1.9, 0.45)}})
  out = io.StringIO()
  e2e.report([_run("plain", alphas=()), _run("lookup", alphas=(0.5, 0.5, 0.5, 0.5))], costs,
             out=out)
  assert "(gamma 4, real rows): top-k 50 0.45 (rows processed first: 1.90)" in out.getvalue()


def test_the_sized_tree_costs_come_from_the_measured_curve():
  from specdec_jax.app import e2e_tree

  calls = e2e_tree.call_costs({1: 19.0, 3: 20.0, 5: 23.0}, verify_ms=0.4, sample_ms=0.2)
  # [0] a plain step; [n] a call on 1 + n tokens (linear between measured widths) + verify.
  assert calls.tolist() == pytest.approx([19.2, 19.9, 20.4, 21.9, 23.4])
  # A spike (a call on 2 tokens measured above the call on 3) is cut to the later measurement.
  spiky = e2e_tree.call_costs({1: 60.0, 2: 50.0, 3: 20.0}, verify_ms=0.0, sample_ms=0.0)
  assert spiky.tolist() == pytest.approx([20.0, 20.0, 20.0])


def test_predicted_speedup_of_a_sized_tree_uses_the_plans_cost():
  # Both in the plan's units (calls measured in a loop), not the isolated target step's.
  run = _run("eagle+sized", alphas=(1.0, 0.5), gamma=2, iteration_ms=25.0, plain_ms=15.0)
  plain = 60.0 + 100 * 15.0
  assert e2e_costs.predicted_speedup(run, COSTS) == pytest.approx(plain / (60.0 + 100 / 2.5 * 25.0))


def test_the_dynamic_tree_scores_what_the_plan_scores():
  from specdec_jax.app import e2e_tree
  from specdec_jax.decoding import DraftTree
  from specdec_jax.decoding import DynamicTree
  from specdec_jax.decoding import TreePlan

  tree = DraftTree.from_branching((3, 2))
  plan = TreePlan(tree, 2.4, 30.0, 1.3, ())
  choice = e2e_tree.Sized("tree", 2, tree, 2.4, 30.0, 1.3, 23.0, plan, 1.5)
  assert e2e_tree.dynamic_tree(choice) == DynamicTree(top_k=e2e_tree.RANKS, depth=3,
                                                      num_draft=tree.size - 1)
  one = DraftTree.from_branching((1,))  # one node: no room for a deeper level
  assert e2e_tree.dynamic_tree(choice._replace(tree=one, gamma=1)) == DynamicTree(
    top_k=e2e_tree.RANKS, depth=1, num_draft=1)
  for kind, gamma in (("plain", 0), ("chain", 2)):  # then it runs what the plan runs
    assert e2e_tree.dynamic_tree(choice._replace(kind=kind, gamma=gamma, tree=None)) is None


def test_the_mean_over_seeds_is_an_aligned_table_of_each_variant():
  import io

  from specdec_jax.app.e2e_report import Run
  from specdec_jax.app.e2e_report import summarize

  def run(draft, seed, seconds, per_call):
    return Run("open-ended", draft, 0.7, 2, seconds, 0.0, 64, "", [], tokens_per_call=per_call,
               seed=seed)

  runs = [run("plain", s, 2.0, 1.0) for s in range(3)]
  runs += [run("eagle-adaptive", s, t, c) for s, t, c in [(0, 1.0, 2.0), (1, 2.0, 1.5),
                                                           (2, 4.0, 1.0)]]
  out = io.StringIO()
  summarize(runs, out)
  lines = out.getvalue().splitlines()
  assert lines[0].strip() == "mean over seeds (min .. max)"
  header, rule, plain, eagle = lines[1:]
  assert eagle.split() == ["open-ended", "0.7", "eagle-adaptive", "3", "1.50", "(1.00", "..",
                           "2.00)", "1.17x", "(0.50", "..", "2.00)"]
  assert plain.split()[2:4] == ["plain", "3"]
  # the columns line up whatever the width of the draft's name (left: text, right: numbers)
  assert eagle.index("1.50 (") == plain.index("1.00 (") == header.index("tok/call")
  assert eagle.index("1.17x") == plain.index("1.00x (") == header.index("speed-up")
  assert eagle.index(" 3 ") + 2 == plain.index(" 3 ") + 2 == header.index("seeds") + 5
  assert set(rule) == {" ", "-"}


def test_calls_timed_together_take_turns_so_a_burst_of_load_slows_each_alike(monkeypatch):
  """A burst of load from another process (here: the 4th to 7th calls cost 100 more) lands on both
  calls when they take turns, and the medians keep their ratio; timed one after the other, the
  burst lands on one call's block only (the negative control)."""
  clock, order = [0.0], []

  def burst(n):  # the n-th call in time, counted from 0, falls inside the burst
    return 100.0 if 3 <= n < 7 else 0.0

  def call(name, cost):
    def fn():
      clock[0] += cost + burst(len(order))
      order.append(name)
    return fn

  monkeypatch.setattr(e2e_costs.time, "perf_counter", lambda: clock[0])
  fns = {"step": call("step", 1.0), "wide": call("wide", 2.0)}
  medians = e2e_costs.timed_together(fns, repeats=5)
  assert order == ["step", "wide"] * 6  # one compiling call each, then 5 rounds in turn
  assert medians == {"step": 1.0, "wide": 2.0}
  order.clear()
  alone = {name: e2e_costs.timed(fn, 5)[2] for name, fn in fns.items()}
  assert alone["step"] == 101.0 and alone["wide"] == 2.0  # the burst took the step's block


def test_the_cost_curves_time_every_width_of_both_forms_in_turn(monkeypatch):
  """``measure_curves`` runs the eagle target's chain and tree calls for every width of the
  curve, all timed together (one round calls each in turn), and returns ms per call."""
  config = llama.LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
                             head_dim=8, ffn_dim=32, max_position=512)
  model = llama.make_model(llama.init_params(jax.random.key(0), config), config)
  setup = types.SimpleNamespace(target_for={"eagle": model}.__getitem__)
  seen = []

  def together(fns, repeats):
    seen.append((sorted(fns), repeats))
    return {name: 0.004 for name in fns}  # 4 ms for the loop of 2 calls

  monkeypatch.setattr(e2e_tree, "CURVE_TOKENS", (1, 3))
  monkeypatch.setattr(e2e_tree, "timed_together", together)
  curves = e2e_tree.measure_curves(setup, repeats=2, calls=2)
  assert seen == [([("chain", 1), ("chain", 3), ("tree", 1), ("tree", 3)], 2)]
  assert curves == {"chain": {1: 2.0, 3: 2.0}, "tree": {1: 2.0, 3: 2.0}}
  monkeypatch.undo()
  fn = e2e_tree.loop_calls(model, 3, 320, tree=True, calls=2)  # the real loop runs
  assert fn()[1].shape == ()


def test_the_loop_overhead_is_the_time_beyond_the_modelled_calls_per_iteration():
  plain = _run("plain", seconds=(60.0 + 100 * 19.2 + 100 * 0.5) / 1e3)
  assert e2e_costs.loop_overhead_ms(plain, COSTS) == pytest.approx(0.5)
  # 20 iterations of gamma 4 at 1.5 + 3 * 1.0 + 22.2 + 0.4 = 27.1 ms, plus 2 ms each.
  chain = _run("eagle", alphas=(1.0, 1.0, 1.0, 1.0), target_calls=21,
               seconds=(60.0 + 20 * 27.1 + 20 * 2.0) / 1e3)
  assert e2e_costs.loop_overhead_ms(chain, COSTS) == pytest.approx(2.0)
  # Adaptive: what predicted_speedup spends on the run's own counts, so with no overhead the
  # measured speed-up is the predicted one.
  counts = dict(alphas=(0.5,), target_calls=41, proposals=60)
  policy = e2e.adaptive_policy(COSTS, "eagle", gamma=4)
  spent = 40 * 19.2 * (1 + policy.fixed_cost) + 60 * 19.2 * (policy.draft_cost + policy.verify_cost)
  adaptive = _run("eagle-adaptive", seconds=(60.0 + spent) / 1e3, **counts)
  assert e2e_costs.loop_overhead_ms(adaptive, COSTS) == pytest.approx(0.0, abs=1e-9)
  base = (60.0 + 100 * 19.2) / 1e3
  assert base / adaptive.seconds == pytest.approx(e2e_costs.predicted_speedup(adaptive, COSTS))
  for other in (_run("eagle+tree", alphas=(0.5,), target_calls=5),
                _run("eagle+sized", alphas=(0.5,), target_calls=5, iteration_ms=20.0),
                _run("eagle+dynamic")):  # not modelled here: none
    assert e2e_costs.loop_overhead_ms(other, COSTS) is None


def test_the_cut_verification_runs_with_a_gamma_longer_than_the_prompt():
  """``generate --prompt hi --gamma 64`` once died here (its 31 tokens gave 31 rows for the 65 of
  gamma 64): the prompt is repeated until it has gamma + 1 tokens."""
  from specdec_jax.models.toy import make_toy_model

  setup = types.SimpleNamespace(encode=lambda _text: [1, 2, 3],
                                target=make_toy_model(jax.random.key(0), 16))
  times = e2e_costs.cut_verification_ms(setup, "hi", gamma=7, repeats=1)
  assert set(times) == set(e2e_costs.CUT_PARAMS) and all(t > 0 for t in times["top-k 50"])
