"""Server-side tokenization and server facts, so a client needs only a URL: /tokenize,
/detokenize, /apply_chat_template (the model's own template, with chat_template_kwargs),
/get_server_info (also /server_info) and /version. Request shapes follow SGLang/vLLM."""

from __future__ import annotations

import importlib.metadata
from typing import Any, cast

from fastapi import FastAPI
from pydantic import Field

from .protocol import _Strict


def version() -> str:
    try:
        return importlib.metadata.version("radixlm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class TokenizeRequest(_Strict):
    """`prompt` is one text or a batch; `add_special_tokens` as in HF (off: what programs need)."""

    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = False


class ChatTemplateRequest(_Strict):
    messages: list[dict[str, Any]] = Field(default_factory=list)
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    kwargs: dict[str, Any] | None,
    continue_final_message: bool = False,
) -> str:
    """The model's chat template applied to `messages`; ValueError when it has none or refuses.
    With `continue_final_message` the text ends inside the last message, open for more."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template")
    extra = dict(kwargs or {})
    for reserved in (
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "conversation",
        "messages",
    ):
        if reserved in extra:
            raise ValueError(f"chat_template_kwargs may not set {reserved!r}")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **extra,
        )
        return cast(str, text)  # tokenize=False: the rendered prompt
    except Exception as exc:  # jinja raises its own errors for messages a template refuses
        raise ValueError(f"chat template rejected the messages: {exc}") from exc


def register(app: FastAPI) -> None:
    engine = app.state.engine
    tok = engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        ids = [list(tok.encode(t, add_special_tokens=req.add_special_tokens)) for t in texts]
        context = getattr(engine.model_config, "context_len", None)
        if isinstance(req.prompt, str):
            return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": context}
        return {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": context}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        vocab = len(tok)  # ids past the tokenizer (model vocab padding) have no text
        batch = bool(req.tokens) and isinstance(req.tokens[0], list)
        seqs: list[list[int]] = req.tokens if batch else [req.tokens]  # type: ignore[assignment,list-item]
        for seq in seqs:
            bad = [t for t in seq if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
        texts = [tok.decode(seq, skip_special_tokens=req.skip_special_tokens) for seq in seqs]
        return {"text": texts if batch else texts[0]}

    @app.post("/apply_chat_template")
    async def apply_chat_template(req: ChatTemplateRequest) -> dict[str, Any]:
        text = render_chat(tok, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        return {"text": text}

    async def server_info() -> dict[str, Any]:
        cfg = engine.model_config
        stats = engine.get_stats()
        return {
            "version": version(),
            "model_path": str(engine.model_path),
            "served_model_name": app.state.model_name,
            "context_length": getattr(cfg, "context_len", None),
            "vocab_size": getattr(cfg, "vocab_size", None),
            "device": str(engine.device),
            "has_chat_template": getattr(tok, "chat_template", None) is not None,
            "limits": {k: v for k, v in vars(app.state.runner.limits).items()},
            "engine_stats": stats,
            "internal_states": [stats],  # SGLang's key: one entry per scheduler; bench_serving reads [0]
        }

    app.get("/get_server_info")(server_info)
    app.get("/server_info")(server_info)

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}
