"""JSON schema → regex for our FSM, plus schema normalisation and the structural checks shared by
every engine. Promises: every string the regex matches is compact JSON (separators ", " and ": ",
the same as the other engines) that validates against the schema; an assertion the regex does not
translate raises NotRegularError (never dropped); malformed schemas raise ValueError."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import jsonschema

from .json_pattern import PatternError, pattern_body_regex

# Assertion keywords of every draft; a schema object using one that the regex translation does not
# handle (TRANSLATED) goes to a grammar engine instead. Other keywords are annotations or unknown.
ASSERTIONS = frozenset(
    "type properties required additionalProperties items prefixItems minItems maxItems enum const "
    "anyOf oneOf allOf $ref minLength maxLength pattern format minimum maximum exclusiveMinimum "
    "exclusiveMaximum multipleOf if then else not uniqueItems patternProperties dependentSchemas "
    "dependentRequired dependencies contains minContains maxContains propertyNames "
    "unevaluatedProperties unevaluatedItems minProperties maxProperties $dynamicRef $recursiveRef "
    "additionalItems".split()
)
TRANSLATED = frozenset(
    "type properties required additionalProperties items minItems maxItems enum const anyOf allOf "
    "$ref minLength maxLength pattern format minimum maximum exclusiveMinimum exclusiveMaximum".split()
)
# Keywords that decide the value alone: beside other assertions they need a grammar engine.
EXCLUSIVE = ("$ref", "anyOf", "allOf")
JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})

STRING_CHAR = r'([^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
INTEGER = r"-?(0|[1-9][0-9]{0,15})"
NON_NEGATIVE_INTEGER = r"(0|[1-9][0-9]{0,15})"
NUMBER = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?"
FORMATS = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "time": r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": r"[a-zA-Z0-9._%+\-]{1,64}@[a-zA-Z0-9\-]{1,63}(\.[a-zA-Z0-9\-]{1,63}){0,4}\.[a-zA-Z]{2,12}",
}
FORMATS["date-time"] = FORMATS["date"] + "T" + FORMATS["time"]
ITEM_SEP, KEY_SEP = ", ", ": "


class NotRegularError(ValueError):
    """The schema is valid and supported, but our regex translation cannot express it (use xgrammar)."""


def normalize_json_schema(schema: Any) -> str:
    """A JSON string from a JSON string, a dict/bool, or a pydantic model class; ValueError otherwise."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            obj = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON schema: not valid JSON ({e})") from e
    elif isinstance(schema, (dict, bool)):
        obj = schema
    else:
        raise ValueError(
            f"json_schema must be a JSON string, dict or pydantic model class, got {type(schema).__name__}"
        )
    if not isinstance(obj, (dict, bool)):
        raise ValueError(f"invalid JSON schema: expected an object, got {type(obj).__name__}")
    if obj is True:  # the schema every JSON value satisfies, written as the engines take it
        obj = {}
    return json.dumps(obj, ensure_ascii=False)


