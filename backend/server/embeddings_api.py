"""POST /v1/embeddings (OpenAI's shape) for a generation model: each input's final normalized
hidden state, last-token pooled and L2-normalized (Engine.encode). Promises: the OpenAI client's
request and response shapes (float or base64 encoding); bad input is a 400 with the reason; an
input the KV pool could not take within the engine's wait is a 503 with Retry-After."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from ..embeddings import KVPoolBusy
from .runner import Overloaded

MAX_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def _split(
    inp: str | list[str] | list[int] | list[list[int]],
) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, id lists): exactly one is set; an empty list is refused."""
    if isinstance(inp, str):
        return [inp], None
    if not inp:
        raise ValueError("input must not be empty")
    if len(inp) > MAX_INPUTS:
        raise ValueError(f"{len(inp)} inputs; at most {MAX_INPUTS} per request")
    if all(isinstance(x, str) for x in inp):
        return list(inp), None  # type: ignore[arg-type]
    if all(isinstance(x, int) for x in inp):
        return None, [list(inp)]  # type: ignore[arg-type]
    return None, [list(x) for x in inp]  # type: ignore[arg-type]


def _encode_vector(vec: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


def register(app: FastAPI) -> None:
    engine = app.state.engine

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> dict[str, Any]:
        texts, ids = _split(req.input)
        lists = ids if ids is not None else [engine.tokenizer.encode(t) for t in texts or []]
        hidden = engine.model_config.hidden_size
        if req.dimensions is not None and req.dimensions != hidden:
            raise ValueError(
                f"dimensions: this model's embeddings have {hidden}; other sizes are not supported"
            )
        try:
            vectors = await asyncio.to_thread(engine.encode_vectors, input_ids=lists)
        except KVPoolBusy as e:  # running requests held the room for as long as it waited
            raise Overloaded(str(e)) from e
        tokens = sum(len(x) for x in lists)
        return {
            "object": "list",
            "model": req.model or app.state.model_name,
            "data": [
                {"object": "embedding", "index": i, "embedding": _encode_vector(v, req.encoding_format)}
                for i, v in enumerate(vectors)
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
