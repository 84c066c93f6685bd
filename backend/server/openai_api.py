"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (n, stop,
logprobs, echo, streaming deltas with an optional usage chunk, response_format, tools and
tool_choice via tools.py). Every choice is its own engine request, so any of them can be
aborted alone; shapes follow the OpenAI API reference."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
)
from .runner import Runner, Seq, run_to_end
from .streams import (
    SSE_DONE,
    gather_all,
    merge_streams,
    sse,
    sse_response,
    until_disconnect,
)
from .tools import TOOL_CALL_TAG, ToolPlan, chat_prompt_ids, plan_tools


def finish_reason(meta: dict[str, Any]) -> str | None:
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    return str(fr.get("type")) if isinstance(fr, dict) else str(fr)


def _sample_params(base: dict[str, Any], j: int, n: int) -> dict[str, Any]:
    sp = dict(base)
    if n > 1 and "seed" in sp:
        sp["seed"] = sp["seed"] + j
    return sp


def _rid(req_rid: str | None, k: int, total: int) -> str:
    if req_rid is None:
        return uuid.uuid4().hex
    return req_rid if total == 1 else f"{req_rid}-{k}"


# ---------------------------------------------------------------- logprob shapes


class _Tok:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def chat_entries(self, meta: dict[str, Any]) -> list[dict[str, Any]]:
        lps = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or [None] * len(lps)
        return [{**self._entry(e), "top_logprobs": [self._entry(t) for t in (top or [])]}
                for e, top in zip(lps, tops)]

    def _entry(self, e: Any) -> dict[str, Any]:
        tok = self.text(e[1])
        return {"token": tok, "logprob": e[0], "bytes": list(tok.encode("utf-8"))}

    def completion_logprobs(self, entries: list[Any], tops: list[Any], offset: int) -> dict[str, Any]:
        tokens = [self.text(e[1]) for e in entries]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        top_dicts = [None if row is None else {self.text(t[1]): t[0] for t in row} for row in tops]
        return {"tokens": tokens, "token_logprobs": [e[0] for e in entries],
                "top_logprobs": top_dicts, "text_offset": offsets}


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---------------------------------------------------------------- completions


def _completion_seqs(req: CompletionRequest) -> list[Seq]:
    prompts = req.prompts()
    sp = req.sampling_params(req.max_tokens)
    seqs = []
    for p in prompts:
        for j in range(req.n):
            k = len(seqs)
            seqs.append(Seq(prompt=p, sampling_params=_sample_params(sp, j, req.n),
                            rid=_rid(req.rid, k, len(prompts) * req.n),
                            return_logprob=req.logprobs is not None,
                            logprob_start_len=0 if req.echo else -1,
                            top_logprobs_num=req.logprobs or 0, index=k))
    return seqs


@dataclass
class _CompletionChoice:
    """Accumulates one completion choice from chunks (streamed or whole)."""

    seq: Seq
    echo_text: str
    tok: _Tok
    want_logprobs: bool
    text: str = ""
    offset: int = 0
    echoed: bool = False
    meta: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """Fold a chunk in; return this chunk's OpenAI choice fragment."""
        meta = chunk.get("meta_info", {})
        self.meta = {**(self.meta or {}), **meta}
        piece = chunk.get("text", "")
        entries, tops = [], []
        if not self.echoed:
            self.echoed = True
            piece = self.echo_text + piece
            entries = list(meta.get("input_token_logprobs") or [])
            tops = list(meta.get("input_top_logprobs") or [None] * len(entries))
        out_entries = list(meta.get("output_token_logprobs") or [])
        entries += out_entries
        tops += list(meta.get("output_top_logprobs") or [None] * len(out_entries))
        logprobs = None
        if self.want_logprobs:
            logprobs = self.tok.completion_logprobs(entries, tops, self.offset)
        self.offset += len(piece)
        self.text += piece
        return {"index": self.seq.index, "text": piece, "logprobs": logprobs,
                "finish_reason": finish_reason(meta)}


def _completion_choices(req: CompletionRequest, seqs: list[Seq], tok: _Tok) -> list[_CompletionChoice]:
    choices = []
    for s in seqs:
        echo = ""
        if req.echo:
            echo = s.prompt["text"] if "text" in s.prompt else tok.tokenizer.decode(s.prompt["input_ids"])
        choices.append(_CompletionChoice(s, echo, tok, req.logprobs is not None))
    return choices


