"""Train the EAGLE-style draft of SmolLM2 by self-distillation (``make train-draft``).

1. **Data**: the target answers a set of varied instructions (:data:`TRAIN_PROMPTS`, or the
   wider :data:`WIDE_PROMPTS`; none of them a benchmark prompt) greedily and by sampling; its
   own generations are the corpus, so the draft learns the distribution it will be verified
   against (self-distillation, as in Medusa-2 and EAGLE's fixed-dataset ablation).
2. **Features**: one target pass over every sequence gives the final-normed hidden states
   ``f[t]`` and the log-normaliser of the full-vocabulary softmax, so the target's next-token
   probabilities of the draft vocabulary are ``exp(f[t] @ head_K.T - lse[t])`` at the cost of
   the small head.
3. **Draft vocabulary** (FR-Spec): the ``K`` most frequent tokens of the corpus, the end of turn
   always among them.
4. **Training** (optax AdamW): at position ``t`` the draft reads ``x[t]`` and ``f[t - 1]``; the
   loss is the cross-entropy against the target's probabilities plus a feature regression
   (EAGLE's two losses), on ``--unroll`` unrolled passes too, where the draft reads its own
   predicted features as at inference (the "training-time test" of EAGLE-3/HASS), which is what
   makes the second and later proposals usable. With ``--fused`` (EAGLE-3) the draft reads a
   learned projection of three of the target's hidden states (low, middle, high) in place of
   ``f[t - 1]``, and only the cross-entropy is kept.

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
import numpy as np

from specdec_jax.app import smollm2
from specdec_jax.app.argtypes import gib
from specdec_jax.app.argtypes import int_at_least
from specdec_jax.app.argtypes import int_in
from specdec_jax.app.argtypes import memory_limit
from specdec_jax.app.draft_training import Corpus
from specdec_jax.app.draft_training import frequent_vocab
from specdec_jax.app.draft_training import generate_corpus
from specdec_jax.app.draft_training import say
from specdec_jax.app.draft_training import train_eagle
from specdec_jax.app.draft_training import training_bytes
from specdec_jax.models import eagle
from specdec_jax.models.llama import LlamaConfig
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

#: Topics and task templates of the wider corpus (``--prompts wide``: :data:`TRAIN_PROMPTS` plus
#: every template applied to every topic, 148 prompts): explanations, facts, essays, poems and
#: stories on everyday, science, history and nature topics; none is a benchmark prompt.
TOPICS = (
  "volcanoes", "honey bees", "the printing press", "electric cars", "the human heart", "chess",
  "rainbows", "coffee", "penguins", "the internet", "recycling", "ocean tides", "earthquakes",
  "the Roman Empire", "gardening", "trains", "deserts", "the moon", "friendship", "a rainy day",
)
TEMPLATES = (
  "Explain {} to a ten year old.",
  "Tell me three interesting facts about {}.",
  "Write a short essay about {}.",
  "Write a poem about {}.",
  "Write a short story in which {} plays a part.",
)
WIDE_PROMPTS = TRAIN_PROMPTS + tuple(t.format(topic) for topic in TOPICS for t in TEMPLATES)

#: The prompt sets of ``--prompts``.
PROMPT_SETS = {"base": TRAIN_PROMPTS, "wide": WIDE_PROMPTS}

#: The draft vocabulary size (the head reads this many of the target's 49,152 output rows).
DRAFT_VOCAB = 8192

#: Answers generated at once for the corpus.
CORPUS_BATCH = 24

#: SmolLM2's context, which bounds ``--length`` and ``--max-new-tokens`` before it is loaded.
CONTEXT = smollm2.CONFIG.max_position


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
  parser.add_argument("--max-new-tokens", type=int_in(1, CONTEXT - 1, f"SmolLM2's context of "
                                                         f"{CONTEXT} holds the prompt and answer"),
                      default=160,
                      help="length of each answer of the corpus (default: %(default)s)")
  parser.add_argument("--temperatures", type=_temperature, nargs="+",
                      default=[0.0, 0.6, 0.8, 1.0, 1.0, 1.0],
                      help="one answer per prompt at each of these temperatures (0 is greedy)")
  parser.add_argument("--steps", type=int_at_least(1), default=700,
                      help="training steps (default: %(default)s)")
  parser.add_argument("--corpus", type=_npz, default=None,
                      help="reuse (or write) the generated corpus at this .npz path")
  parser.add_argument("--batch", type=int_at_least(1), default=8,
                      help="sequences per training step (default: %(default)s); --batch, "
                           "--length, --unroll and corpus sizes whose training would need more "
                           "than half of this machine's memory are refused")
  parser.add_argument("--length", type=int_in(2, CONTEXT, f"no sequence is longer than SmolLM2's "
                                                        f"context of {CONTEXT}"), default=256,
                      help="tokens per training sequence (default: %(default)s; position t "
                           "learns from t - 1, so at least 2)")
  parser.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="base",
                      help="the instructions the target answers: base, the 48 hand-written "
                           "ones, or wide, those and 5 tasks on each of 20 topics (default: "
                           "%(default)s)")
  parser.add_argument("--unroll", type=int_at_least(0), default=1,
                      help="unrolled passes of the training-time test: the draft trained on its "
                           "own predicted features, as for its 2nd .. (unroll + 1)-th proposal "
                           "(default: %(default)s)")
  parser.add_argument("--fused", action="store_true",
                      help="EAGLE-3's fused features: the draft reads a projection of the "
                           "target's hidden states entering layers 2, 15 and 27 instead of its "
                           "top feature (no feature regression)")
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
  ``--out`` can be written and is not ``--corpus``, that ``--corpus``, if it exists, is a corpus,
  and that the sizes fit in memory (:func:`check_memory`). Exits with 2 on a problem
  (``parser.error``); returns the stored corpus's sequences, or None."""
  try:
    importlib.import_module("optax")
  except ImportError as err:
    parser.error(f"training needs optax (the training extra), which cannot be imported ({err}); "
                 "install it: pip install -e '.[train]'")
  if args.corpus is not None and same_file(args.out, args.corpus):
    parser.error(f"argument --out: expected a path other than --corpus, got {args.out}, the same "
                 f"file as --corpus {args.corpus} (the weights would overwrite the corpus)")
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
  stored = None
  if args.corpus is not None and args.corpus.exists():
    try:
      stored = read_corpus(args.corpus)
    except ValueError as err:
      parser.error(f"argument --corpus: {err}")
  if (problem := check_memory(args, stored)) is not None:
    parser.error(problem)
  return stored


