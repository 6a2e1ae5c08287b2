"""Train the EAGLE-style draft of SmolLM2 by self-distillation (``make train-draft``).

1. **Data**: the target answers a set of varied instructions (:data:`TRAIN_PROMPTS`, none of
   them a benchmark prompt) greedily and by sampling; its own generations are the corpus, so
   the draft learns the distribution it will be verified against (self-distillation, as in
   Medusa-2 and EAGLE's fixed-dataset ablation).
2. **Features**: one target pass over every sequence gives the final-normed hidden states
   ``f[t]`` and the log-normaliser of the full-vocabulary softmax, so the target's next-token
   probabilities of the draft vocabulary are ``exp(f[t] @ head_K.T - lse[t])`` at the cost of
   the small head.
3. **Draft vocabulary** (FR-Spec): the ``K`` most frequent tokens of the corpus, the end of turn
   always among them.
4. **Training** (optax AdamW): at position ``t`` the draft reads ``x[t]`` and ``f[t - 1]``; the
   loss is the cross-entropy against the target's probabilities plus a feature regression
   (EAGLE's two losses), on a second unrolled pass too, where the draft reads its own
   predicted features as at inference (the "training-time test" of EAGLE-3/HASS), which is what
   makes the second and later proposals usable.

Reference: Li et al., "EAGLE", arXiv:2401.15077; Cai et al., "Medusa", arXiv:2401.10774;
Zhao et al., "FR-Spec", arXiv:2502.14856; Zhang et al., "HASS", arXiv:2408.15766.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax.app import smollm2
from specdec_jax.app.argtypes import int_at_least
from specdec_jax.models import eagle
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.models.llama import LlamaParams
from specdec_jax.models.llama import init_cache
from specdec_jax.models.llama import llama_apply_features
from specdec_jax.models.llama import make_model

#: Instructions the target answers to make the corpus (varied tasks; no benchmark prompt).
TRAIN_PROMPTS = (
  "Write a short story about a girl who builds a robot from scrap metal.",
  "Write a short story about a fisherman who catches a talking fish.",
  "Write a short story about a dragon who is afraid of fire.",
  "Write a short story about two friends lost in a forest at night.",
  "Write a short story about an old clock that stops at midnight.",
  "Write a story about a cat who wants to become a chef.",
  "Write a short story about a village where it never stops raining.",
  "Tell me a story about a young wizard on his first day at school.",
  "Write a short story about a sailor who discovers an island that is not on any map.",
  "Write a short story about a baker who bakes bread that grants wishes.",
  "Write a short story about a boy who can talk to birds.",
  "Write a story about a lost dog finding its way home.",
  "Write a poem about the sea at dawn.",
  "Write a poem about autumn leaves.",
  "Describe a busy market in a small town.",
  "Describe your ideal holiday in the mountains.",
  "Explain how photosynthesis works in simple terms.",
  "Explain why the sky is blue.",
  "Explain how a bicycle stays upright.",
  "Explain what a computer program is to a ten year old.",
  "What are the benefits of regular exercise?",
  "What are some tips for learning a new language?",
  "Give me five ideas for a birthday party.",
  "List some healthy breakfast ideas.",
  "How do I make a cup of tea?",
  "How can I improve my sleep?",
  "Write an email to a friend inviting them to dinner.",
  "Write a letter to your future self.",
  "Write a short speech for a school graduation.",
  "Summarize the plot of a typical detective novel.",
  "What is the difference between weather and climate?",
  "Explain how rain forms.",
  "Why do leaves change colour in the autumn?",
  "Describe the life cycle of a butterfly.",
  "What makes a good friend?",
  "Give advice to someone starting their first job.",
  "Write a short story about a robot who learns to paint.",
  "Write a short story about a princess who becomes a knight.",
  "Write a short story about a mouse who lives in a library.",
  "Write a short story about a family moving to a new city.",
  "Write a short story about a mysterious door in an old house.",
  "Write a story about a girl who finds a map in her grandmother's attic.",
  "Write a short story about an astronaut alone on the moon.",
  "Write a short story about a musician who loses her voice.",
  "Describe a walk along the beach on a windy day.",
  "Write a diary entry of a sailor crossing the ocean.",
  "Explain how a lighthouse helps ships at sea.",
  "Tell me about the history of bread.",
)

#: The draft vocabulary size (the head reads this many of the target's 49,152 output rows).
DRAFT_VOCAB = 8192



def _say(progress: bool, message: str) -> None:
  if progress:
    print(message, file=sys.stderr, flush=True)


def generate_corpus(target, prompts: Sequence[Sequence[int]], *, temperatures: Sequence[float],
                    max_new_tokens: int, batch: int, eos_id: int | None, seed: int = 0,
                    progress: bool = True) -> list[np.ndarray]:
  """The target's own answers: one sequence (prompt + answer) per prompt and temperature."""
  sequences = []
  jobs = [(list(p), t) for t in temperatures for p in prompts]
  start = time.perf_counter()
  for i in range(0, len(jobs), batch):
    chunk = jobs[i: i + batch]
    chunk += [chunk[-1]] * (batch - len(chunk))  # one compiled shape
    width = max(len(p) for p, _ in chunk)
    prompt = np.zeros((batch, width), np.int32)
    for b, (p, _) in enumerate(chunk):
      prompt[b, :len(p)] = p
    lengths = np.array([len(p) for p, _ in chunk], np.int32)
    params = SamplingParams(temperature=jnp.asarray([t for _, t in chunk], jnp.float32))
    out = generate(target, jnp.asarray(prompt), jnp.asarray(lengths), jax.random.key(seed + i),
                   max_new_tokens=max_new_tokens, params=params, eos_id=eos_id,
                   max_len=width + max_new_tokens)
    tokens, total = np.asarray(out.tokens), np.asarray(out.lengths)
    for b in range(min(batch, len(jobs) - i)):
      sequences.append(tokens[b, :total[b]].copy())
    _say(progress, f"  corpus: {min(i + batch, len(jobs))}/{len(jobs)} answers, "
                   f"{sum(map(len, sequences))} tokens, {time.perf_counter() - start:.0f} s")
  return sequences


