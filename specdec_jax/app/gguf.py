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

import math
import mmap
import os
import re
import struct
import sys
import time
from pathlib import Path
from typing import Any
from typing import NoReturn

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


class GGUFError(ValueError):
  """A GGUF file the loader cannot use: cut short, metadata missing or inconsistent, a tensor of
  the wrong shape or of a type it cannot dequantize. The message names the function, the file
  and the metadata key or the tensor."""


def open_gguf(path: str | os.PathLike[str]) -> Any:
  """Open a GGUF file (memory-mapped) as a ``gguf.GGUFReader``.

  Raises:
    GGUFError: not a GGUF file, cut short (the message names the header field or the tensor the
      end of the file cuts), or a tensor type id the ``gguf`` package does not know.
  """
  return _open(path, "open_gguf")


def _open(path: str | os.PathLike[str], where: str) -> Any:
  gguf = _gguf()
  try:
    return gguf.GGUFReader(Path(path))
  except (ValueError, IndexError, KeyError, OverflowError) as e:
    why = _diagnose(Path(path), gguf) or f"not a readable GGUF file ({type(e).__name__}: {e})"
    raise GGUFError(f"{where}: {path}: {why}") from e


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

  Raises:
    GGUFError: the architecture is not llama; a key is missing, or is not a positive integer
      (the floats: a positive finite number); or keys contradict each other (a width that the
      heads do not divide, query heads not a multiple of the key/value heads, an odd head size,
      a value or RoPE size other than the head size, more tokens than ``vocab_size``). The
      message names the file, the key and its value.
    NotImplementedError: the file asks for RoPE scaling.
  """
  return _config(reader, "config_from_gguf")


def _config(reader: Any, where: str) -> LlamaConfig:
  file = _file_of(reader)

  def fail(message: str) -> NoReturn:
    raise GGUFError(f"{where}: {file}: {message}")

  arch = metadata(reader, "general.architecture")
  if arch != "llama":
    fail(f"general.architecture = {arch!r}: only the llama architecture is supported")
  scaling = metadata(reader, "llama.rope.scaling.type", "none")
  if scaling not in ("none", None):
    raise NotImplementedError(f"{where}: {file}: RoPE scaling {scaling!r} is not implemented")

  def get(key, default=None, number=False):
    value = metadata(reader, f"llama.{key}", default)
    if value is None:
      fail(f"metadata llama.{key} is missing")
    kinds = (int, float) if number else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < math.inf:
      fail(f"llama.{key} = {repr(value)[:60]}: it must be a positive "
           + ("finite number" if number else "integer"))
    return value

  dim, n_heads = get("embedding_length"), get("attention.head_count")
  n_kv_heads = get("attention.head_count_kv", n_heads)
  if n_heads % n_kv_heads:
    fail(f"llama.attention.head_count = {n_heads} is not a multiple of "
         f"llama.attention.head_count_kv = {n_kv_heads}")
  if metadata(reader, "llama.attention.key_length") is None and dim % n_heads:
    fail(f"llama.embedding_length = {dim} is not a multiple of llama.attention.head_count = "
         f"{n_heads} (and llama.attention.key_length is absent)")
  head_dim = get("attention.key_length", dim // n_heads)
  if head_dim % 2:
    fail(f"the head size (llama.attention.key_length or embedding_length / head_count) is "
         f"{head_dim}: RoPE needs an even one")
  for key in ("attention.value_length", "rope.dimension_count"):
    if metadata(reader, f"llama.{key}") is not None and get(key) != head_dim:
      fail(f"llama.{key} = {get(key)} differs from the head size {head_dim}: not implemented")
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  n_tokens = None if tokens is None else len(tokens.data)
  vocab_size = get("vocab_size", n_tokens)
  if n_tokens is not None and n_tokens > vocab_size:
    fail(f"tokenizer.ggml.tokens lists {n_tokens} tokens, more than llama.vocab_size = "
         f"{vocab_size} (their ids would index past the embedding)")
  return LlamaConfig(
    vocab_size=vocab_size,
    dim=dim,
    n_layers=get("block_count"),
    n_heads=n_heads,
    n_kv_heads=n_kv_heads,
    head_dim=head_dim,
    ffn_dim=get("feed_forward_length"),
    rope_theta=float(get("rope.freq_base", 10000.0, number=True)),
    norm_eps=float(get("attention.layer_norm_rms_epsilon", number=True)),
    tie_embeddings="output.weight" not in {t.name for t in reader.tensors},
    max_position=get("context_length", 2048),
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

  Raises:
    GGUFError: the file is cut short or unreadable (as in :func:`open_gguf`), its metadata is
      missing or inconsistent (:func:`config_from_gguf`), or, before anything is dequantized,
      a tensor is missing, has a type the loader cannot dequantize, has a shape other than the
      one the metadata implies (:func:`expected_shapes`), or is in a block past
      ``llama.block_count``. Each message names the function, the file and the key or tensor.
  """
  gguf = _gguf()
  reader = _open(source, "load_gguf_llama") if isinstance(source, str | os.PathLike) else source
  config = _config(reader, "load_gguf_llama")
  tensors = {t.name: t for t in reader.tensors}
  _check_tensors(tensors, config, _file_of(reader), _readable_types(gguf))
  c = config
  total = c.n_layers * len(_LAYER_TENSORS) + 2 + (0 if c.tie_embeddings else 1)
  done, start = 0, time.perf_counter()
  label = Path(_file_of(reader)).name
  interactive = sys.stderr.isatty()  # redraw the count in place; otherwise one final line

  def load(name: str) -> np.ndarray:
    nonlocal done
    t = tensors[name]
    a = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    a = a.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGUF lists dims innermost first
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
  return params, c


