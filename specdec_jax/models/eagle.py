"""An EAGLE-style draft for a Llama target: one decoder layer on the target's features.

The draft (Li et al. 2024, EAGLE, arXiv:2401.15077) predicts the target's next top-layer
feature rather than its next token. At position ``t`` it reads the target's feature
``f[t - 1]`` (the final-normed hidden state the target's head read at ``t - 1``) and the
embedding of the token ``x[t]``:

  ``g[t] = Layer(concat(embed(x[t]), f[t - 1]) @ fc)``,   ``logits[t] = g[t] @ head.T``

``g[t]`` stands in for ``f[t]``: it is fed back as the next step's feature while the draft runs
ahead of the target, and the target's own features replace it once the target has scored the
tokens. The layer is a Llama decoder block of the target's width with its own small KV cache;
the token embedding is the target's (shared, not stored); the head is a frequency-ranked subset
of the target's own output rows (FR-Spec, Zhao et al. 2025, arXiv:2502.14856), so a draft step
does not pay for the full vocabulary. Tokens outside the subset get ``q = 0``, which the
verification rule handles exactly.

Stored weights (:func:`save_eagle` / :func:`load_eagle`) hold only ``fc``, the layer and the
subset's token ids, in float16; :func:`make_eagle_draft` joins them to the target's arrays.

**Fused features** (EAGLE-3, Li et al. 2025, arXiv:2503.01840): a draft trained with
``fuse`` reads, in place of the target's top feature, a projection of a low, a middle and a
high hidden state of the target (:func:`fused_layers`, :func:`fuse_features`); the target
that computes it is :func:`make_fused_target`. Its own output ``g[t]`` is still fed back while
it runs ahead; nothing ties ``g`` to the target's features (no feature regression), the
training-time test teaches the draft to read its own outputs.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdec_jax.models.llama import FINAL_FEATURES
from specdec_jax.models.llama import KVCache
from specdec_jax.models.llama import LayerParams
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.models.llama import LlamaParams
from specdec_jax.models.llama import decoder_layer
from specdec_jax.models.llama import init_cache as llama_init_cache
from specdec_jax.models.llama import make_model
from specdec_jax.models.llama import rope_angles
from specdec_jax.models.llama import tree_visibility
from specdec_jax.models.protocol import FeatureDraft
from specdec_jax.models.protocol import Model
from specdec_jax.models.protocol import check_vocab_ids


class EagleWeights(NamedTuple):
  """The draft's own trained arrays (what is stored).

  Attributes:
    fc: ``(2 D, D)``: ``concat(embedding, feature) @ fc`` is the layer's input.
    layer: :class:`~specdec_jax.models.llama.LayerParams` of one layer (leading axis 1).
    fuse: ``(k D, D)`` or None: EAGLE-3's projection of the target's ``k`` fused hidden
      states (:func:`fuse_features`); None for a draft that reads the top feature.
  """

  fc: jax.Array
  layer: LayerParams
  fuse: jax.Array | None = None


class FusedTargetParams(NamedTuple):
  """The parameters of :func:`make_fused_target`'s model: the target's and the projection.

  Attributes:
    target: the target's :class:`~specdec_jax.models.llama.LlamaParams`.
    fuse: ``(k D, D)``, :attr:`EagleWeights.fuse`.
  """

  target: LlamaParams
  fuse: jax.Array


def fused_layers(n_layers: int) -> tuple[int, ...]:
  """EAGLE-3's low, middle and high layers of an ``n_layers`` target: the hidden states
  entering layers ``2``, ``n_layers // 2`` and ``n_layers - 3`` (distinct ones, fewer for a
  target of under 6 layers). SmolLM2-135M (30 layers): ``(2, 15, 27)``."""
  return tuple(sorted({min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0)}))


def fused_label(n_layers: int) -> str:
  """``Model.features`` of :func:`make_fused_target` (and ``FeatureDraft.reads`` of a fused
  draft) for a target of ``n_layers`` layers."""
  return f"EAGLE-3 fusion of the hidden states entering layers {fused_layers(n_layers)}"


def fuse_features(hidden: jax.Array, fuse: jax.Array, eps: float = 1e-6) -> jax.Array:
  """EAGLE-3's fused feature: each of the ``k`` hidden states RMS-normalised (no weights, so
  the residual stream's growth with depth does not weigh them), concatenated, times ``fuse``.

  Args:
    hidden: ``(..., k D)``: what :func:`~specdec_jax.models.llama.llama_apply_features` returns
      with ``feature_layers=fused_layers(L)``.
    fuse: ``(k D, D)``.

  Returns:
    float32 ``(..., D)``.
  """
  d = fuse.shape[1]
  h = hidden.astype(jnp.float32).reshape(*hidden.shape[:-1], -1, d)
  h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
  return h.reshape(*hidden.shape[:-1], -1) @ fuse.astype(jnp.float32)


class EagleParams(NamedTuple):
  """Everything the draft's forward reads (a pytree of arrays).

  Attributes:
    weights: :class:`EagleWeights`.
    embed: ``(V, D)`` the target's token embedding (shared with the target).
    head: ``(K, D)`` the target's output rows of the draft vocabulary.
  """

  weights: EagleWeights
  embed: jax.Array
  head: jax.Array


def layer_config(target: LlamaConfig) -> LlamaConfig:
  """The shape of the draft's single decoder layer: the target's width, one layer."""
  return target._replace(n_layers=1)


def init_weights(key: jax.Array, target: LlamaConfig, *, fused: bool = False) -> EagleWeights:
  """Fresh weights: ``fc`` maps the feature half to itself (the draft starts as "copy the
  feature, apply the layer"), the layer is small so the residual path dominates; with
  ``fused``, ``fuse`` starts as the normalised high hidden state."""
  c = layer_config(target)
  d = c.dim
  n_q, n_kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  keys = iter(jax.random.split(key, 8))

  def dense(shape, scale=0.02):
    return scale * jax.random.normal(next(keys), shape, jnp.float32)

  fc = jnp.concatenate([dense((d, d)), jnp.eye(d, dtype=jnp.float32)], axis=0)
  layer = LayerParams(
    attn_norm=jnp.ones((1, d)), wq=dense((1, d, n_q)), wk=dense((1, d, n_kv)),
    wv=dense((1, d, n_kv)), wo=dense((1, n_q, d)), mlp_norm=jnp.ones((1, d)),
    w_gate=dense((1, d, c.ffn_dim)), w_up=dense((1, d, c.ffn_dim)),
    w_down=dense((1, c.ffn_dim, d)))
  if not fused:
    return EagleWeights(fc=fc, layer=layer)
  k = len(fused_layers(target.n_layers))
  fuse = jnp.concatenate([jnp.zeros(((k - 1) * d, d)), jnp.eye(d)], axis=0)
  return EagleWeights(fc=fc, layer=layer, fuse=fuse)


def weight_shapes(target: LlamaConfig, *, fused: bool = False) -> dict[str, tuple[int, ...]]:
  """The shape of each array of a draft for ``target``, by its name in :func:`save_eagle`'s file
  (``fc``, ``layer.<field>`` with a leading layer axis of 1, and ``fuse`` when ``fused``)."""
  d, f = target.dim, target.ffn_dim
  n_q, n_kv = target.n_heads * target.head_dim, target.n_kv_heads * target.head_dim
  layer = dict(attn_norm=(d,), wq=(d, n_q), wk=(d, n_kv), wv=(d, n_kv), wo=(n_q, d),
               mlp_norm=(d,), w_gate=(d, f), w_up=(d, f), w_down=(f, d))
  shapes = {"fc": (2 * d, d), **{f"layer.{k}": (1, *v) for k, v in layer.items()}}
  if fused:
    shapes["fuse"] = (len(fused_layers(target.n_layers)) * d, d)
  return shapes


def check_weights(fn: str, weights: EagleWeights, target: LlamaConfig) -> None:
  """``ValueError`` naming ``weights.<name>`` unless every array has :func:`weight_shapes`'s
  shape for ``target`` (a wrong one would fail deep in tracing, a two-layer ``layer`` be cut)."""
  if not isinstance(weights, EagleWeights) or not isinstance(weights.layer, LayerParams):
    raise TypeError(f"{fn}: `weights` must be an EagleWeights with a LayerParams layer, got "
                    f"{type(weights).__name__} instead.")
  arrays = {"fc": weights.fc, "fuse": weights.fuse,
            **{f"layer.{k}": v for k, v in weights.layer._asdict().items()}}
  for name, shape in weight_shapes(target, fused=weights.fuse is not None).items():
    if tuple(jnp.shape(arrays[name])) != shape:
      raise ValueError(f"{fn}: `weights.{name}` must have shape {shape} for the target's "
                       f"config (dim {target.dim}, {target.n_heads} heads and {target.n_kv_heads} "
                       f"kv heads of {target.head_dim}, ffn {target.ffn_dim}; one layer), got "
                       f"{tuple(jnp.shape(arrays[name]))} instead.")


def eagle_apply(params: EagleParams, tokens: jax.Array, features: jax.Array, positions: jax.Array,
                cache: KVCache, *, config: LlamaConfig) -> tuple[jax.Array, jax.Array, KVCache]:
  """The draft's forward over ``T`` tokens per row: ``FeatureDraft.apply``.

  Args:
    params: :class:`EagleParams`.
    tokens: int32 ``(B, T)`` target token ids ``x[t]``.
    features: float32 ``(B, T, D)``: ``f[t - 1]``, the target's (or the draft's own predicted)
      feature at the position before each token.
    positions: int32 ``(B, T)``: the position ``t`` of each token; written to cache slot ``t``,
      attends to slots ``0 .. t`` (rollback by length, as the Llama's cache).
    cache: :class:`~specdec_jax.models.llama.KVCache` of one layer.
    config: the draft layer's shape (:func:`layer_config`).

  Returns:
    ``(logits (B, T, K), features (B, T, D), cache)``: logits over the draft vocabulary and the
    predicted features ``g[t]``.
  """
  positions = jnp.asarray(positions, jnp.int32)
  size = cache.k.shape[3]
  visible = jnp.arange(size, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
  return _layer(params, tokens, features, positions, positions, visible, cache, config)


def eagle_tree_apply(params: EagleParams, tokens: jax.Array, features: jax.Array,
                     positions: jax.Array, cache: KVCache, start: jax.Array, nodes: jax.Array,
                     tree_mask: jax.Array, *, config: LlamaConfig
                     ) -> tuple[jax.Array, jax.Array, KVCache]:
  """The draft's forward over nodes of a draft tree: ``FeatureDraft.tree_apply`` (EAGLE-2).

  Node ``nodes[t]`` is written to slot ``start + nodes[t]`` and attends to the slots before
  ``start`` and to its ancestors' tree slots (:func:`~specdec_jax.models.llama.tree_visibility`);
  ``features[:, t]`` is the feature its parent predicted.

  Returns:
    ``(logits (B, T, K), features (B, T, D), cache)``.

  Reference:
    Li et al., "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees",
    arXiv:2406.16858.
  """
  slots, visible = tree_visibility(start, nodes, tree_mask, cache.k.shape[3])
  return _layer(params, tokens, features, jnp.asarray(positions, jnp.int32), slots, visible,
                cache, config)


def _layer(params: EagleParams, tokens, features, positions, slots, visible, cache: KVCache,
           config: LlamaConfig):
  """``concat(embed(x), f) @ fc``, the decoder layer (written at ``slots``), the head."""
  e = jnp.take(params.embed, jnp.asarray(tokens, jnp.int32), axis=0, mode="clip")
  x = jnp.concatenate([e, features.astype(jnp.float32)], axis=-1) @ params.weights.fc
  cos, sin = rope_angles(positions, config)
  w = jax.tree.map(lambda a: a[0], params.weights.layer)
  g, cache = decoder_layer(config, w, x, cache, jnp.int32(0), slots, visible, cos, sin)
  return g @ params.head.T, g, cache


def make_eagle_draft(weights: EagleWeights, vocab_ids: np.ndarray | jax.Array,
                     target_params: LlamaParams, target_config: LlamaConfig, *,
                     name: str = "eagle") -> FeatureDraft:
  """Join trained draft weights to the target's arrays: a :class:`FeatureDraft`.

  Args:
    weights: :class:`EagleWeights`.
    vocab_ids: int ``(K,)`` distinct target token ids, the draft vocabulary.
    target_params: the target's :class:`~specdec_jax.models.llama.LlamaParams` (its embedding
      and output rows are read, not copied into the stored weights).
    target_config: the target's shape.
    name: label for tables.

  Returns:
    :class:`~specdec_jax.decoding.FeatureDraft` for
    :func:`~specdec_jax.decoding.speculative_generate` (with a target that has
    ``apply_features``; for weights with ``fuse``, the target of :func:`make_fused_target`,
    without which the draft reads features it was not trained on: still exact, rarely accepted).

  Raises:
    ValueError: a weight whose shape is not :func:`weight_shapes`'s for ``target_config``
      (named: ``weights.layer.wq``), or ``vocab_ids`` that are not distinct ids in ``[0, V)``.

  Example:
    >>> import jax
    >>> from specdec_jax.models import llama
    >>> c = llama.LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1,
    ...                       head_dim=8, ffn_dim=32)
    >>> p = llama.init_params(jax.random.key(0), c)
    >>> draft = make_eagle_draft(init_weights(jax.random.key(1), c), range(8), p, c)
    >>> draft.params.head.shape
    (8, 16)

  Reference:
    Li et al., "EAGLE", arXiv:2401.15077; Zhao et al., "FR-Spec", arXiv:2502.14856.
  """
  if isinstance(vocab_ids, range):
    vocab_ids = np.asarray(vocab_ids)
  check_weights("make_eagle_draft", weights, target_config)
  ids = check_vocab_ids("make_eagle_draft", vocab_ids, target_config.vocab_size)
  head_all = target_params.embed if target_params.output is None else target_params.output
  params = EagleParams(weights=jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), weights),
                       embed=target_params.embed, head=jnp.take(head_all, ids, axis=0))
  apply, cache, tree_apply = _functions(layer_config(target_config))
  reads = (FINAL_FEATURES if weights.fuse is None
           else fused_label(target_config.n_layers))
  return FeatureDraft(params=params, apply=apply, init_cache=cache, vocab_ids=ids, name=name,
                      tree_apply=tree_apply, reads=reads)


def make_fused_target(weights: EagleWeights, target_params: LlamaParams,
                      target_config: LlamaConfig, *, name: str = "llama") -> Model:
  """The target as a fused-feature draft reads it (EAGLE-3): its feature forms return
  :func:`fuse_features` of its :func:`fused_layers`; ``apply`` and ``tree_apply`` are the
  target's own (same logits, so plain decoding and verification are unchanged).

  Args:
    weights: :class:`EagleWeights` with ``fuse`` (trained with it).
    target_params: the target's :class:`~specdec_jax.models.llama.LlamaParams`.
    target_config: the target's shape.
    name: label for tables.

  Returns:
    :class:`~specdec_jax.models.protocol.Model` with params :class:`FusedTargetParams`, for
    :func:`~specdec_jax.decoding.speculative_generate` with the draft of
    :func:`make_eagle_draft` (same weights).

  Raises:
    ValueError: ``weights.fuse`` is None or not ``(k D, D)``.

  Example:
    >>> import jax
    >>> from specdec_jax.models import llama
    >>> c = llama.LlamaConfig(vocab_size=32, dim=16, n_layers=6, n_heads=2, n_kv_heads=1,
    ...                       head_dim=8, ffn_dim=32)
    >>> p = llama.init_params(jax.random.key(0), c)
    >>> w = init_weights(jax.random.key(1), c, fused=True)
    >>> target = make_fused_target(w, p, c)
    >>> _, f, _ = target.apply_features(target.params, jax.numpy.zeros((1, 3), "int32"),
    ...                                 jax.numpy.arange(3)[None], target.init_cache(1, 8))
    >>> f.shape
    (1, 3, 16)

  Reference:
    Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
    Training-Time Test", arXiv:2503.01840.
  """
  taps = fused_layers(target_config.n_layers)
  shape = (len(taps) * target_config.dim, target_config.dim)
  if weights.fuse is None or tuple(weights.fuse.shape) != shape:
    got = None if weights.fuse is None else tuple(weights.fuse.shape)
    raise ValueError(f"make_fused_target: `weights.fuse` must be {shape} (the projection of "
                     f"the target's layers {taps}; train with --fused), got {got}")
  base = make_model(target_params, target_config, name=name, feature_layers=taps)
  apply, tree_apply, features, tree_features = _fused_functions(
    base.apply, base.tree_apply, base.apply_features, base.tree_apply_features)
  params = FusedTargetParams(target=target_params, fuse=jnp.asarray(weights.fuse, jnp.float32))
  return base._replace(params=params, apply=apply, tree_apply=tree_apply,
                       apply_features=features, tree_apply_features=tree_features,
                       features=fused_label(target_config.n_layers))


@functools.cache
def _fused_functions(apply, tree_apply, features, tree_features):
  """The target's functions on :class:`FusedTargetParams`, built once per target shape (so
  loops that take them as static arguments compile once)."""

  def on_target(fn):
    @functools.wraps(fn)
    def call(params, *args):
      return fn(params.target, *args)
    return call

  def fused(fn):
    @functools.wraps(fn)
    def call(params, *args):
      logits, hidden, cache = fn(params.target, *args)
      return logits, fuse_features(hidden, params.fuse), cache
    return call

  return on_target(apply), on_target(tree_apply), fused(features), fused(tree_features)


@functools.cache
def _functions(config: LlamaConfig):
  apply = jax.jit(functools.partial(eagle_apply, config=config))
  tree_apply = jax.jit(functools.partial(eagle_tree_apply, config=config))
  return apply, functools.partial(llama_init_cache, config, n_layers=1), tree_apply


def save_eagle(path: str | Path, weights: EagleWeights, vocab_ids: np.ndarray) -> None:
  """Store the draft compactly: float16 arrays and int32 ids in one ``.npz``."""
  arrays = {"fc": np.asarray(weights.fc, np.float16),
            "vocab_ids": np.asarray(vocab_ids, np.int32)}
  for field, value in weights.layer._asdict().items():
    arrays[f"layer.{field}"] = np.asarray(value, np.float16)
  if weights.fuse is not None:
    arrays["fuse"] = np.asarray(weights.fuse, np.float16)
  np.savez_compressed(path, **arrays)


def load_eagle(path: str | Path) -> tuple[EagleWeights, np.ndarray]:
  """Read what :func:`save_eagle` wrote: ``(weights (float32), vocab_ids)``."""
  with np.load(path) as z:
    layer = LayerParams(**{f: jnp.asarray(z[f"layer.{f}"], jnp.float32)
                           for f in LayerParams._fields})
    fuse = jnp.asarray(z["fuse"], jnp.float32) if "fuse" in z.files else None
    return EagleWeights(fc=jnp.asarray(z["fc"], jnp.float32), layer=layer,
                        fuse=fuse), z["vocab_ids"]


def num_weights(weights: EagleWeights) -> int:
  """How many numbers the stored draft holds (its size is twice this in bytes, float16)."""
  return sum(math.prod(a.shape) for a in jax.tree.leaves(weights))
