"""Load a Llama-architecture GGUF file (e.g. SmolLM2-135M-Instruct) into :mod:`llama` params.

Part of the application (:mod:`specdec_jax.app`), not of the library: it needs the ``gguf``
package of the ``model`` extra.

GGUF is llama.cpp's file format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
The ``gguf`` package (``pip install gguf==0.19.0``) reads it and dequantizes the tensors
(Q4_1, Q8_0, F32, ...) to float32.

Layout conversions done here, once, at load time:

* GGUF stores a projection as ``(out, in)`` rows (the PyTorch layout); :class:`LayerParams`
  wants ``(in, out)``, so the weights are transposed.
* llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows
  of ``attn_q`` / ``attn_k`` within each head so that llama.cpp's *interleaved* RoPE (pairs
  ``(2i, 2i + 1)``) computes what Hugging Face's *rotate-half* RoPE (pairs ``(i, i + hd/2)``)
  computes on the original weights. :func:`unpermute_rope_rows` restores the original order,
  and :mod:`specdec_jax.models.llama` uses rotate-half. (Getting this wrong does not crash: it
  raises SmolLM2-135M's perplexity on a plain English sentence from 11 to 20, on others from
  4 to 15 or from 24 to 44; see ``tests/test_real_model.py``.)

Where the SmolLM2 file comes from is :mod:`specdec_jax.app.smollm2`'s business.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from specdec_jax.models.llama import LayerParams
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.models.llama import LlamaParams

INSTALL = "pip install 'specdec_jax[model]'"
"""What installs the readers of GGUF files and tokenizers (the ``model`` extra)."""

# GGUF tensor name of each LayerParams field (per block ``blk.{i}.``).
_LAYER_TENSORS = {
  "attn_norm": "attn_norm",
  "wq": "attn_q",
  "wk": "attn_k",
  "wv": "attn_v",
  "wo": "attn_output",
  "mlp_norm": "ffn_norm",
  "w_gate": "ffn_gate",
  "w_up": "ffn_up",
  "w_down": "ffn_down",
}


def _gguf():
  try:
    import gguf  # optional dependency, imported on use
  except ImportError as e:
    raise ImportError(f"reading GGUF files needs the gguf package; run: {INSTALL}") from e
  return gguf


def open_gguf(path: str | os.PathLike[str]) -> Any:
  """Open a GGUF file (memory-mapped) as a ``gguf.GGUFReader``."""
  return _gguf().GGUFReader(Path(path))


def _as_reader(source: Any) -> Any:
  return open_gguf(source) if isinstance(source, str | os.PathLike) else source


def metadata(reader: Any, key: str, default: Any = None) -> Any:
  """The value of metadata ``key`` of a ``GGUFReader`` (``default`` when absent)."""
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def config_from_gguf(reader: Any) -> LlamaConfig:
  """The :class:`LlamaConfig` from a GGUF file's ``llama.*`` metadata.

  Args:
    reader: a ``gguf.GGUFReader``.

  Returns:
    The config; ``tie_embeddings`` is set when the file has no ``output.weight`` tensor.
  """
  arch = metadata(reader, "general.architecture")
  if arch != "llama":
    raise ValueError(f"only the llama architecture is supported, the file says {arch!r}")
  scaling = metadata(reader, "llama.rope.scaling.type", "none")
  if scaling not in ("none", None):
    raise NotImplementedError(f"RoPE scaling {scaling!r} is not implemented")

  def get(key, default=None):
    value = metadata(reader, f"llama.{key}", default)
    if value is None:
      raise ValueError(f"GGUF metadata llama.{key} is missing")
    return value

  dim = int(get("embedding_length"))
  n_heads = int(get("attention.head_count"))
  tokens = metadata(reader, "tokenizer.ggml.tokens")
  names = {t.name for t in reader.tensors}
  return LlamaConfig(
    vocab_size=int(get("vocab_size", len(tokens) if tokens is not None else None)),
    dim=dim,
    n_layers=int(get("block_count")),
    n_heads=n_heads,
    n_kv_heads=int(get("attention.head_count_kv", n_heads)),
    head_dim=int(get("attention.key_length", dim // n_heads)),
    ffn_dim=int(get("feed_forward_length")),
    rope_theta=float(get("rope.freq_base", 10000.0)),
    norm_eps=float(get("attention.layer_norm_rms_epsilon")),
    tie_embeddings="output.weight" not in names,
    max_position=int(get("context_length", 2048)),
  )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation: interleaved-RoPE order back to rotate-half order.

  The converter maps Hugging Face row ``h * hd + s * hd/2 + i`` (``s`` in {0, 1}) to GGUF row
  ``h * hd + 2 * i + s``; this is the inverse.

  Args:
    w: ``(n_heads * hd, in)`` GGUF q or k weight (rows are output features).
    n_heads: heads of this projection (``n_heads`` for q, ``n_kv_heads`` for k).

  Returns:
    ``(n_heads * hd, in)`` in the Hugging Face order.
  """
  rows, cols = w.shape
  hd = rows // n_heads
  return w.reshape(n_heads, hd // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def load_gguf_llama(source: Any, *, progress: bool = True) -> tuple[LlamaParams, LlamaConfig]:
  """Read and dequantize a Llama GGUF file into float32 :class:`LlamaParams`.

  Args:
    source: a path or an open ``gguf.GGUFReader``.
    progress: report ``tensors loaded / total`` on stderr.

  Returns:
    ``(params, config)``, the params as JAX float32 arrays in the layout of
    :mod:`specdec_jax.models.llama` (about 4 bytes per parameter: 540 MB for SmolLM2-135M).
  """
  gguf = _gguf()
  reader = _as_reader(source)
  config = config_from_gguf(reader)
  tensors = {t.name: t for t in reader.tensors}
  c = config
  total = c.n_layers * len(_LAYER_TENSORS) + 2 + (0 if c.tie_embeddings else 1)
  done, start = 0, time.perf_counter()
  label = Path(reader.data.filename).name if hasattr(reader.data, "filename") else "GGUF"
  interactive = sys.stderr.isatty()  # redraw the count in place; otherwise one final line

  def load(name: str) -> np.ndarray:
    nonlocal done
    if name not in tensors:
      raise KeyError(f"tensor {name!r} is missing from the GGUF file")
    t = tensors[name]
    a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    expected = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims innermost first
    a = a.reshape(expected)
    done += 1
    if progress and (done == total or (interactive and done % 16 == 0)):
      end = f" ({time.perf_counter() - start:.1f} s)\n" if done == total else ""
      sys.stderr.write(f"\rloading {label}: {done}/{total} tensors{end}")
      sys.stderr.flush()
    return a

  per_layer: dict[str, list[np.ndarray]] = {field: [] for field in _LAYER_TENSORS}
  for i in range(c.n_layers):
    for field, gguf_name in _LAYER_TENSORS.items():
      a = load(f"blk.{i}.{gguf_name}.weight")
      if field == "wq":
        a = unpermute_rope_rows(a, c.n_heads)
      elif field == "wk":
        a = unpermute_rope_rows(a, c.n_kv_heads)
      per_layer[field].append(a if a.ndim == 1 else a.T)  # (out, in) -> (in, out)
  layers = LayerParams(**{f: jnp.asarray(np.stack(ws)) for f, ws in per_layer.items()})
  embed = jnp.asarray(load("token_embd.weight"))  # (V, D)
  final_norm = jnp.asarray(load("output_norm.weight"))
  output = None if c.tie_embeddings else jnp.asarray(load("output.weight"))  # (V, D)
  params = LlamaParams(embed=embed, layers=layers, final_norm=final_norm, output=output)
  _check_shapes(params, c)
  return params, c


def _check_shapes(p: LlamaParams, c: LlamaConfig) -> None:
  n_q, n_kv, L = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_layers
  expected = {
    "embed": (p.embed.shape, (c.vocab_size, c.dim)),
    "wq": (p.layers.wq.shape, (L, c.dim, n_q)),
    "wk": (p.layers.wk.shape, (L, c.dim, n_kv)),
    "wv": (p.layers.wv.shape, (L, c.dim, n_kv)),
    "wo": (p.layers.wo.shape, (L, n_q, c.dim)),
    "w_gate": (p.layers.w_gate.shape, (L, c.dim, c.ffn_dim)),
    "w_down": (p.layers.w_down.shape, (L, c.ffn_dim, c.dim)),
  }
  for name, (got, want) in expected.items():
    if tuple(got) != want:
      raise ValueError(f"{name} has shape {tuple(got)}, the metadata implies {want}")
