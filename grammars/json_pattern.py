"""A JSON-Schema `pattern` (an unanchored regex over the decoded string) as a regex over the string's
JSON-escaped body, for the FSM engine. Promises: the result matches exactly the JSON string bodies
whose decoded text the pattern searches successfully, or NotRegularError is raised; only patterns
whose characters need no JSON escaping are translated (others go to a grammar engine)."""

from __future__ import annotations

try:
    import re._constants as sre_c
    import re._parser as sre_parse
except ImportError:  # Python < 3.11
    import sre_constants as sre_c
    import sre_parse

from typing import Any


class PatternError(ValueError):
    """The pattern is outside the subset translated here."""


SAFE_CATEGORIES = {sre_c.CATEGORY_DIGIT: "[0-9]", sre_c.CATEGORY_WORD: "[A-Za-z0-9_]"}
SPECIAL = set("\\.^$|?*+()[]{}")


def _safe_char(code: int) -> bool:
    """Printable ASCII other than '"' and '\\': written the same decoded and JSON-escaped."""
    return 0x20 <= code < 0x7F and chr(code) not in '"\\'


def _char(code: int) -> str:
    if not _safe_char(code):
        raise PatternError(f"character {chr(code)!r} needs JSON escaping")
    c = chr(code)
    return "\\" + c if c in SPECIAL or c == "-" else c


def _class(items: list[tuple[Any, Any]]) -> str:
    parts = []
    for op, av in items:
        if op is sre_c.LITERAL:
            parts.append(_char(av))
        elif op is sre_c.RANGE:
            lo, hi = av
            if not all(_safe_char(c) for c in range(lo, hi + 1)):
                raise PatternError("class range includes characters that need JSON escaping")
            parts.append(f"{_char(lo)}-{_char(hi)}")
        elif op is sre_c.CATEGORY and av in SAFE_CATEGORIES:
            parts.append(SAFE_CATEGORIES[av][1:-1])
        else:
            raise PatternError(f"class item {op} is not translated")
    return "[" + "".join(parts) + "]"


def _emit(seq: Any) -> str:
    out = []
    for op, av in seq:
        if op is sre_c.LITERAL:
            out.append(_char(av))
        elif op is sre_c.IN:
            out.append(_class(av))
        elif op is sre_c.SUBPATTERN:
            out.append("(" + _emit(av[-1]) + ")")
        elif op is sre_c.BRANCH:
            out.append("(" + "|".join(_emit(b) for b in av[1]) + ")")
        elif op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT):
            lo, hi, sub = av
            bound = "" if hi is sre_c.MAXREPEAT else str(hi)
            out.append(f"({_emit(sub)}){{{lo},{bound}}}")
        else:
            raise PatternError(f"regex construct {op} is not translated")
    return "".join(out)


def pattern_body_regex(pattern: str, any_char: str) -> str:
    """Regex over the JSON string body (between the quotes); any_char matches one escaped character."""
    try:
        parsed = list(sre_parse.parse(pattern))
    except Exception as e:  # re.error and friends: the caller reports the schema as invalid
        raise PatternError(f"invalid pattern {pattern!r}: {e}") from e
    head = parsed[:1] == [(sre_c.AT, sre_c.AT_BEGINNING)]
    tail = parsed[-1:] in ([(sre_c.AT, sre_c.AT_END)], [(sre_c.AT, sre_c.AT_END_STRING)])
    body = parsed[int(head) : len(parsed) - int(tail)]
    prefix = "" if head else f"({any_char})*"
    suffix = "" if tail else f"({any_char})*"
    return f"{prefix}({_emit(body)}){suffix}"
