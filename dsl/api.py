"""The expression constructors users call: gen, gen_int, gen_string, select, and the role
helpers (`user("...")`, `user_begin()`, ...). Names and arguments follow SGLang's frontend."""

from __future__ import annotations

from typing import Any

from radixlm.choices import ChoicesSamplingMethod
from radixlm.ir import Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, make_gen, make_select, to_expr


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
) -> Gen | Select:
    """Generate into variable `name`. With `choices`, this is `select`. `json_schema` may be
    a JSON string, a dict or a pydantic class (then `s[name]` is a validated instance)."""
    if choices is not None:
        return make_select(name, choices, temperature or 0.0, choices_method)
    options = dict(locals())
    for k in ("name", "dtype", "choices", "choices_method"):
        options.pop(k)
    return make_gen(name, options, dtype)


def _typed(name: str | None, dtype: type, options: dict[str, Any]) -> Gen:
    options.pop("name")
    return make_gen(name, options, dtype)


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> Gen:
    """Generate an integer (regex-constrained); `s[name]` is an int."""
    return _typed(name, int, dict(locals()))


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> Gen:
    """Generate a double-quoted string (regex-constrained); `s[name]` is the unquoted str."""
    return _typed(name, str, dict(locals()))


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod | None = None,
) -> Select:
    """Pick one of `choices` by scoring each one's tokens after the current text."""
    return make_select(name, choices, temperature, choices_method)


def _role(role: str, expr: Any) -> ExprList:
    inner = [] if expr is None else [to_expr(expr)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")
