"""The measured costs of ``bench-e2e`` and the cost model built on them.

:func:`measure_costs` times each piece of a decoding step alone at batch 1 (the target on 1 and
on ``gamma + 1`` tokens, a draft step, sampling, verification; and the loop's verification step
for requests that cut their rows, :func:`cut_verification_ms`); :func:`adaptive_policy` turns
them into :class:`~specdec_jax.decoding.AdaptiveSpeculation`'s cost model and
:func:`predicted_speedup` into Leviathan et al.'s Theorem 3.8 (see :mod:`specdec_jax.app.e2e`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax import AdaptiveSpeculation
from specdec_jax import SamplingParams
from specdec_jax import process_logits
from specdec_jax import sample_index
from specdec_jax import verify
from specdec_jax._logits.params import per_request
from specdec_jax.decoding.chain_loop import verify_step
from specdec_jax.decoding.request_rows import processed
from specdec_jax.theory import expected_tokens_per_position

#: :class:`specdec_jax.app.e2e.Setup` and :class:`~specdec_jax.app.e2e.Run` (e2e imports this
#: module, so they are not imported here).
Setup = Run = Any

#: Proposals per iteration of each draft unless ``--gamma`` says otherwise. Prompt lookup
#: proposes runs of copied text. The learned draft's conditional acceptance is about 0.5 at each
#: of its first 4 positions (open-ended, greedy): with a draft step at 4% of a target step and a
#: call on 4 tokens 6-20% dearer than on one, Theorem 3.8 puts gamma 3 level with or just above
#: 2 and above 4, and with 3 adaptive speculation can go one proposal further where it pays.
DEFAULT_GAMMA = {"lookup": 4, "eagle": 3, "skip": 4, "early": 4}

@dataclasses.dataclass
class Costs:
  """Measured times (ms, median, batch 1) of the pieces of a decoding step, each in isolation."""

  target_step: float  # one target call on 1 token
  target_verify: dict[int, float]  # one target call on gamma + 1 tokens, by gamma
  draft_step: dict[str, float]  # one draft call on 1 token (0 for prompt lookup)
  draft_sync: dict[str, float]  # the draft's first call of an iteration (eagle: its gamma + 1)
  prefill: dict[str, float]  # the target on the whole prompt, by prompt name
  sample: float  # process the logits of 1 token and sample (plain decoding's extra)
  verify: dict[int, float]  # process the logits of gamma + 1 and gamma tokens and verify
  # by request that cuts its rows: (rows processed first, as the loop verifies), ms
  verify_cut: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)


def draft_gamma(draft: str, gamma: int | None) -> int:
  """``gamma`` if given, else the draft's :data:`DEFAULT_GAMMA` (``-adaptive``/``+...`` ignored)."""
  if gamma is not None:
    return gamma
  return DEFAULT_GAMMA[draft.partition("+")[0].removesuffix("-adaptive")]


