"""`not` as a positive schema: negate(s) builds a schema whose valid instances are exactly those that
fail s, from keywords whose failure a grammar can state (type, const/enum of scalars, bounds,
lengths, counts, required, properties, allOf/anyOf/not). Promises: the result is equivalent to
{"not": s} or None (the case is not known here and stays a refusal); no approximation."""

from __future__ import annotations

import re
from typing import Any

from .schema_walk import ANNOTATIONS, resolve_pointer

ALL_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
# Keywords that assert nothing: ignored, as everywhere else.
_NEUTRAL = ANNOTATIONS | {"$id", "id", "definitions", "$defs", "format_hint"}
# Bounds: the keyword, its value's type, and the keyword (and type) of its negation.
_BOUNDS = {
    "minimum": ("number", "exclusiveMaximum"),
    "maximum": ("number", "exclusiveMinimum"),
    "exclusiveMinimum": ("number", "maximum"),
    "exclusiveMaximum": ("number", "minimum"),
}
_COUNTS = {  # keyword: (type, the opposite keyword); not {minX: n} is {maxX: n - 1}
    "minLength": ("string", "maxLength"),
    "maxLength": ("string", "minLength"),
    "minItems": ("array", "maxItems"),
    "maxItems": ("array", "minItems"),
    "minProperties": ("object", "maxProperties"),
    "maxProperties": ("object", "minProperties"),
}
MAX_PATTERN = 4000
MAX_DEPTH = 6


def negate(s: Any, root: Any, depth: int = 0, refs: tuple[str, ...] = ()) -> Any:
    """A schema equivalent to {"not": s}; None when this cannot be stated exactly."""
    if depth > MAX_DEPTH:
        return None
    if s is True:
        return False
    if s is False:
        return True
    if not isinstance(s, dict):
        return None
    if isinstance(s.get("$ref"), str):
        ref = s["$ref"]
        if not ref.startswith("#") or ref in refs:
            return None
        try:
            target = resolve_pointer(root, ref)
        except ValueError:
            return None
        rest = {k: v for k, v in s.items() if k != "$ref"}
        return negate({"allOf": [target, rest]} if rest else target, root, depth + 1, (*refs, ref))
    keys = [k for k in s if k not in _NEUTRAL and not k.startswith("x-")]
    if "additionalProperties" in s or "patternProperties" in s:
        return None  # they depend on `properties`: not split here
    parts: list[Any] = []
    for key in keys:
        part = _negate_keyword(key, s[key], root, depth, refs)
        if part is None:
            return None
        if part is not False:
            parts.append(part)
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _negate_keyword(key: str, val: Any, root: Any, depth: int, refs: tuple[str, ...]) -> Any:
    """Instances failing this one keyword (False: none do; None: unknown)."""
    if key == "type":
        return _not_types(val)
    if key in ("const", "enum"):
        values = [val] if key == "const" else val
        return _not_values(values) if isinstance(values, list) else None
    if key == "pattern":
        parts = _not_pattern(val) if isinstance(val, str) else None
        return None if parts is None else _any(parts)  # only strings fail a pattern
    if key in _BOUNDS:
        kind, other = _BOUNDS[key]
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            return None  # draft-04 boolean exclusives
        return {"type": kind, other: val}
    if key in _COUNTS:
        kind, other = _COUNTS[key]
        if isinstance(val, bool) or not isinstance(val, int):
            return None
        if key.startswith("min"):
            return False if val <= 0 else {"type": kind, other: val - 1}
        return {"type": kind, other: val + 1}
    if key == "required":
        if not isinstance(val, list):
            return None
        return _any([{"type": "object", "properties": {name: False}} for name in val])
    if key == "properties":
        if not isinstance(val, dict):
            return None
        parts = []
        for name, sub in val.items():
            neg = negate(sub, root, depth + 1, refs)
            if neg is None:
                return None
            if neg is not False:
                parts.append({"type": "object", "required": [name], "properties": {name: neg}})
        return _any(parts)
    if key == "allOf" and isinstance(val, list):
        negs = [negate(m, root, depth + 1, refs) for m in val]
        return None if any(n is None for n in negs) else _any([n for n in negs if n is not False])
    if key == "anyOf" and isinstance(val, list):
        negs = [negate(m, root, depth + 1, refs) for m in val]
        if any(n is None for n in negs):
            return None
        if any(n is False for n in negs):
            return False
        kept = [n for n in negs if n is not True]
        return {} if not kept else kept[0] if len(kept) == 1 else {"allOf": kept}
    if key == "not":
        return val
    return None


def _any(parts: list[Any]) -> Any:
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _not_types(val: Any) -> Any:
    banned = {val} if isinstance(val, str) else set(val) if isinstance(val, list) else None
    if banned is None or not banned <= set(ALL_TYPES):
        return None
    if "integer" in banned and "number" not in banned:
        return None  # whole numbers written as 1.0 are integers too: no type says "not whole"
    if "number" in banned:
        banned.add("integer")
    allowed = [t for t in ALL_TYPES if t not in banned]
    return {"type": allowed} if allowed else False


