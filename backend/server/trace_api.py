"""The trace endpoint: POST /programs/{name}/trace takes the body POST /programs/{name} takes and
answers an SSE stream of the run's trace events (schema in docs/studio.md), ending with a `done`
event and `data: [DONE]`. The language side records the events (`TraceHost.trace`); the server
only relays them. Promise: a client leaving the stream cancels the run (its engine requests are
aborted), exactly as for a streamed program run."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Request

from .programs import admit_program_run, program_registry, run_events
from .protocol import ProgramRunRequest
from .streams import SSE_DONE, sse, sse_response, until_disconnect

POLL_S = 0.03  # how often a stream looks for new events (tokens arrive slower than this on CPU)


class TracedRun(Protocol):
    """A started traced run: its events so far, and whether the last one (`done`) is in."""

    @property
    def is_finished(self) -> bool: ...

    def events(self, start: int = 0) -> list[dict[str, Any]]: ...


class TraceHost(Protocol):
    """A ProgramHost that can also run a program traced."""

    def trace(
        self, name: str, engine: Any, *, options: dict[str, Any], args: dict[str, Any]
    ) -> TracedRun: ...


async def trace_events(run: TracedRun) -> AsyncGenerator[bytes, None]:
    """Every event of the run as SSE, in order, then [DONE]."""
    cursor = 0
    while True:
        finished = run.is_finished  # read first: the events read after it are then complete
        events = run.events(cursor)
        cursor += len(events)
        for event in events:
            yield sse(event)
        if finished:
            break
        await asyncio.sleep(POLL_S)
    yield SSE_DONE


def register(app: FastAPI) -> None:
    @app.post("/programs/{name}/trace")
    async def trace_program(name: str, req: ProgramRunRequest, request: Request) -> Any:
        host = program_registry(app).host
        trace = getattr(host, "trace", None)
        if not callable(trace):
            raise HTTPException(501, "this server's program host cannot trace runs")
        _, kwargs, options, run = admit_program_run(app, name, req)
        try:
            traced = await until_disconnect(
                request, asyncio.to_thread(trace, name, run.view, options=options, args=kwargs)
            )
            return await sse_response(request, run_events(run, trace_events(traced)))
        except BaseException:
            run.cancel()  # client gone or the run could not start: abort what it submitted
            raise
        finally:
            if not run.handed_over:
                run.finish()
