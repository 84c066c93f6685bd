"""The one definition of a request's sampling parameters (SGLang's names): each key, its
default, the types a wire format may send, its value check, and the names other front ends use
for it (OpenAI's `max_tokens`, the language's `gen(max_tokens=...)`). The engine validates a
request here once at submission; the server's request models and the language's `gen` are
derived from it, so a key or a bound is changed in this file only."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, get_type_hints

from .stop_regex import check_stop_regexes

GREEDY_TEMPERATURE = 1e-5
DEFAULT_MAX_NEW_TOKENS = 128
# Names the OpenAI API and the language's gen() use for the same keys.
FRONTEND_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
# Keys whose None is a value of its own (no seed, no constraint), not "not set".
NONE_MEANS_UNSET_EXCEPT = ("seed", "regex", "json_schema", "ebnf")
CONSTRAINT_KEYS = ("regex", "json_schema", "ebnf")
SPECULATIVE_ALGORITHMS = ("ngram", "draft", "none")
MAX_DRAFT_TOKENS = 16


def _wire(t: Any, **kw: Any) -> Any:
    """A field whose wire format also takes `t` (normalized by from_dict)."""
    return field(metadata={"wire": t}, **kw)


@dataclass
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = _wire(str | list[str], default_factory=list)
    stop_token_ids: list[int] = _wire(int | list[int], default_factory=list)
    stop_regex: list[str] = _wire(str | list[str], default_factory=list)  # searched in the output text
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    # token id → bias added to its logit before sampling (OpenAI's; JSON sends the ids as strings)
    logit_bias: dict[int, float] = _wire(dict[str, float] | dict[int, float], default_factory=dict)
    seed: int | None = None
    regex: str | None = None
    # str (JSON), dict, or pydantic model class; normalized to str
    json_schema: str | dict[str, Any] | type | None = _wire(str | dict[str, Any], default=None)
    json_schema_strict: bool = True  # False: assertions the grammar cannot enforce are dropped and named
    ebnf: str | None = None
    # None: the engine's setting (backend/speculative.py); "none" turns it off for this request
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        if isinstance(d, SamplingParams):
            return d
        d = normalize(check_keys(d))
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> None:
        for f in fields(self):
            _CHECKS[f.name](f.name, getattr(self, f.name))
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        given = [k for k in CONSTRAINT_KEYS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"only one of regex / json_schema / ebnf per request, got {', '.join(given)}")
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            self.json_schema = schema_to_json_string(self.json_schema)

    @property
    def is_greedy(self) -> bool:
        # A temperature this small is argmax in all but float overflow (SGLang's rule too).
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, spec) of the request's constraint, if any."""
        for k in CONSTRAINT_KEYS:
            v = getattr(self, k)
            if v is not None:
                return k, v
        return None


SAMPLING_KEYS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))


