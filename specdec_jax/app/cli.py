"""The command line, ``python -m specdec_jax``: argument parsing and dispatch, nothing else.

Subcommands:

- ``examples``: walk both worked examples of the rule step by step (:mod:`.demo`).
- ``simulate``: ``jax.jit(jax.vmap(verify))`` over many random steps against the theory.
- ``generate --prompt ...``: plain and speculative decoding of a prompt with
  SmolLM2-135M-Instruct on this CPU (:mod:`.e2e`).
- ``bench-e2e``: the same on the built-in prompts, every draft, greedy and sampled, timed.

Without a subcommand ``examples`` and ``simulate`` run, then (when the model package is
installed) the end-to-end demo. Every argument is validated by the parser, and so is every
combination of them (:func:`check_simulate`, :func:`check_e2e`) before anything is loaded;
expected failures (a missing model package, a prompt over the model's context) print one line
and exit with 2.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from collections.abc import Callable
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specdec_jax.app import demo
from specdec_jax.app import e2e
from specdec_jax.app import e2e_structured
from specdec_jax.app import simulate
from specdec_jax.app import smollm2
from specdec_jax.app.argtypes import gib
from specdec_jax.app.argtypes import int_at_least
from specdec_jax.app.argtypes import int_in
from specdec_jax.app.argtypes import json_schema_file
from specdec_jax.app.argtypes import memory_limit
from specdec_jax.app.argtypes import regex_pattern
from specdec_jax.app.gguf import GGUFError
from specdec_jax.app.tables import banner
from specdec_jax.models import eagle

#: argparse types: an integer ``>= 1`` and ``>= 0``.
positive_int = int_at_least(1)
non_negative_int = int_at_least(0)

#: SmolLM2's context, which bounds the sizes of ``generate`` and ``bench-e2e`` before it is loaded.
CONTEXT = smollm2.CONFIG.max_position

#: argparse types of ``--gamma`` and ``--max-new-tokens``: sizes that fit SmolLM2's context.
gamma_size = int_in(1, CONTEXT - 1, f"the target scores gamma + 1 tokens in one call, which must "
                                    f"fit SmolLM2's context of {CONTEXT} positions")
new_tokens = int_in(1, CONTEXT - 1, f"SmolLM2's context of {CONTEXT} positions holds the prompt, "
                                    f"at least one token, and the new tokens")


def vocab_size(text: str) -> int:
  """argparse type: a vocabulary size in ``[1, 2**31)`` (token ids are int32)."""
  value = positive_int(text)
  if value >= 2**31:
    raise argparse.ArgumentTypeError(
      f"expected an integer in [1, 2**31) (token ids are int32), got {value}")
  return value


def seed(text: str) -> int:
  """argparse type: a seed in ``[0, 2**32)``."""
  value = non_negative_int(text)
  if value >= 2**32:
    raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**32), got {value}")
  return value


def temperature(text: str) -> float:
  """argparse type: a finite number ``>= 0`` (0 is greedy)."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
  if not 0 <= value < float("inf"):
    raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 is greedy), got {text}")
  return value


def prompt(text: str) -> str:
  """argparse type: a non-empty prompt that is valid UTF-8."""
  if not text.strip():
    raise argparse.ArgumentTypeError("the prompt is empty; give the text of a user message")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as err:  # bytes that are not UTF-8 arrive as lone surrogates
    byte = ord(err.object[err.start]) - 0xDC00  # Python's surrogateescape of that byte
    raise argparse.ArgumentTypeError(
      f"the prompt is not valid UTF-8 (byte 0x{byte:02x} at character {err.start}); pass UTF-8 "
      "text") from None
  return text


