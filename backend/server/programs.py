"""Program endpoint: programs registered at start-up are listed at GET /programs and run by
POST /programs/{name} with JSON arguments validated against the program's signature. Requests
only pick a registered program by name and pass JSON values: no code, path or pickle from a
request is ever executed. The server never imports the language: a `ProgramHost` (provided by
the language side, `radixlm.program_host`) says which programs there are and runs one."""

from __future__ import annotations

import asyncio
import inspect
import threading
import typing
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from .protocol import ProgramRunRequest, error_body
from .streams import SSE_DONE, sse, sse_response, until_disconnect

_POLL_S = 0.05


@dataclass
class ProgramSignature:
    """A program as the server sees it: the function whose parameters after the first (the
    program state) are the JSON arguments, and any arguments already bound."""

    func: Callable[..., Any]
    bound: dict[str, Any] = field(default_factory=dict)


@dataclass
class ProgramResult:
    text: str
    variables: dict[str, Any]
    meta_info: dict[str, Any]
    return_value: Any


class ProgramRun(Protocol):
    """A started program: polled while it streams, then asked for its result."""

    @property
    def is_finished(self) -> bool: ...

    def variables(self) -> dict[str, Any]:
        """The variables set so far (strings grow while a generation streams)."""
        ...

    def result(self) -> ProgramResult:
        """Waits for the end; raises what the program raised."""
        ...


class ProgramHost(Protocol):
    """The language side of the endpoint: which programs there are, and how to run one on an
    engine (the engine passed is a view that records what the run submits)."""

    def programs(self) -> dict[str, ProgramSignature]: ...

    def run(
        self, name: str, engine: Any, *, stream: bool, options: dict[str, Any], args: dict[str, Any]
    ) -> ProgramRun: ...


# `--programs MODULE_OR_FILE ...` → the host that serves them (given by the language side).
ProgramLoader = Callable[[list[str]], ProgramHost]


@dataclass
class RegisteredProgram:
    name: str
    signature: ProgramSignature
    args_model: type[BaseModel]

    def describe(self) -> dict[str, Any]:
        args = []
        for name, field_info in self.args_model.model_fields.items():
            args.append(
                {
                    "name": name,
                    "required": field_info.is_required(),
                    "default": None if field_info.is_required() else jsonable_encoder(field_info.default),
                    "annotation": _annotation_name(field_info.annotation),
                }
            )
        return {
            "name": self.name,
            "doc": inspect.getdoc(self.signature.func) or "",
            "arguments": args,
            "schema": self.args_model.model_json_schema(),
        }


def _annotation_name(annotation: Any) -> str:
    if annotation is Any or annotation is None:
        return "any"
    return getattr(annotation, "__name__", None) or str(annotation)


def _args_model(name: str, sig: ProgramSignature) -> type[BaseModel]:
    """A pydantic model of the program's arguments (all but the state), extra fields forbidden."""
    try:
        hints = typing.get_type_hints(sig.func)
    except Exception:  # noqa: BLE001 - unresolvable annotations: accept any JSON value
        hints = {}
    params = list(inspect.signature(sig.func).parameters.values())[1:]
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = sig.bound.get(p.name, p.default)
        fields[p.name] = (hints.get(p.name, Any), ... if default is p.empty else default)
    return create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)


class ProgramRegistry:
    """The host's programs, and the runs in progress (each with its own engine view)."""

    def __init__(self, host: ProgramHost, max_concurrent: int = 64) -> None:
        self.host = host
        self.programs = {
            name: RegisteredProgram(name, sig, _args_model(name, sig))
            for name, sig in host.programs().items()
        }
        self.max_concurrent = max_concurrent
        self.active: set[_Run] = set()

    def admit(self, engine: Any) -> _Run:
        if len(self.active) >= self.max_concurrent:
            raise HTTPException(
                503,
                f"{len(self.active)} programs running; the limit is {self.max_concurrent}",
                headers={"Retry-After": "1"},
            )
        run = _Run(self, engine)
        self.active.add(run)
        return run

    def cancel_all(self) -> int:
        runs = list(self.active)
        for run in runs:
            run.cancel()
        return len(runs)

    def get(self, name: str) -> RegisteredProgram:
        if name not in self.programs:
            raise HTTPException(404, f"no program named {name!r}; GET /programs lists them")
        return self.programs[name]


class _Run:
    """One program run: its place in the concurrency limit, and the engine as the program sees
    it. The view records every request id the run submits, so a client disconnect (or shutdown)
    aborts them, and refuses new requests once cancelled, so the program stops."""

    def __init__(self, reg: ProgramRegistry, engine: Any) -> None:
        self.reg = reg
        self.engine = engine
        self.rids: list[str] = []
        self.cancelled = False
        self.handed_over = False
        self._lock = threading.Lock()
        self.view = _EngineView(self)

    def start(self, name: str, stream: bool, options: dict[str, Any], args: dict[str, Any]) -> ProgramRun:
        return self.reg.host.run(name, self.view, stream=stream, options=options, args=args)

    def submit(self, sampling_params: Any, batch_size: int | None, rid: Any) -> Any:
        """Request ids for a generate call (made here when the program gave none), recorded."""
        with self._lock:
            if self.cancelled:
                raise RuntimeError("program run cancelled (client disconnected or server shutting down)")
            if rid is None:
                rid = (
                    uuid.uuid4().hex if batch_size is None else [uuid.uuid4().hex for _ in range(batch_size)]
                )
            params = (
                sampling_params
                if isinstance(sampling_params, list)
                else [sampling_params] * len([rid] if isinstance(rid, str) else rid)
            )
            for r, sp in zip([rid] if isinstance(rid, str) else rid, params):
                n = int((sp or {}).get("n", 1) or 1)
                self.rids.extend([r] if n == 1 else [f"{r}-{i}" for i in range(n)])
            return rid

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            rids = list(self.rids)
        for rid in rids:
            self.engine.abort_request(rid)

    def finish(self) -> None:
        self.reg.active.discard(self)


