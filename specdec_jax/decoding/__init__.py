"""Decoding loops: plain autoregressive sampling and exact speculative decoding, fully jitted.

The package, one module per concern: ``types`` (results and loop state), ``args`` (host-side
argument checks), ``common`` (the traced pieces every loop shares), ``plain`` (:func:`generate`),
``drafts``, ``chain`` and ``chain_loop`` (:func:`speculative_generate`, its drafts and its traced
loop), ``draft_tree``, ``dynamic_tree``, ``tree`` and ``tree_plan`` (:class:`DraftTree`,
:class:`DynamicTree`, :func:`tree_speculative_generate` and :func:`plan_tree`). The public
entry points are the names this ``__init__`` exports (``__all__``); the modules' other names are
the implementation and may change.

Both loops run a whole batch inside one compiled ``jax.lax.while_loop`` with fixed
shapes. Every row has its own length (ragged batches), its own keys and its own stop
(``eos_id`` or ``max_new_tokens``); finished rows stop changing while the others go on.
Models enter through the :class:`~specdec_jax.models.protocol.Model` protocol: a
cache slot per position, so rolling back rejected proposals is just moving a length.

* :func:`generate`: one target call per token (the baseline).
* :func:`speculative_generate`: a draft proposes ``gamma`` tokens, the target scores
  them in one call and a verifier (default :func:`~specdec_jax.verify`) keeps a prefix
  plus one token of its own, so the output is distributed exactly as :func:`generate`'s.
  The draft is another :class:`Model` (a small model, or the target with layers
  skipped), a :class:`FeatureDraft` reading the target's features (EAGLE) or
  :class:`PromptLookup` (n-gram matches in the context, no model at all); with
  :class:`AdaptiveSpeculation` each row chooses how many to propose from its past acceptance.
* Every loop takes ``grammar=`` (:mod:`specdec_jax.structured`: a JSON schema or a regex as
  device tables) and samples only what it allows, the draft and the target masked alike at
  every position, tokens the grammar forces proposed for free (:class:`GrammarOutcome`).
* :func:`tree_speculative_generate`: a draft model proposes a :class:`DraftTree` of
  candidates, the target scores every node in one call with tree attention and
  :func:`~specdec_jax.tree_verify` keeps one path plus a token of its own;
  :func:`plan_tree` sizes the tree from measured acceptance and the machine's cost curve;
  a :class:`DynamicTree` (EAGLE-2) drafts each row's tree afresh from the draft's confidences.
"""

from specdec_jax.decoding.adaptive import AdaptiveSpeculation
from specdec_jax.decoding.chain import VERIFIERS
from specdec_jax.decoding.chain import Verifier
from specdec_jax.decoding.chain import speculative_generate
from specdec_jax.decoding.drafts import Draft
from specdec_jax.decoding.drafts import FeatureDraft
from specdec_jax.decoding.drafts import PromptLookup
from specdec_jax.decoding.dynamic_tree import DynamicTree
from specdec_jax.decoding.plain import generate
from specdec_jax.decoding.tree import DraftTree
from specdec_jax.decoding.tree import tree_speculative_generate
from specdec_jax.decoding.tree_plan import TreePlan
from specdec_jax.decoding.tree_plan import plan_tree
from specdec_jax.decoding.tree_verifier import TREE_LAWS
from specdec_jax.decoding.types import DecodeStats
from specdec_jax.decoding.types import GenerateResult
from specdec_jax.decoding.types import GrammarOutcome
from specdec_jax.decoding.types import SpeculativeResult

__all__ = (
  "TREE_LAWS",
  "VERIFIERS",
  "AdaptiveSpeculation",
  "DecodeStats",
  "Draft",
  "DraftTree",
  "DynamicTree",
  "FeatureDraft",
  "GenerateResult",
  "GrammarOutcome",
  "PromptLookup",
  "SpeculativeResult",
  "TreePlan",
  "Verifier",
  "generate",
  "plan_tree",
  "speculative_generate",
  "tree_speculative_generate",
)
