"""Models for the decoding loop: the protocol, a Llama in JAX, and the GGUF loader."""

from specdec_jax.models.protocol import Model

__all__ = ("Model",)
