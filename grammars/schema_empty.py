"""Schemas with no finite instance, found before compiling: a required property, a required array
item or an allOf member whose schema has none, an anyOf/oneOf whose members all have none, a
$ref to such a definition. A recursive definition that can only nest itself forever is the case
the grammar engines miss: their grammar then refuses every document, and generation dead-ends.
Promises: `empty_reason` says a schema is empty only when no finite JSON value validates against
it (it reads only the keywords above; anything else counts as satisfiable)."""

from __future__ import annotations

from typing import Any

from .schema_walk import resolve_pointer, walk


def empty_reason(schema: Any) -> str | None:
    """Why no finite value validates against schema (the first local definition found empty, or
    the root), else None. The definitions' emptiness is a least fixpoint: every reachable local
    $ref starts empty and becomes satisfiable once its schema is, given those found so far."""
    if not isinstance(schema, dict):
        return None
    refs = sorted({node["$ref"] for node, _ in walk(schema) if _local_ref(node)})
    targets: dict[str, Any] = {}
    for ref in refs:
        try:
            targets[ref] = resolve_pointer(schema, ref)
        except ValueError:
            continue  # reported by the compiler with its own message
    satisfiable = {ref: False for ref in targets}
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if not satisfiable[ref] and _satisfiable(target, satisfiable):
                satisfiable[ref] = changed = True
    if _satisfiable(schema, satisfiable):
        return None
    empty = [ref for ref, ok in satisfiable.items() if not ok]
    if empty:
        return f"no finite value satisfies the definition {empty[0]!r}"
    return "no value satisfies the schema"


def _local_ref(node: dict[str, Any]) -> bool:
    ref = node.get("$ref")
    return isinstance(ref, str) and ref.startswith("#")


def _satisfiable(node: Any, refs: dict[str, bool]) -> bool:
    """False only where node certainly has no finite instance, given refs' verdicts."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not refs.get(ref, True):
        return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(_satisfiable(m, refs) for m in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        members = node.get(key)
        if isinstance(members, list) and members and not any(_satisfiable(m, refs) for m in members):
            return False
    types = node.get("type")
    only = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    # a value of any other type escapes the object and array rules
    if only == {"object"}:
        return _object_satisfiable(node, refs)
    if only == {"array"}:
        return _array_satisfiable(node, refs)
    return True


def _object_satisfiable(node: dict[str, Any], refs: dict[str, bool]) -> bool:
    props, required = node.get("properties"), node.get("required")
    props = props if isinstance(props, dict) else {}
    required = required if isinstance(required, list) else []
    return all(
        _satisfiable(props[name], refs) for name in required if isinstance(name, str) and name in props
    )


def _array_satisfiable(node: dict[str, Any], refs: dict[str, bool]) -> bool:
    least = node.get("minItems", 0)
    if not isinstance(least, int) or least <= 0:
        return True
    prefix = node.get("prefixItems")
    rest: Any = node.get("items", True)
    if isinstance(rest, list):  # drafts 4-7: a list of items, then additionalItems
        prefix, rest = rest, node.get("additionalItems", True)
    prefix = prefix if isinstance(prefix, list) else []
    if not all(_satisfiable(s, refs) for s in prefix[:least]):
        return False
    return least <= len(prefix) or _satisfiable(rest, refs)
