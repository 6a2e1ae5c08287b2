"""Exact speculative decoding with a chain of proposals (:func:`speculative_generate`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax._block import block_verify
from specdec_jax._logits import SamplingParams
from specdec_jax._verify import VerifyResult
from specdec_jax._verify import verify
from specdec_jax.decoding.adaptive import AdaptiveSpeculation
from specdec_jax.decoding.adaptive import check_policy
from specdec_jax.decoding.adaptive import choose_num_draft
from specdec_jax.decoding.adaptive import update_counts
from specdec_jax.decoding.args import StaticFunction
from specdec_jax.decoding.args import auto_axes
from specdec_jax.decoding.args import batch_params
from specdec_jax.decoding.args import check_budget
from specdec_jax.decoding.args import check_eos
from specdec_jax.decoding.args import check_prompt
from specdec_jax.decoding.args import check_same_vocab
from specdec_jax.decoding.args import model_fns
from specdec_jax.decoding.args import row_keys as make_row_keys
from specdec_jax.decoding.common import after_verify
from specdec_jax.decoding.common import batch_rows
from specdec_jax.decoding.common import make_common
from specdec_jax.decoding.common import model_ids
from specdec_jax.decoding.common import prefill
from specdec_jax.decoding.common import prefill_and_start
from specdec_jax.decoding.common import processed
from specdec_jax.decoding.common import speculative_result
from specdec_jax.decoding.common import uniform
from specdec_jax.decoding.data_parallel import run_loop
from specdec_jax.decoding.drafts import Draft
from specdec_jax.decoding.drafts import FeatureDraft
from specdec_jax.decoding.drafts import FeatureFns
from specdec_jax.decoding.drafts import PromptLookup
from specdec_jax.decoding.drafts import feature_fns
from specdec_jax.decoding.drafts import feature_prefill
from specdec_jax.decoding.drafts import propose_features
from specdec_jax.decoding.drafts import propose_lookup
from specdec_jax.decoding.drafts import propose_model
from specdec_jax.decoding.types import ModelFns
from specdec_jax.decoding.types import SpecState
from specdec_jax.decoding.types import SpeculativeResult
from specdec_jax.models.protocol import Model

#: ``verifier(p (gamma + 1, V), q (gamma, V), draft (gamma,), uniforms (gamma + 1,), *,
#: num_draft) -> VerifyResult`` for one sequence, the signature of :func:`verify`.
Verifier = Callable[..., VerifyResult]

#: Verifiers selectable by name in :func:`speculative_generate`.
VERIFIERS: dict[str, Verifier] = {"token": verify, "block": block_verify}



_STATIC = ("target", "draft", "verifier", "gamma", "max_new_tokens", "max_len", "context",
           "pad_id", "adaptive")


def _loop(target_params, draft_params, prompt, prompt_lengths, tokens_ok, row_keys, params, eos_id,
          *, target: ModelFns, draft: ModelFns | PromptLookup | FeatureFns, verifier: Verifier,
          gamma: int, max_new_tokens: int, max_len: int, context: int | None, pad_id: int,
          adaptive: AdaptiveSpeculation | None):
  """``(common, init, cond, body)`` of the chain loop (traced pieces shared by its jits)."""
  batch = prompt.shape[0]
  rows = batch_rows(batch)
  vocab = target.vocab_size
  cache_len = max_len + gamma  # positions fed never pass L - 1 + gamma <= max_len + gamma - 1
  common, error = make_common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id,
                              max_new_tokens=max_new_tokens, max_len=max_len, context=context,
                              vocab=vocab)
  is_model = isinstance(draft, ModelFns)
  is_feature = isinstance(draft, FeatureFns)
  slots = jnp.arange(gamma + 1, dtype=jnp.int32)

  def init() -> SpecState:
    start = prefill_and_start(target, target_params, prompt, common, max_len, cache_len, pad_id,
                              features=is_feature)
    tokens, lengths, done, target_cache, first_error = start[:5]
    zero = jnp.int32(0)
    if is_model:
      _, draft_cache = prefill(draft, draft_params, prompt, prompt_lengths, cache_len)
      draft_calls = zero + 1
    elif is_feature:
      draft_cache = feature_prefill(draft, draft_params, prompt, prompt_lengths, start[5],
                                     gamma=gamma, cache_len=cache_len, vocab=vocab)
      draft_calls = zero + 1
    else:
      draft_cache, draft_calls = None, zero
    counts = jnp.zeros((batch,), jnp.int32)
    at = jnp.zeros((batch, gamma), jnp.int32)
    return SpecState(tokens, lengths, done, target_cache, draft_cache, zero + 1, draft_calls,
                     (prompt_lengths < common.stop_len).astype(jnp.int32), counts, counts, at, at,
                     error | first_error, jnp.zeros((batch, 2), jnp.float32))

  def cond(s: SpecState):
    return jnp.any(~s.done) & (s.target_calls <= max_new_tokens)

  def body(s: SpecState) -> SpecState:
    active = ~s.done
    last = s.lengths - 1
    # Never propose past the budget: then the verifier emits at most `stop_len - L` tokens.
    budget = jnp.where(active, jnp.clip(common.stop_len - s.lengths - 1, 0, gamma), 0)
    want = budget if adaptive is None else jnp.minimum(
      budget, choose_num_draft(adaptive, s.adapt, gamma=gamma))
    step_keys = jax.vmap(jax.random.fold_in)(row_keys, s.row_calls)
    steps = gamma if adaptive is None else jnp.maximum(jnp.max(want), 1)
    if is_model:
      draft_tokens, q, draft_cache = propose_model(
        draft, draft_params, s.draft_cache, s.tokens, s.lengths, step_keys, params, gamma=gamma,
        cache_len=cache_len, steps=steps)
      draft_calls = s.draft_calls + steps
    elif is_feature:
      draft_tokens, q, feature_cache = propose_features(
        draft, draft_params, s.draft_cache, s.tokens, s.lengths, step_keys, params, gamma=gamma,
        cache_len=cache_len, vocab=vocab, steps=steps)
      draft_calls = s.draft_calls + steps
    else:
      draft_tokens, q, found = propose_lookup(draft, s.tokens, s.lengths, gamma=gamma,
                                              vocab=vocab)
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
    result = jax.vmap(verifier)(processed(logits, params), q, draft_tokens, uniforms,
                                num_draft=num_draft)
    if is_feature:
      draft_cache = (feature_cache, feats, s.lengths)
    new = after_verify(s, result, common, active=active, target_cache=target_cache,
                       draft_cache=draft_cache, draft_calls=draft_calls, proposals=num_draft,
                       depth=num_draft)
    if adaptive is not None:
      accepted = jnp.where(active, result.num_accepted, 0)
      new = new._replace(adapt=update_counts(adaptive, s.adapt, num_draft, accepted, active))
    return new

  return common, init, cond, body


def run_one(index: jax.Array, branches, cache):
  """``branches[index](cache)``, each branch returning ``(out, cache, extra)``, with the KV
  cache updated in place.

  ``lax.switch`` would do, but XLA copies a large operand into a conditional and again inside
  each branch before writing to it (four copies of the cache per iteration, seen in the
  compiled CPU HLO); a ``lax.while_loop`` per branch that runs once or not at all carries the
  cache in place. Only the model call sits in the branches: processing the logits and
  verifying inside them cost ~7 ms per iteration on SmolLM2 (CPU), outside nothing.
  """
  def loop(branch):
    def body(carry):
      out, c, extra = branch(carry[1])
      return jnp.int32(-1), c, (out, extra)
    return body

  shape = jax.eval_shape(lambda c: (lambda r: (r[0], r[2]))(branches[0](c)), cache)
  done = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shape)
  flag = index.astype(jnp.int32)
  for k, branch in enumerate(branches):
    flag, cache, done = lax.while_loop(lambda carry, k=k: carry[0] == k, loop(branch),
                                       (flag, cache, done))
  out, extra = done
  return out, cache, extra


# Which positional arguments of the loops have the batch as their leading axis.
_BATCH_ARGS = (False, False, True, True, True, True, True, False)


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
  """At most ``iterations`` more loop iterations from ``state``; and whether rows remain."""
  _, _, cond, body = _loop(*args, **static)
  state, _ = lax.while_loop(lambda c: cond(c[0]) & (c[1] < iterations),
                            lambda c: (body(c[0]), c[1] + 1), (state, jnp.int32(0)))
  return state, cond(state)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _finish(state: SpecState, *args, **static) -> SpeculativeResult:
  return speculative_result(state, _loop(*args, **static)[0])


def streamed_loop(args, static, on_tokens: Callable, iterations: int) -> SpeculativeResult:
  """Run the loop in jitted chunks of ``iterations``, calling ``on_tokens(tokens, lengths)``
  (host NumPy arrays) after each; the state is carried, so the result is the one-shot loop's."""
  state = _start(*args, **static)
  if not state.tokens.is_fully_addressable:
    raise ValueError("speculative_generate: `on_tokens` hands the host the tokens after each "
                     "chunk, so the batch must live on this process's devices; got a global "
                     "batch that spans several processes (stream per process instead).")
  running = True
  while running:
    state, running = _chunk(state, *args, iterations=iterations, **static)
    tokens, lengths, running = jax.device_get((state.tokens, state.lengths, running))
    on_tokens(tokens, lengths)
  return _finish(state, *args, **static)


