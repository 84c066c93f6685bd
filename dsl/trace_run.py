"""A traced program run: TracedExecutor (the interpreter, reporting what each expression appends)
and TracingRuntime (the in-process backend, reporting what each engine request answered: cached
prompt tokens, streamed token ids, jump-forward positions, timings). `start_trace` runs a program
on a thread and returns a handle whose events the server streams (schema in docs/studio.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from radixlm.interpreter import CallSite, Executor
from radixlm.ir import ConcatAndAppend, Expr, ExprList, Gen, RoleBegin, RoleEnd, Select
from radixlm.program import Program, _split_options
from radixlm.runtime import Runtime
from radixlm.state import ProgramState
from radixlm.trace import NodeTrace, Tracer, site_json, to_json

_local = threading.local()  # the executor whose expression runs on this worker thread


def constraint_of(gen: Gen) -> dict[str, Any] | None:
    """The grammar a gen decodes under, named for people: its kind and a short label."""
    for kind in ("json_schema", "regex", "ebnf"):
        spec = gen.sampling.get(kind)
        if spec is not None:
            label = getattr(gen.schema_cls, "__name__", None) or str(spec)
            return {"kind": kind, "name": label if len(label) <= 60 else label[:57] + "..."}
    return None


class TracedExecutor(Executor):
    """An Executor whose appends, forks, joins and errors become trace events."""

    def __init__(self, backend: TracingRuntime, *args: Any, **kwargs: Any) -> None:
        self.tracer: Tracer = backend.tracer
        self.trace_node: NodeTrace | None = None
        self._fill_as: tuple[str, str | None] | None = None  # (source, role) while a role marker fills
        self._sites: dict[int, CallSite | None] = {}
        self._site: CallSite | None = None
        self._decision: Any = None  # the last select's ChoicesDecision (set by the backend)
        self._gen: dict[str, Any] = {}  # the running gen's variable and constraint
        self._gen_numbers: dict[str, Any] = {}  # the last gen request's numbers (set by the backend)
        super().__init__(backend, *args, **kwargs)

    @property
    def node(self) -> NodeTrace:
        assert self.trace_node is not None, "traced executor used before it was registered"
        return self.trace_node

    def submit(self, expr: Any, site: CallSite | None = None) -> None:
        if isinstance(expr, Expr):
            self._sites[id(expr)] = site
        super().submit(expr, site)

    def _execute(self, expr: Expr) -> None:
        _local.ex = self
        outer = self._site
        self._site = self._sites.pop(id(expr), None) or outer
        try:
            if isinstance(expr, Gen):
                self._traced_gen(expr)
            elif isinstance(expr, Select):
                self._traced_select(expr)
            elif isinstance(expr, (RoleBegin, RoleEnd)):
                self._fill_as = ("template", expr.role)
                try:
                    super()._execute(expr)
                finally:
                    self._fill_as = None
            elif isinstance(expr, ConcatAndAppend):
                self._traced_concat(expr)
            else:
                super()._execute(expr)
        finally:
            self._site = outer
            if not isinstance(expr, ExprList):
                self._catch_up("other")

    def _catch_up(self, source: str) -> None:
        """Emit text the state gained that no event carried yet."""
        own = len(self.text_) - self.fork_text_pos
        if self.trace_node is not None and own > self.node.length:
            self.tracer.text(self.node, self.text_[self.fork_text_pos + self.node.length :], source)

    def _fill(self, text: str) -> None:
        super()._fill(text)
        source, role = self._fill_as or ("prompt", self.cur_role)
        self.tracer.text(self.node, text, source, role=role)

    def _commit(self) -> None:
        n_ids, pending = len(self.ids_), self.pending_
        super()._commit()
        if self.trace_node is not None and len(self.ids_) > n_ids:
            end = len(self.text_) - self.fork_text_pos
            self.tracer.committed(self.node, end - len(pending), end, n_ids, self.ids_[n_ids:], pending)

    def _traced_gen(self, gen: Gen) -> None:
        sampling, _ = self._resolve(gen)
        constraint = constraint_of(gen)
        self._gen = {"var": gen.name, "constraint": constraint}
        self.tracer.emit(
            "gen",
            node=self.node.node,
            var=gen.name,
            constraint=constraint,
            max_new_tokens=sampling.get("max_new_tokens"),
            site=site_json(self._site),
        )
        self._gen_numbers = {}
        super()._execute(gen)
        value = self.variables.get(gen.name) if gen.name is not None else None
        self.tracer.emit(
            "gen_done", node=self.node.node, var=gen.name, value=to_json(value), **self._gen_numbers
        )

    def _traced_select(self, sel: Select) -> None:
        self._decision = None
        n_text = len(self.text_)
        super()._execute(sel)
        decision = self._decision
        meta = decision.meta_info if decision is not None else {}
        scores = {k: to_json(v) for k, v in meta.items() if k.startswith("normalized")}
        chosen = self.text_[n_text:]
        self.tracer.emit(
            "select",
            node=self.node.node,
            var=sel.name,
            choices=list(sel.choices),
            decision=chosen,
            index=sel.choices.index(chosen) if chosen in sel.choices else None,
            method=repr(sel.choices_method),
            scores=scores,
            site=site_json(self._site),
        )
        ids = self.codec.encode(chosen) if self.codec is not None else None
        self.tracer.text(self.node, chosen, "select", var=sel.name, ids=ids, flags=["select"])

    def _traced_concat(self, expr: ConcatAndAppend) -> None:
        kids = {id(st.stream_executor) for st in expr.states}
        for fork, _, fork_kids in self.node.forks:
            if {id(k) for k in fork_kids} == kids:
                self.node.concatenated.add(fork)
        super()._execute(expr)
        self._catch_up("join")

    def fork(self, size: int, site: CallSite | None) -> tuple[list[Executor], Any]:
        kids, handle = super().fork(size, site)
        for kid, node in zip(kids, self.tracer.new_fork(self.node, kids, site)):
            kid.trace_node = node  # type: ignore[attr-defined]
        return kids, handle

    def release_pin(self, handle: Any) -> None:
        super().release_pin(handle)
        self.tracer.joined(self.node)  # a fork group's join ends with releasing its pin

    def end(self) -> None:
        was_ended = self._ended
        super().end()
        if not was_ended and self.trace_node is not None:
            self.tracer.node_done(self.node, self.text_[self.fork_text_pos :])

    def _fail(self, error: BaseException, site: CallSite | None) -> None:
        super()._fail(error, site)
        self.tracer.error(self.trace_node, error, site)


class TracingRuntime(Runtime):
    """The in-process backend of a traced run: every engine answer is read for the trace."""

    def __init__(self, engine: Any, tracer: Tracer) -> None:
        super().__init__(engine=engine)
        self.tracer = tracer

    @staticmethod
    def _current(input_ids: list[int]) -> TracedExecutor | None:
        """The executor on this thread, if the request continues its ids."""
        ex = getattr(_local, "ex", None)
        if ex is None or ex.trace_node is None or input_ids[: len(ex.ids_)] != ex.ids_:
            return None
        return ex

    def _request(
        self,
        input_ids: list[list[int]],
        sampling: dict[str, Any],
        rid: list[str] | None = None,
        **logprob: Any,
    ) -> list[dict[str, Any]]:
        outs = super()._request(input_ids, sampling, rid=rid, **logprob)
        ex = self._current(input_ids[0]) if input_ids else None
        if ex is not None and outs:
            self.tracer.settle(ex.node, int(outs[0]["meta_info"].get("cached_tokens", 0)), "prefill")
        return outs

    def _request_stream(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str | None = None, **logprob: Any
    ) -> Iterator[dict[str, Any]]:
        ex = self._current(input_ids)
        if ex is None:
            yield from super()._request_stream(input_ids, sampling, rid=rid, **logprob)
            return
        watch = _GenWatch(self.tracer, ex, time.perf_counter())
        for chunk in super()._request_stream(input_ids, sampling, rid=rid, **logprob):
            watch.chunk(chunk)
            yield chunk
        ex._gen_numbers = watch.summary()

    def pin_prefix(self, ids: list[int]) -> Any:
        ex = self._current(list(ids))
        if ex is not None and ex.node.commits:  # learn what the pin finds cached (a prefill, then the pin)
            self._request([list(ids)], {"max_new_tokens": 0})
        return super().pin_prefix(ids)

    def select(self, ex: Any, choices: list[str], temperature: float, method: Any) -> Any:
        decision = super().select(ex, choices, temperature, method)
        if isinstance(ex, TracedExecutor):
            ex._decision = decision
        return decision


class _GenWatch:
    """One streamed gen request: its chunks as text events, its numbers for gen_done."""

    def __init__(self, tracer: Tracer, ex: TracedExecutor, t_submit: float) -> None:
        self.tracer, self.ex, self.t_submit = tracer, ex, t_submit
        self.n_out = 0
        self.t_first: float | None = None
        self.t_last = t_submit
        self.meta: dict[str, Any] = {}

    def chunk(self, chunk: dict[str, Any]) -> None:
        meta = chunk.get("meta_info") or {}
        if not self.meta:
            self.tracer.settle(self.ex.node, int(meta.get("cached_tokens", 0)), "gen")
        self.meta = meta
        ids = list(chunk.get("output_ids") or [])
        if ids:
            self.t_last = time.perf_counter()
            self.t_first = self.t_first or self.t_last
        forced = _forced(meta.get("jump_forward_spans") or [], self.n_out, len(ids))
        self.n_out += len(ids)
        gen = self.ex._gen
        flags = ["generated"] + (["constrained"] if gen.get("constraint") else [])
        for text, part_ids, jumped in _split(self.tracer.codec, chunk.get("text", ""), ids, forced):
            self.tracer.text(
                self.ex.node,
                text,
                "generated",
                role=self.ex.cur_role,
                var=gen.get("var"),
                ids=part_ids,
                flags=flags + (["jump_forward"] if jumped else []),
                forced=jumped if isinstance(jumped, list) else None,
                constraint=gen.get("constraint"),
            )

    def summary(self) -> dict[str, Any]:
        meta, stats = self.meta, self.ex.node.stats
        n = int(meta.get("completion_tokens", self.n_out))
        ttft = None if self.t_first is None else round(self.t_first - self.t_submit, 4)
        decode_s = self.t_last - (self.t_first or self.t_last)
        rate = round((self.n_out - 1) / decode_s, 2) if self.n_out > 1 and decode_s > 0 else None
        spans = meta.get("jump_forward_spans") or []
        stats["generated_tokens"] += n
        if stats.get("ttft_s") is None:
            stats["ttft_s"] = ttft
        stats["decode_s"] = round(stats.get("decode_s", 0.0) + decode_s, 4)
        stats["decode_tokens"] = stats.get("decode_tokens", 0) + max(self.n_out - 1, 0)
        out = {
            "finish_reason": meta.get("finish_reason"),
            "prompt_tokens": meta.get("prompt_tokens"),
            "cached_tokens": meta.get("cached_tokens"),
            "completion_tokens": n,
            "jump_forward_tokens": sum(e - s for s, e in spans),
            "ttft_s": ttft,
            "tokens_per_s": rate,
            "elapsed_s": round(self.t_last - self.t_submit, 4),
        }
        if "json_schema_valid" in meta:
            out["json_schema_valid"] = meta["json_schema_valid"]
        return out


def _forced(spans: list[list[int]], start: int, n: int) -> list[bool]:
    """Which of the n output ids from position `start` on the grammar wrote by jump-forward."""
    return [any(s <= start + i < e for s, e in spans) for i in range(n)]


def _split(codec: Any, text: str, ids: list[int], forced: list[bool]) -> Iterator[tuple[str, list[int], Any]]:
    """The chunk as pieces of uniform forcedness when its ids decode to its text; otherwise one
    piece whose third item lists the forced indexes (or False when none is)."""
    if not any(forced):
        yield text, ids, False
        return
    runs: list[tuple[list[int], bool]] = []
    for tok, f in zip(ids, forced):
        if runs and runs[-1][1] == f:
            runs[-1][0].append(tok)
        else:
            runs.append(([tok], f))
    pieces = [codec.decode(r) for r, _ in runs] if codec is not None else []
    if pieces and "".join(pieces) == text:
        for piece, (run, f) in zip(pieces, runs):
            yield piece, run, f
        return
    yield text, ids, [i for i, f in enumerate(forced) if f]


class TraceRun:
    """A started traced run, seen through the server's TracedRun interface."""

    def __init__(self, tracer: Tracer, state: ProgramState) -> None:
        self.tracer = tracer
        self.state = state

    @property
    def is_finished(self) -> bool:
        return self.tracer.finished

    def events(self, start: int = 0) -> list[dict[str, Any]]:
        return self.tracer.events_since(start)


