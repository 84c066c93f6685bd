"""The interpreter: one Executor per program state runs its expressions in order (on a worker thread,
so `s += gen(...)` returns at once, or inline for a non-streamed run's own state) and keeps its text,
token ids, messages and variables. Promise: committed token ids are exactly what the backend saw and
generated; an expression's error is kept with its program line and re-raised to whoever waits."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from radixlm.backend.logprob_text import with_logprob_text
from radixlm.backend_base import ProgramBackend, StreamedLogprobs
from radixlm.call_site import CallSite
from radixlm.ir import (
    Commit,
    ConcatAndAppend,
    Constant,
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    convert_value,
    to_expr,
)
from radixlm.run_cancel import RunCancel
from radixlm.select_healing import chosen_prompt
from radixlm.threads import PROGRAM_THREADS


class Executor:
    """Runs one program state's expressions; fields ending in `_` belong to the worker. `inline=True`
    runs each in the thread that adds it: a non-streamed run's root state, whose body alone adds to and
    reads it, and which `run` waits for anyway (a worker would add two thread hand-offs per model
    call). Forks always get workers, so they run concurrently."""

    def __init__(
        self,
        backend: ProgramBackend,
        arguments: dict[str, Any],
        sampling: dict[str, Any],
        logprob: dict[str, Any],
        stream: bool = False,
        program_name: str = "<program>",
        inline: bool = False,
        cancel: RunCancel | None = None,
    ) -> None:
        self.backend = backend
        self.cancel = cancel  # the run's cancellation, shared with its forks
        self.codec = backend.codec
        self.template = backend.get_chat_template()
        self.arguments = arguments
        self.sampling = sampling
        self.logprob = logprob
        self.stream = stream
        self.program_name = program_name
        self.inline = inline
        if self.inline and stream:
            raise ValueError("a streamed program state runs its expressions on a worker thread, not inline")

        self.text_ = ""
        self.ids_: list[int] = []
        self.pending_ = ""  # tail of text_ not yet tokenized
        self.messages_: list[dict[str, Any]] = []
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.cur_role_suffix = ""
        self.fork_text_pos = 0
        self.fork_ids_pos = 0

        self.variables: dict[str, Any] = {}
        self.variable_event: dict[str, threading.Event] = {}
        self.meta_info: dict[str, Any] = {}
        self._scope_start: dict[str, int] = {}
        self.error_: BaseException | None = None
        self.is_finished = False
        self._logprob_text = False  # the running gen's return_text_in_logprobs
        self._ended = False
        self._pins: list[Any] = []
        self._last_pin: Any = None
        self.children: list[Executor] = []

        self.stream_text_event = threading.Event() if stream else None
        self.stream_var_event: dict[str, threading.Event] = {}
        # per streamed variable: (text delta, meta with that chunk's own output logprobs)
        self.stream_chunks: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        self.stream_text_of: dict[str, str] = {}  # a streamed gen's text, even once a dtype converts it
        self._queue: queue.Queue = queue.Queue()
        self._worker: Future[None] | None = None
        if not self.inline:
            self._worker = PROGRAM_THREADS.submit(self._loop)

    # ---- caller side -------------------------------------------------------------------

    def submit(self, expr: Any, site: CallSite | None = None) -> None:
        expr = to_expr(expr)
        self._init_events(expr)
        if self._ended:
            raise RuntimeError("this program state has ended; it accepts no more expressions")
        if self.error_ is not None:
            self.release_waiters()
        if self.inline:
            self._run_one(expr, site, reraise_interrupts=True)
        else:
            self._queue.put((expr, site))

    def sync(self) -> None:
        if not self.inline:
            self._queue.join()

    def raise_error(self) -> None:
        if self.error_ is not None:
            raise self.error_

    def get_var(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name not in self.variables:
            self.raise_error()
            raise KeyError(f"program state has no variable {name!r}")
        return self.variables[name]

    def get_meta_info(self, name: str) -> Any:
        event = self.variable_event.get(name)
        if event is not None:
            event.wait()
        if name not in self.variables:
            self.raise_error()
        return self.meta_info.get(name)

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def end(self) -> None:
        """Finish: let queued expressions run, stop the worker, end forks, drop pins."""
        if self._ended:
            return
        self._ended = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.result()
        else:
            self.is_finished = True
        for child in self.children:
            child.end()
        for handle in self._pins:
            self.backend.unpin_prefix(handle)
        self._pins.clear()

    def fork(self, size: int, site: CallSite | None) -> tuple[list[Executor], Any]:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be a positive int, got {size!r}")
        self.submit(Commit(pin=size > 1), site)
        self.sync()
        self.raise_error()
        handle, self._last_pin = self._last_pin, None
        if handle is not None:
            self._pins.append(handle)
        kids = [self._child() for _ in range(size)]
        self.children.extend(kids)
        return kids, handle

    def release_pin(self, handle: Any) -> None:
        if handle is not None and handle in self._pins:
            self._pins.remove(handle)
            self.backend.unpin_prefix(handle)

    def commit_now(self) -> list[int]:
        """Tokenize pending text (through the worker) and return the committed ids."""
        if self._ended or self.inline:
            self._commit()  # no worker runs (any more): safe to do here
        else:
            self.submit(Commit())
            self.sync()
        self.raise_error()
        return list(self.ids_)

    def _child(self) -> Executor:
        # type(self): a subclass's forks are of that class too (a traced run's branches are traced)
        kid = type(self)(
            self.backend, self.arguments, self.sampling, self.logprob, self.stream, self.program_name
        )  # never inline: forks run concurrently
        kid.text_, kid.ids_, kid.pending_ = self.text_, list(self.ids_), self.pending_
        kid.cancel = self.cancel
        kid.messages_ = [dict(m) for m in self.messages_]
        kid.cur_role, kid.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
        kid.cur_role_suffix = self.cur_role_suffix
        kid.variables = dict(self.variables)
        kid.meta_info = dict(self.meta_info)
        kid.fork_text_pos, kid.fork_ids_pos = len(self.text_), len(self.ids_)
        return kid

    def _init_events(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for e in expr.exprs:
                self._init_events(e)
            return
        name = getattr(expr, "name", None) if isinstance(expr, (Gen, Select, VarScopeBegin)) else None
        if name is not None:
            self.variable_event[name] = threading.Event()
            if self.stream:
                self.stream_var_event[name] = threading.Event()

    # ---- worker side -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    break
                expr, site = item
                self._run_one(expr, site, reraise_interrupts=False)
            finally:
                self._queue.task_done()
                if self.stream_text_event is not None:
                    self.stream_text_event.set()
        self.is_finished = True
        if self.stream_text_event is not None:
            self.stream_text_event.set()

    def _run_one(self, expr: Expr, site: CallSite | None, reraise_interrupts: bool) -> None:
        """Execute one expression unless an earlier one failed, keeping its error for the state's
        readers; in the program's own thread an interrupt (Ctrl-C, SystemExit) also goes on up."""
        if self.error_ is not None:
            return
        try:
            self._execute(expr)
        except BaseException as e:  # noqa: BLE001 - kept and re-raised to the caller
            self._fail(e, site)
            if reraise_interrupts and not isinstance(e, Exception):
                raise

    def _fail(self, error: BaseException, site: CallSite | None) -> None:
        where = site.describe() if site is not None else "(unknown line)"
        error.add_note(f"radixlm: in program {self.program_name!r}, {where}")
        self.error_ = error
        for name in [n for n, ev in self.variable_event.items() if not ev.is_set()]:
            self.variables.pop(name, None)  # unfinished (a streamed gen's partial text): no value
        self.release_waiters()

    def release_waiters(self) -> None:  # after an error no queued expression sets its variable
        for ev in list(self.variable_event.values()) + list(self.stream_var_event.values()):
            ev.set()
        if self.stream_text_event is not None:
            self.stream_text_event.set()

    def _execute(self, expr: Expr) -> None:
        handler = _HANDLERS.get(type(expr))
        if handler is None:
            raise ValueError(f"unknown expression {expr!r}")
        handler(self, expr)

    def _exec_list(self, expr: ExprList) -> None:
        for e in expr.exprs:
            self._execute(e)

    def _exec_constant(self, expr: Constant) -> None:
        self._fill(expr.value)

    def _fill(self, text: str) -> None:
        self.text_ += text
        if self.codec is not None:
            self.pending_ += text

    def _commit(self) -> None:
        if self.codec is not None and self.pending_:
            self.ids_.extend(self.codec.encode(self.pending_))
            self.pending_ = ""

    def _exec_commit(self, expr: Commit) -> None:
        self._commit()
        if expr.pin and self.ids_:
            if self.backend.supports_pin:  # prefill once and lock until the forks join
                self._last_pin = self.backend.pin_prefix(list(self.ids_))
            else:  # at least prefill once, so the forks find it cached
                self.backend.cache_prefix(list(self.ids_))

    def _append_generated_ids(self, text: str, ids: list[int] | None) -> None:
        """Keep a generation's ids that decode to a prefix of its text; the rest is pending."""
        if self.codec is None:
            return
        if ids is None:
            self.pending_ += text
            return
        k, decoded = self.codec.consistent_prefix(ids, text)
        self.ids_.extend(ids[:k])
        self.pending_ += text[len(decoded) :]

    def _resolve(self, gen: Gen) -> tuple[dict[str, Any], dict[str, Any]]:
        return {**self.sampling, **gen.sampling}, {**self.logprob, **gen.logprob}

    def _exec_gen(self, gen: Gen) -> None:
        sampling, logprob = self._resolve(gen)
        self._logprob_text = bool(logprob.pop("return_text_in_logprobs", False))  # applied here, not sent
        self._commit()
        if self.stream:
            text, meta = self._gen_stream(gen, sampling, logprob)
        else:
            out = self.backend.generate(self, sampling, logprob)
            self.text_ += out.text
            self._append_generated_ids(out.text, out.ids)
            text, meta = out.text, with_logprob_text(out.meta, self.codec, self._logprob_text)
        self._set_result(gen.name, convert_value(gen, text, meta), meta)

    def _gen_stream(self, gen: Gen, sampling: dict[str, Any], logprob: dict[str, Any]) -> tuple[str, Any]:
        name = gen.name
        text, ids, meta = "", [], {}
        merged = StreamedLogprobs()
        if name is not None:
            self.variables[name] = ""
            self.stream_chunks[name] = []
            self.stream_text_of[name] = ""
        for chunk in self.backend.generate_stream(self, sampling, logprob):
            text += chunk.text
            ids.extend(chunk.ids or [])
            meta = merged.add(chunk.meta)  # token texts once, at the end: it holds every token so far
            self.text_ += chunk.text
            if name is not None:
                chunk_meta = with_logprob_text(chunk.meta, self.codec, self._logprob_text)
                self.stream_chunks[name].append((chunk.text, chunk_meta))  # before the text wakes readers
                self.variables[name] = self.stream_text_of[name] = text
                self.meta_info[name] = meta
                self.stream_var_event[name].set()
            assert self.stream_text_event is not None
            self.stream_text_event.set()
        self._append_generated_ids(text, ids or None)  # text_ already holds the streamed text
        return text, with_logprob_text(meta, self.codec, self._logprob_text)

    def _set_result(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        self.variables[name] = value
        self.meta_info[name] = meta
        self.variable_event[name].set()
        if name in self.stream_var_event:
            self.stream_var_event[name].set()

    def _exec_select(self, sel: Select) -> None:
        self._commit()
        decision = self.backend.select(self, sel.choices, sel.temperature, sel.choices_method)
        self.text_ += decision.decision
        if self.codec is not None:
            self.ids_ = chosen_prompt(self.codec, self.ids_, sel.choices, decision.decision)
        self._set_result(sel.name, decision.decision, decision.meta_info)

    def _exec_role_begin(self, expr: RoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(
                f"role {expr.role!r} begins inside an open {self.cur_role!r} role; roles do not nest"
            )
        prefix, suffix = self.template.prefix_and_suffix(expr.role, self.messages_)
        self._fill(prefix)
        self.cur_role, self.cur_role_begin_pos, self.cur_role_suffix = expr.role, len(self.text_), suffix

    def _exec_role_end(self, expr: RoleEnd) -> None:
        if self.cur_role != expr.role:
            raise ValueError(f"role end {expr.role!r} does not match the open role {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos :]
        self._fill(self.cur_role_suffix)
        self.messages_.append({"role": expr.role, "content": content})
        self.cur_role = None

    def _exec_scope_begin(self, expr: VarScopeBegin) -> None:
        self._scope_start[expr.name] = len(self.text_)

    def _exec_scope_end(self, expr: VarScopeEnd) -> None:
        if expr.name not in self._scope_start:
            raise ValueError(f"var_scope {expr.name!r} ends without a begin")
        self._set_result(expr.name, self.text_[self._scope_start.pop(expr.name) :], None)

    def _exec_concat(self, expr: ConcatAndAppend) -> None:
        self._commit()
        for state in expr.states:
            kid: Executor = state.stream_executor
            kid_ids = kid.commit_now()
            self.text_ += kid.text_[kid.fork_text_pos :]
            if self.codec is not None:
                self.ids_.extend(kid_ids[kid.fork_ids_pos :])


_HANDLERS: dict[type, Callable[[Executor, Any], None]] = {
    Constant: Executor._exec_constant,
    ExprList: Executor._exec_list,
    Gen: Executor._exec_gen,
    Select: Executor._exec_select,
    RoleBegin: Executor._exec_role_begin,
    RoleEnd: Executor._exec_role_end,
    VarScopeBegin: Executor._exec_scope_begin,
    VarScopeEnd: Executor._exec_scope_end,
    ConcatAndAppend: Executor._exec_concat,
    Commit: Executor._exec_commit,
}
