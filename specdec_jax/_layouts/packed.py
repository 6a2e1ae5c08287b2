"""Verification on the packed, ragged layouts that serving engines keep.

vLLM, vllm-project/tpu-inference and sgl-project/sglang-jax never hold ``(B, gamma + 1, V)``
arrays: the drafts of a batch are concatenated (``draft_token_ids [T]``, ``num_draft_tokens
[B]``) and so are the target rows (``[T, V]``, or ``[T + B, V]`` with each request's bonus
row after its draft rows). :func:`packed_verify` takes those arrays as they are: each request
reads its gathered scalars and its stop row in place (row offsets into the shared arrays), so
nothing is padded, copied or one-hot encoded. Point-mass drafts (n-gram, prompt lookup, greedy
drafters: ``draft_probs=None``) are handled by the rule itself, a caller-sampled bonus token is
emitted as given, logits are processed per request (greedy rows mixed with sampled ones), and
the engines' sentinels are mapped by ``convention``. The same body runs over vocabulary shards
(:func:`~specdec_jax.vocab_parallel_packed_verify`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from specdec_jax._core.checks import INT
from specdec_jax._core.checks import check_array
from specdec_jax._core.checks import check_pad_id
from specdec_jax._core.checks import check_static_int
from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.checks import host_array
from specdec_jax._core.checks import host_top_k
from specdec_jax._core.errors import ErrorCode
from specdec_jax._core.errors import flag
from specdec_jax._core.keys import draw_uniforms
from specdec_jax._core.keys import one_source
from specdec_jax._core.keys import uniforms_first
from specdec_jax._core.results import PackedVerifyResult as PackedVerifyResult
from specdec_jax._layouts.engine import all_greedy
from specdec_jax._layouts.engine import check_convention
from specdec_jax._layouts.engine import engine_params
from specdec_jax._layouts.engine import row_owners
from specdec_jax._layouts.mesh import check_divisible
from specdec_jax._layouts.mesh import check_word_aligned
from specdec_jax._layouts.mesh import over_vocab
from specdec_jax._layouts.packed_checks import PACKED_ARRAYS
from specdec_jax._layouts.packed_checks import check_packed
from specdec_jax._layouts.packed_checks import host_checks
from specdec_jax._layouts.packed_checks import no_draft_mask
from specdec_jax._logits.adjust import History
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.lazy import request_rows
from specdec_jax._logits.params import check_bitmask
from specdec_jax._logits.params import check_history
from specdec_jax._logits.params import history_error
from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import check_params
from specdec_jax._logits.process import params_error
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax._rows.logprobs import finish_emitted
from specdec_jax._rows.logprobs import result_specs
from specdec_jax._rows.sources import masked_rows
from specdec_jax._rules.registry import CHAIN_RULES


def packed_verify(draft_token_ids: ArrayLike, num_draft_tokens: ArrayLike, *, max_spec_len: int,
                  target_probs: ArrayLike | None = None,
                  target_logits: ArrayLike | None = None, draft_probs: ArrayLike | None = None,
                  draft_logits: ArrayLike | None = None,
                  bonus_token_ids: ArrayLike | None = None,
                  params: SamplingParams | None = None, key: ArrayLike | None = None,
                  uniforms: ArrayLike | None = None, bonus_rows: bool | None = None,
                  rule: str = "token",
                  convention: str = "specdec", pad_id: int = -1,
                  history: History | None = None, target_bitmask: ArrayLike | None = None,
                  draft_bitmask: ArrayLike | None = None, logprobs: int | None = None,
                  logprobs_mode: str = "processed") -> PackedVerifyResult:
  """Exact verification of a packed, ragged batch, reading every row in place (jitted).

  Request ``i`` proposed ``n_i = num_draft_tokens[i]`` tokens, stored at
  ``draft_token_ids[s_i : s_i + n_i]`` with ``s_i = n_0 + ... + n_{i-1}``. Its target rows
  are ``target[s_i + i : s_i + i + n_i + 1]`` with ``bonus_rows=True`` (vLLM's interleaved
  ``[T + B, V]``: draft rows, then the request's bonus row) or ``target[s_i : s_i + n_i]``
  with ``bonus_rows=False`` (tpu-inference's ``[T, V]``; the bonus token is then
  ``bonus_token_ids[i]``, sampled by the caller). Its draft rows are ``draft[s_i : s_i +
  n_i]``; without draft probabilities the drafts are point masses (``q = e_x``: accept with
  probability ``p(x)``, resample from ``p`` without ``x``), which is exact for any drafter
  that picks its tokens deterministically (n-gram, prompt lookup, greedy EAGLE/MTP heads).
  Each request then runs :func:`~specdec_jax.verify` (``rule="token"``) or
  :func:`~specdec_jax.block_verify` (``rule="block"``) with the uniforms ``uniforms[i]``:
  slot ``j`` tests draft ``j``, the slot after the last test draws the final token; a
  request that accepts everything emits ``bonus_token_ids[i]`` when given (no uniform read,
  its bonus row never read). Arrays may be longer than ``T`` (static engine buffers): rows
  past the counts are never read.

  Nothing of shape ``(B, max_spec_len, V)`` is formed: per request the ``2 * n_i``
  gathered probabilities and the stop row are read from the packed arrays. With
  ``target_logits`` no processed copy is made either: each row gets a few statistics (its max,
  normaliser and top-k/top-p cut, :mod:`specdec_jax._logits.lazy`) and probabilities are computed
  only where the rule reads them, equal to :func:`~specdec_jax.process_logits`'s (the same kept
  tokens; values equal up to the rounding of the normaliser).

  Multi-host: see the docs, "Sharding and many hosts". Vocabulary-sharded rows:
  :func:`~specdec_jax.vocab_parallel_packed_verify` (the same call over a mesh).

  Args:
    draft_token_ids: ``(T,)`` int, the drafts of all requests, concatenated.
    num_draft_tokens: ``(B,)`` int in ``[0, max_spec_len]``, summing to at most ``T``.
    max_spec_len: static int ``>= 0``, the width of the output (``S``).
    target_probs: ``(>= T + B, V)`` or ``(>= T, V)`` target probabilities (processed), or
    target_logits: the same rows as logits, processed with ``params`` per request.
    draft_probs: optional ``(>= T, V)``: the law each draft was sampled from, or
    draft_logits: optional draft logits, processed with ``params`` (as :func:`sample_draft`).
      Neither: point-mass drafts.
    bonus_token_ids: optional ``(B,)`` int, bonus tokens sampled by the caller.
    params: :class:`SamplingParams` with scalar or ``(B,)`` fields (``target_logits`` only).
    key: one ``jax.random`` key (uniforms ``uniform(key, (B, S + 1))``) or ``B`` keys (one
      ``uniform(key_i, (S + 1,))`` per request: results independent of batch composition), or
    uniforms: ``(B, S + 1)`` floats in ``[0, 1)``.
    bonus_rows: static bool, see above; default: True without ``bonus_token_ids``.
    rule: static ``"token"`` or ``"block"``.
    convention: static, how ``params`` writes greedy and "disabled" (:func:`engine_params`);
      ``"sglang"`` also applies ``min_p`` after top-k and top-p, as sglang-jax's sampler does.
    pad_id: static int for the unused slots of ``tokens``.
    history: optional :class:`~specdec_jax.History` with fields ``(B, n)`` (vLLM's
      ``prompt_token_ids`` and ``output_token_ids``, ``-1`` padded): what the penalties,
      ``min_tokens`` and bad words read; a request's draft row ``j`` (target or draft side)
      counts its drafts ``0 .. j - 1`` as output too.
    target_bitmask: optional grammar words ``(rows of the target, ceil(V / 32))``, row for row
      with ``target_probs`` / ``target_logits`` (bonus rows included).
    draft_bitmask: optional ``(rows of the draft, ceil(V / 32))``, the words each draft was
      sampled under.
    logprobs: static, None or an int ``k`` in ``[0, 64]``: the result's ``logprobs`` (each
      emitted token's log-probability under its row's processed target distribution) and,
      for ``k > 0``, ``top_ids`` / ``top_logprobs`` (each such row's ``k`` most likely
      tokens).
    logprobs_mode: static, ``"processed"`` (default) or ``"raw"`` (the raw logits' softmax,
      vLLM's ``raw_logprobs``; with probabilities both are the rows' own).

  Returns:
    :class:`PackedVerifyResult` with ``tokens (B, S + 1)``.

  Raises:
    ValueError / TypeError: on shapes, dtypes, static arguments, and concrete counts or
      parameters out of range. Under an outer ``jit`` traced values are clipped and flagged:
      ``BAD_NUM_DRAFT`` (counts), ``BAD_PARAMS``, ``TOKEN_OUT_OF_RANGE`` (a given bonus id),
      and the value codes of :func:`~specdec_jax.verify`.

  Example:
    >>> import jax.numpy as jnp
    >>> p = jnp.array([[0.1, 0.9], [0.5, 0.5], [0.2, 0.8]])  # request 0: 1 draft + bonus row;
    >>> # request 1: no drafts, only its bonus row (vLLM's interleaved [T + B, V])
    >>> r = packed_verify(jnp.array([1]), jnp.array([1, 0]), max_spec_len=2, target_probs=p,
    ...                   uniforms=jnp.array([[0.5, 0.3, 0.0], [0.6, 0.0, 0.0]]))
    >>> r.tokens.tolist(), r.num_tokens.tolist()
    ([[1, 0, -1], [1, -1, -1]], [2, 1])

  Reference:
    Leviathan, Kalman, Matias (2023), arXiv:2211.17192; Sun et al., "Block Verification
    Accelerates Speculative Decoding" (2025), arXiv:2403.10444; the packed layouts of
    vLLM V1 (``rejection_sampler.py``) and vllm-project/tpu-inference (``RejectionSampler``).
  """
  return packed_call("packed_verify", None, None, draft_token_ids, num_draft_tokens,
                     max_spec_len=max_spec_len, target_probs=target_probs,
                     target_logits=target_logits, draft_probs=draft_probs,
                     draft_logits=draft_logits, bonus_token_ids=bonus_token_ids, params=params,
                     key=key, uniforms=uniforms, bonus_rows=bonus_rows, rule=rule,
                     convention=convention, pad_id=pad_id, history=history,
                     target_bitmask=target_bitmask, draft_bitmask=draft_bitmask,
                     logprobs=logprobs, logprobs_mode=logprobs_mode)


def packed_call(name, mesh, vocab_axis, draft_token_ids, num_draft_tokens, *, max_spec_len,
                target_probs, target_logits, draft_probs, draft_logits, bonus_token_ids, params,
                key, uniforms, bonus_rows, rule, convention, pad_id, history=None,
                target_bitmask=None, draft_bitmask=None, logprobs=None,
                logprobs_mode="processed", lower=False) -> PackedVerifyResult:
  """Host-side checks and conversion, then the jitted packed body (over ``mesh``, if given)."""
  args = dict(draft_token_ids=draft_token_ids, num_draft_tokens=num_draft_tokens,
              target_probs=target_probs, target_logits=target_logits, draft_probs=draft_probs,
              draft_logits=draft_logits, bonus_token_ids=bonus_token_ids, key=key,
              uniforms=uniforms)
  args = {k: host_array(name, k, v, PACKED_ARRAYS[k]) for k, v in args.items()}
  max_spec_len = check_static_int(name, "max_spec_len", max_spec_len, 0)
  pad_id = check_pad_id(name, pad_id)
  check_convention(name, convention)
  if (args["target_probs"] is None) == (args["target_logits"] is None):
    raise ValueError(f"{name}: pass exactly one of `target_probs` and `target_logits`.")
  if args["draft_probs"] is not None and args["draft_logits"] is not None:
    raise ValueError(f"{name}: pass at most one of `draft_probs` and `draft_logits`.")
  if params is not None and key is None and uniforms is None and all_greedy(params, convention):
    # Greedy verification reads no randomness (a draft is kept iff it is the argmax): an
    # all-greedy batch needs neither a key nor uniforms.
    args["uniforms"] = uniforms = np.zeros(
      (jnp.shape(args["num_draft_tokens"])[0] if jnp.ndim(args["num_draft_tokens"]) else 0,
       max_spec_len + 1), np.float32)
  one_source(name, key, uniforms)
  if params is not None and args["target_logits"] is None:
    raise ValueError(f"{name}: `params` apply to logits; with `target_probs` the rows are "
                     "already processed (pass `target_logits` to have them processed).")
  if rule not in CHAIN_RULES:
    raise ValueError(f"{name}: `rule` must be one of {tuple(CHAIN_RULES)}, got {rule!r}.")
  if bonus_rows is None:
    bonus_rows = args["bonus_token_ids"] is None
  if not isinstance(bonus_rows, bool):
    raise ValueError(f"{name}: `bonus_rows` must be a static bool, got {bonus_rows!r}.")
  if params is not None:
    params = engine_params(host_top_k(params), convention)
  elif args["target_logits"] is not None:
    params = SamplingParams()
  logits = args["target_probs"] is None
  for arg in ("draft_token_ids", "num_draft_tokens"):
    check_array(name, arg, args[arg], 1, INT, batch_hint=False)
  host_checks(name, args["num_draft_tokens"], args["draft_token_ids"], max_spec_len, params,
               jnp.shape(args["num_draft_tokens"])[0] if jnp.ndim(args["num_draft_tokens"]) else 0,
               args["target_logits" if logits else "target_probs"],
               args["draft_logits"] if args["draft_logits"] is not None else args["draft_probs"],
               bonus_rows, "target_logits" if logits else "target_probs",
               "draft_logits" if args["draft_logits"] is not None else "draft_probs")
  target = args["target_logits" if logits else "target_probs"]
  draft = args["draft_logits"] if args["draft_logits"] is not None else args["draft_probs"]
  args["key"], args["uniforms"] = uniforms_first(
    name, args["key"], args["uniforms"], jnp.shape(args["num_draft_tokens"])[0],
    max_spec_len + 1, [target.dtype] + ([] if draft is None else [draft.dtype]))
  vocab = target.shape[-1] if jnp.ndim(target) == 2 else None
  batch = jnp.shape(args["num_draft_tokens"])[0] if jnp.ndim(args["num_draft_tokens"]) else 0
  if history is not None and not logits:
    raise ValueError(f"{name}: `history` feeds the parameters that adjust logits: pass "
                     "`target_logits` (probabilities are already processed; a grammar "
                     "`target_bitmask` applies to them).")
  if params is not None:
    params = check_params(params, name, batch=batch, host_only=True, vocab=vocab)
  history = check_history(name, history, vocab, batch)
  target_bitmask = check_bitmask(name, "target_bitmask", target_bitmask, jnp.shape(target)[0],
                                 vocab)
  draft_bitmask = check_bitmask(name, "draft_bitmask", draft_bitmask,
                                None if draft is None else jnp.shape(draft)[0], vocab) if (
    draft is not None) else no_draft_mask(name, draft_bitmask)
  if mesh is not None and (target_bitmask is not None or draft_bitmask is not None or (
      params is not None and needs_edits(params, None))):
    check_word_aligned(name, vocab, mesh.shape[vocab_axis], vocab_axis)
  run = packed_jit.lower if lower else packed_jit
  return run(**args, params=params, max_spec_len=max_spec_len, bonus_rows=bonus_rows,
                     rule=rule, pad_id=pad_id, name=name, mesh=mesh, vocab_axis=vocab_axis,
                     history=history, target_bitmask=target_bitmask,
                     draft_bitmask=draft_bitmask,
                     logprobs=check_logprobs(name, logprobs, logprobs_mode, vocab),
                     logprobs_mode=logprobs_mode, min_p_last=convention == "sglang")


@functools.partial(jax.jit, static_argnames=("max_spec_len", "bonus_rows", "rule", "pad_id",
                                             "name", "mesh", "vocab_axis", "logprobs",
                                             "logprobs_mode", "min_p_last"))
def packed_jit(draft_token_ids, num_draft_tokens, target_probs, target_logits, draft_probs,
                draft_logits, bonus_token_ids, key, uniforms, params, history=None,
                target_bitmask=None, draft_bitmask=None, *, max_spec_len,
                bonus_rows, rule, pad_id, name="packed_verify", mesh=None,
                vocab_axis=None, logprobs=None, logprobs_mode="processed",
                min_p_last=False) -> PackedVerifyResult:
  logits = target_probs is None
  target = target_logits if logits else target_probs
  draft = draft_logits if draft_logits is not None else draft_probs
  target_name = "target_logits" if logits else "target_probs"
  batch, _, vocab = check_packed(
    name, draft_token_ids, num_draft_tokens, target, draft, bonus_token_ids, uniforms,
    max_spec_len, bonus_rows, target_name,
    "draft_logits" if draft_logits is not None else "draft_probs")
  if uniforms is None:
    dtypes = [target.dtype] + ([] if draft is None else [draft.dtype])
    uniforms = draw_uniforms(name, key, batch, max_spec_len + 1, compute_dtype(*dtypes))
  sizes = (draft_token_ids.shape[0], target.shape[0], None if draft is None else draft.shape[0])
  if draft_token_ids.shape[0] == 0:  # no request drafted (T = 0): each emits its bonus token.
    # One unread row keeps every gather's static shapes valid; the counts are checked against
    # the real sizes (a count claiming a draft is flagged, as for any T).
    draft_token_ids = jnp.zeros((1,), draft_token_ids.dtype)
    draft = None if draft is None else jnp.zeros((1, vocab), draft.dtype)
    if not bonus_rows:
      target = jnp.zeros((1, vocab), target.dtype)
  named = dict(draft_token_ids=draft_token_ids, num_draft_tokens=num_draft_tokens,
               target=target, draft=draft, bonus_token_ids=bonus_token_ids, uniforms=uniforms,
               params=params, history=history, target_bitmask=target_bitmask,
               draft_bitmask=draft_bitmask)
  body = functools.partial(packed_body, max_spec_len=max_spec_len, bonus_rows=bonus_rows,
                           rule=rule, pad_id=pad_id, vocab=vocab,
                           draft_is_logits=draft_logits is not None, sizes=sizes,
                           logprobs=logprobs, logprobs_mode=logprobs_mode,
                           min_p_last=min_p_last)
  if mesh is None:
    return body(named, axis_name=None)
  check_divisible(name, target_name, vocab, mesh.shape[vocab_axis], vocab_axis)
  return over_vocab(body, mesh, vocab_axis, named,
                    rows=("target", "draft", "target_bitmask", "draft_bitmask"),
                    out_specs=PackedVerifyResult(*(P(),) * 6, *result_specs(logprobs)))


def packed_body(named, *, max_spec_len: int, bonus_rows: bool, rule: str, pad_id: int,
                vocab: int, draft_is_logits: bool = False, logprobs: int | None = None,
                logprobs_mode: str = "processed", min_p_last: bool = False,
                axis_name: str | None = None,
                sizes: tuple[int, int, int | None] | None = None) -> PackedVerifyResult:
  """The traced body of :func:`packed_verify` (``axis_name``: rows split over the vocabulary).

  ``named["params"]`` is None for processed probabilities, else the logits are processed per
  row with their request's parameters (over the shards, with ``axis_name``).
  """
  draft_token_ids, counts = named["draft_token_ids"], jnp.asarray(named["num_draft_tokens"])
  target, draft, params = named["target"], named["draft"], named["params"]
  # The rows the caller passed (``sizes``: before packed_jit padded a step without drafts).
  total, target_rows, draft_rows = sizes or (
    draft_token_ids.shape[0], target.shape[0], None if draft is None else draft.shape[0])
  batch = counts.shape[0]
  bad_count = (counts < 0) | (counts > max_spec_len)
  counts = jnp.clip(counts, 0, max_spec_len).astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts
  overflow = starts + counts > total  # more drafts claimed than draft_token_ids holds
  counts = jnp.where(overflow, jnp.clip(total - starts, 0, max_spec_len), counts)
  bad_count = bad_count | overflow
  requests = jnp.arange(batch, dtype=jnp.int32)
  p_offsets = starts + requests if bonus_rows else starts
  # Rows the counts claim beyond the arrays (values an outer jit cannot check): flagged.
  bad_count = bad_count | (p_offsets + counts + int(bonus_rows) > target_rows)
  if draft is not None:
    bad_count = bad_count | (starts + counts > draft_rows)
  error = flag(bad_count, ErrorCode.BAD_NUM_DRAFT)

  positions = jnp.arange(max_spec_len, dtype=jnp.int32)
  slots = jnp.clip(starts[:, None] + positions[None, :], 0, max(total - 1, 0))
  drafts = draft_token_ids[slots]

  if params is None:  # probabilities: masked (and renormalised) where a bitmask is given
    target = masked_rows(target, named.get("target_bitmask"), axis_name)
    if draft is not None:
      draft = masked_rows(draft, named.get("draft_bitmask"), axis_name)
  if params is not None:  # logits: each row processed with its request's parameters
    row_counts = counts + 1 if bonus_rows else counts
    history = named.get("history")
    target = packed_rows(target, params, history, drafts, row_counts, p_offsets,
                         named.get("target_bitmask"), axis_name, logprobs, logprobs_mode,
                         min_p_last)
    if draft is not None and draft_is_logits:
      draft = packed_rows(draft, params, history, drafts, counts, starts,
                          named.get("draft_bitmask"), axis_name, None, logprobs_mode,
                          min_p_last)
    elif draft is not None:
      draft = masked_rows(draft, named.get("draft_bitmask"), axis_name)
    error = error | jnp.broadcast_to(params_error(params, vocab), (batch,))
    if history is not None:
      error = error | jnp.broadcast_to(history_error(history, vocab), (batch,))
  rule_rows = CHAIN_RULES[rule]

  def one(ids, u, n, p_offset, q_offset, bonus):
    return rule_rows(target, draft, ids, u, n, pad_id=pad_id, vocab=vocab, axis_name=axis_name,
                     p_offset=p_offset, q_offset=q_offset, bonus_token=bonus)

  bonus = named["bonus_token_ids"]
  result = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, None if bonus is None else 0))(
    drafts, named["uniforms"], counts, p_offsets, starts, bonus)
  slots = jnp.arange(max_spec_len + 1, dtype=jnp.int32)
  rows = jnp.clip(p_offsets[:, None] + slots[None, :], 0, max(target.shape[0] - 1, 0))
  caller = None if bonus is None else result.num_accepted == counts  # the caller's bonus token
  result = jax.vmap(lambda r, rw, c: finish_emitted(
    r, target, rw, pad_id=pad_id, k=logprobs, mode=logprobs_mode, axis_name=axis_name,
    caller_token=c), in_axes=(0, 0, None if caller is None else 0))(result, rows, caller)
  error = result.error | error
  if params is not None and draft is not None and not draft_is_logits:
    # A greedy request's target is a point mass: its draft is kept iff it is the argmax and
    # the residual is the argmax whatever the draft row holds, so a row engines leave unfilled
    # for greedy requests (zeros: not normalised) changes nothing and is not an error. NaN or
    # negative entries can change the outcome and stay flagged.
    greedy = jnp.broadcast_to(~(jnp.asarray(params.temperature) > 0), (batch,))
    error = jnp.where(greedy & (error & ErrorCode.NOT_NORMALIZED.value == error), 0, error)
  return PackedVerifyResult(*result[:4], valid=error == 0, error=error, logprobs=result.logprobs,
                            top_ids=result.top_ids, top_logprobs=result.top_logprobs)


def packed_rows(rows, params, history, drafts, row_counts, offsets, bitmask, axis_name,
                logprobs=None, logprobs_mode="processed", min_p_last=False):
  """Packed logit rows as a lazily processed row source: row ``r`` belongs to the request that
  owns it (``row_counts`` per request, in order), whose ``j``-th row (``r = offsets[b] + j``)
  follows its drafts ``drafts[b, :j]`` after its ``history``."""
  owners = row_owners(row_counts, rows.shape[0])
  position = jnp.clip(jnp.arange(rows.shape[0], dtype=jnp.int32) - offsets[owners], 0,
                      drafts.shape[1])
  j = jnp.arange(drafts.shape[1], dtype=jnp.int32)[None, :]
  prefix = jnp.where(j < position[:, None], drafts[owners], -1)
  return request_rows(rows, params, owners, axis_name, history=history, prefix=prefix,
                      prefix_len=position, bitmask=bitmask, logprobs=logprobs or 0,
                      raw=logprobs is not None and logprobs_mode == "raw",
                      min_p_last=min_p_last)


__all__ = ["PackedVerifyResult", "packed_verify"]