def start_trace(program: Program, engine: Any, options: dict[str, Any], args: dict[str, Any]) -> TraceRun:
    """Run `program(**args)` on `engine` with streaming on, traced, on its own thread."""
    options = dict(options)
    run_options = {"max_new_tokens": options.pop("max_new_tokens", 128), **options}
    kwargs = program._arguments((), dict(args))
    sampling, logprob = _split_options({**program.options, **run_options})
    tracer = Tracer(program.__name__, kwargs, run_options, codec=None)
    backend = TracingRuntime(engine, tracer)
    tracer.codec = backend.codec
    ex = TracedExecutor(backend, kwargs, sampling, logprob, stream=True, program_name=program.__name__)
    ex.trace_node = tracer.new_node(0)
    state = ProgramState(ex)
    threading.Thread(target=_body, args=(program, state, kwargs), name="radixlm-trace", daemon=True).start()
    return TraceRun(tracer, state)


def _body(program: Program, state: ProgramState, kwargs: dict[str, Any]) -> None:
    """Run the program; whatever happens, the log ends with an error (if any) and `done`."""
    ex = state.stream_executor
    assert isinstance(ex, TracedExecutor)
    error: BaseException | None = None
    try:
        try:
            state.ret_value = program.func(state, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported as an error event
            error = e
        try:
            ex.end()
        except BaseException as e:  # noqa: BLE001 - e.g. an unpin on an engine that stopped
            error = error or e
        error = error or ex.error_
        if error is not None:
            ex.tracer.error(ex.trace_node, error)
    finally:
        ex.tracer.done(error is None, ex.text_, dict(ex.variables), state.ret_value)
