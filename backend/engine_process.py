"""EngineProcess: the Engine in a child process, behind the Engine API the server and programs use
(generate, async_generate, abort_request, flush_cache, get_stats, pin/unpin_prefix, shutdown).
The scheduler then never competes for a GIL with the HTTP event loop. Results cross the pipe in
one message per batch of chunks. Promises: bad input raises ValueError in the caller exactly as
in-process; every request gets its final chunk or an error (EngineDied where the child exited on
its own); the child never outlives the parent, and only the parent stops it (it ignores SIGINT and
SIGTERM, so a signal to the whole process group leaves the parent to drain and then stop it).
Messages are Python objects this server built itself, serialized by multiprocessing between its
own two processes; no bytes from a client are ever deserialized as objects."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import queue
import signal
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import Any, cast

import torch

from .embeddings import KVPoolBusy
from .engine_child import child_main
from .loop_mailbox import LoopMailbox, coalesce_chunks
from .spawned import died_while_starting
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
_live: weakref.WeakSet[EngineProcess] = weakref.WeakSet()
_exit_hook_registered = False


class EngineDied(RuntimeError):
    """The engine process exited while this process still needed it (killed, crashed): the
    requests it was running end with this, and so does every later call."""


def _stop_live_children() -> None:
    """At interpreter exit, before multiprocessing's own exit hook: that one would SIGTERM the
    child (which ignores it) and then wait for it forever."""
    for ep in list(_live):
        try:
            ep.shutdown()
        except Exception:  # one engine's failure must not keep the others running
            logger.exception("engine process shutdown at exit failed")


class _Waiter:
    """Where one generate call's messages go: per-request queues (asyncio or thread) and the ack."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.box = LoopMailbox.for_loop(loop) if loop is not None else None
        self.queues: dict[int, Any] = {}
        # the child's ack of a generate call ((rids, single)) or a call's reply, as unpickled
        self.ack: Future[Any] = Future()
        self.lock = threading.Lock()
        self.abandoned = False  # the caller went away before the ack: abort its requests on arrival
        # the engine process is gone: every queue ends with this (an abort chunk, or EngineDied)
        self.failed: dict[str, Any] | EngineDied | None = None

    def queue(self, k: int) -> Any:
        with self.lock:
            q = self.queues.get(k)
            if q is None:
                q = self.queues[k] = asyncio.Queue() if self.loop is not None else queue.Queue()
                if self.failed is not None:
                    q.put_nowait(self.failed)
            return q

    def fail(self, last: dict[str, Any] | EngineDied) -> None:
        """End every request of this call with `last`, also those not yet waited on."""
        with self.lock:
            self.failed = last
            ks = list(self.queues)
        for k in ks:
            self.deliver(k, last)

    def deliver(self, k: int, item: dict[str, Any] | EngineDied) -> None:
        q = self.queue(k)
        if self.box is not None:
            self.box.post(q, item)
        else:
            q.put(item)


