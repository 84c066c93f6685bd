"""ProgramState (the `s` a program receives) and ProgramStateGroup (what `s.fork(n)` returns).
Promise: reading a variable, the text or the messages waits for what it needs and raises the
program's error (with its line) if one happened; `+=` on a fork or a streamed state never blocks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.call_site import call_site
from radixlm.interpreter import Executor
from radixlm.ir import (
    ConcatAndAppend,
    Expr,
    ExprList,
    RoleBegin,
    RoleEnd,
    VarScopeBegin,
    VarScopeEnd,
    to_expr,
)


class _Submitted:
    """Returned by `s.user("...")`: already appended, so `s += s.user(...)` adds nothing more."""


SUBMITTED = _Submitted()
STREAM_POLL_S = 0.05  # a stream reader's longest wait for a wake-up it may share with another


class _RoleScope:
    """`s.user()` without content: a context manager (`with s.user(): ...`)."""

    def __init__(self, state: ProgramState, role: str) -> None:
        self._state, self._role = state, role

    def __enter__(self) -> ProgramState:
        self._state.stream_executor.submit(RoleBegin(self._role), call_site())
        return self._state

    def __exit__(self, *exc: Any) -> None:
        self._state.stream_executor.submit(RoleEnd(self._role), call_site())


class ProgramState:
    """The state of a running program: its text, token ids, messages and variables."""

    def __init__(self, executor: Executor) -> None:
        self.stream_executor = executor
        self._chunks_sent: dict[str, int] = {}  # per variable: stream chunks already yielded
        self.ret_value: Any = None

    # ---- appending --------------------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        if other is not SUBMITTED:
            self.stream_executor.submit(other, call_site())
        return self

    def _role(self, role: str, expr: Any) -> Any:
        if expr is None:
            return _RoleScope(self, role)
        self.stream_executor.submit(ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)]), call_site())
        return SUBMITTED

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[ProgramState]:
        ex = self.stream_executor
        ex.submit(VarScopeBegin(name), call_site())
        yield self
        ex.submit(VarScopeEnd(name), call_site())

    # ---- forks ------------------------------------------------------------------------

    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ProgramStateGroup:
        """`size` states that go on from this one's text. SGLang's `position_ids_offset` (its
        interpreter never reads it) is taken as None only: forks continue at the parent's positions."""
        if position_ids_offset is not None:
            raise ValueError(
                "fork(position_ids_offset=...) is not supported: forks continue at their parent's "
                "positions; leave it None"
            )
        kids, handle = self.stream_executor.fork(size, call_site())
        return ProgramStateGroup([ProgramState(k) for k in kids], self, handle)

    @contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator[ProgramState]:
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- reading ----------------------------------------------------------------------

    def _synced(self) -> Executor:
        ex = self.stream_executor
        ex.sync()
        ex.raise_error()
        return ex

    def text(self) -> str:
        return self._synced().text_

    def messages(self) -> list[dict[str, Any]]:
        return list(self._synced().messages_)

    def token_ids(self) -> list[int]:
        """The state's token ids (its pending text tokenized now)."""
        return self.stream_executor.commit_now()

    def sync(self) -> None:
        self._synced()

    def error(self) -> BaseException | None:
        self.stream_executor.sync()
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def __repr__(self) -> str:
        # never raises: a debugger, a log line or a test report shows a failed state too
        ex = self.stream_executor
        ex.sync()
        if ex.error_ is not None:
            return f"ProgramState({ex.text_!r}, failed: {ex.error_!r})"
        return f"ProgramState({ex.text_!r})"

    # ---- streaming --------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        ex = self.stream_executor
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        if var_name is None:
            yield from self._iter_text(ex)
        else:
            yield from self._iter_var(ex, var_name)
        ex.raise_error()

    # Readers share one event per stream and each clears it, so a reader may miss a wake-up that
    # another took (or come after the last one): waits are bounded, and "done" is read before the
    # text, so the read after it sees everything.
    @staticmethod
    def _iter_text(ex: Executor) -> Iterator[str]:
        event, pos = ex.stream_text_event, 0
        assert event is not None
        while True:
            done = ex.is_finished
            if not done:
                event.wait(STREAM_POLL_S)
                event.clear()
            out = ex.text_[pos:]
            pos += len(out)
            if out:
                yield out
            if done:
                return

    @staticmethod
    def _iter_var(ex: Executor, name: str) -> Iterator[str]:
        event = ex.stream_var_event.get(name)
        while event is None:
            if ex.is_finished:  # the program never set it: one empty chunk, as SGLang yields
                yield ""
                return
            assert ex.stream_text_event is not None
            ex.stream_text_event.wait(STREAM_POLL_S)
            event = ex.stream_var_event.get(name)
        pos = 0
        while True:
            done = ex.variable_event[name].is_set()
            if not done:
                event.wait(STREAM_POLL_S)
                event.clear()
            text = ex.stream_text_of.get(name)  # a typed gen's variable is its value, not text
            value = text if text is not None else ex.variables.get(name, "")
            out = value[pos:] if isinstance(value, str) else ""
            pos += len(out)
            if out:
                yield out
            if done:
                return

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """Async version of text_iter. With return_meta_data and a variable, yields (chunk, meta)
        per backend chunk as SGLang does: meta carries that chunk's own output_token_logprobs and
        the running output_token_logprobs_length (get_meta_info(name) has the whole lists); a
        select's (or var_scope's) value comes as one chunk with its whole meta (None for a scope).
        Without a variable it yields text chunks alone, return_meta_data or not (SGLang too)."""
        if return_meta_data and var_name is not None:
            it: Iterator[Any] = self._iter_var_chunks(var_name)
        else:
            it = self.text_iter(var_name)
        done = object()
        while True:
            item = await asyncio.to_thread(next, it, done)
            if item is done:
                return
            yield item

    def _iter_var_chunks(self, name: str) -> Iterator[tuple[str, Any]]:
        ex = self.stream_executor
        if not ex.stream:
            yield self.get_var(name), self.get_meta_info(name)
            return
        for text in self._iter_var(ex, name):  # wakes on each new chunk; the chunks list is the record
            if name in ex.stream_chunks:
                yield from self._take_chunks(ex, name)
            else:  # a select or var_scope (or a name never set): its value comes whole, no chunks
                yield text, ex.meta_info.get(name)
        yield from self._take_chunks(ex, name)
        ex.raise_error()

    def _take_chunks(self, ex: Executor, name: str) -> Iterator[tuple[str, Any]]:
        chunks = ex.stream_chunks.get(name, [])
        start = self._chunks_sent.get(name, 0)
        self._chunks_sent[name] = len(chunks)
        yield from chunks[start : len(chunks)]


