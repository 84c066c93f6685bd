"""Schema inclusion, proved conservatively, and the rewrites of properties beside patternProperties
it allows. implies(a, b) is True only when every instance valid against a is valid against b
(a ⊆ b), from keywords whose inclusion is plain to check (type, enum and const, items, properties of
closed objects, required, equal keywords). Promises: True is a proof, False means "not known";
implied_properties() and one_of_equivalent() keep the set of valid instances exactly."""

from __future__ import annotations

import json
import re
from typing import Any

from .schema_not import _not_strings_pattern, negate
from .schema_walk import ANNOTATIONS, dict_at, resolve_pointer

MAX_DEPTH = 8
_PY_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list}


def implies(a: Any, b: Any, root: Any, depth: int = 0) -> bool:
    """True only when a ⊆ b (every instance a accepts, b accepts)."""
    if depth > MAX_DEPTH:
        return False
    a, b = _plain(a, root), _plain(b, root)
    if b is True or b == {} or a is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    if _text(a) == _text(b):
        return True
    if any(implies(m, b, root, depth + 1) for m in a.get("allOf") or []):
        return True
    if set(b) == {"anyOf"} and isinstance(b["anyOf"], list):
        return any(implies(a, m, root, depth + 1) for m in b["anyOf"])
    object_keys = {"additionalProperties", "patternProperties"}
    if object_keys & set(b) and not _object_keys_implied(a, b):
        return False
    return all(_keyword_implied(a, k, v, root, depth) for k, v in b.items() if k not in object_keys)


def _plain(s: Any, root: Any) -> Any:
    """s without annotations, a sibling-free local $ref followed (a few hops)."""
    for _ in range(4):
        if not isinstance(s, dict):
            return s
        s = {k: v for k, v in s.items() if k not in ANNOTATIONS}
        ref = s.get("$ref")
        if set(s) != {"$ref"} or not isinstance(ref, str) or not ref.startswith("#"):
            return s
        try:
            s = resolve_pointer(root, ref)
        except ValueError:
            return {"$ref": ref}
    return s


def _text(s: Any) -> str:
    return json.dumps(s, sort_keys=True)


# Keywords that read their siblings (an equal value may mean something else beside other keywords).
_COUPLED = frozenset(
    {
        "additionalProperties",
        "patternProperties",
        "items",
        "additionalItems",
        "prefixItems",
        "contains",
        "minContains",
        "maxContains",
        "if",
        "then",
        "else",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$id",
        "id",
        "$anchor",
        "$dynamicRef",
        "$recursiveRef",
    }
)


def _keyword_implied(a: dict[str, Any], key: str, val: Any, root: Any, depth: int) -> bool:
    """Every instance of a satisfies b's keyword key: val (b's other keywords checked apart)."""
    if key in ("definitions", "$defs"):
        return True
    if key in a and key not in _COUPLED and _text(a[key]) == _text(val):
        return True  # a asserts the same keyword, and asserts every other of its keywords too
    if key == "type":
        allowed = {val} if isinstance(val, str) else set(val) if isinstance(val, list) else set()
        mine = _types(a)
        return mine is not None and mine <= allowed | ({"integer"} if "number" in allowed else set())
    if key in ("enum", "const"):
        values = [val] if key == "const" else val
        own = _values(a)
        return own is not None and isinstance(values, list) and all(_member(v, values) for v in own)
    if key == "required":
        return isinstance(val, list) and set(val) <= set(a.get("required") or [])
    if key == "items":
        if not isinstance(val, dict) or not isinstance(a.get("items"), dict):
            return False
        return not {"prefixItems", "additionalItems"} & set(a) and implies(a["items"], val, root, depth + 1)
    if key == "properties":
        return isinstance(val, dict) and all(_property_implied(a, n, s, root, depth) for n, s in val.items())
    return False


