"""What adaptive speculation's width branches cost, against the same proposals without them.

``python tools/bench_width_branches.py [--branches run_one|switch|widest|two] [--rounds 7]``:
SmolLM2-135M-Instruct, greedy, the copy-edit prompt of ``bench-e2e`` (128 new tokens at most).
Plain decoding, plain prompt lookup (gamma 4), and prompt lookup under an
``AdaptiveSpeculation`` that always proposes 4: the same proposals and target calls, so the gap
is what the adaptive loop adds (its width branches, the policy). ``--branches`` picks how the
loop's target call chooses its width: ``run_one`` (the library's, one ``while_loop`` per
width), ``lax.switch``, ``widest`` (no branching: always the widest call, the same output
here) or ``two`` (``run_one`` over two widths only: one token or the widest). Then a target
call on 5 tokens inside a jitted loop, called directly, through ``run_one`` and through
``lax.switch``. Every variant is compiled first, then timed in turn
each round (medians). Needs the ``model`` extra.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax import lax

import specdec_jax.decoding.chain_loop as chain_loop
from specdec_jax import PromptLookup
from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax.app.e2e import PROMPTS
from specdec_jax.app.e2e import Setup
from specdec_jax.app.e2e_costs import timed_together
from specdec_jax.decoding import AdaptiveSpeculation
from specdec_jax.decoding.common import run_one

GAMMA = 4


def _switch(index, branches, cache):
  return lax.switch(index, branches, cache)


def _widest(index, branches, cache):
  del index
  return branches[-1](cache)


def _two(index, branches, cache):
  """Two branches only: one token, or the widest call (the same output when proposing 4)."""
  return run_one((index > 0).astype(jnp.int32), [branches[0], branches[-1]], cache)


def loops(setup: Setup, rounds: int) -> None:
  ids = setup.encode(PROMPTS["copy-edit"])
  prompt, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
  common = dict(max_new_tokens=128, params=SamplingParams(temperature=jnp.float32(0.0)),
                eos_id=setup.tokenizer.eos_id)
  key = jax.random.key(0)
  always = AdaptiveSpeculation(draft_cost=0.0, verify_cost=0.0, fixed_cost=0.0,
                               prior_accepted=100.0)
  variants = {
    "plain": lambda: generate(setup.target, prompt, lengths, key, **common),
    "lookup": lambda: speculative_generate(setup.target, PromptLookup(), prompt, lengths, key,
                                           gamma=GAMMA, **common),
    "lookup-adaptive, always 4": lambda: speculative_generate(
      setup.target, PromptLookup(), prompt, lengths, key, gamma=GAMMA, adaptive=always,
      **common)}
  variants["lookup again"] = variants["lookup"]
  seconds = timed_together(variants, rounds)
  outs = {name: fn() for name, fn in variants.items()}
  for name, s in seconds.items():
    out = outs[name]
    print(f"{name:28s} {s * 1e3:8.1f} ms  {seconds['lookup'] / s:.3f}x of lookup  "
          f"target calls {int(out.stats.target_calls)}  new {int(out.num_new[0])}")


def calls(setup: Setup, rounds: int, n: int = 8, max_len: int = 320) -> None:
  model = setup.target

  def make(choose):
    @jax.jit
    def run(params, cache, index):
      def body(i, carry):
        cache, token = carry
        ids = jnp.broadcast_to(token, (1, GAMMA + 1))  # the logits feed the next call
        positions = jnp.arange(GAMMA + 1, dtype=jnp.int32)[None] + 100 + i

        def score(k):
          def call(c):
            logits, c = model.apply(params, ids[:, :k + 1], positions[:, :k + 1], c)
            return jnp.pad(logits, ((0, 0), (0, GAMMA - k), (0, 0))), c, None
          return call
        logits, cache, _ = choose(index, [score(k) for k in range(GAMMA + 1)], cache)
        return cache, jnp.argmax(jnp.sum(logits[0], axis=0)).astype(jnp.int32) % 7
      return lax.fori_loop(0, n, body, (cache, jnp.int32(1)))
    cache = model.init_cache(1, max_len)
    return lambda: run(model.params, cache, jnp.int32(GAMMA))

  variants = {"direct": make(_widest), "run_one": make(run_one), "lax.switch": make(_switch)}
  variants["direct again"] = variants["direct"]
  for name, s in timed_together(variants, rounds).items():
    print(f"a call on {GAMMA + 1} tokens in a loop, {name:12s} {s * 1e3 / n:7.2f} ms")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--branches", choices=("run_one", "switch", "widest", "two"),
                      default="run_one")
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args()
  chain_loop.run_one = {"run_one": run_one, "switch": _switch, "widest": _widest,
                        "two": _two}[args.branches]
  setup = Setup(progress=False)
  print(f"branches: {args.branches}")
  loops(setup, args.rounds)
  calls(setup, args.rounds)


if __name__ == "__main__":
  main()
