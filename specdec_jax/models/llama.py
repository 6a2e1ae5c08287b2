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

All computation is float32. :func:`reference_logits` is a plain NumPy forward (no cache,
float64 by default) written for reading, to check the JAX one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax._checks import is_concrete
from specdec_jax.models.protocol import Model


class LlamaConfig(NamedTuple):
  """Static hyper-parameters of a Llama model (hashable: usable as a static argument).

  Attributes:
    vocab_size: ``V``.
    dim: model width ``D``.
    n_layers: number of transformer blocks ``L``.
    n_heads: query heads ``H``.
    n_kv_heads: key/value heads ``KV`` (``H`` must be a multiple of it: grouped-query attention).
    head_dim: per-head width ``hd`` (even, for RoPE).
    ffn_dim: hidden width ``F`` of the SwiGLU MLP.
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the output head is the token embedding (``params.output is None``).
    max_position: the context length the model was trained for (informational; the cache size
      is whatever ``init_cache`` is given).
  """

  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  ffn_dim: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  max_position: int = 2048


class LayerParams(NamedTuple):
  """The weights of all layers, stacked along a leading layer axis ``L``.

  Projections are stored ``(in, out)``: ``y = x @ w``. The q/k output features are in the
  Hugging Face (rotate-half RoPE) order, head-major: feature ``h * hd + i``.

  Attributes:
    attn_norm: ``(L, D)`` RMSNorm weight before attention.
    wq: ``(L, D, H * hd)``.
    wk: ``(L, D, KV * hd)``.
    wv: ``(L, D, KV * hd)``.
    wo: ``(L, H * hd, D)``.
    mlp_norm: ``(L, D)`` RMSNorm weight before the MLP.
    w_gate: ``(L, D, F)``.
    w_up: ``(L, D, F)``.
    w_down: ``(L, F, D)``.
  """

  attn_norm: jax.Array
  wq: jax.Array
  wk: jax.Array
  wv: jax.Array
  wo: jax.Array
  mlp_norm: jax.Array
  w_gate: jax.Array
  w_up: jax.Array
  w_down: jax.Array


class LlamaParams(NamedTuple):
  """All parameters of a Llama model (a pytree of float32 arrays).

  Attributes:
    embed: ``(V, D)`` token embedding.
    layers: :class:`LayerParams`, stacked over the ``L`` layers.
    final_norm: ``(D,)`` final RMSNorm weight.
    output: ``(V, D)`` output head (rows are unembedding vectors), or ``None`` when tied to
      ``embed``.
  """

  embed: jax.Array
  layers: LayerParams
  final_norm: jax.Array
  output: jax.Array | None


class KVCache(NamedTuple):
  """Fixed-size key/value cache of the layers a model runs.

  Attributes:
    k: ``(n_run_layers, B, KV, max_len, hd)`` float32; ``k[j, b, :, t]`` holds the keys of
      the token at position ``t`` of row ``b`` (this layout feeds both attention matmuls
      without a transpose).
    v: same shape, the values.
  """

  k: jax.Array
  v: jax.Array


def init_params(key: jax.Array, config: LlamaConfig, *, scale: float = 0.5) -> LlamaParams:
  """Random parameters for tests and toys (normal weights scaled by ``scale / sqrt(fan_in)``).

  Norm weights are ``1 + 0.1 * normal`` so that they matter, and the output head is separate
  unless ``config.tie_embeddings``.

  Args:
    key: a ``jax.random`` key.
    config: the model shape.
    scale: weight scale; ``0.5`` keeps the logits of a tiny model in a moderate range.

  Returns:
    :class:`LlamaParams` of float32 arrays.
  """
  c = config
  _check_config(c)
  n_q, n_kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
  keys = iter(jax.random.split(key, 16))

  def dense(shape):
    fan_in = shape[-2]
    return scale / math.sqrt(fan_in) * jax.random.normal(next(keys), shape, jnp.float32)

  def norm(shape):
    return 1.0 + 0.1 * jax.random.normal(next(keys), shape, jnp.float32)

  L = c.n_layers
  layers = LayerParams(
    attn_norm=norm((L, c.dim)),
    wq=dense((L, c.dim, n_q)),
    wk=dense((L, c.dim, n_kv)),
    wv=dense((L, c.dim, n_kv)),
    wo=dense((L, n_q, c.dim)),
    mlp_norm=norm((L, c.dim)),
    w_gate=dense((L, c.dim, c.ffn_dim)),
    w_up=dense((L, c.dim, c.ffn_dim)),
    w_down=dense((L, c.ffn_dim, c.dim)),
  )
  embed = jax.random.normal(next(keys), (c.vocab_size, c.dim), jnp.float32)
  output = None if c.tie_embeddings else dense((c.dim, c.vocab_size)).T
  return LlamaParams(embed=embed, layers=layers, final_norm=norm((c.dim,)), output=output)


