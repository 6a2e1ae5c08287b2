"""A Llama-architecture decoder in JAX behind the :class:`Model` protocol, and a NumPy reference.

Architecture (Touvron et al. 2023, "LLaMA", arXiv:2302.13971; grouped-query attention from
Ainslie et al. 2023, arXiv:2305.13245, as in Llama 2): token embedding; for each layer
``x += Attention(RMSNorm(x))`` and ``x += SwiGLU(RMSNorm(x))``; a final RMSNorm; the output
head (the embedding matrix itself when ``tie_embeddings``).

RoPE (Su et al. 2021, "RoFormer", arXiv:2104.09864) is used in the *rotate-half* form of
Hugging Face ``transformers``: in every head, dimension ``i`` is rotated together with
dimension ``i + head_dim / 2``. GGUF files store the q/k projections permuted for llama.cpp's
*interleaved* pairing ``(2i, 2i + 1)``; :mod:`specdec_jax.app.gguf` undoes that
permutation at load time, so the parameters here are in the Hugging Face layout.

The KV cache has a fixed ``max_len`` slots per layer. The token at position ``t`` is written
to slot ``t`` and attends to slots ``0 .. t`` (the mask is ``key_slot <= query_position`` and
nothing else), so anything written past a sequence's length is invisible to it and is
overwritten later: rollback is free, as :mod:`specdec_jax.models.protocol` requires.

``make_model(..., layers=...)`` runs only a subset of the layers (self-speculation by layer
skipping, e.g. Zhang et al. 2024, "Draft & Verify", arXiv:2309.08168): the draft reads the
same parameter arrays; only its cache is smaller.

The configuration, parameters and cache are defined in :mod:`specdec_jax.models.llama_params`,
the layers and the cache-addressed forward in :mod:`specdec_jax.models.llama_forward`; this
module builds the :class:`Model` on them and re-exports their public names.

All computation is float32. :func:`reference_logits` is a plain NumPy forward (no cache,
float64 by default) written for reading, to check the JAX one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax._core.checks import is_concrete
from specdec_jax.models.llama_forward import copy_slots
from specdec_jax.models.llama_forward import decoder_layer as decoder_layer
from specdec_jax.models.llama_forward import forward
from specdec_jax.models.llama_forward import rms_norm as rms_norm
from specdec_jax.models.llama_forward import rope as rope
from specdec_jax.models.llama_forward import rope_angles as rope_angles
from specdec_jax.models.llama_forward import tree_visibility
from specdec_jax.models.llama_params import KVCache
from specdec_jax.models.llama_params import LayerParams as LayerParams
from specdec_jax.models.llama_params import LlamaConfig
from specdec_jax.models.llama_params import LlamaParams
from specdec_jax.models.llama_params import check_config
from specdec_jax.models.llama_params import init_cache
from specdec_jax.models.llama_params import init_params as init_params
from specdec_jax.models.protocol import Model


def llama_apply(
  params: LlamaParams,
  tokens: jax.Array,
  positions: jax.Array,
  cache: KVCache,
  *,
  config: LlamaConfig,
  layers: tuple[int, ...] | None = None,
) -> tuple[jax.Array, KVCache]:
  """The Llama forward over ``T`` new tokens per row, reading and updating the KV cache.

  Args:
    params: :class:`LlamaParams` (all ``config.n_layers`` layers, even when ``layers`` is set).
    tokens: int32 ``(B, T)``, ids in ``[0, V)`` (ids outside give NaN logits).
    positions: int32 ``(B, T)``, the absolute position of each token; rows may differ (ragged
      batches). Token ``(b, t)`` is written to slot ``positions[b, t]`` and attends to slots
      ``0 .. positions[b, t]``. Positions outside ``[0, max_len)`` raise ``ValueError`` when
      concrete (the :class:`Model`'s ``apply`` checks them); traced, they are not written and
      their logits are NaN. Positions past ``config.max_position`` are computed, but outside
      the range the model was trained for: the decoding loops never go there.
    cache: :class:`KVCache` from :func:`init_cache` with one entry per layer run.
    config: the static model shape.
    layers: static tuple of the layer indices to run, in order (``None``: all). The final
      norm and the output head always run.

  Returns:
    ``(logits, cache)``: float32 ``(B, T, V)`` next-token logits after each token, and the
    updated cache.
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  size = cache.k.shape[3]
  visible = jnp.arange(size, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]  # (B, T, S)
  logits, _, cache = forward(params, tokens, positions, positions, visible, cache, config,
                             layers)
  return logits, cache


def llama_apply_features(
  params: LlamaParams,
  tokens: jax.Array,
  positions: jax.Array,
  cache: KVCache,
  *,
  config: LlamaConfig,
  layers: tuple[int, ...] | None = None,
  feature_layers: tuple[int, ...] | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
  """:func:`llama_apply` that also returns the hidden states the output head reads.

  The protocol's ``Model.apply_features``, for drafts that read the target's features
  (EAGLE, :mod:`specdec_jax.models.eagle`).

  Args:
    feature_layers: static increasing indices into the layers run, or ``None``. When given,
      the features are the hidden states entering those layers, concatenated (EAGLE-3 reads a
      low, a middle and a high one; :func:`~specdec_jax.models.eagle.fused_layers`); the
      number of layers run stands for the last one's output (before the final norm).

  Returns:
    ``(logits (B, T, V), features (B, T, D), cache)``: ``features`` are the final-normed hidden
    states, so ``logits = features @ head.T``; with ``feature_layers``, ``(B, T, k * D)`` for
    ``k`` layers.

  Reference:
    Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
    arXiv:2401.15077 (the draft reads the target's top-layer features); Li et al., "EAGLE-3",
    arXiv:2503.01840 (low, middle and high features).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  size = cache.k.shape[3]
  visible = jnp.arange(size, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
  taps = check_feature_layers("llama_apply_features", feature_layers, config, layers)
  return forward(params, tokens, positions, positions, visible, cache, config, layers, taps)


def check_feature_layers(fn: str, feature_layers, config: LlamaConfig,
                         layers: tuple[int, ...] | None) -> tuple[int, ...] | None:
  """``feature_layers`` as a tuple of ints after checking that they increase and index the
  layers run; ``None`` stays ``None``. Raises ``ValueError`` naming ``fn`` otherwise."""
  if feature_layers is None:
    return None
  n_run = config.n_layers if layers is None else len(layers)
  taps = tuple(int(i) for i in feature_layers)
  if not taps or any(not 0 <= i <= n_run for i in taps) or list(taps) != sorted(set(taps)):
    raise ValueError(f"{fn}: `feature_layers` must be increasing indices in [0, {n_run}] (the "
                     f"layers run; {n_run}: the last one's output), got {tuple(feature_layers)}")
  return taps


def llama_tree_apply(
  params: LlamaParams,
  tokens: jax.Array,
  positions: jax.Array,
  cache: KVCache,
  start: jax.Array,
  nodes: jax.Array,
  tree_mask: jax.Array,
  *,
  config: LlamaConfig,
  layers: tuple[int, ...] | None = None,
) -> tuple[jax.Array, KVCache]:
  """The Llama forward over the nodes of a draft tree (tree attention): ``Model.tree_apply``.

  The tree's ``N`` nodes occupy the slots ``start .. start + N - 1`` of each row. Token
  ``(b, t)`` is tree node ``nodes[t]``: it is rotated by ``positions[b, t]`` (its depth
  plus ``start``), written to slot ``start[b] + nodes[t]``, and attends to every slot
  before ``start[b]`` (the accepted context) and to the tree slots ``start[b] + j`` with
  ``tree_mask[t, j]`` (its ancestors and itself). Nothing after the tree is read.

  Args:
    params, config, layers: as in :func:`llama_apply`.
    tokens: int32 ``(B, T)``.
    positions: int32 ``(B, T)``.
    cache: :class:`KVCache`.
    start: int32 ``(B,)``, the slot of tree node 0 in each row.
    nodes: int32 ``(T,)``, the tree node of each token, in ``[0, N)``.
    tree_mask: bool ``(T, N)``.

  Returns:
    ``(logits (B, T, V) float32, cache)``.

  Reference:
    Miao et al., "SpecInfer", arXiv:2305.09781 (tree attention).
  """
  slots, visible = tree_visibility(start, nodes, tree_mask, cache.k.shape[3])
  logits, _, cache = forward(params, jnp.asarray(tokens, jnp.int32),
                             jnp.asarray(positions, jnp.int32), slots, visible, cache, config,
                             layers)
  return logits, cache


def llama_tree_apply_features(
  params: LlamaParams,
  tokens: jax.Array,
  positions: jax.Array,
  cache: KVCache,
  start: jax.Array,
  nodes: jax.Array,
  tree_mask: jax.Array,
  *,
  config: LlamaConfig,
  layers: tuple[int, ...] | None = None,
  feature_layers: tuple[int, ...] | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
  """:func:`llama_tree_apply` that also returns the hidden states the head reads: the
  protocol's ``Model.tree_apply_features``, for a feature draft (EAGLE) that drafts a tree.

  Returns:
    ``(logits (B, T, V), features (B, T, D), cache)`` (``feature_layers`` as in
    :func:`llama_apply_features`).
  """
  slots, visible = tree_visibility(start, nodes, tree_mask, cache.k.shape[3])
  taps = check_feature_layers("llama_tree_apply_features", feature_layers, config, layers)
  return forward(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                 slots, visible, cache, config, layers, taps)


def make_model(
  params: LlamaParams,
  config: LlamaConfig,
  *,
  layers: Sequence[int] | None = None,
  name: str | None = None,
  feature_layers: Sequence[int] | None = None,
) -> Model:
  """Bundle a Llama as a :class:`Model` (jitted ``apply``, ``init_cache``).

  Args:
    params: :class:`LlamaParams` with all ``config.n_layers`` layers.
    config: the model shape.
    layers: indices of the layers to run, in order (``None``: all). A layer-skipping draft
      shares ``params`` with the full model; its cache holds only these layers. Final norm and
      output head always run. Small models tolerate little skipping: on SmolLM2-135M, every
      other layer gives perplexity in the millions, while skipping layers 4, 5, 16 and 17
      (the four that cost least) keeps a mean acceptance ``sum(min(p, q))`` of about 0.7.
    name: label for tables (default ``"llama"`` or ``"llama[k/L layers]"``).
    feature_layers: what the feature forms return (:func:`llama_apply_features`): ``None``,
      the final-normed hidden states; or increasing indices into the layers run, the hidden
      states entering them, concatenated (EAGLE-3, :func:`~specdec_jax.models.eagle.
      make_fused_target`).

  Returns:
    :class:`Model` with ``apply(params, tokens (B, T), positions (B, T), cache)
    -> (logits (B, T, V) float32, cache)``, ``init_cache(batch, max_len)``, the tree
    functions :func:`llama_tree_apply` and :func:`copy_slots`, the feature forms
    :func:`llama_apply_features` and :func:`llama_tree_apply_features` (``features``:
    :func:`feature_label`), and ``context_length = config.max_position``. Called with
    concrete arguments, ``apply`` and ``tree_apply`` raise on token ids outside ``[0, V)``
    and on cache slots outside ``[0, max_len)``.
  """
  check_config(config)
  layer_ids = None if layers is None else tuple(int(i) for i in layers)
  if layer_ids is not None:
    bad = [i for i in layer_ids if not 0 <= i < config.n_layers]
    if bad:
      raise ValueError(f"layer indices {bad} out of range [0, {config.n_layers})")
    if layer_ids == tuple(range(config.n_layers)):
      layer_ids = None  # all layers: the same functions as the full model
  if name is None:
    name = "llama" if layer_ids is None else f"llama[{len(layer_ids)}/{config.n_layers} layers]"
  taps = check_feature_layers("make_model", feature_layers, config, layer_ids)
  apply, make_cache, tree_apply, apply_features, tree_features = _functions(config, layer_ids,
                                                                            taps)
  return Model(
    params=params, apply=apply, init_cache=make_cache, vocab_size=config.vocab_size, name=name,
    tree_apply=tree_apply, copy_slots=_copy_slots_jit, context_length=config.max_position,
    apply_features=apply_features, tree_apply_features=tree_features,
    features=feature_label(taps),
  )


#: ``Model.features`` of a Llama whose feature forms return the final-normed hidden state.
FINAL_FEATURES = "final-normed hidden state"


def feature_label(feature_layers: Sequence[int] | None) -> str:
  """``Model.features`` of :func:`make_model` with these ``feature_layers`` (see there)."""
  if feature_layers is None:
    return FINAL_FEATURES
  return f"hidden states entering layers {tuple(int(i) for i in feature_layers)}"


@functools.cache
def _functions(config: LlamaConfig, layers: tuple[int, ...] | None,
               feature_layers: tuple[int, ...] | None = None):
  """``(apply, init_cache, tree_apply, apply_features, tree_apply_features)`` for a config,
  layer subset and feature layers, built once.

  Models of the same shape get the same function objects, so a loop that takes them as static
  (hashed) arguments compiles once for all of them.
  """
  n_run = config.n_layers if layers is None else len(layers)
  apply = jax.jit(functools.partial(llama_apply, config=config, layers=layers))
  tree_apply = jax.jit(functools.partial(llama_tree_apply, config=config, layers=layers))
  features = jax.jit(functools.partial(llama_apply_features, config=config, layers=layers,
                                       feature_layers=feature_layers))
  tree_features = jax.jit(functools.partial(llama_tree_apply_features, config=config,
                                            layers=layers, feature_layers=feature_layers))
  return (_checked_apply(apply, config.vocab_size), functools.partial(init_cache, config,
                                                                       n_layers=n_run),
          _checked_tree_apply(tree_apply, config.vocab_size),
          _checked_apply(features, config.vocab_size),
          _checked_tree_apply(tree_features, config.vocab_size))


def _check_ids(fn: str, tokens, vocab: int) -> None:
  if is_concrete(tokens):
    ids = np.asarray(tokens)
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
      index = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(f"{fn}: `tokens` ids must be in [0, V) = [0, {vocab}), got "
                       f"{int(ids[index])} at index {index}.")


def _check_slots(fn: str, arg: str, slots, size: int) -> None:
  if is_concrete(slots):
    where = np.asarray(slots)
    bad = (where < 0) | (where >= size)
    if bad.any():
      index = tuple(int(i) for i in np.argwhere(bad)[0])
      raise ValueError(
        f"{fn}: `{arg}` must address cache slots in [0, max_len) = [0, {size}), got "
        f"{int(where[index])} at index {index}; make the cache longer (init_cache)."
      )


def _checked_apply(apply, vocab: int):
  """``apply`` that raises on concrete out-of-range ids or slots (traced ones give NaN logits)."""

  @functools.wraps(apply)
  def checked(params, tokens, positions, cache):
    _check_ids("llama apply", tokens, vocab)
    _check_slots("llama apply", "positions", positions, cache.k.shape[3])
    return apply(params, tokens, positions, cache)

  return checked


def _checked_tree_apply(tree_apply, vocab: int):
  """``tree_apply`` with the checks of :func:`_checked_apply` (slots are ``start + nodes``)."""

  @functools.wraps(tree_apply)
  def checked(params, tokens, positions, cache, start, nodes, tree_mask):
    _check_ids("llama tree_apply", tokens, vocab)
    if is_concrete(start) and is_concrete(nodes):
      slots = np.asarray(start)[:, None] + np.asarray(nodes)[None, :]
      _check_slots("llama tree_apply", "start + nodes", slots, cache.k.shape[3])
    return tree_apply(params, tokens, positions, cache, start, nodes, tree_mask)

  return checked


_copy_slots_jit = jax.jit(copy_slots)
