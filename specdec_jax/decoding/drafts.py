"""The drafts of the chain loop: another model (sampled with its ``q``), a feature draft or
prompt lookup.

:class:`~specdec_jax.models.protocol.FeatureDraft` is defined next to ``Model`` (the models
build it, and they do not import the loops); it is re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from specdec_jax._core.sampling import sample_index
from specdec_jax._logits.process import sample_unchecked
from specdec_jax.decoding.common import run_one
from specdec_jax.decoding.constrained import force
from specdec_jax.decoding.request_rows import batch_rows
from specdec_jax.decoding.request_rows import draft_prefix
from specdec_jax.decoding.request_rows import edits_needed
from specdec_jax.decoding.request_rows import model_ids
from specdec_jax.decoding.request_rows import processed
from specdec_jax.decoding.types import ModelFns
from specdec_jax.models.protocol import FeatureDraft
from specdec_jax.models.protocol import Model
from specdec_jax.models.protocol import check_vocab_ids


class PromptLookup(NamedTuple):
  """A draft without a model: propose what followed the last n-gram the last time it occurred.

  At each step the row's last ``n`` tokens are looked up in its own context (prompt
  and generated tokens), for ``n = max_ngram`` down to ``min_ngram``; at the most
  recent earlier occurrence, the tokens that followed it are proposed (repeating the
  matched period if fewer than ``gamma`` follow). Without any match the last token is
  repeated. Each proposal comes with a point mass as its ``q`` row, which the
  verification rule handles exactly at any temperature (accept ``x`` with probability
  ``p(x)``, else sample from ``p`` with ``x`` removed), so the output distribution is
  the target's whatever is proposed.

  Attributes:
    max_ngram: longest n-gram to match (static).
    min_ngram: shortest n-gram to match, ``1 <= min_ngram <= max_ngram``.

  Reference:
    Saxena, "Prompt Lookup Decoding", 2023, github.com/apoorvumang/prompt-lookup-decoding;
    Yang et al., "Inference with Reference: Lossless Acceleration of Large Language
    Models" (LLMA), arXiv:2304.04487.
  """

  max_ngram: int = 3
  min_ngram: int = 1


class FeatureFns(NamedTuple):
  """The static half of a :class:`FeatureDraft` (hashable: a jit static argument)."""

  apply: Callable[..., Any]
  init_cache: Callable[[int, int], Any]
  draft_vocab: int
  tree_apply: Callable[..., Any] | None = None
  label: str = "the draft"  # "speculative_generate: `draft`"


def feature_fns(draft: FeatureDraft, target: Model, name: str, *,
                tree: bool = False) -> tuple[FeatureFns, tuple]:
  """``(static functions, (params, vocab_ids int32))`` of a :class:`FeatureDraft`, checked
  against the target (its feature forms, the draft vocabulary's ids when readable here)."""
  need = ("tree_apply_features",) if tree else ("apply_features",)
  for field in need:
    if getattr(target, field) is None:
      raise ValueError(f"{name}: a FeatureDraft reads the target's features, but the target "
                       f"{target.name!r} has no `{field}` (see specdec_jax.models.Model).")
  if tree and draft.tree_apply is None:
    raise ValueError(f"{name}: the FeatureDraft {draft.name!r} has no `tree_apply` (tree "
                     f"attention over the draft's nodes), needed to draft a tree.")
  reads, given = draft.reads, getattr(target, "features", None)
  if reads is not None and given is not None and reads != given:
    raise ValueError(f"{name}: the FeatureDraft {draft.name!r} reads the target's {reads}, but "
                     f"the feature forms of the target {target.name!r} return its {given} "
                     "(a draft trained on EAGLE-3's fused features runs with "
                     "specdec_jax.models.eagle.make_fused_target's target).")
  ids = check_vocab_ids(name, draft.vocab_ids, target.vocab_size)
  return (FeatureFns(draft.apply, draft.init_cache, int(ids.shape[0]), draft.tree_apply,
                     f"{name}: `draft`"), (draft.params, ids))


#: A draft for :func:`speculative_generate`: another :class:`Model` (same vocabulary as the
#: target), :class:`PromptLookup` or a :class:`FeatureDraft`.
Draft = Model | PromptLookup | FeatureDraft



def draft_sampler(step_keys, params, vocab: int, vocab_ids=None, history=None):
  """``sample(j, logits (B, K), proposed) -> (tokens (B,), q (B, V))``: draft position ``j``'s
  draw.

  Row ``b`` uses ``fold_in(step_keys[b], j)``. With ``vocab_ids`` the logits are over that
  subset of the vocabulary: the token is mapped to its target id and ``q`` is zero elsewhere.
  When ``params`` adjust the logits (penalties, bias, bans, allowed ids), ``q`` is processed
  as the target's row at that position is: after the row's ``history`` (the request's prompt
  and output, :func:`~specdec_jax.decoding.request_rows.loop_history`) and the proposals before
  position ``j`` (``proposed`` ``(B, gamma)``, its first ``j`` entries; None at ``j = 0``),
  over the whole vocabulary (a subset's other ids are ``-inf``).
  """
  def sample(j, logits, proposed=None):
    keys = jax.vmap(lambda k: jax.random.fold_in(k, j))(step_keys)
    if not edits_needed(params, history):
      out = jax.vmap(sample_unchecked)(keys, logits, params)
      if vocab_ids is None:
        return out.token, out.probs
      q = jnp.zeros((logits.shape[0], vocab), out.probs.dtype).at[:, vocab_ids].set(out.probs)
      return vocab_ids[out.token], q
    if vocab_ids is not None:  # the subset's logits in their target columns, -inf elsewhere
      logits = jnp.full((logits.shape[0], vocab), -jnp.inf, logits.dtype).at[:, vocab_ids].set(
        logits)
    prefix, prefix_len = (None, None) if proposed is None else draft_prefix(proposed, j)
    probs = processed(logits, params, history, prefix, prefix_len)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), dtype=probs.dtype))(keys)
    return force(history, prefix, prefix_len, jax.vmap(sample_index)(probs, u), probs)

  return sample