def timed(fn, repeats: int) -> tuple[object, float, float]:
  """(result, seconds of the first call, median seconds of ``repeats`` further calls)."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn())
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  median = statistics.median(times) if times else first
  return result, first, median


def timed_together(fns: dict[Any, Any], repeats: int) -> dict[Any, float]:
  """Median seconds of each function over ``repeats`` rounds that call every one in turn (after
  one compiling call each). Interleaved, a burst of load from other processes slows all of them
  alike, so their ratios hold; timed one after the other, a burst can land on one only (a call
  on 3 tokens once measured 2.3x a call on one here, and adaptive speculation stopped)."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times: dict[Any, list[float]] = {name: [] for name in fns}
  for _ in range(max(repeats, 1)):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def measure_costs(setup: Setup, *, gamma: int | None, max_len: int,
                  prompt_lengths: dict[str, int], cut_prompt: str, repeats: int = 20) -> Costs:
  """Median times of the pieces of a decoding step, each measured alone at batch 1 (the
  target's calls on 1 and on ``gamma + 1`` tokens in turn, :func:`timed_together`;
  ``cut_prompt``: the user message whose real rows :func:`cut_verification_ms` verifies)."""
  def call(model, width: int, start: int = 100):
    cache = model.init_cache(1, max_len)
    tokens = jnp.ones((1, width), jnp.int32)
    positions = jnp.arange(width, dtype=jnp.int32)[None] + start
    fn = jax.jit(model.apply)
    return lambda: fn(model.params, tokens, positions, cache)

  def call_time(model, width: int, start: int = 100) -> float:
    return timed(call(model, width, start), repeats)[2] * 1e3

  vocab = setup.config.vocab_size
  params = SamplingParams(temperature=jnp.float32(0.7))
  names = [d for d in DEFAULT_GAMMA if d in setup.drafts]
  gammas = sorted({draft_gamma(d, gamma) for d in names})
  logits = jax.random.normal(jax.random.key(0), (max(gammas) + 1, vocab))

  @jax.jit
  def sample_one(x):
    return sample_index(process_logits(x, params), jnp.float32(0.5))

  @jax.jit
  def verify_one(x):
    g = x.shape[0] - 1
    p, q = process_logits(x, params), process_logits(x[:g], params)
    return verify(p, q, jnp.zeros(g, jnp.int32), jnp.full(g + 1, 0.5))

  _, _, sample_s = timed(lambda: sample_one(logits[0]), repeats)
  verify_ms = {g: timed(lambda g=g: verify_one(logits[:g + 1]), repeats)[2] * 1e3
               for g in gammas}
  cut_ms = cut_verification_ms(setup, cut_prompt, max(gammas), repeats)
  draft_step = {"lookup": 0.0}
  draft_sync = {"lookup": 0.0}
  for name in ("skip", "early"):
    draft_step[name] = call_time(setup.drafts[name], 1)
    draft_sync[name] = call_time(setup.drafts[name], 2)
  if "eagle" in setup.drafts:
    draft_step["eagle"] = feature_call_time(setup.drafts["eagle"], 1, max_len, repeats)
    draft_sync["eagle"] = feature_call_time(setup.drafts["eagle"], draft_gamma("eagle", gamma) + 1,
                                            max_len, repeats)
  prefill = {name: call_time(setup.target, n, start=0) for name, n in prompt_lengths.items()}
  # The target's calls on 1 and on gamma + 1 tokens in turn: their ratio is the cost model's.
  calls = timed_together({w: call(setup.target, w) for w in {1, *(g + 1 for g in gammas)}},
                         repeats)
  return Costs(calls[1] * 1e3, {g: calls[g + 1] * 1e3 for g in gammas},
               draft_step, draft_sync, prefill, sample_s * 1e3, verify_ms, cut_ms)


#: Requests that cut their rows, for the cost line of the loop's verification from logits.
CUT_PARAMS = {"top-k 50": SamplingParams(np.float32(0.7), np.int32(50), None),
              "top-p 0.9": SamplingParams(np.float32(0.7), None, np.float32(0.9))}