def _object_keys_implied(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """b's additionalProperties/patternProperties hold for a: b allows any other names, or a is closed
    and every name a allows is one of b's properties (b's properties checked apart)."""
    if b.get("patternProperties"):
        return False  # they may reach names of b's properties too
    if b.get("additionalProperties", True) in (True, {}):
        return True
    return _closed(a) and set(dict_at(a, "properties")) <= set(dict_at(b, "properties"))


def _property_implied(a: dict[str, Any], name: str, b_sub: Any, root: Any, depth: int) -> bool:
    props = dict_at(a, "properties")
    if name in props:
        return implies(props[name], b_sub, root, depth + 1)
    return _closed(a)  # a closed object never has the property


def _closed(a: dict[str, Any]) -> bool:
    return a.get("additionalProperties") is False and not a.get("patternProperties")


def _types(s: dict[str, Any]) -> set[str] | None:
    t = s.get("type")
    if isinstance(t, (str, list)):
        names = {t} if isinstance(t, str) else set(t)
        return names | ({"integer"} if "number" in names else set())
    values = _values(s)
    if values is not None:
        return {_value_type(v) for v in values}
    return None


def _value_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):  # 1.0 is an integer in some drafts only: "number" here
        return "integer" if isinstance(v, int) else "number"
    return next(name for name, py in _PY_TYPES.items() if isinstance(v, py))


def _values(s: dict[str, Any]) -> list[Any] | None:
    if "const" in s:
        return [s["const"]]
    return s["enum"] if isinstance(s.get("enum"), list) else None


def _member(v: Any, values: list[Any]) -> bool:
    """v equals one of values as JSON Schema compares (1 == 1.0, true != 1)."""
    return any(_text(v) == _text(u) and type(v) is type(u) for u in values)


# Patterns Python's re and ECMA-262 read alike (searched in names without line breaks): literals,
# classes of word characters, groups, quantifiers. A leading unanchored ".*" changes no search.
_PLAIN_PATTERN = re.compile(
    r"(?:\.\*)?\^?(?:[A-Za-z0-9_()]|\[\^?[A-Za-z0-9_-]+\]|[*+?]|\{\d+(?:,\d*)?\})*\$?"
)
_EVERY_NAME = frozenset({"", ".*", "^.*"})  # patterns every name matches


def implied_properties(node: dict[str, Any], root: Any) -> None:
    """Where a property and a patternProperties entry both reach a name, llguidance intersects the two
    schemas (it cannot when they reach a recursive $ref). A property whose schema is the pattern's
    (annotations aside) becomes {}; a name whose property schema implies that of a pattern every name
    matches is cut out of that pattern. Either way each name's conjunction is unchanged."""
    props, patterns = node.get("properties"), node.get("patternProperties")
    if not isinstance(props, dict) or not isinstance(patterns, dict):
        return
    names = [n for n, sub in props.items() if isinstance(sub, dict) and sub != {} and n.isprintable()]
    for name in names:
        mine = _text(_plain_annotations(props[name]))
        if any(
            _PLAIN_PATTERN.fullmatch(pat) and re.search(pat, name) and _text(_plain_annotations(sub)) == mine
            for pat, sub in patterns.items()
        ):
            props[name] = {}
    every = [pat for pat in patterns if pat in _EVERY_NAME]
    if len(every) != 1:
        return
    cut = [n for n in names if props[n] != {} and implies(props[n], patterns[every[0]], root)]
    narrowed = _not_strings_pattern(cut) if cut else None
    if narrowed is not None and narrowed not in patterns:
        patterns[narrowed] = patterns.pop(every[0])


def _plain_annotations(s: Any) -> Any:
    return {k: v for k, v in s.items() if k not in ANNOTATIONS} if isinstance(s, dict) else s


def one_of_equivalent(branches: list[Any], root: Any) -> Any:
    """A schema llguidance can enforce equivalent to oneOf: branches (None when not known here):
    of two branches one implied by the other, "the wider and not the narrower" (an instance of the
    narrower matches both); branches that only list required names, "one set present, each other
    set missing a name of its own"."""
    if len(branches) == 2:
        for a, b in ((branches[0], branches[1]), (branches[1], branches[0])):
            if implies(a, b, root):
                neg = negate(a, root)
                if neg is not None:
                    return {"allOf": [b, neg]}
    return _one_of_required(branches)


def _one_of_required(branches: list[Any]) -> Any:
    sets: list[set[str]] = []
    for branch in branches:
        plain = _plain_annotations(branch)
        names = plain.get("required") if isinstance(plain, dict) and set(plain) == {"required"} else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return None
        sets.append(set(names))
    if len(sets) < 2:
        return None  # one branch: nothing to rewrite
    alternatives = []
    for i, mine in enumerate(sets):
        others = [sorted(other - mine) for j, other in enumerate(sets) if j != i]
        if any(not missing for missing in others):
            continue  # every object with these names matches another branch too
        absent = [{"anyOf": [{"properties": {n: False}} for n in missing]} for missing in others]
        alternatives.append({"type": "object", "required": sorted(mine), "allOf": absent})
    return {"anyOf": alternatives} if alternatives else False
