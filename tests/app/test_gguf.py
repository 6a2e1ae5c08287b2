"""The GGUF loader: its RoPE un-permutation against llama.cpp's interleaved RoPE (no file
needed), and what it says about small files that are cut short, contradict their metadata or hold
tensors it cannot read (written here with ``gguf.GGUFWriter``)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest

from specdec_jax.app import gguf as gguf_app
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


# A tiny Llama: V = 40, D = 16, 2 query heads and 1 key/value head of 8, F = 24, 2 blocks.
_META = {"vocab_size": 40, "embedding_length": 16, "attention.head_count": 2,
         "attention.head_count_kv": 1, "feed_forward_length": 24, "block_count": 2,
         "context_length": 64}


def _write_gguf(path, *, meta=None, shapes=None, dtypes=None, tied=False):
  """Write a small random Llama GGUF file (F32) and return its path.

  ``meta`` overrides ``llama.*`` keys (``None`` drops one); ``shapes`` / ``dtypes`` override a
  tensor's NumPy shape / dtype by name; ``tied`` leaves out ``output.weight``.
  """
  m = {**_META, **(meta or {})}
  V, D, F, q, kv = 40, 16, 24, 16, 8  # NumPy shapes: (out, in); GGUF lists dims innermost first
  layer = {"attn_norm": (D,), "attn_q": (q, D), "attn_k": (kv, D), "attn_v": (kv, D),
           "attn_output": (D, q), "ffn_norm": (D,), "ffn_gate": (F, D), "ffn_up": (F, D),
           "ffn_down": (D, F)}
  tensors = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
  tensors.update({} if tied else {"output.weight": (V, D)})
  for i in range(2):
    tensors.update({f"blk.{i}.{name}.weight": shape for name, shape in layer.items()})
  gguf = pytest.importorskip("gguf")
  rng = np.random.default_rng(0)
  w = gguf.GGUFWriter(str(path), "llama")
  for key, value in m.items():
    if value is not None:
      w.add_uint32(f"llama.{key}", value)
  w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
  for name, shape in tensors.items():
    shape = (shapes or {}).get(name, shape)
    w.add_tensor(name, rng.normal(size=shape).astype((dtypes or {}).get(name, np.float32)))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_gguf_loader_reads_a_small_file(tmp_path):
  """The checks let a consistent file through: the params have the config's shapes."""
  for tied in (False, True):
    path = _write_gguf(tmp_path / f"tied{tied}.gguf", tied=tied)
    params, config = gguf_app.load_gguf_llama(path, progress=False)
    assert (config.vocab_size, config.dim, config.n_layers, config.head_dim) == (40, 16, 2, 8)
    assert config.tie_embeddings is tied and (params.output is None) is tied
    assert params.embed.shape == (40, 16) and params.final_norm.shape == (16,)
    assert params.layers.wk.shape == (2, 16, 8) and params.layers.w_down.shape == (2, 24, 16)


@pytest.mark.parametrize(("name", "shape"), [
  ("output_norm.weight", (1,)),  # broadcast against every hidden state
  ("output.weight", (7, 16)),  # a head of 7 rows for V = 40 generated with error 0
], ids=["norm-(1,)", "head-7-rows"])
def test_gguf_tensor_shapes_must_match_the_metadata(tmp_path, name, shape):
  """Issue item 7: a tensor whose shape contradicts the metadata is named before any is read."""
  path = _write_gguf(tmp_path / "bad.gguf", shapes={name: shape})
  want = {"output_norm.weight": (16,), "output.weight": (40, 16)}[name]
  with pytest.raises(ValueError, match=rf"load_gguf_llama: .*bad\.gguf: tensor '{name}' has "
                     rf"shape {re.escape(str(shape))}, the metadata implies "
                     rf"{re.escape(str(want))}"):
    gguf_app.load_gguf_llama(path, progress=False)


@pytest.mark.parametrize(("cut", "what"), [
  (40, r"tensor 'blk\.1\.ffn_down\.weight' \(F32, GGUF dims \[24, 16\]\) is cut"),  # the last
  (None, r"the file ends inside metadata 'llama\.embedding_length'"),  # the header
], ids=["tensor-data", "header"])
def test_gguf_truncated_file_names_the_tensor_or_field(tmp_path, cut, what):
  """Issue item 18: a file cut short names what is cut (was a raw reshape or index error)."""
  path = _write_gguf(tmp_path / "cut.gguf")
  data = path.read_bytes()
  end = len(data) - cut if cut else data.index(b"llama.embedding_length") + 28
  path.write_bytes(data[:end])
  with pytest.raises(ValueError, match=rf"load_gguf_llama: .*cut\.gguf: {what}"):
    gguf_app.load_gguf_llama(path, progress=False)


def test_gguf_unsupported_tensor_types_are_named(tmp_path):
  """Issue item 18: an I32 tensor (was a bare NotImplementedError) or an unknown type id (a raw
  enum error) names the tensor, its type and the types the loader reads."""
  path = _write_gguf(tmp_path / "i32.gguf", dtypes={"blk.1.ffn_norm.weight": np.int32})
  with pytest.raises(ValueError, match=r"load_gguf_llama: .*i32\.gguf: tensor "
                     r"'blk\.1\.ffn_norm\.weight' has type I32, .*supported types: F32, F16, "):
    gguf_app.load_gguf_llama(path, progress=False)
  path = _write_gguf(tmp_path / "type99.gguf")
  data = bytearray(path.read_bytes())
  at = data.index(b"output_norm.weight") + len("output_norm.weight") + 4 + 8  # n_dims, 1 dim
  data[at : at + 4] = (99).to_bytes(4, "little")
  path.write_bytes(bytes(data))
  with pytest.raises(ValueError, match=r"load_gguf_llama: .*type99\.gguf: tensor "
                     r"'output_norm\.weight' has the unknown type id 99; supported types: F32, "):
    gguf_app.load_gguf_llama(path, progress=False)


@pytest.mark.parametrize(("meta", "message"), [
  ({"attention.head_count": 0}, r"llama\.attention\.head_count = 0: it must be a positive"),
  ({"block_count": 0}, r"llama\.block_count = 0: it must be a positive integer"),
  ({"attention.head_count_kv": 3},
   r"llama\.attention\.head_count = 2 is not a multiple of llama\.attention\.head_count_kv = 3"),
  ({"embedding_length": 15}, r"llama\.embedding_length = 15 is not a multiple of"),
  ({"vocab_size": None}, r"metadata llama\.vocab_size is missing"),
], ids=["head_count-0", "block_count-0", "kv-heads-3-of-2", "width-15", "no-vocab_size"])
def test_gguf_bad_metadata_names_the_key_and_value(tmp_path, meta, message):
  """Issue item 18: ``head_count = 0`` (was ZeroDivisionError), ``block_count = 0`` (a raw stack
  error) and inconsistent keys name the file, the key and its value."""
  path = _write_gguf(tmp_path / "meta.gguf", meta=meta)
  with pytest.raises(ValueError, match=rf"load_gguf_llama: .*meta\.gguf: {message}"):
    gguf_app.load_gguf_llama(path, progress=False)
