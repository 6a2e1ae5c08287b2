"""Where verification from logits spends its time: the row statistics against the rest, and the
exp pass against a plain read (issue 22's breakdown).

``python benchmarks/bench_logit_passes.py``: one packed batch of ``make bench``'s logits section
(B = 64, V = 32,000, LM-like rows, per-request temperature, draft logits), every piece jitted and
timed interleaved with the others (medians of 20 calls), so the ratios are side by side.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import specdec_jax
from specdec_jax import SamplingParams
from specdec_jax._logits.lazy import logit_stats
from specdec_jax.app import bench_logits

ROUNDS = 20


def main() -> None:
  case = bench_logits.make_case(64, 4, 32000, "lm", 0)
  params = bench_logits.make_params(case["rng"], 64, "temperature")
  counts = case["counts"]
  dev = {k: jnp.asarray(case[k]) for k in ("target", "draft", "ids", "counts", "uniforms")}
  rows_t = SamplingParams(jnp.asarray(np.repeat(params.temperature, counts + 1)))
  rows_d = SamplingParams(jnp.asarray(np.repeat(params.temperature, counts)))
  traced = SamplingParams(jnp.asarray(params.temperature))
  verify = jax.jit(lambda ids, n, t, d, u, p: specdec_jax.packed_verify(
    ids, n, max_spec_len=4, target_logits=t, draft_logits=d, params=p, uniforms=u))
  stats = jax.jit(lambda t, d, pt, pd: (logit_stats(t, pt), logit_stats(d, pd)))
  x = dev["target"]
  top = jnp.max(x, axis=-1)
  scale = rows_t.temperature
  exp_pass = jax.jit(lambda x, top, s: jnp.sum(jnp.exp((x - top[:, None]) / s[:, None]), -1))
  max_pass = jax.jit(lambda x: jnp.max(x, axis=-1))
  target_np, draft_np = case["target"], case["draft"]
  calls = {
    "packed_verify from logits": lambda: verify(dev["ids"], dev["counts"], x, dev["draft"],
                                                dev["uniforms"], traced),
    "  of which: row statistics": lambda: stats(x, dev["draft"], rows_t, rows_d),
    "floor (NumPy reads target + draft)": lambda: float(target_np.sum()) + float(draft_np.sum()),
    "exp pass, target rows": lambda: exp_pass(x, top, scale),
    "jnp.max, target rows": lambda: max_pass(x),
    "NumPy max, target rows": lambda: target_np.max(axis=-1),
  }
  for call in calls.values():
    jax.block_until_ready(call())
  times = {name: [] for name in calls}
  for _ in range(ROUNDS):
    for name, call in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append(time.perf_counter() - start)
  ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
  floor = ms["floor (NumPy reads target + draft)"]
  read = ms["NumPy max, target rows"]
  print(f"{'piece':<38} {'ms':>7} {'floors':>7} {'reads':>7}")
  for name, value in ms.items():
    print(f"{name:<38} {value:7.2f} {value / floor:7.2f} {value / read:7.2f}")
  print(f"\n{int(counts.sum()) + 64} target rows, {int(counts.sum())} draft rows; floors: over the "
        "floor; reads: over NumPy's max of the target rows.")


if __name__ == "__main__":
  main()
