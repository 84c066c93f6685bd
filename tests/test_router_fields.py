"""The bodies sglang-router 0.3.2 forwards (recorded from a real router in front of a recording
worker) parse, and every SGLang field has its stated fate: honoured, accepted without effect, or
refused with a reason. Model-level, so it runs where the router is not installed;
test_router.py runs the real router."""

from __future__ import annotations

import re

import pytest

from radixlm.backend.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixlm.backend.server.sglang_fields import INFORMATIONAL, REFUSED_FLAGS, REFUSED_VALUES

ROUTER_DEFAULTS = {
    "model": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}
GENERATE = {"text": "Hello", "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}, **ROUTER_DEFAULTS}
GENERATE_ALL = {
    **GENERATE,
    "input_ids": None,
    "text": "Hello",
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 2,
    "rid": "abc",
    "data_parallel_rank": 0,
    "conversation_id": "c",
    "priority": 1,
    "custom_labels": {"a": "b"},
}
CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": "spy",
    "logprobs": False,
    "max_completion_tokens": 8,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
COMPLETION = {
    "model": "spy",
    "prompt": "hi",
    "max_tokens": 8,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
    "sampling_seed": 4,
}


def test_router_bodies_parse_and_pass() -> None:
    for body in (GENERATE, GENERATE_ALL):
        req = GenerateRequest(**body)
        req.check_supported()
        assert req.sampling_params.to_engine() == {"temperature": 0.0, "max_new_tokens": 8}
    chat = ChatCompletionRequest(**CHAT)
    chat.check_supported()
    assert chat.sampling_params(chat.max_new_tokens())["max_new_tokens"] == 8
    completion = CompletionRequest(**COMPLETION)
    completion.check_supported()
    assert completion.sampling_params(8)["seed"] == 4  # sampling_seed is seed


@pytest.mark.parametrize("field", sorted(REFUSED_FLAGS))
def test_refused_flags_say_why(field: str) -> None:
    req = GenerateRequest(**{**GENERATE, field: True})
    with pytest.raises(ValueError, match=f"^{field}=true: " + re.escape(REFUSED_FLAGS[field])):
        req.check_supported()


@pytest.mark.parametrize("field", sorted(REFUSED_VALUES))
def test_refused_values_say_why(field: str) -> None:
    req = GenerateRequest(**{**GENERATE, field: "x"})
    with pytest.raises(ValueError, match=f"^{field}: "):
        req.check_supported()


def test_other_replica_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="one replica"):
        GenerateRequest(**{**GENERATE, "data_parallel_rank": 1}).check_supported()


def test_openai_refusals_and_seed_agreement() -> None:
    with pytest.raises(ValueError, match="return_hidden_states=true"):
        ChatCompletionRequest(**{**CHAT, "return_hidden_states": True}).check_supported()
    with pytest.raises(ValueError, match="LoRA"):
        CompletionRequest(**{**COMPLETION, "lora_path": "adapter"}).check_supported()
    with pytest.raises(ValueError, match="disagree"):
        CompletionRequest(**{**COMPLETION, "seed": 5}).sampling_params(8)
    assert CompletionRequest(**{**COMPLETION, "seed": 4}).sampling_params(8)["seed"] == 4


def test_continue_final_message_needs_an_assistant_turn() -> None:
    with pytest.raises(ValueError, match="last message"):
        ChatCompletionRequest(**{**CHAT, "continue_final_message": True})
    msgs = [*CHAT["messages"], {"role": "assistant", "content": "1, 2,"}]
    assert ChatCompletionRequest(**{**CHAT, "messages": msgs, "continue_final_message": True})


def test_informational_fields_exist_where_documented() -> None:
    generate_only = set(INFORMATIONAL) - {"stream_reasoning"}
    assert generate_only <= set(GenerateRequest.model_fields)
    assert "stream_reasoning" in ChatCompletionRequest.model_fields
    assert "bogus" not in GenerateRequest.model_fields
    with pytest.raises(ValueError, match="bogus"):
        GenerateRequest(**{**GENERATE, "bogus": 1})
