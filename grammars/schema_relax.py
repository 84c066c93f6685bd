"""Non-strict relaxation after the grammar engine refuses a prepared schema: read llguidance's reason,
find the construct it names (a recursive $ref with sibling keywords, overlapping patternProperties, a
regex it cannot compile, min/maxProperties beside optional properties, an external $ref), and drop it.
Promises: relax() only ever widens the schema (a dropped keyword never refuses a valid instance), and
every keyword it drops is returned as 'keyword at #/pointer (why)'; it returns [] when it recognizes
nothing to drop, so the caller refuses the schema instead of looping."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import unquote

import llguidance as llg

from .schema_walk import ASSERTIONS, dict_at, list_at, reaching, resolve_pointer, subschemas, walk

_COMBINATORS = ("allOf", "anyOf", "oneOf")


def relax(schema: Any, error: str, compiler: Any) -> list[str]:
    """Drop from schema (in place) what the engine's error names; the names of what was dropped."""
    if not isinstance(schema, dict):
        return []
    if "circular references with sibling keys" in error:
        return _recursive_siblings(schema, error)
    if "patternProperty regexes" in error and "not disjoint" in error:
        return _overlapping_pattern_properties(schema, error)
    if "min/maxProperties" in error:
        return _min_max_properties(schema)
    if "not present in a registry" in error or "Retrieving external resources" in error:
        return _external_refs(schema)
    if "float range" in error:
        return _huge_bounds(schema)
    if "schema too large" in error or "intersection stack level" in error:
        return _blow_up(schema, compiler)
    if "Regex is empty" in error:  # e.g. a pattern that no string of the format matches
        return _pattern_beside_format(schema)
    if "regex" in error or "lookaround" in error:
        return _bad_patterns(schema, compiler, also_composed="determine if regex is empty" in error)
    return []


def _fragment(error: str) -> str | None:
    """The JSON pointer of the recursive definition the error names ('/definitions/x')."""
    m = re.search(r"supported: \S*#(\S*)", error)
    return unquote(m.group(1)) if m else None


def _refers_to(node: Any, fragment: str) -> bool:
    ref = node.get("$ref") if isinstance(node, dict) else None
    return isinstance(ref, str) and "#" in ref and unquote(ref.split("#", 1)[1]) == fragment


def _drop(node: dict[str, Any], keys: list[str], ptr: str, why: str) -> list[str]:
    for k in keys:
        del node[k]
    return [f"{k} at {ptr} ({why})" for k in keys]


def _reaching(schema: dict[str, Any], fragment: str) -> set[int]:
    """ids of the schema objects from which a $ref to fragment can be reached (through subschemas and
    local $refs)."""
    parents: dict[int, set[int]] = {}
    hits: set[int] = set()
    for node, _ in walk(schema):
        children = [sub for sub, _ in subschemas(node, "#")]
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            try:
                children.append(resolve_pointer(schema, ref))
            except ValueError:
                pass
        for child in children:
            parents.setdefault(id(child), set()).add(id(node))
        if _refers_to(node, fragment):
            hits.add(id(node))
    return reaching(parents, hits)


def _recursive_siblings(schema: dict[str, Any], error: str) -> list[str]:
    """llguidance must intersect schemas that reach a recursive $ref: beside a $ref, the sibling
    assertions go (drafts 04 to 07 ignore them anyway); where an allOf is combined with siblings or
    other members, the allOf goes (its owner's own keywords stay)."""
    frag = _fragment(error)
    if frag is None:
        return []
    reach = _reaching(schema, frag)
    dropped: list[str] = []
    changed = False
    for node, ptr in list(walk(schema)):
        if id(node) not in reach:
            continue
        siblings = [k for k in node if k in ASSERTIONS and k != "$ref"]
        notes = [k for k in node if k not in ASSERTIONS and k not in ("$ref", "definitions", "$defs")]
        if isinstance(node.get("$ref"), str) and (siblings or notes):
            for k in notes:  # llguidance intersects even with annotations; they assert nothing
                del node[k]
            dropped += _drop(node, siblings, ptr, "beside a $ref reaching a recursive definition")
            changed = True
        elif isinstance(node.get("allOf"), list) and (len(siblings) > 1 or len(node["allOf"]) > 1):
            dropped += _drop(node, ["allOf"], ptr, "an intersection reaching a recursive definition")
        elif isinstance(node.get("patternProperties"), dict) and isinstance(node.get("properties"), dict):
            # a declared property that a pattern also matches is the intersection of both schemas
            dropped += _open_pattern_properties(
                node, ptr, "beside properties reaching a recursive definition"
            )
        else:
            for key in ("anyOf", "oneOf"):
                others = [k for k in siblings if k not in _COMBINATORS]
                if isinstance(node.get(key), list) and others:
                    dropped += _drop(node, others, ptr, f"beside a {key} reaching a recursive definition")
                    break
    return dropped or (["annotations beside recursive $refs"] if changed else [])


def _open_pattern_properties(node: dict[str, Any], ptr: str, why: str) -> list[str]:
    """patternProperties go with additionalProperties (which would otherwise refuse their keys)."""
    keys = ["patternProperties"]
    if "additionalProperties" in node and node["additionalProperties"] not in (True, {}):
        keys.append("additionalProperties")
    return _drop(node, keys, ptr, why)


