"""The packed section of ``make bench``: ragged engine batches, verified in place or padded first.

``python -m specdec_jax.app.bench_packed`` (``make bench`` runs it after the main table).

Every request proposes ``n_i ~ U{0 .. gamma}`` drafts; the batch is laid out as the engines
keep it (vLLM's interleaved ``[T + B, V]`` target rows, ``[T, V]`` draft rows, ``[T]`` draft
ids). On the same inputs, one after the other in one process, as the median of ``--repeats``
calls after a warm-up:

* ``packed``: :func:`specdec_jax.packed_verify`, reading every row in place;
* ``floor``: NumPy reading exactly the bytes the rule needs (per request its stop row of ``p``,
  of ``q`` if a draft was rejected, and the gathered scalars), as in the main table;
* ``gather+vmap``: what an integrator writes today, the ragged-to-padded gather (a jitted
  ``take`` to ``(B, gamma + 1, V)`` and ``(B, gamma, V)``) then ``jax.jit(jax.vmap(verify))``;
* ``eager``: :func:`~specdec_jax.app.baselines.eager_packed_sampler`, a jitted sampler in the
  style of vllm-project/tpu-inference's ``RejectionSampler`` on the packed rows (residual and an
  exponential race over every draft row, one more race for the bonus rows).

The logits rows (``--logits``) process the same layout from logits with per-request
temperature, top-k and top-p: ``packed`` (sort-free top-k/top-p) against ``sorted``, the path
before the packed entry point (gather to padded, process every row with a stable argsort, then
``jax.vmap(verify)``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import specdec_jax
from specdec_jax import SamplingParams
from specdec_jax._logits.params import take_rows
from specdec_jax.app.baselines import eager_packed_sampler
from specdec_jax.app.baselines import sorted_process_rows
from specdec_jax.app.tables import format_table

MIX = 0.55  # q = MIX * p + (1 - MIX) * noise, as in the main table: acceptance ~0.7


def make_packed(batch: int, gamma: int, vocab: int, seed: int) -> dict:
  """Ragged random inputs in the packed layout, with the padded gather indices."""
  rng = np.random.default_rng(seed)
  counts = rng.integers(0, gamma + 1, batch).astype(np.int32)
  total = int(counts.sum())
  starts = np.cumsum(counts) - counts
  p = rng.random((total + batch, vocab), np.float32) ** 4
  p /= p.sum(1, keepdims=True)
  draft_rows = (starts + np.arange(batch)).repeat(counts) + np.concatenate(
    [np.arange(c) for c in counts] + [np.zeros(0, int)])
  noise = rng.random((total, vocab), np.float32)
  q = MIX * p[draft_rows] + (1 - MIX) * noise / noise.sum(1, keepdims=True)
  q /= q.sum(1, keepdims=True)
  ids = np.array([rng.choice(vocab, p=row / row.sum()) for row in q.astype(np.float64)],
                 np.int32) if total else np.zeros(0, np.int32)
  p_index = np.clip((starts + np.arange(batch))[:, None] + np.arange(gamma + 1)[None, :], 0,
                    total + batch - 1)
  q_index = np.clip(starts[:, None] + np.arange(gamma)[None, :], 0, max(total - 1, 0))
  return dict(counts=counts, p=p, q=q.astype(np.float32), ids=ids, p_index=p_index,
              q_index=q_index, uniforms=rng.random((batch, gamma + 1)).astype(np.float32),
              gamma=gamma, batch=batch, vocab=vocab, starts=starts, rng=rng)


@functools.partial(jax.jit, static_argnames=())
def _gather_then_vmap(p, q, ids, counts, uniforms, p_index, q_index):
  return jax.vmap(specdec_jax.verify)(p[p_index], q[q_index], ids[q_index], uniforms,
                                      num_draft=counts)


@jax.jit
def _sorted_then_vmap(p_logits, q_logits, ids, counts, uniforms, p_index, q_index, params):
  """The path before the packed entry point: gather, sort-based processing, vmap(verify)."""
  batch, width = p_index.shape
  flat = take_rows(params, jnp.repeat(jnp.arange(batch, dtype=jnp.int32), width))
  p = sorted_process_rows(p_logits[p_index].reshape(batch * width, -1), flat)
  flat_q = take_rows(params, jnp.repeat(jnp.arange(batch, dtype=jnp.int32), width - 1))
  q = sorted_process_rows(q_logits[q_index].reshape(batch * (width - 1), -1), flat_q)
  return jax.vmap(specdec_jax.verify)(p.reshape(batch, width, -1), q.reshape(batch, width - 1, -1),
                                      ids[q_index], uniforms, num_draft=counts)


def median_ms(call, repeats: int) -> float:
  jax.block_until_ready(call())  # warm-up (compilation)
  times = []
  for _ in range(max(1, repeats)):
    start = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def probability_row(case: dict, repeats: int) -> list[str]:
  """Times of one probability configuration, as formatted cells."""
  dev = {k: jnp.asarray(case[k]) for k in ("p", "q", "ids", "counts", "uniforms", "p_index",
                                            "q_index")}
  gamma = case["gamma"]

  def packed():
    return specdec_jax.packed_verify(dev["ids"], dev["counts"], max_spec_len=gamma,
                                     target_probs=dev["p"], draft_probs=dev["q"],
                                     uniforms=dev["uniforms"])

  result = packed()
  accepted = np.asarray(result.num_accepted)
  if not np.asarray(result.valid).all():
    raise RuntimeError("packed_verify flagged the benchmark inputs")
  padded = _gather_then_vmap(*(dev[k] for k in ("p", "q", "ids", "counts", "uniforms",
                                                 "p_index", "q_index")))
  if not np.array_equal(np.asarray(padded.tokens), np.asarray(result.tokens)):
    raise RuntimeError("packed_verify and gather + vmap(verify) disagree")
  p, q, ids, counts = case["p"], case["q"], case["ids"], case["counts"]
  stops = case["p_index"][np.arange(case["batch"]), accepted]
  rejected = accepted < counts
  q_stops = case["starts"] + accepted

  draft_rows = np.repeat(case["starts"] + np.arange(case["batch"]), counts) + np.concatenate(
    [np.arange(c) for c in counts] + [np.zeros(0, int)])

  def floor():
    total = float(p[draft_rows, ids].sum()) + float(q[np.arange(len(ids)), ids].sum())
    for b in range(case["batch"]):
      total += float(p[stops[b]].sum())
      if rejected[b]:
        total += float(q[q_stops[b]].sum())
    return total

  key = jax.random.key(0)
  times = {
    "packed": median_ms(packed, repeats),
    "floor": median_ms(floor, repeats),
    "gather": median_ms(lambda: _gather_then_vmap(*(dev[k] for k in (
      "p", "q", "ids", "counts", "uniforms", "p_index", "q_index"))), repeats),
    "eager": median_ms(lambda: eager_packed_sampler(dev["p"], dev["q"], dev["ids"], dev["counts"],
                                                    key), repeats),
  }
  t = times
  return [str(case["batch"]), str(case["vocab"]), f"{np.mean(counts):.2f}", cell(t["packed"]),
          cell(t["floor"]), cell(t["packed"] / t["floor"], "x"), cell(t["gather"]),
          cell(t["gather"] / t["packed"], "x"), cell(t["eager"]),
          cell(t["eager"] / t["packed"], "x")]


def logits_row(case: dict, repeats: int) -> list[str]:
  """Times of one logits configuration (per-request temperature, top-k, top-p)."""
  rng, batch, gamma = case["rng"], case["batch"], case["gamma"]
  p_logits = jnp.asarray(np.log(case["p"]) * 0.5)
  q_logits = jnp.asarray(np.log(case["q"]) * 0.5)
  params = SamplingParams(
    jnp.asarray(rng.choice([0.0, 0.6, 1.0, 1.3], batch).astype(np.float32)),
    jnp.asarray(rng.choice([0, 20, 50, 1000], batch).astype(np.int32)),
    jnp.asarray(rng.choice([1.0, 0.95, 0.8], batch).astype(np.float32)))
  dev = {k: jnp.asarray(case[k]) for k in ("ids", "counts", "uniforms", "p_index", "q_index")}

  def packed():
    return specdec_jax.packed_verify(dev["ids"], dev["counts"], max_spec_len=gamma,
                                     target_logits=p_logits, draft_logits=q_logits,
                                     params=params, uniforms=dev["uniforms"])

  def sorted_path():
    return _sorted_then_vmap(p_logits, q_logits, dev["ids"], dev["counts"], dev["uniforms"],
                             dev["p_index"], dev["q_index"], params)

  if not np.array_equal(np.asarray(packed().tokens), np.asarray(sorted_path().tokens)):
    print("note: sort-free and sorted processing differ on a top-p boundary within rounding",
          file=sys.stderr)
  t_packed, t_sorted = median_ms(packed, repeats), median_ms(sorted_path, repeats)
  return [str(batch), str(case["vocab"]), f"{np.mean(case['counts']):.2f}", cell(t_packed),
          cell(t_sorted), cell(t_sorted / t_packed, "x")]


def cell(value: float, suffix: str = "") -> str:
  """A time or ratio as a table cell: 3 significant digits, then no decimals from 100 on."""
  if value >= 100:
    return f"{value:.0f}{suffix}"
  if value >= 10:
    return f"{value:.1f}{suffix}"
  return f"{value:.2f}{suffix}" if value >= 1 else f"{value:.3f}{suffix}"


def run(args: argparse.Namespace) -> str:
  """Both tables, as text."""
  prob_rows, logit_rows = [], []
  for vocab in args.vocab:
    for batch in args.batch:
      start = time.perf_counter()
      case = make_packed(batch, args.gamma, vocab, args.seed)
      prob_rows.append(probability_row(case, args.repeats))
      if batch in args.logits_batch:
        logit_rows.append(logits_row(case, max(1, args.repeats // 2)))
      print(f"packed B={batch} V={vocab}: {time.perf_counter() - start:.1f} s", file=sys.stderr,
            flush=True)
  header = ["B", "V", "drafts/req", "packed ms", "floor ms", "packed/floor", "gather+vmap ms",
            "gather/packed", "eager ms", "eager/packed"]
  text = [f"Packed ragged batches (num_draft ~ U{{0..{args.gamma}}}), probabilities:",
          format_table(header, prob_rows, markdown=args.markdown)]
  if logit_rows:
    header = ["B", "V", "drafts/req", "packed ms", "sorted ms", "sorted/packed"]
    text += ["", "From logits, per-request temperature / top-k / top-p (draft logits too):",
             format_table(header, logit_rows, markdown=args.markdown)]
  text += ["", f"median of {args.repeats} calls ({max(1, args.repeats // 2)} for logits) after "
           "a warm-up; x/packed is packed's speed-up over x, packed/floor its time in floors."]
  return "\n".join(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m specdec_jax.app.bench_packed",
                                   description="Packed ragged verification, timed side by side.")
  parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
  parser.add_argument("--gamma", type=int, default=4)
  parser.add_argument("--logits-batch", type=int, nargs="*", default=[64],
                      help="batch sizes that also get the logits row (sorted is slow)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--markdown", action="store_true")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tiny", action="store_true", help="B 4, V 1000 (a smoke test)")
  args = parser.parse_args(argv)
  if args.tiny:
    args.batch, args.vocab, args.logits_batch, args.repeats = [4], [1000], [4], 2
  return args


def main(argv: Sequence[str] | None = None) -> int:
  print(run(parse_args(argv)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
