"""Model-free unit tests of the server's pure parts: tool-call schemas (checked with jsonschema
against hand-written valid and invalid calls), tool-call parsing, request models' rejections,
validation-error messages and the completions API's top_logprobs shape. The end-to-end behaviour is in test_server.py."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_grammar_cases import default_tokenizer

from radixlm.backend.server.app import _format_validation, _shutdown_engine
from radixlm.backend.server.body_text import body_problem, lone_surrogate_at
from radixlm.backend.server.native import CumulativeEvents
from radixlm.backend.server.openai_shapes import Tok
from radixlm.backend.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixlm.backend.server.streams import sse
from radixlm.backend.server.tools import plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object
MSGS = [{"role": "user", "content": "hi"}]


def _chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MSGS, tools=[WEATHER, TIME], **kw)


def _valid(schema: dict, value: object) -> bool:
    try:
        jsonschema.validate(value, schema)
        return True
    except jsonschema.ValidationError:
        return False


def test_tool_schemas_accept_exactly_well_formed_calls() -> None:
    single = plan_tools(_chat(tool_choice="required", parallel_tool_calls=False)).call_schema()
    assert _valid(single, {"name": "get_weather", "arguments": {"city": "Paris"}})
    assert _valid(single, {"name": "get_time", "arguments": {}})
    assert not _valid(single, {"name": "get_weather", "arguments": {}})  # missing required arg
    assert not _valid(single, {"name": "rm_rf", "arguments": {}})
    assert not _valid(single, {"name": "get_time", "arguments": {}, "extra": 1})

    many = plan_tools(_chat(tool_choice="required")).call_schema()
    assert _valid(
        many, [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "x"}}]
    )
    assert not _valid(many, [])

    named = plan_tools(_chat(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.call_schema() == WEATHER["function"]["parameters"]
    assert plan_tools(_chat(tool_choice="none")).mode == "none"
    assert plan_tools(_chat()).mode == "auto"


def test_tool_call_parsing() -> None:
    plan = plan_tools(_chat(tool_choice="required"))
    calls = plan.parse('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    with pytest.raises(ValueError, match="known tool"):
        plan.parse('{"name": "nope", "arguments": {}}')
    with pytest.raises(ValueError):
        plan.parse('{"name": "get_weather", "argu')  # cut off
    named = plan_tools(_chat(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.parse("{}")[0]["function"]["name"] == "get_time"


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "ghost"}}}, "unknown tool"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logit_bias": {"1": 101.0}}, r"logit_bias\[1\] must be a number in \[-100, 100\]"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias: 'a' is not a token id"),
        ({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
    ],
)
def test_chat_request_rejections(kwargs: dict, reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        _chat(**kwargs)


def test_tools_do_not_mix_with_other_constraints() -> None:
    fmt = {"type": "json_object"}
    with pytest.raises(ValueError, match="response_format"):
        plan_tools(_chat(response_format=fmt))
    with pytest.raises(ValueError, match="regex"):
        plan_tools(_chat(regex="a+"))
    assert ChatCompletionRequest(messages=MSGS, response_format=fmt).sampling_params(8)["json_schema"] == {
        "type": "object"
    }


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_broken_tool_schema_is_refused_in_every_mode(choice: str) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    req = ChatCompletionRequest(messages=MSGS, tools=[WEATHER, broken], tool_choice=choice)
    with pytest.raises(ValueError, match=r"tools\[1\]\.function\.parameters: .*unknown type 'nonsense'"):
        plan_tools(req)


def test_request_shapes() -> None:
    assert GenerateRequest(text=["a", "b"]).is_batch and not GenerateRequest(text="a").is_batch
    assert GenerateRequest(input_ids=[[1], [2, 3]]).prompts() == [{"input_ids": [1]}, {"input_ids": [2, 3]}]
    assert CompletionRequest(prompt=[5, 6]).prompts() == [{"input_ids": [5, 6]}]
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest()
    with pytest.raises(ValidationError, match="suffix"):
        CompletionRequest(prompt="a", suffix="b")


def _message(body: dict) -> tuple[bool, str]:
    try:
        GenerateRequest(**body)
    except ValidationError as e:
        errors = [{**x, "loc": ("body", *x["loc"])} for x in e.errors()]
        return _format_validation(RequestValidationError(errors))
    raise AssertionError("expected a validation error")


def test_validation_messages_name_the_field_without_union_noise() -> None:
    fields, msg = _message({"text": "a", "sampling_params": {"max_new_tokenz": 1}})
    assert fields and msg == "invalid request: sampling_params.max_new_tokenz: unknown field"
    fields, msg = _message({"text": "a", "sampling_params": [{"top_p": 2}]})
    assert fields and msg.startswith("invalid request: sampling_params.0.top_p:")
    assert "list" not in msg.split(":", 2)[1]


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(
        st.tuples(st.text(max_size=6), st.lists(st.integers(0, 200_000), max_size=3)), min_size=1, max_size=8
    ),
    index=st.one_of(st.none(), st.integers(0, 7)),
    logprobs=st.booleans(),
)
def test_stream_events_encoded_incrementally_equal_whole_event_json(
    chunks: list[tuple[str, list[int]]], index: int | None, logprobs: bool
) -> None:
    """Each incrementally encoded event is byte for byte json.dumps of the cumulative event
    (text with quotes, backslashes, control and non-ASCII characters split anywhere); from the
    engine's per-chunk logprob entries it carries the whole list so far and its length."""
    events = CumulativeEvents(index, with_text=False, tokenizer=None)
    text, ids = "", []
    for delta, new_ids in chunks:
        meta: dict[str, object] = {"completion_tokens": len(ids) + len(new_ids), "finish_reason": None}
        chunk_meta = dict(meta)
        if logprobs:
            chunk_meta["output_token_logprobs"] = [[-0.5 * t, t, None] for t in new_ids]
            chunk_meta["output_token_logprobs_length"] = len(ids) + len(new_ids)
        events.add({"text": delta, "output_ids": new_ids, "meta_info": chunk_meta})
        text, ids = text + delta, ids + new_ids
        if logprobs:
            meta["output_token_logprobs"] = [[-0.5 * t, t, None] for t in ids]
            meta["output_token_logprobs_length"] = len(ids)
        whole: dict[str, object] = {"text": text, "output_ids": ids, "meta_info": meta}
        if index is not None:
            whole["index"] = index
        got = events.event()
        assert got == sse(whole)
        assert json.loads(got[len(b"data: ") :]) == whole


