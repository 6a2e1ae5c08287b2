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
from specdec_jax.decoding.args import StaticFunction
from specdec_jax.decoding.args import batch_params
from specdec_jax.decoding.args import check_budget
from specdec_jax.decoding.args import check_eos
from specdec_jax.decoding.args import check_prompt
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
from specdec_jax.decoding.drafts import Draft
from specdec_jax.decoding.drafts import PromptLookup
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



@functools.partial(
  jax.jit,
  static_argnames=("target", "draft", "verifier", "gamma", "max_new_tokens", "max_len", "context",
                   "pad_id"),
)
def speculative_loop(target_params, draft_params, prompt, prompt_lengths, tokens_ok, row_keys,
                      params, eos_id, *, target: ModelFns, draft: ModelFns | PromptLookup,
                      verifier: Verifier, gamma: int, max_new_tokens: int, max_len: int,
                      context: int | None, pad_id: int):
  batch = prompt.shape[0]
  rows = batch_rows(batch)
  vocab = target.vocab_size
  cache_len = max_len + gamma  # positions fed never pass L - 1 + gamma <= max_len + gamma - 1
  common, error = make_common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id,
                          max_new_tokens=max_new_tokens, max_len=max_len, context=context,
                          vocab=vocab)
  stop_len = common.stop_len
  tokens, lengths, done, target_cache, first_error = prefill_and_start(
    target, target_params, prompt, common, max_len, cache_len, pad_id)
  zero = jnp.int32(0)
  is_model = isinstance(draft, ModelFns)
  if is_model:
    _, draft_cache = prefill(draft, draft_params, prompt, prompt_lengths, cache_len)
    draft_calls = zero + 1
  else:
    draft_cache, draft_calls = None, zero
  counts = jnp.zeros((batch,), jnp.int32)
  at = jnp.zeros((batch, gamma), jnp.int32)
  state = SpecState(tokens, lengths, done, target_cache, draft_cache, zero + 1, draft_calls,
                     (prompt_lengths < stop_len).astype(jnp.int32), counts, counts, at, at,
                     error | first_error)
  slots = jnp.arange(gamma + 1, dtype=jnp.int32)

  def cond(s: SpecState):
    return jnp.any(~s.done) & (s.target_calls <= max_new_tokens)

  def body(s: SpecState):
    active = ~s.done
    last = s.lengths - 1
    # Never propose past the budget: then the verifier emits at most `stop_len - L` tokens.
    num_draft = jnp.where(active, jnp.clip(common.stop_len - s.lengths - 1, 0, gamma), 0)
    step_keys = jax.vmap(jax.random.fold_in)(row_keys, s.row_calls)
    if is_model:
      draft_tokens, q, draft_cache = propose_model(
        draft, draft_params, s.draft_cache, s.tokens, s.lengths, step_keys, params, gamma=gamma,
        cache_len=cache_len)
      draft_calls = s.draft_calls + gamma
    else:
      draft_tokens, q = propose_lookup(draft, s.tokens, s.lengths, gamma=gamma, vocab=vocab)
      draft_cache, draft_calls = s.draft_cache, s.draft_calls

    # One target call scores the last token and the gamma proposals.
    inputs = jnp.concatenate([s.tokens[rows, last][:, None], draft_tokens], axis=1)
    positions = jnp.clip(last[:, None] + slots[None], 0, cache_len - 1)
    logits, target_cache = target.apply(target_params, model_ids(inputs, vocab), positions,
                                        s.target_cache)
    p = processed(logits, params)
    uniforms = jax.vmap(lambda k: uniform(jax.random.fold_in(k, gamma), (gamma + 1,)))(step_keys)
    result = jax.vmap(verifier)(p, q, draft_tokens, uniforms, num_draft=num_draft)

    return after_verify(s, result, common, active=active, target_cache=target_cache,
                         draft_cache=draft_cache, draft_calls=draft_calls, proposals=num_draft,
                         depth=num_draft)

  return speculative_result(lax.while_loop(cond, body, state), common)




