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
from .schema_walk import walk

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


def one_of_pointers(schema: Any) -> list[str]:
    """Where a oneOf remains after the exact rewrites (those llguidance may enforce as anyOf)."""
    return [ptr for node, ptr in walk(schema) if isinstance(node.get("oneOf"), list)]


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
