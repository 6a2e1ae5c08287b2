"""Where a SmolLM2 decoding loop's time goes: XLA's op time by part of the loop and source line.

``python benchmarks/profile_loop.py [--loop plain|lookup|eagle|lookup-adaptive|eagle-adaptive]
[--prompt open-ended] [--temperature 0] [--gamma N] [--max-new-tokens 96] [--top 20]
[--profiles 3]``: the loop is compiled, timed (median of 3 runs), then run ``--profiles`` times
under ``jax.profiler`` (its Python tracer off: with it the trace can hang), each run in a trace
of its own; the fastest is read (a burst of load from another process slows every op of a
run). Each op's time on XLA's threads is attributed to the Python line it was traced from
through the stack frames of the loop's optimized HLO
(:mod:`specdec_jax.app.op_profile`, the HLO dumped by ``XLA_FLAGS=--xla_dump_to``), and summed
by part of the loop: the target model's calls, the draft, logits processing and sampling,
verification, the loop's own bookkeeping. The op time per iteration is summed over XLA's
threads, so with two cores it can be up to twice the wall time; what the threads do not fill
is the runtime's scheduling and the program's sequential stretches. Ops before the loop's
``while_loop`` (the prefill) are reported apart. ``-adaptive`` uses
``AdaptiveSpeculation()``'s default cost model. Needs the ``model`` extra.
"""

from __future__ import annotations

import os
import tempfile

DUMP = tempfile.mkdtemp(prefix="profile_loop_hlo_")
# before jax starts its backend: the optimized HLO of every compiled program goes to DUMP
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP}".strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from specdec_jax import SamplingParams  # noqa: E402
from specdec_jax import generate  # noqa: E402
from specdec_jax import speculative_generate  # noqa: E402
from specdec_jax.app.e2e import DEFAULT_GAMMA  # noqa: E402
from specdec_jax.app.e2e import PROMPTS  # noqa: E402
from specdec_jax.app.e2e import Setup  # noqa: E402
from specdec_jax.app.op_profile import CATEGORIES  # noqa: E402
from specdec_jax.app.op_profile import by_key  # noqa: E402
from specdec_jax.app.op_profile import category  # noqa: E402
from specdec_jax.app.op_profile import hlo_locations  # noqa: E402
from specdec_jax.app.op_profile import hlo_op_names  # noqa: E402
from specdec_jax.app.op_profile import hlo_opcodes  # noqa: E402
from specdec_jax.app.op_profile import in_loop  # noqa: E402
from specdec_jax.app.op_profile import innermost  # noqa: E402
from specdec_jax.app.op_profile import op_times  # noqa: E402
from specdec_jax.app.op_profile import without_containers  # noqa: E402
from specdec_jax.decoding import AdaptiveSpeculation  # noqa: E402

LOOPS = ("plain", "lookup", "eagle", "lookup-adaptive", "eagle-adaptive")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--loop", choices=LOOPS, default="eagle")
  parser.add_argument("--prompt", choices=sorted(PROMPTS), default="open-ended")
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--gamma", type=int, default=None,
                      help="proposals per iteration (default: bench-e2e's for the draft)")
  parser.add_argument("--max-new-tokens", type=int, default=96)
  parser.add_argument("--top", type=int, default=20, help="source lines listed")
  parser.add_argument("--profiles", type=int, default=3,
                      help="runs profiled, each apart; the fastest is reported (default: 3)")
  args = parser.parse_args()

  setup = Setup(progress=False)
  ids = setup.encode(PROMPTS[args.prompt])
  prompt, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32)
  params, key = SamplingParams(temperature=jnp.float32(args.temperature)), jax.random.key(0)
  base = args.loop.removesuffix("-adaptive")
  gamma = args.gamma or DEFAULT_GAMMA.get(base, 4)
  if args.loop == "plain":
    def run():
      return generate(setup.target, prompt, lengths, key, max_new_tokens=args.max_new_tokens,
                      params=params, eos_id=setup.tokenizer.eos_id)
  else:
    adaptive = AdaptiveSpeculation() if args.loop.endswith("-adaptive") else None

    def run():
      return speculative_generate(setup.target_for(base), setup.drafts[base], prompt, lengths,
                                  key, gamma=gamma, max_new_tokens=args.max_new_tokens,
                                  params=params, eos_id=setup.tokenizer.eos_id,
                                  adaptive=adaptive)

  before = set(glob.glob(f"{DUMP}/*after_optimizations.txt"))
  result = jax.block_until_ready(run())  # compiles
  new = set(glob.glob(f"{DUMP}/*after_optimizations.txt")) - before
  module = max(new, key=os.path.getsize)  # the loop: the program holding the model
  iterations, tokens = int(result.stats.target_calls), int(result.num_new[0])
  walls = []
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(run())
    walls.append(time.perf_counter() - start)
  profiles = []  # (wall, trace): each run profiled apart; the fastest is read
  for _ in range(args.profiles):
    trace = tempfile.mkdtemp(prefix="profile_loop_trace_")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(trace, profiler_options=options)
    start = time.perf_counter()
    jax.block_until_ready(run())
    profiles.append((time.perf_counter() - start, trace))
    jax.profiler.stop_trace()
  profiled, trace = min(profiles)
  (xplane,) = glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)

  text = Path(module).read_text()
  locations, opcodes, op_names = hlo_locations(text), hlo_opcodes(text), hlo_op_names(text)
  times = without_containers(op_times(xplane)[0], opcodes)  # a while's span holds its body
  outside = sum(ns for name, ns in times.items() if not in_loop(op_names.get(name, "")))
  times = collections.Counter({name: ns for name, ns in times.items()
                               if in_loop(op_names.get(name, ""))})
  own = hlo_locations(text, inherit=False)
  # a line per innermost frame; ops XLA left without one by opcode and their operands' part
  lines = {name: innermost(frames) if frames else
           f"(no frame) {opcodes.get(name, '?')}, {category(locations.get(name, ()))}"
           for name, frames in own.items()}
  per_it = 1e-6 / iterations  # ns -> ms per iteration
  wall = statistics.median(walls) * 1e3 / iterations
  cores = len(os.sched_getaffinity(0))
  print(f"{args.loop}, gamma {gamma if args.loop != 'plain' else '-'}, {args.prompt}, "
        f"temperature {args.temperature:g}: {tokens} tokens in {iterations} target calls "
        f"({tokens / iterations:.2f} per call); module {Path(module).name}")
  print(f"wall per iteration {wall:.1f} ms, the prefill included (median of 3 runs; the "
        f"fastest of {args.profiles} profiled runs {profiled * 1e3 / iterations:.1f} ms); "
        f"{cores} cores")
  print(f"ops before the loop (prefill, set-up): {outside * 1e-6:.1f} ms over all threads")
  parts = by_key(times, locations, category)
  total = sum(parts.values())
  print(f"\n{'op time in the loop per iteration':40s} {'ms':>7s}  share")
  for name in CATEGORIES:
    print(f"{name:40s} {parts[name] * per_it:7.2f}  {parts[name] / total:5.1%}")
  print(f"{'all, summed over threads':40s} {total * per_it:7.2f}")
  print(f"\n{'source line (innermost specdec_jax frame)':60s} {'ms/it':>7s}")
  by_line = collections.Counter()
  for name, ns in times.items():
    by_line[lines.get(name, "(another program)")] += ns
  for line, ns in by_line.most_common(args.top):
    print(f"{line[-60:]:60s} {ns * per_it:7.2f}")


if __name__ == "__main__":
  main()
