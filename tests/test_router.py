"""radixlm as sglang-router's worker, end to end on the CPU: `radixlm serve --dp 2` (two replicas of
the default model, the real router from PyPI, the front) on loopback. Shared-prefix traffic lands on
one replica (read from the replicas' own cache counters); a replica killed while requests run loses
none of them (the router retries elsewhere; the front continues a stream it cuts on the live
replica, so the stream completes), a stream that cannot be continued ends with an error event, never
as a shorter answer; SIGTERM stops every process. Skips when sglang-router cannot be imported."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router)")
psutil = pytest.importorskip("psutil")

from radixlm.backend.server.dp import replica_argv  # noqa: E402
from radixlm.backend.server.dp_front import FrontRouting, ResetOnOpenIsConnectError, create_front  # noqa: E402
from radixlm.backend.server.serve_cmd import serve_parser  # noqa: E402

FEW_SHOT = "".join(f"Q: What is {a} plus {a + 3}?\nA: {2 * a + 3}.\n" for a in range(1, 25))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DP:
    def __init__(self, proc: subprocess.Popen[str], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log
        found = re.search(r"over replicas (\S+), (\S+)", log.read_text())
        assert found, log.read_text()[-2000:]
        self.replicas = [found.group(1), found.group(2)]

    def stats(self, replica: str) -> dict[str, int]:
        return httpx.get(replica + "/get_server_info", timeout=10).json()["engine_stats"]

    def generate(self, text: str, max_new_tokens: int = 4, timeout: float = 120) -> dict[str, Any]:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        r = httpx.post(self.url + "/generate", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DP]:
    port = _free_port()
    log = tmp_path_factory.mktemp("dp") / "dp.log"
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--dp", "2", "--port", str(port), "--device", "cpu"]
    cmd += ["--max-total-tokens", "8192", "--drain-timeout", "5", "--log-level", "info"]
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the servers
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while "replicas behind sglang-router" not in log.read_text():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "deployment did not start"
        time.sleep(0.5)
    children = psutil.Process(proc.pid).children(recursive=True)
    deployment = DP(proc, url, log)
    yield deployment
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-3000:]  # stopped cleanly, children first
    time.sleep(1.0)
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []


def test_replica_options_pass_through_without_the_deployments() -> None:
    p = serve_parser()
    args = p.parse_args(["--dp", "3", "--port", "1", "--max-total-tokens", "99", "--disable-radix-cache"])
    argv = replica_argv(p, args)
    assert argv == ["--max-total-tokens", "99", "--disable-radix-cache"]
    assert replica_argv(p, p.parse_args(["--programs", "a.py", "--programs", "b.py"])) == [
        "--programs",
        "a.py",
        "--programs",
        "b.py",
    ]


def test_front_sends_program_runs_to_the_least_busy_replica() -> None:
    routing = FrontRouting("http://router", ["http://r0", "http://r1"])
    assert routing.targets("/generate") == ([None], False)
    assert routing.targets("/v1/chat/completions") == ([None], False)
    assert sorted(routing.targets("/tokenize")[0]) == [0, 1]  # any replica, the other as fallback
    assert routing.targets("/programs")[1] is False  # the list is not a run
    routing.running[:] = [3, 0]
    assert routing.targets("/programs/qa") == ([1, 0], True)
    routing.running[:] = [0, 5]
    assert routing.targets("/programs/qa") == ([0, 1], True)
    assert routing.url(None) == "http://router" and routing.url(1) == "http://r1"


def test_front_serves_the_studio_from_a_replica_and_takes_its_cookie() -> None:
    from starlette.testclient import TestClient

    from radixlm.backend.server import studio

    routing = FrontRouting("http://router", ["http://r0", "http://r1"])
    assert sorted(routing.targets("/studio")[0]) == [0, 1]
    assert sorted(routing.targets("/studio/api/metrics")[0]) == [0, 1]
    assert routing.targets("/studios") == ([None], False)
    down = f"http://127.0.0.1:{_free_port()}"  # refuses: a request that passes the key check gets 503
    with TestClient(create_front(down, [down], api_key="k")) as client:
        assert client.post("/generate", json={}).status_code == 401
        assert client.post("/generate", json={}, headers={"X-API-Key": "k"}).status_code == 503
        cookie = {"cookie": f"{studio.COOKIE}={studio.session_token(b'k').decode()}"}
        assert client.post("/programs/p/trace", json={}, headers=cookie).status_code == 503
        wrong = {"cookie": f"{studio.COOKIE}=x"}
        assert client.post("/programs/p/trace", json={}, headers=wrong).status_code == 401
        assert client.get("/studio").status_code == 503  # the replica shows the key form itself


def _loopback_peer(answer: Callable[[socket.socket], None]) -> socket.socket:
    """A listening loopback socket whose thread hands each accepted connection to `answer`,
    until the socket is closed."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            answer(conn)

    threading.Thread(target=serve, daemon=True).start()
    return sock