def branching(text: str) -> tuple[int, ...]:
  """argparse type: a draft tree as candidates per node at each depth, e.g. ``2,2,1,1``."""
  try:
    counts = tuple(int(x) for x in text.split(","))
  except ValueError:
    counts = ()
  if not counts or min(counts) < 1:
    raise argparse.ArgumentTypeError(f"expected counts >= 1 like 2,2,1,1, got {text!r}")
  nodes, level = 1, 1
  for depth, count in enumerate(counts):
    level *= count
    nodes += level
    if nodes > CONTEXT:
      raise argparse.ArgumentTypeError(
        f"expected a tree of at most {CONTEXT} nodes (the target scores them all in one call, "
        f"which must fit SmolLM2's context of {CONTEXT} positions), got {text!r}, which has "
        f"{'' if depth == len(counts) - 1 else 'over '}{nodes:,} nodes")
  return counts


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
  """Options of ``simulate``."""
  parser.add_argument("--trials", type=positive_int, default=100_000,
                      help="number of verification steps (default: %(default)s); --trials, "
                           "--gamma and --vocab whose arrays would need more than half of this "
                           "machine's memory are refused")
  parser.add_argument("--gamma", type=non_negative_int, default=4,
                      help="draft length (default: %(default)s)")
  parser.add_argument("--vocab", type=vocab_size, default=8,
                      help="vocabulary size V, below 2**31 (default: %(default)s)")
  parser.add_argument("--seed", type=seed, default=0,
                      help="seed for the distributions, drafts and uniforms (default: %(default)s)")


def simulate_bytes(trials: int, gamma: int, vocab: int) -> int:
  """An upper estimate of the memory ``simulate`` (:func:`.simulate.run_simulate`) needs, in bytes.

  The rows ``p`` ``(gamma + 1, V)`` and ``q`` ``(gamma, V)`` are made in float64 with
  temporaries, then kept in float32 and float64 and copied to the device: 64 bytes per entry of
  ``p``. Each trial holds its drafts, uniforms (float64 and float32), results and check masks,
  96 bytes per slot of ``gamma + 1``, and ``verify``'s scratch for the row it samples from
  (measured on XLA:CPU: at most 8 KiB plus ``V / 4`` bytes).
  """
  rows = 64 * (gamma + 1) * vocab
  per_trial = 96 * (gamma + 1) + min(16 * vocab, 8192) + vocab // 4
  return rows + trials * per_trial


def check_simulate(args: argparse.Namespace) -> str | None:
  """The problem with ``simulate``'s arguments together, or None: sizes whose arrays cannot fit
  (they would end in a MemoryError or the process killed for memory)."""
  need, limit = simulate_bytes(args.trials, args.gamma, args.vocab), memory_limit()
  if need <= limit:
    return None
  return (f"argument --trials/--gamma/--vocab: expected sizes whose arrays fit in {gib(limit)} "
          f"(half of this machine's memory), got --trials {args.trials} --gamma {args.gamma} "
          f"--vocab {args.vocab}, which need about {gib(need)}; lower the largest of them")


def _why_not(draft: str) -> str:
  """Why :func:`.e2e.runs_with` is False for ``draft`` and a verifier other than token."""
  if "+" in draft:
    return f"{draft} names its own verifier and runs with --verifier token only"
  return f"--verifier tree needs a draft model ({', '.join(e2e.DEFAULT_TREE)}), not {draft}"


def check_e2e(args: argparse.Namespace) -> str | None:
  """The problem with ``generate``'s or ``bench-e2e``'s arguments together, or None: a
  combination that would be ignored (a draft no verifier runs, a verifier no draft takes,
  ``--tree`` without ``--verifier tree``)."""
  verifiers, drafts = " ".join(args.verifier), " ".join(args.draft)
  if args.tree is not None and "tree" not in args.verifier:
    return (f"argument --tree: expected together with --verifier tree (only it reads the tree), "
            f"got --verifier {verifiers}; add tree to --verifier or drop --tree")
  for draft in args.draft:
    if not any(e2e.runs_with(draft, v) for v in args.verifier):
      return (f"argument --draft: expected drafts that --verifier {verifiers} can run, got "
              f"{draft}: {_why_not(draft)}; add token to --verifier or choose other drafts")
  for verifier in args.verifier:
    if not any(e2e.runs_with(d, verifier) for d in args.draft):
      return (f"argument --verifier: expected verifiers that apply to --draft {drafts}, got "
              f"{verifier}: {_why_not(args.draft[0])}; add such a draft or drop {verifier}")
  return None