def speculative_generate(target: Model, draft: Draft, prompt_tokens: jax.Array,
                         prompt_lengths: jax.Array, key: jax.Array, *, gamma: int,
                         max_new_tokens: int, params: SamplingParams = SamplingParams(),
                         eos_id: int | None = None, max_len: int | None = None,
                         verifier: str | Verifier = "token",
                         pad_id: int = -1) -> SpeculativeResult:
  """Exact speculative decoding of a batch, as one jitted ``lax.while_loop`` with fixed shapes.

  The target prefills the prompt and samples each row's first token as
  :func:`generate` does (same key use, so the first token is the same). Then each
  iteration, for every unfinished row of length ``L``:

  1. the draft proposes ``gamma`` tokens and the distributions ``q`` they were drawn
     from: a draft :class:`Model` samples with :func:`~specdec_jax.sample_draft` under
     the same ``params`` (its cache is synced by feeding the tokens at ``L - 2, L - 1``,
     then ``gamma - 1`` single steps); :class:`PromptLookup` proposes from n-gram
     matches with point-mass ``q`` and calls no model;
  2. the target scores the token at ``L - 1`` and the proposals in ONE ``apply``
     (``T = gamma + 1``, positions ``L - 1 .. L + gamma - 1``), giving ``p`` via
     :func:`~specdec_jax.process_logits`;
  3. ``jax.vmap(verifier)`` keeps a prefix of the proposals plus one token, and the
     row grows by that many (cut after ``eos_id``). Only
     ``num_draft = min(gamma, max_new_tokens - emitted - 1)`` proposals are verified,
     so a row never overshoots ``max_new_tokens``. Rejected positions are rolled back
     by the length alone: the caches' stale slots are overwritten before being read.

  The output is distributed exactly as :func:`generate`'s (the target's processed
  distribution), for any draft; ``temperature == 0`` gives the greedy sequence token
  for token. Each row draws its randomness from its own key and its own iteration
  count (``fold_in(row_key, i)``: draft step ``j`` uses ``fold_in(., j)``, the
  verifier's ``gamma + 1`` uniforms ``fold_in(., gamma)``), so a row's output does not
  depend on the rest of the batch.

  Args:
    target: the target :class:`Model`.
    draft: a draft :class:`Model` with the target's vocabulary (a small model, or the
      target with layers skipped: self-speculation), or :class:`PromptLookup`.
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
  if isinstance(draft, PromptLookup):
    if not 1 <= draft.min_ngram <= draft.max_ngram:
      raise ValueError(
        f"{name}: PromptLookup needs 1 <= min_ngram <= max_ngram, got min_ngram = "
        f"{draft.min_ngram}, max_ngram = {draft.max_ngram} instead."
      )
    draft_static, draft_params = PromptLookup(int(draft.max_ngram), int(draft.min_ngram)), None
  else:
    draft_static, draft_params = model_fns(draft, name, "draft"), draft.params
    if draft_static.vocab_size != target_fns.vocab_size:
      raise ValueError(
        f"{name}: the draft must share the target's vocabulary, got V = "
        f"{draft_static.vocab_size} for the draft and V = {target_fns.vocab_size} for the target."
      )
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
              ("draft", None if isinstance(draft, PromptLookup) else draft.context_length))
  max_len, context = check_budget(max_new_tokens, max_len, width, lengths, name, contexts)
  return speculative_loop(target.params, draft_params, prompt, lengths, tokens_ok,
                          make_row_keys(key, batch, name), batch_params(params, batch, name),
                          check_eos(eos_id, name, vocab), target=target_fns, draft=draft_static,
                          verifier=verifier, gamma=int(gamma),
                          max_new_tokens=int(max_new_tokens), max_len=max_len, context=context,
                          pad_id=int(pad_id))
