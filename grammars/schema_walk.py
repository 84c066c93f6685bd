"""Walking a JSON schema: the subschemas of a schema object with their JSON pointers, local $ref
resolution, and a walk over every reachable schema object. Promises: each object is visited once,
parents before their children; pointers are RFC 6901 fragments ('#/properties/a~1b')."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_VALUES = (
    "additionalProperties",
    "additionalItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
)

# Keywords that assert nothing (notes for readers of the schema).
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$schema",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
# Keywords that assert something about an instance or apply subschemas to it (drafts 04 to 2020-12);
# any other key of a schema object is an annotation or unknown, and asserts nothing.
ASSERTIONS = frozenset(
    {
        *SCHEMA_MAPS,
        *SCHEMA_LISTS,
        *SCHEMA_VALUES,
        *("type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum"),
        *("exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems"),
        *("uniqueItems", "maxContains", "minContains", "maxProperties", "minProperties", "required"),
        *("dependentRequired", "dependencies", "items", "$ref", "$dynamicRef", "$recursiveRef"),
    }
) - {"$defs", "definitions"}


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def subschemas(node: dict[str, Any], ptr: str) -> Iterator[tuple[Any, str]]:
    """(subschema, pointer) for every keyword of node whose value is a schema or holds schemas."""
    for key in SCHEMA_MAPS:
        val = node.get(key)
        if isinstance(val, dict):
            for name, sub in val.items():
                yield sub, f"{ptr}/{key}/{_escape(name)}"
    for key in SCHEMA_LISTS:
        val = node.get(key)
        if isinstance(val, list):
            for i, sub in enumerate(val):
                yield sub, f"{ptr}/{key}/{i}"
    for key in SCHEMA_VALUES:
        if key in node:
            yield node[key], f"{ptr}/{key}"
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield sub, f"{ptr}/items/{i}"
    elif items is not None:
        yield items, f"{ptr}/items"
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, (dict, bool)):
                yield sub, f"{ptr}/dependencies/{_escape(name)}"


def resolve_pointer(root: Any, ref: str) -> Any:
    """The node a local '#/...' reference names; ValueError when it does not resolve."""
    node = root
    for part in [p for p in ref.split("#", 1)[1].split("/") if p]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")  # a URI fragment: %-decoded
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise ValueError(f"invalid JSON schema: $ref {ref!r} does not resolve")
    return node


def walk(root: Any) -> Iterator[tuple[dict[str, Any], str]]:
    """Every schema object reachable from root through schema keywords and local $refs, once each."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "#")]
    while stack:
        node, ptr = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield node, ptr
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            stack.append((resolve_pointer(root, ref), ref))
        stack.extend(reversed(list(subschemas(node, ptr))))


def list_at(node: dict[str, Any], key: str) -> list[Any]:
    """node[key] when it is a list, else an empty list (schemas from users may hold anything)."""
    value = node.get(key)
    return value if isinstance(value, list) else []


def dict_at(node: dict[str, Any], key: str) -> dict[str, Any]:
    """node[key] when it is an object, else an empty dict."""
    value = node.get(key)
    return value if isinstance(value, dict) else {}


def reaching(parents: Mapping[int, Iterable[int]], seed: Iterable[int]) -> set[int]:
    """seed and every id from which child links lead into it (parents: id -> ids of its parents)."""
    marked = set(seed)
    stack = list(marked)
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in marked:
                marked.add(p)
                stack.append(p)
    return marked


def python_regex_problem(root: Any) -> str | None:
    """Why the first pattern or patternProperties key reachable from root does not compile with
    Python's re (the value checks and jsonschema read patterns with it), or None when all do."""
    for node, ptr in walk(root):
        pattern = node.get("pattern")
        found = [(pattern, f"{ptr}/pattern")] if isinstance(pattern, str) else []
        found += [(key, f"{ptr}/patternProperties") for key in dict_at(node, "patternProperties")]
        for regex, where in found:
            try:
                with warnings.catch_warnings():  # a FutureWarning on nested sets is not a failure
                    warnings.simplefilter("ignore")
                    re.compile(regex)
            except (re.error, RecursionError, OverflowError) as e:
                return f"pattern {regex!r} at {where} does not compile with Python's re ({e})"
    return None