def cut_verification_ms(setup: Setup, prompt: str, gamma: int,
                        repeats: int) -> dict[str, tuple[float, float]]:
  """``{request: (ms with every target row processed first, ms as the loop verifies)}``.

  One verification step of the chain loop (:func:`~specdec_jax.decoding.chain_loop.verify_step`,
  a model draft's processed ``q``) on the target's real logits: its last ``gamma + 1`` rows on
  the chat prompt of user message ``prompt``. With a top-k or top-p request the loop reads the
  target's rows lazily; "processed first" is the same step through a function verifier (the loop
  before). A prompt shorter than ``gamma + 1`` tokens is repeated until it is that long.
  """
  ids = setup.encode(prompt)
  ids = jnp.asarray([ids * -(-(gamma + 1) // len(ids))], jnp.int32)
  width = ids.shape[1]
  logits, _ = jax.jit(setup.target.apply)(
    setup.target.params, ids, jnp.arange(width, dtype=jnp.int32)[None],
    setup.target.init_cache(1, width))
  x = logits[:, -(gamma + 1):].astype(jnp.float32)
  draft, uniforms = jnp.zeros((1, gamma), jnp.int32), jnp.full((1, gamma + 1), 0.5)

  def function_verifier(p, q, draft, uniforms, *, num_draft):
    return verify(p, q, draft, uniforms, num_draft=num_draft)

  out = {}
  for label, params in CUT_PARAMS.items():
    rows = per_request(params, 1)
    times = []
    for verifier in (function_verifier, verify):
      @jax.jit
      def step(x, rows=rows, verifier=verifier):
        q = processed(x[:, :gamma], rows)
        return verify_step(verifier, x, rows, q, q, draft, uniforms,
                           jnp.full((1,), gamma, jnp.int32), vocab=x.shape[-1])
      times.append(timed(lambda step=step: step(x), repeats)[2] * 1e3)
    out[label] = (times[0], times[1])
  return out


def feature_call_time(draft, width: int, max_len: int, repeats: int, start: int = 100) -> float:
  """Median ms of one call of a :class:`~specdec_jax.decoding.FeatureDraft` on ``width`` tokens."""
  cache = draft.init_cache(1, max_len)
  tokens = jnp.ones((1, width), jnp.int32)
  positions = jnp.arange(width, dtype=jnp.int32)[None] + start
  features = jnp.zeros((1, width, draft.params.head.shape[1]), jnp.float32)
  fn = jax.jit(draft.apply)
  _, _, seconds = timed(lambda: fn(draft.params, tokens, features, positions, cache), repeats)
  return seconds * 1e3


#: ``AdaptiveSpeculation.observe`` of the ``-adaptive`` drafts: 0, the measured constants. With 8
#: (chunks of 8 iterations whose costs the loop follows) a side-by-side run on this machine was
#: no better and sometimes worse (eagle open-ended greedy 0.84x against 1.21x): the chunk times
#: are too noisy for the fit at batch 1 and 128 tokens.
OBSERVE = 0


def adaptive_policy(costs: Costs, draft: str, gamma: int,
                    observe: int = OBSERVE) -> AdaptiveSpeculation:
  """The cost model of :class:`~specdec_jax.decoding.AdaptiveSpeculation` from measured costs.

  Unit: a plain decoding step (target step + sample). ``verify_cost``: each extra token of the
  target's call, ``(call on gamma + 1 - step) / gamma``; ``draft_cost``: a draft step;
  ``fixed_cost``: what speculating adds per iteration beyond those (verification instead of
  plain sampling, and the draft's first call beyond one step). ``observe``: see
  :data:`OBSERVE` (0: the constants only).
  """
  unit = costs.target_step + costs.sample
  per_token = max(costs.target_verify[gamma] - costs.target_step, 0.0) / gamma
  fixed = max(costs.verify[gamma] - costs.sample, 0.0) + max(
    costs.draft_sync[draft] - costs.draft_step[draft], 0.0)
  return AdaptiveSpeculation(draft_cost=costs.draft_step[draft] / unit,
                             verify_cost=per_token / unit, fixed_cost=fixed / unit,
                             observe=observe)


def predicted_speedup(run: Run, costs: Costs) -> float:
  """Theorem 3.8 with the run's per-position acceptance, the measured costs and the prefill.

  Tokens per iteration ``E = 1 + sum_i prod_{j<=i} alpha_j`` (measured ``alpha_i``); an
  iteration costs ``gamma`` draft steps, one verification call and the verification
  itself; a plain step costs one target step and one sample. Both runs share the
  prefill, which also yields the first token:

    ``(prefill + (N-1)(step + sample)) / (prefill + (N-1)/E (gamma draft + verify_call + verify))``.
  """
  n = max(run.new_tokens - 1, 0)
  prefill = costs.prefill[run.prompt]
  # eagle+sized/+dynamic: the plan's own units (calls measured in a loop), plain decoding too
  plain = prefill + n * (run.plain_ms or costs.target_step + costs.sample)
  draft = run.draft.partition("+")[0]
  if draft.endswith("-adaptive"):  # proposals vary: the cost model on the run's own counts
    policy = adaptive_policy(costs, draft.removesuffix("-adaptive"), run.gamma)
    unit = costs.target_step + costs.sample
    iterations = max(run.target_calls - 1, 1)
    spent = iterations * unit * (1 + policy.fixed_cost) + run.proposals * unit * (
      policy.draft_cost + policy.verify_cost)
    return plain / (prefill + spent)
  tokens_per_iteration = float(expected_tokens_per_position(jnp.asarray(run.alphas)))
  if run.iteration_ms:  # eagle+sized/+dynamic: its acceptance by depth at the planned cost
    iteration = run.iteration_ms
  else:
    iteration = _chain_iteration_ms(costs, draft, run.gamma)
  return plain / (prefill + n / tokens_per_iteration * iteration)


def _chain_iteration_ms(costs: Costs, draft: str, gamma: int) -> float:
  """An iteration of the chain at a fixed ``gamma`` from the pieces measured alone."""
  return (costs.draft_sync[draft] + (gamma - 1) * costs.draft_step[draft]
          + costs.target_verify[gamma] + costs.verify[gamma])


def loop_overhead_ms(run: Run, costs: Costs) -> float | None:
  """The loop's own ms per iteration: what the run took beyond its model calls, sampling and
  verification as measured alone, ``(measured - modelled) / iterations``.

  The model takes the run's own iterations (target calls after the prefill; for plain decoding
  its steps) and counts, not expected ones, so what is left is the loop's work around the calls
  (buffers, bookkeeping, the policy, padding) and the machine's noise: the gap between
  :func:`predicted_speedup` and the measured speed-up, per iteration. None where the model does
  not apply (trees; the sized and dynamic plans, whose costs are in the plan's own units).
  """
  if run.draft.endswith("+tree") or run.iteration_ms or not run.seconds:
    return None
  prefill, unit = costs.prefill[run.prompt], costs.target_step + costs.sample
  if run.draft == "plain":
    iterations = max(run.new_tokens - 1, 1)
    modelled = iterations * unit
  elif not run.alphas:  # +sized/+dynamic that chose plain decoding
    return None
  else:
    draft = run.draft.partition("+")[0]
    iterations = max(run.target_calls - 1, 1)
    if draft.endswith("-adaptive"):
      policy = adaptive_policy(costs, draft.removesuffix("-adaptive"), run.gamma)
      modelled = iterations * unit * (1 + policy.fixed_cost) + run.proposals * unit * (
        policy.draft_cost + policy.verify_cost)
    else:
      modelled = iterations * _chain_iteration_ms(costs, draft, run.gamma)
  return (run.seconds * 1e3 - prefill - modelled) / iterations


def conditional_acceptance(proposed_at: np.ndarray, accepted_at: np.ndarray) -> tuple[float, ...]:
  """``alpha_i``: P(position ``i`` accepted | positions ``< i`` accepted), from loop counters.

  ``accepted_at[i]`` counts steps that accepted position ``i`` (so also every earlier
  one); the steps that reached position ``i`` are those that accepted ``i - 1`` (all
  steps that proposed position 0 for ``i = 0``).
  """
  reached = np.concatenate([[proposed_at[0]], accepted_at[:-1]]).astype(np.float64)
  reached = np.minimum(reached, proposed_at)  # proposals cut at the token budget
  return tuple(float(a / r) if r else 0.0 for a, r in zip(accepted_at, reached, strict=True))
