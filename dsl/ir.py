"""The expressions of a radixlm program (what `s += ...` accepts) and the sampling options
they carry. Expressions are plain immutable data; the interpreter gives them meaning.
Promise: every constructor validates its arguments and raises ValueError with a reason."""

from __future__ import annotations

import functools
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue

from radixlm.backend.sampling_params import FRONTEND_NAMES, SAMPLING_KEYS, check_values

if TYPE_CHECKING:
    from pydantic_core import core_schema

    from radixlm.choices import ChoicesSamplingMethod

# Sampling keys a gen may set, under the names gen() uses (max_tokens, ...), mapped to the one
# definition's (radixlm.backend.sampling_params); values are checked there too.
GEN_SAMPLING_KEYS = (
    "max_new_tokens",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "regex",
    "json_schema",
)
GEN_TO_ENGINE_KEYS = {FRONTEND_NAMES.get(k, k): k for k in GEN_SAMPLING_KEYS}
_GEN_NAMES = {k: FRONTEND_NAMES.get(k, k) for k in SAMPLING_KEYS}
# Options that are not sampling parameters but ride along with a request.
LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")

# As SGLang: a number may trail spaces or newlines, and its gen stops on either (_NUMBER_STOPS),
# so a model that would go on writing digits ends at its first separator instead.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?[ \n]*"
_NUMBER_STOPS = (" ", "\n")
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
_DTYPE_REGEX = {int: REGEX_INT, float: REGEX_FLOAT, bool: REGEX_BOOL, str: REGEX_STR}
_DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str}


class Expr:
    """Base of all expressions; `expr + "text"` and `"text" + expr` build an ExprList."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), self])


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    if value is None:
        raise ValueError("cannot append None to a program state")
    raise ValueError(f"cannot append a {type(value).__name__} to a program state; use str(...) first")


@dataclass(frozen=True)
class Constant(Expr):
    value: str

    def __repr__(self) -> str:
        return repr(self.value if len(self.value) < 40 else self.value[:37] + "...")


@dataclass(frozen=True)
class ExprList(Expr):
    exprs: list[Expr]

    def __add__(self, other: Any) -> ExprList:
        return ExprList([*self.exprs, to_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([to_expr(other), *self.exprs])


@dataclass(frozen=True)
class Gen(Expr):
    """Generate text. `sampling` holds only the gen-level overrides (engine names)."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    logprob: dict[str, Any] = field(default_factory=dict)
    dtype: type | None = None
    schema_cls: type[BaseModel] | None = None  # pydantic class: the value becomes a validated object


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float
    choices_method: ChoicesSamplingMethod


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True)
class ConcatAndAppend(Expr):
    states: list[Any]  # ProgramState of joined forks


@dataclass(frozen=True)
class Commit(Expr):
    """Internal: tokenize pending text now (and optionally pin the prefix for forks)."""

    pin: bool = False


def _is_pydantic_class(obj: Any) -> bool:
    return isinstance(obj, type) and hasattr(obj, "model_json_schema") and hasattr(obj, "model_validate_json")


class _TypedGenSchema(GenerateJsonSchema):
    """A model's JSON schema with its objects closed unless the model allows extra fields.

    Pydantic leaves additionalProperties unset for its default (extra fields ignored), which in
    JSON Schema means any undeclared property is allowed: a small model then spends its budget on
    properties validation would drop. Closing them changes no object the user gets back."""

    def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
        out = super().model_schema(schema)
        allows_extra = schema.get("config", {}).get("extra_fields_behavior") == "allow"
        if not allows_extra and out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out


def normalize_json_schema(schema: Any) -> tuple[str, type[BaseModel] | None]:
    """str | dict | pydantic class → (schema JSON text, pydantic class or None)."""
    if _is_pydantic_class(schema):
        return _model_schema_text(schema), schema
    if isinstance(schema, dict):
        return json.dumps(schema), None
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from e
        return schema, None
    raise ValueError(
        f"json_schema must be a JSON string, a dict or a pydantic class, got {type(schema).__name__}"
    )


@functools.lru_cache(maxsize=256)
def _model_schema_text(model: type[BaseModel]) -> str:
    """A pydantic class's JSON schema text, built once per class: pydantic regenerates it on
    every call, which would cost each typed gen of a batch of programs the same work."""
    return json.dumps(model.model_json_schema(schema_generator=_TypedGenSchema))


def _resolve_dtype(dtype: Any) -> type | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        dtype = _DTYPE_NAMES.get(dtype, dtype)
    if dtype not in _DTYPE_REGEX:
        raise ValueError(f"dtype must be one of int, float, bool, str; got {dtype!r}")
    return dtype


def check_logprob_options(logprob: dict[str, Any]) -> dict[str, Any]:
    """The logprob options, or ValueError naming the first that is not of its type and range."""
    for key in ("return_logprob", "return_text_in_logprobs"):
        if not isinstance(logprob.get(key, False), bool):
            raise ValueError(f"{key} must be True or False, got {logprob[key]!r}")
    for key, low in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
        value = logprob.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{key} must be an int >= {low}, got {value!r}")
    return logprob


