"""``bench-e2e``'s sized tree: the learned draft's tree chosen from measured acceptance and costs.

:func:`tree_plan` calibrates on :data:`CALIBRATION_PROMPT` (not one of the measured prompts):
the learned draft's chain gives its acceptance by depth, and the draft read with the target's
own features along that run's text (teacher forcing) gives how often the target's sampled
token is the draft's ``r``-th most likely one (``a[0, r] = E[p(c_r)]``, the law of a top-k
tree). With the target's measured cost curves (a call on 1 .. 17 tokens, in a loop, as the chain
loop and as the tree loop call it), :func:`~specdec_jax.decoding.plan_tree` picks the tree, and
``eagle+sized`` runs the best predicted of plain decoding, the chain (each gamma, with its own
acceptance) and that tree: on a machine where calls on more tokens are expensive it is a short
chain or nothing. ``eagle+dynamic`` scores as many tokens as the planned tree, but chooses them
afresh each iteration from the draft's confidences (:func:`dynamic_tree`, EAGLE-2's dynamic
tree); where the plan is plain decoding or a chain it runs that.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax import SamplingParams
from specdec_jax import process_logits
from specdec_jax import speculative_generate
from specdec_jax.app.e2e_costs import conditional_acceptance
from specdec_jax.app.e2e_costs import timed_together
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding import DynamicTree
from specdec_jax.decoding import TreePlan
from specdec_jax.decoding import plan_tree

#: A request for calibration only (the tables measure other prompts).
CALIBRATION_PROMPT = "Explain to a child why the sky is blue and why sunsets are red."

#: The tree's bounds: depth and candidates per node (the acceptance table's shape).
DEPTH, RANKS = 4, 4

#: Token counts of the measured target calls (the cost curves; linear in between).
CURVE_TOKENS = (1, 2, 3, 4, 5, 7, 9, 13, 17)


class Sized(NamedTuple):
  """What ``eagle+sized`` runs: the best predicted of plain decoding, a chain and a tree.

  Attributes:
    kind: ``"plain"``, ``"chain"`` (the chain loop with ``gamma`` proposals) or ``"tree"``.
    gamma: the chain's proposals, or the tree's depth (0 for plain).
    tree: the tree (kind ``"tree"``), else None.
    expected_tokens: tokens per target call predicted.
    cost_ms: one iteration's predicted cost.
    speedup: predicted over plain decoding (prefill not counted).
    plain_ms: a plain decoding step in the same units (the call on one token in a loop).
    plan: :func:`~specdec_jax.decoding.plan_tree`'s result for the tree.
  """

  kind: str
  gamma: int
  tree: DraftTree | None
  expected_tokens: float
  cost_ms: float
  speedup: float
  plain_ms: float
  plan: TreePlan
  draft_step_ms: float = 0.0  # one draft call on a level's nodes (a dynamic tree's extra level)


def dynamic_tree(choice: Sized) -> DynamicTree | None:
  """``eagle+dynamic``'s tree: EAGLE-2's dynamic tree scoring as many tokens as the planned tree.

  The same cost per target call as the plan (``num_draft`` = its nodes), the candidates
  expanded ``RANKS`` at a time, one level deeper than the plan where it has the nodes for it
  (a confident path can grow past it for one more draft call); None where the plan is plain
  decoding or a chain.

  Example:
    >>> plan = TreePlan(DraftTree.from_branching((3, 1)), 2.0, 1.0, 1.5, ())
    >>> dynamic_tree(Sized("tree", 2, plan.tree, 2.0, 1.0, 1.5, 1.0, plan))
    DynamicTree(top_k=4, depth=3, num_draft=6)
  """
  if choice.kind != "tree" or choice.tree is None:
    return None
  nodes = choice.tree.size - 1
  return DynamicTree(top_k=RANKS, depth=min(choice.tree.depth + 1, nodes), num_draft=nodes)


def loop_calls(model: Any, tokens: int, max_len: int, *, tree: bool, calls: int = 8):
  """A function that runs ``calls`` target calls on ``tokens`` tokens inside a jitted loop (the
  cache updated in place, as in the decoding loops): ``apply_features``, or with ``tree``
  ``tree_apply_features`` on a tree of the root and ``tokens - 1`` children. Each call's logits
  choose the next call's token, so XLA cannot drop the output head (most of a step's cost for a
  small model)."""
  width = tokens
  nodes = jnp.arange(width, dtype=jnp.int32)
  mask = (nodes[:, None] == nodes[None]) | (nodes[None] == 0)

  @jax.jit
  def run(params, cache):
    def body(i, carry):
      cache, token = carry
      ids = jnp.broadcast_to(token, (1, width))  # the logits feed the next call: none is dead
      positions = jnp.full((1, width), 100, jnp.int32) + i + jnp.minimum(nodes, 1)[None]
      if tree:
        start = jnp.full((1,), 200, jnp.int32) + i
        logits, _, cache = model.tree_apply_features(params, ids, positions, cache, start, nodes,
                                                     mask)
      else:
        logits, _, cache = model.apply_features(params, ids, positions, cache)
      return cache, jnp.argmax(jnp.sum(logits[0], axis=0)).astype(jnp.int32) % 7
    return lax.fori_loop(0, calls, body, (cache, jnp.int32(1)))

  cache = model.init_cache(1, max_len)
  return lambda: run(model.params, cache)


def measure_curves(setup: Any, max_len: int = 320, repeats: int = 5,
                   calls: int = 8) -> dict[str, dict[int, float]]:
  """``{"chain": {k: ms}, "tree": {k: ms}}``: the target's call on ``k`` tokens in a loop, as
  the chain loop calls it and as the tree loop does (tree attention), for ``k`` in
  :data:`CURVE_TOKENS`; every width timed in turn (:func:`~specdec_jax.app.e2e_costs.
  timed_together`), so a burst of load cannot bend one part of the curve."""
  target = setup.target_for("eagle")  # the target the eagle loops call (its feature forms)
  fns = {(kind, k): loop_calls(target, k, max_len, tree=kind == "tree", calls=calls)
         for kind in ("chain", "tree") for k in CURVE_TOKENS}
  seconds = timed_together(fns, repeats)
  return {kind: {k: seconds[kind, k] * 1e3 / calls for k in CURVE_TOKENS}
          for kind in ("chain", "tree")}


def call_costs(curve: dict[int, float], verify_ms: float, sample_ms: float) -> np.ndarray:
  """``plan_tree``'s ``call_cost`` (ms): ``[0]`` a plain step (call on 1 token + sampling),
  ``[n]`` the call on ``1 + n`` tokens plus a verification, from the measured ``curve`` (its
  lower envelope from the right, linear between the measured widths)."""
  tokens = np.array(sorted(curve))
  # A call on k tokens costs at most what a call on more tokens costs: a measurement above a
  # later one is a spike of the machine (seen at 2-3x on this CPU), cut to that later one.
  ms = np.minimum.accumulate(np.array([curve[k] for k in tokens])[::-1])[::-1]
  calls = np.interp(np.arange(1, tokens.max() + 1), tokens, ms)
  return np.concatenate([[calls[0] + sample_ms], calls[1:] + verify_ms])


def rank_acceptance(setup: Any, ids: list[int], start: int, temperature: float) -> np.ndarray:
  """``(RANKS,)``: the mean target probability of the draft's ``r``-th candidate over the
  positions ``start - 1 .. len(ids) - 2`` of ``ids`` (target and draft read the true text)."""
  target, draft = setup.target_for("eagle"), setup.drafts["eagle"]
  tokens = jnp.asarray([ids], jnp.int32)
  width = tokens.shape[1]
  positions = jnp.arange(width, dtype=jnp.int32)[None]
  logits, feats, _ = jax.jit(target.apply_features)(target.params, tokens, positions,
                                                   target.init_cache(1, width))
  shifted = jnp.pad(feats, ((0, 0), (1, 0), (0, 0)))[:, :width]
  vocab_ids = jnp.asarray(draft.vocab_ids, jnp.int32)
  draft_logits, _, _ = jax.jit(draft.apply)(draft.params, tokens, shifted, positions,
                                            draft.init_cache(1, width))
  rows = slice(start - 1, width - 1)
  p = process_logits(logits[0, rows].astype(jnp.float32),
                     SamplingParams(temperature=jnp.float32(temperature)))
  candidates = vocab_ids[jax.lax.top_k(draft_logits[0, rows], RANKS)[1]]
  return np.asarray(jnp.take_along_axis(p, candidates, axis=-1).mean(axis=0), np.float64)


def tree_plan(setup: Any, costs: Any, curves: dict[str, dict[int, float]], temperature: float,
              *, seed: int, max_new_tokens: int = 96) -> tuple[Sized, np.ndarray, np.ndarray]:
  """``(choice, chain alphas (DEPTH,), tree acceptance (DEPTH, RANKS))`` at ``temperature``.

  The chain's acceptance by position ``alpha_d`` comes from a run of the chain loop on
  :data:`CALIBRATION_PROMPT`; the tree's table is ``a[d, r] = a0[r] * alpha_d / alpha_0``, the
  rank profile ``a0`` (teacher forcing on that run's text) scaled by depth as ``alpha_d`` falls
  (rows capped to sum 1). Each option is priced with its own loop's measured call curve.
  """
  ids = setup.encode(CALIBRATION_PROMPT)
  result = speculative_generate(
    setup.target_for("eagle"), setup.drafts["eagle"], jnp.asarray([ids], jnp.int32),
    jnp.asarray([len(ids)], jnp.int32), jax.random.key(seed), gamma=DEPTH,
    max_new_tokens=max_new_tokens, params=SamplingParams(temperature=jnp.float32(temperature)),
    eos_id=setup.tokenizer.eos_id)
  alphas = np.array(conditional_acceptance(np.asarray(result.stats.proposed_at[0]),
                                           np.asarray(result.stats.accepted_at[0])))
  text = np.asarray(result.tokens[0, :len(ids) + int(result.num_new[0])]).tolist()
  a0 = rank_acceptance(setup, text, len(ids), temperature)
  table = a0[None] * (alphas / max(alphas[0], 1e-9))[:, None]
  table /= np.maximum(table.sum(axis=1, keepdims=True), 1.0)
  verify = costs.verify[max(costs.verify)]
  step, sync = costs.draft_step["eagle"], costs.draft_sync["eagle"]
  plan = plan_tree(table, call_costs(curves["tree"], verify, costs.sample), draft_cost=step,
                   fixed_cost=max(sync - step, 0.0))
  chain = call_costs(curves["chain"], verify, costs.sample)
  plain = chain[0]
  options = [Sized("plain", 0, None, 1.0, plain, 1.0, plain, plan, step)]
  for g in range(1, DEPTH + 1):
    e = 1.0 + float(np.sum(np.cumprod(alphas[:g])))
    c = chain[g] + sync + (g - 1) * step
    options.append(Sized("chain", g, None, e, c, e / c * plain, plain, plan, step))
  if plan.tree is not None:
    options.append(Sized("tree", plan.tree.depth, plan.tree, plan.expected_tokens, plan.cost,
                         plan.expected_tokens / plan.cost * plain, plain, plan, step))
  return max(options, key=lambda o: o.speedup), alphas, table


def describe(choice: Sized, alphas: np.ndarray, table: np.ndarray, temperature: float) -> str:
  """Lines for the report: the calibrated acceptance, the tree plan's best sizes, the choice."""
  rows = "; ".join(f"depth {d + 1}: " + " ".join(f"{a:.3f}" for a in row)
                   for d, row in enumerate(table))
  plan = choice.plan
  best = sorted(plan.curve, key=lambda x: -x[1] / x[2])[:3]
  sizes = ", ".join(f"{n} nodes E {e:.2f} / {c:.1f} ms" for n, e, c in best)
  tree = plan.tree
  planned = ("none" if tree is None
             else f"{tree.size - 1} nodes, depth {tree.depth}, parents {tree.parents}")
  chosen = {"plain": "plain decoding", "chain": f"the chain, gamma {choice.gamma}",
            "tree": "the tree"}[choice.kind]
  return (f"  sized at temperature {temperature:g}: chain acceptance by position "
          f"{' '.join(f'{a:.2f}' for a in alphas)}; tree acceptance by rank ({rows})\n"
          f"    tree plan: {planned}; best sizes {sizes}\n"
          f"    chosen: {chosen}, expected {choice.expected_tokens:.2f} tokens per call at "
          f"{choice.cost_ms:.1f} ms, {choice.speedup:.2f}x plain (prefill not counted)")
