"""The server when something under it fails: the engine process killed mid-request (requests in
flight end with a 503 in OpenAI's error shape, the server stops with status 1, and until it has
stopped every route, /health included, answers 503), unexpected exceptions (a JSON 500), a signal
to the whole process group (the engine child ignores it: the server drains, then stops it; it never
outlives its parent) and a request that can never be admitted (400, not a retryable 503). Real
servers on 127.0.0.1: `radixlm.launch_server` subprocesses, or uvicorn threads around a real
EngineProcess or the session Engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
from server_helpers import launch_server

from radixlm.backend.engine_process import EngineProcess
from radixlm.backend.server import ServerThread, create_app
from radixlm.backend.server.runner import ServerLimits

CPU_SERVER = ["--device", "cpu", "--max-total-tokens", "4096", "--log-level", "info"]
LONG = {"max_tokens": 3000, "ignore_eos": True}
CHAT = [{"role": "user", "content": "Write an essay"}]


def _engine_child(server_pid: int) -> psutil.Process:
    """The server's engine process (its spawned child that is not multiprocessing's tracker)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in psutil.Process(server_pid).children():
            cmd = " ".join(child.cmdline())
            if "spawn_main" in cmd and "resource_tracker" not in cmd:
                return child
        time.sleep(0.1)
    raise AssertionError("no engine child process")


def _read_stream(url: str, path: str, body: dict[str, Any], lines: list[str]) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
            lines.extend(x[6:] for x in r.iter_lines() if x.startswith("data: "))

    reader = threading.Thread(target=run)
    reader.start()
    return reader


def _wait(cond: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _engine_error(r: httpx.Response, status: int = 503) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == "server_error", err
    return dict(err)


def test_engine_death_ends_requests_in_flight_and_stops_the_server(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    proc, url = launch_server(CPU_SERVER, log)
    try:
        child = _engine_child(proc.pid)
        plain: list[httpx.Response] = []
        asker = threading.Thread(
            target=lambda: plain.append(
                httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, **LONG}, timeout=120)
            )
        )
        asker.start()
        lines: list[str] = []
        reader = _read_stream(url, "/v1/completions", {"prompt": "Once upon a time", **LONG}, lines)
        _wait(lambda: len(lines) >= 2, "the stream did not start")
        _wait(lambda: httpx.get(url + "/get_load").json()[0]["num_reqs"] == 2, "chat not running")
        child.kill()
        asker.join(60)
        reader.join(60)
        assert "engine process exited" in _engine_error(plain[0])["message"]
        assert lines[-1] == "[DONE]"
        assert _engine_error_event(json.loads(lines[-2]))
        assert proc.wait(timeout=60) == 1  # a supervisor sees the failure
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    text = log.read_text()
    assert "killed by SIGKILL" in text and "stopping the server" in text, text[-2000:]


def _engine_error_event(event: dict[str, Any]) -> bool:
    err = event["error"]
    return bool(err["code"] == 503 and "engine process exited" in err["message"])


@pytest.fixture()
def doomed_engine() -> Iterator[EngineProcess]:
    ep = EngineProcess(device="cpu", max_total_tokens=2048)
    yield ep
    ep.shutdown()


def test_after_engine_death_every_route_answers_503_json(doomed_engine: EngineProcess) -> None:
    """An unexpected exception is a JSON 500; once the engine process died, /health and every
    route that needs the engine answer a JSON 503 that says so (the uvicorn thread is kept from
    stopping itself, to see what a request gets before the server is gone)."""
    ep = doomed_engine
    thread = ServerThread(create_app(ep), drain_timeout_s=1.0)
    server = thread.server
    server.on_tick = lambda counter: uvicorn.Server.on_tick(server, counter)  # type: ignore[method-assign]
    thread.start()
    try:
        h = httpx.Client(base_url=thread.url, timeout=60)
        assert h.get("/health").status_code == 200
        real_stats = ep.get_stats
        ep.get_stats = lambda: {}[0]  # type: ignore[method-assign,index]  # a KeyError
        r = h.get("/get_load")
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert "KeyError" in r.json()["error"]["message"]
        ep.get_stats = real_stats  # type: ignore[method-assign]
        ep._proc.kill()
        _wait(lambda: ep.exit_reason is not None, "the death went unnoticed")
        for r in (
            h.get("/health"),
            h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}),
            h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}),
            h.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
            h.get("/get_load"),
        ):
            assert "engine process exited" in _engine_error(r)["message"]
    finally:
        thread.stop()


def test_sigterm_to_the_process_group_drains_requests_in_flight(tmp_path: Path) -> None:
    """systemd's KillMode=control-group, `timeout` and `kill -- -PGID` signal every process: the
    engine child must keep running the stream until the server has drained it, then go."""
    log = tmp_path / "server.log"
    proc, url = launch_server([*CPU_SERVER, "--drain-timeout", "60"], log, new_session=True)
    try:
        child = _engine_child(proc.pid)
        lines: list[str] = []
        body = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True}
        reader = _read_stream(url, "/v1/completions", body, lines)
        _wait(lambda: len(lines) >= 2, "the stream did not start")
        os.killpg(proc.pid, signal.SIGTERM)
        reader.join(120)
        assert proc.wait(timeout=120) in (0, -signal.SIGTERM)
        child.wait(timeout=30)  # stopped by the server after the drain, not left behind
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length", lines[-3:]
    assert "letting them finish" in log.read_text()


ENGINE_PARENT = """
import sys
from radixlm.backend.engine_process import EngineProcess
ep = EngineProcess(device="cpu", max_total_tokens=2048)
print(ep._proc.pid, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("parent_end", ["returns", "killed"])
def test_engine_child_ignores_sigterm_and_never_outlives_its_parent(parent_end: str) -> None:
    """SIGTERM leaves the child running; a parent that returns without shutdown() (its exit hook
    stops the child; multiprocessing's own would SIGTERM it and wait forever) or is killed (the
    pipe closes) leaves no engine process behind."""
    parent = subprocess.Popen(
        [sys.executable, "-c", ENGINE_PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    watchdog = threading.Timer(180, parent.kill)  # a hung start must not hang the test run
    watchdog.start()
    try:
        assert parent.stdout is not None and parent.stdin is not None
        child = psutil.Process(int(parent.stdout.readline()))
        child.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        if parent_end == "returns":
            parent.stdin.write("\n")
            parent.stdin.flush()
            assert parent.wait(timeout=60) == 0
        else:
            parent.kill()
        child.wait(timeout=60)
    finally:
        watchdog.cancel()
        if parent.poll() is None:
            parent.kill()
            parent.wait(30)


def test_a_request_over_the_pending_limit_is_a_400_not_a_503(engine: Any) -> None:
    """More sequences (prompts × n) than --max-pending-requests can never be admitted: a 503 with
    Retry-After would send the openai client into retries that cannot pass."""
    thread = ServerThread(
        create_app(engine, limits=ServerLimits(max_pending_requests=3)), drain_timeout_s=1.0
    )
    thread.start()
    try:
        h = httpx.Client(base_url=thread.url, timeout=60)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for r in (
            h.post("/v1/chat/completions", json={**chat, "n": 4}),
            h.post("/generate", json={"text": ["a", "b"], "sampling_params": {"n": 2, "max_new_tokens": 2}}),
        ):
            assert r.status_code == 400 and "Retry-After" not in r.headers, r.text
            assert "can never be admitted" in r.json()["error"]["message"]
        assert h.post("/v1/chat/completions", json={**chat, "n": 3}).status_code == 200
    finally:
        thread.stop()
