"""Side by side on SmolLM2: plain decoding, adaptive speculation with constant vs observed costs.

Usage: ``python benchmarks/bench_observed_costs.py [busy]`` (``busy``: one CPU-bound process
runs beside it). Prints one line per prompt, temperature and variant: ms per token and speed-up
over plain decoding, measured side by side (one compiling run, then 3 rounds, medians).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import SamplingParams
from specdec_jax.app import e2e
from specdec_jax.app.e2e_costs import DEFAULT_GAMMA
from specdec_jax.app.e2e_costs import adaptive_policy
from specdec_jax.app.e2e_costs import measure_costs
from specdec_jax.decoding import generate
from specdec_jax.decoding import speculative_generate

MAX_NEW = 128
REPEATS = 3


def _variants(setup, costs, ids, temperature):
  prompt, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
  params, key, eos = SamplingParams(jnp.float32(temperature)), jax.random.key(0), \
    setup.tokenizer.eos_id
  out = {"plain": lambda: generate(setup.target, prompt, lengths, key, max_new_tokens=MAX_NEW,
                                   params=params, eos_id=eos)}
  for draft in ("lookup", "eagle"):
    gamma = DEFAULT_GAMMA[draft]
    for observe in (0, 8):
      policy = adaptive_policy(costs, draft, gamma, observe=observe)
      out[f"{draft}-adaptive obs={observe}"] = (
        lambda draft=draft, gamma=gamma, policy=policy: speculative_generate(
          setup.target_for(draft), setup.drafts[draft], prompt, lengths, key, gamma=gamma,
          max_new_tokens=MAX_NEW, params=params, eos_id=eos, adaptive=policy))
  return out


def main(busy: bool) -> None:
  setup = e2e.Setup()
  prompts = {k: e2e.PROMPTS[k] for k in ("copy-edit", "open-ended")}
  lengths = {k: len(setup.encode(v)) for k, v in prompts.items()}
  costs = measure_costs(setup, gamma=None, prompt_lengths=lengths,
                        max_len=max(lengths.values()) + MAX_NEW + 4,
                        cut_prompt=prompts["open-ended"], repeats=5)
  burner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
  try:
    for temperature in (0.0, 0.7):
      for name, text in prompts.items():
        variants = _variants(setup, costs, setup.encode(text), temperature)
        results = {v: jax.block_until_ready(fn()) for v, fn in variants.items()}  # compile
        times = {v: [] for v in variants}
        for _ in range(REPEATS):
          for v, fn in variants.items():
            start = time.perf_counter()
            results[v] = jax.block_until_ready(fn())
            times[v].append(time.perf_counter() - start)
        base = statistics.median(times["plain"]) / int(results["plain"].num_new[0])
        for v, r in results.items():
          per = statistics.median(times[v]) / int(r.num_new[0])
          same = "" if temperature else (
            "same" if np.array_equal(r.tokens, results["plain"].tokens) else "DIFFERENT")
          print(f"{'busy' if busy else 'quiet'} {name:10s} t={temperature} {v:24s} "
                f"new={int(r.num_new[0]):3d} ms/tok={per * 1e3:6.1f} speedup={base / per:5.2f}x "
                f"calls={int(r.stats.target_calls)} {same}", flush=True)
  finally:
    if burner is not None:
      burner.kill()


if __name__ == "__main__":
  main("busy" in sys.argv[1:])
