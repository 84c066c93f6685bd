"""LoopMailbox: hands results from the scheduler thread to one asyncio loop with at most one
wake-up per batch of results (one call_soon_threadsafe, one self-pipe write) instead of one per
streamed token; coalesce_chunks merges stream chunks a slow consumer let pile up. Promises:
items reach their queues in the order they were posted; merged chunks lose no text or ids."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any

_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[tuple[asyncio.Queue[Any], Any]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    @staticmethod
    def for_loop(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        with _registry_lock:
            box = _mailboxes.get(loop)
            if box is None:
                box = _mailboxes[loop] = LoopMailbox(loop)
            return box

    def post(self, q: asyncio.Queue[Any], item: Any) -> None:
        """Called from any thread: q.put_nowait(item) on the loop, soon."""
        with self._lock:
            self._items.append((q, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._scheduled = False
        for q, item in items:
            q.put_nowait(item)


def coalesce_chunks(chunk: dict[str, Any], q: asyncio.Queue[Any]) -> dict[str, Any]:
    """chunk plus the chunks of the same request waiting right behind it in q, as one (text and
    ids concatenated, the last meta_info), so a consumer that fell behind catches up in one event
    instead of many. Chunks carrying logprobs are never merged, and an item that is no chunk
    (the error a failed request ends with) stays in q for the consumer to take."""
    if _has_logprobs(chunk):
        return chunk
    merged: dict[str, Any] | None = None
    while not q.empty() and chunk["meta_info"].get("finish_reason") is None:
        nxt = q._queue[0]  # type: ignore[attr-defined]  # peek: stop before a chunk we must not merge
        if not isinstance(nxt, dict) or _has_logprobs(nxt) or nxt.get("index") != chunk.get("index"):
            break
        q.get_nowait()
        if merged is None:
            merged = {**chunk, "output_ids": list(chunk.get("output_ids", []))}
        merged["text"] = merged.get("text", "") + nxt.get("text", "")
        merged["output_ids"].extend(nxt.get("output_ids", []))
        merged["meta_info"] = nxt["meta_info"]
        chunk = merged
    return chunk


def _has_logprobs(chunk: dict[str, Any]) -> bool:
    meta = chunk.get("meta_info") or {}
    return any(k.endswith("logprobs") for k in meta)