def eagle_weights(text: str):
  """argparse type: a file of EAGLE draft weights (what ``train_draft`` writes)."""
  path = Path(text)
  if not path.is_file():
    raise argparse.ArgumentTypeError(f"expected a file of draft weights written by "
                                     f"train_draft (.npz), got {text!r}, which is not a file")
  try:
    with np.load(path) as z:
      arrays = {name: z[name] for name in z.files}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
    raise argparse.ArgumentTypeError(f"expected draft weights written by train_draft (.npz), "
                                     f"got {text!r}, which cannot be read as one ({err})"
                                     ) from None
  if (problem := eagle_file_problem(arrays)) is not None:
    raise argparse.ArgumentTypeError(f"expected draft weights of SmolLM2-135M written by "
                                     f"train_draft, got {text!r} {problem}")
  return path


def eagle_file_problem(arrays: dict[str, np.ndarray]) -> str | None:
  """What is wrong with a draft file's arrays for SmolLM2 (:data:`.smollm2.CONFIG`), or None:
  the names :func:`.eagle.save_eagle` writes, each weight's dtype (float) and shape
  (:func:`.eagle.weight_shapes`), and ``vocab_ids``: distinct integer ids of the vocabulary."""
  config = smollm2.CONFIG
  shapes = eagle.weight_shapes(config, fused="fuse" in arrays)
  expected = {"vocab_ids", *shapes}
  if missing := sorted(expected - set(arrays)):
    return f"with arrays {sorted(arrays)[:6]}, without {missing[:4]}"
  if extra := sorted(set(arrays) - expected):
    return f"with arrays train_draft does not write: {extra[:4]}"
  for name, shape in shapes.items():
    a = arrays[name]
    if not np.issubdtype(a.dtype, np.floating) or a.shape != shape:
      return (f"whose array {name} is {a.dtype}{a.shape}, not float{shape} (SmolLM2-135M: width "
              f"{config.dim}, {config.n_heads} heads and {config.n_kv_heads} kv heads of "
              f"{config.head_dim}, ffn {config.ffn_dim}, {config.n_layers} layers)")
    if not np.isfinite(a).all():
      return f"whose array {name} holds NaN or inf"
  ids = arrays["vocab_ids"]
  if not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1 or not ids.size:
    return f"whose vocab_ids are {ids.dtype}{ids.shape}, not integer ids of shape (K,), K >= 1"
  if ids.min() < 0 or ids.max() >= config.vocab_size or np.unique(ids).size != ids.size:
    return (f"whose vocab_ids are not distinct ids in [0, {config.vocab_size}): {ids.size} ids "
            f"in [{ids.min()}, {ids.max()}]")
  return None