def make_gen(name: str | None, options: dict[str, Any], dtype: Any = None) -> Gen:
    """Build a Gen from gen()'s keyword arguments (None means 'not set')."""
    if name is not None and not isinstance(name, str):
        raise ValueError(f"gen name must be a str, got {type(name).__name__}")
    if options.get("n") not in (None, 1):
        raise ValueError(
            f"gen(n={options['n']!r}) is not supported: fork the state (s.fork(n)) and gen in each"
        )
    sampling: dict[str, Any] = {}
    for key, engine_key in GEN_TO_ENGINE_KEYS.items():
        if options.get(key) is not None:
            sampling[engine_key] = options[key]
    logprob = check_logprob_options({k: options[k] for k in LOGPROB_KEYS if options.get(k) is not None})
    dtype = _resolve_dtype(dtype)
    schema_cls = None
    if "json_schema" in sampling:
        sampling["json_schema"], schema_cls = normalize_json_schema(sampling["json_schema"])
    if "regex" in sampling:
        try:
            re.compile(sampling["regex"])
        except re.error as e:
            raise ValueError(f"invalid regex {sampling['regex']!r}: {e}") from e
    if "regex" in sampling and "json_schema" in sampling:
        raise ValueError("gen: give at most one of regex and json_schema")
    if dtype is not None and "regex" in sampling:
        # as SGLang: the dtype's own pattern, so the output always parses as the dtype
        warnings.warn(f"gen: dtype={dtype.__name__} overrides regex={sampling['regex']!r}", stacklevel=3)
    if dtype is not None and "json_schema" in sampling:
        warnings.warn(f"gen: dtype={dtype.__name__} is ignored beside json_schema", stacklevel=3)
    if dtype is not None and "json_schema" not in sampling:
        sampling["regex"] = _DTYPE_REGEX[dtype]
        if dtype in (int, float):
            sampling["stop"] = _with_stops(sampling.get("stop"), _NUMBER_STOPS)
    try:
        check_values(sampling, _GEN_NAMES)
    except ValueError as e:
        raise ValueError(f"gen: {e}") from e
    return Gen(name, sampling, logprob, dtype, schema_cls)


def _with_stops(stop: Any, extra: tuple[str, ...]) -> Any:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    return stops + [s for s in extra if s not in stops]


def convert_value(gen: Gen, text: str, meta: dict[str, Any] | None = None) -> Any:
    """The variable value of a finished gen: typed when a dtype or pydantic class was given.
    ValueError when the output does not parse, saying why it ended when a limit cut it short."""
    try:
        return _typed_value(gen, text)
    except ValueError as e:
        raise ValueError(f"{e}{_why_cut(meta)}") from e


def _typed_value(gen: Gen, text: str) -> Any:
    if gen.schema_cls is not None:
        try:
            return gen.schema_cls.model_validate_json(text)
        except Exception as e:  # pydantic.ValidationError, kept generic to avoid importing pydantic
            raise ValueError(
                f"gen {gen.name!r}: output does not validate as {gen.schema_cls.__name__}: {e}"
            ) from e
    if gen.dtype is None:
        return text
    try:
        if gen.dtype is int:
            return int(text.strip())
        if gen.dtype is float:
            return float(text.strip())
        if gen.dtype is bool:
            return {"True": True, "False": False}[text.strip()]
        return json.loads(text, strict=False)  # REGEX_STR lets tabs and newlines in
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"gen {gen.name!r}: output {text!r} does not parse as {gen.dtype.__name__}") from e


def _why_cut(meta: dict[str, Any] | None) -> str:
    reason = (meta or {}).get("finish_reason") or {}
    if reason.get("type") == "length":
        return f" (generation hit its token limit, {reason.get('length')} tokens: raise max_tokens)"
    if reason.get("type") == "stop":
        matched = reason.get("matched")
        return f" (generation stopped at {f'token {matched}' if isinstance(matched, int) else repr(matched)})"
    if reason.get("type") == "abort":
        return f" (generation was aborted: {reason.get('message', 'no reason given')})"
    return ""


def make_select(name: str | None, choices: Any, temperature: float, method: Any) -> Select:
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("select needs a non-empty list of choices")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select choices must be non-empty strings")
    if method is None:
        from radixlm.choices import token_length_normalized

        method = token_length_normalized
    if not callable(method):
        raise ValueError(f"choices_method must be a ChoicesSamplingMethod, got {method!r}")
    if temperature:
        raise ValueError(
            f"select(temperature={temperature}) is not supported: select scores every choice and picks the "
            "best by choices_method, nothing is sampled; leave temperature at 0"
        )
    return Select(name, list(choices), 0.0, method)
