"""OpenAI request fields that common clients send, through the official `openai` client (extra_body)
against real uvicorn on 127.0.0.1: honoured ones take effect (chat_template_kwargs, guided_*,
structured_outputs, tool `strict`, `user` in the access log), informational ones are accepted,
known unsupported ones are refused with their reason. Also the formerly ignored program options."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import jsonschema
import openai
import pytest

import radixlm as sgl
from radixlm.backend.server import ServerThread, create_app
from radixlm.backend.server.runner import Runner, ServerLimits

MSG = [{"role": "user", "content": "Reply with a short answer: is the sky blue?"}]
# Appended to the model's own template: renders only when the kwarg reaches the template.
KWARG_TAIL = "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"


@pytest.fixture(scope="module")
def client(engine) -> Iterator[openai.OpenAI]:
    tok = engine.tokenizer
    original = tok.chat_template
    tok.chat_template = original + KWARG_TAIL
    thread = ServerThread(create_app(engine), drain_timeout_s=2.0).start()
    try:
        yield openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        thread.stop()
        tok.chat_template = original


def chat(client: openai.OpenAI, **kw: object) -> object:
    return client.chat.completions.create(
        model="m", messages=MSG, max_tokens=kw.pop("max_tokens", 8), temperature=0, **kw
    )


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI) -> None:
    plain = chat(client, max_tokens=1)
    off = chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    on = chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens == on.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="may not set"):
        chat(client, extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})


def test_guided_json_and_structured_outputs_constrain(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = chat(client, max_tokens=40, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    picks = chat(client, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert picks.choices[0].message.content in ("yes", "no")
    digits = client.completions.create(
        model="m", prompt="Number:", max_tokens=6, temperature=0, extra_body={"guided_regex": "[0-9]{3}"}
    )
    assert len(digits.choices[0].text) == 3 and digits.choices[0].text.isdigit()
    with pytest.raises(openai.BadRequestError, match="one constraint"):
        chat(client, extra_body={"guided_regex": "a", "guided_choice": ["b"]})


def test_informational_fields_are_accepted_and_user_is_logged(
    client: openai.OpenAI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixlm.server.access")
    out = chat(
        client,
        metadata={"team": "a"},
        store=False,
        service_tier="auto",
        reasoning_effort="low",
        user="user-42",
        extra_body={"separate_reasoning": True, "prompt_cache_key": "k"},
    )
    assert out.choices[0].message.content is not None
    lines = [r.getMessage() for r in caplog.records if r.name == "radixlm.server.access"]
    assert any("/v1/chat/completions 200" in x and "user='user-42'" in x for x in lines), lines


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("modalities", ["text", "audio"], "only text output"),
        ("functions", [{"name": "f"}], "use `tools`"),
        ("prediction", {"type": "content", "content": "x"}, "predicted outputs"),
        ("no_such_option", 1, "unknown field"),
    ],
)
def test_unsupported_fields_are_refused_with_reason(
    client: openai.OpenAI, field: str, value: object, reason: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=reason):
        chat(client, extra_body={field: value})


def test_tool_strict_takes_effect(client: openai.OpenAI) -> None:
    tags = {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2, "uniqueItems": True}

    def call(tags_schema: dict, strict: bool) -> object:
        params = {
            "type": "object",
            "properties": {"tags": tags_schema},
            "required": ["tags"],
            "additionalProperties": False,  # an open object lets the small model add properties past max_tokens
        }
        tool = {"type": "function", "function": {"name": "tag", "parameters": params, "strict": strict}}
        return chat(
            client, max_tokens=40, tools=[tool], tool_choice={"type": "function", "function": {"name": "tag"}}
        )

    remote = {**tags, "allOf": [{"$ref": "https://example.com/tags.json"}]}
    with pytest.raises(openai.BadRequestError, match="external reference"):
        call(remote, strict=True)  # no grammar or check can hold a reference to another document
    relaxed = call(remote, strict=False)  # non-strict drops it and still constrains the rest
    assert relaxed.choices[0].message.tool_calls[0].function.name == "tag"
    checked = call(tags, strict=True)  # uniqueItems: held by a value check in strict mode
    if checked.choices[0].finish_reason == "tool_calls":
        args = json.loads(checked.choices[0].message.tool_calls[0].function.arguments)
        assert len(set(args["tags"])) == len(args["tags"]), args


def test_chat_without_max_tokens_runs_to_the_end_of_the_context() -> None:
    """As vLLM and SGLang serve it: no max_tokens is the rest of the context (here bounded by a
    server limit above the engine's own default of 128, so the run stays short), not 128; for
    /v1/completions an explicit null is, and an absent max_tokens is OpenAI's 16."""
    from radixlm.backend.engine import Engine

    limit = 150
    engine = Engine(max_total_tokens=2048, quantization="gguf")  # its GGUF weights: a fast CPU decode
    thread = ServerThread(create_app(engine, limits=ServerLimits(max_new_tokens=limit)), drain_timeout_s=2.0)
    thread.start()
    try:
        oai = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = oai.chat.completions.create(
            model="m", messages=MSG, temperature=0, extra_body={"ignore_eos": True}
        )
        assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (limit, "length")
        params = {
            "model": "m",
            "prompt": "Once upon a time",
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        null = oai.completions.create(max_tokens=None, **params)  # /v1/completions: null is the rest too
        assert (null.usage.completion_tokens, null.choices[0].finish_reason) == (limit, "length")
        assert oai.completions.create(**params).usage.completion_tokens == 16  # absent: OpenAI's 16
        with pytest.raises(openai.BadRequestError, match=r"max_tokens .*exceeds the limit 150"):
            oai.chat.completions.create(model="m", messages=MSG, max_tokens=limit + 1)  # named as sent
    finally:
        thread.stop()
        engine.shutdown()
    runner = Runner.__new__(Runner)  # the arithmetic alone: context 1,000, with and without a limit
    runner.context_len, runner.limits = 1000, ServerLimits()
    assert [runner.rest_of_context(n) for n in (0, 900, 999, 1000)] == [1000, 100, 1, 1]
    runner.limits = ServerLimits(max_new_tokens=50)
    assert [runner.rest_of_context(n) for n in (900, 980)] == [50, 20]
    runner.context_len = None
    assert runner.rest_of_context(10) == 50
    runner.limits = ServerLimits()
    assert runner.rest_of_context(10) is None


def test_formerly_ignored_program_options_are_refused() -> None:
    with pytest.raises(ValueError, match="select\\(temperature=0.7\\) is not supported"):
        sgl.select("x", choices=["a", "b"], temperature=0.7)
    with pytest.raises(ValueError, match="is not supported"):
        sgl.gen("x", choices=["a", "b"], temperature=0.5)
    assert sgl.select("x", choices=["a", "b"], temperature=0).temperature == 0.0

    def prog(s):
        s += "x"

    with pytest.raises(ValueError, match="num_api_spec_tokens"):
        sgl.function(num_api_spec_tokens=64)(prog)
