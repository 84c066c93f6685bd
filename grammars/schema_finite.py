"""Keywords over a finite set, decided member by member with jsonschema. Beside an enum or const, the
keywords no grammar enforces in general (not, if/then/else, uniqueItems, contains, propertyNames,
dependencies) are evaluated on each listed value, and the list keeps the values that pass; the
propertyNames of a closed object are evaluated on each name it lists, and a name that fails is
forbidden. Promises: the node's valid instances are unchanged; a case whose evaluation could read
differently from the grammar (a $ref, a format, an unreadable schema) is left untouched."""

from __future__ import annotations

import json
from typing import Any

import jsonschema

# Keyword groups evaluated together (a group's keywords read each other).
_GROUPS = (
    ("not",),
    ("if", "then", "else"),
    ("uniqueItems",),
    ("contains", "minContains", "maxContains"),
    ("propertyNames",),
    ("dependencies",),
    ("dependentRequired",),
    ("dependentSchemas",),
)


def filter_values(node: dict[str, Any], root: dict[str, Any]) -> None:
    """enum/const beside the keywords above: the values that pass them, the keywords removed."""
    values = [node["const"]] if "const" in node else node.get("enum")
    if not isinstance(values, list):
        return
    keys = [k for group in _GROUPS if group[0] in node for k in group if k in node]
    if not keys:
        return
    kept = _passing({k: node[k] for k in keys}, values, root)
    if kept is None:
        return
    for k in keys:
        del node[k]
    node.pop("const", None)
    node["enum"] = kept


def closed_names(node: dict[str, Any], root: dict[str, Any]) -> None:
    """propertyNames of an object that allows only its listed properties: each listed name is
    checked, one that fails becomes false (absent), and propertyNames goes."""
    names, props = node.get("propertyNames"), node.get("properties")
    if names is None or node.get("additionalProperties") is not False or node.get("patternProperties"):
        return
    listed = list(props) if isinstance(props, dict) else []
    kept = _passing(names, listed, root)
    if kept is None:
        return
    for name in listed:
        if name not in kept:
            node["properties"][name] = False
    del node["propertyNames"]


def _passing(check: Any, values: list[Any], root: dict[str, Any]) -> list[Any] | None:
    """The values valid against check (None: not evaluated here)."""
    text = json.dumps(check)
    if '"$ref"' in text or '"$dynamicRef"' in text or '"$recursiveRef"' in text or '"format"' in text:
        return None  # references resolve against the root, formats depend on installed checkers
    cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
    try:
        validator = cls(check)
        return [v for v in values if validator.is_valid(v)]
    except Exception:  # an unreadable schema (bad regex, wrong types): left for the policy to judge
        return None
