"""OpenAI: the program backend for any OpenAI-compatible server through the official
`openai` client. Chat mode sends the state's messages; completion mode sends its text.
Promise: what such servers cannot do (regex; select and continuing a partial assistant turn
in chat mode) fails at once with a ValueError that says so, never silently."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from radixlm.backend.sampling_params import FRONTEND_NAMES
from radixlm.backend_base import GenOutput, ProgramBackend, ProgramView
from radixlm.chat_template import ChatTemplate, PlainChatTemplate
from radixlm.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    LogprobEntry,
    call_method,
    needs_unconditional,
)

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

# Engine sampling keys under their OpenAI names (radixlm.backend.sampling_params.FRONTEND_NAMES):
# the OpenAI API's own ones, and those that servers such as radixlm, SGLang and vLLM take in the body.
_DIRECT = {
    k: FRONTEND_NAMES.get(k, k)
    for k in ("max_new_tokens", "stop", "temperature", "top_p", "frequency_penalty", "presence_penalty")
}
_EXTRA = {
    k: FRONTEND_NAMES.get(k, k)
    for k in ("top_k", "min_p", "min_new_tokens", "ignore_eos", "stop_token_ids", "repetition_penalty")
}


class OpenAI(ProgramBackend):
    """`OpenAI(model, base_url=..., api_key=..., is_chat_model=True)`."""

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        is_chat_model: bool = True,
        chat_template: ChatTemplate | None = None,
        **client_kwargs: Any,
    ) -> None:
        import openai

        self.model = model
        self.is_chat_model = is_chat_model
        self.client = openai.OpenAI(
            base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY", **client_kwargs
        )
        self.tokenizer = None
        self._template = chat_template or PlainChatTemplate()

    def _kwargs(self, sampling: dict[str, Any], logprob: dict[str, Any]) -> dict[str, Any]:
        if "regex" in sampling:
            raise ValueError(
                "regex is not supported by the OpenAI backend (the OpenAI API has no regex "
                "constraint); use radixlm.Runtime or radixlm.RuntimeEndpoint"
            )
        if logprob.get("return_logprob"):
            raise ValueError("return_logprob is not supported by the OpenAI backend")
        unknown = set(sampling) - set(_DIRECT) - set(_EXTRA) - {"json_schema"}
        if unknown:
            raise ValueError(f"the OpenAI backend cannot send sampling option(s) {sorted(unknown)}")
        kw: dict[str, Any] = {_DIRECT[k]: v for k, v in sampling.items() if k in _DIRECT}
        extra = {_EXTRA[k]: v for k, v in sampling.items() if k in _EXTRA}
        if extra:
            kw["extra_body"] = extra
        if "json_schema" in sampling:
            if not self.is_chat_model:
                raise ValueError("json_schema needs chat mode on the OpenAI backend (response_format)")
            kw["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(sampling["json_schema"])},
            }
        return kw

    def _messages(self, ex: ProgramView) -> list[ChatCompletionMessageParam]:
        if ex.cur_role != "assistant":
            raise ValueError(
                "the OpenAI chat backend generates whole assistant messages: put gen inside "
                "an assistant role (s += assistant(gen(...)))"
            )
        if ex.text_[ex.cur_role_begin_pos :]:
            raise ValueError(
                "the OpenAI chat backend cannot continue a partial assistant message: gen must "
                "come first in the assistant role"
            )
        return cast("list[ChatCompletionMessageParam]", list(ex.messages_))

    def generate(self, ex: ProgramView, sampling: dict[str, Any], logprob: dict[str, Any]) -> GenOutput:
        kw = self._kwargs(sampling, logprob)
        if self.is_chat_model:
            resp = self.client.chat.completions.create(model=self.model, messages=self._messages(ex), **kw)
            choice = resp.choices[0]
            text = choice.message.content or ""
        else:
            resp = self.client.completions.create(model=self.model, prompt=ex.text_, **kw)
            choice = resp.choices[0]
            text = choice.text
        usage = resp.usage
        meta = {
            "prompt_tokens": getattr(usage, "prompt_tokens", None),
            "completion_tokens": getattr(usage, "completion_tokens", None),
            "finish_reason": choice.finish_reason,
        }
        return GenOutput(text, None, meta)

    def generate_stream(
        self, ex: ProgramView, sampling: dict[str, Any], logprob: dict[str, Any]
    ) -> Iterator[GenOutput]:
        kw = self._kwargs(sampling, logprob)
        if self.is_chat_model:
            chat = self.client.chat.completions.create(
                model=self.model, messages=self._messages(ex), stream=True, **kw
            )
            for chunk in chat:
                if chunk.choices:
                    c = chunk.choices[0]
                    yield GenOutput(c.delta.content or "", None, {"finish_reason": c.finish_reason})
            return
        for part in self.client.completions.create(model=self.model, prompt=ex.text_, stream=True, **kw):
            if part.choices:
                choice = part.choices[0]
                yield GenOutput(choice.text or "", None, {"finish_reason": choice.finish_reason})

    def select(
        self, ex: ProgramView, choices: list[str], temperature: float, method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        """Completion mode: score `text + choice` with echo=True, max_tokens=0 and keep the
        logprobs of the tokens that cover the choice. The server tokenizes text, so (as in
        SGLang) a token may straddle the boundary; the token-keeping backends avoid that."""
        if self.is_chat_model:
            raise ValueError(
                "select / gen(choices=...) is not supported by the OpenAI backend in chat mode: "
                "chat servers cannot score given continuations; use is_chat_model=False on a "
                "completions server, or radixlm.Runtime / RuntimeEndpoint"
            )
        prefix = ex.text_
        if not prefix:
            raise ValueError("select needs some text before it to condition on")
        cond = self._echo_logprobs([prefix + c for c in choices], len(prefix))
        uncond = self._echo_logprobs(list(choices), 0) if needs_unconditional(method) else None
        return call_method(method, choices, cond, uncond)

    def _echo_logprobs(self, prompts: list[str], start: int) -> list[list[LogprobEntry]]:
        resp = self.client.completions.create(
            model=self.model, prompt=prompts, max_tokens=0, echo=True, logprobs=0, temperature=0
        )
        out: list[list[LogprobEntry]] = []
        for choice in sorted(resp.choices, key=lambda c: c.index):
            lp = choice.logprobs
            if lp is None or not lp.tokens or lp.token_logprobs is None or lp.text_offset is None:
                raise ValueError(
                    "the server returned no prompt logprobs for echo=True; select is not supported"
                )
            ends = list(lp.text_offset[1:]) + [len(prompts[choice.index])]
            out.append([(p, None, t) for t, p, end in zip(lp.tokens, lp.token_logprobs, ends) if end > start])
        return out
