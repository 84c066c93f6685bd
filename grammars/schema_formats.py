"""String formats of the JSON Schema specification beyond what llguidance builds in: regular ones
(RFC 3986/3987 references, RFC 6570 templates, RFC 6901 pointers) become a `pattern` the grammar
enforces, and the format checker that value checks and the final validation use knows the same
regexes. Promises: FORMAT_PATTERNS[f] matches exactly the strings format_checker() accepts for f."""

from __future__ import annotations

import re

import jsonschema

_UNRESERVED = r"A-Za-z0-9\-._~"
_SUB_DELIMS = r"!$&'()*+,;="
_PCT = r"%[0-9A-Fa-f]{2}"
# RFC 3987 ucschar and iprivate (the characters an IRI adds to a URI), as literal characters
_UCSCHAR = "\u00a0-\ud7ff\uf900-\ufdcf\ufdf0-\uffef"
_IPRIVATE = "\ue000-\uf8ff"


def _reference_regex(absolute_only: bool, extra: str = "", private: str = "") -> str:
    """RFC 3986 URI / URI-reference (RFC 3987 IRI / IRI-reference with extra = ucschar)."""
    unreserved = _UNRESERVED + extra
    pchar = f"(?:[{unreserved}{_SUB_DELIMS}:@]|{_PCT})"
    segment_nz_nc = f"(?:[{unreserved}{_SUB_DELIMS}@]|{_PCT})+"
    ip_literal = rf"\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[{_UNRESERVED}{_SUB_DELIMS}:]+)\]"
    reg_name = f"(?:[{unreserved}{_SUB_DELIMS}]|{_PCT})*"
    userinfo = f"(?:[{unreserved}{_SUB_DELIMS}:]|{_PCT})*"
    authority = f"(?:{userinfo}@)?(?:{ip_literal}|{reg_name})(?::[0-9]*)?"
    abempty = f"(?:/{pchar}*)*"
    path_absolute = f"/(?:{pchar}+(?:/{pchar}*)*)?"
    rootless = f"{pchar}+(?:/{pchar}*)*"
    noscheme = f"{segment_nz_nc}(?:/{pchar}*)*"
    query = f"(?:{pchar}|[/?{private}])*"
    fragment = f"(?:{pchar}|[/?])*"
    tail = rf"(?:\?{query})?(?:#{fragment})?"
    uri = rf"[A-Za-z][A-Za-z0-9+\-.]*:(?://{authority}{abempty}|{path_absolute}|{rootless})?{tail}"
    if absolute_only:
        return f"^{uri}$"
    relative = f"(?://{authority}{abempty}|{path_absolute}|{noscheme})?{tail}"
    return f"^(?:{uri}|{relative})$"


def _uri_template_regex() -> str:
    """RFC 6570 level 4: literals and {expressions} of variable lists with prefix / explode modifiers."""
    literal = rf"(?:[^\x00-\x20\"'%<>\\^`{{|}}\x7f]|{_PCT})"
    varchar = f"(?:[A-Za-z0-9_]|{_PCT})"
    varspec = rf"{varchar}(?:\.?{varchar})*(?::[1-9][0-9]{{0,3}}|\*)?"
    expression = rf"\{{[+#./;?&=,!@|]?{varspec}(?:,{varspec})*\}}"
    return f"^(?:{literal}|{expression})*$"


FORMAT_PATTERNS: dict[str, str] = {
    "uri-reference": _reference_regex(False),
    "iri": _reference_regex(True, _UCSCHAR, _IPRIVATE),
    "iri-reference": _reference_regex(False, _UCSCHAR, _IPRIVATE),
    "uri-template": _uri_template_regex(),
    "json-pointer": r"^(?:/(?:[^~/]|~[01])*)*$",
    "relative-json-pointer": r"^(?:0|[1-9][0-9]*)(?:#|(?:/(?:[^~/]|~[01])*)*)$",
}

# Formats llguidance enforces that jsonschema's checker lacks without optional packages.
_LLGUIDANCE_FORMATS = {
    "hostname": r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z",
    "uri": r"[A-Za-z][A-Za-z0-9+.\-]*:[^\s\"<>\\^`{|}]*\Z",
    "duration": r"P(?!\Z)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?\Z",
}


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's format checker, with the formats above checked by their regexes."""
    checker = jsonschema.FormatChecker()
    compiled = {name: re.compile(rx) for name, rx in _LLGUIDANCE_FORMATS.items()}
    compiled.update(
        {
            name: re.compile(rx.removeprefix("^").removesuffix("$") + r"\Z")
            for name, rx in FORMAT_PATTERNS.items()
        }
    )
    for name, rx in compiled.items():
        checker.checks(name)(lambda value, rx=rx: not isinstance(value, str) or bool(rx.match(value)))
    return checker


CHECKED_FORMATS = frozenset(format_checker().checkers)  # a value check can hold these
