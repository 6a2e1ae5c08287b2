"""Vocab-parallel verification: every layout over a mesh whose devices hold ``V / n`` columns.

This is the layout a tensor-parallel LM head leaves (as on TPU pods): every device holds
``V / n`` contiguous columns of every row, as probabilities or as *logits*. Each factory here
builds the jitted, sharded form of one layout (padded chains, padded trees, packed chains,
packed trees) from the same rule bodies the single-device forms run, with ``axis_name`` set:
per sequence only O(n) scalars cross devices (gathered entries, row statistics, the sampler's
partial masses and one candidate id; for logits also the processing's row statistics: max,
normaliser, the threshold searches' counts and masses), never a row. Randomness is given as
``uniforms`` or drawn from ``key=`` (one key, or one per request) before the sharded body.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from specdec_jax._core.checks import check_chain
from specdec_jax._core.checks import check_pad_id
from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.keys import draw_uniforms
from specdec_jax._core.keys import one_source
from specdec_jax._core.keys import uniforms_first
from specdec_jax._core.results import VerifyResult
from specdec_jax._layouts.from_logits import chain_from_logits
from specdec_jax._layouts.from_logits import tree_from_logits
from specdec_jax._layouts.mesh import Built
from specdec_jax._layouts.mesh import batch_counts
from specdec_jax._layouts.mesh import batch_size
from specdec_jax._layouts.mesh import check_divisible
from specdec_jax._layouts.mesh import check_inputs
from specdec_jax._layouts.mesh import check_mesh
from specdec_jax._layouts.mesh import check_word_aligned
from specdec_jax._layouts.mesh import host_arrays
from specdec_jax._layouts.mesh import over_vocab
from specdec_jax._layouts.mesh import per_request
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.params import check_history
from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import check_params
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax._rows.logprobs import finish_emitted
from specdec_jax._rows.logprobs import path_rows
from specdec_jax._rows.logprobs import result_specs
from specdec_jax._rows.sources import masked_rows
from specdec_jax._rules.registry import CHAIN_RULES
from specdec_jax._rules.registry import TREE_RULE
from specdec_jax._rules.tree import TreeVerifyResult
from specdec_jax._rules.tree import check_tree


def _adjusting(name, a, logits, batch, vocab) -> dict:
  """The host-checked ``history`` and bitmasks of a vocab-parallel call from logits."""
  masks = dict(target_bitmask=a.get("target_bitmask"), draft_bitmask=a.get("draft_bitmask"))
  if not logits:
    return masks
  return dict(history=check_history(name, a.get("history"), vocab, batch), **masks)


def _batch_history(history, batch: int):
  """A history with a leading ``B`` (shared fields broadcast)."""
  return type(history)(*(None if h is None else (
    jnp.asarray(h) if jnp.ndim(h) == 2 else jnp.broadcast_to(jnp.asarray(h), (batch,
                                                                              *jnp.shape(h))))
    for h in history))


def _masks(name, target_bitmask, draft_bitmask, target_rows, draft_rows, vocab, shards,
           vocab_axis, params, history) -> dict:
  """The bitmasks ``(B, rows, W)`` checked, and whole words per device where anything adjusts
  the rows."""
  words = -(-vocab // 32)
  out = {}
  for arg, mask, rows in (("target_bitmask", target_bitmask, target_rows),
                          ("draft_bitmask", draft_bitmask, draft_rows)):
    if mask is not None:
      mask = jnp.asarray(mask)
      if mask.dtype not in (jnp.int32, jnp.uint32) or mask.shape != (*rows, words):
        raise ValueError(f"{name}: `{arg}` must be int32 words of shape {(*rows, words)}, got "
                         f"{mask.dtype}{tuple(mask.shape)} instead.")
    out[arg] = mask
  if any(m is not None for m in out.values()) or (
      params is not None and needs_edits(params, None)) or history is not None:
    check_word_aligned(name, vocab, shards, vocab_axis)
  return out


def vocab_parallel_verify(mesh: Mesh, vocab_axis: str, batch_axis: str | None = None, *,
                          rule: str = "token", inputs: str = "probs", pad_id: int = -1,
                          logprobs: int | None = None,
                          logprobs_mode: str = "processed") -> Callable[..., VerifyResult]:
  """Build a jitted, batched :func:`~specdec_jax.verify` (or block) on vocab-split rows.

  Per sequence only O(n) scalars cross devices: the ``2 * gamma`` gathered probabilities of
  the draft tokens (a ``psum`` of one contribution each), a few statistics of each row the
  rule reads, ``n`` partial masses for the inverse-CDF sample and one candidate id; from
  logits also each row's processing statistics (max, normaliser, the top-k/top-p searches'
  counts and masses, the greedy argmax), a few scalars per pass. The accept scan runs
  replicated. Results equal the single-device verifier's (:func:`~specdec_jax.verify`,
  :func:`~specdec_jax.verify_logits`) for the same uniforms except within float rounding of
  an interval boundary of the final sample.

  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    mesh: a ``jax.sharding.Mesh``.
    vocab_axis: the mesh axis the vocabulary is split over; ``V`` must be divisible by its size.
    batch_axis: optional mesh axis the batch is split over (data parallel).
    rule: static ``"token"`` or ``"block"``.
    inputs: ``"probs"`` (processed probabilities) or ``"logits"`` (processed per request with
      ``params``, on the shards).
    pad_id: int written into unused token slots.
    logprobs, logprobs_mode: static, as in :func:`~specdec_jax.packed_verify` (the result's
      ``logprobs`` and, for ``logprobs > 0``, ``top_ids`` / ``top_logprobs``).

  Returns:
    ``inputs="probs"``: ``fn(p, q, draft, uniforms=None, num_draft=None, *, key=None)`` with
    ``p (B, gamma + 1, V)``, ``q (B, gamma, V)`` or None (point-mass drafts), ``draft (B,
    gamma)``, ``uniforms (B, gamma + 1)``, ``num_draft (B,)``, ``key`` one key or ``B`` keys.
    ``inputs="logits"``: ``fn(target_logits, draft_logits, draft, uniforms=None, params=None,
    num_draft=None, *, key=None)`` with :class:`~specdec_jax.SamplingParams` fields scalar or
    ``(B,)``. The result's fields have a leading ``B`` axis (sharded over ``batch_axis``).

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> fn = vocab_parallel_verify(mesh, "model")
    >>> p = np.full((1, 3, 4), 0.25, np.float32); q = np.full((1, 2, 4), 0.25, np.float32)
    >>> fn(p, q, np.array([[1, 2]]), np.full((1, 3), 0.5, np.float32)).tokens.tolist()
    [[1, 2, 2]]

  Reference:
    Shoeybi et al., "Megatron-LM" (vocab-parallel output layer), arXiv:1909.08053;
    Leviathan, Kalman, Matias (2023), arXiv:2211.17192; Sun et al. (2025, block
    verification), arXiv:2403.10444.
  """
  name = "vocab_parallel_verify"
  shards = check_mesh(name, mesh, vocab_axis, batch_axis)
  pad_id = check_pad_id(name, pad_id)
  check_inputs(name, inputs)
  if rule not in CHAIN_RULES:
    raise ValueError(f"{name}: `rule` must be one of {tuple(CHAIN_RULES)}, got {rule!r}.")
  batched = ("draft", "uniforms", "num_draft", "params", "history")
  logprobs = check_logprobs(name, logprobs, logprobs_mode, None)
  out = VerifyResult(*(P(batch_axis),) * 6, *result_specs(logprobs, P(batch_axis)))

  @functools.partial(jax.jit, static_argnames=("logits",))
  def run(p, q, draft, uniforms, num_draft, key, params, history=None, target_bitmask=None,
          draft_bitmask=None, *, logits):
    batch = batch_size(name, (("p", p, 3), ("q", q, 3), ("draft", draft, 2),
                            ("uniforms", uniforms, 2)))
    one = [None if a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
           for a in (p, q, draft, uniforms)]
    gamma, vocab = check_chain(name, *one, names=("target_logits", "draft_logits") if logits
                               else ("p", "q"))
    check_divisible(name, "target_logits" if logits else "p", vocab, shards, vocab_axis)
    if uniforms is None:
      dtype = compute_dtype(p.dtype, (p if q is None else q).dtype)
      uniforms = draw_uniforms(name, key, batch, gamma + 1, dtype)
    masks = _masks(name, target_bitmask, draft_bitmask, (batch, gamma + 1), (batch, gamma),
                   vocab, shards, vocab_axis, params, history)
    named = dict(p=p, q=q, draft=jnp.asarray(draft), uniforms=uniforms,
                 num_draft=batch_counts(name, "num_draft", num_draft, batch, gamma),
                 params=None if params is None else per_request(params, batch),
                 history=None if history is None else _batch_history(history, batch), **masks)

    def body(named, axis_name):
      def one(p, q, draft, uniforms, num_draft, params, history, target_mask, draft_mask):
        if params is None:
          p = masked_rows(p, target_mask, axis_name)
          q = None if q is None else masked_rows(q, draft_mask, axis_name)
          result = CHAIN_RULES[rule](p, q, draft, uniforms, num_draft, pad_id=pad_id,
                                     vocab=vocab, axis_name=axis_name)
          return finish_emitted(result, p, jnp.arange(draft.shape[0] + 1, dtype=jnp.int32),
                                pad_id=pad_id, k=logprobs, mode=logprobs_mode,
                                axis_name=axis_name)
        return chain_from_logits(p, q, draft, uniforms, params, num_draft, rule=rule,
                                 pad_id=pad_id, vocab=vocab, axis_name=axis_name,
                                 history=history, target_bitmask=target_mask,
                                 draft_bitmask=draft_mask, logprobs=logprobs,
                                 logprobs_mode=logprobs_mode)
      return jax.vmap(one)(*(named[k] for k in ("p", "q", "draft", "uniforms", "num_draft",
                                                 "params", "history", "target_bitmask",
                                                 "draft_bitmask")))

    return over_vocab(body, mesh, vocab_axis, named,
                      rows=("p", "q", "target_bitmask", "draft_bitmask"), out_specs=out,
                      batch_axis=batch_axis, batched=batched)

  def impl(a: dict, lower: bool):
    logits = inputs == "logits"
    p, q = (a["target_logits"], a["draft_logits"]) if logits else (a["p"], a["q"])
    h = host_arrays(name, dict(p=p, q=q, draft=a["draft"], uniforms=a["uniforms"],
                         num_draft=a["num_draft"], key=a["key"]))
    one_source(name, a["key"], a["uniforms"])
    params = (SamplingParams() if a.get("params") is None else a["params"]) if logits else None
    if params is not None:
      params = check_params(params, name, batch=jnp.shape(h["draft"])[0], host_only=True)
    draft = h["draft"]
    key, uniforms = uniforms_first(
      name, h["key"], h["uniforms"], draft.shape[0] if jnp.ndim(draft) == 2 else None,
      jnp.shape(draft)[-1] + 1, [x.dtype for x in (h["p"], h["q"]) if x is not None])
    target = run.lower if lower else run
    extra = _adjusting(name, a, logits, jnp.shape(h["draft"])[0],
                       None if h["p"] is None else h["p"].shape[-1])
    return target(h["p"], h["q"], draft, uniforms, h["num_draft"], key, params, **extra,
                  logits=logits)

  def probs(p, q, draft, uniforms=None, num_draft=None, *, key=None, target_bitmask=None,
            draft_bitmask=None) -> VerifyResult: ...

  def from_logits(target_logits, draft_logits, draft, uniforms=None, params=None,
                  num_draft=None, *, key=None, history=None, target_bitmask=None,
                  draft_bitmask=None) -> VerifyResult: ...

  return Built(impl, probs if inputs == "probs" else from_logits, name,
               vocab_parallel_verify.__doc__)


def vocab_parallel_tree_verify(mesh: Mesh, vocab_axis: str, batch_axis: str | None = None, *,
                               law: str = "iid", inputs: str = "probs", pad_id: int = -1,
                               logprobs: int | None = None, logprobs_mode: str = "processed",
                               max_depth: int | None = None,
                               uniform_layout: str = "sequential",
                               ) -> Callable[..., TreeVerifyResult]:
  """Build a jitted, batched :func:`~specdec_jax.tree_verify` on vocab-split rows.

  The walk carries no ``(V,)`` row (see :func:`~specdec_jax.tree_verify`), so it runs
  replicated on every device: a child test gathers two scalars (a ``psum`` of one
  contribution each), a rejection reduces three statistics of the node's rows, and the final
  token is a sharded inverse CDF (``n`` partial masses and one candidate). Per tree O(n + N)
  scalars cross devices, nothing of size ``V``; from logits also each row's processing
  statistics.

  Multi-host: see the docs, "Sharding and many hosts".

  Args:
    mesh, vocab_axis, batch_axis, inputs, pad_id: as in :func:`vocab_parallel_verify`.
    law, max_depth, uniform_layout: static, as in :func:`~specdec_jax.tree_verify`.

  Returns:
    ``inputs="probs"``: ``fn(p, q, parents, tokens, uniforms=None, num_nodes=None, *,
    key=None)`` with ``p``, ``q`` ``(B, N, V)`` (``q`` None under ``"deterministic"``),
    ``parents`` ``(N,)`` (one shape for the batch) or ``(B, N)``, ``tokens`` and ``uniforms``
    ``(B, N)``, ``num_nodes`` ``(B,)``, ``key`` one key or ``B`` keys.
    ``inputs="logits"``: ``fn(target_logits, draft_logits, parents, tokens, uniforms=None,
    params=None, num_nodes=None, *, key=None)``.

  Example:
    >>> import jax, numpy as np
    >>> mesh = jax.make_mesh((1,), ("model",))
    >>> fn = vocab_parallel_tree_verify(mesh, "model", law="deterministic")
    >>> p = np.full((1, 3, 4), 0.25, np.float32)
    >>> r = fn(p, p, np.array([-1, 0, 0]), np.array([[0, 1, 2]]), np.full((1, 3), 0.1))
    >>> r.tokens.tolist(), r.path.tolist()
    ([[1, 0, -1]], [[1, -1, -1]])

  Reference:
    Miao et al., "SpecInfer", arXiv:2305.09781; Shoeybi et al., "Megatron-LM",
    arXiv:1909.08053.
  """
  name = "vocab_parallel_tree_verify"
  shards = check_mesh(name, mesh, vocab_axis, batch_axis)
  pad_id = check_pad_id(name, pad_id)
  check_inputs(name, inputs)
  batched = ("parents", "tokens", "uniforms", "num_nodes", "params", "history")
  logprobs = check_logprobs(name, logprobs, logprobs_mode, None)
  out = TreeVerifyResult(*(P(batch_axis),) * 7, *result_specs(logprobs, P(batch_axis)))

  @functools.partial(jax.jit, static_argnames=("logits",))
  def run(p, q, parents, tokens, uniforms, num_nodes, key, params, history=None,
          target_bitmask=None, draft_bitmask=None, *, logits):
    q = None if law == "deterministic" else q
    batch = batch_size(name, (("p", p, 3), ("q", q, 3), ("tokens", tokens, 2),
                            ("uniforms", uniforms, 2)))
    parents = jnp.asarray(parents)
    if parents.ndim == 1:
      parents = jnp.broadcast_to(parents, (batch, parents.shape[0]))
    one = [None if a is None else jax.ShapeDtypeStruct(a.shape[1:], a.dtype)
           for a in (p, p if q is None else q, parents, tokens, uniforms)]
    size, vocab, depth = check_tree(*one, law, max_depth, name, uniform_layout)
    check_divisible(name, "target_logits" if logits else "p", vocab, shards, vocab_axis)
    if uniforms is None:
      dtype = compute_dtype(p.dtype, (p if q is None else q).dtype)
      uniforms = draw_uniforms(name, key, batch, size, dtype)
    named = dict(p=p, q=q, parents=jnp.clip(parents, -1, 2**31 - 1).astype(jnp.int32),
                 tokens=jnp.clip(tokens, -1, 2**31 - 1).astype(jnp.int32), uniforms=uniforms,
                 num_nodes=batch_counts(name, "num_nodes", num_nodes, batch, size),
                 params=None if params is None else per_request(params, batch),
                 history=None if history is None else _batch_history(history, batch),
                 **_masks(name, target_bitmask, draft_bitmask, (batch, size), (batch, size),
                          vocab, shards, vocab_axis, params, history))
    static = dict(law=law, pad_id=pad_id, max_depth=depth, uniform_layout=uniform_layout,
                  vocab=vocab)

    def body(named, axis_name):
      def one(p, q, parents, tokens, uniforms, num_nodes, params, history, target_mask,
              draft_mask):
        if params is None:
          p = masked_rows(p, target_mask, axis_name)
          q = None if q is None else masked_rows(q, draft_mask, axis_name)
          result = TREE_RULE(p, q, parents, tokens, uniforms, num_nodes, axis_name=axis_name,
                             **static)
          return finish_emitted(result, p, path_rows(result.path), pad_id=pad_id, k=logprobs,
                                mode=logprobs_mode, axis_name=axis_name)
        return tree_from_logits(p, q, parents, tokens, uniforms, params, num_nodes,
                                axis_name=axis_name, history=history,
                                target_bitmask=target_mask, draft_bitmask=draft_mask,
                                logprobs=logprobs, logprobs_mode=logprobs_mode, **static)
      return jax.vmap(one)(*(named[k] for k in ("p", "q", "parents", "tokens", "uniforms",
                                                 "num_nodes", "params", "history",
                                                 "target_bitmask", "draft_bitmask")))

    return over_vocab(body, mesh, vocab_axis, named,
                      rows=("p", "q", "target_bitmask", "draft_bitmask"), out_specs=out,
                      batch_axis=batch_axis, batched=batched)

  def impl(a: dict, lower: bool):
    logits = inputs == "logits"
    p, q = (a["target_logits"], a["draft_logits"]) if logits else (a["p"], a["q"])
    h = host_arrays(name, dict(p=p, q=q, parents=a["parents"], tokens=a["tokens"],
                         uniforms=a["uniforms"], num_nodes=a["num_nodes"], key=a["key"]))
    one_source(name, a["key"], a["uniforms"])
    params = (SamplingParams() if a.get("params") is None else a["params"]) if logits else None
    if params is not None:
      params = check_params(params, name, batch=jnp.shape(h["tokens"])[0], host_only=True)
    tokens = h["tokens"]
    q = None if law == "deterministic" else h["q"]
    key, uniforms = uniforms_first(
      name, h["key"], h["uniforms"], tokens.shape[0] if jnp.ndim(tokens) == 2 else None,
      jnp.shape(tokens)[-1], [x.dtype for x in (h["p"], q) if x is not None])
    target = run.lower if lower else run
    extra = _adjusting(name, a, logits, jnp.shape(tokens)[0],
                       None if h["p"] is None else h["p"].shape[-1])
    return target(h["p"], h["q"], h["parents"], tokens, uniforms, h["num_nodes"], key, params,
                  **extra, logits=logits)

  def probs(p, q, parents, tokens, uniforms=None, num_nodes=None, *, key=None,
            target_bitmask=None, draft_bitmask=None) -> TreeVerifyResult: ...

  def from_logits(target_logits, draft_logits, parents, tokens, uniforms=None, params=None,
                  num_nodes=None, *, key=None, history=None, target_bitmask=None,
                  draft_bitmask=None) -> TreeVerifyResult: ...

  return Built(impl, probs if inputs == "probs" else from_logits, name,
               vocab_parallel_tree_verify.__doc__)
