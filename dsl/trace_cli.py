"""`radixlm trace URL PROGRAM [--args k=v ...]`: run a registered program on a radixlm server
through its trace stream (POST /programs/{name}/trace) and print the run as a tree, live lines
while it runs; `--json` prints the raw events instead. Exit status 1 when the program raised."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx

from radixlm.backend.arg_types import positive_seconds
from radixlm.trace_view import TraceTree, describe_error, describe_select


def trace_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixlm trace",
        description="Run a program registered on a radixlm server and print its trace as a tree.",
        epilog="example: radixlm trace http://127.0.0.1:30000 tree_of_thought --args problem='2+3?' width=2",
    )
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:30000")
    p.add_argument("program", help="a program name (GET /programs lists them)")
    p.add_argument(
        "--args", nargs="*", default=[], metavar="NAME=VALUE",
        help="program arguments; a VALUE that parses as JSON is taken as JSON, else as a string",
    )  # fmt: skip
    p.add_argument("--api-key", default=None, help="the server's API key")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default max_new_tokens of each gen")
    p.add_argument("--temperature", type=float, default=None, help="default temperature (0: greedy)")
    p.add_argument("--json", action="store_true", help="print the events as JSON lines")
    p.add_argument("--no-color", action="store_true", help="no ANSI colours in the tree")
    p.add_argument("--timeout", type=positive_seconds, default=600.0, help="seconds to wait for the run")
    return p


def parse_args_list(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"radixlm trace: --args takes NAME=VALUE, got {item!r}")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value
    return out


def stream_events(url: str, program: str, body: dict[str, Any], api_key: str | None,
                  timeout: float) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The run's events; SystemExit once the whole run has taken longer than `timeout` seconds."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout) as client:
        with client.stream("POST", f"/programs/{program}/trace", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise SystemExit(f"radixlm trace: HTTP {r.status_code}: {_message(r)}")
            for line in r.iter_lines():
                if time.monotonic() > deadline:
                    raise SystemExit(f"radixlm trace: the run took longer than --timeout {timeout:g} s")
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    if data == "[DONE]":
                        return
                    yield json.loads(data)


def _message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except Exception:  # noqa: BLE001 - not our error shape: show the body
        return r.text[:500]


def live_line(ev: dict[str, Any]) -> str | None:
    """One line for the events worth seeing while the run goes on."""
    kind = ev["type"]
    if kind == "fork":
        return f"[{ev['t']:7.2f}s] {ev['node']} forks into {', '.join(ev['branches'])}"
    if kind == "gen_done":
        return f"[{ev['t']:7.2f}s] {ev['node']} gen {ev.get('var')}: {json.dumps(ev.get('value'))[:80]}"
    if kind == "select":
        return f"[{ev['t']:7.2f}s] {ev['node']} {describe_select(ev)}"
    if kind == "join":
        return f"[{ev['t']:7.2f}s] {ev['node']} joins {', '.join(ev['branches'])} ({ev['mode']})"
    if kind == "error":
        return f"[{ev['t']:7.2f}s] {describe_error(ev)}"
    return None


def main(argv: list[str]) -> int:
    args = trace_parser().parse_args(argv)
    body: dict[str, Any] = {"args": parse_args_list(args.args)}
    if args.max_new_tokens is not None:
        body["max_new_tokens"] = args.max_new_tokens
    if args.temperature is not None:
        body["temperature"] = args.temperature
    tree = TraceTree()
    try:
        for ev in stream_events(args.url, args.program, body, args.api_key, args.timeout):
            tree.add(ev)
            line = json.dumps(ev, ensure_ascii=False) if args.json else live_line(ev)
            if line is not None:
                print(line, flush=True)
    except httpx.TimeoutException:
        raise SystemExit(f"radixlm trace: no reply within --timeout {args.timeout:g} s") from None
    except httpx.TransportError as e:
        raise SystemExit(f"radixlm trace: cannot reach {args.url}: {e}") from None
    if not args.json and tree.nodes:
        print()
        print(tree.render(color=not args.no_color and sys.stdout.isatty()))
    if tree.done is None:
        print("radixlm trace: the stream ended before the run did", file=sys.stderr)
        return 1
    return 0 if tree.done["ok"] else 1
