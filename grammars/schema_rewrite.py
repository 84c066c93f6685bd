"""Equivalence rewrites of JSON-schema keywords that no grammar enforces directly into keywords that
one does (e.g. `not: {type: null}` into a type list, `dependencies` into an anyOf). Promises: every
rewrite keeps the set of valid instances exactly; a case it does not know is left untouched."""

from __future__ import annotations

from typing import Any

from radixlm.grammars.schema_walk import walk

ALL_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def rewrite(schema: Any) -> Any:
    """The schema with every known case rewritten in place (the same object, or False)."""
    if not isinstance(schema, dict):
        return schema
    for node, _ in list(walk(schema)):
        _unique_items(node)
        _property_names(node)
        _dependencies(node)
        _not(node)
    return schema


def _unique_items(node: dict) -> None:
    val = node.get("uniqueItems")
    if val is False or (val is True and isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1):
        del node["uniqueItems"]


def _property_names(node: dict) -> None:
    val = node.get("propertyNames")
    if val is True or val == {} or val == {"type": "string"}:  # every key is a string
        del node["propertyNames"]


def _absent(name: str) -> dict:
    """Objects without the property name, and every non-object."""
    return {"properties": {name: False}}


def _object_without(name: str) -> dict:
    return {"type": "object", "properties": {name: False}}


def _dependencies(node: dict) -> None:
    """dependencies / dependentRequired / dependentSchemas: 'name absent, or present and ...'."""
    conds: list[dict] = []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        deps = node.get(key)
        if not isinstance(deps, dict):
            continue
        for name, dep in deps.items():
            if isinstance(dep, list):
                present: Any = {"required": [name, *dep]}
            elif dep is True or dep == {}:
                continue
            else:
                present = {"allOf": [{"required": [name]}, dep]}
            conds.append({"anyOf": [_absent(name), present]})
        del node[key]
    if conds:
        node["allOf"] = [*node.get("allOf", []), *conds]


def _not(node: dict) -> None:
    sub = node.get("not")
    if "not" not in node:
        return
    if sub is True or sub == {}:
        del node["not"]
        node["allOf"] = [*node.get("allOf", []), False]
        return
    if not isinstance(sub, dict):
        if sub is False:
            del node["not"]
        return
    if set(sub) == {"type"}:
        banned = sub["type"] if isinstance(sub["type"], list) else [sub["type"]]
        if "integer" in banned and "number" not in banned:
            return  # whole numbers written as floats (1.0) are integers too
        allowed = [t for t in ALL_TYPES if t not in banned]
        if "number" in banned:
            allowed = [t for t in allowed if t != "integer"]
        del node["not"]
        node["allOf"] = [*node.get("allOf", []), {"type": allowed} if allowed else False]
    elif set(sub) == {"required"} and isinstance(sub["required"], list) and sub["required"]:
        del node["not"]
        names = sub["required"]
        cond: Any = (
            _object_without(names[0]) if len(names) == 1 else {"anyOf": [_object_without(n) for n in names]}
        )
        node["allOf"] = [*node.get("allOf", []), cond]
    elif set(sub) == {"not"}:
        del node["not"]
        node["allOf"] = [*node.get("allOf", []), sub["not"]]
