"""Tree verification in the encoding EAGLE-style engines use (sgl-project/sglang-jax).

sglang-jax keeps one draft tree of ``N`` nodes per request: ``candidates (B, N)`` (node 0 is
the root, the last verified token), ``retrive_next_token (B, N)`` (each node's first child)
and ``retrive_next_sibling (B, N)`` (its next sibling), ``-1`` for none, siblings in increasing
node order; the target rows ``(B * N, V)`` (row ``b * N + u``: the law of node ``u``'s
children); one coin per node ``(B, N)``. :func:`packed_tree_verify` takes those arrays as they
are: the encoding is converted to parent indices inside the jitted call, each tree reads its
rows in place (row offset ``b * N``), and the coins are read in sglang's layout
(``uniform_layout="per_parent"`` of :func:`~specdec_jax.tree_verify`: one coin per parent,
rescaled after each rejection), so its target-only rule's accept decisions are reproduced
coin for coin.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import INT
from specdec_jax._core.checks import KEY
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
from specdec_jax._core.links import malformed_links as malformed_links
from specdec_jax._core.links import parents_from_links as parents_from_links
from specdec_jax._core.results import PackedTreeVerifyResult as PackedTreeVerifyResult
from specdec_jax._layouts.engine import all_greedy
from specdec_jax._layouts.engine import check_convention
from specdec_jax._layouts.engine import engine_params
from specdec_jax._layouts.mesh import check_divisible
from specdec_jax._layouts.mesh import check_word_aligned
from specdec_jax._layouts.mesh import over_vocab
from specdec_jax._logits.adjust import History
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.adjust import tree_prefixes
from specdec_jax._logits.lazy import request_rows
from specdec_jax._logits.params import check_bitmask
from specdec_jax._logits.params import check_history
from specdec_jax._logits.params import history_error
from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import check_params
from specdec_jax._logits.process import params_error
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax._rows.logprobs import finish_emitted
from specdec_jax._rows.logprobs import path_rows
from specdec_jax._rows.logprobs import result_specs
from specdec_jax._rows.sources import masked_rows
from specdec_jax._rules.registry import LAWS
from specdec_jax._rules.registry import TREE_RULE
from specdec_jax._rules.registry import UNIFORM_LAYOUTS

TREE_PACKED_ARRAYS = {"candidates": INT, "retrive_next_token": INT,
                      "retrive_next_sibling": INT, "target_probs": FLOAT, "target_logits": FLOAT,
                      "draft_probs": FLOAT, "draft_logits": FLOAT, "uniforms": FLOAT,
                      "coins": FLOAT, "key": KEY, "final_coins": FLOAT}


def packed_tree_verify(candidates: ArrayLike, retrive_next_token: ArrayLike,
                       retrive_next_sibling: ArrayLike, *, max_depth: int,
                       target_probs: ArrayLike | None = None,
                       target_logits: ArrayLike | None = None,
                       draft_probs: ArrayLike | None = None,
                       draft_logits: ArrayLike | None = None,
                       params: SamplingParams | None = None, law: str = "deterministic",
                       key: ArrayLike | None = None, uniforms: ArrayLike | None = None,
                       coins: ArrayLike | None = None, uniform_layout: str = "per_parent",
                       convention: str = "specdec", pad_id: int = -1,
                       final_coins: ArrayLike | None = None, history: History | None = None,
                       target_bitmask: ArrayLike | None = None,
                       draft_bitmask: ArrayLike | None = None, logprobs: int | None = None,
                       logprobs_mode: str = "processed") -> PackedTreeVerifyResult:
  """Exact tree verification of ``B`` draft trees in sglang-jax's encoding (jitted).

  Each tree is verified by :func:`~specdec_jax.tree_verify` (recursive rejection sampling)
  with ``parents`` derived from the links, ``tokens = candidates[b]`` and the rows
  ``target[b * N : (b + 1) * N]`` read in place. With ``law="deterministic"`` (EAGLE-2
  top-k drafts, sglang's target-only verification) no draft probabilities are needed:
  greedy and sampled requests go through the same call (from logits, greedy rows are point
  masses on the argmax). ``"iid"`` / ``"without_replacement"`` read ``draft_probs``.

  Defaults differ from :func:`~specdec_jax.tree_verify` (``law="iid"``, ``"sequential"``) on
  purpose: this layout is sglang-jax's, whose drafts are EAGLE-2 top-k trees (deterministic,
  no draft probabilities) and whose coins are one per parent; the defaults reproduce its
  decisions coin for coin.

  Multi-host: see the docs, "Sharding and many hosts". Vocabulary-sharded rows:
  :func:`~specdec_jax.vocab_parallel_packed_tree_verify` (the same call over a mesh).

  Args:
    candidates: ``(B, N)`` int token ids, node 0 the root (ignored).
    retrive_next_token: ``(B, N)`` int first child of each node, ``-1`` for none.
    retrive_next_sibling: ``(B, N)`` int next sibling, ``-1`` for none; a child's index must
      exceed its parent's and each sibling link must point to a later node (siblings are
      tested in link order, which is then index order). A tree whose links break this (a
      backward link, a cycle, a node reached twice, a link outside ``[-1, N)``, a node no link
      reaches) is flagged ``BAD_PARAMS`` (:func:`malformed_links`).
    max_depth: static int ``>= 0``, accepted tokens at most (sglang's ``num_spec_steps - 1``
      draft levels); the output has ``max_depth + 1`` columns.
    target_probs: ``(B * N, V)`` processed target rows, row ``b * N + u`` for node ``u``, or
    target_logits: the same as logits, processed with ``params``.
    draft_probs: ``(B * N, V)`` draft laws for ``"iid"`` / ``"without_replacement"``, or
    draft_logits: the same as logits, processed with ``params`` (as the target's).
    params: :class:`SamplingParams` with scalar or ``(B,)`` fields (``target_logits`` only).
    law: static, one of ``"deterministic"`` (default), ``"iid"``, ``"without_replacement"``.
    uniforms: ``(B, N)`` uniforms ("coins"), read as ``uniform_layout`` says, or
    key: one ``jax.random`` key (``uniforms = uniform(key, (B, N))``) or ``B`` keys, one per
      request (``uniform(key_i, (N,))``: results independent of the batch). Neither a key
      nor uniforms when every request is greedy (``params`` temperatures known on the host
      and greedy under ``convention``, as in :func:`~specdec_jax.packed_verify`; sglang's
      ``verify_tree_greedy``): greedy verification reads no coins.
    coins: the old name of ``uniforms`` (sglang's word), accepted as an alias.
    final_coins: optional ``(B,)`` uniforms, one per request, for the final token (sglang's
      ``uniform_samples_for_final_sampling``) in place of the layout's coin, under every
      ``uniform_layout``; with ``uniforms`` only.
    uniform_layout: static, ``"per_parent"`` (sglang, default), ``"per_node"`` or
      ``"sequential"`` (see :func:`~specdec_jax.tree_verify`).
    convention: static, how ``params`` writes greedy / disabled (:func:`engine_params`;
      ``"sglang"``: ``min_p`` after top-k and top-p, sglang-jax's order).
    history: optional :class:`~specdec_jax.History` with fields ``(B, n)``: node ``u``'s rows
      count the tokens of the path to ``u`` as output too (penalties, ``min_tokens``, bad
      words).
    target_bitmask, draft_bitmask: optional grammar words ``(B * N, ceil(V / 32))``, row
      ``b * N + u`` the mask after the path to node ``u``.
    logprobs, logprobs_mode: static, as in :func:`~specdec_jax.packed_verify` (each emitted
      token's row is its parent node's).
    pad_id: static int for unused token slots.

  Returns:
    :class:`PackedTreeVerifyResult`.

  Raises:
    ValueError / TypeError: on shapes, dtypes (of every array argument, NumPy or JAX),
      static arguments, and a missing key and uniforms in a batch that is not all greedy.
      Under an outer ``jit`` values are flagged, not raised (``BAD_PARAMS`` for malformed
      links, and the value codes of :func:`~specdec_jax.tree_verify`).

  Example:
    >>> import jax.numpy as jnp
    >>> p = jnp.array([[0.1, 0.6, 0.3], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    >>> r = packed_tree_verify(jnp.array([[0, 2, 1]]), jnp.array([[1, -1, -1]]),
    ...                        jnp.array([[-1, 2, -1]]), max_depth=1, target_probs=p,
    ...                        uniforms=jnp.array([[0.5, 0.0, 0.9]]))
    >>> # Root coin 0.5: child 1 (token 2, p = 0.3) rejected, the coin rescaled to 0.2/0.7 <
    >>> # r(1) = 0.6/0.7 accepts child 2 (token 1); node 2 is a leaf: bonus from its row.
    >>> r.tokens.tolist(), r.accept_index.tolist()
    ([[1, 2]], [[0, 2]])

  Reference:
    Miao et al., "SpecInfer", arXiv:2305.09781; Li et al., "EAGLE-2", arXiv:2406.16858;
    sgl-project/sglang-jax ``speculative/eagle_util.py`` (the encoding and the coins).
  """
  return packed_tree_call("packed_tree_verify", None, None, candidates, retrive_next_token,
                          retrive_next_sibling, max_depth=max_depth, target_probs=target_probs,
                          target_logits=target_logits, draft_probs=draft_probs,
                          draft_logits=draft_logits, params=params, law=law, key=key,
                          uniforms=uniforms, coins=coins, uniform_layout=uniform_layout,
                          convention=convention, pad_id=pad_id, final_coins=final_coins,
                          history=history, target_bitmask=target_bitmask,
                          draft_bitmask=draft_bitmask, logprobs=logprobs,
                          logprobs_mode=logprobs_mode)


def packed_tree_call(name, mesh, vocab_axis, candidates, retrive_next_token,
                     retrive_next_sibling, *, max_depth, target_probs, target_logits,
                     draft_probs, draft_logits, params, law, key, uniforms, coins,
                     uniform_layout, convention, pad_id, final_coins=None, history=None,
                     target_bitmask=None, draft_bitmask=None, logprobs=None,
                     logprobs_mode="processed", lower=False) -> PackedTreeVerifyResult:
  """Host-side checks and conversion, then the jitted packed-tree body (over ``mesh``)."""
  if coins is not None and uniforms is not None:
    raise ValueError(f"{name}: `coins` is another name of `uniforms`; pass one of them.")
  coins_name = "uniforms" if coins is None else "coins"  # the name the caller used
  uniforms = coins if uniforms is None else uniforms
  args = dict(candidates=candidates, retrive_next_token=retrive_next_token,
              retrive_next_sibling=retrive_next_sibling, target_probs=target_probs,
              target_logits=target_logits, draft_probs=draft_probs, draft_logits=draft_logits,
              uniforms=uniforms, key=key, final_coins=final_coins)
  args = {k: host_array(name, coins_name if k == "uniforms" else k, v, TREE_PACKED_ARRAYS[k])
          for k, v in args.items()}
  if final_coins is not None and uniforms is None:
    raise ValueError(f"{name}: `final_coins` go with `uniforms` (an engine's own coins); with "
                     "a `key` every coin is drawn from it.")
  max_depth = check_static_int(name, "max_depth", max_depth, 0)
  pad_id = check_pad_id(name, pad_id)
  check_convention(name, convention)
  if (args["target_probs"] is None) == (args["target_logits"] is None):
    raise ValueError(f"{name}: pass exactly one of `target_probs` and `target_logits`.")
  if args["draft_probs"] is not None and args["draft_logits"] is not None:
    raise ValueError(f"{name}: pass at most one of `draft_probs` and `draft_logits`.")
  if law not in LAWS:
    raise ValueError(f"{name}: `law` must be one of {LAWS}, got {law!r} instead.")
  if uniform_layout not in UNIFORM_LAYOUTS:
    raise ValueError(f"{name}: `uniform_layout` must be one of {UNIFORM_LAYOUTS}, got "
                     f"{uniform_layout!r} instead.")
  has_draft = args["draft_probs"] is not None or args["draft_logits"] is not None
  if (law == "deterministic") == has_draft:
    raise ValueError(f"{name}: draft rows (`draft_probs` or `draft_logits`) are read under law "
                     f"'iid' and 'without_replacement' and only there; got law={law!r} and "
                     f"{'draft rows' if has_draft else 'none'}.")
  if (params is not None or args["draft_logits"] is not None) and args["target_logits"] is None:
    raise ValueError(f"{name}: `params` and `draft_logits` go with logits; pass `target_logits`.")
  for arg in ("candidates", "retrive_next_token", "retrive_next_sibling"):
    check_array(name, arg, args[arg], 2, INT, batch_hint=False)
  shape = args["candidates"].shape
  for arg in ("retrive_next_token", "retrive_next_sibling"):
    if args[arg].shape != shape:
      raise ValueError(f"{name}: `{arg}` must have the shape of `candidates` {shape}, got "
                       f"{args[arg].shape} instead.")
  for arg, rank in (("target_probs", 2), ("target_logits", 2), ("draft_probs", 2),
                    ("draft_logits", 2), ("uniforms", 2), ("final_coins", 1)):
    if args[arg] is not None:  # ranks and dtypes of JAX values too, before anything reads them
      check_array(name, coins_name if arg == "uniforms" else arg, args[arg], rank, FLOAT,
                  batch_hint=False)
  if key is None and uniforms is None:
    if params is not None and all_greedy(params, convention):
      # Greedy verification reads no randomness: an all-greedy batch needs no key nor coins.
      args["uniforms"] = uniforms = np.zeros(shape, np.float32)
    else:
      raise ValueError(f"{name}: pass exactly one of `key` and `uniforms` (or `coins`), got "
                       "neither; only a batch whose requests are all greedy (host-known "
                       "`params` temperatures) needs no randomness.")
  one_source(name, key, uniforms)
  target = args["target_probs"] if args["target_logits"] is None else args["target_logits"]
  draft = args["draft_probs"] if args["draft_logits"] is None else args["draft_logits"]
  vocab = target.shape[-1]
  if params is not None:
    params = engine_params(host_top_k(params), convention)
    params = check_params(params, name, batch=shape[0], host_only=True, vocab=vocab)
  elif args["target_logits"] is not None:
    params = SamplingParams()
  if history is not None and args["target_logits"] is None:
    raise ValueError(f"{name}: `history` feeds the parameters that adjust logits: pass "
                     "`target_logits` (probabilities are already processed; a grammar "
                     "`target_bitmask` applies to them).")
  history = check_history(name, history, vocab, shape[0])
  target_bitmask = check_bitmask(name, "target_bitmask", target_bitmask, target.shape[0], vocab)
  draft_bitmask = check_bitmask(name, "draft_bitmask", draft_bitmask, target.shape[0], vocab)
  if mesh is not None and (target_bitmask is not None or draft_bitmask is not None
                           or (params is not None and needs_edits(params, None))):
    check_word_aligned(name, vocab, mesh.shape[vocab_axis], vocab_axis)
  args["key"], args["uniforms"] = uniforms_first(
    name, args["key"], args["uniforms"], shape[0], shape[1],
    [target.dtype] + ([] if draft is None else [draft.dtype]))
  run = packed_tree_jit.lower if lower else packed_tree_jit
  return run(**args, params=params, history=history, target_bitmask=target_bitmask,
             draft_bitmask=draft_bitmask, max_depth=max_depth, law=law,
             logprobs=check_logprobs(name, logprobs, logprobs_mode, vocab),
             logprobs_mode=logprobs_mode, min_p_last=convention == "sglang",
             uniform_layout=uniform_layout, pad_id=pad_id, name=name, mesh=mesh,
             vocab_axis=vocab_axis)


@functools.partial(jax.jit, static_argnames=("max_depth", "law", "uniform_layout", "pad_id",
                                             "name", "mesh", "vocab_axis", "logprobs",
                                             "logprobs_mode", "min_p_last"))
def packed_tree_jit(candidates, retrive_next_token, retrive_next_sibling, target_probs,
                    target_logits, draft_probs, draft_logits, uniforms, key, params,
                    final_coins=None, history=None, target_bitmask=None, draft_bitmask=None, *,
                    max_depth,
                    law, uniform_layout, pad_id, name="packed_tree_verify", mesh=None,
                    vocab_axis=None, logprobs=None, logprobs_mode="processed",
                    min_p_last=False):
  batch, size = candidates.shape
  target = target_probs if target_logits is None else target_logits
  draft = draft_probs if draft_logits is None else draft_logits
  target_name = "target_logits" if target_probs is None else "target_probs"
  check_array(name, target_name, target, 2, FLOAT, batch_hint=False)
  if target.shape[0] != batch * size:
    raise ValueError(f"{name}: the target rows must have shape (B * N, V) = ({batch * size}, V), "
                     f"got {tuple(target.shape)} instead.")
  if draft is not None and draft.shape != target.shape:
    draft_name = "draft_probs" if draft_logits is None else "draft_logits"
    raise ValueError(f"{name}: `{draft_name}` must have the shape of the target rows "
                     f"{tuple(target.shape)}, got {tuple(draft.shape)} instead.")
  if uniforms is None:
    dtypes = [target.dtype] + ([] if draft is None else [draft.dtype])
    uniforms = draw_uniforms(name, key, batch, size, compute_dtype(*dtypes))
  elif uniforms.shape != (batch, size):
    raise ValueError(f"{name}: `uniforms` must have shape (B, N) = ({batch}, {size}), got "
                     f"{tuple(uniforms.shape)} instead.")
  if final_coins is not None:
    check_array(name, "final_coins", final_coins, 1, FLOAT, batch_hint=False)
    if final_coins.shape != (batch,):
      raise ValueError(f"{name}: `final_coins` must have shape (B,) = ({batch},), got "
                       f"{tuple(final_coins.shape)} instead.")
    uniforms = jnp.concatenate([uniforms, final_coins.astype(uniforms.dtype)[:, None]], axis=1)
  named = dict(candidates=candidates, retrive_next_token=retrive_next_token,
               retrive_next_sibling=retrive_next_sibling, target=target, draft=draft,
               uniforms=uniforms, params=params, history=history,
               target_bitmask=target_bitmask, draft_bitmask=draft_bitmask)
  body = functools.partial(packed_tree_body, max_depth=max_depth, law=law,
                           uniform_layout=uniform_layout, pad_id=pad_id,
                           vocab=target.shape[1], draft_is_logits=draft_logits is not None,
                           final_coin=final_coins is not None, logprobs=logprobs,
                           logprobs_mode=logprobs_mode, min_p_last=min_p_last)
  if mesh is None:
    return body(named, axis_name=None)
  check_divisible(name, target_name, target.shape[1], mesh.shape[vocab_axis], vocab_axis)
  return over_vocab(body, mesh, vocab_axis, named,
                    rows=("target", "draft", "target_bitmask", "draft_bitmask"),
                    out_specs=PackedTreeVerifyResult(*(P(),) * 9, *result_specs(logprobs)))


def packed_tree_body(named, *, max_depth, law, uniform_layout, pad_id, vocab,
                     draft_is_logits=False, final_coin=False, logprobs=None,
                     logprobs_mode="processed", min_p_last=False,
                     axis_name=None) -> PackedTreeVerifyResult:
  """The traced body of :func:`packed_tree_verify` (``axis_name``: vocabulary-split rows)."""
  candidates, target, draft = named["candidates"], named["target"], named["draft"]
  batch, size = candidates.shape
  error = jnp.zeros((batch,), jnp.int32)
  params = named["params"]
  links = (named["retrive_next_token"], named["retrive_next_sibling"])
  parents = jax.vmap(parents_from_links)(*links)
  if params is None:  # probabilities: masked (and renormalised) where a bitmask is given
    target = masked_rows(target, named.get("target_bitmask"), axis_name)
    draft = None if draft is None else masked_rows(draft, named.get("draft_bitmask"), axis_name)
  if params is not None:  # node u's rows follow the path to u after the request's history
    owners = jnp.arange(batch * size, dtype=jnp.int32) // size
    history, masks = named.get("history"), (named.get("target_bitmask"),
                                            named.get("draft_bitmask"))
    prefix = prefix_len = None
    if needs_edits(params, masks[0]) or needs_edits(params, masks[1]):
      prefix, prefix_len = jax.vmap(tree_prefixes, in_axes=(0, 0, None))(
        parents, candidates, max(max_depth, 1))
      prefix, prefix_len = prefix.reshape(batch * size, -1), prefix_len.reshape(-1)
    rows = functools.partial(request_rows, owners=owners, axis_name=axis_name,
                             history=history, prefix=prefix, prefix_len=prefix_len,
                             min_p_last=min_p_last)
    target = rows(target, params, bitmask=masks[0], logprobs=logprobs or 0,
                  raw=logprobs is not None and logprobs_mode == "raw")
    if draft is not None and draft_is_logits:
      draft = rows(draft, params, bitmask=masks[1])
    elif draft is not None:
      draft = masked_rows(draft, masks[1], axis_name)
    error = error | jnp.broadcast_to(params_error(params, vocab), (batch,))
    if history is not None:
      error = error | jnp.broadcast_to(history_error(history, vocab), (batch,))
  error = error | flag(jax.vmap(malformed_links)(*links), ErrorCode.BAD_PARAMS)

  def one(parents, tokens, uniforms, offset):
    return TREE_RULE(target, draft, parents, tokens, uniforms, None, law=law, pad_id=pad_id,
                     max_depth=max_depth, uniform_layout=uniform_layout, vocab=vocab,
                     axis_name=axis_name, offset=offset, final_coin=final_coin)

  offsets = jnp.arange(batch, dtype=jnp.int32) * size
  result = jax.vmap(one)(parents, candidates, named["uniforms"], offsets)
  result = jax.vmap(lambda r, o: finish_emitted(
    r, target, path_rows(r.path, o), pad_id=pad_id, k=logprobs, mode=logprobs_mode,
    axis_name=axis_name))(result, offsets)
  accepted_rows = jnp.where(result.path >= 0, offsets[:, None] + result.path, -1)
  accept_index = jnp.concatenate([offsets[:, None], accepted_rows[:, :-1]], axis=1)
  error = result.error | error
  written = accept_index >= 0  # the root and the accepted nodes: each emitted the next token
  predicts = jnp.full((batch * size,), pad_id, jnp.int32).at[
    jnp.where(written, accept_index, batch * size)].set(result.tokens, mode="drop")
  return PackedTreeVerifyResult(*result[:4], valid=error == 0, error=error, path=result.path,
                                accept_index=accept_index, predicts=predicts,
                                logprobs=result.logprobs, top_ids=result.top_ids,
                                top_logprobs=result.top_logprobs)


__all__ = ["PackedTreeVerifyResult", "malformed_links", "packed_tree_verify",
           "parents_from_links"]
