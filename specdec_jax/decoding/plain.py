"""Plain autoregressive decoding (:func:`generate`): the baseline every speculative loop matches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._core.checks import check_pad_id
from specdec_jax._logits.process import SamplingParams
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax.decoding.args import auto_axes
from specdec_jax.decoding.args import batch_params
from specdec_jax.decoding.args import check_budget
from specdec_jax.decoding.args import check_eos
from specdec_jax.decoding.args import check_grammar
from specdec_jax.decoding.args import check_prompt
from specdec_jax.decoding.args import model_fns
from specdec_jax.decoding.args import row_keys as make_row_keys
from specdec_jax.decoding.common import append_constrained
from specdec_jax.decoding.common import flag_out_of_room
from specdec_jax.decoding.common import grammar_outcome
from specdec_jax.decoding.common import make_common
from specdec_jax.decoding.common import make_stats
from specdec_jax.decoding.common import prefill_and_start
from specdec_jax.decoding.common import sample_step
from specdec_jax.decoding.data_parallel import run_loop
from specdec_jax.decoding.request_rows import batch_rows
from specdec_jax.decoding.request_rows import loop_history
from specdec_jax.decoding.request_rows import model_ids
from specdec_jax.decoding.request_rows import record_logprobs
from specdec_jax.decoding.types import GenerateResult
from specdec_jax.decoding.types import GenerateState
from specdec_jax.decoding.types import ModelFns
from specdec_jax.models.protocol import Model
from specdec_jax.structured.tables import Grammar


@functools.partial(
  jax.jit,
  static_argnames=("target", "max_new_tokens", "max_len", "context", "pad_id", "logprobs",
                   "logprobs_mode", "structured"),
)
def generate_loop(target_params, prompt, prompt_lengths, tokens_ok, row_keys, params, eos_id,
                  grammar=None, grammar_start=None, *, target: ModelFns, max_new_tokens: int,
                  max_len: int, context: int | None,
                  pad_id: int, logprobs: int | None = None, logprobs_mode: str = "processed",
                  structured: bool = False):
  del structured  # static: whether `grammar` is given (the data-parallel result's specs)
  batch = prompt.shape[0]
  rows = batch_rows(batch)
  common, error = make_common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id,
                          max_new_tokens=max_new_tokens, max_len=max_len, context=context,
                          vocab=target.vocab_size, grammar=grammar,
                          grammar_start=grammar_start)
  prompt_lengths = common.prompt_lengths  # clipped to [1, P] (BAD_LENGTH rows)
  tokens, lengths, done, cache, first_error, buffers, grammar_state = prefill_and_start(
    target, target_params, prompt, common, max_len, max_len, pad_id,
    history_size=max_new_tokens, logprobs=logprobs, mode=logprobs_mode)
  zero = jnp.int32(0)
  state = GenerateState(tokens, lengths, done, cache, zero + 1,
                         (prompt_lengths < common.stop_len).astype(jnp.int32),
                         error | first_error, buffers, grammar_state)

  def cond(s: GenerateState):
    return jnp.any(~s.done) & (s.target_calls <= max_new_tokens)

  def body(s: GenerateState):
    last = s.lengths - 1
    inputs = model_ids(s.tokens[rows, last], target.vocab_size)[:, None]
    logits, cache = target.apply(target_params, inputs, last[:, None], s.cache)
    history = loop_history(common, s.tokens, s.lengths, max_new_tokens, s.grammar)
    new, bad, found, counts = sample_step(logits[:, 0], common, history, s.lengths,
                                          logprobs=logprobs, mode=logprobs_mode)
    active = ~s.done
    tokens, lengths, done, written, bad, grammar_state = append_constrained(
      s.tokens, s.lengths, s.done, new, jnp.ones_like(s.lengths) if counts is None else counts,
      common, s.grammar, bad)
    if counts is not None:  # a row whose adjusted row allows no token stops (it would again)
      done = done | (counts < 1)
    return GenerateState(tokens, lengths, done, cache, s.target_calls + 1,
                          s.row_calls + active.astype(jnp.int32),
                          s.error | jnp.where(active, bad, 0),
                          record_logprobs(s.logprobs, s.lengths, written, found), grammar_state)

  s = lax.while_loop(cond, body, state)
  num_new = s.lengths - prompt_lengths
  empty = jnp.zeros((batch, 0), jnp.int32)
  stats = make_stats(s.target_calls, zero, s.row_calls, jnp.zeros_like(num_new),
                 jnp.zeros_like(num_new), empty, empty, num_new)
  return GenerateResult(s.tokens, s.lengths, num_new, stats,
                        flag_out_of_room(s.error, s.tokens, s.lengths, common),
                        *(s.logprobs or (None, None, None)), grammar_outcome(common, s.grammar))


def generate(model: Model, prompt_tokens: jax.Array, prompt_lengths: jax.Array, key: jax.Array,
             *, max_new_tokens: int, params: SamplingParams = SamplingParams(),
             eos_id: int | None = None, max_len: int | None = None,
             pad_id: int = -1, logprobs: int | None = None,
             logprobs_mode: str = "processed", grammar: Grammar | None = None,
             grammar_state=None) -> GenerateResult:
  """Plain autoregressive decoding: one target call per token, as one jitted while loop.

  The prompt is prefilled with one ``apply`` call (``T = P``, positions ``0 .. P - 1``;
  right padding is fine, each row's padding slots are overwritten before they are
  read) and the first token is sampled from each row's logits at its own last prompt
  position. Then a ``lax.while_loop`` feeds each row's last token and samples the next
  from ``process_logits(logits, params, history)`` by inverse CDF
  (:func:`~specdec_jax.sample_index`; ``temperature == 0`` is greedy), the row's
  :class:`~specdec_jax.History` read from its buffer: its prompt and the tokens it generated
  so far (the penalties' counts, ``min_tokens``'s count, bad words' prefixes). Row ``b``'s
  ``n``-th new token (from 0) uses the uniform ``uniform(fold_in(row_key[b], n))``, so
  a row's output does not depend on the rest of the batch. A row stops after
  ``max_new_tokens`` new tokens, after emitting ``eos_id``, or when the buffer is full.

  Prompts split over a mesh axis run data-parallel: one loop per shard under ``shard_map``,
  nothing crossing that axis per step (:mod:`specdec_jax.decoding.data_parallel`).
  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    model: the target :class:`Model`. Its ``apply``/``init_cache`` are static: reuse
      the same functions to reuse the compiled loop.
    prompt_tokens: int ``(B, P)`` right-padded prompts.
    prompt_lengths: int ``(B,)`` in ``[1, P]``.
    key: one ``jax.random`` key (split into one per row) or ``B`` keys, one per row.
    max_new_tokens: static int ``>= 1``.
    params: :class:`~specdec_jax.SamplingParams`; each field one request's (a scalar, a list
      field's ``-1``-padded list) shared by the batch, or that with a leading ``B``.
    eos_id: optional token id that ends a row (it is kept in the output).
    max_len: static buffer and cache length, ``>= P``; default ``P + max_new_tokens``.
    pad_id: static int written after each row's last token.
    logprobs: static None, or ``k`` in ``[0, min(64, V)]``: the result's ``logprobs`` (each
      generated token's) and, for ``k > 0``, ``top_ids`` / ``top_logprobs``.
    logprobs_mode: static ``"processed"`` (the distribution the token was drawn from) or
      ``"raw"`` (the raw logits' softmax).
    grammar: a :class:`~specdec_jax.structured.Grammar` (JSON schemas, regexes) or None:
      every row samples only tokens its grammar state allows (the mask applied after the
      request's allowed ids, as vLLM applies a grammar bitmask), EOS only where its text is
      complete; the state moves with each token inside the loop, no host call.
    grammar_state: int ``(B,)`` (or a scalar) each row's initial state
      (:func:`~specdec_jax.structured.start_states`; ``FREE``: unconstrained); default:
      every row starts the first grammar stacked.

  Returns:
    :class:`GenerateResult` with ``tokens`` ``(B, max_len)``, ``lengths``, ``num_new``
    ``(B,)``, :class:`DecodeStats` and, with ``logprobs``, the logprobs ``(B, max_len)``;
    with ``grammar``, ``grammar`` (:class:`GrammarOutcome`: whether each output is complete).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from specdec_jax import SamplingParams
    >>> from specdec_jax.models.toy import make_toy_model
    >>> model = make_toy_model(jax.random.key(0), vocab_size=8)
    >>> out = generate(model, jnp.array([[1, 2, 3], [4, 0, 0]]), jnp.array([3, 1]),
    ...                jax.random.key(1), max_new_tokens=4, params=SamplingParams(0.0))
    >>> out.num_new.tolist(), out.lengths.tolist(), int(out.stats.target_calls)
    ([4, 4], [7, 5], 4)

  Reference:
    Radford et al., "Language Models are Unsupervised Multitask Learners", 2019
    (autoregressive sampling); Holtzman et al. 2020, arXiv:1904.09751 (top-p).
  """
  name = "generate"
  fns = model_fns(model, name, "model")
  prompt, lengths, tokens_ok = check_prompt(prompt_tokens, prompt_lengths, name, fns.vocab_size)
  batch, width = prompt.shape
  max_len, context = check_budget(max_new_tokens, max_len, width, lengths, name,
                                   (("model", model.context_length),))
  grammar, grammar_state = check_grammar(grammar, grammar_state, name, batch, fns.vocab_size)
  args = auto_axes((model.params, prompt, lengths, tokens_ok, make_row_keys(key, batch, name),
                    batch_params(params, batch, name, vocab=fns.vocab_size),
                    check_eos(eos_id, name, fns.vocab_size), grammar, grammar_state))
  static = dict(target=fns, max_new_tokens=int(max_new_tokens), max_len=max_len,
                context=context, pad_id=check_pad_id(name, pad_id),
                logprobs=check_logprobs(name, logprobs, logprobs_mode, fns.vocab_size),
                logprobs_mode=logprobs_mode, structured=grammar is not None)
  batch_args = (False, True, True, True, True, True, False, False, True)
  return run_loop(generate_loop, GenerateResult, args, batch_args, static, prompt_index=1)
