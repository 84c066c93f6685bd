"""radixlm.backend: the runtime — Engine, scheduler, radix cache, KV pool, model runner,
models, sampling, tokenizer/detokenizer, HTTP server and CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine


def __getattr__(name: str) -> Any:
    # Lazy: importing radixlm.backend must not pull in torch-heavy modules until needed.
    if name == "Engine":
        from .engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
