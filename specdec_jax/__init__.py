"""specdec_jax: exact speculative-decoding verification for JAX.

The verification step of speculative decoding (Leviathan et al. 2023; Chen et
al. 2023) as a pure, jit- and vmap-safe JAX function, with the problem's
stateful ``rng.random()`` interface on top and a literal NumPy reference beside it.

Every public name is re-exported here, flat (``__all__`` lists them by role). The code lives in
five private layer packages, each importing only from those below it -- ``_core`` (the accept
test, sampling, errors, checks, keys, result types) <- ``_logits`` (sampling parameters, row
edits, lazy statistics) <- ``_rows`` (row sources, batching, the chain skeleton) <- ``_rules``
(token-wise, block, tree) <- ``_layouts`` (from logits, packed, engines, vocab-parallel) -- and
in the public modules :mod:`specdec_jax.host` (the stateful API), :mod:`specdec_jax.reference`
(the float64 oracle), :mod:`specdec_jax.theory`, :mod:`specdec_jax.decoding` (the loops) and
:mod:`specdec_jax.structured` (grammars).
"""

from specdec_jax import reference
from specdec_jax import theory
from specdec_jax._core.accept import accepts
from specdec_jax._core.errors import ErrorCode
from specdec_jax._core.errors import describe_error
from specdec_jax._core.results import VerifyResult
from specdec_jax._core.sampling import sample_index
from specdec_jax._core.sampling import sample_index_sharded
from specdec_jax._layouts.engine import engine_params
from specdec_jax._layouts.engine import flat_tokens
from specdec_jax._layouts.from_logits import tree_verify_logits
from specdec_jax._layouts.from_logits import verify_logits
from specdec_jax._layouts.packed import PackedVerifyResult
from specdec_jax._layouts.packed import packed_verify
from specdec_jax._layouts.packed_tree import PackedTreeVerifyResult
from specdec_jax._layouts.packed_tree import packed_tree_verify
from specdec_jax._layouts.vocab_parallel import vocab_parallel_tree_verify
from specdec_jax._layouts.vocab_parallel import vocab_parallel_verify
from specdec_jax._layouts.vocab_parallel_packed import vocab_parallel_packed_tree_verify
from specdec_jax._layouts.vocab_parallel_packed import vocab_parallel_packed_verify
from specdec_jax._logits.adjust import History
from specdec_jax._logits.process import DraftSample
from specdec_jax._logits.process import SamplingParams
from specdec_jax._logits.process import process_logits
from specdec_jax._logits.process import sample_draft
from specdec_jax._logits.request import bitmask_from_ids
from specdec_jax._logits.request import bitmask_from_mask
from specdec_jax._logits.request import logit_bias_arrays
from specdec_jax._logits.request import output_ids_from_counts
from specdec_jax._rules.block import block_verify
from specdec_jax._rules.tokenwise import verify
from specdec_jax._rules.tree import TreeVerifyResult
from specdec_jax._rules.tree import tree_verify
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
from specdec_jax.host import UniformStream
from specdec_jax.host import sample
from specdec_jax.host import speculative_step
from specdec_jax.models.protocol import Model

__version__ = "0.1.0"

__all__ = (  # noqa: RUF022 (grouped by role, not sorted)
  # The rules on probabilities (one sequence, or a batch)
  "verify",
  "block_verify",
  "tree_verify",
  "accepts",
  "VerifyResult",
  "TreeVerifyResult",
  # The rules on logits, with a request's sampling parameters
  "verify_logits",
  "tree_verify_logits",
  "SamplingParams",
  "History",
  "process_logits",
  "sample_draft",
  "DraftSample",
  "sample_index",
  "sample_index_sharded",
  # A request's forms converted on the host
  "bitmask_from_ids",
  "bitmask_from_mask",
  "logit_bias_arrays",
  "output_ids_from_counts",
  # Serving engines: packed layouts and their conventions
  "packed_verify",
  "packed_tree_verify",
  "PackedVerifyResult",
  "PackedTreeVerifyResult",
  "engine_params",
  "flat_tokens",
  # Vocabulary-parallel forms (a mesh holding V / n columns per device)
  "vocab_parallel_verify",
  "vocab_parallel_tree_verify",
  "vocab_parallel_packed_verify",
  "vocab_parallel_packed_tree_verify",
  # Errors under jit
  "ErrorCode",
  "describe_error",
  # Decoding loops (specdec_jax.decoding)
  "generate",
  "speculative_generate",
  "tree_speculative_generate",
  "Model",
  "FeatureDraft",
  "PromptLookup",
  "AdaptiveSpeculation",
  "DraftTree",
  "DynamicTree",
  "plan_tree",
  "TreePlan",
  "GenerateResult",
  "SpeculativeResult",
  "DecodeStats",
  "GrammarOutcome",
  # The problem's stateful host API (specdec_jax.host)
  "speculative_step",
  "sample",
  "UniformStream",
  # Modules
  "reference",
  "theory",
)
