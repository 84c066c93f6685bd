"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (n, stop,
logprobs, echo, streaming deltas with an optional usage chunk, response_format, tools and
tool_choice via tools.py). Every choice is its own engine request, so any of them can be
aborted alone; shapes follow the OpenAI API reference. The per-route pieces are in
openai_completions.py and openai_chat.py, the shared response shapes in openai_shapes.py;
/v1/responses (on the chat pieces) in openai_responses.py."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException, Request

from . import openai_responses
from .openai_chat import chat_stream, chat_usage, collect_choice, prepare_chat
from .openai_completions import completion_choices, completion_events, completion_seqs, prompt_usage
from .openai_shapes import Tok, usage
from .protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from .runner import Runner, run_to_end
from .streams import gather_all, sse_response, until_disconnect


def _log_user(request: Request, user: str | None) -> None:
    """OpenAI's `user` (an end-user id for abuse monitoring) goes into this request's access-log line."""
    if user:
        request.state.log_extra = f"user={user!r}"


def register(app: FastAPI) -> None:
    runner: Runner = app.state.runner
    tok = Tok(app.state.engine.tokenizer)

    def model_card() -> dict[str, Any]:
        return {
            "id": app.state.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "radixlm",
            "max_model_len": getattr(app.state.engine.model_config, "context_len", None),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != app.state.model_name:
            raise HTTPException(
                404, f"model {model_id!r} does not exist; this server serves {app.state.model_name!r}"
            )
        return model_card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        _log_user(request, req.user)
        req.check_supported()
        seqs = completion_seqs(req)
        if req.max_tokens is None:  # an explicit null: the rest of the context, as vLLM serves it
            for s in seqs:
                rest = runner.rest_of_context(runner.count_prompt_tokens(s.prompt))
                if rest is not None:
                    s.sampling_params["max_new_tokens"] = rest
        runner.check(seqs)
        runner.reserve(seqs)
        rid, model = new_id("cmpl"), req.model or app.state.model_name
        choices = completion_choices(req, seqs, tok)
        if req.stream:
            return await sse_response(request, completion_events(runner, req, seqs, choices, rid, model))
        try:
            results = await until_disconnect(request, gather_all([run_to_end(runner, s) for s in seqs]))
        finally:
            runner.release_all(seqs)
        fragments = [c.add(r) for c, r in zip(choices, results)]
        return {
            "id": rid,
            "object": "text_completion",
            "created": now(),
            "model": model,
            "choices": fragments,
            "usage": usage(*prompt_usage(choices, req.n)),
        }

    openai_responses.register(app, runner, tok, _log_user)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        _log_user(request, req.user)
        req.check_supported()
        ctx, seqs = prepare_chat(runner, tok, req)
        rid, model = new_id("chatcmpl"), req.model or app.state.model_name
        if req.stream:
            return await sse_response(request, chat_stream(runner, ctx, seqs, rid, model))
        try:
            choices = await until_disconnect(
                request, gather_all([collect_choice(runner, ctx, s) for s in seqs])
            )
        finally:
            runner.release_all(seqs)
        return {
            "id": rid,
            "object": "chat.completion",
            "created": now(),
            "model": model,
            "choices": [c.message() for c in choices],
            "usage": chat_usage(ctx, choices),
        }
