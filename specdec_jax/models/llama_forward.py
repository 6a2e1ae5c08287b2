"""The Llama's JAX forward: RMSNorm, RoPE, the decoder layer, the cache writes and reads.

:func:`forward` runs the layers over tokens at given positions, written to given cache slots
and attending to given slots; :func:`tree_visibility` gives those for the nodes of a draft
tree and :func:`copy_slots` moves an accepted path. :mod:`specdec_jax.models.llama` builds its
forms (``apply``, ``tree_apply`` and their feature forms) on them and re-exports them.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from specdec_jax.models.llama_params import KVCache
from specdec_jax.models.llama_params import LayerParams
from specdec_jax.models.llama_params import LlamaConfig
from specdec_jax.models.llama_params import LlamaParams


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


def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
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
  q, k = rope(q, cos, sin), rope(k, cos, sin)

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


def forward(params: LlamaParams, tokens: jax.Array, positions: jax.Array, slots: jax.Array,
            visible: jax.Array, cache: KVCache, config: LlamaConfig,
            layers: tuple[int, ...] | None,
            taps: tuple[int, ...] | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
  """The forward shared by :func:`~specdec_jax.models.llama.llama_apply` and the other forms.

  Token ``(b, t)`` is rotated by ``positions[b, t]``, written to ``slots[b, t]`` and attends to
  the slots ``s`` with ``visible[b, t, s]``. Returns ``(logits, features, cache)``: the
  features are the final-normed hidden states ``(B, T, D)`` the head reads, or with ``taps``
  (increasing indices into the layers run, their number for the last one's output) the hidden
  states entering each of those layers, concatenated: ``(B, T, len(taps) * D)`` (EAGLE-3's
  low, middle and high features).
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

  # One scan over the layers run, cut where a tapped hidden state is read (no extra work).
  bounds = (0, *(taps or ()), len(layer_ids))
  tapped = []
  for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
    if k:
      tapped.append(x)
    if hi > lo:
      xs = (jnp.arange(lo, hi, dtype=jnp.int32), jnp.asarray(layer_ids[lo:hi], jnp.int32))
      (x, cache), _ = lax.scan(body, (x, cache), xs)

  x = rms_norm(x, params.final_norm, c.norm_eps)
  head = params.embed if params.output is None else params.output
  logits = jnp.einsum("btd,vd->btv", x, head)
  # A token whose slot is outside the cache was not written (the write is dropped): its
  # logits would silently differ from the true ones, so they are NaN (like those of an
  # out-of-range token id), which every loop and verifier reading them reports.
  outside = (slots < 0) | (slots >= cache.k.shape[3])
  features = x if taps is None else jnp.concatenate(tapped, axis=-1)
  return jnp.where(outside[..., None], jnp.nan, logits), features, cache


def tree_visibility(start: jax.Array, nodes: jax.Array, tree_mask: jax.Array,
                    size: int) -> tuple[jax.Array, jax.Array]:
  """Where tree tokens are written and what they see: ``(slots (B, T), visible (B, T, S))``.

  Token ``t`` (node ``nodes[t]``) goes to slot ``start[b] + nodes[t]`` and sees every slot
  before ``start[b]`` and the tree slots ``start[b] + j`` with ``tree_mask[t, j]``, or
  ``tree_mask[b, t, j]`` for a mask ``(B, T, N)`` of one tree per row (EAGLE-2's dynamic
  trees).
  """
  start = jnp.asarray(start, jnp.int32)[:, None]  # (B, 1)
  nodes = jnp.asarray(nodes, jnp.int32)
  tree_mask = jnp.asarray(tree_mask, bool)
  width = tree_mask.shape[-1]
  rel = jnp.arange(size, dtype=jnp.int32)[None, :] - start  # (B, S): slot minus the tree start
  at = jnp.clip(rel, 0, width - 1)
  if tree_mask.ndim == 2:
    in_tree = jnp.moveaxis(jnp.take(tree_mask, at, axis=1), 1, 0)  # (B, T, S)
  else:
    in_tree = jnp.take_along_axis(tree_mask, at[:, None, :], axis=2)  # (B, T, S)
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