def run_ahead(step, first_token, first_q, carry, *, gamma: int, steps):
  """Fill ``(B, gamma)`` proposals and ``(B, gamma, V)`` ``q`` from the first draw and
  ``steps - 1`` more calls of ``step(j, proposed, carry) -> (token, q, carry)`` (``proposed``
  ``(B, gamma)``: the proposals so far, its first ``j`` entries drawn; the step feeds
  ``proposed[:, j - 1]``).

  ``steps`` is a static int or a traced ``()`` int32 in ``[1, gamma]`` (adaptive speculation:
  the batch's largest proposal count); the slots after it keep the first draw (never verified).
  """
  tokens = jnp.broadcast_to(first_token[:, None], (*first_token.shape, gamma))
  q = jnp.broadcast_to(first_q[:, None], (first_q.shape[0], gamma, first_q.shape[1]))

  def body(j, state):
    tokens, q, carry = state
    token, probs, carry = step(j, tokens, carry)
    return tokens.at[:, j].set(token), q.at[:, j].set(probs), carry

  tokens, q, carry = lax.fori_loop(1, steps, body, (tokens, q, carry))
  return tokens, q, carry


def propose_model(draft: ModelFns, draft_params, cache, tokens, lengths, step_keys, params,
                   *, gamma: int, cache_len: int, steps=None, history=None):
  """Up to ``gamma`` proposals from a draft model: one ``T = 2`` sync call, then ``steps - 1``
  single steps (``steps`` defaults to ``gamma``; see :func:`run_ahead`).

  The draft has processed every token before position ``L - 2`` (after a full
  acceptance the last two tokens are new to it, after a rejection only the last), so
  it is fed the tokens at ``L - 2`` and ``L - 1``. For ``L = 1`` both inputs are the
  token at position 0 (the slot is written twice with the same token). ``history``: each
  row's :class:`~specdec_jax.History` (:func:`draft_sampler`).

  Returns:
    ``(draft (B, gamma) int32, q (B, gamma, V), cache)``.
  """
  batch = tokens.shape[0]
  rows = batch_rows(batch)
  last = lengths - 1
  positions = jnp.stack([jnp.maximum(last - 1, 0), last], axis=1)
  positions = jnp.clip(positions, 0, cache_len - 1)
  sync = tokens[rows[:, None], positions]
  logits, cache = draft.apply(draft_params, model_ids(sync, draft.vocab_size), positions, cache)
  sample = draft_sampler(step_keys, params, draft.vocab_size, history=history)
  first, first_q = sample(0, logits[:, -1])

  def step(j, proposed, carry):
    cache = carry
    token = proposed[:, j - 1]
    position = jnp.minimum(last + j, cache_len - 1)
    logits, cache = draft.apply(draft_params, token[:, None], position[:, None], cache)
    token, q = sample(j, logits[:, 0], proposed)
    return token, q, cache

  return run_ahead(step, first, first_q, cache, gamma=gamma,
                   steps=gamma if steps is None else steps)


