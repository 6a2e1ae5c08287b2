"""Tokens per target call and time of the learned draft's chain, static tree and dynamic trees.

``python benchmarks/bench_dynamic_tree.py [--max-new-tokens 64] [--temperature 0] [--repeats 3]``:
SmolLM2-135M-Instruct with the committed EAGLE draft on ``bench-e2e``'s two prompts; plain
decoding, the chain (gamma 2), the static ``(4, 1)`` tree and :class:`~specdec_jax.DynamicTree`
(EAGLE-2) at several budgets, every variant compiled first, then timed in turn each round
(median), so the ratios are side by side. Prints tokens per target call, the speed-up over
plain decoding and whether greedy output equals plain greedy. Needs the ``model`` extra.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import DraftTree
from specdec_jax import DynamicTree
from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax import tree_speculative_generate
from specdec_jax.app.e2e import PROMPTS
from specdec_jax.app.e2e import Setup

#: ``name: (kind, shape)``; kind ``"chain"`` takes gamma, ``"tree"`` a tree.
VARIANTS = {
  "chain gamma 2": ("chain", 2),
  "static (4, 1)": ("tree", DraftTree.from_branching((4, 1))),
  "DynamicTree(4, 3, 4)": ("tree", DynamicTree(4, 3, 4)),
  "DynamicTree(4, 4, 6)": ("tree", DynamicTree(4, 4, 6)),
  "DynamicTree(4, 4, 8)": ("tree", DynamicTree(4, 4, 8)),
  "DynamicTree(4, 5, 12)": ("tree", DynamicTree(4, 5, 12)),
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, nargs="+", default=[0.0])
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  setup = Setup(progress=False)
  target, draft, eos = setup.target, setup.drafts["eagle"], setup.tokenizer.eos_id
  feature_target = setup.target_for("eagle")  # the same logits; the features the draft reads
  new = args.max_new_tokens
  print(f"{'prompt':<11} {'temp':>4}  {'variant':<22} {'new':>4} {'calls':>5} {'tok/call':>8} "
        f"{'ms':>7} {'speed-up':>8}  same as plain")
  for name, text in PROMPTS.items():
    ids = setup.encode(text)
    prompt, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
    for temperature in args.temperature:
      params = SamplingParams(temperature=jnp.float32(temperature))
      args_ = (prompt, lengths, jax.random.key(0))
      common = dict(max_new_tokens=new, params=params, eos_id=eos)
      calls = {"plain": functools.partial(generate, target, *args_, **common)}
      for label, (kind, shape) in VARIANTS.items():
        if kind == "chain":
          calls[label] = functools.partial(speculative_generate, feature_target, draft, *args_,
                                           gamma=shape, **common)
        else:
          calls[label] = functools.partial(tree_speculative_generate, feature_target, draft, *args_,
                                           tree=shape, **common)
      results = {label: jax.block_until_ready(call()) for label, call in calls.items()}
      times: dict[str, list[float]] = {label: [] for label in calls}
      for _ in range(max(args.repeats, 1)):
        for label, call in calls.items():
          start = time.perf_counter()
          jax.block_until_ready(call())
          times[label].append(time.perf_counter() - start)
      base = float(np.median(times["plain"]))
      plain_tokens = np.asarray(results["plain"].tokens)
      for label, out in results.items():
        emitted, target_calls = int(out.num_new[0]), int(out.stats.target_calls)
        ms = float(np.median(times[label]))
        same = bool((np.asarray(out.tokens) == plain_tokens).all())
        print(f"{name:<11} {temperature:>4g}  {label:<22} {emitted:>4} {target_calls:>5} "
              f"{emitted / target_calls:>8.2f} {1000 * ms:>7.0f} {base / ms:>7.2f}x  {same}",
              flush=True)


if __name__ == "__main__":
  main()
