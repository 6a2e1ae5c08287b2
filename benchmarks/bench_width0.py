"""What a decoding loop costs when its adaptive policy never proposes, against plain decoding.

``python benchmarks/bench_width0.py [--max-new-tokens 48] [--repeats 5]``: SmolLM2-135M-Instruct,
greedy, on a short open-ended prompt: plain decoding, then the chain loop with prompt lookup and
with the committed EAGLE draft under an ``AdaptiveSpeculation`` whose ``fixed_cost`` (1e6) makes
every iteration propose nothing. Every variant is compiled first, then timed in turn each round
(median), so the ratios are side by side. What a never-proposing loop loses against plain
decoding is the loop's own work per iteration at width 0, the floor of adaptive speculation's
"never much worse than plain decoding", plus what its longer KV cache (``gamma`` more slots)
costs: so plain decoding is also timed with a cache 1, 2, 4 and 8 slots longer. To compare two
checkouts, run it with ``PYTHONPATH`` pointing at each, back to back. Needs the ``model`` extra.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from specdec_jax import PromptLookup
from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax.app.e2e import Setup
from specdec_jax.decoding import AdaptiveSpeculation

PROMPT = "Write a short story about a lighthouse keeper."


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--max-new-tokens", type=int, default=48)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  setup = Setup(progress=False)
  ids = setup.tokenizer.encode(PROMPT)
  prompt, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
  params, key = SamplingParams(temperature=jnp.float32(0.0)), jax.random.key(0)
  n = args.max_new_tokens
  never = AdaptiveSpeculation(fixed_cost=1e6)

  def loop(draft, gamma, target=setup.target):
    return lambda: speculative_generate(target, draft, prompt, lengths, key, gamma=gamma,
                                        max_new_tokens=n, params=params, adaptive=never)

  def plain(extra=0):  # the chain loop's KV cache has gamma more slots than plain decoding's
    return lambda: generate(setup.target, prompt, lengths, key, max_new_tokens=n, params=params,
                            max_len=len(ids) + n + extra)

  variants = {"plain": plain(), "plain, cache + 1": plain(1), "plain, cache + 2": plain(2),
              "plain, cache + 4": plain(4), "plain, cache + 8": plain(8),
              "lookup, never proposing": loop(PromptLookup(), 4),
              "lookup, gamma 2": loop(PromptLookup(), 2),
              "eagle, never proposing": loop(setup.drafts["eagle"], 2, setup.target_for("eagle"))}
  end = len(ids) + n
  plain_tokens = jax.block_until_ready(variants["plain"]()).tokens[:, :end]
  for name, run in variants.items():  # compile; greedy output must be plain greedy's
    out = jax.block_until_ready(run())
    assert (out.tokens[:, :end] == plain_tokens).all(), f"{name}: greedy output differs"
  times: dict[str, list[float]] = {name: [] for name in variants}
  for _ in range(args.repeats):
    for name, run in variants.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - start)
  base = statistics.median(times["plain"])
  print(f"{'variant':<24} {'ms':>8}  of plain")
  for name, values in times.items():
    ms = statistics.median(values)
    print(f"{name:<24} {ms * 1e3:8.1f}  {base / ms:.3f}x")


if __name__ == "__main__":
  main()