def _not_values(values: list[Any], depth: int = 0) -> Any:
    """Instances equal to none of the values (scalars; arrays of at most one item and objects,
    nested a few levels)."""
    strings = [v for v in values if isinstance(v, str)]
    numbers = sorted({v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)})
    bools = {v for v in values if isinstance(v, bool)}
    others = [t for t in ("object", "array", "boolean", "null", "string", "number") if not _has(t, values)]
    parts: list[Any] = [{"type": others}] if others else []
    arrays = [_not_array(v, depth) for v in values if isinstance(v, list)]
    objects = [_not_object(v, depth) for v in values if isinstance(v, dict)]
    for each in (arrays, objects):  # each negation is already limited to its type
        if each:
            if any(x is None for x in each) or depth >= MAX_DEPTH:
                return None
            parts.append(each[0] if len(each) == 1 else {"allOf": each})
    if strings:
        pattern = _not_strings_pattern(strings)
        if pattern is None:
            return None
        parts.append({"type": "string", "pattern": pattern})
    if numbers:
        parts.append({"type": "number", "exclusiveMaximum": numbers[0]})
        parts += [
            {"type": "number", "exclusiveMinimum": a, "exclusiveMaximum": b}
            for a, b in zip(numbers, numbers[1:])
        ]
        parts.append({"type": "number", "exclusiveMinimum": numbers[-1]})
    if len(bools) == 1:
        parts.append({"const": not next(iter(bools))})
    return _any(parts)


# One character class, its body kept (escapes included): "[abc]", "[^\\s-]".
_CLASS = r"\[((?:\\.|[^\\\]])+)\]"
_ANY = r"[\s\S]"


def _not_pattern(pattern: str) -> list[dict[str, Any]] | None:
    """The strings `pattern` does not match, for one class C in these forms: ^C+$, ^C*$ (every
    character in C, and C holds the newline), ^C (starts with one). The grammar reads `$` as Python
    does (it also matches before a final newline), so no anchored pattern here may match "" as well:
    the empty string is its own part (maxLength 0)."""
    m = re.fullmatch(rf"\^{_CLASS}([+*]?)(\$?)", pattern)
    if m is None:
        return None
    body, repeat, end = m.groups()
    if any(op in body.replace("\\\\", "") for op in ("[", "&&", "--", "~~")):
        return None  # nested classes and set operations read differently across regex engines
    if body.startswith("^"):
        if len(body) == 1:
            return None
        other = f"[{body[1:]}]"
    else:
        other = f"[^{body}]"
    empty = {"type": "string", "maxLength": 0}
    if end and repeat and ("\\s" in body or "\\n" in body) and not body.startswith("^"):
        some = {"type": "string", "pattern": f"^{_ANY}*{other}{_ANY}*$"}  # a character outside C
        return [empty, some] if repeat == "+" else [some]
    if not end and not repeat:
        return [empty, {"type": "string", "pattern": f"^{other}{_ANY}*$"}]
    return None


def _not_array(value: list[Any], depth: int) -> Any:
    """Arrays unequal to value: another length, or (one item) an unequal item. Longer values would
    need positional keywords, which not every draft reads: unknown here."""
    if len(value) > 1:
        return None
    parts: list[Any] = [{"type": "array", "minItems": len(value) + 1}]
    if value:
        item = _not_values(value, depth + 1)
        if item is None:
            return None
        parts += [{"type": "array", "maxItems": 0}, {"type": "array", "minItems": 1, "items": item}]
    return _any(parts)


def _not_object(value: dict[str, Any], depth: int) -> Any:
    """Objects unequal to value: one of its names absent or with an unequal value, or another name
    (with all of its names present, more names than it has)."""
    parts: list[Any] = [{"type": "object", "minProperties": len(value) + 1}]
    for name, v in value.items():
        unequal = _not_values([v], depth + 1)
        if unequal is None:
            return None
        parts.append({"type": "object", "properties": {name: False}})
        parts.append({"type": "object", "required": [name], "properties": {name: unequal}})
    return _any(parts)


def _has(kind: str, values: list[Any]) -> bool:
    if kind == "number":
        return any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    py = {"object": dict, "array": list, "boolean": bool, "string": str}.get(kind)
    return None in values if py is None else any(isinstance(v, py) for v in values)


def _esc(c: str) -> str:
    """One character as an escape that Python's re and Rust's regex read the same way."""
    if c.isascii() and c.isalnum():
        return c
    code = ord(c)
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


def _not_strings_pattern(strings: list[str]) -> str | None:
    """An anchored pattern for every string except these (a trie, complemented)."""
    if any("\n" in s for s in strings):
        return None  # a `$` before a final newline would read differently in Python
    end = object()
    trie: dict[object, Any] = {}
    for s in strings:
        node = trie
        for c in s:
            node = node.setdefault(c, {})
        node[end] = True

    def body(node: dict[object, Any]) -> str:
        alts = [] if end in node else [""]
        children = [c for c in node if isinstance(c, str)]  # every key but `end` is a character
        alts += [_esc(c) + body(node[c]) for c in children]
        any_char = r"[\s\S]"
        alts.append(f"[^{''.join(_esc(c) for c in children)}]{any_char}*" if children else f"{any_char}+")
        return "(?:" + "|".join(alts) + ")"

    pattern = "^" + body(trie) + "$"
    return pattern if len(pattern) <= MAX_PATTERN else None
