"""Every rule from logits: the rows processed with per-request ``SamplingParams``, then the rule.

Serving engines hand a verifier logits and per-request temperature / top-k / top-p, never
normalised probabilities. The bodies here make a sequence's rows (target, and draft when given;
greedy rows are point masses on the argmax) a lazily processed row source
(:mod:`specdec_jax._logits.lazy`: per-row statistics, probabilities computed where read) and run a
rule of :mod:`~specdec_jax._rules.registry` on it, on one device or over vocabulary shards
(``axis_name``: the row statistics are combined with scalar collectives, no device gathers a row).
:func:`verify_logits` (token-wise or block) and :func:`tree_verify_logits` are the
one-sequence entry points; the layouts (packed, vocab-parallel) reuse the bodies.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.typing import ArrayLike

from specdec_jax._core.checks import FLOAT
from specdec_jax._core.checks import INT
from specdec_jax._core.checks import KEY
from specdec_jax._core.checks import check_chain
from specdec_jax._core.checks import check_scalar
from specdec_jax._core.checks import compute_dtype
from specdec_jax._core.checks import public_jit
from specdec_jax._core.keys import key_uniforms
from specdec_jax._core.keys import one_source
from specdec_jax._core.results import VerifyResult
from specdec_jax._logits.adjust import History
from specdec_jax._logits.adjust import chain_prefixes
from specdec_jax._logits.adjust import needs_edits
from specdec_jax._logits.adjust import tree_prefixes
from specdec_jax._logits.lazy import LogitRows
from specdec_jax._logits.lazy import request_rows
from specdec_jax._logits.params import check_bitmask
from specdec_jax._logits.params import check_history
from specdec_jax._logits.params import history_error
from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import check_params
from specdec_jax._logits.process import params_error
from specdec_jax._rows.chain import CHAIN_ARRAYS
from specdec_jax._rows.logprobs import check_logprobs
from specdec_jax._rows.logprobs import finish_emitted
from specdec_jax._rows.logprobs import path_rows
from specdec_jax._rules.registry import CHAIN_RULES
from specdec_jax._rules.registry import TREE_RULE
from specdec_jax._rules.tree import TreeVerifyResult
from specdec_jax._rules.tree import check_tree


def process_sequence(logits, params: SamplingParams, axis_name: str | None = None, *,
                     history: History | None = None, prefix=None, prefix_len=None,
                     bitmask=None, logprobs: int = 0, raw: bool = False) -> LogitRows:
  """One sequence's logit rows ``(R, V)`` (``V / n`` per device with ``axis_name``) as a lazily
  processed row source (:mod:`specdec_jax._logits.lazy`) with its scalar ``params``; row ``r``
  follows the draft tokens ``prefix[r, :prefix_len[r]]`` after the request's ``history``, and
  ``bitmask[r]`` (grammar words) masks it."""
  return request_rows(logits, params, jnp.zeros((logits.shape[0],), jnp.int32), axis_name,
                      history=history, prefix=prefix, prefix_len=prefix_len, bitmask=bitmask,
                      logprobs=logprobs, raw=raw)


def with_params_error(result, params: SamplingParams, vocab: int | None = None,
                      history: History | None = None):
  """``result`` with ``ErrorCode.BAD_PARAMS`` added where a parameter (or a history id) is out
  of range."""
  error = result.error | params_error(params, vocab)
  if history is not None and vocab is not None:
    error = error | history_error(history, vocab)
  return result._replace(error=error, valid=error == 0)


def chain_from_logits(target_logits, draft_logits, draft, uniforms, params, num_draft, *,
                      rule: str, pad_id: int, vocab: int, axis_name: str | None = None,
                      history: History | None = None, target_bitmask=None,
                      draft_bitmask=None, logprobs: int | None = None,
                      logprobs_mode: str = "processed") -> VerifyResult:
  """A chain rule on one sequence's logits (``draft_logits=None``: point-mass drafts); row
  ``i`` of either side follows ``draft[:i]``."""
  gamma = draft.shape[0]
  prefix, prefix_len = chain_prefixes(draft, gamma + 1)
  p = process_sequence(target_logits, params, axis_name, history=history, prefix=prefix,
                       prefix_len=prefix_len, bitmask=target_bitmask, logprobs=logprobs or 0,
                       raw=logprobs is not None and logprobs_mode == "raw")
  q = None
  if draft_logits is not None:
    q = (process_sequence(draft_logits, params, axis_name, history=history,
                          prefix=prefix[:gamma], prefix_len=prefix_len[:gamma],
                          bitmask=draft_bitmask) if gamma
         else jnp.zeros(draft_logits.shape, p.dtype))
  result = CHAIN_RULES[rule](p, q, draft, uniforms, num_draft, pad_id=pad_id, vocab=vocab,
                             axis_name=axis_name)
  result = finish_emitted(result, p, jnp.arange(gamma + 1, dtype=jnp.int32), pad_id=pad_id,
                          k=logprobs, mode=logprobs_mode, axis_name=axis_name)
  return with_params_error(result, params, vocab, history)


def tree_from_logits(target_logits, draft_logits, parents, tokens, uniforms, params, num_nodes,
                     *, law: str, pad_id: int, max_depth: int, uniform_layout: str, vocab: int,
                     axis_name: str | None = None, history: History | None = None,
                     target_bitmask=None, draft_bitmask=None, logprobs: int | None = None,
                     logprobs_mode: str = "processed") -> TreeVerifyResult:
  """The tree rule on one tree's logits (``draft_logits`` read only by the iid laws); node
  ``u``'s rows follow the tokens of the path to ``u``."""
  prefix = prefix_len = None
  if needs_edits(params, target_bitmask) or needs_edits(params, draft_bitmask):
    prefix, prefix_len = tree_prefixes(parents, tokens, max(max_depth, 1))
  p = process_sequence(target_logits, params, axis_name, history=history, prefix=prefix,
                       prefix_len=prefix_len, bitmask=target_bitmask, logprobs=logprobs or 0,
                       raw=logprobs is not None and logprobs_mode == "raw")
  q = None if draft_logits is None else process_sequence(
    draft_logits, params, axis_name, history=history, prefix=prefix, prefix_len=prefix_len,
    bitmask=draft_bitmask)
  result = TREE_RULE(p, q, parents, tokens, uniforms, num_nodes, law=law, pad_id=pad_id,
                     max_depth=max_depth, uniform_layout=uniform_layout, vocab=vocab,
                     axis_name=axis_name)
  result = finish_emitted(result, p, path_rows(result.path), pad_id=pad_id, k=logprobs,
                          mode=logprobs_mode, axis_name=axis_name)
  return with_params_error(result, params, vocab, history)



