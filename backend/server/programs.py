"""Program endpoint: `@function` programs registered at start-up (from a module or a file the
operator names) are listed at GET /programs and run by POST /programs/{name} with JSON
arguments validated against the function's signature. Requests only pick a registered program
by name and pass JSON values: no code, path or pickle from a request is ever executed."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
import typing
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from radixlm.backend.server.protocol import ProgramRunRequest, error_body
from radixlm.backend.server.streams import SSE_DONE, sse, sse_response

_POLL_S = 0.05


@dataclass
class RegisteredProgram:
    name: str
    program: Any
    args_model: type[BaseModel]

    def describe(self) -> dict[str, Any]:
        args = []
        for name, field in self.args_model.model_fields.items():
            args.append({"name": name, "required": field.is_required(),
                         "default": None if field.is_required() else jsonable_encoder(field.default),
                         "annotation": _annotation_name(field.annotation)})
        return {"name": self.name, "doc": inspect.getdoc(self.program.func) or "",
                "arguments": args, "schema": self.args_model.model_json_schema()}


def _annotation_name(annotation: Any) -> str:
    if annotation is Any or annotation is None:
        return "any"
    return getattr(annotation, "__name__", None) or str(annotation)


def _args_model(name: str, program: Any) -> type[BaseModel]:
    """A pydantic model of the program's arguments (all but the state), extra fields forbidden."""
    try:
        hints = typing.get_type_hints(program.func)
    except Exception:  # noqa: BLE001 - unresolvable annotations: accept any JSON value
        hints = {}
    params = list(inspect.signature(program.func).parameters.values())[1:]
    bound = getattr(program, "bind_arguments", {}) or {}
    fields: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = bound.get(p.name, p.default)
        fields[p.name] = (hints.get(p.name, Any), ... if default is p.empty else default)
    return create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)


class ProgramRegistry:
    """Named programs plus the backend they run on (an in-process Runtime over the engine)."""

    def __init__(self, programs: dict[str, Any], max_concurrent: int = 64) -> None:
        self.programs = {name: RegisteredProgram(name, p, _args_model(name, p)) for name, p in programs.items()}
        self.backend: Any = None
        self.max_concurrent = max_concurrent
        self.running = 0

    @classmethod
    def load(cls, specs: list[str], max_concurrent: int = 64) -> ProgramRegistry:
        found: dict[str, Any] = {}
        for spec in specs:
            found.update(find_programs(_import(spec)))
        if not found:
            raise ValueError(f"no @function programs found in {specs}")
        return cls(found, max_concurrent)

    def bind_engine(self, engine: Any) -> None:
        from radixlm.runtime import Runtime

        self.backend = Runtime(engine=engine)

    def admit(self) -> _Ticket:
        if self.running >= self.max_concurrent:
            raise HTTPException(503, f"{self.running} programs running; the limit is {self.max_concurrent}",
                                headers={"Retry-After": "1"})
        self.running += 1
        return _Ticket(self)

    def get(self, name: str) -> RegisteredProgram:
        if name not in self.programs:
            raise HTTPException(404, f"no program named {name!r}; GET /programs lists them")
        return self.programs[name]


def find_programs(module: Any) -> dict[str, Any]:
    from radixlm.program import Program

    return {name: obj for name, obj in vars(module).items() if isinstance(obj, Program)}


def _import(spec: str) -> Any:
    """A module by dotted name, or a .py file by path (given by the operator at start-up)."""
    path = Path(spec)
    if spec.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ValueError(f"program file {spec!r} does not exist")
        mod_name = f"radixlm_programs_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"cannot import {spec!r}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        loader_spec.loader.exec_module(module)
        return module
    return importlib.import_module(spec)


def _jsonable(value: Any) -> Any:
    try:
        return jsonable_encoder(value)
    except Exception:  # noqa: BLE001 - unknown objects are shown by their repr
        return repr(value)


def _state_result(name: str, state: Any) -> dict[str, Any]:
    names = list(state.stream_executor.variables)
    return {"program": name, "text": state.text(),
            "variables": {v: _jsonable(state.get_var(v)) for v in names},
            "meta_info": {v: _jsonable(state.get_meta_info(v)) for v in names},
            "return_value": _jsonable(state.ret_value)}


def _validated_args(entry: RegisteredProgram, args: dict[str, Any]) -> dict[str, Any]:
    try:
        return entry.args_model(**args).model_dump()
    except ValidationError as exc:
        parts = [f"{'.'.join(map(str, e['loc']))}: "
                 f"{'unknown argument' if e['type'] == 'extra_forbidden' else e['msg']}" for e in exc.errors()]
        raise HTTPException(422, f"invalid arguments for {entry.name}: " + "; ".join(parts)) from exc


async def _stream_program(entry: RegisteredProgram, state: Any) -> AsyncIterator[bytes]:
    """Variable deltas while the program runs, then the final result (or an error)."""
    ex = state.stream_executor
    seen: dict[str, str] = {}
    while True:
        done = ex.is_finished
        for var, value in list(ex.variables.items()):
            if isinstance(value, str):
                old = seen.get(var, "")
                if value != old and value.startswith(old):
                    yield sse({"variable": var, "delta": value[len(old):]})
                    seen[var] = value
        if done:
            break
        await asyncio.sleep(_POLL_S)
    try:
        result = await asyncio.to_thread(_state_result, entry.name, state)
        yield sse({**result, "done": True})
    except Exception as exc:  # noqa: BLE001 - reported to the client as an error event
        yield sse(error_body(f"program {entry.name} failed: {exc}", 400))
    yield SSE_DONE


def register(app: FastAPI) -> None:
    registry: ProgramRegistry | None = app.state.programs
    if registry is not None and registry.backend is None:
        registry.bind_engine(app.state.engine)

    def need_registry() -> ProgramRegistry:
        if registry is None:
            raise HTTPException(404, "no programs are registered on this server (start it with --programs)")
        return registry

    @app.get("/programs")
    async def list_programs() -> dict[str, Any]:
        reg = need_registry()
        return {"programs": [p.describe() for p in reg.programs.values()]}

    @app.post("/programs/{name}")
    async def run_program(name: str, req: ProgramRunRequest, request: Request) -> Any:
        reg = need_registry()
        entry = reg.get(name)
        kwargs = _validated_args(entry, req.args)
        options = req.sampling_options(app.state.runner.max_new_tokens)
        ticket = reg.admit()
        try:
            state = await asyncio.to_thread(entry.program.run, backend=reg.backend, stream=req.stream,
                                            **options, **kwargs)
            if req.stream:
                return await sse_response(request, _released_after(ticket, _stream_program(entry, state)))
            return await asyncio.to_thread(_state_result, name, state)
        except ValueError as exc:
            raise ValueError(f"program {name} failed: {exc}") from exc
        finally:
            if not req.stream or not ticket.handed_over:
                ticket.release()


class _Ticket:
    """One running program's place in the concurrency limit; release is idempotent."""

    def __init__(self, reg: ProgramRegistry) -> None:
        self.reg = reg
        self.released = False
        self.handed_over = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.reg.running -= 1


async def _released_after(ticket: _Ticket, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    ticket.handed_over = True
    try:
        async for event in events:
            yield event
    finally:
        ticket.release()
