"""Unsatisfiable definitions as `false`: llguidance refuses a whole schema when a `$ref` leads to a
definition that matches nothing, even where the reference sits in an optional place (a property
that may be absent, an anyOf branch), although it handles an inline `false` there. Its error names
the definition; every reference to it becomes `false`, which matches exactly what the definition
matches (nothing). Promises: only `$ref`s to the named definition of this document change."""

from __future__ import annotations

import json
import re
from typing import Any

_UNSATISFIABLE_AT = re.compile(r"Unsatisfiable schema:.*?while processing ([^\s#]*)#(/[^\s)]*)", re.DOTALL)


def unsatisfiable_pointer(error: str) -> tuple[str, str] | None:
    """(base URI, '#/...' fragment) of the definition an llguidance unsatisfiability error names."""
    m = _UNSATISFIABLE_AT.search(error)
    return (m.group(1), "#" + m.group(2)) if m and m.group(2).strip("/") else None


def refs_to_false(spec: str, base: str, fragment: str) -> str | None:
    """The schema with every `$ref` to fragment (as written relative, or against the root's own
    base URI) replaced by `false`; None when no reference matched."""
    schema = json.loads(spec)
    if not isinstance(schema, dict):
        return None
    root_base = str(schema.get("$id") or schema.get("id") or "").split("#")[0]
    names = {fragment} | ({root_base + fragment} if root_base and base in ("", root_base) else set())
    if base.startswith("json-schema:///"):
        names.add(base + fragment)
    hits = 0

    def rewrite(node: Any) -> Any:
        nonlocal hits
        if isinstance(node, dict):
            if node.get("$ref") in names and len(node) == 1:
                hits += 1
                return False
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    out = rewrite(schema)
    return json.dumps(out) if hits else None
