"""TraceTree: a program run rebuilt from its trace events (docs/studio.md), and its rendering as
a tree for a terminal. Promise: each node's `text` is the concatenation of its text events, so it
equals the node's own text in the program state; the tree needs nothing but the events."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_ANSI = {"generated": "\x1b[1;32m", "select": "\x1b[1;35m", "template": "\x1b[2m", "error": "\x1b[1;31m"}
_RESET = "\x1b[0m"


@dataclass
class TraceNode:
    node: str
    parent: str | None
    index: int | None
    pieces: list[tuple[str, str]] = field(default_factory=list)  # (source, text)
    items: list[Any] = field(default_factory=list)  # pieces, fork ids and select/error events, in order
    stats: dict[str, Any] = field(default_factory=dict)
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(t for _, t in self.pieces)


class TraceTree:
    """Feed events with `add`; read nodes, forks, selects, errors and the final `done` event."""

    def __init__(self) -> None:
        self.program = ""
        self.nodes: dict[str, TraceNode] = {}
        self.forks: dict[str, dict[str, Any]] = {}
        self.selects: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.done: dict[str, Any] | None = None
        self.seq = 0

    @classmethod
    def of(cls, events: list[dict[str, Any]]) -> TraceTree:
        tree = cls()
        for event in events:
            tree.add(event)
        return tree

    @property
    def root(self) -> TraceNode:
        return next(n for n in self.nodes.values() if n.parent is None)

    def branches(self, fork: str) -> list[TraceNode]:
        return [self.nodes[n] for n in self.forks[fork]["branches"]]

    def add(self, ev: dict[str, Any]) -> None:
        if ev.get("seq") != self.seq:
            raise ValueError(f"trace event seq {ev.get('seq')} where {self.seq} was expected")
        self.seq += 1
        kind = ev["type"]
        if kind == "run":
            self.program = ev["program"]
        elif kind == "node":
            self.nodes[ev["node"]] = TraceNode(ev["node"], ev["parent"], ev["index"])
            if ev["parent"] is not None:
                fork = self.forks.setdefault(ev["fork"], {"branches": [], "join": None, "site": ev["site"]})
                if not fork["branches"]:
                    self.nodes[ev["parent"]].items.append(("fork", ev["fork"]))
                fork["branches"].append(ev["node"])
        elif kind == "text":
            node = self.nodes[ev["node"]]
            if ev["start"] != len(node.text):
                raise ValueError(
                    f"text event at {ev['start']} but node {node.node} has {len(node.text)} chars"
                )
            node.pieces.append((ev["source"], ev["text"]))
            node.items.append(("text", ev["source"], ev["text"]))
        elif kind == "select":
            self.selects.append(ev)
            self.nodes[ev["node"]].items.append(("select", ev))
        elif kind == "join":
            self.forks[ev["fork"]]["join"] = ev["mode"]
        elif kind == "node_done":
            self.nodes[ev["node"]].stats = ev["stats"]
            self.nodes[ev["node"]].done = True
        elif kind == "error":
            self.errors.append(ev)
            if ev.get("node") in self.nodes:
                self.nodes[ev["node"]].items.append(("error", ev))
        elif kind == "done":
            self.done = ev

    # ---- the terminal --------------------------------------------------------------------

    def render(self, color: bool = False, width: int = 100) -> str:
        lines = [f"{self.program}" + ("" if self.done is None else f"  ({self._outcome()})")]
        self._render_node(self.root, "", lines, color, width)
        return "\n".join(lines)

    def _outcome(self) -> str:
        assert self.done is not None
        return f"{'ok' if self.done['ok'] else 'failed'} in {self.done['elapsed_s']:.2f} s"

    def _render_node(self, node: TraceNode, pad: str, lines: list[str], color: bool, width: int) -> None:
        title = (
            "root" if node.parent is None else f"branch {node.index + 1 if node.index is not None else '?'}"
        )
        lines.append(f"{pad}● {title} [{node.node}]  {describe_stats(node.stats)}")
        body = pad + "│ "
        text: list[str] = []
        for item in node.items:
            if item[0] == "text":
                text.append(_paint(item[2], item[1], color))
                continue
            _flush(text, body, lines, width)
            if item[0] == "fork":
                self._render_fork(item[1], pad, lines, color, width)
            elif item[0] == "select":
                lines.append(body + _paint(describe_select(item[1]), "select", color))
            elif item[0] == "error":
                lines.append(body + _paint(describe_error(item[1]), "error", color))
        _flush(text, body, lines, width)

    def _render_fork(self, fork: str, pad: str, lines: list[str], color: bool, width: int) -> None:
        info = self.forks[fork]
        site = info.get("site") or {}
        at = f" (line {site['line']})" if site.get("line") else ""
        lines.append(f"{pad}├─ fork {fork}: {len(info['branches'])} branches{at}")
        for n in info["branches"]:
            self._render_node(self.nodes[n], pad + "│  ", lines, color, width)
        lines.append(f"{pad}├─ join {fork} ({info['join'] or 'not joined'})")


def _paint(text: str, source: str, color: bool) -> str:
    code = _ANSI.get(source)
    return f"{code}{text}{_RESET}" if color and code else text


def _flush(text: list[str], prefix: str, lines: list[str], width: int) -> None:
    if not text:
        return
    for line in "".join(text).split("\n"):
        lines.append(prefix + line)
    text.clear()


def describe_stats(stats: dict[str, Any]) -> str:
    if not stats:
        return ""
    ttft = stats.get("ttft_s")
    rate = stats.get("tokens_per_s")
    return (
        f"prompt {stats.get('prompt_tokens', 0)} tok ({stats.get('cached_tokens', 0)} cached) · "
        f"generated {stats.get('generated_tokens', 0)} · TTFT {'–' if ttft is None else f'{ttft:.2f} s'} · "
        f"{'–' if rate is None else f'{rate:.1f}'} tok/s"
    )


def describe_select(ev: dict[str, Any]) -> str:
    scores = ev.get("scores", {}).get("normalized_prompt_logprobs") or []
    parts = [
        f"{'*' if i == ev.get('index') else ''}{c}={scores[i]:.3f}" if i < len(scores) else c
        for i, c in enumerate(ev["choices"])
    ]
    return f"select {ev.get('var')}: {' | '.join(parts)} -> {ev.get('decision')!r}"


def describe_error(ev: dict[str, Any]) -> str:
    where = f" at {ev.get('file')}:{ev.get('line')}" if ev.get("line") else ""
    return f"error {ev['error_type']}: {ev['message']}{where}" + (
        f"\n    {ev['code']}" if ev.get("code") else ""
    )
