"""The engine process's side of EngineProcess: builds the Engine, answers the parent's messages
(generate, abort, calls, shutdown) and sends results back batched, one pipe message per batch.
Promises: a request is acknowledged (its ids) or refused (the exception) before any wait on it
ends; the process exits when the parent says so or its end of the pipe closes (the parent
exited, even killed), never on SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

CALLS = ("flush_cache", "get_stats", "pin_prefix", "unpin_prefix", "encode_vectors")


class Outbox:
    """Messages for the parent, sent by one thread as lists: many chunks, one pipe write."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.items: list[tuple[object, ...]] = []
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="radixlm-engine-outbox", daemon=True)
        self.thread.start()

    def put(self, msg: tuple[object, ...]) -> None:
        with self.cond:
            self.items.append(msg)
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(10)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.items and not self.closed:
                    self.cond.wait()
                batch, self.items = self.items, []
                closed = self.closed
            if batch:
                try:
                    self.conn.send(batch)
                except (OSError, ValueError):
                    return
            if closed:
                return


def child_main(conn: Connection, engine_kwargs: dict[str, Any]) -> None:
    # the parent stops us, after draining its requests: a signal to the whole process group
    # (Ctrl-C, systemd's stop, `timeout`) must not end the engine under requests it still runs
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from .engine import Engine

        engine = Engine(**engine_kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("failed", (error_kind(e) if isinstance(e, Exception) else type(e).__name__, str(e))))
        return
    source = engine_kwargs.get("tokenizer_path") or engine.tokenizer_source
    conn.send(
        (
            "ready",
            {
                "model_config": engine.model_config,
                "model_path": engine.model_path,
                "device": str(engine.device),
                "eos_token_ids": engine.eos_token_ids,
                "tokenizer_source": None if source is None else str(source),
            },
        )
    )
    outbox = Outbox(conn)
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="radixlm-engine-submit")
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "shutdown":
                break
            if msg[0] == "abort":
                engine.abort_request(msg[1])
            elif msg[0] == "generate":
                pool.submit(_generate, engine, outbox, msg[1], msg[2])
            elif msg[0] == "call":
                pool.submit(_call, engine, outbox, msg[1], msg[2], msg[3])
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
        outbox.close()


def _generate(engine: Any, outbox: Outbox, call_id: int, kw: dict[str, Any]) -> None:
    """Validate, tokenize and submit (waiting for grammars) off the receiving thread."""
    try:
        kw = dict(kw)
        rid = kw.pop("rid", None)
        specs, single = engine._specs(
            kw.pop("prompt"), kw.pop("sampling_params"), kw.pop("input_ids"), rid, **kw
        )
        for spec in specs:
            spec.rid = spec.rid or uuid.uuid4().hex
        reqs = engine._make_reqs(specs, lambda k: lambda item: outbox.put(("chunk", call_id, k, item)))
        engine._submit(reqs)
        outbox.put(("ack", call_id, ([r.rid for r in reqs], single)))
    except Exception as e:  # noqa: BLE001 - the caller gets it, as in-process
        outbox.put(("error", call_id, (error_kind(e), str(e))))


def error_kind(e: Exception) -> str:
    """The built-in type the parent rebuilds e as: its nearest ValueError or TypeError base (a
    UnicodeEncodeError or JSONDecodeError is a bad request like any ValueError), else its own name."""
    names = [c.__name__ for c in type(e).__mro__ if c.__module__ == "builtins"]
    return next((n for n in names if n in ("ValueError", "TypeError")), type(e).__name__)


def _call(
    engine: Any, outbox: Outbox, call_id: int, method: str, args: tuple[tuple[Any, ...], dict[str, Any]]
) -> None:
    try:
        if method not in CALLS:
            raise ValueError(f"unknown engine call {method!r}")
        outbox.put(("reply", call_id, getattr(engine, method)(*args[0], **args[1])))
    except Exception as e:  # noqa: BLE001 - the caller gets it
        outbox.put(("error", call_id, (error_kind(e), str(e))))