def speculative_generate(target: Model, draft: Draft, prompt_tokens: jax.Array,
                         prompt_lengths: jax.Array, key: jax.Array, *, gamma: int,
                         max_new_tokens: int, params: SamplingParams = SamplingParams(),
                         eos_id: int | None = None, max_len: int | None = None,
                         verifier: str | Verifier = "token",
                         pad_id: int = -1, adaptive: AdaptiveSpeculation | None = None,
                         on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
                         chunk_iterations: int = 4) -> SpeculativeResult:
  """Exact speculative decoding of a batch, as one jitted ``lax.while_loop`` with fixed shapes.

  The target prefills the prompt and samples each row's first token as
  :func:`generate` does (same key use, so the first token is the same). Then each
  iteration, for every unfinished row of length ``L``:

  1. the draft proposes ``gamma`` tokens and the distributions ``q`` they were drawn
     from: a draft :class:`Model` samples with :func:`~specdec_jax.sample_draft` under
     the same ``params`` (its cache is synced by feeding the tokens at ``L - 2, L - 1``,
     then ``gamma - 1`` single steps); a :class:`FeatureDraft` (EAGLE) is synced on the
     tokens the target scored last with the target's features, then runs ahead on its own;
     :class:`PromptLookup` proposes from n-gram matches with point-mass ``q`` and calls no
     model;
  2. the target scores the token at ``L - 1`` and the proposals in ONE ``apply``
     (``T = gamma + 1``, positions ``L - 1 .. L + gamma - 1``), giving ``p`` via
     :func:`~specdec_jax.process_logits`;
  3. ``jax.vmap(verifier)`` keeps a prefix of the proposals plus one token, and the
     row grows by that many (cut after ``eos_id``). Only
     ``num_draft = min(gamma, max_new_tokens - emitted - 1)`` proposals are verified,
     so a row never overshoots ``max_new_tokens``. Rejected positions are rolled back
     by the length alone: the caches' stale slots are overwritten before being read.

  With ``adaptive`` (:class:`~specdec_jax.decoding.AdaptiveSpeculation`) each row proposes
  ``num_draft <= gamma`` tokens chosen from its own past acceptance (none at all when
  proposals keep failing; :class:`PromptLookup` proposes nothing where no n-gram matches),
  the draft runs only as many steps as the batch's largest choice and the target scores
  that many plus one (one compiled call per width, picked with ``lax.switch``).

  The output is distributed exactly as :func:`generate`'s (the target's processed
  distribution), for any draft; ``temperature == 0`` gives the greedy sequence token
  for token. Each row draws its randomness from its own key and its own iteration
  count (``fold_in(row_key, i)``: draft step ``j`` uses ``fold_in(., j)``, the
  verifier's ``gamma + 1`` uniforms ``fold_in(., gamma)``), so a row's output does not
  depend on the rest of the batch.

  Global arrays (``jax.distributed``, several processes): prompts, lengths and keys may be
  arrays that span devices of several processes (e.g. the batch split over a ``data`` mesh
  axis). Their values are then checked under ``jit`` and flagged in ``error`` instead of on
  the host (only values this process can read are checked on the host), nothing is gathered
  to one host, and the result is a global array laid out like the batch. Prompts split over a
  mesh axis run data-parallel: one loop per shard under ``shard_map``, nothing crossing that
  axis per step (:mod:`specdec_jax.decoding.data_parallel`).

  Args:
    target: the target :class:`Model`.
    draft: a draft :class:`Model` with the target's vocabulary (a small model, or the
      target with layers skipped: self-speculation), a :class:`FeatureDraft` (needs a target
      with ``apply_features``), or :class:`PromptLookup`.
    prompt_tokens: int ``(B, P)`` right-padded prompts.
    prompt_lengths: int ``(B,)`` in ``[1, P]``.
    key: one ``jax.random`` key (split into one per row) or ``B`` keys, one per row.
    gamma: static int ``>= 1``, proposals per iteration.
    max_new_tokens: static int ``>= 1``.
    params: :class:`~specdec_jax.SamplingParams` for both draft and target; each field
      a scalar or ``(B,)``.
    eos_id: optional token id that ends a row (kept in the output).
    max_len: static buffer length, ``>= P``; default ``P + max_new_tokens``. The
      caches have ``max_len + gamma`` slots.
    verifier: ``"token"`` (:func:`~specdec_jax.verify`), ``"block"``
      (:func:`~specdec_jax.block_verify`) or a function with :func:`~specdec_jax.verify`'s
      signature ``(p, q, draft, uniforms, *, num_draft) -> VerifyResult`` for one sequence.
      It is static; functions are compared by code and captured values, so a lambda written
      at the call site reuses the compiled loop on the next call.
    pad_id: static int written after each row's last token.
    adaptive: optional static :class:`~specdec_jax.decoding.AdaptiveSpeculation`, the cost
      model that chooses each row's proposals per iteration (``None``: always ``gamma``,
      within the budget).
    on_tokens: optional host function ``on_tokens(tokens (B, max_len), lengths (B,))`` (NumPy
      arrays) for streaming: the loop then runs in jitted chunks of ``chunk_iterations``
      iterations with its state carried between them, and calls it after each chunk. The
      result is the same as without it, token for token.
    chunk_iterations: static int ``>= 1``, loop iterations per chunk when streaming.

  Returns:
    :class:`SpeculativeResult`: ``tokens`` ``(B, max_len)``, ``lengths``, ``num_new``
    ``(B,)``, :class:`DecodeStats` and the verifier's ``error`` bits per row.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from specdec_jax import PromptLookup, SamplingParams, generate
    >>> from specdec_jax.models.toy import make_toy_model
    >>> target = make_toy_model(jax.random.key(0), vocab_size=8)
    >>> small = make_toy_model(jax.random.key(1), vocab_size=8, context=1)
    >>> prompt, lengths = jnp.array([[1, 2, 3], [4, 0, 0]]), jnp.array([3, 1])
    >>> greedy = SamplingParams(temperature=0.0)
    >>> plain = generate(target, prompt, lengths, jax.random.key(2), max_new_tokens=6,
    ...                  params=greedy)
    >>> fast = speculative_generate(target, small, prompt, lengths, jax.random.key(2), gamma=3,
    ...                             max_new_tokens=6, params=greedy)
    >>> bool((fast.tokens == plain.tokens).all()), fast.num_new.tolist()
    (True, [6, 6])
    >>> lookup = speculative_generate(target, PromptLookup(), prompt, lengths,
    ...                               jax.random.key(2), gamma=3, max_new_tokens=6, params=greedy)
    >>> bool((lookup.tokens == plain.tokens).all()), int(lookup.stats.draft_calls)
    (True, 0)

  Reference:
    Leviathan, Kalman, Matias, "Fast Inference from Transformers via Speculative
    Decoding", ICML 2023, arXiv:2211.17192; Chen et al., "Accelerating Large Language
    Model Decoding with Speculative Sampling", arXiv:2302.01318; Zhang et al., "Draft &
    Verify: Lossless Large Language Model Acceleration via Self-Speculative Decoding",
    arXiv:2309.08168; Saxena 2023 (prompt lookup decoding); Yang et al. 2023 (LLMA),
    arXiv:2304.04487.
  """
  name = "speculative_generate"
  target_fns = model_fns(target, name, "target")
  if isinstance(draft, FeatureDraft):
    draft_static, draft_params = feature_fns(draft, target, name)
  elif isinstance(draft, PromptLookup):
    if not 1 <= draft.min_ngram <= draft.max_ngram:
      raise ValueError(
        f"{name}: PromptLookup needs 1 <= min_ngram <= max_ngram, got min_ngram = "
        f"{draft.min_ngram}, max_ngram = {draft.max_ngram} instead."
      )
    draft_static, draft_params = PromptLookup(int(draft.max_ngram), int(draft.min_ngram)), None
  else:
    draft_static, draft_params = model_fns(draft, name, "draft"), draft.params
    check_same_vocab(draft_static.vocab_size, target_fns.vocab_size, name)
  if isinstance(verifier, str):
    if verifier not in VERIFIERS:
      raise ValueError(
        f"{name}: `verifier` must be one of {sorted(VERIFIERS)} or a function, got "
        f"{verifier!r} instead."
      )
    verifier = VERIFIERS[verifier]
  elif not callable(verifier):
    raise TypeError(f"{name}: `verifier` must be a name or a function, got {verifier!r}.")
  else:
    verifier = StaticFunction(verifier)  # a lambda written at the call site compiles once
  if not isinstance(gamma, int | np.integer) or gamma < 1:
    raise ValueError(f"{name}: `gamma` must be an int >= 1, got {gamma!r} instead.")
  vocab = target_fns.vocab_size
  prompt, lengths, tokens_ok = check_prompt(prompt_tokens, prompt_lengths, name, vocab)
  batch, width = prompt.shape
  contexts = (("target", target.context_length),
              ("draft", getattr(draft, "context_length", None)))
  max_len, context = check_budget(max_new_tokens, max_len, width, lengths, name, contexts)
  if adaptive is not None:
    adaptive = check_policy(adaptive, name)
  args = auto_axes((target.params, draft_params, prompt, lengths, tokens_ok,
                    make_row_keys(key, batch, name), batch_params(params, batch, name),
                    check_eos(eos_id, name, vocab)))
  static = dict(target=target_fns, draft=draft_static, verifier=verifier, gamma=int(gamma),
                max_new_tokens=int(max_new_tokens), max_len=max_len, context=context,
                pad_id=int(pad_id), adaptive=adaptive)
  if on_tokens is None:
    return run_loop(speculative_loop, SpeculativeResult, args, _BATCH_ARGS, static,
                    prompt_index=2)
  if not callable(on_tokens):
    raise TypeError(f"{name}: `on_tokens` must be a function or None, got {on_tokens!r}.")
  if not isinstance(chunk_iterations, int | np.integer) or chunk_iterations < 1:
    raise ValueError(f"{name}: `chunk_iterations` must be an int >= 1, got "
                     f"{chunk_iterations!r} instead.")
  return streamed_loop(args, static, on_tokens, int(chunk_iterations))
