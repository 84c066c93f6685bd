"""Equivalence rewrites of JSON-schema keywords that no grammar enforces directly into keywords that
one does (e.g. `not: {type: null}` into a type list, `dependencies` into an anyOf). Promises: every
rewrite keeps the set of valid instances exactly; a case it does not know is left untouched."""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from .schema_finite import closed_names, filter_values
from .schema_not import negate
from .schema_subsume import implied_properties, one_of_equivalent
from .schema_walk import ANNOTATIONS, dict_at, list_at, resolve_pointer, walk


def rewrite(schema: Any) -> Any:
    """The schema with every known case rewritten in place (the same object, or False)."""
    if not isinstance(schema, dict):
        return schema
    text = json.dumps(schema)
    mergeable = "/allOf/" not in text  # no $ref points into an allOf member
    renamable = "/oneOf/" not in text  # nor into a oneOf's branches (the rewrite renames it)
    replaceable = "/properties/" not in text  # no $ref points into a property's schema (replaced)
    legacy_ref = bool(_LEGACY_DRAFT.search(str(schema.get("$schema", ""))))
    for node, _ in list(walk(schema)):
        if mergeable:
            _merge_all_of(node)
        filter_values(node, schema)
        if replaceable:
            closed_names(node, schema)
        _unique_items(node)
        _if_then_else(node)
        _property_names(node)
        _dependencies(node)
        _not(node, schema)
        _ref_siblings(node, legacy_ref)
        if renamable:
            _one_of(node, schema)
        _implied_type(node, schema)
    if replaceable and "/patternProperties/" not in text:  # nor into a pattern (which may be renamed)
        for node, _ in list(walk(schema)):  # after the pass above: compares the schemas it tidied
            implied_properties(node, schema)
    return schema


