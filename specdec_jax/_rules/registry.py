"""The one registry of rules: every layout looks its rule up here by name.

A rule is a one-sequence body that reads rows only through row sources
(:mod:`~specdec_jax._rows.sources`), so it runs unchanged in every layout: padded or packed rows,
point-mass drafts, vocabulary shards. Chain rules share one signature,
``rule(p, q, draft, uniforms, num_draft, *, pad_id, vocab, axis_name, p_offset, q_offset,
bonus_token) -> VerifyResult``; the tree rule (:func:`~specdec_jax._rules.tree.tree_rows`) takes a
tree instead of a chain and its drafting law (``law=``). A new chain rule is one module with
such a body and one entry here.
"""

from __future__ import annotations

from specdec_jax._rules.block import block_verify_rows
from specdec_jax._rules.tokenwise import verify_rows
from specdec_jax._rules.tree import LAWS
from specdec_jax._rules.tree import UNIFORM_LAYOUTS
from specdec_jax._rules.tree import tree_rows

#: Chain rules by name (``rule=``): token-wise (Leviathan et al. 2023) and block (Sun et al.).
CHAIN_RULES = {"token": verify_rows, "block": block_verify_rows}

#: The tree rule (recursive rejection sampling) and its drafting laws (``law=``).
TREE_RULE = tree_rows

__all__ = ["CHAIN_RULES", "LAWS", "TREE_RULE", "UNIFORM_LAYOUTS"]
