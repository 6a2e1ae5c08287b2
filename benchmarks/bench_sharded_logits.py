"""Vocabulary-sharded logits: the row statistics with each shard's candidates gathered and merged,
against the bisection with scalar collectives they replace (issue 22, item 4).

``python benchmarks/bench_sharded_logits.py [--devices N]``: one packed batch of ``make bench``'s
logits section (B = 64, gamma = 4, V = 32,000, target and draft rows) split over ``N`` host
devices (default 2, one per core here; the devices share this machine's cores, so the figures
show the work and the number of collectives, not a real interconnect). Per parameter mix and
kind of row: the statistics of the target and draft rows by candidates (what the verifiers
use) and by bisection alone (``logit_stats(..., candidates=False)``), the whole
``vocab_parallel_packed_verify`` from logits, and the unsharded statistics; every call jitted,
the calls interleaved, medians of ``--rounds`` calls, so the ratios are side by side.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--vocab", type=int, default=32000)
  args = parser.parse_args(argv)
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.devices}")
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType
  from jax.sharding import PartitionSpec as P

  import specdec_jax
  from specdec_jax import SamplingParams
  from specdec_jax._logits.lazy import logit_stats
  from specdec_jax.app import bench_logits
  from specdec_jax.app.tables import format_table

  if jax.device_count() < args.devices:
    sys.exit(f"expected {args.devices} devices, got {jax.device_count()} (set XLA_FLAGS "
             "before jax is imported)")
  mesh = jax.make_mesh((args.devices,), ("model",), axis_types=(AxisType.Auto,))

  def sharded_stats(candidates: bool):
    def both(t, d, pt, pd):
      return (logit_stats(t, pt, "model", candidates=candidates),
              logit_stats(d, pd, "model", candidates=candidates))
    return jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P(None, "model"),) * 2 + (P(),) * 2,
                                 out_specs=P()))

  by_candidates, by_bisection = sharded_stats(True), sharded_stats(False)
  unsharded = jax.jit(lambda t, d, pt, pd: (logit_stats(t, pt), logit_stats(d, pd)))
  verify = specdec_jax.vocab_parallel_packed_verify(mesh, "model", max_spec_len=4)

  def time_case(kind: str, mix: str) -> dict[str, float]:
    """Median ms of each call on one case, the calls interleaved."""
    case = bench_logits.make_case(64, 4, args.vocab, kind, 0)
    params = bench_logits.make_params(case["rng"], 64, mix)
    counts = case["counts"]

    def per_row(repeat):
      return SamplingParams(*(None if v is None else jnp.asarray(np.repeat(v, repeat))
                              for v in params))

    pt, pd = per_row(counts + 1), per_row(counts)
    t, d = jnp.asarray(case["target"]), jnp.asarray(case["draft"])
    ids, n = jnp.asarray(case["ids"]), jnp.asarray(counts)
    uniforms = jnp.asarray(case["uniforms"])
    target_np, draft_np = case["target"], case["draft"]
    calls = {
      "candidates": lambda: by_candidates(t, d, pt, pd),
      "bisection": lambda: by_bisection(t, d, pt, pd),
      "verify": lambda: verify(ids, n, target_logits=t, draft_logits=d, params=params,
                               uniforms=uniforms),
      "unsharded": lambda: unsharded(t, d, pt, pd),
      "floor": lambda: float(target_np.sum()) + float(draft_np.sum()),
    }
    first = {name: jax.block_until_ready(call()) for name, call in calls.items()}
    for x, y in zip(first["candidates"], first["bisection"], strict=True):  # the same stats
      np.testing.assert_array_equal(np.asarray(x.cut_id), np.asarray(y.cut_id))
      np.testing.assert_array_equal(np.asarray(x.cut_value), np.asarray(y.cut_value))
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
      for name, call in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(call())
        times[name].append(time.perf_counter() - start)
    return {name: float(np.median(v)) * 1e3 for name, v in times.items()}

  rows = []
  for kind in ("lm", "flat"):
    for mix in ("temperature", "top-k", "top-k+top-p"):
      ms = time_case(kind, mix)
      rows.append([kind, mix, f"{ms['candidates']:.1f}", f"{ms['bisection']:.1f}",
                   f"{ms['bisection'] / ms['candidates']:.1f}x", f"{ms['verify']:.1f}",
                   f"{ms['unsharded']:.1f}", f"{ms['floor']:.1f}",
                   f"{ms['verify'] / ms['floor']:.1f}"])
  print(f"vocabulary over {args.devices} host devices; B = 64, gamma = 4, V = {args.vocab:,}; "
        "ms, medians of interleaved calls")
  print(format_table(["rows", "params", "stats: candidates", "stats: bisection", "speed-up",
                      "verify", "unsharded stats", "floor", "verify / floor"], rows))


if __name__ == "__main__":
  main()