def frequent_vocab(sequences: Sequence[np.ndarray], size: int, vocab: int,
                   always: Sequence[int] = ()) -> np.ndarray:
  """The ``size`` most frequent ids of the corpus (``always`` included), sorted by id."""
  counts = np.bincount(np.concatenate(list(sequences)), minlength=vocab).astype(np.float64)
  counts[list(always)] = np.inf
  order = np.argsort(-counts, kind="stable")[:min(size, vocab)]
  return np.sort(order).astype(np.int32)


class Corpus:
  """Padded training arrays: ``tokens (N, T)``, ``mask (N, T)``, target ``features (N, T, D)``
  and ``lse (N, T)`` (the log-normaliser of the target's full softmax at each position)."""

  def __init__(self, params: LlamaParams, config: LlamaConfig, sequences: Sequence[np.ndarray],
               *, length: int, batch: int = 8, progress: bool = True):
    n = len(sequences)
    self.tokens = np.zeros((n, length), np.int32)
    self.mask = np.zeros((n, length), bool)
    for i, s in enumerate(sequences):
      s = s[:length]
      self.tokens[i, :len(s)] = s
      self.mask[i, :len(s)] = True
    feats, lses = [], []
    forward = jax.jit(lambda p, t, c: llama_apply_features(p, t, jnp.broadcast_to(
      jnp.arange(length, dtype=jnp.int32), t.shape), c, config=config))
    start = time.perf_counter()
    for i in range(0, n, batch):
      rows = self.tokens[i: i + batch]
      pad = batch - rows.shape[0]
      rows = np.pad(rows, ((0, pad), (0, 0)))
      logits, f, _ = forward(params, jnp.asarray(rows), init_cache(config, batch, length))
      feats.append(np.asarray(f)[:batch - pad])
      lses.append(np.asarray(jax.nn.logsumexp(logits, axis=-1))[:batch - pad])
      _say(progress, f"  features: {min(i + batch, n)}/{n} sequences, "
                     f"{time.perf_counter() - start:.0f} s")
    self.features = np.concatenate(feats)
    self.lse = np.concatenate(lses)


