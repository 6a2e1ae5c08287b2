"""Exact speculative decoding with a draft tree (:func:`tree_speculative_generate`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax._core.checks import check_pad_id
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.adjust import tree_prefixes
from specdec_jax._logits.process import SamplingParams
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax.decoding.args import auto_axes
from specdec_jax.decoding.args import batch_params
from specdec_jax.decoding.args import check_budget
from specdec_jax.decoding.args import check_eos
from specdec_jax.decoding.args import check_grammar
from specdec_jax.decoding.args import check_prompt
from specdec_jax.decoding.args import check_same_vocab
from specdec_jax.decoding.args import row_keys as make_row_keys
from specdec_jax.decoding.common import after_verify
from specdec_jax.decoding.common import make_common
from specdec_jax.decoding.common import prefill
from specdec_jax.decoding.common import prefill_and_start
from specdec_jax.decoding.common import speculative_result
from specdec_jax.decoding.common import uniform
from specdec_jax.decoding.data_parallel import run_loop
from specdec_jax.decoding.draft_tree import DraftTree
from specdec_jax.decoding.draft_tree import TreeFns
from specdec_jax.decoding.draft_tree import node_bitmask
from specdec_jax.decoding.draft_tree import tree_candidates
from specdec_jax.decoding.draft_tree import tree_model_fns
from specdec_jax.decoding.drafts import FeatureFns
from specdec_jax.decoding.drafts import feature_fns
from specdec_jax.decoding.drafts import feature_prefill
from specdec_jax.decoding.drafts import feature_sync
from specdec_jax.decoding.dynamic_tree import DynamicTree
from specdec_jax.decoding.dynamic_tree import draft_dynamic_tree
from specdec_jax.decoding.request_rows import batch_rows
from specdec_jax.decoding.request_rows import loop_history
from specdec_jax.decoding.request_rows import model_ids
from specdec_jax.decoding.request_rows import split_history
from specdec_jax.decoding.tree_verifier import check_tree_args
from specdec_jax.decoding.tree_verifier import default_tree_verifier
from specdec_jax.decoding.tree_verifier import verify_tree
from specdec_jax.decoding.types import SpecState
from specdec_jax.decoding.types import SpeculativeResult
from specdec_jax.models.protocol import FeatureDraft
from specdec_jax.models.protocol import Model
from specdec_jax.structured.tables import Grammar


@functools.partial(
  jax.jit,
  static_argnames=("target", "draft", "tree", "law", "tree_verifier", "max_new_tokens",
                   "max_len", "context", "pad_id", "logprobs", "logprobs_mode", "structured"),
)
def tree_loop(target_params, draft_params, prompt, prompt_lengths, tokens_ok, row_keys, params,
              eos_id, grammar=None, grammar_start=None, *, target: TreeFns,
              draft: TreeFns | FeatureFns, tree: DraftTree | DynamicTree, law: str,
              tree_verifier, max_new_tokens: int, max_len: int, context: int | None,
              pad_id: int, logprobs: int | None = None, logprobs_mode: str = "processed",
              structured: bool = False):
  del structured  # static: whether `grammar` is given (the data-parallel result's specs)
  batch = prompt.shape[0]
  rows = batch_rows(batch)
  vocab = target.vocab_size
  size, depth = tree.size, tree.depth
  dynamic = isinstance(tree, DynamicTree)  # one tree per row and iteration (EAGLE-2)
  if dynamic:
    slots_used = max(size, tree.num_fed)  # the target's tree slots, the draft's
  else:
    slots_used = size
    parents = np.asarray(tree.parents, np.int32)
    ranks = np.asarray(tree.ranks, np.int32)
    depths = tree.depths()
    mask = jnp.asarray(tree.ancestors())
    width = max(1, int(ranks.max()) + 1)  # candidates drafted per node
    levels = [np.flatnonzero(depths == d).astype(np.int32) for d in range(depth + 1)]
    # Nodes of depth <= d are a prefix (breadth-first order): num_nodes for a depth budget d.
    level_end = jnp.asarray([int((depths <= d).sum()) for d in range(depth + 1)], jnp.int32)
    paths = tree.paths()  # (N, depth): each node's path, for the rows' draft prefixes
  need_q = law != "deterministic" or tree_verifier is not default_tree_verifier(law, depth)
  is_feature = isinstance(draft, FeatureFns)
  cache_len = max_len + slots_used - 1  # tree slots reach root + N - 1 <= max_len + N - 2
  common, error = make_common(row_keys, prompt, prompt_lengths, tokens_ok, params, eos_id,
                          max_new_tokens=max_new_tokens, max_len=max_len, context=context,
                          vocab=vocab, grammar=grammar, grammar_start=grammar_start)
  prompt_lengths = common.prompt_lengths  # clipped to [1, P] (BAD_LENGTH rows)
  params = common.params  # in range (out-of-range values are flagged)
  # static: some parameter adjusts the logits, or a grammar masks them
  edits = needs_edits(params, None) or grammar is not None
  stop_len = common.stop_len
  start = prefill_and_start(target, target_params, prompt, common, max_len, cache_len, pad_id,
                            features=is_feature, history_size=max_new_tokens,
                            logprobs=logprobs, mode=logprobs_mode)
  tokens, lengths, done, target_cache, first_error, buffers = start[:6]
  if is_feature:  # (cache, target features at positions start - 1 .. start + depth - 1, start)
    draft_cache = feature_prefill(draft, draft_params, prompt, prompt_lengths, start[7],
                                  gamma=depth, cache_len=cache_len, vocab=vocab)
    vocab_ids = draft_params[1]
  else:
    _, draft_cache = prefill(draft, draft_params, prompt, prompt_lengths, cache_len)
    vocab_ids = None
  zero = jnp.int32(0)
  counts = jnp.zeros((batch,), jnp.int32)
  at = jnp.zeros((batch, depth), jnp.int32)
  state = SpecState(tokens, lengths, done, target_cache, draft_cache, zero + 1, zero + 1,
                     (prompt_lengths < stop_len).astype(jnp.int32), counts, counts, at, at,
                     error | first_error, logprobs=buffers, grammar=start[6],
                     forced=None if grammar is None else jnp.zeros((batch, 2), jnp.int32))
  slots = jnp.arange(depth, dtype=jnp.int32)
  all_nodes = jnp.arange(size, dtype=jnp.int32)
  # tree_candidates over (B, nodes): params and history per row, prefixes per node.
  candidates = jax.vmap(
    jax.vmap(tree_candidates, in_axes=(0, 0, None, None, None, None, None, None, 0, 0, 0)),
    in_axes=(0, 0, 0, None, None, None, None, 0, 0, 0, 0))

  def node_candidates(logits, keys, history, prefix, prefix_len):
    """:func:`tree_candidates` of ``(B, n)`` nodes (masked by each node's grammar state)."""
    return candidates(logits, keys, params, width, law, vocab_ids, vocab,
                      split_history(history)[0], prefix, prefix_len,
                      node_bitmask(history, prefix, prefix_len))

  def node_prefix(node_tokens, nodes):
    """``(prefix (B, n, depth), length (B, n))``: the path tokens of static tree ``nodes``
    (their tokens set), root excluded; None, None when nothing reads them."""
    if not edits:
      return None, None
    table = paths[nodes]
    prefix = jnp.where((table >= 0)[None], node_tokens[:, np.maximum(table, 0)], -1)
    return prefix, jnp.broadcast_to(jnp.asarray(depths[nodes], jnp.int32),
                                    (batch, len(nodes)))

  def model_draft(s: SpecState, root):
    """The draft model's first call (the tokens at ``L - 2, L - 1``) and its per-level call."""
    sync = jnp.clip(jnp.stack([jnp.maximum(root - 1, 0), root], axis=1), 0, cache_len - 1)
    logits, cache = draft.apply(draft_params, model_ids(s.tokens[rows[:, None], sync], vocab),
                                sync, s.draft_cache)

    def level_call(d, level, node_tokens, cache):
      positions = jnp.broadcast_to((root + d)[:, None], (batch, len(level)))
      return draft.tree_apply(draft_params, node_tokens[:, level],
                              jnp.clip(positions, 0, cache_len - 1), cache, root,
                              jnp.asarray(level), mask[level])

    return logits[:, -1:], cache, level_call

  def feature_draft(s: SpecState, root):
    """The feature draft's sync on the target's last features, then per level each node reads
    the feature its parent predicted (EAGLE-2's tree drafting)."""
    cache, features, begin = s.draft_cache
    params_d = draft_params[0]
    root_logits, first_feature, cache = feature_sync(draft, params_d, cache, features, begin,
                                                     s.tokens, root + 1, cache_len=cache_len,
                                                     vocab=vocab)
    node_features = jnp.zeros((batch, size, first_feature.shape[-1]), first_feature.dtype)
    node_features = node_features.at[:, 0].set(first_feature)

    def level_call(d, level, node_tokens, carry):
      cache, node_features = carry
      positions = jnp.broadcast_to((root + d)[:, None], (batch, len(level)))
      logits, g, cache = draft.tree_apply(
        params_d, node_tokens[:, level], node_features[:, parents[level]],
        jnp.clip(positions, 0, cache_len - 1), cache, root, jnp.asarray(level), mask[level])
      return logits, (cache, node_features.at[:, level].set(g))

    return root_logits[:, None], (cache, node_features), level_call

  def static_draft(root_logits, carry, level_call, s: SpecState, root, step_keys, history):
    """Draft the static tree level by level: a first call gives the root's candidates, then
    one tree-attention call per level gives the candidates after each of its nodes (each
    node's row after the row's ``history`` and its path)."""
    node_keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 1), size))(step_keys)
    node_tokens = jnp.zeros((batch, size), jnp.int32).at[:, 0].set(s.tokens[rows, root])
    # The point-mass rule never reads q: then no draft distribution is materialised.
    q = jnp.zeros((batch, size, vocab), jnp.float32) if need_q else None
    ids, q_root = node_candidates(root_logits, node_keys[:, :1], history,
                                  *node_prefix(node_tokens, np.zeros(1, np.int32)))
    cands = jnp.zeros((batch, size, width), jnp.int32).at[:, :1].set(ids)
    q = q.at[:, :1].set(q_root) if need_q else None
    for d in range(1, depth + 1):
      level = levels[d]
      node_tokens = node_tokens.at[:, level].set(cands[:, parents[level], ranks[level]])
      if d < depth:  # the deepest level's candidates are never needed
        logits, carry = level_call(d, level, node_tokens, carry)
        ids, q_level = node_candidates(logits, node_keys[:, level], history,
                                       *node_prefix(node_tokens, level))
        cands = cands.at[:, level].set(ids)
        q = q.at[:, level].set(q_level) if need_q else None
    return node_tokens, carry, q

  def cond(s: SpecState):
    return jnp.any(~s.done) & (s.target_calls <= max_new_tokens)

  def body(s: SpecState):
    active = ~s.done
    root = s.lengths - 1  # slot and position of node 0
    budget = jnp.where(active, jnp.clip(common.stop_len - s.lengths - 1, 0, depth), 0)
    step_keys = jax.vmap(jax.random.fold_in)(row_keys, s.row_calls)
    # Each row's prompt and output so far (None unless a parameter reads them).
    history = loop_history(common, s.tokens, s.lengths, max_new_tokens, s.grammar)
    root_logits, carry, level_call = (feature_draft if is_feature else model_draft)(s, root)
    if dynamic:
      # EAGLE-2: expand the most confident candidates, score the most confident num_draft.
      drafted, cache = draft_dynamic_tree(
        tree, lambda t, f, pos, c, nodes, m: draft.tree_apply(
          draft_params[0], t, f, jnp.clip(pos, 0, cache_len - 1), c, root, nodes, m),
        s.tokens[rows, root], root_logits[:, 0], carry[1][:, 0], carry[0], root,
        vocab_ids=vocab_ids, vocab=vocab, params=params, need_q=need_q, history=history)
      carry = (cache, carry[1])
      node_tokens, tree_parents, node_depths, tree_mask, q = drafted
      parents_axis = 0
      num_nodes = jnp.sum(node_depths <= budget[:, None], axis=1, dtype=jnp.int32)
      prefix, prefix_len = (jax.vmap(lambda a, t: tree_prefixes(a, t, depth))(
        tree_parents, node_tokens) if edits else (None, None))
    else:
      node_tokens, carry, q = static_draft(root_logits, carry, level_call, s, root, step_keys,
                                           history)
      tree_parents, parents_axis, tree_mask = jnp.asarray(parents), None, mask
      node_depths = jnp.broadcast_to(jnp.asarray(depths)[None], (batch, size))
      num_nodes = level_end[budget]
      prefix, prefix_len = node_prefix(node_tokens, np.arange(size))

    # One target call scores every node with tree attention.
    positions = jnp.clip(root[:, None] + node_depths, 0, cache_len - 1)
    if is_feature:
      logits, node_features, target_cache = target.tree_apply_features(
        target_params, model_ids(node_tokens, vocab), positions, s.target_cache, root, all_nodes,
        tree_mask)
    else:
      logits, target_cache = target.tree_apply(target_params, model_ids(node_tokens, vocab),
                                               positions, s.target_cache, root, all_nodes,
                                               tree_mask)
    uniforms = jax.vmap(lambda k: uniform(jax.random.fold_in(k, 0), (size,)))(step_keys)
    result = verify_tree(tree_verifier, logits, params, q, tree_parents, parents_axis,
                         node_tokens, uniforms, num_nodes, law=law, depth=depth, vocab=vocab,
                         history=history, prefix=prefix, prefix_len=prefix_len,
                         logprobs=logprobs, mode=logprobs_mode)

    accepted = jnp.where(active, result.num_accepted, 0)
    # Move the accepted path from its tree slots to the slots of its positions.
    dst = jnp.clip(root[:, None] + 1 + slots[None], 0, cache_len - 1)
    src = jnp.where(slots[None] < accepted[:, None], root[:, None] + result.path[:, :depth], dst)
    src = jnp.clip(src, 0, cache_len - 1)
    target_cache = target.copy_slots(target_cache, src, dst)
    if is_feature:
      # The next sync re-reads the accepted path (root + 1 ..) with the target's features of
      # the root and the path; it rewrites those slots, so the draft's cache needs no copy.
      path = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32),
                              jnp.clip(result.path[:, :depth], 0, size - 1)], axis=1)
      draft_cache = (carry[0], node_features[rows[:, None], path], root + 1)
    else:
      draft_cache = draft.copy_slots(carry, src, dst)
    return after_verify(s, result, common, active=active, target_cache=target_cache,
                         draft_cache=draft_cache, draft_calls=s.draft_calls + depth,
                         proposals=jnp.where(active, num_nodes - 1, 0), depth=budget,
                         stop_empty=edits)

  return speculative_result(lax.while_loop(cond, body, state), common)