class EngineProcess:
    def __init__(self, start_timeout_s: float = 1800.0, **engine_kwargs: Any) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_conn = ctx.Pipe()
        # a daemon dies with this process, but may not start processes: tensor-parallel ranks
        # need a parent that may (the child still exits when its pipe to us closes)
        daemon = engine_kwargs.get("tp_size", 1) == 1
        self._proc = ctx.Process(
            target=child_main, args=(child_conn, engine_kwargs), name="radixlm-engine", daemon=daemon
        )
        self._proc.start()
        child_conn.close()
        _register_exit_hook()  # now, after multiprocessing registered its own: ours runs first
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {start_timeout_s:.0f} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:  # gone before it could say why
            self._proc.join(10)
            raise died_while_starting(self._proc, "the engine process") from None
        if kind != "ready":
            self._proc.join(10)
            raise _start_error(info)
        self.model_config = info["model_config"]
        self.model_path: str = info["model_path"]
        self.device = torch.device(info["device"])
        self.eos_token_ids = info["eos_token_ids"]
        self.tokenizer = load_tokenizer(info["tokenizer_source"])
        self._ids = itertools.count()
        self._waiters: dict[int, _Waiter] = {}
        self._send_lock = threading.Lock()
        self._closed = False
        self._stopping = False  # shutdown() began: the child's exit is expected
        # why the child exited on its own; None while it runs or once it was shut down
        self.exit_reason: str | None = None
        _live.add(self)
        self._reader = threading.Thread(target=self._read, name="radixlm-engine-reader", daemon=True)
        self._reader.start()

    # ---- the pipe ------------------------------------------------------------------------
    def _send(self, msg: tuple[object, ...]) -> None:
        if self._closed:
            if self.exit_reason is not None:
                raise EngineDied(self.exit_reason)
            raise RuntimeError("engine is shut down")
        with self._send_lock:
            self._conn.send(msg)

    def _read(self) -> None:
        try:
            while True:
                for msg in self._conn.recv():
                    self._dispatch(msg)
        except (EOFError, OSError):
            pass
        if self._stopping:
            self._fail_all("engine is shut down")
            return
        self.exit_reason = "the engine process exited unexpectedly"
        self._closed = True  # from here calls raise EngineDied instead of writing to a dead pipe
        self._proc.join(5)
        self.exit_reason += f" ({_exit_status(self._proc.exitcode)})"
        logger.error("%s", self.exit_reason)
        self._fail_all(self.exit_reason)

    def _dispatch(self, msg: tuple[Any, ...]) -> None:  # as the child's Outbox sent it, unpickled
        kind, call_id = msg[0], msg[1]
        waiter = self._waiters.get(call_id)
        if waiter is None:
            return
        if kind == "chunk":
            waiter.deliver(msg[2], msg[3])
        elif kind == "ack":
            if waiter.abandoned:
                self._waiters.pop(call_id, None)
                for rid in msg[2][0]:
                    self.abort_request(rid)
            waiter.ack.set_result(msg[2])
        elif kind == "error":
            waiter.ack.set_exception(_rebuild(msg[2]))
            self._waiters.pop(call_id, None)
        elif kind == "reply":
            self._waiters.pop(call_id, None)
            waiter.ack.set_result(msg[2])

    def _fail_all(self, why: str) -> None:
        """End every waiting call: with EngineDied after an exit of the child's own, else (a
        shutdown) with an abort chunk per request."""
        self._closed = True
        died = self.exit_reason is not None
        for call_id, waiter in list(self._waiters.items()):
            if not waiter.ack.done():
                waiter.ack.set_exception(EngineDied(why) if died else RuntimeError(why))
            waiter.fail(EngineDied(why) if died else _aborted(why))
            self._waiters.pop(call_id, None)

    def _start(self, loop: asyncio.AbstractEventLoop | None, kwargs: dict[str, Any]) -> tuple[int, _Waiter]:
        call_id = next(self._ids)
        waiter = _Waiter(loop)
        self._waiters[call_id] = waiter
        try:
            self._send(("generate", call_id, kwargs))
        except Exception:
            self._waiters.pop(call_id, None)
            raise
        return call_id, waiter

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        call_id = next(self._ids)
        waiter = _Waiter(None)
        self._waiters[call_id] = waiter
        self._send(("call", call_id, method, (args, kwargs)))
        return waiter.ack.result()

    # ---- the Engine API ------------------------------------------------------------------
    def generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        stream: bool = False,
        **kw: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        call_id, waiter = self._start(
            None,
            dict(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids, stream=stream, **kw),
        )
        rids, single = waiter.ack.result()  # raises the child's ValueError as is
        if stream:
            return self._stream_sync(call_id, waiter, rids[0])
        try:
            outs = [_chunk(waiter.queue(k).get()) for k in range(len(rids))]
        finally:
            self._waiters.pop(call_id, None)
        return outs[0] if single else outs

    def _stream_sync(self, call_id: int, waiter: _Waiter, rid: str) -> Iterator[dict[str, Any]]:
        done = False
        try:
            while not done:
                chunk = _chunk(waiter.queue(0).get())
                done = chunk["meta_info"].get("finish_reason") is not None
                yield chunk
        finally:
            self._waiters.pop(call_id, None)
            if not done:
                self.abort_request(rid)

    async def async_generate(
        self,
        prompt: Any = None,
        sampling_params: Any = None,
        input_ids: Any = None,
        stream: bool = False,
        **kw: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        call_id, waiter = self._start(
            asyncio.get_running_loop(),
            dict(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids, stream=stream, **kw),
        )
        try:
            rids, single = await asyncio.shield(asyncio.wrap_future(waiter.ack))
        except asyncio.CancelledError:
            waiter.abandoned = True  # its requests are aborted when the child acknowledges them
            if waiter.ack.done() and not waiter.ack.exception():
                for rid in waiter.ack.result()[0]:
                    self.abort_request(rid)
            raise
        if stream:
            return self._stream_async(call_id, waiter, rids[0])
        try:
            outs = [_chunk(await waiter.queue(k).get()) for k in range(len(rids))]
        except asyncio.CancelledError:
            for rid in rids:
                self.abort_request(rid)
            raise
        finally:
            self._waiters.pop(call_id, None)
        return outs[0] if single else outs

    async def _stream_async(self, call_id: int, waiter: _Waiter, rid: str) -> AsyncIterator[dict[str, Any]]:
        done = False
        q = waiter.queue(0)
        try:
            while not done:
                chunk = coalesce_chunks(_chunk(await q.get()), q)
                done = chunk["meta_info"].get("finish_reason") is not None
                yield chunk
        finally:
            self._waiters.pop(call_id, None)
            if not done:
                self.abort_request(rid)

    def abort_request(self, rid: str) -> None:
        if not self._closed:
            self._send(("abort", rid))

    def flush_cache(self) -> bool:
        return bool(self._call("flush_cache"))

    def get_stats(self) -> dict[str, int]:
        return cast(dict[str, int], self._call("get_stats"))

    def encode_vectors(
        self, prompt: Any = None, input_ids: Any = None, pooling: str = "last"
    ) -> list[list[float]]:
        return cast(
            list[list[float]],
            self._call("encode_vectors", prompt=prompt, input_ids=input_ids, pooling=pooling),
        )

    def pin_prefix(self, input_ids: list[int]) -> int:
        return cast(int, self._call("pin_prefix", list(input_ids)))

    def unpin_prefix(self, handle: int) -> None:
        self._call("unpin_prefix", handle)

    def shutdown(self) -> None:
        """Stop the child (it finishes nothing: abort or drain first) and wait for it, also
        after it exited on its own, so it is never left a zombie."""
        if self._stopping:
            return
        self._stopping = True
        _live.discard(self)
        try:
            self._send(("shutdown",))
        except (OSError, RuntimeError):
            pass
        self._closed = True
        self._proc.join(60)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._fail_all(self.exit_reason or "engine is shut down")

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        _exit_hook_registered = True
        atexit.register(_stop_live_children)


def _chunk(item: dict[str, Any] | EngineDied) -> dict[str, Any]:
    """A request's next chunk, raising where its queue says the engine process died."""
    if isinstance(item, EngineDied):
        raise EngineDied(str(item))
    return item


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _aborted(why: str) -> dict[str, Any]:
    return {"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": why}}}


class EngineStartError(RuntimeError):
    """The engine process could not start, for a reason other than a bad option."""


def _start_error(err: tuple[str, str]) -> Exception:
    """A bad option (ValueError, TypeError) as itself; any other failure as EngineStartError."""
    kind, message = err
    if kind in ("ValueError", "TypeError"):
        return _rebuild(err)
    return EngineStartError(f"the engine process failed to start: {kind}: {message}")


def _rebuild(err: tuple[str, str]) -> Exception:
    """The child's exception as the same type where it is a built-in one (ValueError stays
    ValueError) or KVPoolBusy (the server answers it with 503), else RuntimeError."""
    kind, message = err
    types: dict[str, type[Exception]] = {
        "ValueError": ValueError,
        "RuntimeError": RuntimeError,
        "TypeError": TypeError,
        "KVPoolBusy": KVPoolBusy,
    }
    return types.get(kind, RuntimeError)(message)
