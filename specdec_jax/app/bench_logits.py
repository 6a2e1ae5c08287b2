"""The logits section of ``make bench``: packed verification from logits, as engines call it.

``python -m specdec_jax.app.bench_logits`` (``make bench`` runs it after the packed table).

A ragged batch in vLLM's packed layout (``n_i ~ U{0 .. gamma}`` drafts per request, target
logits ``[T + B, V]``, draft logits ``[T, V]``), per-request parameters, on two kinds of rows:

* ``lm``: peaked rows, a stand-in for LM logits (a Zipf-shaped background, ``-1.1 log(rank)``
  over a random permutation of the vocabulary, plus Gaussian noise of scale 1): a few tokens
  carry most of the mass, as in real next-token rows;
* ``flat``: Gaussian logits of scale 0.3, every token within a few nats: the nucleus of top-p
  covers most of the vocabulary (adversarial for a threshold search).

The parameter mixes: ``none`` (temperature 1), ``temperature`` (per request from {0.6, 0.8,
1.0, 1.3}), ``top-k`` (and temperature; k from {20, 40, 50}), ``top-k+top-p`` (k from {0, 20,
50}, p from {1, 0.95, 0.9, 0.8}, mixed per request), ``greedy-mixed`` (half the requests
greedy, the others sampled with top-p 0.9).

Columns, on the same inputs, one after the other in one process (median of ``--repeats`` calls
after a warm-up): ``ours`` (:func:`specdec_jax.packed_verify` with ``target_logits``,
``draft_logits`` and ``params``); ``floor`` (NumPy reading every logits row once: no logits
verifier can read less, since every row's normaliser depends on all of it); ``tpu-style`` (the
shape of vllm-project/tpu-inference's ``RejectionSampler`` from logits: every row processed
into probabilities with a threshold search, as its ``_compute_probs`` does with
``binary_search.topk_mask/topp_mask``, then the rejection sampler over every row,
:func:`~specdec_jax.app.baselines.eager_packed_sampler`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import specdec_jax
from specdec_jax import SamplingParams
from specdec_jax._logits import process_rows
from specdec_jax.app.baselines import eager_packed_sampler
from specdec_jax.app.bench_packed import cell
from specdec_jax.app.bench_packed import median_ms
from specdec_jax.app.tables import format_table

KINDS = ("lm", "flat")
MIXES = ("none", "temperature", "top-k", "top-k+top-p", "greedy-mixed")


def make_rows(rng, count: int, vocab: int, kind: str) -> np.ndarray:
  """``(count, vocab)`` float32 logits of one kind (see the module docstring)."""
  if kind == "flat":
    return rng.normal(scale=0.3, size=(count, vocab)).astype(np.float32)
  base = (-1.1 * np.log(np.arange(1, vocab + 1))).astype(np.float32)
  rows = np.empty((count, vocab), np.float32)
  for i in range(count):
    rows[i] = base[rng.permutation(vocab)]
  rows += rng.normal(size=(count, vocab)).astype(np.float32)
  return rows


def make_params(rng, batch: int, mix: str) -> SamplingParams | None:
  """Per-request parameters of one mix (None: the defaults, temperature 1)."""
  if mix == "none":
    return None
  t = rng.choice([0.6, 0.8, 1.0, 1.3], batch).astype(np.float32)
  if mix == "temperature":
    return SamplingParams(t)
  if mix == "top-k":
    return SamplingParams(t, rng.choice([20, 40, 50], batch).astype(np.int32))
  if mix == "top-k+top-p":
    return SamplingParams(t, rng.choice([0, 20, 50], batch).astype(np.int32),
                          rng.choice([1.0, 0.95, 0.9, 0.8], batch).astype(np.float32))
  greedy = rng.random(batch) < 0.5
  return SamplingParams(np.where(greedy, 0, t).astype(np.float32), None,
                        np.full(batch, 0.9, np.float32))


def make_case(batch: int, gamma: int, vocab: int, kind: str, seed: int) -> dict:
  """A packed batch from logits: counts, target/draft logits, draft ids, uniforms."""
  rng = np.random.default_rng(seed)
  counts = rng.integers(0, gamma + 1, batch).astype(np.int32)
  total = int(counts.sum())
  target = make_rows(rng, total + batch, vocab, kind)
  starts = np.cumsum(counts) - counts
  draft_rows = np.repeat(starts + np.arange(batch), counts) + np.concatenate(
    [np.arange(c) for c in counts] + [np.zeros(0, int)])
  draft = target[draft_rows] + rng.normal(scale=0.7, size=(total, vocab)).astype(np.float32)
  # Draft ids: the draft's own samples at temperature 1 (Gumbel-max), so acceptance is real.
  ids = np.argmax(draft + rng.gumbel(size=draft.shape).astype(np.float32), axis=1).astype(
    np.int32) if total else np.zeros(0, np.int32)
  return dict(rng=rng, counts=counts, target=target, draft=draft, ids=ids, batch=batch,
              gamma=gamma, vocab=vocab, uniforms=rng.random((batch, gamma + 1)).astype(np.float32))


def _row_params(params: SamplingParams | None, owners: np.ndarray, batch: int) -> SamplingParams:
  params = SamplingParams() if params is None else params
  return SamplingParams(*(None if v is None else jnp.asarray(
    np.broadcast_to(np.asarray(v), (batch,))[owners]) for v in params))


@jax.jit
def _tpu_style(target, draft, ids, counts, target_params, draft_params, key):
  """Every row processed into probabilities (threshold search, softmax), then the rejection
  sampler over every row."""
  p = process_rows(target, target_params)
  q = process_rows(draft, draft_params)
  return eager_packed_sampler(p, q, ids, counts, key)


def timings(case: dict, mix: str, repeats: int) -> list[str]:
  """One row of the table."""
  batch, gamma, counts = case["batch"], case["gamma"], case["counts"]
  params = make_params(case["rng"], batch, mix)
  dev = {k: jnp.asarray(case[k]) for k in ("target", "draft", "ids", "counts", "uniforms")}

  def ours():
    return specdec_jax.packed_verify(dev["ids"], dev["counts"], max_spec_len=gamma,
                                     target_logits=dev["target"], draft_logits=dev["draft"],
                                     params=params, uniforms=dev["uniforms"])

  owners_t = np.repeat(np.arange(batch), counts + 1)
  owners_d = np.repeat(np.arange(batch), counts)
  tp, dp = _row_params(params, owners_t, batch), _row_params(params, owners_d, batch)
  key = jax.random.key(0)

  def peer():
    return _tpu_style(dev["target"], dev["draft"], dev["ids"], dev["counts"], tp, dp, key)

  target, draft = case["target"], case["draft"]

  def floor():
    return float(target.sum()) + float(draft.sum())

  if not np.asarray(ours().valid).all():
    raise RuntimeError("packed_verify flagged the benchmark inputs")
  t = {"ours": median_ms(ours, repeats), "floor": median_ms(floor, repeats),
       "peer": median_ms(peer, max(1, repeats // 2))}
  return [case["kind"], str(batch), str(case["vocab"]), mix, cell(t["ours"]), cell(t["floor"]),
          cell(t["ours"] / t["floor"], "x"), cell(t["peer"]), cell(t["peer"] / t["ours"], "x")]


def run(args: argparse.Namespace) -> str:
  rows = []
  for kind in args.kinds:
    for vocab in args.vocab:
      for batch in args.batch:
        start = time.perf_counter()
        case = make_case(batch, args.gamma, vocab, kind, args.seed)
        case["kind"] = kind
        for mix in args.mixes:
          rows.append(timings(case, mix, args.repeats))
        print(f"logits {kind} B={batch} V={vocab}: {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
  header = ["rows", "B", "V", "params", "ours ms", "floor ms", "ours/floor", "tpu-style ms",
            "tpu-style/ours"]
  return "\n".join([
    f"From logits, packed (num_draft ~ U{{0..{args.gamma}}}), per-request parameters:",
    format_table(header, rows, align="llll", markdown=args.markdown),
    "",
    f"median of {args.repeats} calls ({max(1, args.repeats // 2)} for tpu-style) after a "
    "warm-up; ours/floor is ours in floors (NumPy reading every logits row once), "
    "tpu-style/ours our speed-up over a sampler that processes every row first."])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m specdec_jax.app.bench_logits",
                                   description="Verification from logits, timed side by side.")
  parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
  parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
  parser.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
  parser.add_argument("--gamma", type=int, default=4)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--markdown", action="store_true")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tiny", action="store_true",
                      help="B 4, V 1000, two mixes (a smoke test)")
  args = parser.parse_args(argv)
  if args.tiny:
    args.batch, args.vocab, args.repeats = [4], [1000], 1
    args.mixes = ["top-k+top-p", "greedy-mixed"]
  return args


def main(argv: Sequence[str] | None = None) -> int:
  print(run(parse_args(argv)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
