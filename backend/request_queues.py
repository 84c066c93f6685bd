"""RequestQueues: where each request the scheduler holds is between steps — waiting for a prefill
(retracted ones first), part-way through a chunked prefill, or running (decoding). Promises: a
request is in at most one of them; `discard` takes it out of whichever holds it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .request import Req


@dataclass
class RequestQueues:
    waiting: deque[Req] = field(default_factory=deque)
    running: list[Req] = field(default_factory=list)  # prefill done, decoding
    chunked: Req | None = None  # a prompt part-way through chunked prefill
    # KV tokens each embedding waiting for room needs, by ticket (embeddings.embed_when_room)
    embedding_holds: dict[int, int] = field(default_factory=dict)

    def discard(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None

    def held(self) -> list[Req]:
        return [*self.waiting, *self.running, *([self.chunked] if self.chunked else [])]

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)
