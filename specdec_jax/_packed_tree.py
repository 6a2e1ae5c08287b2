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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jax.typing import ArrayLike

from specdec_jax._checks import FLOAT
from specdec_jax._checks import INT
from specdec_jax._checks import KEY
from specdec_jax._checks import check_array
from specdec_jax._checks import check_pad_id
from specdec_jax._checks import check_static_int
from specdec_jax._checks import compute_dtype
from specdec_jax._checks import host_array
from specdec_jax._checks import host_top_k
from specdec_jax._engine import all_greedy
from specdec_jax._engine import check_convention
from specdec_jax._engine import engine_params
from specdec_jax._errors import ErrorCode
from specdec_jax._errors import flag
from specdec_jax._keys import draw_uniforms
from specdec_jax._keys import one_source
from specdec_jax._keys import uniforms_first
from specdec_jax._lazy import lazy_rows
from specdec_jax._logits import SamplingParams
from specdec_jax._logits import check_params
from specdec_jax._logits import params_error
from specdec_jax._mesh import check_divisible
from specdec_jax._mesh import over_vocab
from specdec_jax._rules import LAWS
from specdec_jax._rules import TREE_RULE
from specdec_jax._rules import UNIFORM_LAYOUTS


class PackedTreeVerifyResult(NamedTuple):
  """What :func:`packed_tree_verify` produced for ``B`` trees.

  The first six fields are those of every result (:class:`~specdec_jax.VerifyResult`).

  Attributes:
    tokens: int32 ``(B, max_depth + 1)``: the accepted path's tokens, then the final token
      (replacement or bonus), then ``pad_id``.
    num_tokens: int32 ``(B,)`` new tokens, ``num_accepted + 1``.
    num_accepted: int32 ``(B,)`` accepted draft tokens (sglang's ``accept_length``).
    num_uniforms: int32 ``(B,)`` coins read as fresh uniforms (tests plus the final sample;
      under ``"per_parent"`` a parent's coin is rescaled after each rejection, not re-read).
    valid: bool ``(B,)``.
    error: int32 ``(B,)`` :class:`~specdec_jax.ErrorCode` bits.
    path: int32 ``(B, max_depth + 1)``: the accepted nodes (tree indices ``u``), then ``-1``.
    accept_index: int32 ``(B, max_depth + 1)``: sglang's ``accept_index``, the flat rows
      ``b * N + u`` of the root and then of the accepted nodes, ``-1`` after.
    predicts: int32 ``(B * N,)``: sglang's ``predicts``, the token emitted after each node of
      the accepted path (row ``b * N + u``: the next accepted token, or the final one after
      the last accepted node), ``pad_id`` at every other node.
  """

  tokens: jax.Array
  num_tokens: jax.Array
  num_accepted: jax.Array
  num_uniforms: jax.Array
  valid: jax.Array
  error: jax.Array
  path: jax.Array
  accept_index: jax.Array
  predicts: jax.Array


#: The name of earlier versions, kept as an alias.
PackedTreeResult = PackedTreeVerifyResult


def parents_from_links(first_child: jax.Array, next_sibling: jax.Array) -> jax.Array:
  """Parent indices ``(N,)`` of a tree given as first-child / next-sibling links (-1: none).

  The root (node 0) and nodes no link reaches get ``-1``. Traced-safe: links outside
  ``[0, N)`` are ignored (the node they would reach is then unreachable, and
  :func:`~specdec_jax.tree_verify` flags a real node without a valid parent).

  Example:
    >>> import jax.numpy as jnp
    >>> parents_from_links(jnp.array([1, 3, -1, -1]), jnp.array([-1, 2, -1, -1])).tolist()
    [-1, 0, 0, 1]
  """
  size = first_child.shape[0]
  nodes = jnp.arange(size, dtype=jnp.int32)

  def valid(link):
    return (link >= 0) & (link < size)

  parent = jnp.full((size,), -1, jnp.int32).at[jnp.where(valid(first_child), first_child, size)]
  parent = parent.set(nodes, mode="drop")
  previous = jnp.full((size,), -1, jnp.int32).at[jnp.where(valid(next_sibling), next_sibling,
                                                           size)].set(nodes, mode="drop")

  def follow(_, parent):  # a sibling has its previous sibling's parent
    inherited = jnp.where(previous >= 0, parent[jnp.maximum(previous, 0)], -1)
    return jnp.where(parent >= 0, parent, inherited)

  return lax.fori_loop(0, size, follow, parent).at[0].set(-1)


def malformed_links(first_child: jax.Array, next_sibling: jax.Array) -> jax.Array:
  """Whether one tree's links break the encoding :func:`packed_tree_verify` reads (traced bool).

  Well formed: every link is ``-1`` or a later node (``u < link < N``: children after their
  parent, siblings in increasing order, hence no cycle), no node is reached by two links, and
  the root has no sibling. Nodes no link reaches are flagged by the tree rule itself.

  Example:
    >>> import jax.numpy as jnp
    >>> bool(malformed_links(jnp.array([1, -1, -1]), jnp.array([-1, 2, -1])))
    False
    >>> bool(malformed_links(jnp.array([2, -1, -1]), jnp.array([-1, -1, 1])))  # 2 -> 1
    True
  """
  size = first_child.shape[0]
  nodes = jnp.arange(size, dtype=first_child.dtype)
  links = jnp.concatenate([first_child, next_sibling])
  out_of_order = (links != -1) & ((links <= jnp.tile(nodes, 2)) | (links >= size))
  reached = jnp.zeros((size,), jnp.int32).at[jnp.where(links >= 0, links, size)].add(
    1, mode="drop")
  return jnp.any(out_of_order) | jnp.any(reached > 1) | (next_sibling[0] != -1)


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
                       final_coins: ArrayLike | None = None) -> PackedTreeVerifyResult:
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

  Multi-host: see the README, "Running on many devices and hosts". Vocabulary-sharded rows:
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
    convention: static, how ``params`` writes greedy / disabled (:func:`engine_params`).
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
                          convention=convention, pad_id=pad_id, final_coins=final_coins)