def _prompt_usage(choices: list[Any], n: int) -> tuple[int, int, int]:
    metas = [c.meta or {} for c in choices]
    prompt = sum(int(m.get("prompt_tokens", 0)) for m in metas[::n])
    cached = sum(int(m.get("cached_tokens", 0)) for m in metas[::n])
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas)
    return prompt, completion, cached


async def _completion_events(runner: Runner, req: CompletionRequest, seqs: list[Seq],
                             choices: list[_CompletionChoice], rid: str, model: str) -> AsyncIterator[bytes]:
    head = {"id": rid, "object": "text_completion", "created": now(), "model": model}
    try:
        async for i, chunk in merge_streams([runner.run(s, stream=True) for s in seqs]):
            fragment = choices[i].add(chunk)
            if fragment["text"] or fragment["finish_reason"] or fragment["logprobs"]:
                yield sse({**head, "choices": [fragment]})
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(*_prompt_usage(choices, req.n))})
    except ValueError as exc:
        yield sse(error_body(str(exc), 400))
    finally:
        runner.release_all(seqs)
    yield SSE_DONE


# ---------------------------------------------------------------- chat


@dataclass
class _ChatCtx:
    req: ChatCompletionRequest
    plan: ToolPlan
    prompt_ids: list[int]
    base_sp: dict[str, Any]
    tok: _Tok


def _chat_seqs(ctx: _ChatCtx) -> list[Seq]:
    req, plan = ctx.req, ctx.plan
    sp = dict(ctx.base_sp)
    if plan.mode in ("named", "required"):
        sp["json_schema"] = plan.call_schema()
        sp["json_schema_strict"] = plan.strict
    elif plan.mode == "auto":
        stops = sp.get("stop") or []
        sp["stop"] = ([stops] if isinstance(stops, str) else list(stops)) + [TOOL_CALL_TAG]
    return [Seq(prompt={"input_ids": ctx.prompt_ids}, sampling_params=_sample_params(sp, j, req.n),
                rid=_rid(req.rid, j, req.n), return_logprob=req.logprobs,
                top_logprobs_num=req.top_logprobs or 0, index=j) for j in range(req.n)]


async def _choice_events(runner: Runner, ctx: _ChatCtx, seq: Seq, stream: bool) -> AsyncIterator[tuple]:
    """Events of one chat choice: ("delta", text, logprob entries | None), ("tool_calls", calls),
    then ("finish", reason, completion_tokens, cached_prompt_tokens)."""
    plan = ctx.plan
    constrained = plan.mode in ("named", "required")
    text, meta = "", {}
    async for chunk in runner.run(seq, stream=stream and not constrained):
        meta = chunk.get("meta_info", {})
        piece = chunk.get("text", "")
        text += piece
        if not constrained:
            entries = ctx.tok.chat_entries(meta) if seq.return_logprob else None
            if piece or entries:
                yield ("delta", piece, entries)
    reason = finish_reason(meta) or "abort"
    tokens = int(meta.get("completion_tokens", 0))
    called = plan.mode == "auto" and _matched_tag(meta, text)
    if called:
        text, reason, more = await _run_call(runner, ctx, seq, text)
        tokens += more
    if constrained or called:
        calls, reason = _tool_calls(plan, text, reason)
        if calls:
            yield ("tool_calls", calls)
        else:  # cut off (length/abort): show what was generated, as text
            yield ("delta", text if constrained else TOOL_CALL_TAG + text, None)
    yield ("finish", reason, tokens, int(meta.get("cached_tokens", 0)))


async def _run_call(runner: Runner, ctx: _ChatCtx, seq: Seq, before: str) -> tuple[str, str, int]:
    """Auto mode after the model wrote the tag: generate the call JSON under the call schema."""
    content = before.removesuffix(TOOL_CALL_TAG) + TOOL_CALL_TAG
    ids = ctx.prompt_ids + ctx.tok.tokenizer.encode(content, add_special_tokens=False)
    sp = {k: v for k, v in seq.sampling_params.items() if k != "stop"}
    sp["json_schema"] = ctx.plan.call_schema()
    sp["json_schema_strict"] = ctx.plan.strict
    call = Seq(prompt={"input_ids": ids}, sampling_params=sp, index=seq.index)
    runner.reserve([call])
    out = await run_to_end(runner, call)
    meta = out.get("meta_info", {})
    return out.get("text", ""), finish_reason(meta) or "abort", int(meta.get("completion_tokens", 0))


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
class _ChatChoice:
    index: int
    content: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None
    finish: str | None = None
    tokens: int = 0
    cached: int = 0

    def add(self, event: tuple) -> dict[str, Any]:
        """Fold an event in; return the streaming delta fragment for it."""
        kind = event[0]
        if kind == "delta":
            self.content += event[1]
            if event[2] is not None:
                self.logprobs = (self.logprobs or []) + event[2]
            lp = {"content": event[2]} if event[2] is not None else None
            return {"index": self.index, "delta": {"content": event[1]}, "logprobs": lp, "finish_reason": None}
        if kind == "tool_calls":
            self.tool_calls = event[1]
            calls = [{"index": k, **c} for k, c in enumerate(event[1])]
            return {"index": self.index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}
        self.finish, self.tokens, self.cached = event[1], event[2], event[3]
        return {"index": self.index, "delta": {}, "logprobs": None, "finish_reason": event[1]}

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": None if self.tool_calls else self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return {"index": self.index, "message": msg,
                "logprobs": {"content": self.logprobs} if self.logprobs is not None else None,
                "finish_reason": self.finish}


