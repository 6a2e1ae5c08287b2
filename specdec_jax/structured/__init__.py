"""Structured generation: JSON schemas and regexes as device-resident automata for the loops.

:func:`compile_json_schema` / :func:`compile_regex` (host, outlines-core: the ``structured``
extra) build a :class:`CompiledGrammar`; :func:`stack_grammars` puts one or more of them on the
device as a :class:`Grammar`, which :func:`~specdec_jax.generate`,
:func:`~specdec_jax.speculative_generate` and :func:`~specdec_jax.tree_speculative_generate`
take as ``grammar=`` with each row's initial state (:func:`start_states`).
"""

from specdec_jax.structured.compile import CompiledGrammar
from specdec_jax.structured.compile import compile_json_schema
from specdec_jax.structured.compile import compile_regex
from specdec_jax.structured.compile import token_bytes_from_byte_level
from specdec_jax.structured.tables import FREE
from specdec_jax.structured.tables import Grammar
from specdec_jax.structured.tables import allowed
from specdec_jax.structured.tables import next_state
from specdec_jax.structured.tables import prefix_state
from specdec_jax.structured.tables import stack_grammars
from specdec_jax.structured.tables import start_states
from specdec_jax.structured.tables import state_bitmask
from specdec_jax.structured.tables import walk

__all__ = (
  "FREE",
  "CompiledGrammar",
  "Grammar",
  "allowed",
  "compile_json_schema",
  "compile_regex",
  "next_state",
  "prefix_state",
  "stack_grammars",
  "start_states",
  "state_bitmask",
  "token_bytes_from_byte_level",
  "walk",
)
