"""The Llama's static shape, parameters and KV cache, and their initialisers.

:class:`LlamaConfig`, :class:`LlamaParams` (:class:`LayerParams` stacked over the layers),
:class:`KVCache`, :func:`init_params` and :func:`init_cache`; all re-exported by
:mod:`specdec_jax.models.llama`, whose forward reads them.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


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
  check_config(c)
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


def check_config(c: LlamaConfig) -> None:
  """Raise ``ValueError`` unless the query heads group over the kv heads and RoPE can pair."""
  if c.n_heads % c.n_kv_heads:
    raise ValueError(f"n_heads={c.n_heads} must be a multiple of n_kv_heads={c.n_kv_heads}")
  if c.head_dim % 2:
    raise ValueError(f"head_dim={c.head_dim} must be even for RoPE")


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

