"""`radixlm trace --timeout` bounds the whole run: a server that keeps streaming events past it
and one that goes silent both end in one line, within about the timeout."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from radixlm.trace_cli import main

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _event(seq: int) -> bytes:
    line = b'data: {"type": "run", "program": "prog", "seq": %d}\n\n' % seq
    return b"%x\r\n" % len(line) + line + b"\r\n"


def _serve(events: int, gap_s: float) -> tuple[socket.socket, int]:
    """One connection: the stream's head, then `events` events `gap_s` apart, never its end."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)

    def serve() -> None:
        try:
            conn, _ = sock.accept()
            conn.recv(65536)
            conn.sendall(HEAD)
            for seq in range(events):
                conn.sendall(_event(seq))
                time.sleep(gap_s)
            time.sleep(5)
            conn.close()
        except OSError:
            return

    threading.Thread(target=serve, daemon=True).start()
    return sock, int(sock.getsockname()[1])


@pytest.fixture
def streaming_server() -> Iterator[str]:
    sock, port = _serve(events=60, gap_s=0.05)
    yield f"http://127.0.0.1:{port}"
    sock.close()


@pytest.fixture
def silent_server() -> Iterator[str]:
    sock, port = _serve(events=1, gap_s=0.0)
    yield f"http://127.0.0.1:{port}"
    sock.close()


def test_a_run_that_streams_past_the_timeout_is_cut(streaming_server: str) -> None:
    start = time.monotonic()
    with pytest.raises(SystemExit, match=r"took longer than --timeout 0.5 s"):
        main([streaming_server, "prog", "--timeout", "0.5", "--json"])
    assert time.monotonic() - start < 2.5


def test_a_silent_server_is_cut_at_the_timeout(silent_server: str) -> None:
    start = time.monotonic()
    with pytest.raises(SystemExit, match=r"no reply within --timeout 0.5 s"):
        main([silent_server, "prog", "--timeout", "0.5"])
    assert time.monotonic() - start < 2.5


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_the_timeout_must_be_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["http://127.0.0.1:9", "prog", "--timeout", value])
    assert "must be a positive number of seconds" in capsys.readouterr().err
