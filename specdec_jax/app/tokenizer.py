"""SmolLM2's byte-level BPE tokenizer, rebuilt with the ``tokenizers`` package from GGUF metadata.

A GGUF file with ``tokenizer.ggml.model == "gpt2"`` carries the whole tokenizer: the vocabulary
(``tokenizer.ggml.tokens``, in GPT-2's byte-to-unicode alphabet), the merges in rank order
(``tokenizer.ggml.merges``, ``"left right"`` strings), the token types (3 = control token,
matched as one token anywhere in the text) and the bos/eos ids. The pre-tokenizer is named by
``tokenizer.ggml.pre``; for ``"smollm"`` (as for ``"starcoder"``) llama.cpp's ``llama-vocab.cpp``
first splits every digit on its own (``\\p{N}``) and then applies the GPT-2 regex, which is
``Digits(individual_digits=True)`` followed by ``ByteLevel(add_prefix_space=False)`` in
``tokenizers``, as in the ``tokenizer.json`` that Hugging Face ships with SmolLM2. No BOS token
is added (``tokenizer.ggml.add_bos_token`` is false).

Byte-level BPE is lossless: ``decode(encode(text)) == text`` for any string.
"""

from __future__ import annotations

import operator
import os
import re
import secrets
from collections.abc import Iterable
from typing import Any

from specdec_jax.app.chat_template import ChatTemplateError
from specdec_jax.app.chat_template import chat_prompt
from specdec_jax.app.gguf import INSTALL
from specdec_jax.app.gguf import metadata
from specdec_jax.app.gguf import open_gguf

_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED = 4  # LLAMA_TOKEN_TYPE_USER_DEFINED
_PRE_TOKENIZERS = ("smollm", "starcoder", "refact", "gpt2", "default")


def _tokenizers():
  try:
    import tokenizers  # optional dependency, imported on use
  except ImportError as e:
    raise ImportError(f"the tokenizer needs the tokenizers package; run: {INSTALL}") from e
  return tokenizers


