"""The language side of the server's program endpoint: `ProgramsHost` finds the `@function`
programs in modules or files the operator names at start-up and runs one on the engine the
server hands it, plainly or traced (the studio's event stream). It implements the server's
`ProgramHost` interface, so the server never imports the language."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from radixlm.backend.server.programs import ProgramRegistry, ProgramResult, ProgramSignature
from radixlm.program import Program
from radixlm.state import ProgramState
from radixlm.trace_run import TraceRun, start_trace


class ProgramsHost:
    """Named `@function` programs, run in-process on the server's engine."""

    def __init__(self, programs: dict[str, Program]) -> None:
        self._programs = dict(programs)

    @classmethod
    def load(cls, specs: list[str]) -> ProgramsHost:
        """The programs of each module (dotted name) or .py file in `specs`."""
        found: dict[str, Program] = {}
        for spec in specs:
            found.update(find_programs(_import(spec)))
        if not found:
            raise ValueError(f"no @function programs found in {specs}")
        return cls(found)

    def programs(self) -> dict[str, ProgramSignature]:
        return {name: ProgramSignature(p.func, dict(p.bind_arguments)) for name, p in self._programs.items()}

    def run(
        self, name: str, engine: Any, *, stream: bool, options: dict[str, Any], args: dict[str, Any]
    ) -> _StateRun:
        from radixlm.runtime import Runtime

        state = self._programs[name].run(backend=Runtime(engine=engine), stream=stream, **options, **args)
        return _StateRun(state)

    def trace(self, name: str, engine: Any, *, options: dict[str, Any], args: dict[str, Any]) -> TraceRun:
        """Start a traced, streaming run whose events the server's trace endpoint relays."""
        return start_trace(self._programs[name], engine, options, args)


class _StateRun:
    """A program state seen through the server's `ProgramRun` interface."""

    def __init__(self, state: ProgramState) -> None:
        self.state = state

    @property
    def is_finished(self) -> bool:
        return bool(self.state.stream_executor.is_finished)

    def variables(self) -> dict[str, Any]:
        return dict(self.state.stream_executor.variables)

    def result(self) -> ProgramResult:
        state = self.state
        names = list(state.stream_executor.variables)
        return ProgramResult(
            text=state.text(),
            variables={v: state.get_var(v) for v in names},
            meta_info={v: state.get_meta_info(v) for v in names},
            return_value=state.ret_value,
        )


def program_registry(programs: dict[str, Program] | list[str], max_concurrent: int = 64) -> ProgramRegistry:
    """The server's registry over these programs (a dict, or module/file specs to load)."""
    host = ProgramsHost(programs) if isinstance(programs, dict) else ProgramsHost.load(programs)
    return ProgramRegistry(host, max_concurrent)


def find_programs(module: Any) -> dict[str, Program]:
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
    try:
        return importlib.import_module(spec)
    except ModuleNotFoundError as e:
        # Only the operator's own name is an operator error; an import inside the module that
        # fails is a bug in their code and keeps its traceback.
        if e.name is None or not (spec == e.name or spec.startswith(e.name + ".")):
            raise
        raise ValueError(f"no module or .py file named {spec!r} (module {e.name!r} not found)") from None