def _overlapping_pattern_properties(schema: dict[str, Any], error: str) -> list[str]:
    m = re.search(r"regexes /(.*)/ and /(.*)/ are not disjoint", error)
    names = set(m.groups()) if m else set()
    dropped: list[str] = []
    for node, ptr in list(walk(schema)):
        pp = node.get("patternProperties")
        if isinstance(pp, dict) and (names & set(pp) if names else len(pp) > 1):
            dropped += _open_pattern_properties(node, ptr, "overlapping patterns")
    return dropped


def _min_max_properties(schema: dict[str, Any]) -> list[str]:
    """llguidance counts properties only when every declared property is required; when no such node
    is found, every min/maxProperties goes."""
    for only_optional in (True, False):
        dropped: list[str] = []
        for node, ptr in list(walk(schema)):
            keys: list[str] = [k for k in ("minProperties", "maxProperties") if k in node]
            optional = set(dict_at(node, "properties")) - set(list_at(node, "required"))
            if keys and (optional or not only_optional):
                dropped += _drop(node, keys, ptr, "beside optional properties")
        if dropped:
            return dropped
    return []


def _external_refs(schema: dict[str, Any]) -> list[str]:
    """A nested id/$id makes llguidance resolve the '#/...' references below it against another
    document; our walk resolves every one against the root, so the nested ids go (as identifiers they
    assert nothing). $refs to other documents go, named."""
    dropped: list[str] = []
    for node, ptr in list(walk(schema)):
        for key in ("id", "$id"):
            if ptr != "#" and isinstance(node.get(key), str):
                del node[key]
                dropped.append(f"{key} at {ptr} (a base URI: references resolve against the root)")
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            dropped += _drop(node, ["$ref"], ptr, f"external reference {ref!r}")
    return dropped


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _huge_bounds(schema: dict[str, Any]) -> list[str]:
    """Bounds near the largest double (1.79e308) that llguidance cannot turn into a regex."""
    dropped: list[str] = []
    for node, ptr in list(walk(schema)):
        keys = [
            k for k in _BOUNDS if isinstance(node.get(k), (int, float)) and not isinstance(node.get(k), bool)
        ]
        huge = [k for k in keys if abs(node[k]) >= 1e300]
        if huge:
            dropped += _drop(node, huge, ptr, "a bound beyond the grammar's number range")
    return dropped


def _blow_up(schema: dict[str, Any], compiler: Any) -> list[str]:
    """The grammar grows too large (or its intersections too deep): the first of these sets whose
    removal lets llguidance build the grammar goes — the allOf that intersect (beside other keywords
    or of several members), patternProperties beside properties (a key both match is an
    intersection), then the oneOf, then the anyOf. Four probes at most."""
    nodes = list(walk(schema))
    groups = {
        "allOf": [
            (n, p)
            for n, p in nodes
            if isinstance(n.get("allOf"), list) and (len(n) > 1 or len(n["allOf"]) > 1)
        ],
        "patternProperties": [(n, p) for n, p in nodes if "patternProperties" in n and "properties" in n],
        "oneOf": [(n, p) for n, p in nodes if isinstance(n.get("oneOf"), list)],
        "anyOf": [(n, p) for n, p in nodes if isinstance(n.get("anyOf"), list)],
    }
    for key, group in groups.items():
        if not group:
            continue
        saved = [(n, n.pop(key)) for n, _ in group]
        error = compiler.json_schema_error(schema)
        for n, val in saved:
            n[key] = val
        if "too large" in error or "stack level" in error:
            continue
        why = "the grammar grows too large with it"
        if key == "patternProperties":
            return [d for n, p in group for d in _open_pattern_properties(n, p, why)]
        return [d for n, p in group for d in _drop(n, [key], p, why)]
    return []


def _pattern_beside_format(schema: dict[str, Any]) -> list[str]:
    dropped: list[str] = []
    for node, ptr in list(walk(schema)):
        if isinstance(node.get("pattern"), str) and "format" in node:
            dropped += _drop(node, ["format"], ptr, "beside a pattern none of its strings match")
    return dropped


def _regex_ok(pattern: str, compiler: Any) -> bool:
    grammar = llg.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
    is_error, _ = llg.LLMatcher.validate_grammar_with_warnings(grammar, compiler.tokenizer)
    return not is_error


def _bad_patterns(schema: dict[str, Any], compiler: Any, also_composed: bool) -> list[str]:
    """Each distinct pattern is compiled alone; those llguidance refuses go. When every pattern
    compiles alone but their intersection cannot be decided, the patterns inside allOf/anyOf/oneOf
    members go."""
    ok: dict[str, bool] = {}
    dropped: list[str] = []
    nodes = list(walk(schema))
    for node, ptr in nodes:
        pat = node.get("pattern")
        if isinstance(pat, str) and not ok.setdefault(pat, _regex_ok(pat, compiler)):
            dropped += _drop(node, ["pattern"], ptr, "a regex the grammar engine cannot compile")
        pp = node.get("patternProperties")
        if isinstance(pp, dict) and not all(ok.setdefault(p, _regex_ok(p, compiler)) for p in pp):
            dropped += _open_pattern_properties(node, ptr, "a regex the grammar engine cannot compile")
    if dropped or not also_composed:
        return dropped
    for node, ptr in nodes:
        if any(f"/{k}/" in ptr for k in _COMBINATORS) and isinstance(node.get("pattern"), str):
            dropped += _drop(node, ["pattern"], ptr, "an intersection of regexes the engine cannot decide")
    return dropped
