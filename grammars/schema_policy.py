"""The JSON-Schema keyword policy shared by every engine: unknown and annotation keywords are ignored;
an assertion keyword the grammar cannot enforce is refused (strict) or dropped and named (non-strict).
Promises: prepare() returns a schema whose every remaining assertion the grammar enforces, plus the
JSON pointers of what it dropped (strict mode never drops, it raises ValueError); generation_policy()
narrows a prepared schema to what generation should write, never widening it."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .schema_rewrite import rewrite
from .schema_walk import list_at, resolve_pointer, walk

# Assertions no grammar here enforces in general (simple cases are rewritten first, schema_rewrite).
UNENFORCEABLE = frozenset(
    {
        "uniqueItems",
        "not",
        "if",
        "then",
        "else",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "contains",
        "minContains",
        "maxContains",
        "propertyNames",
        "unevaluatedProperties",
        "unevaluatedItems",
        "$dynamicRef",
        "$recursiveRef",
    }
)
# Formats of the JSON Schema specification that the grammar engine checks.
ENFORCED_FORMATS = frozenset(
    {
        "date-time",
        "time",
        "date",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uri",
        "uuid",
    }
)
# Standard formats with no grammar here: refused like any other unenforceable assertion.
UNENFORCEABLE_FORMATS = frozenset(
    {
        "idn-email",
        "idn-hostname",
        "uri-reference",
        "iri",
        "iri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
        "regex",
    }
)


@dataclass
class PreparedSchema:
    schema: Any
    dropped: list[str] = field(default_factory=list)  # "keyword at #/pointer", in walk order
    ignored_formats: list[str] = field(default_factory=list)


def prepare(schema: Any, strict: bool = True) -> PreparedSchema:
    """Rewrite what can be enforced another way, ignore unknown formats, then refuse or drop the rest.
    The result keeps the schema's semantics (open objects stay open, integers unbounded)."""
    out = PreparedSchema(rewrite(copy.deepcopy(schema)))
    for node, ptr in list(walk(out.schema)):
        for key in [k for k in node if k in UNENFORCEABLE]:
            _refuse_or_drop(out, node, key, ptr, strict)
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS:
            if fmt in UNENFORCEABLE_FORMATS:
                _refuse_or_drop(out, node, "format", ptr, strict, f"format {fmt!r}")
            else:  # not a format of the specification: an annotation
                del node["format"]
                out.ignored_formats.append(f"{fmt} at {ptr}")
    return out


def generation_policy(schema: Any) -> Any:
    """A copy of a prepared schema that accepts a subset of its instances, the ones generation should
    write: an unbounded integer gets 16 digits at most, so a sampler cannot run on digits forever.
    Objects stay as the schema says (undeclared properties where it allows them): closing them would
    refuse valid documents in the mask."""
    out = copy.deepcopy(schema)
    for node, _ in list(walk(out)):
        if node.get("type") == "integer":
            _bound_integer(node)
    return out


def closed_policy(schema: Any) -> Any:
    """The generation policy with objects closed: an object that lists its properties and says
    nothing about others gets additionalProperties false (not inside allOf/anyOf/oneOf, where closing
    one member could refuse what another allows). A fallback mask for schemas whose open grammar
    llguidance refuses (e.g. minProperties beside optional properties, a oneOf it can prove exclusive
    only once nested objects are closed); text beyond it is read as JSON and checked at EOS."""
    out = generation_policy(schema)
    composed = _composed(out)
    for node, _ in list(walk(out)):
        if _closable(node) and id(node) not in composed:
            node["additionalProperties"] = False
    return out


def one_of_pointers(schema: Any) -> list[str]:
    """Where a oneOf remains after the exact rewrites (those llguidance may enforce as anyOf)."""
    return [ptr for node, ptr in walk(schema) if isinstance(node.get("oneOf"), list)]


def _closable(node: dict) -> bool:
    """Lists its properties (every required one among them) and says nothing about others."""
    props = node.get("properties")
    if not isinstance(props, dict) or not props:
        return False
    required = list_at(node, "required")
    open_keys = {"additionalProperties", "patternProperties", "unevaluatedProperties"}
    return not open_keys & set(node) and all(r in props for r in required)


def _composed(root: Any) -> set[int]:
    """ids of the schema objects combined with others (allOf/anyOf/oneOf members and owners, $ref
    with siblings, and what they reference): closing one of them could refuse valid members."""
    nodes = list(walk(root))
    ids: set[int] = set()
    for node, _ in nodes:
        members = [m for k in ("allOf", "anyOf", "oneOf") for m in node.get(k) or [] if isinstance(m, dict)]
        if members or ("$ref" in node and len(node) > 1):
            ids.add(id(node))
        ids.update(id(m) for m in members)
    changed = True
    while changed:
        changed = False
        for node, _ in nodes:
            ref = node.get("$ref")
            if id(node) in ids and isinstance(ref, str) and ref.startswith("#"):
                target = resolve_pointer(root, ref)
                if isinstance(target, dict) and id(target) not in ids:
                    ids.add(id(target))
                    changed = True
    return ids


MAX_DIGITS_INT = 10**16 - 1  # the same 16-digit bound as the FSM's integers


def _bound_integer(node: dict) -> None:
    """Unbounded integers get 16 digits at most, so a sampler cannot run on digits forever."""
    if not {"minimum", "exclusiveMinimum"} & set(node):
        node["minimum"] = -MAX_DIGITS_INT
    if not {"maximum", "exclusiveMaximum"} & set(node):
        node["maximum"] = MAX_DIGITS_INT


def _refuse_or_drop(
    out: PreparedSchema, node: dict, key: str, ptr: str, strict: bool, what: str | None = None
) -> None:
    name = what or repr(key)
    if strict:
        raise ValueError(
            f"JSON schema keyword {name} at {ptr} cannot be enforced by the grammar "
            "(strict mode; pass strict=False to drop it)"
        )
    del node[key]
    out.dropped.append(f"{key} at {ptr}")
