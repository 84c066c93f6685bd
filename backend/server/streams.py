"""Async plumbing shared by the route handlers: run work until the client disconnects,
gather many sequences (first error cancels the rest), merge several chunk streams, and SSE
framing with the error event that ends a stream already under way. Cancelling any of these
cancels the engine requests under them (see runner)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from ..engine_process import EngineDied
from .protocol import error_body

logger = logging.getLogger("radixlm.server")
T = TypeVar("T")
_POLL_S = 0.25
_DONE = object()


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, polling for a client disconnect; on disconnect cancel it (→ abort)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()


async def gather_all(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Like asyncio.gather, but the first failure cancels the others and is re-raised as is."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel_and_wait(tasks)


async def merge_streams(gens: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as (index, item) in arrival order."""
    if len(gens) == 1:
        async with aclosing(gens[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            await queue.put((i, exc))
        await queue.put((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        await _cancel_and_wait(tasks)


async def _cancel_and_wait(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel unfinished tasks and let their cleanup (engine aborts) run to completion."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*pending, return_exceptions=True)


def sse(payload: Any) -> bytes:
    """One server-sent event carrying a JSON payload."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_status(exc: Exception) -> tuple[int, str]:
    """(status, message) a failure answers with, whether a response or a stream's last event: a
    bad request 400, the engine process gone 503, anything else 500."""
    if isinstance(exc, ValueError):
        return 400, str(exc)
    if isinstance(exc, EngineDied):
        return 503, f"{exc}; the server is shutting down"
    return 500, f"internal server error: {type(exc).__name__}: {exc}"


def stream_error(exc: Exception) -> tuple[int, str]:
    """error_status of a stream whose headers are sent; a 500's traceback is logged here, since
    no exception handler sees it."""
    status, message = error_status(exc)
    if status == 500:
        logger.error("a stream failed", exc_info=exc)
    return status, message


def stream_error_event(exc: Exception) -> bytes:
    """The SSE error event that ends a stream already under way (see stream_error)."""
    status, message = stream_error(exc)
    return sse(error_body(message, status))


class _PrimedStream:
    """The first event (already awaited) followed by the rest of `events`."""

    def __init__(self, first: bytes, events: AsyncGenerator[bytes, None]) -> None:
        self._first: bytes | None = first
        self._events = events

    def __aiter__(self) -> _PrimedStream:
        return self

    async def __anext__(self) -> bytes:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._events.__anext__()

    async def aclose(self) -> None:
        await self._events.aclose()


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body iterator even when the send is cancelled by a disconnect, so the
    engine requests under it are aborted at once rather than whenever GC runs."""

    async def stream_response(self, send: Any) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def sse_response(request: Request, events: AsyncGenerator[bytes, None]) -> StreamingResponse:
    """Start an SSE response; the first event is awaited before the headers go out, so
    request errors raised while starting (bad grammar, overload) become HTTP statuses."""
    try:
        first = await until_disconnect(request, events.__anext__())
    except BaseException:
        with anyio.CancelScope(shield=True):
            await events.aclose()
        raise
    return _ClosingStreamingResponse(
        _PrimedStream(first, events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
