"""The JSON-Schema keyword policy shared by every engine: unknown and annotation keywords are ignored;
an assertion keyword the grammar cannot enforce is left to a value check (schema_guard) where
jsonschema can check it, else refused (strict) or dropped and named (non-strict).
Promises: prepare() returns the grammar's schema (every remaining assertion the grammar enforces), the
full schema the value checks hold, and the JSON pointers of what is checked and what was dropped
(strict mode never drops, it raises ValueError); generation_policy() narrows a prepared schema to what
generation should write (bounded integers, closed objects), never widening it."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from .schema_formats import CHECKED_FORMATS, FORMAT_PATTERNS
from .schema_rewrite import rewrite
from .schema_walk import dict_at, list_at, resolve_pointer, walk

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
# Standard formats llguidance has no grammar for: a regex the grammar holds (schema_formats), else a
# value check where the checker knows the format, else refused (strict) or dropped.
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
    schema: Any  # what the grammar enforces
    dropped: list[str] = field(default_factory=list)  # "keyword at #/pointer", in walk order
    ignored_formats: list[str] = field(default_factory=list)
    full: Any = None  # the schema with the checked keywords: what value checks validate against
    checked: list[str] = field(default_factory=list)  # "keyword at #/pointer": held by value checks


def prepare(schema: Any, strict: bool = True) -> PreparedSchema:
    """Rewrite what can be enforced another way, ignore unknown formats, leave what jsonschema can check
    to value checks, then refuse or drop the rest. The grammar's schema keeps the schema's semantics
    apart from the checked keywords (open objects stay open, integers unbounded)."""
    out = PreparedSchema(rewrite(copy.deepcopy(schema)))
    for node, ptr in list(walk(out.schema)):
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt not in ENFORCED_FORMATS and fmt not in UNENFORCEABLE_FORMATS:
            del node["format"]  # not a format of the specification: an annotation
            out.ignored_formats.append(f"{fmt} at {ptr}")
    out.full = copy.deepcopy(out.schema)
    for node, ptr in list(walk(out.schema)):
        for key in [k for k in node if k in UNENFORCEABLE]:
            del node[key]
            out.checked.append(f"{key} at {ptr}")
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in FORMAT_PATTERNS and "pattern" not in node:
            node["pattern"] = FORMAT_PATTERNS[fmt]
            del node["format"]  # the grammar holds the format as its regex
        elif isinstance(fmt, str) and fmt in UNENFORCEABLE_FORMATS:
            if fmt in CHECKED_FORMATS:
                del node["format"]
                out.checked.append(f"format at {ptr}")
            else:
                _refuse_or_drop(out, node, "format", ptr, strict, f"format {fmt!r}")
                drop_from(out.full, f"format at {ptr}")
    return out


def locate(name: str, root: Any) -> tuple[str, Any]:
    """(keyword, schema object) a name 'keyword at #/pointer' or 'keyword at #/pointer (why)' gives;
    the object is None when the pointer does not resolve (pointers may hold spaces and parentheses,
    so each place a ' (' could start the reason is tried)."""
    keyword, _, rest = name.partition(" at ")
    cuts = [len(rest)] + [i for i in range(len(rest)) if rest.startswith(" (", i)]
    for cut in cuts:
        pointer = rest[:cut]
        if not pointer.startswith("#"):
            continue
        try:
            return keyword, resolve_pointer(root, pointer)
        except ValueError:
            continue
    return keyword, None


def drop_from(full: Any, name: str) -> None:
    """Delete from full the keyword a name 'keyword at #/pointer ...' gives (if it is there)."""
    keyword, node = locate(name, full)
    if isinstance(node, dict):
        node.pop(keyword, None)


def checkable(name: str, full: Any) -> bool:
    """Whether a value check can hold what a relaxation dropped (name: 'keyword at #/pointer (why)'):
    not an external reference or a base URI (jsonschema could not resolve them either), not a regex
    Python cannot compile."""
    if "external reference" in name or re.match(r"\$?id at ", name):
        return False
    _, node = locate(name, full)
    if isinstance(node, dict) and "regex" in name:
        patterns = [node.get("pattern")] + list(dict_at(node, "patternProperties"))
        return all(compiles(p) for p in patterns if isinstance(p, str))
    return True


def compiles(pattern: str) -> bool:
    """Whether Python's re (jsonschema's regex engine) compiles the pattern."""
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True


def generation_policy(schema: Any) -> Any:
    """A copy of a prepared schema that accepts a subset of its instances, the ones generation should
    write: an unbounded integer gets 16 digits at most, so a sampler cannot run on digits forever;
    an object that lists its properties and says nothing about others gets additionalProperties
    false, as xgrammar's strict mode (SGLang's and vLLM's default) and OpenAI's structured outputs
    write it: a model is not led into inventing keys until its token limit. Objects combined with
    others (allOf/anyOf/oneOf) stay open, where closing one member could refuse what another allows.
    Acceptance is the schema's own: a forced document with undeclared properties is still read."""
    out = copy.deepcopy(schema)
    composed = _composed(out)
    for node, _ in list(walk(out)):
        if node.get("type") == "integer":
            _bound_integer(node)
        if _closable(node) and id(node) not in composed:
            node["additionalProperties"] = False
    return out


def one_of_pointers(schema: Any) -> list[str]:
    """Where a oneOf remains after the exact rewrites (those llguidance may enforce as anyOf)."""
    return [ptr for node, ptr in walk(schema) if isinstance(node.get("oneOf"), list)]


def _closable(node: dict[str, Any]) -> bool:
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


def _bound_integer(node: dict[str, Any]) -> None:
    """Unbounded integers get 16 digits at most, so a sampler cannot run on digits forever."""
    if not {"minimum", "exclusiveMinimum"} & set(node):
        node["minimum"] = -MAX_DIGITS_INT
    if not {"maximum", "exclusiveMaximum"} & set(node):
        node["maximum"] = MAX_DIGITS_INT


def _refuse_or_drop(
    out: PreparedSchema, node: dict[str, Any], key: str, ptr: str, strict: bool, what: str | None = None
) -> None:
    name = what or repr(key)
    if strict:
        raise ValueError(
            f"JSON schema keyword {name} at {ptr} cannot be enforced by the grammar "
            "(strict mode; pass strict=False to drop it)"
        )
    del node[key]
    out.dropped.append(f"{key} at {ptr}")
