"""``Tokenizer`` on a tiny byte-level BPE vocabulary (no GGUF file needed): ``decode`` names ids
outside the vocabulary instead of overflowing or dropping them. The SmolLM2 tokenizer itself is
tested in tests/app/test_real_model.py."""

from __future__ import annotations

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers")

from specdec_jax.app.tokenizer import Tokenizer  # noqa: E402


def _tiny() -> Tokenizer:
  """``a``, ``b``, ``Ġ`` (a space in GPT-2's byte alphabet), ``ab`` and the control ``<|end|>``."""
  hf = tokenizers.Tokenizer(tokenizers.models.BPE(
    vocab={"a": 0, "b": 1, "Ġ": 2, "ab": 3, "<|end|>": 4}, merges=[("a", "b")]))
  hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = tokenizers.decoders.ByteLevel()
  hf.add_special_tokens([tokenizers.AddedToken("<|end|>", special=True, normalized=False)])
  return Tokenizer(hf, bos_id=4, eos_id=4, special_tokens={"<|end|>": 4})


def test_decode_reads_ids_of_the_vocabulary():
  tok = _tiny()
  assert tok.vocab_size == 5
  assert tok.decode([3, 2, 0, 4]) == "ab a<|end|>"
  assert tok.decode(np.array([3, 2, 1, 4], np.int64), skip_special=True) == "ab b"
  assert tok.decode(tok.encode("ab ba")) == "ab ba"


@pytest.mark.parametrize("bad", [-1, 2**32 + 28, 5, 49152, 10**6, np.int64(-3)])
def test_decode_names_ids_outside_the_vocabulary(bad):
  """-1 (the loops' padding) and ``2**32 + 28`` once raised a bare OverflowError, and ids past
  the vocabulary were silently dropped from the text."""
  with pytest.raises(ValueError, match=rf"Tokenizer.decode: `ids` must be token ids in \[0, 5\), "
                                       rf"got {int(bad)} at index 1 instead"):
    _tiny().decode([3, bad, 0])


@pytest.mark.parametrize("bad", [2.0, "3", None])
def test_decode_refuses_ids_that_are_not_integers(bad):
  with pytest.raises(TypeError, match=r"Tokenizer.decode: `ids` must be integer token ids, got "
                                      rf"{bad!r} at index 0"):
    _tiny().decode([bad])
