"""Request bodies the app could parse but not serve: bytes that are not UTF-8 (Python's JSON reader
takes an encoded lone surrogate such as b"\\xed\\xa0\\x80"), and JSON strings holding lone UTF-16
surrogates (`"\\ud800"` with no pair): Python decodes both to a str no UTF-8 encoder takes, and the
tokenizer or the response encoder would fail deep inside the request. The guard answers such a body
with a 400 that says where. Promises: a UTF-8 body without a surrogate escape is never parsed here."""

from __future__ import annotations

import json
import re

# a JSON escape in the surrogate range, \ud800-\udfff (a valid pair is two such escapes)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LONE = re.compile("[\ud800-\udfff]")
LONE_SURROGATE = (
    "a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape); send valid Unicode"
)


NOT_UTF8 = "the body is not valid UTF-8 (JSON text must be UTF-8, RFC 8259)"


def body_problem(body: bytes) -> str | None:
    """Why the guard refuses body (not UTF-8, or a string with a lone surrogate), else None."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{NOT_UTF8}: {e.reason} at byte {e.start}"
    where = lone_surrogate_at(body)
    return None if where is None else f"{where}: {LONE_SURROGATE}"


def lone_surrogate_at(body: bytes) -> str | None:
    """The JSON path ('messages[0].content') of the first string (or object key) holding a lone
    surrogate; None when there is none or the body is not JSON (the app reports that itself)."""
    if not _SURROGATE_ESCAPE.search(body):
        return None
    try:  # a body nested too deep for either is the app's to refuse (a 400 for a bad body)
        return _find(json.loads(body), "")
    except (ValueError, RecursionError):
        return None


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
