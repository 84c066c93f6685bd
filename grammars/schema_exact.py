"""Which prepared JSON schemas xgrammar enforces exactly: a conservative subset (closed objects,
bounded strings, simple anchored patterns, integer ranges, scalar enums, typed arrays) where its
grammar accepts, in our compact whitespace policy, exactly the documents jsonschema validates. Its
masks cost a few microseconds where llguidance's cost tens, so GrammarBackend sends these there.
Promises: False for anything outside the subset, so no keyword is ever silently dropped."""

from __future__ import annotations

import re
from typing import Any

from .schema_policy import compiles
from .schema_walk import ASSERTIONS

_SCALARS = (str, int, bool, type(None))
_STRUCTURAL = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength", "pattern", "enum", "const"},
    "integer": {"type", "minimum", "maximum", "enum", "const"},
    "number": {"type"},
    "boolean": {"type", "enum", "const"},
    "null": {"type"},
}
# A pattern read the same by ECMA-262 (JSON Schema), Python and xgrammar, over characters that JSON
# writes unescaped: anchored at both ends; literals are letters, digits, space, '_' and '-'; classes
# hold those and ranges; groups, alternation and the usual quantifiers.
_SIMPLE_PATTERN = re.compile(r"\^(?:[A-Za-z0-9 _-]|\[[A-Za-z0-9 _-]+\]|\{\d+(?:,\d+)?\}|[()|?*+])*\$")
_PLAIN_TEXT = re.compile(r"[ -!#-\[\]-~]*")  # printable ASCII without '"' and '\': written as is
MAX_DEPTH = 8


def xgrammar_exact(schema: Any) -> bool:
    """Whether every assertion of the (prepared) schema lies in the subset xgrammar holds exactly."""
    return isinstance(schema, dict) and _exact(schema, 0)


def _exact(node: Any, depth: int) -> bool:
    if not isinstance(node, dict) or depth > MAX_DEPTH:
        return False
    asserted = {k for k in node if k in ASSERTIONS}
    if "type" not in node:  # a bare enum / const of scalars
        return asserted in ({"enum"}, {"const"}) and _values_ok(node)
    kind = node["type"]
    if not isinstance(kind, str) or kind not in _STRUCTURAL or not asserted <= _STRUCTURAL[kind]:
        return False
    if not _values_ok(node) or ("enum" in node or "const" in node) and len(asserted) > 2:
        return False  # a value list beside other assertions: xgrammar may hold only the list
    if kind == "object":
        return _object_ok(node, depth)
    if kind == "array":
        return _array_ok(node, depth)
    if kind == "string":
        return _string_ok(node)
    if kind == "integer":
        return all(_is_int(node[k]) for k in ("minimum", "maximum") if k in node)
    return True


def _values_ok(node: dict[str, Any]) -> bool:
    """enum / const: scalars of the node's type, strings in plain text (one way to write each)."""
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        return False
    values = [*node.get("enum", []), *([node["const"]] if "const" in node else [])]
    kind = node.get("type")
    for v in values:
        if not isinstance(v, _SCALARS) or isinstance(v, str) and not _PLAIN_TEXT.fullmatch(v):
            return False
        if kind == "integer" and not _is_int(v) or kind == "string" and not isinstance(v, str):
            return False
        if kind == "boolean" and not isinstance(v, bool):
            return False
    return True


def _object_ok(node: dict[str, Any], depth: int) -> bool:
    props = node.get("properties", {})
    required = node.get("required", [])
    if node.get("additionalProperties") is not False or not isinstance(props, dict):
        return False  # open objects: xgrammar's strict mode would close them
    if not isinstance(required, list) or not all(isinstance(r, str) and r in props for r in required):
        return False
    if len(set(required)) != len(required):
        return False
    return all(_PLAIN_TEXT.fullmatch(k) and _exact(v, depth + 1) for k, v in props.items())


def _array_ok(node: dict[str, Any], depth: int) -> bool:
    return _bounds_ok(node, "minItems", "maxItems") and "items" in node and _exact(node["items"], depth + 1)


def _string_ok(node: dict[str, Any]) -> bool:
    if not _bounds_ok(node, "minLength", "maxLength"):
        return False
    pattern = node.get("pattern")
    if pattern is None:
        return True
    lengths = "minLength" in node or "maxLength" in node
    return not lengths and isinstance(pattern, str) and _simple_pattern(pattern)


def _bounds_ok(node: dict[str, Any], low: str, high: str) -> bool:
    """Non-negative integer bounds, the upper one (if any) not below the lower one."""
    lo, hi = node.get(low, 0), node.get(high, node.get(low, 0))
    return _is_int(lo) and _is_int(hi) and 0 <= lo <= hi


def _simple_pattern(pattern: str) -> bool:
    return bool(_SIMPLE_PATTERN.fullmatch(pattern)) and compiles(pattern)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