class ProgramStateGroup:
    """The forks of a state: index with `[i]`, append with `+=` (broadcast, per-fork list,
    or `lambda i: ...`), then `join()`."""

    def __init__(self, states: list[ProgramState], src: ProgramState, pin_handle: Any = None) -> None:
        self.states = states
        self.src_state = src
        self._pin = pin_handle
        self._joined = False

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise ValueError("a fork group's members cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        site = call_site()
        if isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} items for {len(self.states)} forks")
            items = list(other)
        elif isinstance(other, (str, Expr)):
            items = [other] * len(self.states)
        elif callable(other):
            items = [other(i) for i in range(len(self.states))]
        else:
            raise ValueError(f"cannot append a {type(other).__name__} to a fork group")
        for st, item in zip(self.states, items):
            st.stream_executor.submit(item, site)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        if self._joined:
            raise ValueError("this fork group was already joined")
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        self._joined = True
        src = self.src_state.stream_executor
        try:
            for st in self.states:
                st.sync()
            if mode == "gather_variable":
                self._gather(src)
            else:
                src.submit(ConcatAndAppend(self.states), call_site())
                src.sync()
                src.raise_error()
        finally:
            for st in self.states:
                st.stream_executor.end()
            src.release_pin(self._pin)

    def _gather(self, src: Executor) -> None:
        before = set(src.variables)
        for st in self.states:
            kid = st.stream_executor
            for name in kid.variables.keys() - before:
                src.variables.setdefault(name, []).append(kid.variables[name])
                src.meta_info.setdefault(name, []).append(kid.meta_info.get(name))
