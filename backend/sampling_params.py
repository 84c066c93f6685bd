"""SamplingParams: SGLang's sampling keys, validated once at submission. Unknown keys and
out-of-range values raise ValueError naming the key, before any model work."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    regex: str | None = None
    json_schema: Any = None  # str (JSON), dict, or pydantic model class; normalised to str
    json_schema_strict: bool = True  # False: assertions the grammar cannot enforce are dropped and named
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SamplingParams | None) -> SamplingParams:
        if isinstance(d, SamplingParams):
            return d
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        d = {k: v for k, v in d.items() if v is not None or k in ("seed", "regex", "json_schema", "ebnf")}
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if isinstance(d.get("stop_token_ids"), int):
            d["stop_token_ids"] = [d["stop_token_ids"]]
        p = cls(**d)
        p.validate()
        return p

    def validate(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, 0)
        _check_int("min_new_tokens", self.min_new_tokens, 0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})"
            )
        _check_range("temperature", self.temperature, 0.0, None)
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.01, 2.0)
        _check_int("n", self.n, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        self._normalize_grammar()

    def _normalize_grammar(self) -> None:
        given = [k for k in ("regex", "json_schema", "ebnf") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"only one of regex / json_schema / ebnf per request, got {', '.join(given)}")
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            self.json_schema = schema_to_json_string(self.json_schema)
        for k in ("regex", "ebnf"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{k} must be a non-empty string")

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
        for k in ("regex", "json_schema", "ebnf"):
            v = getattr(self, k)
            if v is not None:
                return k, v
        return None


def schema_to_json_string(schema: Any) -> str:
    """A JSON-schema given as dict or pydantic model class → its JSON text."""
    if isinstance(schema, dict):
        return json.dumps(schema)
    to_schema = getattr(schema, "model_json_schema", None)
    if callable(to_schema):
        return json.dumps(to_schema())
    raise ValueError(f"json_schema must be a JSON string, a dict or a pydantic model class, got {type(schema).__name__}")


def _check_int(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an integer ≥ {lo}, got {v!r}")


def _check_range(name: str, v: Any, lo: float, hi: float | None) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)
    if not ok or v != v:  # NaN
        bound = f"[{lo}, {hi}]" if hi is not None else f"≥ {lo}"
        raise ValueError(f"{name} must be {bound}, got {v!r}")
