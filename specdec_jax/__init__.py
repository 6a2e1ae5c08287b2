"""specdec_jax: exact speculative-decoding verification for JAX.

The verification step of speculative decoding (Leviathan et al. 2023; Chen et
al. 2023) as a pure, jit- and vmap-safe JAX function, with the problem's
stateful ``rng.random()`` interface on top and a literal NumPy reference beside it.
"""

from specdec_jax import reference
from specdec_jax._adapter import UniformStream
from specdec_jax._adapter import sample
from specdec_jax._adapter import speculative_step
from specdec_jax._rule import ErrorCode
from specdec_jax._rule import accepts
from specdec_jax._rule import describe_error
from specdec_jax._sampling import sample_index
from specdec_jax._verify import VerifyResult
from specdec_jax._verify import verify

__version__ = "0.1.0"

__all__ = (
  "ErrorCode",
  "UniformStream",
  "VerifyResult",
  "accepts",
  "describe_error",
  "reference",
  "sample",
  "sample_index",
  "speculative_step",
  "verify",
)
