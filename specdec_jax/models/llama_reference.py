"""A plain NumPy Llama forward (no cache, float64 by default), written to check the JAX one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specdec_jax.models.llama import LlamaConfig
from specdec_jax.models.llama import LlamaParams


def reference_logits(
  params: LlamaParams,
  config: LlamaConfig,
  tokens: Sequence[int] | np.ndarray,
  *,
  layers: Sequence[int] | None = None,
  dtype: type = np.float64,
) -> np.ndarray:
  """A plain NumPy Llama forward over one whole sequence at positions ``0 .. T-1`` (no cache).

  Written to be read against the paper and Hugging Face's ``LlamaForCausalLM``, not to be
  fast; it checks :func:`llama_apply`.

  Args:
    params: :class:`LlamaParams` (JAX or NumPy arrays).
    config: the model shape.
    tokens: ``(T,)`` token ids.
    layers: the layer indices to run (``None``: all), as in :func:`make_model`.
    dtype: the float type to compute in (float64 by default).

  Returns:
    ``(T, V)`` next-token logits, of ``dtype``.
  """
  c = config
  tokens = np.asarray(tokens, np.int64)
  T = tokens.shape[0]
  hd, half = c.head_dim, c.head_dim // 2
  group = c.n_heads // c.n_kv_heads

  def f(a):
    return np.asarray(a, dtype)

  def rms_norm(x, weight):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + c.norm_eps) * f(weight)

  # RoPE angle of position t and frequency i: t * theta^(-2i / hd); dimension i of a head is
  # rotated together with dimension i + hd/2 (the rotate-half pairing).
  inv_freq = 1.0 / c.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / hd)
  angle = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]  # (T, hd/2)
  cos, sin = f(np.cos(angle))[:, None, :], f(np.sin(angle))[:, None, :]

  def rope(v):  # (T, n_heads, hd)
    a, b = v[..., :half], v[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

  causal = np.tril(np.ones((T, T), dtype=bool))  # query t sees keys 0 .. t
  x = f(params.embed)[tokens]  # (T, D)
  lw = params.layers
  for layer in range(c.n_layers) if layers is None else layers:
    h = rms_norm(x, lw.attn_norm[layer])
    q = rope((h @ f(lw.wq[layer])).reshape(T, c.n_heads, hd))
    k = rope((h @ f(lw.wk[layer])).reshape(T, c.n_kv_heads, hd))
    v = (h @ f(lw.wv[layer])).reshape(T, c.n_kv_heads, hd)
    heads = []
    for head in range(c.n_heads):
      kv = head // group
      scores = q[:, head] @ k[:, kv].T / np.sqrt(hd)  # (T, T)
      scores = np.where(causal, scores, -np.inf)
      weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
      weights /= weights.sum(axis=-1, keepdims=True)
      heads.append(weights @ v[:, kv])  # (T, hd)
    x = x + np.concatenate(heads, axis=-1) @ f(lw.wo[layer])

    h = rms_norm(x, lw.mlp_norm[layer])
    gate, up = h @ f(lw.w_gate[layer]), h @ f(lw.w_up[layer])
    x = x + (gate / (1 + np.exp(-gate)) * up) @ f(lw.w_down[layer])

  x = rms_norm(x, params.final_norm)
  head = params.embed if params.output is None else params.output
  return x @ f(head).T
