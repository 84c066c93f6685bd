"""radixlm.grammars: constrained decoding — regex → FSM → token index, compressed FSM with
jump-forward strings, the xgrammar adapter, JSON-schema helpers; one matcher interface."""

from .base import (
    CompiledGrammar,
    GrammarMatcher,
    allocate_token_bitmask,
    apply_token_bitmask_,
)
from .grammar_backend import GrammarBackend
from .json_schema import json_schema_to_regex, normalize_json_schema

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarMatcher",
    "allocate_token_bitmask",
    "apply_token_bitmask_",
    "json_schema_to_regex",
    "normalize_json_schema",
]