class Tokenizer:
  """An exact byte-level BPE tokenizer (``encode``/``decode``) with the model's chat prompts.

  Attributes:
    hf: the underlying ``tokenizers.Tokenizer``.
    vocab_size: number of token ids.
    bos_id: beginning-of-sequence id (not added by :meth:`encode`).
    eos_id: end-of-sequence id (``<|im_end|>`` for SmolLM2-Instruct: the end of a turn).
    special_tokens: the control tokens, ``{text: id}``, each encoded as one token.
    chat_template: the Jinja chat template from the file (``tokenizer.chat_template``), or
      None; :meth:`chat_prompt` renders it.
  """

  def __init__(
    self,
    hf: Any,
    *,
    bos_id: int,
    eos_id: int,
    special_tokens: dict[str, int],
    chat_template: str | None = None,
  ):
    """Wrap a built ``tokenizers.Tokenizer`` (use :meth:`from_gguf` to build one)."""
    self.hf = hf
    self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
    self.bos_id = bos_id
    self.eos_id = eos_id
    self.special_tokens = dict(special_tokens)
    self.chat_template = chat_template
    self._literal: Any = None

  @classmethod
  def from_gguf(cls, source: Any) -> Tokenizer:
    """Build the tokenizer from a GGUF file's ``tokenizer.ggml.*`` metadata.

    Args:
      source: a path or an open ``gguf.GGUFReader``.

    Returns:
      The :class:`Tokenizer`.
    """
    tk = _tokenizers()
    reader = open_gguf(source) if isinstance(source, str | os.PathLike) else source
    model = metadata(reader, "tokenizer.ggml.model")
    pre = metadata(reader, "tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in _PRE_TOKENIZERS:
      raise NotImplementedError(
        f"only byte-level BPE tokenizers (model 'gpt2', pre-tokenizer one of {_PRE_TOKENIZERS})"
        f" are supported; the file has model {model!r}, pre-tokenizer {pre!r}"
      )
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    types = metadata(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in metadata(reader, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
      raise ValueError("malformed merge in tokenizer.ggml.merges (expected 'left right')")

    hf = tk.Tokenizer(
      tk.models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        fuse_unk=False,
        byte_fallback=False,
      )
    )
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("gpt2", "default"):
      hf.pre_tokenizer = byte_level
    else:  # llama.cpp splits digits one by one first for these
      hf.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [tk.pre_tokenizers.Digits(individual_digits=True), byte_level]
      )
    hf.decoder = tk.decoders.ByteLevel()
    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types, strict=True)) if ty == _CONTROL}
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
    hf.add_special_tokens([tk.AddedToken(t, special=True, normalized=False) for t in special])
    if user:
      hf.add_tokens([tk.AddedToken(t, special=False, normalized=False) for t in user])
    return cls(
      hf,
      bos_id=int(metadata(reader, "tokenizer.ggml.bos_token_id", 1)),
      eos_id=int(metadata(reader, "tokenizer.ggml.eos_token_id", 2)),
      special_tokens=special,
      chat_template=metadata(reader, "tokenizer.chat_template"),
    )

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text`` (no BOS added; control tokens such as ``<|im_start|>`` in the text
    are encoded as their single ids).

    Args:
      text: any string.

    Returns:
      The token ids.
    """
    return self.hf.encode(_text("Tokenizer.encode", "text", text), add_special_tokens=False).ids

  def encode_literal(self, text: str) -> list[int]:
    """Token ids of ``text`` with no control token: ``<|im_end|>`` written in the text is
    encoded as the characters it is made of, as any other text (for text that a user wrote).

    Args:
      text: any string.

    Returns:
      The token ids, none of them a control token's.
    """
    text = _text("Tokenizer.encode_literal", "text", text)
    if self._literal is None:  # a copy that reads control-token text as text (thread-safe)
      self._literal = type(self.hf).from_str(self.hf.to_str())
      self._literal.encode_special_tokens = True
    return self._literal.encode(text, add_special_tokens=False).ids

  def chat_ids(self, user_message: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt in which only the template writes control tokens.

    When a message holds the text of a control token, the template is rendered
    (:meth:`chat_prompt`) with a placeholder for each message; the text between the
    placeholders (the template's own: ``<|im_start|>user\\n``, ...) is encoded with its control
    tokens, the messages with :meth:`encode_literal`. A message that spells
    ``<|im_end|>\\n<|im_start|>system`` therefore cannot close its turn or open another: it is
    text the model reads inside the user's turn. Otherwise the prompt is encoded whole (the
    same ids as ``encode(chat_prompt(...))``).

    Args:
      user_message: the user's turn (untrusted text).
      system: a system message, sent first (also encoded literally); None sends none.

    Returns:
      The prompt's token ids, ready for the assistant's reply.

    Raises:
      ValueError: the file has no chat template.
      ChatTemplateError: the template changes a message's text (trims or rewrites it), so the
        messages cannot be placed literally.
    """
    _text("Tokenizer.chat_ids", "user_message", user_message)
    if system is not None:
      _text("Tokenizer.chat_ids", "system", system)
    real = self.chat_prompt(user_message, system)
    texts = [user_message] if system is None else [system, user_message]
    if not any(token in text for text in texts for token in self.special_tokens):
      return self.encode(real)  # nothing to escape: the whole prompt as one text
    marks = [f"\ue000{secrets.token_hex(8)}\ue001" for _ in texts]
    literal = dict(zip(marks, texts, strict=True))
    rendered = self.chat_prompt(marks[-1], None if system is None else marks[0])
    parts = re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered)
    if "".join(literal.get(part, part) for part in parts) != real:
      raise ChatTemplateError(
        "Tokenizer.chat_ids: the chat template changes the message text (trims or rewrites "
        "it), so the messages cannot be encoded literally; encode the rendered chat_prompt() "
        "yourself if you trust its text")
    ids: list[int] = []
    for part in parts:
      ids += self.encode_literal(literal[part]) if part in literal else self.encode(part)
    return ids

  def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
    """The text of ``ids`` (bytes that do not form complete UTF-8 characters become U+FFFD).

    Args:
      ids: token ids in ``[0, vocab_size)`` (any iterable of ints, e.g. a NumPy row); a
        decoding loop's row holds its tokens up to its length, then ``pad_id`` (-1): decode
        ``tokens[b, :lengths[b]]``.
      skip_special: drop control tokens such as ``<|im_end|>``.

    Returns:
      The decoded string.

    Raises:
      TypeError: an id that is not an integer (``2.0`` is not read as 2).
      ValueError: an id outside ``[0, vocab_size)``, named with its index (the Rust
        tokenizer would drop ids past the vocabulary from the text and overflow on -1).
    """
    checked = []
    for index, token in enumerate(ids):
      try:
        value = operator.index(token)
      except TypeError:
        raise TypeError(f"Tokenizer.decode: `ids` must be integer token ids, got {token!r} at "
                        f"index {index} instead.") from None
      if not 0 <= value < self.vocab_size:
        raise ValueError(f"Tokenizer.decode: `ids` must be token ids in [0, {self.vocab_size}), "
                         f"got {value} at index {index} instead (-1 is a decoding loop's "
                         f"padding: decode each row up to its length).")
      checked.append(value)
    return self.hf.decode(checked, skip_special_tokens=skip_special)

  def token_to_id(self, token: str) -> int | None:
    """The id of one vocabulary entry (in GPT-2's byte alphabet, e.g. ``"Ġthe"``), or None."""
    return self.hf.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    """The vocabulary entry of ``token_id``, or None."""
    return self.hf.id_to_token(int(token_id))

  def chat_prompt(self, user_message: str, system: str | None = None) -> str:
    """A one-turn prompt in the model's own chat template, ready for the assistant's reply.

    Renders the file's ``tokenizer.chat_template`` the way Hugging Face's
    ``apply_chat_template(..., add_generation_prompt=True, tokenize=False)`` does
    (:func:`~specdec_jax.app.chat_template.render_chat_template`), so any GGUF chat model's
    format works unchanged. For SmolLM2 that is ChatML, with its default system prompt when
    ``system`` is None.

    Args:
      user_message: the user's turn.
      system: a system message, sent first; ``None`` sends none (the template decides).

    Returns:
      The prompt text; :meth:`encode` turns it into ids.

    Raises:
      ValueError: the file has no chat template.
    """
    if not self.chat_template:
      raise ValueError("Tokenizer.chat_prompt: the GGUF file has no tokenizer.chat_template; "
                       "build the prompt text yourself and call encode().")
    return chat_prompt(self.chat_template, user_message, system,
                       bos_token=self.id_to_token(self.bos_id) or "",
                       eos_token=self.id_to_token(self.eos_id) or "")


def _text(fn: str, arg: str, text) -> str:
  """``text`` if it is a ``str`` that UTF-8 can encode, else a ``TypeError``/``ValueError``
  naming the argument (a lone surrogate such as ``"\\ud800"`` is not text a model can read)."""
  if not isinstance(text, str):
    raise TypeError(f"{fn}: `{arg}` must be a str, got {type(text).__name__} instead.")
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise ValueError(f"{fn}: `{arg}` must be valid Unicode text, got the lone surrogate "
                     f"{text[e.start]!r} at index {e.start} (it has no UTF-8 encoding)."
                     ) from None
  return text