def tree_speculative_generate(target: Model, draft: Model | FeatureDraft,
                              prompt_tokens: jax.Array, prompt_lengths: jax.Array,
                              key: jax.Array, *, tree: DraftTree | DynamicTree,
                              max_new_tokens: int, params: SamplingParams = SamplingParams(),
                              law: str = "deterministic", eos_id: int | None = None,
                              max_len: int | None = None, tree_verifier: Callable | None = None,
                              pad_id: int = -1, logprobs: int | None = None,
                              logprobs_mode: str = "processed", grammar: Grammar | None = None,
                              grammar_state=None) -> SpeculativeResult:
  """Exact speculative decoding with a draft *tree*, as one jitted ``lax.while_loop``.

  Each iteration, for every unfinished row of length ``L`` (its last token is the
  tree's root, node 0, at position ``L - 1``):

  1. the draft model builds the tree level by level: one ``apply`` on the tokens at
     ``L - 2, L - 1`` gives the candidates after the root, then one ``tree_apply`` per
     level (tree attention) gives the candidates after each node of that level; node
     ``c`` gets the ``tree.ranks[c]``-th candidate after its parent (``law``:
     ``"deterministic"`` = the draft's top-k tokens, EAGLE-2's top-k tree;
     ``"iid"`` = independent samples from the draft's processed distribution,
     SpecInfer). ``tree.depth`` draft calls per iteration. A
     :class:`~specdec_jax.decoding.FeatureDraft` (EAGLE-2) is first synced on the tokens
     the target scored last with the target's features, then each node reads the feature
     its parent predicted;
  2. the target scores all ``N`` nodes in ONE ``tree_apply`` call: node ``c`` at
     position ``L - 1 + depth(c)`` in slot ``L - 1 + c``, attending to the context
     and its own ancestors;
  3. :func:`~specdec_jax.tree_verify` (recursive rejection sampling with the matching
     law) keeps a path of the tree plus one token of its own; the row grows by that
     many (cut after ``eos_id``), and ``copy_slots`` moves the accepted path's keys and
     values from their tree slots to the slots of their positions in both caches. Only
     the nodes of depth ``<= max_new_tokens - emitted - 1`` are verified, so a row never
     overshoots its budget.

  The output is distributed exactly as :func:`generate`'s for any tree and draft;
  ``temperature == 0`` gives the greedy sequence token for token. The first token
  uses the key as :func:`generate` does; iteration ``i`` of a row uses
  ``fold_in(row_key, i)``: ``fold_in(., 0)`` for the ``N`` uniforms of the
  verification and ``split(fold_in(., 1), N)`` for the ``"iid"`` drafts of each node.

  Prompts split over a mesh axis run data-parallel: one loop per shard under ``shard_map``,
  nothing crossing that axis per step (:mod:`specdec_jax.decoding.data_parallel`).
  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    target: the target :class:`Model`, with ``tree_apply`` and ``copy_slots``.
    draft: the draft :class:`Model` (same vocabulary), with ``tree_apply`` and ``copy_slots``,
      or a :class:`~specdec_jax.decoding.FeatureDraft` with ``tree_apply`` (then the target
      needs ``apply_features`` and ``tree_apply_features``).
    prompt_tokens: int ``(B, P)`` right-padded prompts.
    prompt_lengths: int ``(B,)`` in ``[1, P]``.
    key: one ``jax.random`` key (split into one per row) or ``B`` keys, one per row.
    tree: static :class:`DraftTree` (its ``N`` nodes include the root), or a
      :class:`~specdec_jax.decoding.DynamicTree` (EAGLE-2: each row and iteration drafts its
      own tree of ``N = num_draft + 1`` nodes from the draft's confidences; needs a
      ``FeatureDraft``, ``law="deterministic"`` and a target whose ``tree_apply_features``
      takes a tree mask per row, ``(B, N, N)``, as the Llama and the toy models do).
    max_new_tokens: static int ``>= 1``.
    params: :class:`~specdec_jax.SamplingParams` for target and draft; each field one
      request's (a scalar, a list field's ``-1``-padded list) shared by the batch, or that with
      a leading ``B``. Parameters that read a request's history (the penalties,
      ``min_tokens``, bad words) read the row's buffer, and at node ``u`` the tokens of its path
      count as output too, for the draft's candidates after ``u`` and the target's row at
      ``u`` alike; with such parameters the ``"deterministic"`` candidates are the top of the
      draft's *adjusted* logits.
    law: static, ``"deterministic"`` (top-k tree) or ``"iid"`` (sampled tree).
    eos_id: optional token id that ends a row (kept in the output).
    max_len: static buffer length, ``>= P``; default ``P + max_new_tokens``. The
      caches have ``max_len + N - 1`` slots (a DynamicTree: ``max_len + max(N, num_fed) - 1``).
    tree_verifier: optional static function ``(p (N, V), q (N, V), parents (N,),
      tokens (N,), uniforms (N,), *, num_nodes) -> TreeVerifyResult`` for one tree, to use
      instead of :func:`~specdec_jax.tree_verify` with ``law`` (e.g. a negative control);
      ``q[c]`` is the draft's processed distribution after node ``c``. Compared by code and
      captured values, so a lambda written at the call site reuses the compiled loop.
    pad_id: static int written after each row's last token.
    logprobs: static None, or ``k`` in ``[0, min(64, V)]``: the result's ``logprobs`` (each
      generated token's, under the target row it was drawn from) and, for ``k > 0``,
      ``top_ids`` / ``top_logprobs``.
    logprobs_mode: static ``"processed"`` or ``"raw"`` (the raw logits' softmax).
    grammar, grammar_state: as in :func:`generate` (each node masked by its path's state).

  Returns:
    :class:`SpeculativeResult`; in its :class:`DecodeStats` the per-position counters
    have ``tree.depth`` columns (position ``i`` = depth ``i + 1``), ``proposals``
    counts tree nodes and ``draft_calls`` counts one per level.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from specdec_jax import DraftTree, SamplingParams, generate
    >>> from specdec_jax.models.toy import make_toy_model
    >>> target = make_toy_model(jax.random.key(0), vocab_size=8)
    >>> small = make_toy_model(jax.random.key(1), vocab_size=8, context=1)
    >>> prompt, lengths = jnp.array([[1, 2, 3], [4, 0, 0]]), jnp.array([3, 1])
    >>> greedy = SamplingParams(temperature=0.0)
    >>> plain = generate(target, prompt, lengths, jax.random.key(2), max_new_tokens=6,
    ...                  params=greedy)
    >>> out = tree_speculative_generate(target, small, prompt, lengths, jax.random.key(2),
    ...                                 tree=DraftTree.from_branching((3, 2)), max_new_tokens=6,
    ...                                 params=greedy)
    >>> bool((out.tokens == plain.tokens).all()), out.num_new.tolist()
    (True, [6, 6])

  Reference:
    Miao et al., "SpecInfer: Accelerating Large Language Model Serving with Tree-based
    Speculative Inference and Verification", arXiv:2305.09781; Li et al., "EAGLE-2: Faster
    Inference of Language Models with Dynamic Draft Trees", arXiv:2406.16858; Cai et al.,
    "Medusa", arXiv:2401.10774 (static trees given as rank paths).
  """
  name = "tree_speculative_generate"
  target_fns = tree_model_fns(target, name, "target")
  if isinstance(draft, FeatureDraft):
    draft_fns, draft_params = feature_fns(draft, target, name, tree=True)
  else:
    draft_fns, draft_params = tree_model_fns(draft, name, "draft"), draft.params
    check_same_vocab(draft_fns.vocab_size, target_fns.vocab_size, name)
  tree, tree_verifier = check_tree_args(tree, draft, draft_fns, law, tree_verifier, name)
  vocab = target_fns.vocab_size
  prompt, lengths, tokens_ok = check_prompt(prompt_tokens, prompt_lengths, name, vocab)
  batch, width = prompt.shape
  contexts = (("target", target.context_length),
              ("draft", getattr(draft, "context_length", None)))
  max_len, context = check_budget(max_new_tokens, max_len, width, lengths, name, contexts)
  grammar, grammar_state = check_grammar(grammar, grammar_state, name, batch, vocab)
  args = auto_axes((target.params, draft_params, prompt, lengths, tokens_ok,
                    make_row_keys(key, batch, name), batch_params(params, batch, name, vocab=vocab),
                    check_eos(eos_id, name, vocab), grammar, grammar_state))
  static = dict(target=target_fns, draft=draft_fns, tree=tree, law=law,
                tree_verifier=tree_verifier, max_new_tokens=int(max_new_tokens), max_len=max_len,
                context=context, pad_id=check_pad_id(name, pad_id),
                logprobs=check_logprobs(name, logprobs, logprobs_mode, vocab),
                logprobs_mode=logprobs_mode, structured=grammar is not None)
  batch_args = (False, False, True, True, True, True, True, False, False, True)
  return run_loop(tree_loop, SpeculativeResult, args, batch_args, static, prompt_index=2)