def _file_of(reader: Any) -> str:
  return str(getattr(getattr(reader, "data", None), "filename", None) or "<GGUF reader>")


def _readable_types(gguf: Any) -> list[str]:
  """The tensor types ``gguf.quants.dequantize`` reads: F32, F16 and its quantization classes."""
  traits = getattr(gguf.quants, "_type_traits", {})
  return [t.name for t in gguf.GGMLQuantizationType if t.name in ("F32", "F16") or t in traits]


def expected_shapes(c: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Each tensor :func:`load_gguf_llama` reads and the shape ``c`` implies for it, in NumPy
  (row-major) order: ``(out, in)`` for a projection (GGUF lists the dims innermost first)."""
  D, q, kv, F = c.dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.ffn_dim
  layer = {"attn_norm": (D,), "wq": (q, D), "wk": (kv, D), "wv": (kv, D), "wo": (D, q),
           "mlp_norm": (D,), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F)}
  shapes = {"token_embd.weight": (c.vocab_size, D), "output_norm.weight": (D,)}
  if not c.tie_embeddings:
    shapes["output.weight"] = (c.vocab_size, D)
  for i in range(c.n_layers):
    shapes.update({f"blk.{i}.{_LAYER_TENSORS[f]}.weight": s for f, s in layer.items()})
  return shapes


def _check_tensors(tensors: dict[str, Any], c: LlamaConfig, file: str, readable: list[str]):
  where = f"load_gguf_llama: {file}: tensor"
  sizes = (f"V={c.vocab_size}, D={c.dim}, H={c.n_heads}, KV={c.n_kv_heads}, hd={c.head_dim}, "
           f"F={c.ffn_dim}, L={c.n_layers}")
  for name, want in expected_shapes(c).items():
    t = tensors.get(name)
    if t is None:
      raise GGUFError(f"{where} {name!r} is missing (the metadata implies {want}; {sizes})")
    if t.tensor_type.name not in readable:
      raise GGUFError(f"{where} {name!r} has type {t.tensor_type.name}, which the loader cannot "
                      f"dequantize; supported types: {', '.join(readable)}")
    got = tuple(int(n) for n in reversed(t.shape))
    if got != want:
      raise GGUFError(f"{where} {name!r} has shape {got}, the metadata implies {want} ({sizes})")
  for name in tensors:
    block = re.match(r"blk\.(\d+)\.", name)
    if block and int(block[1]) >= c.n_layers:
      raise GGUFError(f"{where} {name!r} is in block {block[1]}, but llama.block_count = "
                      f"{c.n_layers} (blocks 0..{c.n_layers - 1})")


class _Found(Exception):
  """What :func:`_diagnose` found wrong (its message)."""


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9  # GGUFValueType


def _diagnose(path: Path, gguf: Any) -> str | None:
  """What is wrong with a file the ``gguf`` package could not read (None: nothing found).

  Walks the header (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) with a bounds
  check on every read: the first field or tensor the end of the file cuts, an unknown value
  or tensor type, a quantized row that is not a whole number of blocks.
  """
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size == 0:
      return "the file is empty"
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      try:
        return _walk(m, size, gguf)
      except _Found as e:
        return str(e)


def _walk(m: Any, size: int, gguf: Any) -> str | None:
  pos, order = 0, "<"

  def take(n: int, what: str) -> bytes:
    nonlocal pos
    if pos + n > size:
      raise _Found(f"the file ends inside {what} (bytes {pos}..{pos + n} of a file of {size}; "
                   "cut short?)")
    pos += n
    return m[pos - n : pos]

  def num(fmt: str, what: str) -> int:
    return struct.unpack(order + fmt, take(struct.calcsize(fmt), what))[0]

  def text(what: str) -> str:
    return take(num("Q", what), what).decode("utf-8", "replace")

  def skip_value(kind: int, what: str) -> bytes | None:
    if kind in _SCALAR_BYTES:
      return take(_SCALAR_BYTES[kind], what)
    if kind == _STRING:
      text(what)
    elif kind == _ARRAY:
      item, count = num("I", what), num("Q", what)
      if item in _SCALAR_BYTES:
        take(count * _SCALAR_BYTES[item], what)
      else:
        for _ in range(count):
          skip_value(item, what)
    else:
      raise _Found(f"{what} has the unknown value type {kind}")
    return None

  if take(4, "the magic number") != b"GGUF":
    return "not a GGUF file (it does not start with b'GGUF')"
  raw = take(4, "the version")
  if struct.unpack("<I", raw)[0] & 0xFFFF == 0:
    order = ">"  # written on a big-endian machine
  if (version := struct.unpack(order + "I", raw)[0]) not in (2, 3):
    return f"GGUF version {version} is not supported (2 and 3 are)"
  n_tensors, n_kv = num("Q", "the tensor count"), num("Q", "the metadata count")
  alignment = 32
  for i in range(n_kv):
    key = text(f"the name of metadata entry {i}")
    value = skip_value(num("I", f"the type of metadata {key!r}"), f"metadata {key!r}")
    if key == "general.alignment" and value is not None and len(value) == 4:
      alignment = struct.unpack(order + "I", value)[0] or 32
  infos = []
  for j in range(n_tensors):
    name = text(f"the name of tensor {j}")
    what = f"the description of tensor {name!r}"
    dims = [num("Q", what) for _ in range(num("I", what))]
    infos.append((name, dims, num("I", what), num("Q", what)))
  data_start = -(-pos // alignment) * alignment
  readable = _readable_types(gguf)
  for name, dims, type_id, offset in infos:
    try:
      qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
      return f"tensor {name!r} has the unknown type id {type_id}; supported types: " + ", ".join(
        readable)
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if dims and dims[0] % block:
      return (f"tensor {name!r} has rows of {dims[0]} values, not a whole number of "
              f"{qtype.name} blocks of {block}")
    start = data_start + offset
    end = start + math.prod(dims) // block * type_bytes
    if end > size:
      return (f"tensor {name!r} ({qtype.name}, GGUF dims {dims}) is cut: its data needs bytes "
              f"{start}..{end}, the file has {size} (cut short?)")
  return None