def _check_config(c: LlamaConfig) -> None:
  if c.n_heads % c.n_kv_heads:
    raise ValueError(f"n_heads={c.n_heads} must be a multiple of n_kv_heads={c.n_kv_heads}")
  if c.head_dim % 2:
    raise ValueError(f"head_dim={c.head_dim} must be even for RoPE")


# ----------------------------------------------------------------------------------------------
# The JAX forward.


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight`` over the last axis."""
  mean_sq = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
  return x * lax.rsqrt(mean_sq + eps) * weight.reshape((1,) * (x.ndim - 1) + (-1,))


def _rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
  """``theta ** (-2i / head_dim)`` for ``i < head_dim / 2``, as in Hugging Face (float32)."""
  return (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(
    np.float32
  )


def rope_angles(positions: jax.Array, config: LlamaConfig) -> tuple[jax.Array, jax.Array]:
  """``(cos, sin)`` of the RoPE angles of ``positions (B, T)``: each ``(B, T, head_dim / 2)``."""
  inv_freq = jnp.asarray(_rope_inv_freq(config.head_dim, config.rope_theta))
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  return jnp.cos(angles), jnp.sin(angles)


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate-half RoPE: pairs ``(i, i + hd/2)`` of ``x (B, T, N, hd)`` by angles ``(B, T, hd/2)``."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def decoder_layer(
  config: LlamaConfig,
  w: LayerParams,
  x: jax.Array,
  cache: KVCache,
  j: jax.Array,
  slots: jax.Array,
  visible: jax.Array,
  cos: jax.Array,
  sin: jax.Array,
) -> tuple[jax.Array, KVCache]:
  """One transformer block on ``x (B, T, D)`` with one layer's weights ``w`` (no layer axis).

  Writes the new keys/values at ``slots (B, T)`` into entry ``j`` of the stacked ``cache``;
  token ``(b, t)`` attends to the slots ``s`` with ``visible[b, t, s]``. Returns ``(x, cache)``.
  """
  c = config
  B, T, _ = x.shape
  G = c.n_heads // c.n_kv_heads

  h = rms_norm(x, w.attn_norm, c.norm_eps)
  q = jnp.einsum("btd,dn->btn", h, w.wq).reshape(B, T, c.n_heads, c.head_dim)
  k = jnp.einsum("btd,dn->btn", h, w.wk).reshape(B, T, c.n_kv_heads, c.head_dim)
  v = jnp.einsum("btd,dn->btn", h, w.wv).reshape(B, T, c.n_kv_heads, c.head_dim)
  q, k = _rope(q, cos, sin), _rope(k, cos, sin)

  # Write slot slots[b, t] of row b, in place in the stacked cache (the index result has
  # shape (B, T, KV, hd), as k and v); slots outside [0, S) are dropped, not clamped.
  rows = jnp.arange(B, dtype=jnp.int32)[:, None]
  cache = KVCache(
    k=cache.k.at[j, rows, :, slots].set(k, mode="drop"),
    v=cache.v.at[j, rows, :, slots].set(v, mode="drop"),
  )
  k_cache, v_cache = cache.k[j], cache.v[j]  # (B, KV, S, hd)

  # Query head h uses kv head h // G (the grouping of Hugging Face's repeat_kv and llama.cpp).
  qg = q.reshape(B, T, c.n_kv_heads, G, c.head_dim)
  scores = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache) * (1.0 / math.sqrt(c.head_dim))
  scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  attn = jnp.einsum("bkgts,bksd->btkgd", probs, v_cache).reshape(B, T, c.n_heads * c.head_dim)
  x = x + jnp.einsum("btn,nd->btd", attn, w.wo)

  h = rms_norm(x, w.mlp_norm, c.norm_eps)
  gate = jnp.einsum("btd,df->btf", h, w.w_gate)
  up = jnp.einsum("btd,df->btf", h, w.w_up)
  x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, w.w_down)
  return x, cache


def _forward(params: LlamaParams, tokens: jax.Array, positions: jax.Array, slots: jax.Array,
             visible: jax.Array, cache: KVCache, config: LlamaConfig,
             layers: tuple[int, ...] | None) -> tuple[jax.Array, jax.Array, KVCache]:
  """The forward shared by :func:`llama_apply` and :func:`llama_tree_apply`.

  Token ``(b, t)`` is rotated by ``positions[b, t]``, written to ``slots[b, t]`` and attends to
  the slots ``s`` with ``visible[b, t, s]``. Returns ``(logits, features, cache)``: the
  features are the final-normed hidden states ``(B, T, D)`` the head reads.
  """
  c = config
  layer_ids = tuple(range(c.n_layers)) if layers is None else tuple(layers)
  if cache.k.shape[0] != len(layer_ids):
    raise ValueError(f"cache has {cache.k.shape[0]} layers but {len(layer_ids)} are run")
  x = jnp.take(params.embed, tokens, axis=0, mode="fill", fill_value=jnp.nan)  # (B, T, D)

  cos, sin = rope_angles(positions, c)  # (B, T, hd/2)

  # Scan over the layers run; the weights of layer layer_ids[j] are read by a dynamic index
  # into the stacked arrays (no gathered copy of a layer subset), cache entry j is updated.
  def body(carry, xs):
    j, layer = xs
    w = jax.tree.map(lambda a: a[layer], params.layers)
    return decoder_layer(c, w, *carry, j, slots, visible, cos, sin), None

  xs = (jnp.arange(len(layer_ids), dtype=jnp.int32), jnp.asarray(layer_ids, jnp.int32))
  (x, cache), _ = lax.scan(body, (x, cache), xs)

  x = rms_norm(x, params.final_norm, c.norm_eps)
  head = params.embed if params.output is None else params.output
  logits = jnp.einsum("btd,vd->btv", x, head)
  # A token whose slot is outside the cache was not written (the write is dropped): its
  # logits would silently differ from the true ones, so they are NaN (like those of an
  # out-of-range token id), which every loop and verifier reading them reports.
  outside = (slots < 0) | (slots >= cache.k.shape[3])
  return jnp.where(outside[..., None], jnp.nan, logits), x, cache


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
  logits, _, cache = _forward(params, tokens, positions, positions, visible, cache, config,
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
) -> tuple[jax.Array, jax.Array, KVCache]:
  """:func:`llama_apply` that also returns the hidden states the output head reads.

  The protocol's ``Model.apply_features``, for drafts that read the target's features
  (EAGLE, :class:`~specdec_jax.models.eagle.EagleConfig`).

  Returns:
    ``(logits (B, T, V), features (B, T, D), cache)``: ``features`` are the final-normed hidden
    states, so ``logits = features @ head.T``.

  Reference:
    Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
    arXiv:2401.15077 (the draft reads the target's top-layer features).
  """
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = jnp.asarray(positions, jnp.int32)
  size = cache.k.shape[3]
  visible = jnp.arange(size, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]
  return _forward(params, tokens, positions, positions, visible, cache, config, layers)


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
  logits, _, cache = _forward(params, jnp.asarray(tokens, jnp.int32),
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
) -> tuple[jax.Array, jax.Array, KVCache]:
  """:func:`llama_tree_apply` that also returns the hidden states the head reads: the
  protocol's ``Model.tree_apply_features``, for a feature draft (EAGLE) that drafts a tree.

  Returns:
    ``(logits (B, T, V), features (B, T, D), cache)``.
  """
  slots, visible = tree_visibility(start, nodes, tree_mask, cache.k.shape[3])
  return _forward(params, jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                  slots, visible, cache, config, layers)


def tree_visibility(start: jax.Array, nodes: jax.Array, tree_mask: jax.Array,
                    size: int) -> tuple[jax.Array, jax.Array]:
  """Where tree tokens are written and what they see: ``(slots (B, T), visible (B, T, S))``.

  Token ``t`` (node ``nodes[t]``) goes to slot ``start[b] + nodes[t]`` and sees every slot
  before ``start[b]`` and the tree slots ``start[b] + j`` with ``tree_mask[t, j]``.
  """
  start = jnp.asarray(start, jnp.int32)[:, None]  # (B, 1)
  nodes = jnp.asarray(nodes, jnp.int32)
  width = tree_mask.shape[1]
  rel = jnp.arange(size, dtype=jnp.int32)[None, :] - start  # (B, S): slot minus the tree start
  in_tree = jnp.take(jnp.asarray(tree_mask, bool), jnp.clip(rel, 0, width - 1), axis=1)
  in_tree = jnp.moveaxis(in_tree, 1, 0)  # (B, T, S)
  visible = (rel[:, None, :] < 0) | ((rel[:, None, :] < width) & in_tree)
  return start + nodes[None, :], visible


def copy_slots(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
  """Copy the keys/values of slots ``src[b, k]`` to ``dst[b, k]`` (all read before any write).

  The protocol's ``copy_slots``: after tree verification, the accepted path is moved from
  its tree slots to the slots of its positions. Entries with ``src == dst`` change nothing.

  Args:
    cache: :class:`KVCache`.
    src: int32 ``(B, K)`` slots to read.
    dst: int32 ``(B, K)`` slots to write (distinct within a row, or equal to ``src``).

  Returns:
    The updated :class:`KVCache`.
  """
  # One gather and one scatter on the cache's own layout (the index result is (B, K, layers,
  # KV, hd)), so XLA updates it in place; a vmap over the batch axis made it transpose (copy)
  # the whole cache several times per decoding iteration.
  rows = jnp.arange(src.shape[0], dtype=jnp.int32)[:, None]
  src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
  return KVCache(k=cache.k.at[:, rows, :, dst].set(cache.k[:, rows, :, src]),
                 v=cache.v.at[:, rows, :, dst].set(cache.v[:, rows, :, src]))


def init_cache(
  config: LlamaConfig, batch: int, max_len: int, *, n_layers: int | None = None
) -> KVCache:
  """An empty (zero) cache.

  Args:
    config: the model shape.
    batch: ``B``.
    max_len: ``S``, the number of position slots.
    n_layers: layers run (default ``config.n_layers``).

  Returns:
    :class:`KVCache` with ``k``, ``v`` of shape ``(n_layers, B, KV, S, hd)``, float32.
  """
  n = config.n_layers if n_layers is None else n_layers
  shape = (n, batch, config.n_kv_heads, max_len, config.head_dim)
  return KVCache(k=jnp.zeros(shape, jnp.float32), v=jnp.zeros(shape, jnp.float32))


def make_model(
  params: LlamaParams,
  config: LlamaConfig,
  *,
  layers: Sequence[int] | None = None,
  name: str | None = None,
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

  Returns:
    :class:`Model` with ``apply(params, tokens (B, T), positions (B, T), cache)
    -> (logits (B, T, V) float32, cache)``, ``init_cache(batch, max_len)``, the tree
    functions :func:`llama_tree_apply` and :func:`copy_slots`, the feature forms
    :func:`llama_apply_features` and :func:`llama_tree_apply_features`, and ``context_length =
    config.max_position``. Called with concrete arguments, ``apply`` and ``tree_apply``
    raise on token ids outside ``[0, V)`` and on cache slots outside ``[0, max_len)``.
  """
  _check_config(config)
  layer_ids = None if layers is None else tuple(int(i) for i in layers)
  if layer_ids is not None:
    bad = [i for i in layer_ids if not 0 <= i < config.n_layers]
    if bad:
      raise ValueError(f"layer indices {bad} out of range [0, {config.n_layers})")
    if layer_ids == tuple(range(config.n_layers)):
      layer_ids = None  # all layers: the same functions as the full model
  if name is None:
    name = "llama" if layer_ids is None else f"llama[{len(layer_ids)}/{config.n_layers} layers]"
  apply, make_cache, tree_apply, apply_features, tree_features = _functions(config, layer_ids)
  return Model(
    params=params, apply=apply, init_cache=make_cache, vocab_size=config.vocab_size, name=name,
    tree_apply=tree_apply, copy_slots=_copy_slots_jit, context_length=config.max_position,
    apply_features=apply_features, tree_apply_features=tree_features,
  )


@functools.cache
def _functions(config: LlamaConfig, layers: tuple[int, ...] | None):
  """``(apply, init_cache, tree_apply, apply_features, tree_apply_features)`` for a config and
  layer subset, built once.

  Models of the same shape get the same function objects, so a loop that takes them as static
  (hashed) arguments compiles once for all of them.
  """
  n_run = config.n_layers if layers is None else len(layers)
  apply = jax.jit(functools.partial(llama_apply, config=config, layers=layers))
  tree_apply = jax.jit(functools.partial(llama_tree_apply, config=config, layers=layers))
  features = jax.jit(functools.partial(llama_apply_features, config=config, layers=layers))
  tree_features = jax.jit(functools.partial(llama_tree_apply_features, config=config,
                                            layers=layers))
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
