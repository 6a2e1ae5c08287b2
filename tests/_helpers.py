"""Shared test helpers: random cases, chi-square checks, draft sampling."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import SamplingParams
from specdec_jax import process_logits
from specdec_jax._core.sampling import first_hit
from specdec_jax._core.sampling import sanitize
from specdec_jax.theory import chi_square_test

# The worked example: draft [1, 2] is all accepted ([1, 2, 0], 3 draws), [0, 2] rejected at once
# ([2], 2 draws).
P_EXAMPLE = np.array([[0.2, 0.5, 0.3], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]])
Q_EXAMPLE = np.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
U_EXAMPLE = np.array([0.7, 0.9, 0.1])

# Prompts of the toy decoding-loop tests (V = 16): repeats, one-token prompts, a mix of lengths.
TOY_PROMPTS = np.array([
  [3, 7, 3, 7, 3, 7],
  [5, 9, 9, 9, 9, 9],
  [1, 2, 3, 1, 2, 9],
  [8, 9, 9, 9, 9, 9],
  [4, 4, 0, 9, 9, 9],
  [2, 6, 1, 2, 6, 9],
], np.int32)
TOY_PROMPT_LENGTHS = np.array([6, 1, 5, 1, 3, 5], np.int32)

KINDS = ("flat", "peaked", "one_hot", "overlap", "disjoint", "equal", "zero_q")


def _normalize(rows: np.ndarray) -> np.ndarray:
  return rows / rows.sum(axis=-1, keepdims=True)


def random_rows(rng: np.random.Generator, n: int, vocab: int, kind: str) -> np.ndarray:
  """``n`` probability rows over ``vocab`` tokens of the given kind (float64)."""
  if kind == "flat":
    return np.full((n, vocab), 1.0 / vocab)
  if kind == "peaked":
    return _normalize(rng.dirichlet(np.full(vocab, 0.1), size=n) + 1e-300)
  if kind == "one_hot":
    rows = np.zeros((n, vocab))
    rows[np.arange(n), rng.integers(0, vocab, size=n)] = 1.0
    return rows
  rows = rng.dirichlet(np.ones(vocab), size=n)
  if kind in ("overlap", "equal"):
    return rows
  # Zero out a random subset of each row (keeping at least one entry).
  mask = rng.random((n, vocab)) < 0.5
  mask[np.arange(n), rng.integers(0, vocab, size=n)] = False
  rows = np.where(mask, 0.0, rows)
  return _normalize(rows)


def random_case(rng: np.random.Generator, gamma: int, vocab: int, kind: str):
  """A (p, q, draft) triple in float64; the draft is sampled from q (except for 'zero_q')."""
  p = random_rows(rng, gamma + 1, vocab, kind if kind != "zero_q" else "disjoint")
  if kind == "equal":
    q = p[:gamma].copy()
  elif kind == "disjoint" and vocab > 1:
    # q lives on tokens where p[i] is zero as far as possible.
    q = np.where(p[:gamma] > 0, 0.0, rng.random((gamma, vocab)))
    empty = q.sum(axis=-1) == 0
    q[empty] = rng.dirichlet(np.ones(vocab), size=int(empty.sum()))
    q = _normalize(q)
  else:
    q = random_rows(rng, gamma, vocab, kind if kind != "zero_q" else "disjoint")
  if kind == "zero_q":  # draft ids anywhere, also where q == 0
    draft = rng.integers(0, vocab, size=gamma)
  else:
    draft = sample_rows(rng, q, 1)[0] if gamma else np.zeros(0, np.int64)
  return p, q, draft.astype(np.int32)


def sample_rows(rng: np.random.Generator, rows: np.ndarray, n: int) -> np.ndarray:
  """``n`` independent draws from every row: shape ``(n, len(rows))``, inverse CDF in float64."""
  cdf = np.cumsum(rows, axis=-1)
  cdf[:, -1] = np.inf  # no rounding gap at the top
  u = rng.random((n, rows.shape[0], 1))
  return np.argmax(u < cdf[None], axis=-1)


def assert_same_distribution(samples: np.ndarray, probs: np.ndarray, alpha: float, label: str):
  """Chi-square test of integer ``samples`` against ``probs`` at significance ``alpha``."""
  counts = np.bincount(np.asarray(samples), minlength=len(probs))
  if counts.shape[0] > len(probs):
    raise AssertionError(f"{label}: sample outside [0, {len(probs)}): {counts}")
  _, _, pvalue, detail = chi_square_test(counts, probs)
  if pvalue < alpha:
    raise AssertionError(f"{label}: chi-square p = {pvalue:.3g} < alpha = {alpha:.3g}; {detail}")
  return pvalue


def dirichlet_case(seed: int, gamma: int, vocab: int, zeros: bool = False):
  """Random ``(p (gamma + 1, V), q (gamma, V))`` with q half p, half noise.

  ``zeros``: q misses a token the target likes (q[:, -1] = 0) and proposes one the
  target never emits (p[:, 0] = 0).
  """
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.ones(vocab), size=gamma + 1)
  q = 0.5 * p[:gamma] + 0.5 * rng.dirichlet(np.ones(vocab), size=gamma)
  if zeros:
    p[:, 0] = 0.0
    q[:, -1] = 0.0
    p /= p.sum(-1, keepdims=True)
    q /= q.sum(-1, keepdims=True)
  return p, q


def conditional_errors(law: dict[tuple[int, ...], float], p: np.ndarray) -> float:
  """Largest |P(y_j = v | y_<j = prefix, the step emits position j) - p[j, v]| of an exact law."""
  worst = 0.0
  prefix_mass: dict[tuple[int, ...], np.ndarray] = {}
  for tokens, mass in law.items():
    for j in range(len(tokens)):
      row = prefix_mass.setdefault(tokens[:j], np.zeros(p.shape[1]))
      row[tokens[j]] += mass
  for prefix, row in prefix_mass.items():
    if row.sum() > 0:
      worst = max(worst, float(np.max(np.abs(row / row.sum() - p[len(prefix)]))))
  return worst


def per_position(tokens: np.ndarray, num_tokens: np.ndarray, p: np.ndarray, alpha: float,
                 label: str, min_count: int = 500) -> int:
  """Chi-square of the emitted token at every position with enough samples; how many were tested."""
  tested = 0
  for j in range(p.shape[0]):
    emitted = num_tokens > j
    if emitted.sum() < min_count:  # too few to test this position
      continue
    assert_same_distribution(tokens[emitted, j], p[j], alpha, f"{label} position {j}")
    tested += 1
  return tested


def exact_sequence_probs(model, prompt, new: int, params: SamplingParams) -> np.ndarray:
  """P(continuation) for every continuation in lexicographic order, by enumeration (float64)."""
  vocab = model.vocab_size
  conts = np.array(list(itertools.product(range(vocab), repeat=new)), np.int32)
  seqs = np.concatenate([np.tile(prompt, (len(conts), 1)), conts], axis=1)
  width = seqs.shape[1]
  positions = np.broadcast_to(np.arange(width, dtype=np.int32), seqs.shape)
  logits, _ = model.apply(model.params, jnp.asarray(seqs), jnp.asarray(positions),
                          model.init_cache(len(seqs), width))
  probs = np.asarray(process_logits(logits.reshape(-1, vocab), params), np.float64)
  probs = probs.reshape(len(seqs), width, vocab)
  start = len(prompt)
  out = np.ones(len(seqs))
  for i in range(new):
    out *= probs[np.arange(len(seqs)), start - 1 + i, conts[:, i]]
  return out / out.sum()


def sequence_index(tokens: np.ndarray, vocab: int) -> np.ndarray:
  """Index of each row of ``tokens (n, k)`` in the lexicographic order of ``V ** k`` sequences."""
  return tokens @ (vocab ** np.arange(tokens.shape[1] - 1, -1, -1))


def sample_index_cumsum(weights: jax.Array, u: jax.Array) -> jax.Array:
  """The straightforward sampler: one cumulative sum over the whole row (for comparison).

  Same semantics as :func:`sample_index`; slower, and its float32 partial sums
  drift over long rows. Kept as the baseline the fast sampler is tested against.
  """
  w = sanitize(weights)
  cdf = jnp.cumsum(w)
  return first_hit(w, cdf, u * cdf[-1])


def largest_collective(hlo: str) -> int:
  """Element count of the largest array any collective in compiled HLO text moves."""
  ops = r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(-start)?"
  found = re.findall(r"= (.*?) " + ops + r"\(", hlo)
  assert found, "expected a few scalar collectives"
  sizes = []
  for shapes, _, _ in found:
    for dims in re.findall(r"\w\d+\[([\d,]*)\]", shapes):
      sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
  return max(sizes)


def keyed(fn):
  """``fn`` with its ``key=`` as the first positional argument and without ``uniforms``, for
  ``jax.vmap`` over keys: ``jax.vmap(keyed(verify))(keys, p, q, draft)`` (positional
  arguments after the key fill ``fn``'s parameters in order, ``uniforms`` and ``key`` skipped)."""
  import inspect

  names = [n for n in inspect.signature(fn).parameters if n not in ("uniforms", "key")]

  def call(key, *args, **kwargs):
    return fn(**dict(zip(names, args, strict=False)), key=key, **kwargs)

  return call


def longest_match_encoder(tokens):
  """A toy tokenizer over ``tokens`` (each id's bytes, None for control ids): ``encode(text)``
  takes the longest token that starts the rest of the text, as grammars' forced text is spelled
  by :func:`specdec_jax.structured.compile_regex`'s ``encode``."""
  def encode(text: str) -> list[int]:
    data, out = text.encode(), []
    while data:
      best = max((i for i, t in enumerate(tokens) if t and data.startswith(t)),
                 key=lambda i: len(tokens[i]))
      out.append(best)
      data = data[len(tokens[best]):]
    return out

  return encode