def draft_loss(weights: eagle.EagleWeights, embed, head, batch, noise_key, *,
               config: LlamaConfig, noise: float = 0.05, unrolled_weight: float = 0.5,
               feature_weight: float = 0.1):
  """EAGLE's losses on one batch, over a teacher-forced pass and one unrolled pass.

  ``batch = (tokens (B, T), mask (B, T), features (B, T, D), lse (B, T))``. Position ``t``
  reads ``x[t]`` and ``f[t - 1]`` (zeros at 0) and is scored against the target's next-token
  probabilities at ``t`` on the draft vocabulary (cross-entropy) and against ``f[t]`` (smooth
  L1). Returns ``(loss, cross-entropy of the first pass)``.
  """
  tokens, mask, feats, lse = batch
  b, t = tokens.shape
  layer = eagle.layer_config(config)
  params = eagle.EagleParams(weights=weights, embed=embed, head=head)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  target_p = jnp.exp(jnp.einsum("btd,kd->btk", feats, head) - lse[..., None])
  valid = (mask & (jnp.arange(t) >= 1)[None]).astype(jnp.float32)
  count = jnp.maximum(valid.sum(), 1.0)

  def run(inputs):
    cache = init_cache(layer, b, t, n_layers=1)
    logits, g, _ = eagle.eagle_apply(params, tokens, inputs, positions, cache, config=layer)
    ce = -(target_p * jax.nn.log_softmax(logits, axis=-1)).sum(-1)
    diff = jnp.abs(g - feats)
    reg = jnp.where(diff < 1.0, 0.5 * diff ** 2, diff - 0.5).mean(-1)
    return (ce * valid).sum() / count, (reg * valid).sum() / count, g

  shifted = jnp.pad(feats, ((0, 0), (1, 0), (0, 0)))[:, :t]
  scale = jnp.std(feats)
  shifted = shifted + noise * scale * jax.random.uniform(noise_key, shifted.shape, minval=-1.0)
  ce1, reg1, g1 = run(shifted)
  ce2, reg2, _ = run(jnp.pad(g1, ((0, 0), (1, 0), (0, 0)))[:, :t])
  loss = ce1 + feature_weight * reg1 + unrolled_weight * (ce2 + feature_weight * reg2)
  return loss, ce1


def learning_rate_schedule(steps: int, learning_rate: float):
  """The optax schedule of :func:`train_eagle`: a linear warm-up from 0 over
  ``min(100, steps // 10 + 1)`` steps, then a cosine decay to 5% by step ``steps``.

  A run of one step has no warm-up (it would be the whole run, at a rate of 0), and the decay
  always has a step to take (optax refuses zero decay steps).
  """
  import optax  # the training extra

  warmup = min(100, steps // 10 + 1, steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, max(steps, warmup + 1),
                                            learning_rate * 0.05)


def train_eagle(params: LlamaParams, config: LlamaConfig, corpus: Corpus, vocab_ids: np.ndarray,
                *, steps: int, batch: int, learning_rate: float = 1e-3, seed: int = 0,
                progress: bool = True, log_every: int = 50):
  """Train the draft's weights on a :class:`Corpus`: ``(weights, losses)``.

  Needs ``optax`` (``pip install 'specdec_jax[train]'``).
  """
  import optax  # the training extra; the library and the demo do not need it

  key = jax.random.key(seed)
  key, init_key = jax.random.split(key)
  weights = eagle.init_weights(init_key, config)
  head_all = params.embed if params.output is None else params.output
  head = jnp.take(head_all, jnp.asarray(vocab_ids), axis=0)
  schedule = learning_rate_schedule(steps, learning_rate)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.0))
  with jax.numpy_dtype_promotion("standard"):
    state = optimizer.init(weights)

  @jax.jit
  def step(weights, state, batch_arrays, key):
    (loss, ce), grads = jax.value_and_grad(draft_loss, has_aux=True)(
      weights, params.embed, head, batch_arrays, key, config=config)
    updates, state = optimizer.update(grads, state, weights)
    return optax.apply_updates(weights, updates), state, loss, ce

  rng = np.random.default_rng(seed)
  n = corpus.tokens.shape[0]
  losses = []
  start = time.perf_counter()
  for i in range(steps):
    rows = rng.choice(n, size=batch, replace=n < batch)
    arrays = (jnp.asarray(corpus.tokens[rows]), jnp.asarray(corpus.mask[rows]),
              jnp.asarray(corpus.features[rows]), jnp.asarray(corpus.lse[rows]))
    key, sub = jax.random.split(key)
    with jax.numpy_dtype_promotion("standard"):  # optax relies on implicit promotion
      weights, state, loss, ce = step(weights, state, arrays, sub)
    losses.append(float(ce))
    if progress and (i + 1) % log_every == 0:
      _say(True, f"  step {i + 1}/{steps}: loss {float(loss):.3f}, cross-entropy "
                 f"{np.mean(losses[-log_every:]):.3f}, {time.perf_counter() - start:.0f} s")
  return weights, losses