def propose_features(draft: FeatureFns, draft_params, state, tokens, lengths, step_keys, params,
                     *, gamma: int, cache_len: int, vocab: int, steps=None, history=None):
  """Up to ``gamma`` proposals from a :class:`FeatureDraft`: a sync call, then single steps.

  ``state = (cache, features (B, gamma + 1, D), start (B,))``: the target's features at
  positions ``start - 1 .. start + gamma - 1`` from its last call. The sync call
  (:func:`feature_sync`) feeds the tokens emitted since, at ``start .. L - 1``, with those
  features; its output at ``L - 1`` gives the first proposal, and each further step feeds the
  last proposal with the draft's own predicted feature. ``history``: as in
  :func:`propose_model`.

  Returns:
    ``(draft (B, gamma) int32, q (B, gamma, V), cache)``.
  """
  cache, features, start = state
  params_d, vocab_ids = draft_params
  first_logits, first_feature, cache = feature_sync(draft, params_d, cache, features, start,
                                                    tokens, lengths, cache_len=cache_len,
                                                    vocab=vocab)
  sample = draft_sampler(step_keys, params, vocab, vocab_ids, history)
  first, first_q = sample(0, first_logits)
  last = lengths - 1

  def step(j, proposed, carry):
    cache, feature = carry
    token = proposed[:, j - 1]
    position = jnp.minimum(last + j, cache_len - 1)[:, None]
    logits, feature, cache = draft.apply(params_d, token[:, None], feature, position, cache)
    token, q = sample(j, logits[:, 0], proposed)
    return token, q, (cache, feature)

  tokens_out, q, (cache, _) = run_ahead(step, first, first_q, (cache, first_feature[:, None]),
                                        gamma=gamma, steps=gamma if steps is None else steps)
  return tokens_out, q, cache


def propose_features_when(draft: FeatureFns, draft_params, state, tokens, lengths, step_keys,
                          params, *, gamma: int, cache_len: int, vocab: int, steps, propose,
                          history=None):
  """:func:`propose_features` when ``propose`` (traced bool: some row proposes), else no draft
  work unless the feature window is full (adaptive speculation's iterations without proposals).

  Without proposals the sync call is put off: the target's features of the tokens it emits are
  appended to the window (:func:`next_features`), and the draft reads them all in one call at
  the next iteration that proposes, or once the window's ``gamma + 1`` slots are full. So a
  row that stopped proposing costs plain decoding's step plus one draft call every ``gamma + 1``
  iterations, not a sync call and a sample every iteration (measured on SmolLM2 with another
  process on the cores, a never-proposing EAGLE loop: 0.81-0.86x of plain decoding before).

  Returns:
    ``(draft (B, gamma) int32, q (B, gamma, V), cache, synced)``: zeros when not ``propose``;
    ``synced`` (bool ``()``) whether the draft read the window (then the next window starts at
    ``lengths``).
  """
  cache, features, start = state
  full = jnp.max(lengths - start) >= features.shape[1]
  batch = tokens.shape[0]

  def nothing(cache):
    return (jnp.zeros((batch, gamma), jnp.int32), jnp.zeros((batch, gamma, vocab), jnp.float32),
            cache, None)

  def sync(cache):
    return (*nothing(cache)[:2], feature_sync(draft, draft_params[0], cache, features, start,
                                              tokens, lengths, cache_len=cache_len,
                                              vocab=vocab)[2], None)

  def draft_all(cache):
    out = propose_features(draft, draft_params, (cache, features, start), tokens, lengths,
                           step_keys, params, gamma=gamma, cache_len=cache_len, vocab=vocab,
                           steps=steps, history=history)
    return (*out[:2], out[2], None)

  index = jnp.where(propose, 2, jnp.where(full, 1, 0))
  (draft_tokens, q), cache, _ = run_one(
    index, [lambda c, f=f: (lambda r: ((r[0], r[1]), r[2], r[3]))(f(c))
            for f in (nothing, sync, draft_all)], cache)
  return draft_tokens, q, cache, index > 0


def next_features(state, target_features, lengths, synced):
  """``(features (B, W, D), start (B,))`` of the next sync: the target's features of its last
  call where the draft read the window this iteration (``synced``), else the old window with
  the feature of the one token each row emitted appended (an iteration without proposals
  scores one token)."""
  _, features, start = state
  rows = batch_rows(features.shape[0])
  slot = jnp.clip(lengths - start, 0, features.shape[1] - 1)
  appended = features.at[rows, slot].set(target_features[:, 0].astype(features.dtype))
  return (jnp.where(synced, target_features.astype(features.dtype), appended),
          jnp.where(synced, lengths, start))


