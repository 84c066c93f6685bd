"""Verdicts on one schema object of a full schema, for the value checks: jsonschema-rs validates where
it reads the schema as jsonschema (the reference) does, jsonschema everywhere else. Promises: every
verdict is jsonschema's. The keywords the two read differently are handed back to jsonschema inside
jsonschema-rs (format: our format checker; multipleOf; pattern: Python's re, unless the text is
plain and the regex portable); objects that reach a construct handled differently as a whole, and
values jsonschema-rs cannot take (lone surrogates), are judged by jsonschema."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import jsonschema_rs

from .schema_walk import list_at

logger = logging.getLogger(__name__)

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
Verdict = Callable[[Any], bool]
_EXACT_FLOAT_INT = 2**53  # beyond it an integer and a float may compare differently in Rust
# A regex that Python's re and jsonschema-rs (ECMA-262) read alike on printable ASCII: literals,
# escaped punctuation, the ASCII classes (which differ only beyond ASCII), bracket classes, groups and
# lookaheads, alternation, anchors (which differ only at a trailing newline) and counted quantifiers
# written in full. Python-only syntax ((?P, (?<, \A, \Z, {,n}, inline flags) is outside it.
_PORTABLE_PATTERN = re.compile(
    r"""(?:[ !"#%&',/0-9:;<=>@A-Z_`a-z~-]|\\[^A-Za-z0-9]|\\[dDwWsSbB]|[.^$|)*+?]|\((?!\?)|\(\?[:=!]"""
    r"""|\{\d+(?:,\d*)?\}|\[\^?(?:[ !"#$%&'()*+,./0-9:;<=>?@A-Z_`a-z{|}~-]|\\[^A-Za-z0-9]|\\[dDwWsS])+\])*"""
)


@dataclass
class _Judges:
    """One schema object's validators: jsonschema's, and jsonschema-rs's (by whether it reads
    pattern with its own regexes), built when first needed. pointer is None where jsonschema judges
    every text. jsonschema-rs reading pattern with Python's re judges plain texts, and any text where
    any_text (the object reaches no patternProperties, which match keys in the engine's dialect);
    reading every regex itself, plain texts where own_regexes (every regex reached is portable)."""

    python: Verdict
    pointer: str | None
    any_text: bool
    own_regexes: bool
    built: dict[bool, Verdict | None] = field(default_factory=dict)


class NodeVerdicts:
    """is_valid per schema object of full (by identity), by jsonschema-rs where _Judges allows it,
    else by jsonschema. A plain JSON text is ASCII without escapes: no control character, no
    character where Python's and ECMA-262's regex classes part, no newline before a final $."""

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
        self._key_regexes: set[int] = set()
        self._foreign_regexes: set[int] = set()
        self._by_node: dict[int, _Judges] = {}
        if rs_allowed and isinstance(full, dict):
            self._rs = _rs_validators(full, reference)
        if self._rs is not None:
            self._python_only = reaching({id(n) for n, _ in nodes if _python_only(n)})
            self._key_regexes = reaching({id(n) for n, _ in nodes if "patternProperties" in n})
            self._foreign_regexes = reaching({id(n) for n, _ in nodes if not _portable_pattern(n)})

    def is_valid(self, node: dict[str, Any], text: bytes, value: Any) -> bool:
        """jsonschema's verdict on value (whose JSON text is text) against node."""
        judges = self._by_node.get(id(node))
        if judges is None:
            judges = self._by_node[id(node)] = self._judges(node)
        plain = text.isascii() and b"\\" not in text
        rs = self._rs_validator(judges, True) if plain and judges.own_regexes else None
        if rs is None and (plain or judges.any_text):  # also where jsonschema-rs refuses a regex
            rs = self._rs_validator(judges, False)
        if rs is None:
            return judges.python(value)
        try:
            return rs(value)
        except (ValueError, TypeError, OverflowError):  # e.g. a lone surrogate Rust cannot hold
            return judges.python(value)

    def _judges(self, node: dict[str, Any]) -> _Judges:
        validator = self._reference.evolve(schema=node)
        pointer = self._pointers.get(id(node))
        if self._rs is None or id(node) in self._python_only:
            pointer = None
        return _Judges(
            validator.is_valid,
            pointer,
            id(node) not in self._key_regexes,
            id(node) not in self._foreign_regexes,
        )

    def _rs_validator(self, judges: _Judges, own_regexes: bool) -> Verdict | None:
        if judges.pointer is None or self._rs is None:
            return None
        if own_regexes not in judges.built:
            judges.built[own_regexes] = self._rs.get(judges.pointer, own_regexes)
        return judges.built[own_regexes]


def _portable_pattern(node: dict[str, Any]) -> bool:
    """node's pattern, if any, is read alike by Python's re and jsonschema-rs on plain text."""
    pattern = node.get("pattern")
    return pattern is None or isinstance(pattern, str) and bool(_PORTABLE_PATTERN.fullmatch(pattern))


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
    """A jsonschema-rs custom keyword that gives jsonschema's verdict on {keyword: value} alone, read
    as jsonschema reads it: pattern with Python's re.search on strings, format with the reference's
    format checker, anything else through the reference validator."""

    class ReferenceKeyword:
        def __init__(self, parent_schema: Any, value: Any, schema_path: Any) -> None:
            self._passes = _keyword_check(keyword, value, reference)

        def validate(self, instance: Any) -> None:
            if not self._passes(instance):
                raise ValueError(f"fails {keyword}")

    return ReferenceKeyword


def _keyword_check(keyword: str, value: Any, reference: Any) -> Callable[[Any], bool]:
    if keyword == "pattern" and isinstance(value, str):
        search = re.compile(value).search
        return lambda instance: not isinstance(instance, str) or search(instance) is not None
    checker = reference.format_checker
    if keyword == "format" and isinstance(value, str) and checker is not None:
        return lambda instance: bool(checker.conforms(instance, value))
    validator = reference.evolve(schema={keyword: value})
    return lambda instance: bool(validator.is_valid(instance))


_ROOT_URI = "urn:radixlm:schema"
_FRAGMENT_SAFE = "#/~-._!$&'()*+,;=:@"  # a JSON pointer's characters left as they are in a URI fragment


class _RsValidators:
    """jsonschema-rs validators of full's objects by pointer, built on demand against one registry
    of full read in the reference's draft; the keywords the two read differently are judged by
    jsonschema. Building every subschema up front costs seconds on the largest schemas."""

    def __init__(self, full: dict[str, Any], reference: Any, draft: str) -> None:
        self._draft = draft
        self._keywords = {k: _reference_keyword(k, reference) for k in REFERENCE_KEYWORDS}
        self._own_regexes = {k: v for k, v in self._keywords.items() if k != "pattern"}
        self._registry = jsonschema_rs.Registry([(_ROOT_URI, {**full, "$schema": draft})])

    def get(self, pointer: str, own_regexes: bool) -> Verdict | None:
        """is_valid of the object at pointer ('#/...'), pattern read by jsonschema-rs itself or with
        Python's re; None when jsonschema-rs refuses the object."""
        keywords = self._own_regexes if own_regexes else self._keywords
        try:
            validator = jsonschema_rs.validator_for(
                {"$schema": self._draft, "$ref": _ROOT_URI + quote(pointer, safe=_FRAGMENT_SAFE)},
                registry=self._registry,
                keywords=keywords,
                validate_formats=False,
                offline=True,
            )
        except (ValueError, TypeError, jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError) as e:
            logger.debug("jsonschema-rs refuses %s (%s); jsonschema judges it", pointer, e)
            return None
        is_valid: Verdict = validator.is_valid
        return is_valid


def _rs_validators(full: dict[str, Any], reference: Any) -> _RsValidators | None:
    """None when jsonschema-rs cannot read full (a draft it does not know, a bad resource)."""
    draft = getattr(reference, "META_SCHEMA", {}).get("$schema")
    if not isinstance(draft, str):
        return None
    try:
        return _RsValidators(full, reference, draft)
    except (ValueError, TypeError, jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError) as e:
        logger.debug("jsonschema-rs cannot read the schema (%s); jsonschema judges every value", e)
        return None