PROG = "python -m specdec_jax.app.train_draft"

#: Where the weights go without ``--out``: the current directory, never the shipped draft
#: (:data:`.smollm2.EAGLE_WEIGHTS`), which only an explicit ``--out`` replaces.
DEFAULT_OUT = Path("smollm2_eagle.npz")


def _temperature(text: str) -> float:
  """argparse type: a finite number ``>= 0`` (0 is greedy)."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
  if not 0 <= value < math.inf:
    raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 is greedy), got {text}")
  return value


def _seed(text: str) -> int:
  """argparse type: a seed in ``[0, 2**32)``."""
  value = int_at_least(0)(text)
  if value >= 2**32:
    raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32), got {value}")
  return value


def _npz(text: str) -> Path:
  """argparse type: a path ending in ``.npz`` (NumPy adds the suffix to any other name)."""
  if not text.endswith(".npz"):
    raise argparse.ArgumentTypeError(f"expected a path ending in .npz, got {text!r}")
  return Path(text)


def build_parser() -> argparse.ArgumentParser:
  """The arguments of ``make train-draft``, each checked by its type."""
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=_npz, default=DEFAULT_OUT,
                      help="where to write the draft's weights (default: %(default)s in the "
                           "current directory; the demo's draft, which the weights are written "
                           "to only when asked, is --out "
                           "specdec_jax/app/data/smollm2_eagle.npz)")
  parser.add_argument("--max-new-tokens", type=int_at_least(1), default=160,
                      help="length of each answer of the corpus (default: %(default)s)")
  parser.add_argument("--temperatures", type=_temperature, nargs="+",
                      default=[0.0, 0.6, 0.8, 1.0, 1.0, 1.0],
                      help="one answer per prompt at each of these temperatures (0 is greedy)")
  parser.add_argument("--steps", type=int_at_least(1), default=700,
                      help="training steps (default: %(default)s)")
  parser.add_argument("--corpus", type=_npz, default=None,
                      help="reuse (or write) the generated corpus at this .npz path")
  parser.add_argument("--batch", type=int_at_least(1), default=8,
                      help="sequences per training step (default: %(default)s)")
  parser.add_argument("--length", type=int_at_least(2), default=256,
                      help="tokens per training sequence (default: %(default)s; position t "
                           "learns from t - 1, so at least 2)")
  parser.add_argument("--seed", type=_seed, default=0)
  return parser


def read_corpus(path: Path) -> list[np.ndarray]:
  """The sequences a corpus file holds (what ``--corpus`` wrote: arrays named 0, 1, ...).

  Raises:
    ValueError: the file cannot be read as such a corpus, holds no sequence of 2 tokens or more,
      or holds a negative id; the message says which.
  """
  try:
    with np.load(path) as z:
      names = sorted(z.files, key=int)
      sequences = [z[k] for k in names]
  # Not an .npz (or a damaged one), or arrays not named 0, 1, ...
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
    raise ValueError(f"expected a corpus written by --corpus (.npz of arrays named 0, 1, ...), "
                     f"got {path}, which cannot be read as one ({err})") from None
  for name, s in zip(names, sequences, strict=True):
    if s.ndim != 1 or not np.issubdtype(s.dtype, np.integer):
      raise ValueError(f"expected sequences of integer token ids, got {path} with array {name} "
                       f"of shape {s.shape} and dtype {s.dtype}")
    if s.size and s.min() < 0:
      raise ValueError(f"expected token ids >= 0, got {path} with id {s.min()} in sequence {name}")
  if not any(len(s) >= 2 for s in sequences):
    raise ValueError(f"expected a corpus with a sequence of 2 tokens or more, got {path}, which "
                     f"is empty ({len(sequences)} sequences, none that long)")
  return sequences


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace):
  """What the types cannot see, before anything is loaded: that optax is installed, that
  ``--out`` can be written and that ``--corpus``, if it exists, is a corpus. Exits with 2 on a
  problem (``parser.error``); returns the stored corpus's sequences, or None."""
  try:
    importlib.import_module("optax")
  except ImportError as err:
    parser.error(f"training needs optax (the training extra), which cannot be imported ({err}); "
                 "install it: pip install -e '.[train]'")
  if args.out.is_dir():
    parser.error(f"argument --out: expected a file path ending in .npz, got {args.out}, which "
                 "is a directory")
  if args.out.exists() and not os.access(args.out, os.W_OK):
    parser.error(f"argument --out: expected a file this user can write, got {args.out}")
  for option, path in (("--out", args.out), ("--corpus", args.corpus)):
    if path is None or path.exists():
      continue
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
      parser.error(f"argument {option}: expected a path whose folder can be created, got {path} "
                   f"({err.strerror})")
    if not os.access(path.parent, os.W_OK):
      parser.error(f"argument {option}: expected a path in a folder this user can write, got "
                   f"{path}")
  if args.corpus is None or not args.corpus.exists():
    return None
  try:
    return read_corpus(args.corpus)
  except ValueError as err:
    parser.error(f"argument --corpus: {err}")