def _chat_usage(ctx: _ChatCtx, choices: list[_ChatChoice]) -> dict[str, Any]:
    return _usage(len(ctx.prompt_ids), sum(c.tokens for c in choices), max((c.cached for c in choices), default=0))


async def _collect_choice(runner: Runner, ctx: _ChatCtx, seq: Seq) -> _ChatChoice:
    choice = _ChatChoice(seq.index)
    async for event in _choice_events(runner, ctx, seq, stream=False):
        choice.add(event)
    return choice


async def _chat_stream(runner: Runner, ctx: _ChatCtx, seqs: list[Seq], rid: str,
                       model: str) -> AsyncIterator[bytes]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model}
    choices = [_ChatChoice(s.index) for s in seqs]
    try:
        for c in choices:
            yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        async for i, event in merge_streams([_choice_events(runner, ctx, s, True) for s in seqs]):
            yield sse({**head, "choices": [choices[i].add(event)]})
        opts = ctx.req.stream_options
        if opts and opts.include_usage:
            yield sse({**head, "choices": [], "usage": _chat_usage(ctx, choices)})
    except ValueError as exc:
        yield sse(error_body(str(exc), 400))
    finally:
        runner.release_all(seqs)
    yield SSE_DONE


# ---------------------------------------------------------------- routes


def _log_user(request: Request, user: str | None) -> None:
    """OpenAI's `user` (an end-user id for abuse monitoring) goes into this request's access-log line."""
    if user:
        request.state.log_extra = f"user={user!r}"


def register(app: FastAPI) -> None:
    runner: Runner = app.state.runner
    tok = _Tok(app.state.engine.tokenizer)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cfg = app.state.engine.model_config
        return {"object": "list", "data": [{"id": app.state.model_name, "object": "model", "created": now(),
                                            "owned_by": "radixlm",
                                            "max_model_len": getattr(cfg, "context_len", None)}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        _log_user(request, req.user)
        req.check_supported()
        seqs = _completion_seqs(req)
        runner.check(seqs)
        runner.reserve(seqs)
        rid, model = new_id("cmpl"), req.model or app.state.model_name
        choices = _completion_choices(req, seqs, tok)
        if req.stream:
            return await sse_response(request, _completion_events(runner, req, seqs, choices, rid, model))
        try:
            results = await until_disconnect(request, gather_all([run_to_end(runner, s) for s in seqs]))
        finally:
            runner.release_all(seqs)
        fragments = [c.add(r) for c, r in zip(choices, results)]
        return {"id": rid, "object": "text_completion", "created": now(), "model": model,
                "choices": fragments, "usage": _usage(*_prompt_usage(choices, req.n))}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        _log_user(request, req.user)
        req.check_supported()
        plan = plan_tools(req)
        ctx = _ChatCtx(req, plan, chat_prompt_ids(tok.tokenizer, req, plan),
                       req.sampling_params(req.max_new_tokens()), tok)
        seqs = _chat_seqs(ctx)
        runner.check(seqs)
        runner.reserve(seqs)
        rid, model = new_id("chatcmpl"), req.model or app.state.model_name
        if req.stream:
            return await sse_response(request, _chat_stream(runner, ctx, seqs, rid, model))
        try:
            choices = await until_disconnect(
                request, gather_all([_collect_choice(runner, ctx, s) for s in seqs]))
        finally:
            runner.release_all(seqs)
        return {"id": rid, "object": "chat.completion", "created": now(), "model": model,
                "choices": [c.message() for c in choices], "usage": _chat_usage(ctx, choices)}
