"""The tree loop's verification step: the default verifier on lazily processed target rows,
or any verifier on processed ones, and the emitted tokens' logprobs."""

from __future__ import annotations

import functools

import jax

from specdec_jax._logits.adjust import needs_edits
from specdec_jax._rows.logprobs import finish_emitted
from specdec_jax._rows.logprobs import path_rows
from specdec_jax._rules.registry import TREE_RULE
from specdec_jax._rules.tree import tree_verify
from specdec_jax.decoding.args import StaticFunction
from specdec_jax.decoding.draft_tree import check_draft_tree
from specdec_jax.decoding.drafts import FeatureFns
from specdec_jax.decoding.dynamic_tree import DynamicTree
from specdec_jax.decoding.dynamic_tree import check_dynamic_tree
from specdec_jax.decoding.request_rows import lazy_processed
from specdec_jax.decoding.request_rows import processed
from specdec_jax.decoding.request_rows import reads_lazily
from specdec_jax.models.protocol import FeatureDraft

#: Tree drafting laws of :func:`~specdec_jax.decoding.tree_speculative_generate`.
TREE_LAWS = ("deterministic", "iid")


def verify_tree(tree_verifier, logits, params, q, parents, parents_axis, node_tokens, uniforms,
                num_nodes, *, law: str, depth: int, vocab: int, history=None, prefix=None,
                prefix_len=None, logprobs: int | None = None, mode: str = "processed"):
  """The loop's verification of ``(B, N, V)`` target logits, one tree per row.

  The default verifier (:func:`~specdec_jax.tree_verify` with ``law``) runs its rule on
  lazily processed target rows (no ``(B, N, V)`` probability array) when some request cuts
  or adjusts them (:func:`~specdec_jax.decoding.request_rows.reads_lazily`) or logprobs are asked
  for; otherwise, and for any other verifier, the rows are processed first. Node ``u``'s row
  follows the row's ``history`` and ``prefix[:, u, :prefix_len[:, u]]``, the tokens of its
  path (the root excluded, ``u`` included). ``logprobs`` (static ``k`` or None): the emitted tokens'
  logprobs under the rows they were drawn from (:func:`~specdec_jax._rows.logprobs.finish_emitted`,
  which also drops a final token drawn from a row that allows none).
  """
  default = tree_verifier is default_tree_verifier(law, depth)
  plain = not needs_edits(params, None) and logprobs is None  # the plain path, unchanged
  lazily = default and (reads_lazily(logits, params) or not plain)
  if not lazily:
    probs = processed(logits, params, history, prefix, prefix_len)
    result = jax.vmap(lambda p, q, a, t, u, n: tree_verifier(p, q, a, t, u, num_nodes=n),
                      in_axes=(0, 0, parents_axis, 0, 0, 0))(
      probs, probs if q is None else q, parents, node_tokens, uniforms, num_nodes)
    if logprobs is None:
      return result
  p, axes = lazy_processed(logits, params, history, prefix, prefix_len, logprobs=logprobs or 0,
                           raw=logprobs is not None and mode == "raw")
  if lazily:
    # tree_verify's rule on lazily processed target rows: no (B, N, V) probability array.
    result = jax.vmap(lambda p, q, a, t, u, n: TREE_RULE(
      p, q, a, t, u, n, law=law, pad_id=-1, max_depth=depth, uniform_layout="sequential",
      vocab=vocab), in_axes=(axes, None if q is None else 0, parents_axis, 0, 0, 0))(
      p, q, parents, node_tokens, uniforms, num_nodes)
    if plain:
      return result
  return jax.vmap(lambda r, p: finish_emitted(r, p, path_rows(r.path), pad_id=-1, k=logprobs,
                                              mode=mode), in_axes=(0, axes))(result, p)


@functools.cache
def default_tree_verifier(law: str, depth: int):
  """``tree_verify`` with the law and output length fixed (cached: one object per pair)."""
  return functools.partial(tree_verify, law=law, max_depth=depth)


def check_tree_args(tree, draft, draft_fns, law: str, tree_verifier, name: str):
  """``(tree, tree_verifier)`` of :func:`~specdec_jax.decoding.tree_speculative_generate`
  checked: the law, the tree against the draft, the verifier (the default one for ``law``
  when None, wrapped to compile once when a call-site function)."""
  if law not in TREE_LAWS:
    raise ValueError(f"{name}: `law` must be one of {TREE_LAWS}, got {law!r} instead.")
  if isinstance(tree, DynamicTree):
    tree = check_dynamic_tree(tree, name)
    if not isinstance(draft, FeatureDraft) or law != "deterministic":
      raise ValueError(f"{name}: a DynamicTree (EAGLE-2) needs a FeatureDraft and "
                       f"law='deterministic', got a {type(draft).__name__} draft and law={law!r}.")
    width = tree.top_k
  else:
    tree = check_draft_tree(tree, name)
    if tree.size < 2:
      raise ValueError(f"{name}: `tree` must have at least one node besides the root.")
    width = max(tree.ranks) + 1
  draft_vocab = draft_fns.draft_vocab if isinstance(draft_fns, FeatureFns) else (
    draft_fns.vocab_size)
  if law == "deterministic" and width > draft_vocab:
    raise ValueError(f"{name}: the tree asks for the top {width} candidates per node, but the "
                     f"draft's vocabulary has only {draft_vocab} ids; use a narrower tree or "
                     f"law='iid'.")
  if tree_verifier is None:
    tree_verifier = default_tree_verifier(law, tree.depth)
  elif not callable(tree_verifier):
    raise TypeError(f"{name}: `tree_verifier` must be a function, got {tree_verifier!r}.")
  else:
    tree_verifier = StaticFunction(tree_verifier)  # a call-site lambda compiles once
  return tree, tree_verifier