def packed_tree_call(name, mesh, vocab_axis, candidates, retrive_next_token,
                     retrive_next_sibling, *, max_depth, target_probs, target_logits,
                     draft_probs, draft_logits, params, law, key, uniforms, coins,
                     uniform_layout, convention, pad_id, final_coins=None,
                     lower=False) -> PackedTreeVerifyResult:
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
  if params is not None:
    params = engine_params(host_top_k(params), convention)
    params = check_params(params, name, batch=shape[0], host_only=True)
  elif args["target_logits"] is not None:
    params = SamplingParams()
  target = args["target_probs"] if args["target_logits"] is None else args["target_logits"]
  draft = args["draft_probs"] if args["draft_logits"] is None else args["draft_logits"]
  args["key"], args["uniforms"] = uniforms_first(
    name, args["key"], args["uniforms"], shape[0], shape[1],
    [target.dtype] + ([] if draft is None else [draft.dtype]))
  run = packed_tree_jit.lower if lower else packed_tree_jit
  return run(**args, params=params, max_depth=max_depth, law=law,
                   uniform_layout=uniform_layout, pad_id=pad_id, name=name, mesh=mesh,
                   vocab_axis=vocab_axis)


@functools.partial(jax.jit, static_argnames=("max_depth", "law", "uniform_layout", "pad_id",
                                             "name", "mesh", "vocab_axis"))
def packed_tree_jit(candidates, retrive_next_token, retrive_next_sibling, target_probs,
                    target_logits, draft_probs, draft_logits, uniforms, key, params,
                    final_coins=None, *, max_depth,
                    law, uniform_layout, pad_id, name="packed_tree_verify", mesh=None,
                    vocab_axis=None):
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
               uniforms=uniforms, params=params)
  body = functools.partial(packed_tree_body, max_depth=max_depth, law=law,
                           uniform_layout=uniform_layout, pad_id=pad_id,
                           vocab=target.shape[1], draft_is_logits=draft_logits is not None,
                           final_coin=final_coins is not None)
  if mesh is None:
    return body(named, axis_name=None)
  check_divisible(name, target_name, target.shape[1], mesh.shape[vocab_axis], vocab_axis)
  return over_vocab(body, mesh, vocab_axis, named, rows=("target", "draft"),
                    out_specs=PackedTreeVerifyResult(*(P(),) * 9))


def packed_tree_body(named, *, max_depth, law, uniform_layout, pad_id, vocab,
                     draft_is_logits=False, final_coin=False,
                     axis_name=None) -> PackedTreeVerifyResult:
  """The traced body of :func:`packed_tree_verify` (``axis_name``: vocabulary-split rows)."""
  candidates, target, draft = named["candidates"], named["target"], named["draft"]
  batch, size = candidates.shape
  error = jnp.zeros((batch,), jnp.int32)
  params = named["params"]
  if params is not None:
    owners = jnp.arange(batch * size, dtype=jnp.int32) // size
    rows = SamplingParams(*(None if v is None else (
      jnp.broadcast_to(jnp.asarray(v), (batch,))[owners]) for v in params))
    target = lazy_rows(target, rows, axis_name)
    if draft is not None and draft_is_logits:
      draft = lazy_rows(draft, rows, axis_name)
    error = error | jnp.broadcast_to(params_error(params), (batch,))
  links = (named["retrive_next_token"], named["retrive_next_sibling"])
  parents = jax.vmap(parents_from_links)(*links)
  error = error | flag(jax.vmap(malformed_links)(*links), ErrorCode.BAD_PARAMS)

  def one(parents, tokens, uniforms, offset):
    return TREE_RULE(target, draft, parents, tokens, uniforms, None, law=law, pad_id=pad_id,
                     max_depth=max_depth, uniform_layout=uniform_layout, vocab=vocab,
                     axis_name=axis_name, offset=offset, final_coin=final_coin)

  offsets = jnp.arange(batch, dtype=jnp.int32) * size
  result = jax.vmap(one)(parents, candidates, named["uniforms"], offsets)
  accepted_rows = jnp.where(result.path >= 0, offsets[:, None] + result.path, -1)
  accept_index = jnp.concatenate([offsets[:, None], accepted_rows[:, :-1]], axis=1)
  error = result.error | error
  written = accept_index >= 0  # the root and the accepted nodes: each emitted the next token
  predicts = jnp.full((batch * size,), pad_id, jnp.int32).at[
    jnp.where(written, accept_index, batch * size)].set(result.tokens, mode="drop")
  return PackedTreeVerifyResult(*result[:4], valid=error == 0, error=error, path=result.path,
                                accept_index=accept_index, predicts=predicts)


__all__ = ["PackedTreeResult", "PackedTreeVerifyResult", "malformed_links", "packed_tree_verify",
           "parents_from_links"]