def _half_stream_server() -> tuple[socket.socket, int]:
    """An upstream that starts an event stream, sends one event and drops the connection."""

    def answer(conn: socket.socket) -> None:
        conn.recv(65536)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        event = b'data: {"text": "a"}\n\n'
        conn.sendall(head + b"%x\r\n" % len(event) + event + b"\r\n")
        conn.close()

    sock = _loopback_peer(answer)
    return sock, int(sock.getsockname()[1])


def test_front_ends_a_cut_stream_with_an_error_event() -> None:
    """Over real sockets: the event carries text but no output ids, so the front cannot continue
    the stream (tests/test_dp_replay.py has the continued ones) and ends it with the error event."""
    import uvicorn

    upstream, up_port = _half_stream_server()
    app = create_front(f"http://127.0.0.1:{up_port}", [f"http://127.0.0.1:{up_port}"])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.config.port}/generate"
        with httpx.stream("POST", url, json={"text": "x", "stream": True}, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        server.should_exit = True
        thread.join(10)
        upstream.close()
    assert lines[0] == 'data: {"text": "a"}' and lines[-1] == "data: [DONE]"
    assert "failed mid-way" in json.loads(lines[-2][6:])["error"]["message"]


class _ResetAsItOpens(httpcore.AsyncNetworkBackend):
    """anyio's real connections, each reset by the peer as it opens (the peer, `reset_next`,
    resets once told), the reset read before httpcore first looks at the connection: the
    window a replica killed while the front connects to it hits by chance."""

    def __init__(self, reset_next: threading.Event) -> None:
        self.real, self.reset_next, self.opened = httpcore.AnyIOBackend(), reset_next, 0

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self.real.connect_tcp(host, port, timeout, local_address, socket_options)
        self.opened += 1
        self.reset_next.set()
        with contextlib.suppress(httpcore.ReadError):
            await stream.read(1, timeout=10)  # the reset: the transport closes
        return stream

    async def sleep(self, seconds: float) -> None:
        await self.real.sleep(seconds)


def _resetting_peer(reset_next: threading.Event) -> socket.socket:
    """Accepts each connection and resets it (SO_LINGER 0) when `reset_next` is set."""

    def answer(conn: socket.socket) -> None:
        reset_next.wait(10)
        reset_next.clear()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    return _loopback_peer(answer)


def test_a_connection_reset_as_it_opens_is_a_transport_error_under_uvloop() -> None:
    """Real sockets, uvloop, anyio and httpcore: a reset socket's attributes read as None there,
    and httpcore's check of the new connection raises AttributeError; through the front's
    transport it is an httpx transport error, which the front handles (the next replica)."""
    uvloop = pytest.importorskip("uvloop")
    reset_next = threading.Event()
    peer = _resetting_peer(reset_next)
    backend = _ResetAsItOpens(reset_next)
    inner = httpx.AsyncHTTPTransport()
    inner._pool = httpcore.AsyncConnectionPool(network_backend=backend)  # the race, made certain

    async def outcome() -> BaseException | None:
        async with httpx.AsyncClient(transport=ResetOnOpenIsConnectError(inner)) as client:
            try:
                await client.get(f"http://127.0.0.1:{peer.getsockname()[1]}/tokenize", timeout=10)
            except Exception as exc:  # noqa: BLE001 - the test reads which exception
                return exc
        return None

    try:
        failed = uvloop.run(outcome())
    finally:
        peer.close()
    assert backend.opened == 1
    assert isinstance(failed, httpx.TransportError), repr(failed)  # one the front handles


def test_worker_endpoints_answer_through_the_front(dp: DP) -> None:
    assert httpx.get(dp.url + "/health", timeout=10).status_code == 200
    assert "has_chat_template" in httpx.get(dp.url + "/get_server_info", timeout=10).json()
    assert httpx.post(dp.url + "/tokenize", json={"prompt": "hi"}, timeout=10).json()["count"] >= 1
    for replica in dp.replicas:
        assert httpx.get(replica + "/get_load", timeout=10).json()[0]["dp_rank"] == 0
    refused = httpx.post(dp.url + "/generate", json={"text": "a", "return_hidden_states": True}, timeout=30)
    assert refused.status_code == 400 and "hidden states" in refused.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "model": "any"}
    assert httpx.post(dp.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200


def test_a_responses_chain_continues_through_the_front(dp: DP) -> None:
    """sglang-router forwards /v1/responses with SGLang's sampling extras; each turn of a
    previous_response_id chain reaches the replica storing the turn before, wherever the router
    would send it."""
    import openai

    client = openai.OpenAI(base_url=dp.url + "/v1", api_key="x", max_retries=0, timeout=120)
    previous: str | None = None
    input_tokens: list[int] = []
    for turn in range(4):
        r = client.responses.create(
            model="any",
            input=f"Turn {turn}: name a color.",
            max_output_tokens=4,
            temperature=0,
            previous_response_id=previous,
        )
        assert r.previous_response_id == previous
        input_tokens.append(r.usage.input_tokens)  # type: ignore[union-attr]
        previous = r.id
    assert input_tokens == sorted(input_tokens) and len(set(input_tokens)) == 4  # each turn carries the last
    assert client.responses.retrieve(previous).id == previous
    client.responses.delete(previous)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous)