def add_e2e_arguments(parser: argparse.ArgumentParser, *, generate_command: bool) -> None:
  """Options shared by ``generate`` and ``bench-e2e``."""
  if not generate_command:
    parser.add_argument("--prompts", nargs="+", default=None,
                        choices=(*e2e.PROMPTS, e2e_structured.JSON_TASK),
                        help="the built-in prompts to run (default: all; json-extract is "
                             "constrained by its JSON schema)")
  if generate_command:
    parser.add_argument("--prompt", required=True, type=prompt,
                        help="the user message (chat template added)")
    grammar = parser.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", type=json_schema_file, default=None, metavar="FILE",
                         help="constrain the answer to compact JSON valid under this JSON "
                              "Schema (needs the structured extra: outlines-core)")
    grammar.add_argument("--regex", type=regex_pattern, default=None, metavar="PATTERN",
                         help="constrain the answer to text that fully matches PATTERN")
  parser.add_argument("--draft", nargs="+", default=list(e2e.DRAFTS), choices=e2e.DRAFTS,
                      help="drafts to compare with plain decoding (default: all); the first "
                           "one's output is streamed first; -adaptive: adaptive speculation")
  parser.add_argument("--gamma", type=gamma_size, default=None,
                      help="proposals per step for every draft, below SmolLM2's context of "
                           "8192 (default: each draft's best on this CPU, e2e.DEFAULT_GAMMA: "
                           "lookup 4, eagle 3, skip/early 4)")
  parser.add_argument("--temperature", type=temperature, nargs="+",
                      default=[0.0] if generate_command else [0.0, 0.7],
                      help="sampling temperatures; 0 is greedy")
  parser.add_argument("--max-new-tokens", type=new_tokens, default=96,
                      help="tokens to generate; with the prompt at most SmolLM2's context of "
                           "8192 (default: %(default)s)")
  parser.add_argument("--verifier", nargs="+", default=["token"],
                      choices=("token", "block", "tree"),
                      help="token-wise (default), block verification (Sun et al. 2024) and/or a "
                           "top-k draft tree (model and learned drafts; see --tree)")
  parser.add_argument("--tree", type=branching, default=None,
                      help="the draft tree of --verifier tree: candidates per node at each depth, "
                           "e.g. 2,2,1,1, at most 8192 nodes (default: 2,2,1,1 for skip/early, "
                           "4,1 for eagle)")
  parser.add_argument("--repeats", type=positive_int, default=1 if generate_command else 5,
                      help="timed runs after the compiling one (median)")
  parser.add_argument("--seed", type=seed, default=0)
  parser.add_argument("--seeds", type=positive_int, default=1,
                      help="run sampled requests with this many seeds and summarise (default 1)")
  parser.add_argument("--eagle-weights", type=eagle_weights, default=smollm2.EAGLE_WEIGHTS,
                      help="the eagle draft's weights (default: the demo's draft, "
                           "specdec_jax/app/data/smollm2_eagle.npz; python -m "
                           "specdec_jax.app.train_draft writes ./smollm2_eagle.npz)")


def defaults(add_options: Callable[[argparse.ArgumentParser], None]) -> argparse.Namespace:
  """The default values of a set of options, as a namespace."""
  parser = argparse.ArgumentParser(add_help=False)
  add_options(parser)
  return parser.parse_args([])


def _e2e_demo_defaults() -> argparse.Namespace:
  args = defaults(lambda p: add_e2e_arguments(p, generate_command=False))
  args.repeats, args.max_new_tokens = 1, 64
  args.draft = ["eagle", "eagle-adaptive", "lookup", "lookup-adaptive"]  # the ones that pay here
  return args


def run_generate(args: argparse.Namespace) -> int:
  """``generate``: plain and speculative decoding of the user's prompt on SmolLM2."""
  grammar = {k: v for k, v in (("schema", args.json_schema), ("regex", args.regex))
             if v is not None}
  return run_e2e_cli(args, {"prompt": args.prompt}, {"prompt": grammar} if grammar else {})


def run_e2e(args: argparse.Namespace) -> int:
  """``bench-e2e``: the built-in prompts and the JSON-extraction task, every draft, greedy and
  sampled, timed."""
  prompts = {**e2e.PROMPTS, e2e_structured.JSON_TASK: e2e_structured.JSON_PROMPT}
  chosen = getattr(args, "prompts", None) or list(prompts)
  grammars = {e2e_structured.JSON_TASK: {
    "schema": e2e_structured.JSON_SCHEMA,
    "max_new_tokens": max(args.max_new_tokens, e2e_structured.JSON_MAX_NEW_TOKENS)}}
  return run_e2e_cli(args, {name: prompts[name] for name in chosen},
                     {name: g for name, g in grammars.items() if name in chosen})