@pytest.mark.parametrize(
    "body,where",
    [
        (rb'{"prompt": "hi \ud800"}', "prompt"),
        (rb'{"messages": [{"content": "x"}, {"content": "\uDFFF tail"}]}', "messages[1].content"),
        (rb'{"stop": ["\ud83d\ude00", "\ude00"]}', "stop[1]"),  # a pair, then its low half alone
        (rb'{"a\udc00": 1}', "a\\udc00"),  # the key itself
        (rb'"\ud800"', "body"),
        (rb'{"ok": "\ud83d\ude00 \u00e9"}', None),  # a valid pair and a plain escape
        (rb'{"prompt": "plain"}', None),
        (rb'{"prompt": "\ud800', None),  # not JSON: the app's own 400 says so
    ],
)
def test_lone_surrogates_are_found_with_their_field(body: bytes, where: str | None) -> None:
    assert lone_surrogate_at(body) == where


def test_bodies_python_reads_but_cannot_serve_are_named() -> None:
    encoded = b'{"prompt": "hi \xed\xa0\x80"}'  # a surrogate in UTF-8 form: json.loads takes it
    assert "\ud800" in json.loads(encoded)["prompt"]
    assert "not valid UTF-8" in (body_problem(encoded) or "")
    assert "surrogate" in (body_problem(rb'{"prompt": "\ud800"}') or "")
    assert body_problem('{"prompt": "caf\u00e9 \u00e9"}'.encode()) is None
    deep = b'{"p": "\\ud800", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"  # too deep to parse: the app's 400
    assert body_problem(deep) is None


def test_server_exit_shuts_the_engine_down_even_when_the_flush_fails() -> None:
    class Engine:
        stopped = False

        def flush_cache(self) -> bool:
            raise RuntimeError("reset while 3 cached tokens are locked")

        def shutdown(self) -> None:
            self.stopped = True

    engine = Engine()
    _shutdown_engine(engine)
    assert engine.stopped


def test_completion_top_logprobs_always_hold_the_chosen_token() -> None:
    tok = Tok(default_tokenizer())
    a, b, c = (tok.tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Hello", " world", "!"))
    entries = [(None, a), (-0.5, b), (-3.0, c), (-0.1, a)]  # a prompt's first token has no logprob
    tops = [None, [(-0.5, b), (-1.0, a)], [(-0.2, a), (-0.9, b)], None]  # "!" was sampled, not a top one
    got = tok.completion_logprobs(entries, tops, 0)["top_logprobs"]
    assert got[0] is None
    assert got[1] == {tok.text(b): -0.5, tok.text(a): -1.0}  # chosen among the top: no extra entry
    assert got[2] == {tok.text(a): -0.2, tok.text(b): -0.9, tok.text(c): -3.0}  # logprobs + 1 entries
    assert got[3] == {tok.text(a): -0.1}  # logprobs=0: the chosen token alone