def test_shared_prefix_traffic_stays_on_one_replica(dp: DP) -> None:
    before = {r: dp.stats(r) for r in dp.replicas}
    n = 6
    for i in range(n):
        dp.generate(FEW_SHOT + f"Q: What is {i} plus 7?\nA:")
    after = {r: dp.stats(r) for r in dp.replicas}
    served = {r: after[r]["num_finished"] - before[r]["num_finished"] for r in dp.replicas}
    assert sorted(served.values()) == [0, n], served
    cached = sum(after[r]["cached_prompt_tokens"] - before[r]["cached_prompt_tokens"] for r in dp.replicas)
    computed = sum(
        after[r]["computed_prompt_tokens"] - before[r]["computed_prompt_tokens"] for r in dp.replicas
    )
    assert cached / (cached + computed) > 0.7, (cached, computed)


def test_a_killed_replica_loses_no_request(dp: DP) -> None:
    results: dict[int, Any] = {}
    streaming = threading.Event()

    def plain(i: int) -> None:
        results[i] = dp.generate(f"Story {i}: once upon a time", max_new_tokens=48, timeout=180)

    def stream(i: int) -> None:
        body = {
            "text": f"Tale {i}:",
            "stream": True,
            "rid": f"tale-{i}",
            "sampling_params": {"max_new_tokens": 48, "ignore_eos": True},
        }
        events: list[dict[str, Any]] = []
        with httpx.stream("POST", dp.url + "/generate", json=body, timeout=180) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if i == 6:
                        streaming.set()
        results[i] = events

    threads = [threading.Thread(target=plain, args=(i,)) for i in range(6)]
    threads += [threading.Thread(target=stream, args=(i,)) for i in range(6, 8)]
    for t in threads:
        t.start()
    assert streaming.wait(120), "the stream did not start"
    victim = _replica_running(dp, "tale-6")  # the stream is cut mid-way: the front continues it
    psutil.Process(_pid_listening_on(victim)).kill()
    for t in threads:
        t.join(240)
    for i in range(6):  # every non-streamed request was answered in full, some by a retry
        assert results[i]["meta_info"]["completion_tokens"] == 48, results[i]
    for i in (6, 7):  # every stream completes, a cut one continued on the live replica
        events = results[i]
        assert all("error" not in e for e in events), events[-1]
        last = events[-1]
        assert last["meta_info"]["completion_tokens"] == 48 and len(last["output_ids"]) == 48, last
        assert last["meta_info"]["finish_reason"]["type"] == "length", last
        ids = [e["meta_info"]["id"] for e in events]
        assert ids == [ids[0]] * len(ids)  # one answer, one id, also across the seam
        for before, after in zip(events, events[1:]):  # cumulative text and ids only grow
            assert after["text"].startswith(before["text"]), (before, after)
            assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    assert results[6][-1]["meta_info"]["resumed"] >= 1, results[6][-1]


def _replica_running(dp: DP, rid: str) -> str:
    """The replica running request `rid`: it refuses a second request with that id."""
    probe = {"text": "a", "rid": rid, "sampling_params": {"max_new_tokens": 1}}
    for r in dp.replicas:
        answer = httpx.post(r + "/generate", json=probe, timeout=60)
        if answer.status_code == 400 and "already running" in answer.text:
            return r
    raise AssertionError(f"no replica runs {rid}")


def _pid_listening_on(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    raise AssertionError(f"nothing listens on {url}")
