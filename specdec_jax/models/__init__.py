"""Language models for the decoding loops: the protocols, a Llama in JAX, toy n-gram models.

``llama`` and ``toy`` need only JAX and are not imported by ``import specdec_jax``; loading
real weights (GGUF files) and tokenizing text is the application's job
(:mod:`specdec_jax.app.smollm2`), which needs the ``model`` extra.
"""

from specdec_jax.models.protocol import FeatureDraft
from specdec_jax.models.protocol import Model

__all__ = ("FeatureDraft", "Model")