# Keywords whose meaning depends on others of the same schema object: never split across a merge.
_COUPLED = (
    {"properties", "patternProperties", "additionalProperties", "unevaluatedProperties"},
    {"items", "prefixItems", "additionalItems", "unevaluatedItems"},
    {"contains", "minContains", "maxContains"},
    {"if", "then", "else"},
    {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"},  # draft-04 boolean exclusives
)


def _merge_all_of(node: dict[str, Any]) -> None:
    """allOf members whose keywords the node does not use move into the node: the conjunction is the
    same, and llguidance need not intersect schemas (it cannot when a member reaches a recursive
    $ref)."""
    members = node.get("allOf")
    if not isinstance(members, list):
        return
    keep = []
    for m in members:
        if isinstance(m, dict) and m and _mergeable(node, m):
            node.update(m)
        else:
            keep.append(m)
    if keep:
        node["allOf"] = keep
    else:
        del node["allOf"]


def _mergeable(node: dict[str, Any], member: dict[str, Any]) -> bool:
    if "$ref" in node or "$ref" in member or "allOf" in member or set(node) & set(member) - {"allOf"}:
        return False
    return not any(group & set(node) and group & set(member) for group in _COUPLED)


MAX_UNIQUE_ARRAYS = 100  # arrays listed for uniqueItems over a finite item set (4 values: 65)


def _unique_items(node: dict[str, Any]) -> None:
    val = node.get("uniqueItems")
    if val is False or (val is True and isinstance(node.get("maxItems"), int) and node["maxItems"] <= 1):
        del node["uniqueItems"]
        return
    values = _finite_items(node) if val is True and "enum" not in node and "const" not in node else None
    if values is None:
        return
    if _distinct_arrays(len(values)) > MAX_UNIQUE_ARRAYS:  # counted first: 12 values have 1.3e9
        return
    del node["uniqueItems"]  # every array of distinct items, in every order
    node["enum"] = [list(p) for n in range(len(values) + 1) for p in itertools.permutations(values, n)]


def _distinct_arrays(k: int) -> int:
    """How many arrays of distinct items k values make (every length, every order), counted up to
    just past MAX_UNIQUE_ARRAYS."""
    total = 0
    for n in range(k + 1):
        total += math.perm(k, n)
        if total > MAX_UNIQUE_ARRAYS:
            break
    return total


def _if_then_else(node: dict[str, Any]) -> None:
    """if/then/else decided by a required property with a declared enum (or const) of scalars, that
    `if` tests with const/enum: an anyOf of the two exclusive branches, the property's values split
    between them."""
    cond = node.get("if")
    required, props = list_at(node, "required"), dict_at(node, "properties")
    if node.get("type") != "object" or not isinstance(cond, dict) or set(cond) - {"properties", "required"}:
        return
    tested = cond.get("properties")
    if not isinstance(tested, dict) or len(tested) != 1 or not set(cond.get("required", [])) <= set(tested):
        return
    (name, test), declared = next(iter(tested.items())), props.get(next(iter(tested)))
    if name not in required or not isinstance(test, dict) or not isinstance(declared, dict):
        return
    chosen, domain = _scalars(test), _scalars(declared)
    if chosen is None or domain is None or set(test) - {"const", "enum"}:
        return
    keys = {json.dumps(v) for v in chosen}
    branches = []
    for values, sub in (
        ([v for v in domain if json.dumps(v) in keys], node.get("then", True)),
        ([v for v in domain if json.dumps(v) not in keys], node.get("else", True)),
    ):
        if values:
            branches.append({"properties": {name: {"enum": values}}, "allOf": [sub]})
    for key in ("if", "then", "else"):
        node.pop(key, None)
    node["allOf"] = [*node.get("allOf", []), {"anyOf": branches} if branches else False]


def _scalars(schema: dict[str, Any]) -> list[Any] | None:
    """The values of a const or enum of strings, booleans, null or integers (json.dumps tells them
    apart as JSON Schema equality does)."""
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    if not isinstance(values, list) or not all(v is None or isinstance(v, (str, bool, int)) for v in values):
        return None
    return values


def _finite_items(node: dict[str, Any]) -> list[Any] | None:
    """The values an array's items may take when they are few scalars that no two compare equal
    under uniqueItems (strings, booleans, null, integers): from items' enum, const or boolean type."""
    items = node.get("items")
    if node.get("type") != "array":  # an enum of arrays would refuse the other types it allows
        return None
    if not isinstance(items, dict) or {"prefixItems", "additionalItems", "contains"} & set(node):
        return None
    if "const" in items:
        values = [items["const"]]
    elif isinstance(items.get("enum"), list):
        values = items["enum"]
    elif items.get("type") == "boolean":
        values = [False, True]
    else:
        return None
    if not all(v is None or isinstance(v, (str, bool, int)) for v in values):
        return None
    out: list[Any] = []
    for v in values:  # 1 and true differ for uniqueItems; a repeated enum value counts once
        if not any(v == u and type(v) is type(u) for u in out):
            out.append(v)
    return out


def _property_names(node: dict[str, Any]) -> None:
    val = node.get("propertyNames")
    if val is True or val == {} or val == {"type": "string"}:  # every key is a string
        del node["propertyNames"]


def _absent(name: str) -> dict[str, Any]:
    """Objects without the property name, and every non-object."""
    return {"properties": {name: False}}


def _dependencies(node: dict[str, Any]) -> None:
    """dependencies / dependentRequired / dependentSchemas: 'name absent, or present and ...'."""
    conds: list[dict[str, Any]] = []
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


def _not(node: dict[str, Any], root: dict[str, Any]) -> None:
    if "not" not in node:
        return
    neg = negate(node["not"], root)
    if neg is None:
        return
    del node["not"]
    if neg is not True and neg != {}:
        node["allOf"] = [*node.get("allOf", []), neg]


# Drafts 3 to 7 ignore every keyword beside $ref ("All other properties in a $ref object MUST be
# ignored"); in draft 2019-09 and later they apply beside it.
_LEGACY_DRAFT = re.compile(r"json-schema\.org/draft-0[3-7]/schema")
_POINTER_TARGETS = frozenset({"definitions", "$defs"})


def _ref_siblings(node: dict[str, Any], legacy: bool) -> None:
    """Drop what beside a $ref asserts nothing: annotations (llguidance would intersect them with a
    recursive reference it cannot expand), and in drafts 3-7 every keyword."""
    if isinstance(node.get("$ref"), str):
        for key in set(node) - {"$ref"} - _POINTER_TARGETS:
            if legacy or key in ANNOTATIONS:
                del node[key]


def _one_of(node: dict[str, Any], root: dict[str, Any]) -> None:
    """oneOf whose branches are pairwise disjoint is anyOf (no instance can match two of them);
    else an equivalent from schema_subsume where it knows one."""
    branches = node.get("oneOf")
    if not isinstance(branches, list) or not branches:
        return
    ctx = _types(node, root, 0)
    overlaps = [
        (i, j)
        for i, j in itertools.combinations(range(len(branches)), 2)
        if not _disjoint(branches[i], branches[j], root, ctx)
    ]
    if overlaps and all(_only_empty_in_common(branches[i], branches[j], root) for i, j in overlaps):
        # arrays whose items cannot be alike share only []: [] matches two of them, so none
        branches = [
            {**b, "minItems": 1} if any(k in pair for pair in overlaps) else b for k, b in enumerate(branches)
        ]
        overlaps = []
    if not overlaps:
        del node["oneOf"]
        if "anyOf" in node:
            node["allOf"] = [*node.get("allOf", []), {"anyOf": branches}]
        else:
            node["anyOf"] = branches
        return
    same = one_of_equivalent(branches, root)
    if same is not None:
        del node["oneOf"]
        node["allOf"] = [*node.get("allOf", []), same]


def _only_empty_in_common(a: Any, b: Any, root: dict[str, Any]) -> bool:
    """Both are {type: array, items: ...} alone (annotations aside), their items disjoint."""
    plain = [
        {k: v for k, v in s.items() if k not in ANNOTATIONS} if isinstance(s, dict) else None for s in (a, b)
    ]
    if not all(p is not None and set(p) == {"type", "items"} and p["type"] == "array" for p in plain):
        return False
    return _disjoint(plain[0]["items"], plain[1]["items"], root, None)  # type: ignore[index]


def _implied_type(node: dict[str, Any], root: dict[str, Any]) -> None:
    """A `type` that $ref, every anyOf branch or an allOf member already implies says nothing
    more; dropping it keeps a recursive $ref free of siblings (which llguidance cannot expand)."""
    t = node.get("type")
    names = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
    if names is None:
        return
    allowed = names | ({"integer"} if "number" in names else set())
    # not beside oneOf: llguidance reads the type there when it proves the branches exclusive
    groups = [[node[k]] if k == "$ref" else node[k] for k in ("$ref", "anyOf") if k in node]
    groups = [[{"$ref": g[0]}] if isinstance(g[0], str) else g for g in groups if isinstance(g, list) and g]
    groups += [[m] for m in node.get("allOf") or []]
    for group in groups:
        types = [_types(alt, root, 0) for alt in group]
        if all(ts is not None and ts <= allowed for ts in types):
            del node["type"]
            return


MAX_DEPTH = 4
_TYPE_OF = {bool: "boolean", type(None): "null", str: "string", list: "array", dict: "object"}


def _deref(s: Any, root: dict[str, Any], depth: int) -> Any:
    while isinstance(s, dict) and isinstance(s.get("$ref"), str) and s["$ref"].startswith("#") and depth < 8:
        ref = s["$ref"]
        rest = {k: v for k, v in s.items() if k != "$ref"}
        try:
            target = resolve_pointer(root, ref)
        except ValueError:
            return s
        s = {"allOf": [target, rest]} if rest else target
        depth += 1
    return s


def _value_type(v: Any) -> str:
    if isinstance(v, bool) or v is None or not isinstance(v, (int, float)):
        return _TYPE_OF.get(type(v), "object")
    return "integer" if float(v).is_integer() else "number"


def _types(s: Any, root: dict[str, Any], depth: int) -> set[str] | None:
    """The JSON types s allows ('integer' stands for whole numbers), None when unknown or all."""
    s = _deref(s, root, depth)
    if s is False:
        return set()
    if not isinstance(s, dict):
        return None
    out: set[str] | None = None
    t = s.get("type")
    if isinstance(t, (str, list)):
        names = {t} if isinstance(t, str) else set(t)
        out = names | ({"integer"} if "number" in names else set())
    values = _values(s)
    if values is not None:
        vt = {_value_type(v) for v in values}
        out = vt if out is None else out & (vt | ({"integer"} if "number" in out else set()))
    for sub in s.get("allOf") or []:
        st = _types(sub, root, depth + 1) if depth < MAX_DEPTH else None
        if st is not None:
            out = st if out is None else out & st
    return out


def _values(s: dict[str, Any]) -> list[Any] | None:
    if "const" in s:
        return [s["const"]]
    enum = s.get("enum")
    if isinstance(enum, list):
        return enum
    return None


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _disjoint(a: Any, b: Any, root: dict[str, Any], ctx: set[str] | None, depth: int = 0) -> bool:
    """True only when no instance (of the context types) can be valid against both a and b."""
    if depth > MAX_DEPTH:
        return False
    a, b = _deref(a, root, depth), _deref(b, root, depth)
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    for x, y in ((a, b), (b, a)):
        if any(_disjoint(m, y, root, ctx, depth + 1) for m in x.get("allOf") or []):
            return True
    ta, tb = _types(a, root, depth), _types(b, root, depth)
    both = None if ta is None else ta if tb is None else ta & tb
    if both is not None and ctx is not None:
        both &= ctx
    if both is not None and not both:
        return True
    va, vb = _values(a), _values(b)
    if va is not None and vb is not None and not any(_same_value(x, y) for x in va for y in vb):
        return True
    objects_only = (both if both is not None else ctx) or set()
    if objects_only and objects_only <= {"object"}:
        return _objects_disjoint(a, b, root, depth)
    return False


def _objects_disjoint(a: dict[str, Any], b: dict[str, Any], root: dict[str, Any], depth: int) -> bool:
    """Some property both require has disjoint schemas, or one requires what the other forbids."""
    ra, rb = (set(list_at(s, "required")) for s in (a, b))
    pa, pb = (dict_at(s, "properties") for s in (a, b))
    for name in ra & rb:
        if name in pa and name in pb and _disjoint(pa[name], pb[name], root, None, depth + 1):
            return True
    for req, other, props in ((ra, b, pb), (rb, a, pa)):
        closed = other.get("additionalProperties") is False and not other.get("patternProperties")
        if any(props.get(n) is False or (closed and n not in props) for n in req):
            return True
    return False