def run_e2e_cli(args: argparse.Namespace, prompts: dict[str, str],
                grammars: dict[str, dict]) -> int:
  """Load SmolLM2, compile the prompts' grammars (``{"schema": ...}`` or ``{"regex": ...}``)
  over its vocabulary, check every prompt fits, then run :func:`.e2e.run_suite`. Exit 2 on
  an expected failure before any generation (no model, a grammar outlines-core cannot
  compile, a prompt past the context); 1 when a constrained output is not valid."""
  try:
    setup = e2e.Setup(eagle_weights=getattr(args, "eagle_weights", smollm2.EAGLE_WEIGHTS),
                      drafts=args.draft)
    constraints = {name: e2e_structured.build(setup.tokenizer, **grammar)
                   for name, grammar in grammars.items()}
  except (ImportError, FileNotFoundError, GGUFError, ValueError) as err:
    print(f"error: {err}", file=sys.stderr)  # no model extra, weights, bad file or grammar
    return 2
  context = setup.config.max_position
  for label, text in prompts.items():
    need = len(setup.encode(text)) + args.max_new_tokens
    if need > context:
      what = "the prompt" if label == "prompt" else f"the {label} prompt"
      print(f"error: {what} ({need - args.max_new_tokens} tokens with the chat "
            f"template) plus --max-new-tokens {args.max_new_tokens} exceeds the model's context "
            f"of {context} tokens; shorten the prompt or lower --max-new-tokens", file=sys.stderr)
      return 2
  e2e.run_suite(setup, prompts=prompts, drafts=args.draft, temperatures=args.temperature,
                gamma=args.gamma, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                seed=args.seed, verifiers=args.verifier, tree=args.tree, seeds=args.seeds,
                constraints=constraints)
  return 0 if setup.valid else 1


def run_all(args: argparse.Namespace) -> int:
  """No subcommand: ``examples``, ``simulate``, then the real model if it is installed."""
  code = demo.run_examples(args)
  code = max(code, simulate.run_simulate(defaults(add_simulate_arguments)))
  banner("Speculative decoding end to end: SmolLM2-135M-Instruct on this CPU")
  try:
    smollm2.find_smollm2_gguf()
  except FileNotFoundError as err:
    print(f"  skipped: {err}")
    return code
  return max(code, run_e2e(_e2e_demo_defaults()))


def build_parser() -> argparse.ArgumentParser:
  """The ``python -m specdec_jax`` argument parser; each subcommand sets ``func``."""
  parser = argparse.ArgumentParser(
    prog="python -m specdec_jax",
    description="Demo of exact speculative-decoding verification. Without a subcommand, "
    "run `examples` and then `simulate` with its defaults.",
  )
  parser.set_defaults(func=run_all)
  sub = parser.add_subparsers(title="subcommands", metavar="COMMAND")
  commands: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "examples": ("walk both worked examples of the rule step by step", demo.run_examples),
    "simulate": ("run jax.vmap(verify) over many random steps and compare with the theory",
                 simulate.run_simulate),
    "generate": ("plain vs speculative decoding of your prompt with SmolLM2-135M-Instruct",
                 run_generate),
    "bench-e2e": ("time plain vs speculative decoding on the built-in prompts (SmolLM2)",
                  run_e2e),
  }
  for name, (help_text, func) in commands.items():
    command = sub.add_parser(name, help=help_text, description=help_text)
    command.set_defaults(func=func, parser=command)
    if name == "simulate":
      add_simulate_arguments(command)
      command.set_defaults(check=check_simulate)
    elif name in ("generate", "bench-e2e"):
      add_e2e_arguments(command, generate_command=name == "generate")
      command.set_defaults(check=check_e2e)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of ``python -m specdec_jax``.

  Args:
    argv: command-line arguments without the program name; ``sys.argv[1:]`` if None.

  Returns:
    The exit code: 0 when everything agrees, 1 otherwise, 2 for an expected failure
    (argparse also exits with 2 on bad usage).
  """
  args = build_parser().parse_args(argv)
  check = getattr(args, "check", None)
  if check is not None and (problem := check(args)) is not None:
    args.parser.error(problem)  # one line, "python -m specdec_jax COMMAND: error: ...", exit 2
  return args.func(args)