class _EngineView:
    """The engine, with generate() going through a _Run (everything else passes through)."""

    def __init__(self, run: _Run) -> None:
        self._run = run
        self.tokenizer = run.engine.tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run.engine, name)

    def generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        rid: Any = None,
        **kwargs: Any,
    ) -> Any:
        batch = None
        if isinstance(prompt, list):
            batch = len(prompt)
        elif isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            batch = len(input_ids)
        rid = self._run.submit(sampling_params, batch, rid)
        return self._run.engine.generate(
            prompt=prompt, sampling_params=sampling_params, input_ids=input_ids, rid=rid, **kwargs
        )


def _jsonable(value: Any) -> Any:
    try:
        return jsonable_encoder(value)
    except Exception:  # noqa: BLE001 - unknown objects are shown by their repr
        return repr(value)


def _result_body(name: str, run: ProgramRun) -> dict[str, Any]:
    result = run.result()
    return {
        "program": name,
        "text": result.text,
        "variables": {v: _jsonable(x) for v, x in result.variables.items()},
        "meta_info": {v: _jsonable(x) for v, x in result.meta_info.items()},
        "return_value": _jsonable(result.return_value),
    }


def _validated_args(entry: RegisteredProgram, args: dict[str, Any]) -> dict[str, Any]:
    try:
        return entry.args_model(**args).model_dump()
    except ValidationError as exc:
        parts = [
            f"{'.'.join(map(str, e['loc']))}: "
            f"{'unknown argument' if e['type'] == 'extra_forbidden' else e['msg']}"
            for e in exc.errors()
        ]
        raise HTTPException(400, f"invalid arguments for {entry.name}: " + "; ".join(parts)) from exc


async def _stream_program(entry: RegisteredProgram, state: ProgramRun) -> AsyncGenerator[bytes, None]:
    """Variable deltas while the program runs, then the final result (or an error)."""
    seen: dict[str, str] = {}
    while True:
        done = state.is_finished
        for var, value in list(state.variables().items()):
            if isinstance(value, str):
                old = seen.get(var, "")
                if value != old and value.startswith(old):
                    yield sse({"variable": var, "delta": value[len(old) :]})
                    seen[var] = value
        if done:
            break
        await asyncio.sleep(_POLL_S)
    try:
        result = await asyncio.to_thread(_result_body, entry.name, state)
        yield sse({**result, "done": True})
    except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
        yield sse(error_body(f"program {entry.name} failed: {exc}", 400))
    yield SSE_DONE


def program_registry(app: FastAPI) -> ProgramRegistry:
    registry: ProgramRegistry | None = app.state.programs
    if registry is None:
        raise HTTPException(404, "no programs are registered on this server (start it with --programs)")
    return registry


def admit_program_run(
    app: FastAPI, name: str, req: ProgramRunRequest
) -> tuple[RegisteredProgram, dict[str, Any], dict[str, Any], _Run]:
    """Check a run request and admit it: the program, its validated arguments, its sampling options
    and the admitted run (404 unknown program, 400 bad arguments, 503 while the server stops).
    The caller must end the run (finish, or cancel then finish)."""
    reg = program_registry(app)
    entry = reg.get(name)
    kwargs = _validated_args(entry, req.args)
    options = req.sampling_options(app.state.runner.max_new_tokens)
    if not app.state.runner.accepting:
        raise HTTPException(503, "server is shutting down", headers={"Retry-After": "1"})
    return entry, kwargs, options, reg.admit(app.state.engine)


def register(app: FastAPI) -> None:
    registry: ProgramRegistry | None = app.state.programs
    if registry is not None:
        app.state.runner.add_work_source(lambda: len(registry.active), registry.cancel_all)

    @app.get("/programs")
    async def list_programs() -> dict[str, Any]:
        reg = program_registry(app)
        return {"programs": [p.describe() for p in reg.programs.values()]}

    @app.post("/programs/{name}")
    async def run_program(name: str, req: ProgramRunRequest, request: Request) -> Any:
        entry, kwargs, options, run = admit_program_run(app, name, req)
        try:
            state = await until_disconnect(
                request, asyncio.to_thread(run.start, name, req.stream, options, kwargs)
            )
            if req.stream:
                return await sse_response(request, run_events(run, _stream_program(entry, state)))
            return await until_disconnect(request, asyncio.to_thread(_result_body, name, state))
        except ValueError as exc:
            raise ValueError(f"program {name} failed: {exc}") from exc
        except BaseException:
            run.cancel()  # client gone or server stopping: abort what the program submitted
            raise
        finally:
            if not req.stream or not run.handed_over:
                run.finish()


async def run_events(run: _Run, events: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """The stream owns the run from here: leaving early (disconnect) cancels it."""
    run.handed_over = True
    complete = False
    try:
        async for event in events:
            yield event
        complete = True
    finally:
        if not complete:
            run.cancel()
        run.finish()
