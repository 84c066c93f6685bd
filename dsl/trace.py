"""Tracer: the event log of one traced program run (schema in docs/studio.md). It owns the
numbering of nodes and forks, each node's text offsets, and which committed prompt ranges were
served from the prefix cache. Promise: events are JSON-safe dicts in emission order with a
gapless `seq`; a node's `text` events concatenate to exactly that node's own text."""

from __future__ import annotations

import linecache
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
_DSL_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass
class _Commit:
    """Prompt text tokenized at a commit, not yet sent to the engine."""

    start: int  # node-relative chars
    end: int
    id_start: int  # absolute position in the state's ids
    ids: list[int]
    text: str


@dataclass
class NodeTrace:
    node: str
    fork_text_pos: int
    length: int = 0  # chars of this node's own text emitted so far
    commits: list[_Commit] = field(default_factory=list)
    forks: list[tuple[str, list[str], list[Any]]] = field(default_factory=list)  # open forks
    concatenated: set[str] = field(default_factory=set)  # forks joined by concatenation
    stats: dict[str, Any] = field(
        default_factory=lambda: {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}
    )
    ended: bool = False


def to_json(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy: pydantic models dumped, containers walked, anything else by repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 20:
        return repr(value)
    if hasattr(value, "model_dump"):
        try:
            return value.model_dump(mode="json")
        except Exception:  # noqa: BLE001 - a model that cannot dump is shown by its repr
            return repr(value)
    if isinstance(value, dict):
        return {str(k): to_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v, depth + 1) for v in value]
    return repr(value)


def program_line(error: BaseException) -> dict[str, Any]:
    """The innermost traceback frame outside radixlm's language code (the program's line)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_DSL_DIR)]
    if not frames:
        return {"file": None, "line": None, "function": None, "code": None}
    f = frames[-1]
    return {"file": f.filename, "line": f.lineno, "function": f.name, "code": (f.line or "").strip()}


class Tracer:
    """Collects the events of one run; any thread may emit, readers poll `events_since`."""

    def __init__(self, program: str, args: dict[str, Any], options: dict[str, Any], codec: Any) -> None:
        self.codec = codec
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._n_nodes = 0
        self._n_forks = 0
        self._reported: set[int] = set()
        self.finished = False
        self.emit("run", program=program, args=to_json(args), options=to_json(options))

    # ---- the log ----------------------------------------------------------------------

    def emit(self, type_: str, **fields: Any) -> None:
        with self._lock:
            event = {"v": SCHEMA_VERSION, "seq": len(self._events), "t": self.elapsed(), "type": type_}
            event.update(fields)
            self._events.append(event)

    def events_since(self, start: int) -> list[dict[str, Any]]:
        with self._lock:
            return self._events[start:]

    def elapsed(self) -> float:
        return round(time.perf_counter() - self._t0, 4)

    # ---- nodes --------------------------------------------------------------------------

    def new_node(
        self,
        fork_text_pos: int,
        parent: str | None = None,
        fork: str | None = None,
        index: int | None = None,
        site: Any = None,
    ) -> NodeTrace:
        with self._lock:
            node = NodeTrace(f"n{self._n_nodes}", fork_text_pos)
            self._n_nodes += 1
        self.emit("node", node=node.node, parent=parent, fork=fork, index=index, site=site_json(site))
        return node

    def new_fork(self, parent: NodeTrace, kids: list[Any], site: Any) -> list[NodeTrace]:
        with self._lock:
            fork = f"f{self._n_forks}"
            self._n_forks += 1
        nodes = [self.new_node(k.fork_text_pos, parent.node, fork, i, site) for i, k in enumerate(kids)]
        parent.forks.append((fork, [n.node for n in nodes], list(kids)))
        self.emit("fork", node=parent.node, fork=fork, branches=[n.node for n in nodes], site=site_json(site))
        return nodes

    def joined(self, parent: NodeTrace) -> None:
        """A join released its fork: report the newest open fork whose branches all ended."""
        for k in range(len(parent.forks) - 1, -1, -1):
            fork, branches, kids = parent.forks[k]
            if all(getattr(kid, "_ended", False) for kid in kids):
                del parent.forks[k]
                mode = "concatenate" if fork in parent.concatenated else "gather"
                self.emit("join", node=parent.node, fork=fork, branches=branches, mode=mode)
                return

    def text(self, node: NodeTrace, text: str, source: str, **fields: Any) -> None:
        if not text:
            return
        start = node.length
        node.length += len(text)
        optional = {k: v for k, v in fields.items() if v is not None}  # absent rather than null
        self.emit("text", node=node.node, start=start, text=text, source=source, **optional)

    def node_done(self, node: NodeTrace, text: str) -> None:
        if node.ended:
            return
        node.ended = True
        stats = dict(node.stats)
        stats["computed_tokens"] = stats["prompt_tokens"] - stats["cached_tokens"]
        decode_s, decode_n = stats.pop("decode_s", 0.0), stats.pop("decode_tokens", 0)
        stats["tokens_per_s"] = round(decode_n / decode_s, 2) if decode_s > 0 and decode_n else None
        self.emit("node_done", node=node.node, text=text, stats=stats)

    # ---- prompt tokens and the cache ----------------------------------------------------

    def committed(
        self, node: NodeTrace, start: int, end: int, id_start: int, ids: list[int], text: str
    ) -> None:
        if ids:
            node.commits.append(_Commit(start, end, id_start, list(ids), text))

    def settle(self, node: NodeTrace, cached_tokens: int, purpose: str) -> None:
        """The engine answered a request on this node's ids: the prompt ranges committed since the
        last request were first sent in it; the first `cached_tokens` ids came from the cache."""
        for c in node.commits:
            k = max(0, min(cached_tokens - c.id_start, len(c.ids)))
            node.stats["prompt_tokens"] += len(c.ids)
            node.stats["cached_tokens"] += k
            self.emit(
                "prompt",
                node=node.node,
                start=c.start,
                end=c.end,
                ids=c.ids,
                cached_tokens=k,
                cached_end=c.start + self._chars_of(c, k),
                request=purpose,
            )
        node.commits.clear()

    def _chars_of(self, c: _Commit, k: int) -> int:
        """How many chars of the commit's text its first k ids cover."""
        if k <= 0:
            return 0
        if k >= len(c.ids):
            return len(c.text)
        decoded = self.codec.decode(c.ids[:k]) if self.codec is not None else ""
        if c.text.startswith(decoded):
            return len(decoded)
        return round(len(c.text) * k / len(c.ids))  # a token splits a character: proportional

    # ---- errors and the end -------------------------------------------------------------

    def error(self, node: NodeTrace | None, error: BaseException, site: Any = None) -> None:
        """Report `error` once (an expression's error re-raised by the program is not repeated)."""
        if id(error) in self._reported:
            return
        self._reported.add(id(error))
        where = site_json(site) if site is not None else program_line(error)
        self.emit(
            "error",
            node=None if node is None else node.node,
            error_type=type(error).__name__,
            message=str(error),
            **(where or {}),
        )

    def done(self, ok: bool, text: str, variables: dict[str, Any], return_value: Any) -> None:
        self.emit(
            "done",
            ok=ok,
            text=text,
            variables=to_json(variables),
            return_value=to_json(return_value),
            elapsed_s=self.elapsed(),
        )
        self.finished = True


def site_json(site: Any) -> dict[str, Any] | None:
    if site is None:
        return None
    code = linecache.getline(site.filename, site.lineno).strip()
    return {"file": site.filename, "line": site.lineno, "function": site.function, "code": code}
