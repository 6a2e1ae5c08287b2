"""What ``bench-e2e`` prints: one :class:`Run` per timed generation, the comparison table
(:func:`report`, with Leviathan et al.'s Theorem 3.8 prediction from the measured costs) and the
mean over seeds (:func:`summarize`). :mod:`specdec_jax.app.e2e` runs the generations.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import numpy as np

from specdec_jax.app.e2e_costs import Costs
from specdec_jax.app.e2e_costs import loop_overhead_ms
from specdec_jax.app.e2e_costs import predicted_speedup
from specdec_jax.app.tables import format_table


@dataclasses.dataclass
class Run:
  """One timed generation."""

  prompt: str
  draft: str  # "plain" or a draft name
  temperature: float
  gamma: int
  seconds: float
  compile_seconds: float
  new_tokens: int
  text: str
  tokens: list[int]
  target_calls: int = 0
  draft_calls: int = 0
  alphas: tuple[float, ...] = ()
  tokens_per_call: float = 1.0
  seed: int = 0
  proposals: int = 0
  iteration_ms: float = 0.0  # eagle+sized/+dynamic: the planned cost of an iteration, of a plain
  plain_ms: float = 0.0  # decoding step in the same units (its prediction)
  forced: int = 0  # structured output: proposals the grammar forced (drafted for free)
  forced_accepted: int = 0  # of those, accepted
  complete: bool = True  # structured output: the text is a whole match of the grammar


def report(runs: Sequence[Run], costs: Costs, out=sys.stdout) -> None:
  """Print the comparison table."""
  plain = {(r.prompt, r.temperature): r for r in runs if r.draft == "plain"}
  header = ("prompt", "temp", "draft", "gamma", "tokens", "tok/s", "speed-up", "predicted",
            "loop ms/it", "tok/call", "acceptance by position", "compile s")
  rows = []
  for r in runs:
    base = plain.get((r.prompt, r.temperature))
    tok_s = r.new_tokens / r.seconds if r.seconds else float("nan")
    if r.draft == "plain":
      speed, pred, acc = "1.00x", "", ""
    else:
      base_rate = base.new_tokens / base.seconds if base else float("nan")
      speed = f"{tok_s / base_rate:.2f}x"
      pred = "" if r.draft.endswith("+tree") else f"{predicted_speedup(r, costs):.2f}x"
      if r.draft.endswith(("+sized", "+dynamic")) and not r.alphas:
        pred = "1.00x"  # plain decoding was chosen
      acc = " ".join(f"{a:.2f}" for a in r.alphas)
    overhead = loop_overhead_ms(r, costs)
    rows.append((r.prompt, f"{r.temperature:g}", r.draft, str(r.gamma) if r.alphas else "",
                 str(r.new_tokens), f"{tok_s:.1f}", speed, pred,
                 "" if overhead is None else f"{overhead:.1f}", f"{r.tokens_per_call:.2f}",
                 acc, f"{r.compile_seconds:.1f}"))
  print(format_table(header, rows, align="lrlrrrrrrrl"), file=out)
  prefill = ", ".join(f"{k} {v:.1f}" for k, v in costs.prefill.items())
  calls = ", ".join(f"{g + 1} tokens {v:.2f}" for g, v in costs.target_verify.items())
  verifies = ", ".join(f"gamma {g} {v:.2f}" for g, v in costs.verify.items())
  print(f"\n  costs at batch 1 (median ms, each measured alone): prefill ({prefill}), "
        f"target step {costs.target_step:.2f}, target call on {calls}, sample "
        f"{costs.sample:.2f}, verify ({verifies}), "
        + ", ".join(f"{k} draft step {v:.2f}" for k, v in costs.draft_step.items())
        + ", eagle first call (gamma + 1 tokens) "
        + f"{costs.draft_sync.get('eagle', float('nan')):.2f}", file=out)
  if costs.verify_cut:
    print("  verification with a request that cuts its rows (gamma "
          f"{max(costs.verify)}, real rows): " + ", ".join(
            f"{k} {lazy:.2f} (rows processed first: {first:.2f})"
            for k, (first, lazy) in costs.verify_cut.items()), file=out)
  print("  speed-up: this run's tokens/s over plain decoding's. predicted: Leviathan et al. "
        "Theorem 3.8 from the measured\n  acceptance by position (alpha_i) and the costs above, "
        "prefill included (see specdec_jax.app.e2e_costs.predicted_speedup).\n  loop ms/it: "
        "the run's time beyond its calls, sampling and verification as measured alone, per "
        "iteration (its own\n  iterations and proposals; e2e_costs.loop_overhead_ms): the loop's "
        "own work, and the machine's noise.", file=out)
  if any(r.draft.endswith("+sized") for r in runs):
    print("  +sized: the best predicted of plain decoding, the chain and the tree plan_tree sized "
          "from the measured cost curves\n  and the draft's calibrated acceptance (see above); "
          "predicted from its acceptance by depth at the planned cost.", file=out)
  if any(r.draft.endswith("+dynamic") for r in runs):
    print("  +dynamic: EAGLE-2's dynamic tree (DynamicTree: the draft's most confident paths, "
          "chosen each iteration) scoring\n  as many tokens as the +sized plan, one level deeper "
          "where its nodes allow; predicted from its acceptance\n  by depth at the plan's cost "
          "plus that level's draft call.", file=out)
  if any(r.draft.endswith("+tree") for r in runs):
    print("  +tree: a top-k draft tree verified in one target call (tree attention); gamma is "
          "its depth and the acceptance\n  is by depth. Not predicted: the chain formula does "
          "not apply to trees.", file=out)


def summarize(runs: Sequence[Run], out=sys.stdout) -> None:
  """Mean (and spread) over seeds of tokens per target call and speed-up, by variant."""
  plain = {(r.prompt, r.temperature, r.seed): r for r in runs if r.draft == "plain"}
  groups: dict[tuple[str, float, str], list[tuple[float, float]]] = {}
  for r in runs:
    base = plain[(r.prompt, r.temperature, r.seed)]
    speed = (r.new_tokens / r.seconds) / (base.new_tokens / base.seconds)
    groups.setdefault((r.prompt, r.temperature, r.draft), []).append((r.tokens_per_call, speed))
  print("  mean over seeds (min .. max)", file=out)
  rows = []
  for (prompt, temperature, draft), values in groups.items():
    calls, speeds = np.array(values).T
    rows.append([prompt, f"{temperature:g}", draft, str(len(values)),
                 f"{calls.mean():.2f} ({calls.min():.2f} .. {calls.max():.2f})",
                 f"{speeds.mean():.2f}x ({speeds.min():.2f} .. {speeds.max():.2f})"])
  print(format_table(["prompt", "temp", "draft", "seeds", "tok/call", "speed-up"], rows,
                     align="lrlrll", indent=2), file=out)