def feature_sync(draft: FeatureFns, params_d, cache, features, start, tokens, lengths, *,
                 cache_len: int, vocab: int):
  """A feature draft's sync call: it reads the tokens the target emitted since its last call.

  ``features (B, W, D)`` are the target's at positions ``start - 1 .. start + W - 2`` from that
  call, which emitted ``lengths - start`` tokens per row (at most ``W``). The call feeds the
  tokens at ``start .. start + w - 1`` with those features, ``w`` the batch's largest
  ``lengths - start``: one compiled branch per ``w`` (:func:`~specdec_jax.decoding.common.run_one`),
  so after an iteration that proposed nothing (adaptive speculation) or rejected early the
  call reads one or two tokens, not ``W``: the head over the draft vocabulary is most of a
  small draft's cost. Slots past ``L - 1`` are not written here; the draft's own steps write
  them before they read them.

  Returns:
    ``(logits (B, K), feature (B, D), cache)``: the draft's output at position ``L - 1``
    (its first proposal's logits, and the feature it predicts there).
  """
  rows = batch_rows(tokens.shape[0])
  window = features.shape[1]
  positions = jnp.clip(start[:, None] + jnp.arange(window, dtype=jnp.int32)[None], 0,
                       cache_len - 1)
  inputs = model_ids(tokens[rows[:, None], jnp.clip(positions, 0, tokens.shape[1] - 1)], vocab)
  at = jnp.clip(lengths - 1 - start, 0, window - 1)  # L - 1's index in the window

  def call(width: int):
    def run(cache):
      logits, predicted, cache = draft.apply(params_d, inputs[:, :width], features[:, :width],
                                             positions[:, :width], cache)
      pick = jnp.minimum(at, width - 1)
      return logits[rows, pick], cache, predicted[rows, pick]
    return run

  logits, cache, feature = run_one(jnp.max(at), [call(w) for w in range(1, window + 1)], cache)
  return logits, feature, cache


def feature_prefill(draft: FeatureFns, draft_params, prompt, prompt_lengths, target_features, *,
                     gamma: int, cache_len: int, vocab: int):
  """The feature draft's state after the prompt: ``(cache, features (B, gamma + 1, D), start)``.

  The draft reads positions ``0 .. P - 1`` with the target's features shifted by one (zeros
  before position 0); the next sync starts at each row's prompt length, where the feature is
  the target's at the last prompt position.
  """
  params_d, _ = draft_params
  batch, width = prompt.shape
  cache = draft.init_cache(batch, cache_len)
  positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[None], (batch, width))
  shifted = jnp.pad(target_features, ((0, 0), (1, 0), (0, 0)))[:, :width]
  logits, _, cache = draft.apply(params_d, model_ids(prompt, vocab), shifted, positions, cache)
  if tuple(logits.shape) != (batch, width, draft.draft_vocab):
    raise ValueError(
      f"{draft.label} returned logits of shape {tuple(logits.shape)} for ids of shape "
      f"{(batch, width)}; expected (B, T, K) = {(batch, width, draft.draft_vocab)}, one column "
      f"per entry of its `vocab_ids` (K = {draft.draft_vocab})."
    )
  last = target_features[batch_rows(batch), prompt_lengths - 1]
  features = jnp.zeros((batch, gamma + 1, *last.shape[1:]), last.dtype).at[:, 0].set(last)
  return cache, features, prompt_lengths


def lookup_row(row: jax.Array, length: jax.Array, spec: PromptLookup, gamma: int):
  """Prompt-lookup proposals for one row ``(max_len,)`` of length ``length``: ``(gamma,)``, and
  whether an n-gram matched (bool ``()``).

  For the longest ``n`` with a match, the most recent start ``s`` with
  ``row[s : s + n] == row[L - n : L]`` and ``s + n <= L - 1`` gives the period
  ``d = L - n - s``; the proposals are ``row[L - d + (j mod d)]``, i.e. the tokens that
  followed the match, repeated with the period if fewer than ``gamma`` follow. No
  match: ``d = 1``, the last token repeated. All comparisons are vectorised over the row.
  """
  size = row.shape[0]
  starts = jnp.arange(size, dtype=jnp.int32)
  period = jnp.int32(1)
  found = jnp.asarray(False)
  for n in range(spec.max_ngram, spec.min_ngram - 1, -1):
    match = (starts + n <= length - 1) & (length - n >= 0)
    for k in range(n):
      suffix = row[jnp.clip(length - n + k, 0, size - 1)]
      match = match & (row[jnp.clip(starts + k, 0, size - 1)] == suffix)
    start = jnp.max(jnp.where(match, starts, -1))
    take = ~found & (start >= 0)
    period = jnp.where(take, length - n - start, period)
    found = found | take
  j = jnp.arange(gamma, dtype=jnp.int32)
  return row[jnp.clip(length - period + j % period, 0, size - 1)], found


def propose_lookup(spec: PromptLookup, tokens, lengths, *, gamma: int, vocab: int):
  """Prompt-lookup proposals with point-mass ``q``: ``(draft (B, gamma), q (B, gamma, V),
  found (B,))``, ``found`` telling the rows where an n-gram matched."""
  draft, found = jax.vmap(lookup_row, in_axes=(0, 0, None, None))(tokens, lengths, spec, gamma)
  draft = model_ids(draft, vocab)
  return draft, jax.nn.one_hot(draft, vocab, dtype=jnp.float32), found
