"""/v1/chat/completions pieces: the engine sequences of a request, each choice's events (text
deltas, tool calls generated under the call schema, the finish), the per-choice accumulator, and
the SSE event stream; the route itself is in openai_api.py."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from .openai_shapes import Tok, choice_rid, finish_reason, grammar_report, sample_params, usage
from .protocol import ChatCompletionRequest, now
from .runner import Runner, Seq, run_to_end
from .streams import SSE_DONE, merge_streams, sse, stream_error_event
from .tools import TOOL_CALL_TAG, ToolPlan, chat_prompt_ids, plan_tools


class Count(NamedTuple):
    """A choice's completion tokens so far and its prompt tokens read from the cache."""

    tokens: int
    cached: int


# One chat choice's events: ("delta", text, logprob entries | None, Count), ("tool_calls", calls,
# the call's logprob entries | None, Count), ("finish", reason, Count, grammar report | None).
# Logprobs cover every generated token, the call's too (as vLLM's do).
Entries = list[dict[str, Any]] | None
ChoiceEvent = (
    tuple[Literal["delta"], str, Entries, Count]
    | tuple[Literal["tool_calls"], list[dict[str, Any]], Entries, Count]
    | tuple[Literal["finish"], str, Count, dict[str, Any] | None]
)


@dataclass
class ChatCtx:
    """What every choice of one chat request shares."""

    req: ChatCompletionRequest
    plan: ToolPlan
    prompt_ids: list[int]
    base_sp: dict[str, Any]
    tok: Tok


def prepare_chat(runner: Runner, tok: Tok, req: ChatCompletionRequest) -> tuple[ChatCtx, list[Seq]]:
    """A chat request's context and engine sequences, checked and reserved on the runner (the
    caller releases them). No max tokens: the rest of the context."""
    plan = plan_tools(req)
    prompt_ids = chat_prompt_ids(tok.tokenizer, req, plan)
    max_new = req.max_new_tokens()
    if max_new is None:
        max_new = runner.rest_of_context(len(prompt_ids))
    ctx = ChatCtx(req, plan, prompt_ids, req.sampling_params(max_new), tok)
    seqs = chat_seqs(ctx)
    runner.check(seqs)
    runner.reserve(seqs)
    return ctx, seqs


def chat_seqs(ctx: ChatCtx) -> list[Seq]:
    req, plan = ctx.req, ctx.plan
    sp = dict(ctx.base_sp)
    if plan.mode in ("named", "required"):
        sp["json_schema"] = plan.call_schema()
        sp["json_schema_strict"] = plan.strict
    elif plan.mode == "auto":
        stops = sp.get("stop") or []
        sp["stop"] = ([stops] if isinstance(stops, str) else list(stops)) + [TOOL_CALL_TAG]
    return [
        Seq(
            prompt={"input_ids": ctx.prompt_ids},
            sampling_params=sample_params(sp, j, req.n),
            rid=choice_rid(req.rid, j, req.n),
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            index=j,
        )
        for j in range(req.n)
    ]


async def choice_events(
    runner: Runner, ctx: ChatCtx, seq: Seq, stream: bool
) -> AsyncGenerator[ChoiceEvent, None]:
    """Events of one chat choice (ChoiceEvent): deltas or the tool calls, then the finish."""
    plan = ctx.plan
    constrained = plan.mode in ("named", "required")
    text, meta, call_entries = "", {}, None
    async for chunk in runner.run(seq, stream=stream and not constrained):
        meta = chunk.get("meta_info", {})
        piece = chunk.get("text", "")
        text += piece
        entries = ctx.tok.chat_entries(meta) if seq.return_logprob else None
        if constrained:
            call_entries = entries  # one chunk: the run is not streamed
        elif piece or entries:
            yield ("delta", piece, entries, _count(meta))
    reason = finish_reason(meta) or "abort"
    tokens, cached = _count(meta)
    called = plan.mode == "auto" and _matched_tag(meta, text)
    tag_shown = text.endswith(TOOL_CALL_TAG)  # in the deltas already: the length cut fell after it
    if called:
        text, reason, more, call_entries = await _run_call(runner, ctx, seq, text, tokens)
        tokens += more
    count = Count(tokens, cached)
    if constrained or called:
        calls, reason = _tool_calls(plan, text, reason)
        if calls:
            yield ("tool_calls", calls, call_entries, count)
        else:  # cut off (length/abort): show what was generated, as text
            text = text if constrained or tag_shown else TOOL_CALL_TAG + text
            yield ("delta", text, call_entries, count)
    yield ("finish", reason, count, grammar_report(meta))


def _count(meta: dict[str, Any]) -> Count:
    return Count(int(meta.get("completion_tokens", 0)), int(meta.get("cached_tokens", 0)))


