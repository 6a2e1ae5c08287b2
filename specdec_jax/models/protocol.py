"""The small protocol through which any JAX language model enters the decoding loop.

A model is a bundle of pure functions and its parameters. The decoding loop never
looks inside ``params`` or ``cache``; it only calls these functions, so a Flax or
Equinox module, the Llama in :mod:`specdec_jax.models.llama`, or a toy model all fit.

Contract of ``apply(params, tokens, positions, cache) -> (logits, cache)``:

* ``tokens``: int32 ``(B, T)`` with a static ``T`` (the loop uses ``T = 1``, ``2``
  and ``gamma + 1``); ``positions``: int32 ``(B, T)``, the absolute position of each
  token in its sequence (rows may be at different positions: ragged batches).
* The cache has a fixed size ``max_len`` along the position axis, and the token at
  position ``t`` is written to slot ``t`` (overwriting whatever was there).
* The token at position ``t`` attends to slots ``0 .. t`` only. So writing past the
  accepted length and later overwriting it is a complete rollback: the loop just
  moves each sequence's length back, no cache data is copied or cleared.
* ``logits``: float32 ``(B, T, V)``, the next-token logits after each input token.
* Pure: no side effects, jit-, vmap- and while_loop-safe; ``cache`` is a pytree of
  arrays with static shapes.

``init_cache(batch, max_len) -> cache`` returns an empty cache.

Two optional functions let a model verify a whole draft *tree* in one call
(:func:`~specdec_jax.decoding.tree_speculative_generate`; SpecInfer's tree attention):

* ``tree_apply(params, tokens (B, T), positions (B, T), cache, start (B,), nodes (T,),
  tree_mask (T, N)) -> (logits, cache)``: a tree of ``N`` nodes occupies the slots
  ``start .. start + N - 1`` of each row; token ``t`` is node ``nodes[t]``, written to
  slot ``start + nodes[t]``, rotated/embedded at ``positions[b, t]``, and it attends to
  every slot before ``start`` and to the tree slots ``start + j`` with ``tree_mask[t, j]``
  (its ancestors and itself), nothing else. A mask ``(B, T, N)`` gives each row its own tree
  (``tree_mask[b, t, j]``; the dynamic trees of EAGLE-2,
  :class:`~specdec_jax.decoding.DynamicTree`); a model that accepts only ``(T, N)`` still
  runs every static tree.
* ``copy_slots(cache, src (B, K), dst (B, K)) -> cache``: copy slot ``src[b, k]`` to
  ``dst[b, k]`` (every read before any write; ``src == dst`` is a no-op). The loop moves
  the accepted path from its tree slots to the slots of its positions with it.

A draft that reads the target's features (EAGLE) enters as a :class:`FeatureDraft`, defined
here with ``Model`` so that the models that build one need not import the decoding loops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax._core.checks import INT
from specdec_jax._core.checks import host_array
from specdec_jax._core.checks import is_concrete


class Model(NamedTuple):
  """A language model as pure functions (see the module docstring for the contract).

  Attributes:
    params: any pytree of arrays.
    apply: ``apply(params, tokens (B, T) int32, positions (B, T) int32, cache)
      -> (logits (B, T, V) float32, cache)``.
    init_cache: ``init_cache(batch: int, max_len: int) -> cache``.
    vocab_size: ``V``.
    name: a label for tables and logs.
    tree_apply: optional tree-attention forward (see the module docstring); needed by
      :func:`~specdec_jax.decoding.tree_speculative_generate`.
    copy_slots: optional ``copy_slots(cache, src, dst) -> cache``; needed with ``tree_apply``.
    apply_features: optional ``apply_features(params, tokens, positions, cache) -> (logits,
      features (B, T, D), cache)``: ``apply`` that also returns the hidden states the output
      head reads. Needed of a *target* whose draft reads its features
      (:class:`FeatureDraft`, EAGLE); other loops never call it.
    tree_apply_features: optional ``tree_apply`` that also returns the features, ``(logits,
      features (B, T, D), cache)``: needed of a target whose feature draft drafts a tree
      (:func:`~specdec_jax.decoding.tree_speculative_generate` with a ``FeatureDraft``).
    context_length: optional number of positions the model was trained for (its context
      window). The decoding loops never generate past it: a budget that does not fit raises
      when the lengths are concrete, and rows that reach it stop with ``OUT_OF_ROOM``.
    features: optional label of what the feature forms return (for a Llama
      ``"final-normed hidden state"``, or EAGLE-3's fused layers). A :class:`FeatureDraft`
      whose ``reads`` is set runs only with a target whose label is the same: a draft fed
      features it was not trained on stays exact but is rarely accepted.
  """

  params: Any
  apply: Callable[..., Any]
  init_cache: Callable[[int, int], Any]
  vocab_size: int
  name: str = "model"
  tree_apply: Callable[..., Any] | None = None
  copy_slots: Callable[..., Any] | None = None
  context_length: int | None = None
  apply_features: Callable[..., Any] | None = None
  tree_apply_features: Callable[..., Any] | None = None
  features: str | None = None


class FeatureDraft(NamedTuple):
  """A draft that reads the target's features (EAGLE), over a subset of its vocabulary.

  At position ``t`` the draft reads the token ``x[t]`` and the target's feature ``f[t - 1]``
  (the hidden state its head read at ``t - 1``; the target must provide
  ``Model.apply_features``) and returns logits for ``x[t + 1]`` over its vocabulary
  ``vocab_ids`` and a predicted feature ``g[t]``, which it reads in place of ``f[t]`` while it
  runs ahead of the target. :func:`~specdec_jax.decoding.speculative_generate` syncs it each
  iteration on the tokens the target has just scored, with the target's own features, then
  drafts. Its ``q`` is zero outside ``vocab_ids``; the verification rule is exact for that as
  for any ``q``.

  Attributes:
    params: any pytree of arrays.
    apply: ``apply(params, tokens (B, T), features (B, T, D), positions (B, T), cache) ->
      (logits (B, T, K), features (B, T, D), cache)``, with the cache contract of
      :class:`Model` (slot ``t`` for position ``t``, attends to ``0 .. t``).
    init_cache: ``init_cache(batch, max_len) -> cache``.
    vocab_ids: int32 ``(K,)`` distinct target token ids: logit ``k`` is for token
      ``vocab_ids[k]``.
    name: a label for tables.
    tree_apply: optional tree-attention form for
      :func:`~specdec_jax.decoding.tree_speculative_generate`: ``tree_apply(params, tokens
      (B, T), features (B, T, D), positions (B, T), cache, start (B,), nodes (T,), tree_mask
      (T, N)) -> (logits (B, T, K), features (B, T, D), cache)``, with the slot and visibility
      contract of ``Model.tree_apply``; ``features[:, t]`` is the predicted feature of node
      ``nodes[t]``'s parent.
    reads: optional label of the target features the draft was trained on; when both it and
      the target's ``Model.features`` are set they must be equal (the loops raise otherwise).

  Reference:
    Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML 2024,
    arXiv:2401.15077; Zhao et al., "FR-Spec: Accelerating Large-Vocabulary Language Models via
    Frequency-Ranked Speculative Sampling", arXiv:2502.14856.
  """

  params: Any
  apply: Callable[..., Any]
  init_cache: Callable[[int, int], Any]
  vocab_ids: Any
  name: str = "feature draft"
  tree_apply: Callable[..., Any] | None = None
  reads: str | None = None


def check_vocab_ids(fn: str, vocab_ids, vocab: int) -> jax.Array:
  """A draft vocabulary as int32 ``(K,)``: distinct integer token ids in ``[0, vocab)``.

  Integer dtype and shape always raise; range and distinctness where the host can read the
  values. Float ids are refused, not truncated (``[0.5, 1.5]`` is not ``[0, 1]``).

  Example:
    >>> check_vocab_ids("f", [3, 1, 2], 8).tolist()
    [3, 1, 2]
  """
  ids = host_array(fn, "vocab_ids", vocab_ids, INT)
  dtype = ids.dtype if hasattr(ids, "dtype") else np.asarray(ids).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{fn}: `vocab_ids` must be integer token ids, got dtype {dtype} instead.")
  if jnp.ndim(ids) != 1 or jnp.shape(ids)[0] == 0:
    raise ValueError(f"{fn}: `vocab_ids` must have shape (K,) with K >= 1, got "
                     f"{tuple(jnp.shape(ids))} instead.")
  if is_concrete(ids):
    host = np.asarray(ids).astype(np.int64)
    if host.min() < 0 or host.max() >= vocab or np.unique(host).size != host.size:
      raise ValueError(f"{fn}: `vocab_ids` must be distinct ids in [0, {vocab}), got "
                       f"{host.size} ids in [{host.min()}, {host.max()}]"
                       f"{'' if np.unique(host).size == host.size else ' with repeats'}.")
  return jnp.asarray(ids, jnp.int32)
