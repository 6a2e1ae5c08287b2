"""The GGUF loader's RoPE un-permutation against llama.cpp's interleaved RoPE (no file needed)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specdec_jax.app.gguf import unpermute_rope_rows
from specdec_jax.models import llama


def _interleaved_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
  """llama.cpp's RoPE on ``x (T, hd)``: rotate pairs ``(2i, 2i + 1)`` by ``t * theta^(-2i/hd)``."""
  hd = x.shape[-1]
  angle = positions[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :]
  a, b = x[:, 0::2], x[:, 1::2]
  out = np.empty_like(x)
  out[:, 0::2] = a * np.cos(angle) - b * np.sin(angle)
  out[:, 1::2] = a * np.sin(angle) + b * np.cos(angle)
  return out


def test_gguf_rope_permutation_is_undone():
  """The loader's un-permutation makes rotate-half RoPE compute what llama.cpp computes.

  llama.cpp's converter permutes each head's q/k rows (``LlamaModel.permute`` in
  ``convert_hf_to_gguf.py``) and applies the interleaved RoPE to the permuted weights; the
  attention scores must equal rotate-half RoPE on the un-permuted weights.
  """
  rng = np.random.default_rng(0)
  n_heads, hd, d_in, T, theta = 3, 8, 5, 7, 50.0
  w_hf = rng.normal(size=(n_heads * hd, d_in))
  w_gguf = w_hf.reshape(n_heads, 2, hd // 2, d_in).swapaxes(1, 2).reshape(w_hf.shape)
  np.testing.assert_array_equal(unpermute_rope_rows(w_gguf, n_heads), w_hf)

  x = rng.normal(size=(T, d_in))
  positions = np.arange(T, dtype=np.float64)
  cos = np.cos(positions[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :])
  sin = np.sin(positions[:, None] * theta ** (-np.arange(0, hd, 2) / hd)[None, :])
  for head in range(n_heads):
    rows = slice(head * hd, (head + 1) * hd)
    cpp = _interleaved_rope(x @ w_gguf[rows].T, positions, theta)
    ours = np.asarray(
      llama.rope(
        jnp.asarray((x @ unpermute_rope_rows(w_gguf, n_heads)[rows].T)[None, :, None], jnp.float32),
        jnp.asarray(cos[None], jnp.float32),
        jnp.asarray(sin[None], jnp.float32),
      )
    )[0, :, 0]
    # Same q.k scores (the features of a head are permuted consistently in q and k).
    np.testing.assert_allclose(ours @ ours.T, cpp @ cpp.T, rtol=1e-4, atol=1e-4)
    # And literally the same vectors up to the permutation.
    np.testing.assert_allclose(unpermute_rope_rows(cpp.T, 1).T, ours, rtol=1e-4, atol=1e-4)
