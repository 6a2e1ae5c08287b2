"""specdec_jax: exact speculative-decoding verification for JAX.

The verification step of speculative decoding (Leviathan et al. 2023; Chen et
al. 2023) as a pure, jit- and vmap-safe JAX function, with the problem's
stateful ``rng.random()`` interface on top and a literal NumPy reference beside it.
"""

from specdec_jax import reference
from specdec_jax import theory
from specdec_jax._accept import accepts
from specdec_jax._adapter import UniformStream
from specdec_jax._adapter import sample
from specdec_jax._adapter import speculative_step
from specdec_jax._adjust import History
from specdec_jax._block import block_verify
from specdec_jax._engine import engine_params
from specdec_jax._engine import flat_tokens
from specdec_jax._errors import ErrorCode
from specdec_jax._errors import describe_error
from specdec_jax._from_logits import tree_verify_logits
from specdec_jax._from_logits import verify_logits
from specdec_jax._logits import DraftSample
from specdec_jax._logits import SamplingParams
from specdec_jax._logits import process_logits
from specdec_jax._logits import sample_draft
from specdec_jax._packed import PackedVerifyResult
from specdec_jax._packed import packed_verify
from specdec_jax._packed_tree import PackedTreeVerifyResult
from specdec_jax._packed_tree import packed_tree_verify
from specdec_jax._request import bitmask_from_ids
from specdec_jax._request import bitmask_from_mask
from specdec_jax._request import logit_bias_arrays
from specdec_jax._request import output_ids_from_counts
from specdec_jax._results import VerifyResult
from specdec_jax._sampling import sample_index
from specdec_jax._sampling import sample_index_sharded
from specdec_jax._tree import TreeVerifyResult
from specdec_jax._tree import tree_verify
from specdec_jax._verify import verify
from specdec_jax._vocab_parallel import vocab_parallel_tree_verify
from specdec_jax._vocab_parallel import vocab_parallel_verify
from specdec_jax._vocab_parallel_packed import vocab_parallel_packed_tree_verify
from specdec_jax._vocab_parallel_packed import vocab_parallel_packed_verify
from specdec_jax.decoding import AdaptiveSpeculation
from specdec_jax.decoding import DecodeStats
from specdec_jax.decoding import DraftTree
from specdec_jax.decoding import DynamicTree
from specdec_jax.decoding import FeatureDraft
from specdec_jax.decoding import GenerateResult
from specdec_jax.decoding import GrammarOutcome
from specdec_jax.decoding import PromptLookup
from specdec_jax.decoding import SpeculativeResult
from specdec_jax.decoding import TreePlan
from specdec_jax.decoding import generate
from specdec_jax.decoding import plan_tree
from specdec_jax.decoding import speculative_generate
from specdec_jax.decoding import tree_speculative_generate
from specdec_jax.models.protocol import Model

__version__ = "0.1.0"

__all__ = (
  "AdaptiveSpeculation",
  "DecodeStats",
  "DraftSample",
  "DraftTree",
  "DynamicTree",
  "ErrorCode",
  "FeatureDraft",
  "GenerateResult",
  "GrammarOutcome",
  "History",
  "Model",
  "PackedTreeVerifyResult",
  "PackedVerifyResult",
  "PromptLookup",
  "SamplingParams",
  "SpeculativeResult",
  "TreePlan",
  "TreeVerifyResult",
  "UniformStream",
  "VerifyResult",
  "accepts",
  "bitmask_from_ids",
  "bitmask_from_mask",
  "block_verify",
  "describe_error",
  "engine_params",
  "flat_tokens",
  "generate",
  "logit_bias_arrays",
  "output_ids_from_counts",
  "packed_tree_verify",
  "packed_verify",
  "plan_tree",
  "process_logits",
  "reference",
  "sample",
  "sample_draft",
  "sample_index",
  "sample_index_sharded",
  "speculative_generate",
  "speculative_step",
  "theory",
  "tree_speculative_generate",
  "tree_verify",
  "tree_verify_logits",
  "verify",
  "verify_logits",
  "vocab_parallel_packed_tree_verify",
  "vocab_parallel_packed_verify",
  "vocab_parallel_tree_verify",
  "vocab_parallel_verify",
)
