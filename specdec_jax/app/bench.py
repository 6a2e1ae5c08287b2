"""Benchmark of ``jax.jit(jax.vmap(verify))`` against baselines: ``make bench``.

``python -m specdec_jax.app.bench``; the baselines are in :mod:`specdec_jax.app.baselines`.

For every configuration (batch ``B``, draft length ``gamma``, vocabulary ``V``, float32) one set
of random inputs is generated and every implementation is timed on it in the same process, one
after the other, as the median of ``--repeats`` calls after a warm-up call (JAX results are
waited for with ``jax.block_until_ready``), so each ratio compares two numbers measured side by
side in one run. Columns: ``tok/step`` is the mean number of tokens a sequence emitted
(``num_accepted + 1``); ``verify ms`` is ``jax.jit(jax.vmap(verify))`` on the whole batch (on a
GPU also its bandwidth, bytes the rule needs / time, and that as a share of ``--peak-gbps``);
``floor`` is NumPy reading exactly the bytes the rule needs (per sequence the ``p`` row at the
stop position, the ``q`` row there if a proposal was rejected, and the ``2 * gamma`` gathered
scalars), with those bytes (``floor MB``) and its GB/s, and ``verify/floor`` is how many floors
``verify`` takes; ``eager-JAX`` is :func:`~specdec_jax.app.baselines.eager_recovery_verify`, a
jitted, fully vectorised sampler in the style of the rejection samplers of vLLM V1 and
vllm-project/tpu-inference that computes the residual and an exponential-race sample over the full
vocabulary at every position; ``torch`` is a batched PyTorch CPU sampler in the style of Hugging
Face transformers' ``_speculative_sampling`` and vLLM V0 (normalised residual and
``torch.multinomial`` at every position), ``n/a`` without torch; ``reference`` is
:func:`specdec_jax.reference.speculative_step` in a Python loop over the batch (a ``*`` marks a
time measured on the first ``--reference-max-batch`` sequences and scaled linearly to ``B``);
every ``x/verify`` column is ``x``'s time over ``verify``'s, i.e. the speed-up of ``verify``
over ``x``; ``compile s`` is the wall time of ``jax.jit(jax.vmap(verify)).lower(...).compile()``
(tracing and XLA compilation, not part of ``verify ms``). A second table gives the per-call
latency of the host API :func:`specdec_jax.speculative_step` against the NumPy reference on one
sequence. To add a variant, append a :class:`Method` to :func:`default_methods`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import specdec_jax
from specdec_jax import reference
from specdec_jax.app import bench_logits
from specdec_jax.app import bench_packed
from specdec_jax.app.bench_methods import Case
from specdec_jax.app.bench_methods import Method
from specdec_jax.app.bench_methods import default_methods
from specdec_jax.app.bench_methods import import_torch
from specdec_jax.app.bench_methods import make_case
from specdec_jax.app.bench_methods import on_gpu
from specdec_jax.app.tables import format_table

HEADER = ("B", "gamma", "V", "tok/step")  # the first columns of the main table
LATENCY_CALLS = 50  # minimum number of timed calls for the per-call latency table


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Cell:
  """What one method measured on one configuration (``ms is None``: n/a or failed)."""

  ms: float | None = None
  extrapolated: bool = False
  compile_s: float | None = None
  nbytes: int | None = None
  error: str | None = None


def median_seconds(call: Callable[[], Any], repeats: int) -> float:
  """Median wall time of ``repeats`` calls of ``call``, each waited for with block_until_ready."""
  times = []
  for _ in range(max(1, repeats)):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def run_case(case: Case, methods: Sequence[Method], args: argparse.Namespace,
             warnings: list[str]) -> dict[str, Cell]:
  """Prepare, warm up, cross-check and time every method on ``case``.

  The first method must set ``case.num_accepted``; every other method whose output says how
  many proposals it kept is checked against it (the accept tests read the same uniforms).
  A method other than the first that raises gets an error cell and a warning.
  """
  label = f"B={case.batch} gamma={case.gamma} V={case.vocab}"
  cells: dict[str, Cell] = {}
  for index, method in enumerate(methods):
    try:
      timed = method.prepare(case, args)
      if timed is None:
        cells[method.name] = Cell()
        continue
      output = jax.block_until_ready(timed.call())  # warm-up, and the output to check
      if timed.num_accepted is not None and case.num_accepted is not None:
        got = timed.num_accepted(output)
        want = case.num_accepted[: len(got)]
        if not np.array_equal(got, want):
          bad = int(np.sum(got != want))
          warnings.append(f"{label}: {method.name} kept a different number of proposals than "
                          f"verify in {bad} of {len(got)} sequences.")
      seconds = median_seconds(timed.call, args.repeats) * timed.scale
      cells[method.name] = Cell(ms=seconds * 1e3, extrapolated=timed.covered is not None,
                                compile_s=timed.compile_s, nbytes=timed.nbytes)
      del output, timed
    except Exception as err:
      if index == 0:
        raise
      warnings.append(f"{label}: {method.name} failed: {type(err).__name__}: {err}")
      cells[method.name] = Cell(error=type(err).__name__)
  return cells


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def _fmt(value: float, suffix: str = "") -> str:
  """Three significant digits without exponents."""
  if value >= 100:
    return f"{value:.0f}{suffix}"
  if value >= 10:
    return f"{value:.1f}{suffix}"
  if value >= 1:
    return f"{value:.2f}{suffix}"
  return f"{value:.3f}{suffix}"


def _notes(notes: Sequence[str], markdown: bool) -> str:
  """Footnotes: Markdown paragraphs, or indented and wrapped at 100 columns."""
  if markdown:
    return "\n\n".join(notes)
  return "\n".join(textwrap.fill(n, 100, initial_indent="  ", subsequent_indent="    ")
                   for n in notes)


def _columns(methods: Sequence[Method], gpu: bool) -> list[tuple[Method, str]]:
  """The (method, kind) pairs after the fixed columns, in order."""
  columns: list[tuple[Method, str]] = []
  for method in methods:
    columns.append((method, "ms"))
    if method.show_bytes:
      columns.append((method, "MB"))
    if method.show_bandwidth and (gpu or method.show_bytes):
      columns.append((method, "GB/s"))
    if method.show_peak and gpu:
      columns.append((method, "% peak"))
    if method.ratio:
      columns.append((method, method.ratio))
  return columns


def _title(method: Method, kind: str, base: str) -> str:
  if kind == "over":
    return f"{method.name.split('-')[0]}/{base}"
  if kind == "under":
    return f"{base}/{method.name}"
  if kind == "% peak":
    return f"{method.name} % peak"
  return f"{method.name} {kind}"


def _cell(cells: dict[str, Cell], method: Method, kind: str, base: str, peak_gbps: float) -> str:
  cell = cells[method.name]
  if cell.error:
    return "error"
  if cell.ms is None:
    return "n/a"
  star = "*" if cell.extrapolated else ""
  if kind == "ms":
    return _fmt(cell.ms) + star
  if kind == "MB":
    return "n/a" if cell.nbytes is None else _fmt(cell.nbytes / 1e6)
  if kind in ("GB/s", "% peak"):
    if cell.nbytes is None:
      return "n/a"
    gbps = cell.nbytes / (cell.ms * 1e-3) / 1e9
    return _fmt(gbps) if kind == "GB/s" else _fmt(100 * gbps / peak_gbps)
  reference_ms = cells[base].ms
  if reference_ms is None:
    return "n/a"
  ratio = cell.ms / reference_ms if kind == "over" else reference_ms / cell.ms
  return _fmt(ratio, "x") + star


def main_table(results, methods: Sequence[Method], args: argparse.Namespace) -> str:
  """The main table: one row per configuration, with its footnotes."""
  gpu = on_gpu()
  base = methods[0].name
  columns = _columns(methods, gpu)
  header = [*HEADER, *(_title(m, kind, base) for m, kind in columns), "compile s"]
  rows = []
  for case_key, tok_per_step, cells in results:
    batch, gamma, vocab = case_key
    compile_s = cells[base].compile_s
    rows.append([str(batch), str(gamma), str(vocab), f"{tok_per_step:.2f}",
                 *(_cell(cells, m, kind, base, args.peak_gbps) for m, kind in columns),
                 "n/a" if compile_s is None else f"{compile_s:.2f}"])
  notes = [
    f"times: median of {args.repeats} calls after one warm-up call, in ms; ratios x/{base}: "
    f"x's time over {base}'s ({base}'s speed-up); {base}/floor: {base}'s time in floors.",
    "floor: NumPy reading the bytes the rule needs (the stop row of p, of q if rejected, "
    "2*gamma gathered scalars per sequence); floor MB: those bytes.",
    f"compile s: wall time of jax.jit(jax.vmap(verify)).lower(...).compile(), not in {base} ms.",
  ]
  if gpu:
    notes.append(f"{base} GB/s: bytes the rule needs (floor MB) / {base} time; % peak of "
                 f"--peak-gbps {args.peak_gbps:g}.")
  if any(cells[m.name].extrapolated for _, _, cells in results for m in methods):
    notes.append(f"* timed on the first {args.reference_max_batch} sequences and scaled "
                 "linearly to B (--reference-max-batch).")
  if any(cells[m.name].ms is None and not cells[m.name].error
         for _, _, cells in results for m in methods):
    notes.append("n/a: not available in this run (e.g. torch not installed, or --no-torch).")
  return format_table(header, rows, markdown=args.markdown) + "\n\n" + _notes(notes, args.markdown)


def latency_table(args: argparse.Namespace) -> str:
  """Per-call latency of the host API against the NumPy reference on one sequence."""
  case = make_case(1, 4, 32000, args.seed)
  p, q, draft = case.p[0], case.q[0], case.draft[0]
  device = tuple(x[0] for x in case.device)
  generators = {name: np.random.default_rng(args.seed) for name in ("lib", "ref")}
  calls = {
    "specdec_jax.speculative_step": (
      lambda: specdec_jax.speculative_step(p, q, draft, generators["lib"])),
    "specdec_jax.reference.speculative_step": (
      lambda: reference.speculative_step(p, q, draft, generators["ref"])),
    "specdec_jax.verify (jitted, device arrays)": lambda: specdec_jax.verify(*device),
  }
  repeats = max(args.repeats, LATENCY_CALLS)
  timings = {}
  for name, call in calls.items():
    jax.block_until_ready(call())
    timings[name] = median_seconds(call, repeats) * 1e3
  case.release()
  reference_ms = timings["specdec_jax.reference.speculative_step"]
  rows = [[name, _fmt(ms), _fmt(reference_ms / ms, "x")] for name, ms in timings.items()]
  header = ["B=1, gamma=4, V=32000, float32 NumPy inputs", "ms/call", "reference/this"]
  note = (f"median of {repeats} calls; speculative_step and the reference draw from a "
          "numpy.random.Generator; verify skips the host-side checks and the adapter.")
  table = format_table(header, rows, markdown=args.markdown, align="l")
  return table + "\n\n" + _notes([note], args.markdown)


def header_line(args: argparse.Namespace) -> str:
  """Versions and the machine."""
  if args.no_torch:
    torch_text = "torch disabled (--no-torch)"
  else:
    torch = import_torch()
    torch_text = ("torch not installed" if torch is None
                  else f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
  device = jax.devices()[0]
  return (f"specdec_jax {specdec_jax.__version__} | jax {jax.__version__} | "
          f"backend {jax.default_backend()} | device {device.device_kind} | "
          f"CPUs {os.cpu_count()} | numpy {np.__version__} | {torch_text} | float32")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m specdec_jax.app.bench",
    description="Time jax.jit(jax.vmap(verify)) against a read floor and baselines, side by side.",
  )
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
  parser.add_argument("--gamma", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
  parser.add_argument("--repeats", type=int, default=7, help="timed calls per cell (median)")
  parser.add_argument("--reference-max-batch", type=int, default=64,
                      help="time the NumPy reference on at most this many sequences, scale to B")
  parser.add_argument("--tiny", action="store_true",
                      help="batch 2, gamma 2, V 1000, 2 repeats (a smoke test for CI)")
  parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
  parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
  parser.add_argument("--peak-gbps", type=float, default=4800.0,
                      help="device peak memory bandwidth for the GPU %% peak column (H200: 4800)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-packed", action="store_true",
                      help="skip the packed section (python -m specdec_jax.app.bench_packed)")
  parser.add_argument("--no-logits", action="store_true",
                      help="skip the logits section (python -m specdec_jax.app.bench_logits)")
  args = parser.parse_args(argv)
  if args.tiny:
    args.batch, args.gamma, args.vocab, args.repeats = [2], [2], [1000], 2
  for name in ("batch", "vocab"):
    if min(getattr(args, name)) < 1:
      parser.error(f"--{name} values must be >= 1")
  if min(args.gamma) < 0:
    parser.error("--gamma values must be >= 0")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Run the benchmark and print the tables. Returns 0 (1 when a cross-check failed)."""
  args = parse_args(argv)
  methods = default_methods()
  print(header_line(args), flush=True)
  print()
  configs = [(b, g, v) for v in args.vocab for g in args.gamma for b in args.batch]
  results = []
  warnings: list[str] = []
  for number, (batch, gamma, vocab) in enumerate(configs, 1):
    start = time.perf_counter()
    case = make_case(batch, gamma, vocab, args.seed)
    try:
      cells = run_case(case, methods, args, warnings)
      tok_per_step = float(np.mean(case.num_accepted)) + 1
    finally:
      case.release()
      del case
      gc.collect()
    results.append(((batch, gamma, vocab), tok_per_step, cells))
    print(f"[{number}/{len(configs)}] B={batch} gamma={gamma} V={vocab}: "
          f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
  print(main_table(results, methods, args))
  print()
  print(latency_table(args))
  if not args.no_packed:
    print()
    packed_args = ["--tiny"] if args.tiny else []
    print(bench_packed.run(bench_packed.parse_args(packed_args + (["--markdown"] if args.markdown
                                                                   else []))))
  if not args.no_logits:
    print()
    logits_args = (["--tiny"] if args.tiny else []) + (["--markdown"] if args.markdown else [])
    print(bench_logits.run(bench_logits.parse_args(logits_args)))
  for warning in warnings:
    print(f"WARNING: {warning}")
  return 1 if warnings else 0


if __name__ == "__main__":
  raise SystemExit(main())
