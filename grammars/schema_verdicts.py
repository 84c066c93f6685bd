"""Verdicts on one schema object of a full schema, for the value checks: jsonschema-rs validates where
it reads the schema as jsonschema (the reference) does, jsonschema everywhere else. Promises: every
verdict is jsonschema's. The keywords the two read differently (pattern: Python's re, not ECMA-262;
format: our format checker; multipleOf) are handed back to jsonschema inside jsonschema-rs; objects
that reach a construct handled differently as a whole, and values jsonschema-rs cannot take (lone
surrogates), are judged by jsonschema."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jsonschema_rs

from .schema_walk import list_at

# keywords jsonschema judges inside jsonschema-rs, one keyword at a time
REFERENCE_KEYWORDS = ("pattern", "format", "multipleOf")
# constructs whose meaning spans keywords that jsonschema-rs reads on its own, or that only one of
# the two asserts: an object reaching one is judged by jsonschema
_PYTHON_ONLY = frozenset(
    {
        "unevaluatedProperties",
        "unevaluatedItems",
        "contentMediaType",
        "contentEncoding",
        "contentSchema",
        "$dynamicRef",
        "$recursiveRef",
        "$anchor",
        "$dynamicAnchor",
        "$recursiveAnchor",
    }
)
_EXACT_FLOAT_INT = 2**53  # beyond it an integer and a float may compare differently in Rust
# A regex that Python's re and ECMA-262 read alike on printable ASCII: literals, escaped punctuation,
# the ASCII classes (which differ only beyond ASCII), bracket classes, groups and lookaheads,
# alternation, anchors (which differ only at a trailing newline) and counted quantifiers written
# in full. Python-only syntax ((?P, (?<, \A, \Z, {,n}, inline flags) is outside it.
_PORTABLE_PATTERN = re.compile(
    r"""(?:[ !"#%&',/0-9:;<=>@A-Z_`a-z~-]|\\[^A-Za-z0-9]|\\[dDwWsSbB]|[.^$|)*+?]|\((?!\?)|\(\?[:=!]"""
    r"""|\{\d+(?:,\d*)?\}|\[\^?(?:[ !"#%&',./0-9:;<=>?@A-Z_`a-z~-]|\\[^A-Za-z0-9]|\\[dDwWsS])+\])*"""
)


class NodeVerdicts:
    """is_valid per schema object of full (by identity). Each object is judged in one of three ways:
    by jsonschema-rs; by jsonschema-rs when the value's JSON text is plain (ASCII, no escape), else
    jsonschema, for objects reaching patternProperties whose regexes are portable (patternProperties
    reads object keys with the engine's own regex dialect); by jsonschema."""

    def __init__(
        self,
        full: Any,
        reference: Any,
        nodes: list[tuple[dict[str, Any], str]],
        reaching: Callable[[set[int]], set[int]],
        rs_allowed: bool,
    ) -> None:
        """reference: jsonschema's validator of full; nodes: (schema object, its '#...' pointer) for
        every object of full; reaching(seed): the objects from which subschema and $ref edges lead
        into seed; rs_allowed: False where pointers do not name the objects (embedded $id scopes)."""
        self._reference = reference
        self._pointers = {id(n): p for n, p in nodes}
        self._rs: _RsValidators | None = None
        self._python_only: set[int] = set()
        self._plain_only: set[int] = set()
        self._by_node: dict[int, tuple[Any, Any]] = {}
        if rs_allowed and isinstance(full, dict):
            self._rs = _rs_validators(full, reference)
            self._python_only = reaching({id(n) for n, _ in nodes if _python_only(n)})
            self._plain_only = reaching({id(n) for n, _ in nodes if "patternProperties" in n})

    def is_valid(self, node: dict[str, Any], text: bytes, value: Any) -> bool:
        """jsonschema's verdict on value (whose JSON text is text) against node."""
        found = self._by_node.get(id(node))
        if found is None:
            found = self._by_node[id(node)] = self._validators(node)
        python, rs = found
        if rs is None or id(node) in self._plain_only and (not text.isascii() or b"\\" in text):
            return bool(python(value))
        try:
            return bool(rs(value))
        except (ValueError, TypeError, OverflowError):  # e.g. a lone surrogate Rust cannot hold
            return bool(python(value))

    def _validators(self, node: dict[str, Any]) -> tuple[Any, Any]:
        """(jsonschema's is_valid, jsonschema-rs's is_valid or None) for node."""
        python = self._reference.evolve(schema=node).is_valid
        pointer = self._pointers.get(id(node))
        if self._rs is None or pointer is None or id(node) in self._python_only:
            return python, None
        try:
            return python, self._rs[pointer].is_valid
        except KeyError:
            return python, None


def _python_only(node: dict[str, Any]) -> bool:
    """node holds a construct only jsonschema judges: see _PYTHON_ONLY; patternProperties whose
    regexes are not portable; a value list with integers where Rust's number comparison may differ
    from Python's."""
    if any(k in node for k in _PYTHON_ONLY):
        return True
    patterns = node.get("patternProperties")
    if patterns is not None and not (
        isinstance(patterns, dict) and all(_PORTABLE_PATTERN.fullmatch(p) for p in patterns)
    ):
        return True
    values = [*list_at(node, "enum"), *([node["const"]] if "const" in node else [])]
    return any(_has_big_int(v) for v in values)


def _has_big_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) > _EXACT_FLOAT_INT
    if isinstance(value, list):
        return any(_has_big_int(v) for v in value)
    if isinstance(value, dict):
        return any(_has_big_int(v) for v in value.values())
    return False


def _reference_keyword(keyword: str, reference: Any) -> type:
    """A jsonschema-rs custom keyword that asks jsonschema (an instance of reference's class, with
    its format checker) for the verdict of {keyword: value} alone."""

    class ReferenceKeyword:
        def __init__(self, parent_schema: Any, value: Any, schema_path: Any) -> None:
            self._validator = reference.evolve(schema={keyword: value})

        def validate(self, instance: Any) -> None:
            if not self._validator.is_valid(instance):
                raise ValueError(f"fails {keyword}")

    return ReferenceKeyword


_ROOT_URI = "urn:radixlm:schema"


class _RsValidators:
    """jsonschema-rs validators of full's objects by pointer, built on demand against one registry
    of full read in the reference's draft; the keywords the two read differently are judged by
    jsonschema. Building every subschema up front costs seconds on the largest schemas."""

    def __init__(self, full: dict[str, Any], reference: Any, draft: str) -> None:
        self._draft = draft
        self._keywords = {k: _reference_keyword(k, reference) for k in REFERENCE_KEYWORDS}
        self._registry = jsonschema_rs.Registry([(_ROOT_URI, {**full, "$schema": draft})])

    def __getitem__(self, pointer: str) -> Any:
        """The validator of the object at pointer ('#/...'); KeyError when jsonschema-rs refuses it."""
        try:
            return jsonschema_rs.validator_for(
                {"$schema": self._draft, "$ref": _ROOT_URI + pointer},
                registry=self._registry,
                keywords=self._keywords,
                validate_formats=False,
                offline=True,
            )
        except (ValueError, TypeError, jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError) as e:
            raise KeyError(pointer) from e


def _rs_validators(full: dict[str, Any], reference: Any) -> _RsValidators | None:
    """None when jsonschema-rs cannot read full (a draft it does not know, a bad resource)."""
    draft = getattr(reference, "META_SCHEMA", {}).get("$schema")
    if not isinstance(draft, str):
        return None
    try:
        return _RsValidators(full, reference, draft)
    except (ValueError, TypeError, jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError):
        return None
