"""Exact speculative decoding with a chain of proposals (:func:`speculative_generate`).

This module checks the arguments and picks the driver; the traced loop and the jitted programs
that run it are in :mod:`specdec_jax.decoding.chain_loop`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from specdec_jax._core.checks import check_pad_id
from specdec_jax._logits.process import SamplingParams
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax._rules.block import block_verify
from specdec_jax._rules.tokenwise import verify
from specdec_jax.decoding.adaptive import AdaptiveSpeculation
from specdec_jax.decoding.adaptive import check_policy
from specdec_jax.decoding.args import StaticFunction
from specdec_jax.decoding.args import auto_axes
from specdec_jax.decoding.args import batch_params
from specdec_jax.decoding.args import check_budget
from specdec_jax.decoding.args import check_eos
from specdec_jax.decoding.args import check_grammar
from specdec_jax.decoding.args import check_prompt
from specdec_jax.decoding.args import check_same_vocab
from specdec_jax.decoding.args import model_fns
from specdec_jax.decoding.args import row_keys as make_row_keys
from specdec_jax.decoding.args import static_count
from specdec_jax.decoding.chain_loop import Verifier
from specdec_jax.decoding.chain_loop import speculative_loop
from specdec_jax.decoding.chain_loop import streamed_loop
from specdec_jax.decoding.data_parallel import run_loop
from specdec_jax.decoding.drafts import Draft
from specdec_jax.decoding.drafts import PromptLookup
from specdec_jax.decoding.drafts import feature_fns
from specdec_jax.decoding.types import SpeculativeResult
from specdec_jax.models.protocol import FeatureDraft
from specdec_jax.models.protocol import Model
from specdec_jax.structured.tables import Grammar

#: Verifiers selectable by name in :func:`speculative_generate`.
VERIFIERS: dict[str, Verifier] = {"token": verify, "block": block_verify}


# Which positional arguments of the loops have the batch as their leading axis.
_BATCH_ARGS = (False, False, True, True, True, True, True, False, False, True)


def speculative_generate(target: Model, draft: Draft, prompt_tokens: jax.Array,
                         prompt_lengths: jax.Array, key: jax.Array, *, gamma: int,
                         max_new_tokens: int, params: SamplingParams = SamplingParams(),
                         eos_id: int | None = None, max_len: int | None = None,
                         verifier: str | Verifier = "token",
                         pad_id: int = -1, adaptive: AdaptiveSpeculation | None = None,
                         on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
                         chunk_iterations: int = 4, logprobs: int | None = None,
                         logprobs_mode: str = "processed", grammar: Grammar | None = None,
                         grammar_state=None) -> SpeculativeResult:
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
     :func:`~specdec_jax.process_logits`. Parameters that read a request's history (the
     penalties, ``min_tokens``, bad words) read the row's buffer, its prompt and the tokens it
     generated, and at draft position ``i`` the proposals before it count as output, for the
     draft's ``q`` and the target's ``p`` alike (the bonus row follows all ``gamma``);
  3. ``jax.vmap(verifier)`` keeps a prefix of the proposals plus one token, and the
     row grows by that many (cut after ``eos_id``). Only
     ``num_draft = min(gamma, max_new_tokens - emitted - 1)`` proposals are verified,
     so a row never overshoots ``max_new_tokens``. Rejected positions are rolled back
     by the length alone: the caches' stale slots are overwritten before being read.

  With ``adaptive`` (:class:`~specdec_jax.decoding.AdaptiveSpeculation`) each row proposes
  ``num_draft <= gamma`` tokens chosen from its own past acceptance (none at all when
  proposals keep failing; :class:`PromptLookup` proposes nothing where no n-gram matches),
  the draft runs only as many steps as the batch's largest choice and the target scores
  that many plus one: one compiled call per width, the batch's width picked by a
  ``lax.while_loop`` per width that runs once or not at all (which updates the KV cache in
  place, where ``lax.switch`` would copy it).

  The output is distributed exactly as :func:`generate`'s (the target's processed
  distribution), for any draft; ``temperature == 0`` gives the greedy sequence token
  for token. Each row draws its randomness from its own key and its own iteration
  count (``fold_in(row_key, i)``: draft step ``j`` uses ``fold_in(., j)``, the
  verifier's ``gamma + 1`` uniforms ``fold_in(., gamma)``), so a row's output does not
  depend on the rest of the batch.

  Prompts split over a mesh axis run data-parallel: one loop per shard under ``shard_map``,
  nothing crossing that axis per step (:mod:`specdec_jax.decoding.data_parallel`).
  Multi-host: see the docs, "Sharding and many hosts".

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
    params: :class:`~specdec_jax.SamplingParams` for both draft and target; each field one
      request's (a scalar, a list field's ``-1``-padded list) shared by the batch, or that
      with a leading ``B``.
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
      within the budget). With ``adaptive.observe = n > 0`` the loop runs in jitted chunks of
      ``n`` iterations (``chunk_iterations`` then does not apply) that the host times, and the
      choice follows the observed cost of an iteration by call width
      (:class:`~specdec_jax.decoding.adaptive.CostFit`); it then needs the batch on this
      process's devices and a call outside ``jax.jit``.
    on_tokens: optional host function ``on_tokens(tokens (B, max_len), lengths (B,))`` (NumPy
      arrays) for streaming: the loop then runs in jitted chunks of ``chunk_iterations``
      iterations with its state carried between them, and calls it after each chunk. The
      result is the same as without it, token for token.
    chunk_iterations: static int ``>= 1``, loop iterations per chunk when streaming.
    logprobs: static None, or ``k`` in ``[0, min(64, V)]``: the result's ``logprobs`` (each
      generated token's, under the target row it was drawn from) and, for ``k > 0``,
      ``top_ids`` / ``top_logprobs``.
    logprobs_mode: static ``"processed"`` or ``"raw"`` (the raw logits' softmax).
    grammar, grammar_state: as in :func:`generate` (structured output). Every position is
      masked the same way for the draft and the target: the draft samples inside the mask
      of its state after the draft prefix (prompt lookup's proposals outside it are
      replaced), the target's rows at every draft position and the bonus position are
      masked by the state after the draft tokens before them, and the state moves only past
      the tokens emitted (rejections roll back in ``O(gamma)``). Where the grammar forces the
      next token (:class:`~specdec_jax.structured.Grammar` ``forced``: the one allowed
      token, or the first token of forced text such as a key) it is proposed for free with
      a point-mass ``q`` in place of the draft's; the rule is unchanged, so the output is
      still exactly :func:`generate`'s under the same grammar.

  Returns:
    :class:`SpeculativeResult`: ``tokens`` ``(B, max_len)``, ``lengths``, ``num_new``
    ``(B,)``, :class:`DecodeStats`, the verifier's ``error`` bits per row and, with
    ``logprobs``, the logprobs ``(B, max_len)``; with ``grammar``, its
    :class:`GrammarOutcome` (complete outputs, forced proposals and their acceptance).

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
  gamma = static_count(name, "gamma", gamma)
  chunk_iterations = static_count(name, "chunk_iterations", chunk_iterations)
  vocab = target_fns.vocab_size
  prompt, lengths, tokens_ok = check_prompt(prompt_tokens, prompt_lengths, name, vocab)
  batch, width = prompt.shape
  contexts = (("target", target.context_length),
              ("draft", getattr(draft, "context_length", None)))
  max_len, context = check_budget(max_new_tokens, max_len, width, lengths, name, contexts)
  if adaptive is not None:
    adaptive = check_policy(adaptive, name)
  grammar, grammar_state = check_grammar(grammar, grammar_state, name, batch, vocab)
  args = auto_axes((target.params, draft_params, prompt, lengths, tokens_ok,
                    make_row_keys(key, batch, name), batch_params(params, batch, name, vocab=vocab),
                    check_eos(eos_id, name, vocab), grammar, grammar_state))
  static = dict(target=target_fns, draft=draft_static, verifier=verifier, gamma=gamma,
                max_new_tokens=int(max_new_tokens), max_len=max_len, context=context,
                pad_id=check_pad_id(name, pad_id), adaptive=adaptive,
                logprobs=check_logprobs(name, logprobs, logprobs_mode, vocab),
                logprobs_mode=logprobs_mode, structured=grammar is not None)
  observing = adaptive is not None and adaptive.observe > 0
  if on_tokens is None and not observing:
    return run_loop(speculative_loop, SpeculativeResult, args, _BATCH_ARGS, static,
                    prompt_index=2)
  if on_tokens is not None and not callable(on_tokens):
    raise TypeError(f"{name}: `on_tokens` must be a function or None, got {on_tokens!r}.")
  # The loop never runs more than max_new_tokens + 1 iterations: a longer chunk is one chunk
  # (and 10**12 would not fit the int32 counter).
  chunk = adaptive.observe if observing else chunk_iterations
  return streamed_loop(args, static, on_tokens, min(chunk, int(max_new_tokens) + 1))