async def _run_call(
    runner: Runner, ctx: ChatCtx, seq: Seq, before: str, used: int
) -> tuple[str, str, int, Entries]:
    """Auto mode after the model wrote the tag: generate the call JSON under the call schema,
    within what the request's max_tokens leaves after the `used` tokens before the tag; returns
    (text, finish reason, tokens, logprob entries when the request asked for them)."""
    content = before.removesuffix(TOOL_CALL_TAG) + TOOL_CALL_TAG
    ids = ctx.prompt_ids + ctx.tok.tokenizer.encode(content, add_special_tokens=False)
    sp = {k: v for k, v in seq.sampling_params.items() if k not in ("stop", "stop_regex")}
    budget = sp.get("max_new_tokens")
    if budget is not None:
        if budget <= used:
            return "", "length", 0, None
        sp["max_new_tokens"] = budget - used
    if sp.get("min_new_tokens"):
        sp["min_new_tokens"] = max(sp["min_new_tokens"] - used, 0)
    sp["json_schema"] = ctx.plan.call_schema()
    sp["json_schema_strict"] = ctx.plan.strict
    call = Seq(
        prompt={"input_ids": ids},
        sampling_params=sp,
        index=seq.index,
        return_logprob=seq.return_logprob,
        top_logprobs_num=seq.top_logprobs_num,
    )
    runner.reserve([call])
    out = await run_to_end(runner, call)
    meta = out.get("meta_info", {})
    entries = ctx.tok.chat_entries(meta) if seq.return_logprob else None
    return out.get("text", ""), finish_reason(meta) or "abort", int(meta.get("completion_tokens", 0)), entries


def _matched_tag(meta: dict[str, Any], text: str) -> bool:
    fr = meta.get("finish_reason")
    return (isinstance(fr, dict) and fr.get("matched") == TOOL_CALL_TAG) or text.endswith(TOOL_CALL_TAG)


def _tool_calls(plan: ToolPlan, text: str, reason: str) -> tuple[list[dict[str, Any]], str]:
    """Constrained output → tool calls; a cut-off (length/abort) output stays plain text."""
    if reason != "stop":
        return [], reason
    try:
        return plan.parse(text), "tool_calls"
    except ValueError:
        return [], reason


@dataclass
class ChatChoice:
    index: int
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None
    finish: str | None = None
    tokens: int = 0
    cached: int = 0
    grammar: dict[str, Any] | None = None

    def add(self, event: ChoiceEvent) -> dict[str, Any]:
        """Fold an event in; return the streaming delta fragment for it."""
        if event[0] == "finish":
            self.finish, (self.tokens, self.cached), self.grammar = event[1], event[2], event[3]
            return self._with_report(
                {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": event[1]}
            )
        self.tokens, self.cached = event[3]
        if event[0] == "delta":
            self.content += event[1]
            if event[2] is not None:
                self.logprobs = (self.logprobs or []) + event[2]
            lp = {"content": event[2]} if event[2] is not None else None
            return {
                "index": self.index,
                "delta": {"content": event[1]},
                "logprobs": lp,
                "finish_reason": None,
            }
        self.tool_calls = event[1]
        if event[2] is not None:
            self.logprobs = (self.logprobs or []) + event[2]
        calls = [{"index": k, **c} for k, c in enumerate(event[1])]
        return {
            "index": self.index,
            "delta": {"tool_calls": calls},
            "logprobs": {"content": event[2]} if event[2] is not None else None,
            "finish_reason": None,
        }

    def _with_report(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**choice, "radixlm": self.grammar} if self.grammar else choice

    def message(self) -> dict[str, Any]:
        # text the model wrote before a call stays (as the stream sends it); none is null, as OpenAI's
        content = (self.content or None) if self.tool_calls else self.content
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return self._with_report(
            {
                "index": self.index,
                "message": msg,
                "logprobs": {"content": self.logprobs} if self.logprobs is not None else None,
                "finish_reason": self.finish,
            }
        )


def chat_usage(ctx: ChatCtx, choices: list[ChatChoice]) -> dict[str, Any]:
    return usage(
        len(ctx.prompt_ids), sum(c.tokens for c in choices), max((c.cached for c in choices), default=0)
    )


async def collect_choice(runner: Runner, ctx: ChatCtx, seq: Seq) -> ChatChoice:
    choice = ChatChoice(seq.index)
    async for event in choice_events(runner, ctx, seq, stream=False):
        choice.add(event)
    return choice


def _role_delta(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }


async def chat_stream(
    runner: Runner, ctx: ChatCtx, seqs: list[Seq], rid: str, model: str
) -> AsyncGenerator[bytes, None]:
    """The role chunks wait for the engine's first event, so an error in starting the requests
    propagates before anything is sent (sse_response makes it the HTTP status)."""
    head = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model}
    choices = [ChatChoice(s.index) for s in seqs]
    events = merge_streams([choice_events(runner, ctx, s, True) for s in seqs])
    opts = ctx.req.stream_options
    continuous = opts is not None and opts.continuous_usage_stats

    def chunk(c: ChatChoice, fragment: dict[str, Any]) -> bytes:
        if continuous:  # the choice's own counts so far, as SGLang and vLLM send them
            return sse({**head, "choices": [fragment], "usage": chat_usage(ctx, [c])})
        return sse({**head, "choices": [fragment]})

    started = False
    try:
        first = await anext(events, None)
        started = True
        for c in choices:
            yield chunk(c, _role_delta(c.index))
        if first is not None:
            yield chunk(choices[first[0]], choices[first[0]].add(first[1]))
            async for i, event in events:
                yield chunk(choices[i], choices[i].add(event))
        if opts and opts.include_usage:
            yield sse({**head, "choices": [], "usage": chat_usage(ctx, choices)})
    except Exception as exc:  # noqa: BLE001 - the stream ends with it as an error event
        if not started:
            raise
        yield stream_error_event(exc)
    finally:
        await events.aclose()
        runner.release_all(seqs)
    yield SSE_DONE
