"""Prefix tracing: a program body run without its arguments and without a model, to find the
text it appends before it first needs one of them (what `Program.precache` caches). Promise:
the traced text is exactly the constant prefix every real run of the program starts with; the
trace stops at the first argument use, gen, select or fork, and never calls the model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixlm.backend_base import ProgramBackend
from radixlm.call_site import CallSite
from radixlm.interpreter import Executor
from radixlm.ir import Expr, Gen, Select, to_expr
from radixlm.state import ProgramState


class StopTrace(Exception):
    """The traced body needs something that is not constant: the prefix ends here."""


class PrefixTracer(Executor):
    """An Executor that runs constant expressions in the body's thread and stops at the first
    one that needs the model (gen, select, fork)."""

    def __init__(self, backend: ProgramBackend, program_name: str) -> None:
        super().__init__(backend, {}, {}, {}, program_name=program_name, inline=True)
        self.stopped = False

    def stop(self) -> StopTrace:
        """Mark the prefix as ended and return the exception that unwinds the body. The body may
        still append while it unwinds (a `with s.user():` block adds the role's closing text)
        or after catching the exception: no real run has that text at this point."""
        self.stopped = True
        return StopTrace()

    def submit(self, expr: Any, site: CallSite | None = None) -> None:
        if self.stopped:
            return
        expr = to_expr(expr)
        self._init_events(expr)
        try:
            self._execute(expr)  # an error goes to the traced body, which ends the trace
        except BaseException:
            self.stopped = True
            raise

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, (Gen, Select)):
            raise self.stop()
        super()._execute(expr)

    def fork(self, size: int, site: CallSite | None) -> tuple[list[Executor], Any]:
        raise self.stop()

    def end(self) -> None:
        self._ended = True


class Placeholder(Expr):
    """Stands for a program argument while tracing. `"Q: " + arg` still builds an ExprList
    (so the constant before it is traced); appending or any other use ends the trace."""

    def __init__(self, name: str, tracer: PrefixTracer) -> None:
        self._name = name
        self._tracer = tracer

    def _stop(self, *args: Any, **kwargs: Any) -> Any:
        raise self._tracer.stop()

    __str__ = __format__ = __getitem__ = __iter__ = __len__ = _stop
    __eq__ = __lt__ = __gt__ = __le__ = __ge__ = __bool__ = __int__ = __float__ = __contains__ = _stop
    __call__ = __mul__ = __rmul__ = __mod__ = __hash__ = _stop

    def __getattr__(self, name: str) -> Any:
        raise self._tracer.stop()


def trace_prefix(
    func: Callable[..., Any], arg_names: list[str], bound: dict[str, Any], backend: ProgramBackend, name: str
) -> str:
    """The text `func` (a program body) appends before it first needs an argument not in
    `bound` or the model."""
    ex = PrefixTracer(backend, name)
    args = {n: bound.get(n, Placeholder(n, ex)) for n in arg_names}
    try:
        func(ProgramState(ex), **args)
    except StopTrace:
        pass
    except Exception:  # noqa: BLE001 - tracing is an optimization; the real run reports errors
        pass
    return ex.text_
