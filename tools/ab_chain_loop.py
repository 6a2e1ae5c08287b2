"""The chain loop of another checkout against this one's, interleaved in one process.

``python tools/ab_chain_loop.py OTHER/specdec_jax/decoding/chain_loop.py [--prompt open-ended]
[--temperature 0] [--drafts lookup-adaptive,lookup-adaptive:never] [--rounds 7]``: SmolLM2,
128 new tokens at most. The other ``chain_loop.py`` is loaded as a module of its own (it imports
everything else from this checkout), and ``speculative_generate`` runs with either loop; plain
decoding and both loops of every draft are compiled first, then timed in turn each round
(medians, :func:`~specdec_jax.app.e2e_costs.timed_together`), so a burst of load from other
processes slows them alike. Two checkouts timed one after the other differ by 5-10% on a busy
host; in one process the same program twice differs by 1-3%.

A draft is ``lookup``, ``eagle``, or either with ``-adaptive`` and optionally ``:never`` (an
``AdaptiveSpeculation`` that never proposes) or ``:always`` (one that always proposes gamma).
Plain ``-adaptive`` uses the cost model of ``bench-e2e`` with the costs it measured on
2026-12-07 (a target step 28.4 ms, a call on 4 / 5 tokens 38.1 / 40.4 ms, an EAGLE step 1.3 ms):
edit :data:`MEASURED` to change them. Needs the ``model`` extra.

The loop structures the README compares with the committed one are patches in
``tools/patches/`` (whole iterations in the adaptive width branches; the hybrid that keeps the
call alone at width 0)::

  git worktree add /tmp/other HEAD
  git -C /tmp/other apply "$PWD/tools/patches/adaptive_whole_iteration_branches.diff"
  python tools/ab_chain_loop.py /tmp/other/specdec_jax/decoding/chain_loop.py
"""

from __future__ import annotations

import argparse
import importlib.util

import jax
import jax.numpy as jnp

import specdec_jax.decoding.chain as chain
from specdec_jax import PromptLookup
from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax.app.e2e import DEFAULT_GAMMA
from specdec_jax.app.e2e import PROMPTS
from specdec_jax.app.e2e import Setup
from specdec_jax.app.e2e_costs import timed_together
from specdec_jax.decoding import AdaptiveSpeculation

#: bench-e2e's cost model (e2e_costs.adaptive_policy) from its costs of 2026-12-07.
MEASURED = {"lookup": AdaptiveSpeculation(draft_cost=0.0, verify_cost=0.103, fixed_cost=0.0),
            "eagle": AdaptiveSpeculation(draft_cost=0.0443, verify_cost=0.111,
                                         fixed_cost=0.0676)}
NEVER = AdaptiveSpeculation(fixed_cost=1e6)
ALWAYS = AdaptiveSpeculation(draft_cost=0.0, verify_cost=0.0, fixed_cost=0.0,
                             prior_accepted=100.0)


def load_loop(path: str):
  """The ``speculative_loop`` of the ``chain_loop.py`` at ``path``."""
  spec = importlib.util.spec_from_file_location("other_chain_loop", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.speculative_loop


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("other", help="the other checkout's specdec_jax/decoding/chain_loop.py")
  parser.add_argument("--prompt", choices=sorted(PROMPTS), default="open-ended")
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--drafts", default="lookup-adaptive,lookup-adaptive:never")
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args()
  for draft in args.drafts.split(","):
    name, _, policy = draft.partition(":")
    if name not in ("lookup", "eagle", "lookup-adaptive", "eagle-adaptive") or policy not in (
        "", "never", "always") or (policy and not name.endswith("-adaptive")):
      parser.error(f"--drafts: expected lookup or eagle, optionally with -adaptive and then "
                   f":never or :always, got {draft!r}")
  loops = {"other": load_loop(args.other), "this": chain.speculative_loop}
  setup = Setup(progress=False)
  ids = setup.encode(PROMPTS[args.prompt])
  prompt, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
  common = dict(max_new_tokens=128, eos_id=setup.tokenizer.eos_id,
                params=SamplingParams(temperature=jnp.float32(args.temperature)))
  key = jax.random.key(0)

  def run(draft: str, loop: str):
    name, _, policy = draft.partition(":")
    base = name.removesuffix("-adaptive")
    adaptive = None if base == name else {"never": NEVER, "always": ALWAYS}.get(policy,
                                                                                 MEASURED[base])
    d = PromptLookup() if base == "lookup" else setup.drafts[base]

    def go():
      chain.speculative_loop = loops[loop]  # read when the call is traced (once per variant)
      return speculative_generate(setup.target_for(base), d, prompt, lengths, key,
                                  gamma=DEFAULT_GAMMA[base], adaptive=adaptive, **common)
    return go

  variants = {"plain": lambda: generate(setup.target, prompt, lengths, key, **common)}
  for draft in args.drafts.split(","):
    for loop in loops:
      variants[f"{draft}, {loop}"] = run(draft, loop)
  seconds = timed_together(variants, args.rounds)
  chain.speculative_loop = loops["this"]
  print(f"{args.prompt}, temperature {args.temperature:g}, {args.rounds} rounds")
  for name, s in seconds.items():
    out = variants[name]()
    stats = getattr(out, "stats", None)
    calls = "" if stats is None else (f"  target calls {int(stats.target_calls)}"
                                      f"  proposals {int(stats.proposals.sum())}")
    print(f"{name:36s} {s * 1e3:8.1f} ms  {seconds['plain'] / s:.3f}x of plain{calls}"
          f"  new {int(out.num_new[0])}")


if __name__ == "__main__":
  main()