def check_with_model(args: argparse.Namespace, config: LlamaConfig, prompts,
                     sequences) -> str | None:
  """What needs the model's configuration: ids in its vocabulary, lengths in its context."""
  context = config.max_position
  if args.length > context:
    return f"argument --length: expected at most the model's context {context}, got {args.length}"
  longest = max(map(len, prompts))
  if sequences is None and longest + args.max_new_tokens > context:
    return (f"argument --max-new-tokens: expected at most {context - longest} (the model's "
            f"context {context} less the longest prompt), got {args.max_new_tokens}")
  if sequences is not None:
    top = max(int(s.max()) for s in sequences if s.size)
    if top >= config.vocab_size:
      return (f"argument --corpus: expected token ids in [0, {config.vocab_size}) (the model's "
              f"vocabulary), got {args.corpus} with id {top}")
  return None


def main(argv: Sequence[str] | None = None) -> int:
  """``make train-draft``: build the corpus with SmolLM2, train, write the draft's weights.

  Returns 0 when the weights are written, 1 when training diverged (nothing is written);
  bad arguments exit with 2 (``parser.error``) before the model is loaded, or right after it
  when only the model can tell (ids outside its vocabulary, lengths over its context).
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  stored = check_arguments(parser, args)
  begin = time.perf_counter()
  _say(True, "loading SmolLM2-135M-Instruct ...")
  params, config, tokenizer = smollm2.load_smollm2(progress=True)
  prompts = [tokenizer.chat_ids(p) for p in TRAIN_PROMPTS]
  problem = check_with_model(args, config, prompts, stored)
  if problem is not None:
    parser.error(problem)
  target = make_model(params, config)
  if stored is not None:
    sequences = stored
  else:
    _say(True, f"generating the corpus: {len(prompts)} prompts x {args.temperatures}")
    sequences = generate_corpus(target, prompts, temperatures=args.temperatures,
                                max_new_tokens=args.max_new_tokens, batch=24,
                                eos_id=tokenizer.eos_id, seed=args.seed)
    if args.corpus is not None:
      np.savez(args.corpus, **{str(i): s for i, s in enumerate(sequences)})
  vocab_ids = frequent_vocab(sequences, DRAFT_VOCAB, config.vocab_size, [tokenizer.eos_id])
  _say(True, "target features of the corpus ...")
  corpus = Corpus(params, config, sequences, length=args.length)
  _say(True, f"training: {args.steps} steps of {args.batch} sequences")
  weights, losses = train_eagle(params, config, corpus, vocab_ids, steps=args.steps,
                                batch=args.batch, seed=args.seed)
  if not all(np.isfinite(np.asarray(w)).all() for w in jax.tree.leaves(weights)):
    print(f"error: training diverged: the draft's weights are not finite (NaN or inf); nothing "
          f"was written to {args.out}", file=sys.stderr)
    return 1
  eagle.save_eagle(args.out, weights, vocab_ids)
  size = args.out.stat().st_size / 1e6
  _say(True, f"wrote {args.out} ({size:.1f} MB, {eagle.num_weights(weights):,} weights); "
             f"final cross-entropy {np.mean(losses[-50:]):.3f}; "
             f"{(time.perf_counter() - begin) / 60:.1f} min in all")
  return 0


if __name__ == "__main__":
  sys.exit(main())