def check_keys(d: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of `d`; ValueError naming any key that is not a sampling parameter."""
    if d is not None and not isinstance(d, dict):
        raise ValueError(f"sampling_params must be a dict (or a list of them), got {type(d).__name__}")
    d = dict(d or {})
    unknown = sorted(set(d) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    return d


def normalize(d: dict[str, Any]) -> dict[str, Any]:
    """Wire shapes → field shapes: None drops a key (but stays a value where it means one), a
    single stop string, stop regex or stop token id becomes a list, and so does a tuple of them."""
    d = {k: v for k, v in d.items() if v is not None or k in NONE_MEANS_UNSET_EXCEPT}
    for key in ("stop", "stop_regex", "stop_token_ids"):
        if isinstance(d.get(key), tuple):
            d[key] = list(d[key])
    for key in ("stop", "stop_regex"):
        if isinstance(d.get(key), str):
            d[key] = [d[key]]
    if isinstance(d.get("stop_token_ids"), int) and not isinstance(d["stop_token_ids"], bool):
        d["stop_token_ids"] = [d["stop_token_ids"]]
    if isinstance(d.get("logit_bias"), dict):
        d["logit_bias"] = {_token_key(k): v for k, v in d["logit_bias"].items()}
    return d


def _token_key(key: Any) -> Any:
    """A logit_bias key as a token id: JSON object keys are strings of digits."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return key


def check_values(d: dict[str, Any], names: dict[str, str] | None = None) -> None:
    """Each given key's own check, without the checks across keys (for partial option sets such
    as one gen's overrides, which meet the program's defaults later). Errors name a key as
    `names` maps it (the caller's spelling, e.g. OpenAI's max_tokens)."""
    for k, v in normalize(check_keys(d)).items():
        _CHECKS[k]((names or {}).get(k, k), v)


def wire_fields() -> dict[str, tuple[Any, Any]]:
    """Each key → (the types a request body may send for it, its default), for request models."""
    hints = get_type_hints(SamplingParams)
    out = {}
    for f in fields(SamplingParams):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        out[f.name] = (f.metadata.get("wire", hints[f.name]), default)
    return out


def schema_to_json_string(schema: Any) -> str:
    """A JSON-schema given as dict or pydantic model class → its JSON text."""
    if isinstance(schema, dict):
        return json.dumps(schema)
    to_schema = getattr(schema, "model_json_schema", None)
    if callable(to_schema):
        return json.dumps(to_schema())
    raise ValueError(
        f"json_schema must be a JSON string, a dict or a pydantic model class, got {type(schema).__name__}"
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(lo: int) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        if not _is_int(v) or v < lo:
            kind = {0: "a non-negative integer", 1: "a positive integer"}.get(lo, f"an integer ≥ {lo}")
            raise ValueError(f"{name} must be {kind}, got {v!r}")

    return check


# the sampler divides logits by the temperature in float32: a larger one would be inf there
FLOAT32_MAX = 3.4028234663852886e38


def _range(lo: float, hi: float | None, lo_open: bool = False) -> Callable[[str, Any], None]:
    def check(name: str, v: Any) -> None:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # NaN fails
        ok = ok and (v > lo if lo_open else v >= lo) and (hi is None or v <= hi)
        if not ok:
            left = "(" if lo_open else "["
            bound = f"in {left}{lo}, {hi}]" if hi is not None else f"≥ {lo}"
            raise ValueError(f"{name} must be {bound}, got {v!r}")

    return check


def _seed(name: str, v: Any) -> None:
    # OpenAI takes any int64; unsigned 64-bit values too (torch's range), read modulo 2**64
    if not _is_int(v) or not -(2**63) <= v < 2**64:
        raise ValueError(f"{name} must be an integer in [-2**63, 2**64), got {v!r}")


def _top_k(name: str, v: Any) -> None:
    if not _is_int(v) or (v < 1 and v != -1):
        raise ValueError(f"{name} must be -1 (disabled) or a positive integer, got {v!r}")


def _bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be true or false, got {v!r}")


def _optional(check: Callable[[str, Any], None]) -> Callable[[str, Any], None]:
    return lambda name, v: None if v is None else check(name, v)


def _stop(name: str, v: Any) -> None:
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings")


def _stop_ids(name: str, v: Any) -> None:
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise ValueError(f"{name} must be non-negative integers")


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: ±100 bans or forces a token


def _logit_bias(name: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise ValueError(f"{name} must map token ids to biases")
    for token, bias in v.items():
        if not _is_int(token) or token < 0:
            raise ValueError(f"{name}: {token!r} is not a token id")
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not ok or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise ValueError(f"{name}[{token}] must be a number in [-100, 100], got {bias!r}")


def _text(name: str, v: Any) -> None:
    if not isinstance(v, str) or not v:
        raise ValueError(f"{name} must be a non-empty string")


def check_speculative_algorithm(name: str, v: Any) -> None:
    if v not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, SPECULATIVE_ALGORITHMS))}, got {v!r}")


def _draft_tokens(name: str, v: Any) -> None:
    if not _is_int(v) or not 1 <= v <= MAX_DRAFT_TOKENS:
        raise ValueError(f"{name} must be an integer in [1, {MAX_DRAFT_TOKENS}], got {v!r}")


def _schema(name: str, v: Any) -> None:
    if not isinstance(v, (str, dict)) and not callable(getattr(v, "model_json_schema", None)):
        raise ValueError(
            f"{name} must be a JSON string, a dict or a pydantic model class, got {type(v).__name__}"
        )


_CHECKS: dict[str, Callable[[str, Any], None]] = {
    "max_new_tokens": _int(0),
    "min_new_tokens": _int(0),
    "temperature": _range(0.0, FLOAT32_MAX),
    "top_p": _range(0.0, 1.0, lo_open=True),
    "top_k": _top_k,
    "min_p": _range(0.0, 1.0),
    "frequency_penalty": _range(-2.0, 2.0),
    "presence_penalty": _range(-2.0, 2.0),
    "repetition_penalty": _range(0.01, 2.0),
    "stop": _stop,
    "stop_token_ids": _stop_ids,
    "stop_regex": check_stop_regexes,
    "ignore_eos": _bool,
    "no_stop_trim": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "n": _int(1),
    "logit_bias": _logit_bias,
    "seed": _optional(_seed),
    "regex": _optional(_text),
    "json_schema": _optional(_schema),
    "json_schema_strict": _bool,
    "ebnf": _optional(_text),
    "speculative_algorithm": _optional(check_speculative_algorithm),
    "speculative_num_draft_tokens": _optional(_draft_tokens),
}
assert set(_CHECKS) == set(SAMPLING_KEYS), "every sampling key has exactly one check"