def check_schema(schema: Any, path: str = "#") -> None:
    """Raise ValueError naming the first malformed value (unknown keywords are annotations)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(
            f"invalid JSON schema at {path}: expected object or boolean, got {type(schema).__name__}"
        )
    for key, val in schema.items():
        if key in ("properties", "$defs", "definitions"):
            if not isinstance(val, dict):
                raise ValueError(f"invalid JSON schema at {path}/{key}: expected an object")
            for name, sub in val.items():
                check_schema(sub, f"{path}/{key}/{name}")
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            if not isinstance(val, list) or not val:
                raise ValueError(f"invalid JSON schema at {path}/{key}: expected a non-empty array")
            for i, sub in enumerate(val):
                check_schema(sub, f"{path}/{key}/{i}")
        elif key in ("items", "additionalProperties"):
            check_schema(val, f"{path}/{key}")
    types = schema.get("type")
    for t in types if isinstance(types, list) else [types] if types is not None else []:
        if t not in JSON_TYPES:
            raise ValueError(f"invalid JSON schema at {path}: unknown type {t!r}")
    if "required" in schema and not (
        isinstance(schema["required"], list) and all(isinstance(r, str) for r in schema["required"])
    ):
        raise ValueError(f"invalid JSON schema at {path}: 'required' must be a list of strings")
    if "enum" in schema and not (isinstance(schema["enum"], list) and schema["enum"]):
        raise ValueError(f"invalid JSON schema at {path}: 'enum' must be a non-empty array")


def literal_regex(value: Any) -> str:
    return re.escape(json.dumps(value, ensure_ascii=False, separators=(ITEM_SEP, KEY_SEP)))


MAX_INT = 10**16 - 1  # INTEGER's 16-digit bound


def _same_length(lo: str, hi: str) -> list[str]:
    """Alternatives matching the digit strings of one length from lo to hi (lo <= hi)."""
    n = len(lo)
    if lo == hi:
        return [lo]
    if lo == "0" * n and hi == "9" * n:
        return ["[0-9]" * n]
    if n == 1:
        return [f"[{lo}-{hi}]"]
    if lo[0] == hi[0]:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    parts = [lo[0] + rest for rest in _same_length(lo[1:], "9" * (n - 1))]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}]" + "[0-9]" * (n - 1))
    parts += [hi[0] + rest for rest in _same_length("0" * (n - 1), hi[1:])]
    return parts


def _non_negative_range(lo: int, hi: int) -> list[str]:
    parts = []
    for n in range(len(str(lo)), len(str(hi)) + 1):
        a, b = max(lo, 10 ** (n - 1) if n > 1 else 0), min(hi, 10**n - 1)
        if a <= b:
            parts += _same_length(str(a), str(b))
    return parts


def int_range_regex(lo: int, hi: int) -> str:
    """Regex for the decimal integers lo..hi (JSON form: no leading zeros, '-' only below 0)."""
    parts = []
    if lo < 0:
        parts += ["-" + p for p in _non_negative_range(max(1, -hi), -lo)]
    if hi >= 0:
        parts += _non_negative_range(max(lo, 0), hi)
    return "(" + "|".join(parts) + ")"


def _repeat(unit: str, lo: int, hi: int | None) -> str:
    if hi is not None and hi < lo:
        raise ValueError(f"invalid JSON schema: maximum {hi} < minimum {lo}")
    if hi is None:
        return f"({unit}){{{lo},}}"
    return f"({unit}){{{lo},{hi}}}"


class _Converter:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.ref_stack: list[str] = []

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise NotRegularError(f"remote $ref {ref!r} is not supported")
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise ValueError(f"invalid JSON schema: $ref {ref!r} does not resolve")
            node = node[part]
        return node

    def convert(self, s: Any) -> str:
        if s is True or s == {}:
            raise NotRegularError("schema allows any JSON value, which needs a grammar (xgrammar)")
        if s is False:
            raise ValueError("invalid JSON schema: 'false' schema matches nothing")
        self.check_translated(s)
        if "$ref" in s:
            ref = s["$ref"]
            if ref in self.ref_stack:
                raise NotRegularError(f"recursive $ref {ref!r} needs a grammar (xgrammar)")
            self.ref_stack.append(ref)
            try:
                return self.convert(self.resolve(ref))
            finally:
                self.ref_stack.pop()
        if "const" in s or "enum" in s:
            return self.literals(s)
        if "anyOf" in s:
            return "(" + "|".join(self.convert(sub) for sub in s["anyOf"]) + ")"
        if "oneOf" in s:
            raise NotRegularError("'oneOf' (exclusive) needs xgrammar")
        if "allOf" in s:
            if len(s["allOf"]) != 1:
                raise NotRegularError("'allOf' with several schemas needs xgrammar")
            return self.convert(s["allOf"][0])
        return self.typed(s)

    def literals(self, s: dict[str, Any]) -> str:
        """const / enum: the listed values that also satisfy the sibling keywords (checked by jsonschema)."""
        values = [s["const"]] if "const" in s else list(s["enum"])
        rest = {k: v for k, v in s.items() if k not in ("const", "enum")}
        if ASSERTIONS.intersection(rest):
            check = jsonschema.validators.validator_for(self.root)(self.root).evolve(schema=rest)
            values = [v for v in values if check.is_valid(v)]
        if not values:
            raise ValueError("invalid JSON schema: no value of its const/enum satisfies the other keywords")
        return "(" + "|".join(literal_regex(v) for v in values) + ")"

    @staticmethod
    def check_translated(s: dict[str, Any]) -> None:
        """NotRegularError unless every assertion of s is one this translation enforces."""
        used = ASSERTIONS.intersection(s)
        if used - TRANSLATED:
            raise NotRegularError(f"keywords {sorted(used - TRANSLATED)} need a grammar engine")
        alone = [k for k in EXCLUSIVE if k in used]
        if "const" in used or "enum" in used:
            return  # literals() filters the values by the siblings
        if alone and len(used) > 1:
            raise NotRegularError(f"{alone[0]!r} beside other assertions needs a grammar engine")
        for key in ("exclusiveMinimum", "exclusiveMaximum"):
            if isinstance(s.get(key), bool):
                raise NotRegularError(f"draft-04 boolean {key!r} needs a grammar engine")
        if isinstance(s.get("items"), (list, bool)):
            raise NotRegularError("tuple or boolean 'items' needs a grammar engine")

    def typed(self, s: dict[str, Any]) -> str:
        t = s.get("type")
        if isinstance(t, list):
            return "(" + "|".join(self.typed({**s, "type": one}) for one in t) + ")"
        if t is None:
            t = "object" if "properties" in s else "array" if "items" in s else None
        handlers: dict[str, Callable[[dict[str, Any]], str]] = {
            "string": self.string,
            "integer": self.integer,
            "number": self.number,
            "object": self.object,
            "array": self.array,
            "boolean": lambda _: "(true|false)",
            "null": lambda _: "null",
        }
        handler = handlers.get(t if isinstance(t, str) else "")
        if handler is None:
            raise NotRegularError("schema without a type allows any JSON value (xgrammar)")
        return handler(s)

    def string(self, s: dict[str, Any]) -> str:
        used = {"format", "pattern", "minLength", "maxLength"}.intersection(s)
        if used & {"format", "pattern"} and len(used) > 1:
            raise NotRegularError(
                "a string with several of format / pattern / lengths needs a grammar engine"
            )
        if "format" in s:
            fmt = s["format"]
            if fmt not in FORMATS:
                raise NotRegularError(f"string format {fmt!r} is not supported by the regex engine")
            return f'"{FORMATS[fmt]}"'
        if "pattern" in s:
            try:
                return '"' + pattern_body_regex(s["pattern"], STRING_CHAR) + '"'
            except PatternError as e:
                raise NotRegularError(f"pattern: {e}") from e
        lo, hi = int(s.get("minLength", 0)), s.get("maxLength")
        return '"' + _repeat(STRING_CHAR, lo, None if hi is None else int(hi)) + '"'

    def integer(self, s: dict[str, Any]) -> str:
        if "multipleOf" in s:
            raise NotRegularError("integer 'multipleOf' is not supported by the regex engine")
        lo, hi = -MAX_INT, MAX_INT
        for key, val in (("minimum", s.get("minimum")), ("exclusiveMinimum", s.get("exclusiveMinimum"))):
            if val is not None:
                bound = math.ceil(val) if key == "minimum" else math.floor(val) + 1
                lo = max(lo, bound)
        for key, val in (("maximum", s.get("maximum")), ("exclusiveMaximum", s.get("exclusiveMaximum"))):
            if val is not None:
                bound = math.floor(val) if key == "maximum" else math.ceil(val) - 1
                hi = min(hi, bound)
        if (lo, hi) == (-MAX_INT, MAX_INT):
            return INTEGER
        if lo > hi:
            raise ValueError(f"invalid JSON schema: no integer between {lo} and {hi}")
        return int_range_regex(lo, hi)

    def number(self, s: dict[str, Any]) -> str:
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
            if key in s:
                raise NotRegularError(f"number {key!r} is not supported by the regex engine")
        return NUMBER

    def array(self, s: dict[str, Any]) -> str:
        if "prefixItems" in s:
            raise NotRegularError("'prefixItems' is not supported by the regex engine")
        if "items" not in s or s["items"] is True:
            raise NotRegularError("array without 'items' allows any JSON values (xgrammar)")
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        hi = None if hi is None else int(hi)
        if hi == 0:
            return r"\[\]"
        item = self.convert(s["items"])
        rest = _repeat(ITEM_SEP + item, max(lo - 1, 0), None if hi is None else hi - 1)
        body = f"{item}{rest}"
        return rf"\[{body}\]" if lo >= 1 else rf"\[({body})?\]"

    def object(self, s: dict[str, Any]) -> str:
        props = s.get("properties") or {}
        required = set(s.get("required") or [])
        missing = required - set(props)
        if missing:
            raise NotRegularError(f"required properties without a schema: {sorted(missing)}")
        extra = s.get("additionalProperties", True)
        if not props:
            if isinstance(extra, dict) and extra:
                pair = '"' + STRING_CHAR + '*"' + KEY_SEP + self.convert(extra)
                return rf"\{{({pair}({ITEM_SEP}{pair})*)?\}}"
            raise NotRegularError("object without 'properties' allows any members (xgrammar)")
        items = [
            (literal_regex(name) + KEY_SEP + self.convert(sub), name in required)
            for name, sub in props.items()
        ]
        return r"\{" + self._members(items) + r"\}"

    @staticmethod
    def _members(items: list[tuple[str, bool]]) -> str:
        """Members in declared order; optional ones may be left out; commas only between members."""
        after_first = ""  # regex for members i.. when one member was already written
        first = ""  # regex for members i.. when none was written yet
        for i in range(len(items) - 1, -1, -1):
            member, req = items[i]
            if req:
                after_first, first = f"{ITEM_SEP}{member}{after_first}", f"{member}{after_first}"
            else:
                first = f"({member}{after_first}|{first})" if first else f"({member}{after_first})?"
                after_first = f"({ITEM_SEP}{member})?{after_first}"
        return first


def json_schema_to_regex(schema: Any) -> str:
    """Regex for the schema (str JSON / dict / pydantic class); ValueError or NotRegularError."""
    obj = json.loads(normalize_json_schema(schema))
    check_schema(obj)
    return _Converter(obj if isinstance(obj, dict) else {}).convert(obj)
