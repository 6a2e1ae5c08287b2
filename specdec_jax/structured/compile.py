"""Compiling a JSON schema or a regex into the tables of :mod:`specdec_jax.structured.tables`.

outlines-core (the ``structured`` extra) builds the token-level automaton of a regex over the
model's vocabulary (``Index``) and turns a JSON schema into that regex; this module walks it
once, on the host, into dense NumPy tables: token classes, the next state of each (state,
class), deduplicated bitmask rows, final states, and the token each state forces (a draft
proposed for free). Chosen by measurement on this CPU (docs: "Structured output"):
llguidance computes masks but exposes no automaton to put on the device, and xgrammar's wheel
imports torch.

Reference: Willard & Louf 2023, "Efficient Guided Generation for Large Language Models".
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

#: Bytes of forced text looked ahead for the forced token of a state.
MAX_FORCED_BYTES = 32
#: A state whose allowed tokens all start with one byte but number more than this is not
#: searched for forced text (the text is almost never forced there).
MAX_FORCED_BRANCHES = 256


class CompiledGrammar(NamedTuple):
  """One grammar's automaton over a vocabulary of ``V`` tokens (host NumPy arrays).

  Attributes (``S`` live states, ``C`` token classes, ``M`` distinct masks, ``W`` words):
    token_class: int32 ``(V,)``; next_state: int32 ``(S, C)`` (``-1``: not allowed);
    mask_id: int32 ``(S,)``; mask_rows: int32 ``(M, W)``; final: bool ``(S,)``;
    forced: int32 ``(S,)``; fallback: int32 ``(S,)`` (see :class:`~specdec_jax.structured.
    Grammar`); initial_state: int; eos_id: int; stats: compile time and sizes.
  """

  token_class: np.ndarray
  next_state: np.ndarray
  mask_id: np.ndarray
  mask_rows: np.ndarray
  final: np.ndarray
  forced: np.ndarray
  fallback: np.ndarray
  initial_state: int
  eos_id: int
  stats: dict

  def nbytes(self) -> int:
    return sum(a.nbytes for a in (self.token_class, self.next_state, self.mask_id,
                                  self.mask_rows, self.final, self.forced, self.fallback))


def _outlines(name: str):
  try:
    import outlines_core
  except ImportError as e:  # pragma: no cover - the extra is installed in the tests
    raise ImportError(f"{name}: needs outlines-core, the `structured` extra "
                      "(pip install 'specdec_jax[structured]').") from e
  return outlines_core


def _check_vocabulary(name: str, token_bytes, eos_id) -> int:
  if not isinstance(token_bytes, Sequence) or not token_bytes:
    raise ValueError(f"{name}: `token_bytes` must be a non-empty list of bytes (or None for a "
                     f"token that never appears in text), one per token id; got "
                     f"{type(token_bytes).__name__}.")
  bad = [i for i, b in enumerate(token_bytes) if b is not None and not isinstance(b, bytes)]
  if bad:
    raise ValueError(f"{name}: `token_bytes[{bad[0]}]` is {type(token_bytes[bad[0]]).__name__}; "
                     "expected bytes (the token's raw bytes) or None.")
  vocab = len(token_bytes)
  if isinstance(eos_id, bool) or not isinstance(eos_id, (int, np.integer)) or not (
      0 <= eos_id < vocab):
    raise ValueError(f"{name}: `eos_id` must be a token id in [0, {vocab}); got {eos_id!r}.")
  return vocab


def compile_regex(regex: str, token_bytes: Sequence[bytes | None], eos_id: int, *,
                  encode: Callable[[str], list[int]] | None = None) -> CompiledGrammar:
  """The automaton of texts that fully match ``regex``, over a tokenizer's vocabulary.

  Args:
    regex: the pattern (outlines-core's dialect: Rust ``regex`` syntax, anchored).
    token_bytes: ``V`` entries, the raw bytes each token id decodes to (None for control
      tokens, never allowed; see :func:`token_bytes_from_byte_level`).
    eos_id: the end-of-sequence token, allowed exactly where the text is complete.
    encode: the tokenizer's ``str -> ids`` (without special tokens): with it, a state where
      every continuation starts with the same text (a key, ``": "``) forces the first token of
      that text's encoding; without it, only a state with one allowed token forces it.

  Returns:
    A :class:`CompiledGrammar`; :func:`~specdec_jax.structured.stack_grammars` puts it on the
    device.

  Example:
    >>> vocab = [b"yes", b"no", b".", b"y", b"e", b"s", None]
    >>> compiled = compile_regex(r"(yes|no)\\.", vocab, eos_id=6)
    >>> after_yes = compiled.next_state[0, compiled.token_class[0]]
    >>> compiled.forced[after_yes].item()  # "." is the only token allowed
    2
  """
  name = "compile_regex"
  if not isinstance(regex, str) or not regex:
    raise ValueError(f"{name}: `regex` must be a non-empty str; got {regex!r}.")
  return _compile(name, regex, token_bytes, eos_id, encode)


def compile_json_schema(schema, token_bytes: Sequence[bytes | None], eos_id: int, *,
                        whitespace_pattern: str | None = "",
                        encode: Callable[[str], list[int]] | None = None) -> CompiledGrammar:
  """The automaton of JSON texts valid under ``schema`` (a dict or a JSON string).

  outlines-core turns the schema into a regex; bounded integers (``minimum`` and ``maximum``
  less than 1,000 apart), which its regex leaves unbounded, are rewritten as an ``enum`` of
  their values, so every text the automaton accepts validates. ``whitespace_pattern``: the
  regex between tokens of the JSON syntax (``""``: compact JSON, the most forced text; None:
  outlines-core's default ``[ ]?``). Other arguments as in :func:`compile_regex`.

  Raises:
    ValueError: ``schema`` is not valid JSON or not a valid JSON Schema, or outlines-core
      cannot compile it (its message is included).
  """
  name = "compile_json_schema"
  if isinstance(schema, str):
    try:
      schema = json.loads(schema)
    except json.JSONDecodeError as e:
      raise ValueError(f"{name}: `schema` is not valid JSON ({e}).") from None
  if not isinstance(schema, (dict, bool)):
    raise ValueError(f"{name}: `schema` must be a JSON object (dict or str); got "
                     f"{type(schema).__name__}.")
  try:
    import jsonschema
  except ImportError:  # pragma: no cover - optional: checked by outlines-core alone then
    jsonschema = None
  if jsonschema is not None:
    try:
      jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
      raise ValueError(f"{name}: `schema` is not a valid JSON Schema: {e.message}.") from None
  oc = _outlines(name)
  try:
    regex = oc.json_schema.build_regex_from_schema(json.dumps(_bound_integers(schema)),
                                                  whitespace_pattern)
  except Exception as e:  # outlines-core raises its own error types
    raise ValueError(f"{name}: outlines-core cannot compile this schema: {e}") from None
  return _compile(name, regex, token_bytes, eos_id, encode)


def _bound_integers(schema, most: int = 1000):
  if isinstance(schema, dict):
    out = {k: _bound_integers(v, most) for k, v in schema.items()}
    if out.get("type") == "integer" and "minimum" in out and "maximum" in out:
      lo, hi = int(out["minimum"]), int(out["maximum"])
      if 0 <= hi - lo < most:
        return {"enum": list(range(lo, hi + 1))}
    return out
  if isinstance(schema, list):
    return [_bound_integers(v, most) for v in schema]
  return schema


def _compile(name, regex, token_bytes, eos_id, encode) -> CompiledGrammar:
  vocab = _check_vocabulary(name, token_bytes, eos_id)
  oc = _outlines(name)
  start = time.perf_counter()
  table: dict[bytes, list[int]] = {}
  for i, b in enumerate(token_bytes):
    if b and i != eos_id:
      table.setdefault(b, []).append(i)
  try:
    index = oc.Index(regex, oc.Vocabulary(int(eos_id), table))
  except Exception as e:
    raise ValueError(f"{name}: outlines-core cannot compile {regex[:200]!r} over this "
                     f"vocabulary: {e}") from None
  compiled = _tables(name, index, vocab, int(eos_id), token_bytes, encode)
  compiled.stats["compile_s"] = time.perf_counter() - start
  return compiled


def _explore(index, eos_id: int):
  """Breadth-first over the index: the states in order, each one's (tokens, next states)."""
  order = [index.get_initial_state()]
  seen = set(order)
  finals = set(index.get_final_states())
  edges = []
  for s in order:
    tokens = [t for t in index.get_allowed_tokens(s) if t != eos_id]
    nxt = [index.get_next_state(s, t) for t in tokens]
    for n in nxt:
      if n not in seen:
        seen.add(n)
        order.append(n)
    edges.append((np.asarray(tokens, np.int64), nxt))
  dense = {s: i for i, s in enumerate(order)}
  edges = [(t, np.asarray([dense[n] for n in nxt], np.int64)) for t, nxt in edges]
  return edges, np.array([s in finals for s in order], bool)


def _live(edges, final) -> np.ndarray:
  """bool ``(S,)``: the states from which a final state can be reached."""
  preds: list[list[int]] = [[] for _ in edges]
  for s, (_, nxt) in enumerate(edges):
    for n in np.unique(nxt).tolist():
      preds[n].append(s)
  live = final.copy()
  stack = np.flatnonzero(final).tolist()
  while stack:
    for p in preds[stack.pop()]:
      if not live[p]:
        live[p] = True
        stack.append(p)
  return live


_M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
_K1, _K2 = np.uint64(0x100000001B3), np.uint64(0xFF51AFD7ED558CCD)


def _token_classes(edges, vocab: int, eos_id: int) -> np.ndarray:
  """int32 ``(V,)``: tokens whose (state -> next state) columns are equal share a class (a
  pair of 64-bit hashes of the column, checked exactly by :func:`_tables`); EOS has its own."""
  h1 = np.zeros(vocab, np.uint64)
  h2 = np.zeros(vocab, np.uint64)
  with np.errstate(over="ignore"):
    for s, (tokens, nxt) in enumerate(edges):
      if tokens.size:
        f = (np.uint64(s) * _M1) ^ ((nxt.astype(np.uint64) + np.uint64(1)) * _M2)
        h1[tokens] = h1[tokens] * _K1 + f
        h2[tokens] = h2[tokens] * _K2 + (f ^ (f >> np.uint64(29)))
  h1[eos_id], h2[eos_id] = np.uint64(0xE05E05E05E05E05E), np.uint64(0x5E05E05E05E05E05)
  _, first, inverse = np.unique(np.stack([h1, h2], 1), axis=0, return_index=True,
                                return_inverse=True)
  rank = np.argsort(np.argsort(first))  # classes numbered by their lowest token id
  return rank[inverse.reshape(-1)].astype(np.int32)


def _tables(name, index, vocab: int, eos_id: int, token_bytes, encode) -> CompiledGrammar:
  edges, final = _explore(index, eos_id)
  live = _live(edges, final)  # every allowed token keeps the text completable
  if not live[0]:
    raise ValueError(f"{name}: the grammar accepts no text over this vocabulary (no sequence of "
                     "its tokens reaches a complete match).")
  keep = np.flatnonzero(live)
  remap = np.full(len(edges), -1, np.int64)
  remap[keep] = np.arange(keep.size)
  edges = [(edges[s][0][live[edges[s][1]]], remap[edges[s][1][live[edges[s][1]]]]) for s in keep]
  final = final[keep]
  token_class = _token_classes(edges, vocab, eos_id)
  classes = int(token_class.max()) + 1
  size = np.bincount(token_class, minlength=classes)
  next_state = np.full((keep.size, classes), -1, np.int32)
  for s, (tokens, nxt) in enumerate(edges):
    c = token_class[tokens]
    next_state[s, c] = nxt
    seen = np.bincount(c, minlength=classes)
    if not (np.array_equal(next_state[s, c], nxt)
            and np.array_equal(seen[seen > 0], size[seen > 0])):  # a hash collision
      raise AssertionError(f"{name}: token classes collided in state {s}; please report it.")
  next_state[:, token_class[eos_id]] = np.where(final, np.arange(keep.size), -1)
  # Bitmask rows, deduplicated: bit t of a state's row <=> next_state[s, token_class[t]] >= 0.
  rows, mask_id = np.unique(next_state >= 0, axis=0, return_inverse=True)
  mask_id = mask_id.reshape(-1).astype(np.int32)
  bits = rows[:, token_class]  # (M, V)
  words = (vocab + 31) // 32
  packed = np.packbits(bits, axis=1, bitorder="little")
  packed = np.pad(packed, ((0, 0), (0, 4 * words - packed.shape[1])))
  mask_rows = np.ascontiguousarray(packed).view("<u4").view(np.int32)
  fallback = np.argmax(bits, axis=1).astype(np.int32)[mask_id]
  forced = _forced_tokens(next_state, token_class, bits, mask_id, final, eos_id, token_bytes,
                          encode)
  stats = dict(states=int(keep.size), classes=classes, masks=int(mask_rows.shape[0]),
               forced_states=int(np.sum(forced >= 0)))
  return CompiledGrammar(token_class, next_state, mask_id, mask_rows, final, forced, fallback,
                         0, eos_id, stats)


def _forced_tokens(next_state, token_class, mask_bits, mask_id, final, eos_id, token_bytes,
                   encode):
  """int32 ``(S,)``: each state's forced token (see :class:`CompiledGrammar`), else ``-1``
  (``mask_bits`` ``(M, V)``: the distinct masks, ``mask_id`` ``(S,)``)."""
  states = next_state.shape[0]
  count = mask_bits.sum(axis=1)[mask_id]
  forced = np.where(count == 1, np.argmax(mask_bits, axis=1)[mask_id], -1).astype(np.int32)
  bits = _Rows(mask_bits, mask_id)
  if encode is None:
    return forced
  first = np.array([b[0] if b else -1 for b in (x or b"" for x in token_bytes)], np.int32)
  memo: dict[tuple[int, int], bytes] = {}

  def text(s: int, k: int) -> bytes:
    """The longest text (at most ``k`` bytes) every continuation from ``s`` starts with."""
    if k <= 0 or bits[s, eos_id]:
      return b""
    if (s, k) in memo:
      return memo[(s, k)]
    tokens = np.flatnonzero(bits[s])
    out = b""
    if tokens.size <= MAX_FORCED_BRANCHES and np.unique(first[tokens]).size == 1:
      common = None
      for t in tokens.tolist():
        n = int(next_state[s, token_class[t]])
        c = (token_bytes[t] + text(n, k - len(token_bytes[t])))[:k]
        if common is None:
          common = c
        else:
          i = 0
          while i < min(len(common), len(c)) and common[i] == c[i]:
            i += 1
          common = common[:i]
        if not common:
          break
      out = common or b""
    memo[(s, k)] = out
    return out

  for s in range(states):
    if forced[s] >= 0 or bits[s, eos_id] or final[s]:
      continue
    raw = text(s, MAX_FORCED_BYTES)
    cut = raw.decode("utf-8", "ignore")
    if not cut or not raw.startswith(cut.encode()):
      continue
    ids = list(encode(cut))
    if len(ids) == 1:  # one token spells all the forced text: its end may merge with the
      # free text after it in the model's own tokenization (``":`` + ``"Maria``), so propose
      # the longest allowed token strictly inside it, when there is one (measured on the
      # JSON task with SmolLM2: 2.43 -> 2.67 tokens per target call with prompt lookup)
      inside = [t for t in np.flatnonzero(bits[s]).tolist()
                if token_bytes[t] and len(token_bytes[t]) < len(raw)
                and raw.startswith(token_bytes[t])]
      if inside:
        ids = [max(inside, key=lambda t: (len(token_bytes[t]), -t))]
    if ids and 0 <= ids[0] < bits.shape[1] and bits[s, ids[0]]:
      forced[s] = ids[0]
  return forced


class _Rows:
  """``bits[s]`` / ``bits[s, t]``: state ``s``'s allowed tokens, read from the distinct masks."""

  def __init__(self, mask_bits, mask_id):
    self.mask_bits, self.mask_id = mask_bits, mask_id
    self.shape = (mask_id.shape[0], mask_bits.shape[1])

  def __getitem__(self, at):
    if isinstance(at, tuple):
      return self.mask_bits[self.mask_id[at[0]], at[1]]
    return self.mask_bits[self.mask_id[at]]


def token_bytes_from_byte_level(tokens: Sequence[str | None],
                                special_ids=()) -> list[bytes | None]:
  """GPT-2 byte-level token strings (``"Ġthe"``, as BPE vocabularies store them) to the raw
  bytes they decode to (``b" the"``); None for ``special_ids`` and missing entries.

  Raises:
    ValueError: a token holds a character outside the byte-level alphabet (the vocabulary is
      not byte-level: pass its bytes directly).
  """
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  to_byte = {chr(b): b for b in printable}
  extra = 0
  for b in range(256):
    if b not in printable:
      to_byte[chr(256 + extra)] = b
      extra += 1
  special = set(int(i) for i in special_ids)
  out: list[bytes | None] = []
  for i, t in enumerate(tokens):
    if t is None or i in special:
      out.append(None)
      continue
    try:
      out.append(bytes(to_byte[c] for c in t))
    except KeyError as e:
      raise ValueError(f"token_bytes_from_byte_level: token {i} ({t!r}) holds {e.args[0]!r}, "
                       "not a byte-level character; expected a GPT-2 byte-level vocabulary."
                       ) from None
  return out


__all__ = ["CompiledGrammar", "compile_json_schema", "compile_regex",
           "token_bytes_from_byte_level"]
