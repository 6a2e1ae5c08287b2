"""The chain loop of :func:`~specdec_jax.decoding.speculative_generate`, traced, and its drivers.

The loop's pieces (prefill, condition, body: draft, one target call at the adaptive width
through :func:`~specdec_jax.decoding.common.run_one`, verify), and the jitted programs that run
them: the whole loop at once (:func:`speculative_loop`) or in chunks with the state carried
between them, for streaming (:func:`streamed_loop`). :mod:`specdec_jax.decoding.chain` checks
the arguments, picks one of them and re-exports these names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._core.results import VerifyResult
from specdec_jax._logits.adjust import chain_prefixes
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._rows.logprobs import finish_emitted
from specdec_jax._rules.block import block_verify
from specdec_jax._rules.registry import CHAIN_RULES
from specdec_jax._rules.tokenwise import verify
from specdec_jax.decoding.adaptive import AdaptiveSpeculation
from specdec_jax.decoding.adaptive import CostFit
from specdec_jax.decoding.adaptive import choose_num_draft
from specdec_jax.decoding.adaptive import cost_curve
from specdec_jax.decoding.adaptive import update_counts
from specdec_jax.decoding.common import after_verify
from specdec_jax.decoding.common import make_common
from specdec_jax.decoding.common import prefill
from specdec_jax.decoding.common import prefill_and_start
from specdec_jax.decoding.common import run_one
from specdec_jax.decoding.common import speculative_result
from specdec_jax.decoding.common import uniform
from specdec_jax.decoding.constrained import constrain_proposals
from specdec_jax.decoding.constrained import forced_positions
from specdec_jax.decoding.drafts import FeatureFns
from specdec_jax.decoding.drafts import PromptLookup
from specdec_jax.decoding.drafts import feature_prefill
from specdec_jax.decoding.drafts import next_features
from specdec_jax.decoding.drafts import propose_features
from specdec_jax.decoding.drafts import propose_features_when
from specdec_jax.decoding.drafts import propose_lookup
from specdec_jax.decoding.drafts import propose_model
from specdec_jax.decoding.request_rows import batch_rows
from specdec_jax.decoding.request_rows import edits_needed
from specdec_jax.decoding.request_rows import lazy_processed
from specdec_jax.decoding.request_rows import loop_history
from specdec_jax.decoding.request_rows import model_ids
from specdec_jax.decoding.request_rows import processed
from specdec_jax.decoding.request_rows import reads_lazily
from specdec_jax.decoding.types import ModelFns
from specdec_jax.decoding.types import SpecState
from specdec_jax.decoding.types import SpeculativeResult

#: ``verifier(p (gamma + 1, V), q (gamma, V), draft (gamma,), uniforms (gamma + 1,), *,
#: num_draft) -> VerifyResult`` for one sequence, the signature of :func:`~specdec_jax.verify`.
Verifier = Callable[..., VerifyResult]

#: The named verifiers' rules (:data:`~specdec_jax._rules.registry.CHAIN_RULES`): the loop runs them
#: on lazily processed logits (:func:`verify_step`).
RULE_OF = {verify: "token", block_verify: "block"}

_STATIC = ("target", "draft", "verifier", "gamma", "max_new_tokens", "max_len", "context",
           "pad_id", "adaptive", "logprobs", "logprobs_mode", "structured")


def _loop(target_params, draft_params, prompt, prompt_lengths, tokens_ok, row_keys, params, eos_id,
          grammar=None, grammar_start=None, *, target: ModelFns,
          draft: ModelFns | PromptLookup | FeatureFns, verifier: Verifier, gamma: int,
          max_new_tokens: int, max_len: int, context: int | None, pad_id: int,
          adaptive: AdaptiveSpeculation | None, logprobs: int | None = None,
          logprobs_mode: str = "processed", structured: bool = False):
  """``(common, init, cond, body)`` of the chain loop (traced pieces shared by its jits)."""
  del structured  # static: whether `grammar` is given (the data-parallel result's specs)
  batch = prompt.shape[0]
  rows = batch_rows(batch)
  vocab = target.vocab_size
  cache_len = max_len + gamma  # positions fed never pass L - 1 + gamma <= max_len + gamma - 1
  common, error = make_common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id,
                              max_new_tokens=max_new_tokens, max_len=max_len, context=context,
                              vocab=vocab, grammar=grammar, grammar_start=grammar_start)
  prompt_lengths = common.prompt_lengths  # clipped to [1, P] (BAD_LENGTH rows)
  params = common.params  # in range (out-of-range values are flagged)
  # static: some parameter adjusts the logits, or a grammar masks them
  edits = needs_edits(params, None) or grammar is not None
  is_model = isinstance(draft, ModelFns)
  is_feature = isinstance(draft, FeatureFns)
  is_lookup = not (is_model or is_feature)
  slots = jnp.arange(gamma + 1, dtype=jnp.int32)

  def init() -> SpecState:
    start = prefill_and_start(target, target_params, prompt, common, max_len, cache_len, pad_id,
                              features=is_feature, history_size=max_new_tokens,
                              logprobs=logprobs, mode=logprobs_mode)
    tokens, lengths, done, target_cache, first_error, buffers = start[:6]
    zero = jnp.int32(0)
    if is_model:
      _, draft_cache = prefill(draft, draft_params, prompt, prompt_lengths, cache_len)
      draft_calls = zero + 1
    elif is_feature:
      draft_cache = feature_prefill(draft, draft_params, prompt, prompt_lengths, start[7],
                                     gamma=gamma, cache_len=cache_len, vocab=vocab)
      draft_calls = zero + 1
    else:
      draft_cache, draft_calls = None, zero
    counts = jnp.zeros((batch,), jnp.int32)
    at = jnp.zeros((batch, gamma), jnp.int32)
    return SpecState(tokens, lengths, done, target_cache, draft_cache, zero + 1, draft_calls,
                     (prompt_lengths < common.stop_len).astype(jnp.int32), counts, counts, at, at,
                     error | first_error, jnp.zeros((batch, 2), jnp.float32),
                     None if adaptive is None else cost_curve(adaptive, gamma), buffers, start[6],
                     None if grammar is None else jnp.zeros((batch, 2), jnp.int32))

  def cond(s: SpecState):
    return jnp.any(~s.done) & (s.target_calls <= max_new_tokens)

  def body(s: SpecState) -> SpecState:
    active = ~s.done
    last = s.lengths - 1
    # Never propose past the budget: then the verifier emits at most `stop_len - L` tokens.
    budget = jnp.where(active, jnp.clip(common.stop_len - s.lengths - 1, 0, gamma), 0)
    want = budget if adaptive is None else jnp.minimum(
      budget, choose_num_draft(adaptive, s.adapt, gamma=gamma, costs=s.costs))
    step_keys = jax.vmap(jax.random.fold_in)(row_keys, s.row_calls)
    steps = gamma if adaptive is None else jnp.maximum(jnp.max(want), 1)
    # Each row's prompt and output so far (None unless a parameter reads them).
    history = loop_history(common, s.tokens, s.lengths, max_new_tokens, s.grammar)
    if is_model:
      draft_tokens, q, draft_cache = propose_model(
        draft, draft_params, s.draft_cache, s.tokens, s.lengths, step_keys, params, gamma=gamma,
        cache_len=cache_len, steps=steps, history=history)
      draft_calls = s.draft_calls + steps
    elif is_feature and adaptive is None:
      draft_tokens, q, feature_cache = propose_features(
        draft, draft_params, s.draft_cache, s.tokens, s.lengths, step_keys, params, gamma=gamma,
        cache_len=cache_len, vocab=vocab, steps=steps, history=history)
      draft_calls = s.draft_calls + steps
    elif is_feature:  # adaptive: no draft work in an iteration without proposals
      draft_tokens, q, feature_cache, synced = propose_features_when(
        draft, draft_params, s.draft_cache, s.tokens, s.lengths, step_keys, params, gamma=gamma,
        cache_len=cache_len, vocab=vocab, steps=steps, propose=jnp.max(want) > 0,
        history=history)
      draft_calls = s.draft_calls + jnp.where(jnp.max(want) > 0, steps, synced.astype(jnp.int32))
    else:
      draft_tokens, q, found = propose_lookup(draft, s.tokens, s.lengths, gamma=gamma,
                                              vocab=vocab)
      if grammar is not None:  # forced tokens first, nothing the grammar refuses
        draft_tokens = constrain_proposals(grammar, s.grammar, draft_tokens)
        q = jax.nn.one_hot(draft_tokens, vocab, dtype=q.dtype)
      if adaptive is not None:  # no n-gram match: propose nothing
        want = jnp.where(found, want, 0)
      draft_cache, draft_calls = s.draft_cache, s.draft_calls
    num_draft = want

    # One target call scores the last token and the proposals; adaptive speculation calls it
    # on the batch's largest proposal count plus one (one compiled branch per width).
    inputs = model_ids(jnp.concatenate([s.tokens[rows, last][:, None], draft_tokens], axis=1),
                       vocab)
    positions = jnp.clip(last[:, None] + slots[None], 0, cache_len - 1)
    uniforms = jax.vmap(lambda k: uniform(jax.random.fold_in(k, gamma), (gamma + 1,)))(step_keys)

    def score(k: int):
      """The target call on the last token and the first ``k`` proposals, padded to gamma + 1."""
      def run(target_cache):
        pad = ((0, 0), (0, gamma - k), (0, 0))
        if is_feature:
          logits, feats, target_cache = target.apply_features(
            target_params, inputs[:, :k + 1], positions[:, :k + 1], target_cache)
          feats = jnp.pad(feats, pad)
        else:
          logits, target_cache = target.apply(target_params, inputs[:, :k + 1],
                                              positions[:, :k + 1], target_cache)
          feats = None
        return jnp.pad(logits, pad), target_cache, feats
      return run

    if adaptive is None:
      logits, target_cache, feats = score(gamma)(s.target_cache)
    else:  # rows past a row's num_draft + 1 are padding, which the verifier never reads
      logits, target_cache, feats = run_one(
        jnp.max(num_draft), [score(k) for k in range(gamma + 1)], s.target_cache)
    result = verify_step(verifier, logits, params, None if is_lookup else q, q, draft_tokens,
                         uniforms, num_draft, vocab=vocab, history=history, logprobs=logprobs,
                         mode=logprobs_mode)
    if is_feature and adaptive is None:
      draft_cache = (feature_cache, feats, s.lengths)
    elif is_feature:
      draft_cache = (feature_cache, *next_features(s.draft_cache, feats, s.lengths, synced))
    forced = None if grammar is None else forced_positions(grammar, s.grammar, draft_tokens,
                                                            common.eos_id)
    new = after_verify(s, result, common, active=active, target_cache=target_cache,
                       draft_cache=draft_cache, draft_calls=draft_calls, proposals=num_draft,
                       depth=num_draft, stop_empty=edits, forced=forced)
    if adaptive is not None:
      accepted = jnp.where(active, result.num_accepted, 0)
      new = new._replace(adapt=update_counts(adaptive, s.adapt, num_draft, accepted, active))
    return new

  return common, init, cond, body


def verify_step(verifier: Verifier, logits, params, q_rows, q, draft, uniforms, num_draft, *,
                vocab: int, history=None, logprobs: int | None = None,
                mode: str = "processed") -> VerifyResult:
  """The loop's verification of ``(B, gamma + 1, V)`` target logits.

  :func:`~specdec_jax.verify` and :func:`~specdec_jax.block_verify` (the named verifiers) read
  the target's rows lazily processed when some request may cut them with top-k or top-p, or
  adjusts them (:func:`~specdec_jax.decoding.request_rows.reads_lazily`), or logprobs are asked
  for (no ``(B, gamma + 1, V)`` probability array is written), and ``q_rows``: the draft's
  rows, or None for point-mass proposals (prompt lookup), whose rule needs no draft array.
  The rule and its arithmetic are those of the named function on the processed rows.
  Otherwise, and for any other verifier, the rows are processed first and the verifier gets
  the probabilities and ``q``.

  Row ``i`` of each sequence follows its ``history`` (:func:`~specdec_jax.decoding.common.
  loop_history`) and ``draft[:i]`` (:func:`~specdec_jax._logits.adjust.chain_prefixes`): the draft
  tokens before a position count as output, for the penalties, ``min_tokens`` and bad words.
  ``logprobs`` (static ``k`` or None): the result's ``logprobs`` ``(B, gamma + 1)`` (and top
  ``k``) of the emitted tokens under the rows they were drawn from
  (:func:`~specdec_jax._rows.logprobs.finish_emitted`, which also drops a final token drawn from a
  row that allows none: ``NO_ALLOWED_TOKEN``).
  """
  rule = RULE_OF.get(verifier)

  def by_rule(rows, axes):
    def one(p, q, draft, u, n):
      return CHAIN_RULES[rule](p, q, draft, u, n, pad_id=-1, vocab=vocab)

    return jax.vmap(one, in_axes=(axes, None if q_rows is None else 0, 0, 0, 0))(
      rows, q_rows, draft, uniforms, num_draft)

  if not edits_needed(params, history) and logprobs is None:  # the plain path, unchanged
    if rule is None or not reads_lazily(logits, params):
      return jax.vmap(verifier)(processed(logits, params), q, draft, uniforms,
                                num_draft=num_draft)
    return by_rule(*lazy_processed(logits, params))
  gamma = draft.shape[1]
  prefix, prefix_len = jax.vmap(lambda d: chain_prefixes(d, gamma + 1))(draft)
  if rule is None:  # a function verifier gets the processed rows
    result = jax.vmap(verifier)(processed(logits, params, history, prefix, prefix_len), q, draft,
                                uniforms, num_draft=num_draft)
    if logprobs is None:
      return result
  rows, axes = lazy_processed(logits, params, history, prefix, prefix_len,
                              logprobs=logprobs or 0, raw=logprobs is not None and mode == "raw")
  if rule is not None:
    result = by_rule(rows, axes)
  slots = jnp.arange(gamma + 1, dtype=jnp.int32)
  return jax.vmap(lambda r, p: finish_emitted(r, p, slots, pad_id=-1, k=logprobs, mode=mode),
                  in_axes=(0, axes))(result, rows)


@functools.partial(jax.jit, static_argnames=_STATIC)
def speculative_loop(*args, **static):
  """The whole chain loop as one compiled program: prefill, ``while_loop``, result."""
  common, init, cond, body = _loop(*args, **static)
  return speculative_result(lax.while_loop(cond, body, init()), common)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _start(*args, **static) -> SpecState:
  return _loop(*args, **static)[1]()


@functools.partial(jax.jit, static_argnames=(*_STATIC, "iterations"))
def _chunk(state: SpecState, *args, iterations: int, **static):
  """At most ``iterations`` more loop iterations from ``state``; whether rows remain; and
  ``(gamma + 1,)`` int32, how many of the iterations called the target at each width ``k``
  (the batch's largest proposal count: ``k + 1`` tokens scored)."""
  _, _, cond, body = _loop(*args, **static)
  gamma = static["gamma"]

  def step(c):
    state, i, widths = c
    new = body(state)
    k = jnp.max(jnp.sum(new.proposed_at - state.proposed_at, axis=1))
    return new, i + 1, widths.at[jnp.clip(k, 0, gamma)].add(1)

  state, _, widths = lax.while_loop(lambda c: cond(c[0]) & (c[1] < iterations), step,
                                    (state, jnp.int32(0), jnp.zeros((gamma + 1,), jnp.int32)))
  return state, cond(state), widths


@functools.partial(jax.jit, static_argnames=_STATIC)
def _finish(state: SpecState, *args, **static) -> SpeculativeResult:
  return speculative_result(state, _loop(*args, **static)[0])


def streamed_loop(args, static, on_tokens: Callable | None, iterations: int) -> SpeculativeResult:
  """Run the loop in jitted chunks of ``iterations``, calling ``on_tokens(tokens, lengths)``
  (host NumPy arrays) after each when given; the state is carried, so the result is the
  one-shot loop's.

  With ``static["adaptive"].observe > 0`` the host also times each chunk (the first, which
  compiles, excepted) and hands the loop the cost table :class:`CostFit` refits from it.
  """
  name = "speculative_generate"
  policy = static["adaptive"]
  observing = policy is not None and policy.observe > 0
  why = "`on_tokens` hands the host the tokens" if not observing else (
    "`adaptive.observe` times the loop's chunks on the host")
  if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(args)):
    raise ValueError(f"{name}: {why} after each chunk, so it runs outside jax.jit; got traced "
                     "inputs (call it outside jit, or leave that option out).")
  state = _start(*args, **static)
  if not state.tokens.is_fully_addressable:
    raise ValueError(f"{name}: {why} after each chunk, so the batch must live on this "
                     "process's devices; got a global batch that spans several processes "
                     "(run it per process instead).")
  fit = CostFit(policy, static["gamma"]) if observing else None
  running, first = True, True
  while running:
    if fit is not None:
      fit.start()
    state, running, widths = _chunk(state, *args, iterations=iterations, **static)
    tokens, lengths, running, widths = jax.device_get((state.tokens, state.lengths, running,
                                                       widths))
    if fit is not None:
      if not first:  # the first chunk's time is mostly compilation
        fit.stop(widths)
        # placed as the loop's own costs are (committed or not), or _chunk would compile again
        placement = state.costs.sharding if state.costs.committed else None
        state = state._replace(costs=jax.device_put(fit.next_table(), placement))
      first = False
    if on_tokens is not None:
      on_tokens(tokens, lengths)
  return _finish(state, *args, **static)