def check_logits_pair(name: str, target_logits, draft_logits) -> None:
  """Raise unless both sides' logits have the same vocabulary size."""
  if (draft_logits is not None and target_logits.ndim == 2 and draft_logits.ndim == 2
      and target_logits.shape[-1] != draft_logits.shape[-1]):
    raise ValueError(
      f"{name}: `target_logits` and `draft_logits` must have the same vocabulary size, got "
      f"V = {target_logits.shape[-1]} and V = {draft_logits.shape[-1]} instead.")


@public_jit(arrays=CHAIN_ARRAYS, static_argnames=("rule", "pad_id", "logprobs", "logprobs_mode"))
def verify_logits(target_logits: ArrayLike, draft_logits: ArrayLike | None, draft: ArrayLike,
                  uniforms: ArrayLike | None = None,
                  params: SamplingParams = SamplingParams(), *, key: ArrayLike | None = None,
                  num_draft: ArrayLike | None = None,
                  rule: str = "token", pad_id: int = -1, history: History | None = None,
                  target_bitmask: ArrayLike | None = None,
                  draft_bitmask: ArrayLike | None = None, logprobs: int | None = None,
                  logprobs_mode: str = "processed") -> VerifyResult:
  """:func:`~specdec_jax.verify` (or block verification) on logits, with sampling parameters.

  Both ``target_logits`` and ``draft_logits`` go through
  :func:`~specdec_jax.process_logits` with the same ``params``; the result is exact with
  respect to the processed target distribution, provided the draft tokens were sampled from
  the processed draft distribution (e.g. with :func:`~specdec_jax.sample_draft`).
  ``temperature == 0`` gives greedy verification: accept while the draft equals the target's
  argmax, then emit the argmax (point masses make the rule do exactly that), so greedy and
  sampled sequences can share one batch. All parameters may be traced: no recompilation when
  their values change. ``draft_logits=None`` means point-mass drafts (a deterministic
  drafter: n-gram, prompt lookup, a greedy head): accept ``x`` with probability ``p(x)``.

  Multi-host: see the docs, "Sharding and many hosts". Vocabulary-sharded
  logits: :func:`~specdec_jax.vocab_parallel_verify` with ``inputs="logits"``.

  Args:
    target_logits: ``(gamma + 1, V)`` target logits.
    draft_logits: ``(gamma, V)`` draft logits at the proposed positions, or None.
    draft: ``(gamma,)`` integer token ids.
    uniforms: ``(gamma + 1,)`` uniforms in ``[0, 1)``, read as the rule says; or
    key: one ``jax.random`` key (``uniform(key, (gamma + 1,))``; for a batch,
      ``jax.vmap(lambda k, *a: verify_logits(*a, key=k))(keys, ...)``).
    params: :class:`~specdec_jax.SamplingParams` with scalar fields (``jax.vmap`` for a batch).
    num_draft: optional int32 scalar in ``[0, gamma]``, as in :func:`~specdec_jax.verify`.
    rule: static, ``"token"`` (:func:`~specdec_jax.verify`) or ``"block"``
      (:func:`~specdec_jax.block_verify`).
    pad_id: static int for the unused slots.
    history: optional :class:`~specdec_jax.History` (the request's prompt and output ids)
      that the penalties, ``min_tokens`` and bad words read; row ``i`` (of either side)
      counts ``draft[:i]`` as output too.
    target_bitmask: optional grammar words ``(gamma + 1, ceil(V / 32))``, one row per target
      row (each draft position and the bonus position); bit ``i`` of word ``j`` allows token
      ``32 j + i``.
    draft_bitmask: optional ``(gamma, ceil(V / 32))``, the words the draft sampled under.
    logprobs: static None, or ``k`` in ``[0, 64]``: the result's ``logprobs`` (each emitted
      token's log-probability under the processed target distribution of its position, the
      replacement's included) and, for ``k > 0``, ``top_ids`` / ``top_logprobs``.
    logprobs_mode: static ``"processed"`` or ``"raw"`` (the raw logits' softmax).

  Returns:
    :class:`~specdec_jax.VerifyResult`; ``ErrorCode.BAD_PARAMS`` is set for out-of-range
    parameters.

  Example:
    >>> import jax.numpy as jnp
    >>> from specdec_jax import SamplingParams
    >>> target = jnp.array([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]])
    >>> draft_logits = jnp.zeros((2, 3))
    >>> r = verify_logits(target, draft_logits, jnp.array([1, 2]), jnp.array([0.5, 0.5, 0.5]),
    ...                   SamplingParams(temperature=0.0))
    >>> r.tokens.tolist()   # greedy: 1 == argmax kept, 2 != argmax replaced by 0
    [1, 0, -1]

  Reference:
    Leviathan, Kalman, Matias (2023), arXiv:2211.17192; Sun et al., "Block Verification
    Accelerates Speculative Decoding", arXiv:2403.10444.
  """
  name = "verify_logits"
  if rule not in CHAIN_RULES:
    raise ValueError(f"{name}: `rule` must be one of {tuple(CHAIN_RULES)}, got {rule!r}.")
  check_logits_pair(name, target_logits, draft_logits)
  gamma, vocab = check_chain(name, target_logits, draft_logits, draft, uniforms,
                             names=("target_logits", "draft_logits"))
  check_scalar(name, "num_draft", num_draft, INT)
  params = check_params(params, name, vocab=vocab)
  history = check_history(name, history, vocab)
  target_bitmask = check_bitmask(name, "target_bitmask", target_bitmask, gamma + 1, vocab)
  draft_bitmask = check_bitmask(name, "draft_bitmask", draft_bitmask, gamma, vocab)
  one_source(name, key, uniforms)
  if key is not None:
    uniforms = key_uniforms(name, key, gamma + 1, compute_dtype(target_logits.dtype))
  return chain_from_logits(target_logits, draft_logits, draft, uniforms, params, num_draft,
                           rule=rule, pad_id=pad_id, vocab=vocab, history=history,
                           target_bitmask=target_bitmask, draft_bitmask=draft_bitmask,
                           logprobs=check_logprobs(name, logprobs, logprobs_mode, vocab),
                           logprobs_mode=logprobs_mode)


