"""Starting a real `radixlm.launch_server` process for the HTTP tests: a free loopback port, the
log in a file (a full pipe would stall the server), and a bounded wait for /health."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(
    args: list[str], log: Path, port: int | None = None, timeout_s: float = 180, new_session: bool = False
) -> tuple[subprocess.Popen, str]:
    """Start the server on 127.0.0.1 with `args`; return (process, base URL) once /health answers
    200. Raises with the log's tail if the process exits first, and kills it past `timeout_s`.
    `new_session`: the server leads its own process group (to signal the group, as systemd does)."""
    port = free_port() if port is None else port
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, text=True, start_new_session=new_session
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not start")
        time.sleep(0.3)


@contextmanager
def openai_on_thread(engine: Any) -> Iterator[Any]:
    """The official openai client against a real uvicorn thread serving `engine` on 127.0.0.1."""
    import openai

    from radixlm.backend.server import ServerThread, create_app

    thread = ServerThread(create_app(engine), drain_timeout_s=2.0).start()
    try:
        yield openai.OpenAI(base_url=f"{thread.url}/v1", api_key="x", max_retries=0)
    finally:
        thread.stop()
