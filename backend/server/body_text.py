"""Request bodies whose JSON strings hold lone UTF-16 surrogates: JSON may escape one (`"\\ud800"`
with no pair), Python decodes it to a str no UTF-8 encoder takes, and the tokenizer or the response
encoder would fail deep inside the request. The guard answers such a body with a 400 naming the
field. Promises: a body without a surrogate escape is never parsed here."""

from __future__ import annotations

import json
import re

# a JSON escape in the surrogate range, \ud800-\udfff (a valid pair is two such escapes)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE = (
    "a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); send valid Unicode"
)


def lone_surrogate_at(body: bytes) -> str | None:
    """The JSON path ('messages[0].content') of the first string (or object key) holding a lone
    surrogate; None when there is none or the body is not JSON (the app reports that itself)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return _find(data, "")


def _find(node: object, path: str) -> str | None:
    if isinstance(node, str):
        return (path or "body") if _LONE.search(node) else None
    if isinstance(node, list):
        for i, item in enumerate(node):
            if (hit := _find(item, f"{path}[{i}]")) is not None:
                return hit
    elif isinstance(node, dict):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            if _LONE.search(key):
                return child.encode("utf-8", "backslashreplace").decode()
            if (hit := _find(value, child)) is not None:
                return hit
    return None