#: The array arguments of the tree verifiers from logits.
TREE_LOGITS_ARRAYS = {"key": KEY, "target_logits": FLOAT, "draft_logits": FLOAT,
                      "parents": INT, "tokens": INT, "uniforms": FLOAT, "num_nodes": INT}


@public_jit(arrays=TREE_LOGITS_ARRAYS,
            static_argnames=("law", "pad_id", "max_depth", "uniform_layout", "logprobs",
                             "logprobs_mode"))
def tree_verify_logits(target_logits: ArrayLike, draft_logits: ArrayLike | None,
                       parents: ArrayLike, tokens: ArrayLike, uniforms: ArrayLike | None = None,
                       params: SamplingParams = SamplingParams(), *, key: ArrayLike | None = None,
                       num_nodes: ArrayLike | None = None,
                       law: str = "iid", pad_id: int = -1, max_depth: int | None = None,
                       uniform_layout: str = "sequential", history: History | None = None,
                       target_bitmask: ArrayLike | None = None,
                       draft_bitmask: ArrayLike | None = None, logprobs: int | None = None,
                       logprobs_mode: str = "processed") -> TreeVerifyResult:
  """:func:`~specdec_jax.tree_verify` on logits, with sampling parameters.

  Both sides' rows go through :func:`~specdec_jax.process_logits` with ``params``; greedy
  (``temperature == 0``) makes every target row a point mass on its argmax, so the walk
  follows the target's greedy path through the tree. ``draft_logits`` is read only under the
  laws that read ``q`` (``"iid"``, ``"without_replacement"``); pass None under
  ``"deterministic"``.

  Multi-host: see the docs, "Sharding and many hosts". Vocabulary-sharded
  logits: :func:`~specdec_jax.vocab_parallel_tree_verify` with ``inputs="logits"``.

  Args:
    target_logits: ``(N, V)`` target logits, row ``u`` the law after the path to node ``u``.
    draft_logits: ``(N, V)`` draft logits (row ``u``: what ``u``'s children were drafted
      from), or None under ``"deterministic"``.
    parents, tokens, num_nodes, law, pad_id, max_depth, uniform_layout: as in
      :func:`~specdec_jax.tree_verify`.
    uniforms: ``(N,)`` uniforms; or
    key: one ``jax.random`` key (``uniform(key, (N,))``).
    params: :class:`~specdec_jax.SamplingParams` with one request's fields.
    history: optional :class:`~specdec_jax.History`; node ``u``'s rows count the tokens of the
      path to ``u`` as output too.
    target_bitmask, draft_bitmask: optional grammar words ``(N, ceil(V / 32))``, row ``u`` the
      mask after the path to node ``u``.
    logprobs, logprobs_mode: static, as in :func:`verify_logits` (the row of each emitted
      token is its parent node's).

  Returns:
    :class:`~specdec_jax.TreeVerifyResult`; ``BAD_PARAMS`` for out-of-range parameters.

  Example:
    >>> import jax.numpy as jnp
    >>> from specdec_jax import SamplingParams
    >>> logits = jnp.array([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    >>> r = tree_verify_logits(logits, None, jnp.array([-1, 0, 0]), jnp.array([0, 2, 1]),
    ...                        jnp.array([0.5, 0.5, 0.5]), SamplingParams(0.0),
    ...                        law="deterministic")
    >>> r.tokens.tolist(), r.path.tolist()   # greedy: child 2 (token 1) kept, then 0
    ([1, 0, -1], [2, -1, -1])

  Reference:
    Miao et al., "SpecInfer", arXiv:2305.09781; Li et al., "EAGLE-2", arXiv:2406.16858.
  """
  name = "tree_verify_logits"
  check_logits_pair(name, target_logits, draft_logits)
  if draft_logits is None and law != "deterministic":
    raise ValueError(f"{name}: law {law!r} reads the draft rows: pass `draft_logits` (or use "
                     "law='deterministic').")
  q = target_logits if draft_logits is None else draft_logits
  size, vocab, max_depth = check_tree(target_logits, q, parents, tokens, uniforms, law,
                                      max_depth, name, uniform_layout)
  check_scalar(name, "num_nodes", num_nodes, INT)
  params = check_params(params, name, vocab=vocab)
  history = check_history(name, history, vocab)
  target_bitmask = check_bitmask(name, "target_bitmask", target_bitmask, size, vocab)
  draft_bitmask = check_bitmask(name, "draft_bitmask", draft_bitmask, size, vocab)
  one_source(name, key, uniforms)
  if key is not None:
    uniforms = key_uniforms(name, key, size, compute_dtype(target_logits.dtype))
  draft_logits = None if law == "deterministic" else draft_logits
  return tree_from_logits(target_logits, draft_logits, parents, tokens, uniforms, params,
                          num_nodes, law=law, pad_id=pad_id, max_depth=max_depth,
                          uniform_layout=uniform_layout, vocab=vocab, history=history,
                          target_bitmask=target_bitmask, draft_bitmask=draft_bitmask,
                          logprobs=check_logprobs(name, logprobs, logprobs_mode, vocab),
                          logprobs_mode=logprobs_mode)