def same_file(a: Path, b: Path) -> bool:
  """Whether two paths name one file: the same resolved path (through ``..`` and symbolic links),
  or, both existing, the same file (a hard link)."""
  return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))


def check_memory(args: argparse.Namespace, stored) -> str | None:
  """The problem with sizes whose training (:func:`.draft_training.training_bytes`) cannot fit
  in half of this machine's memory (the process would be killed for memory after the model is
  loaded), or None."""
  n = len(stored) if stored is not None else (len(PROMPT_SETS[args.prompts])
                                              * len(args.temperatures))
  parts = training_bytes(smollm2.CONFIG, sequences=n, length=args.length, batch=args.batch,
                         unroll=args.unroll, fused=args.fused, draft_vocab=DRAFT_VOCAB,
                         answers=0 if stored is not None else args.max_new_tokens,
                         answer_batch=CORPUS_BATCH)
  limit = memory_limit()
  need = parts["model"] + max(parts["generation"],
                              parts["corpus"] + max(parts["features"], parts["step"]))
  if need <= limit:
    return None
  sequences = (f"{len(stored)} sequences in --corpus" if stored is not None else
               f"{len(args.temperatures)} --temperatures x --prompts {args.prompts}")
  options = {
    "generation": ("--max-new-tokens", f"--max-new-tokens {args.max_new_tokens}",
                   "generating the corpus"),
    "corpus": ("--length/--temperatures/--prompts", f"--length {args.length}, {sequences}",
               "the corpus's arrays"),
    "features": ("--length", f"--length {args.length}", "the target's features"),
    "step": ("--batch/--length/--unroll",
             f"--batch {args.batch} --length {args.length} --unroll {args.unroll}",
             "a training step"),
  }
  largest = max(options, key=parts.__getitem__)
  names, got, what = options[largest]
  return (f"argument {names}: expected sizes whose training fits in {gib(limit)} (half of this "
          f"machine's memory), got {got}, which need about {gib(need)} ({what}: "
          f"{gib(parts[largest])}); lower the largest of them")


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
  say(True, "loading SmolLM2-135M-Instruct ...")
  params, config, tokenizer = smollm2.load_smollm2(progress=True)
  prompts = [tokenizer.chat_ids(p) for p in PROMPT_SETS[args.prompts]]
  problem = check_with_model(args, config, prompts, stored)
  if problem is not None:
    parser.error(problem)
  target = make_model(params, config)
  if stored is not None:
    sequences = stored
  else:
    say(True, f"generating the corpus: {len(prompts)} prompts x {args.temperatures}")
    sequences = generate_corpus(target, prompts, temperatures=args.temperatures,
                                max_new_tokens=args.max_new_tokens, batch=CORPUS_BATCH,
                                eos_id=tokenizer.eos_id, seed=args.seed)
    if args.corpus is not None:
      np.savez(args.corpus, **{str(i): s for i, s in enumerate(sequences)})
  vocab_ids = frequent_vocab(sequences, DRAFT_VOCAB, config.vocab_size, [tokenizer.eos_id])
  say(True, "target features of the corpus ...")
  corpus = Corpus(params, config, sequences, length=args.length, fused=args.fused)
  say(True, f"training: {args.steps} steps of {args.batch} sequences")
  weights, losses = train_eagle(params, config, corpus, vocab_ids, steps=args.steps,
                                batch=args.batch, seed=args.seed, unroll=args.unroll)
  if not all(np.isfinite(np.asarray(w)).all() for w in jax.tree.leaves(weights)):
    print(f"error: training diverged: the draft's weights are not finite (NaN or inf); nothing "
          f"was written to {args.out}", file=sys.stderr)
    return 1
  eagle.save_eagle(args.out, weights, vocab_ids)
  size = args.out.stat().st_size / 1e6
  say(True, f"wrote {args.out} ({size:.1f} MB, {eagle.num_weights(weights):,} weights); "
             f"final cross-entropy {np.mean(losses[-50:]):.3f}; "
             f"{(time.perf_counter() - begin) / 60:.1f} min in all")
  return 0


if __name__ == "__main__":
  sys.exit(main())
