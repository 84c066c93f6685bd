"""The server's command line and its life: `radixlm` usage, `serve --help` documents every option, a
busy port is reported before the model loads, and a server stopped by SIGINT or SIGTERM in the
middle of a stream aborts it (SIGINT at once, SIGTERM after --drain-timeout), logs what it does and
each request, and has every KV slot free before it exits. Servers run as real subprocesses."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port, launch_server

from radixlm.backend.server.serve_cmd import serve_parser
from radixlm.cli import main


def test_cli_without_arguments_fails_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code != 0
    assert "usage: radixlm" in capsys.readouterr().err
    main(["--help"])
    out = capsys.readouterr().out
    assert "serve" in out and "run" in out and "examples" in out


def test_serve_help_documents_every_option() -> None:
    parser = serve_parser()
    undocumented = [a.dest for a in parser._actions if not a.help]
    assert undocumented == []
    text = parser.format_help()
    assert "(default: 30000)" in text and "model" in text
    args = parser.parse_args(["some/model.gguf", "--served-model-name", "m"])
    assert args.model == "some/model.gguf" and args.served_model_name == "m"


def test_busy_port_is_reported_before_the_model_loads(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        # a model path that does not exist: reaching the model would fail differently
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "radixlm.cli",
                "serve",
                str(tmp_path / "none.gguf"),
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode != 0
    assert f"127.0.0.1:{port} is already in use" in proc.stderr
    assert "Traceback" not in proc.stderr and "does not exist" not in proc.stderr


@pytest.mark.parametrize(
    "argv,reason",
    [
        (["--port", "70000"], "--port: must be an integer in [0, 65535], got '70000'"),
        (["{tmp}/none.gguf", "--port", "0"], "none.gguf' does not exist (radixlm never downloads weights)"),
        (
            ["--max-running-requests", "0", "--port", "0"],
            "--max-running-requests: must be a positive integer",
        ),
        (["--programs", "{tmp}/missing.py", "--port", "0"], "--programs: program file"),
        (["--log-level", "bogus"], "argument --log-level: invalid choice: 'bogus'"),
        (["--drain-timeout", "-1"], "argument --drain-timeout: must be a number ≥ 0, got '-1'"),
        (["--max-pending-requests", "0"], "argument --max-pending-requests: must be a positive integer"),
    ],
)
def test_startup_mistakes_are_one_line_without_a_traceback(
    tmp_path: Path, argv: list[str], reason: str
) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.run(
        [sys.executable, "-m", "radixlm.cli", "serve", *argv], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode != 0
    assert reason in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_run_against_a_server_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    program = tmp_path / "p.py"
    program.write_text("print('never')\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "radixlm.cli",
            "run",
            "--url",
            f"http://127.0.0.1:{free_port()}",
            str(program),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "radixlm run: cannot use the server at" in proc.stderr and "never" not in proc.stdout


def _start(tmp_path: Path, drain_s: float) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / f"server-{port}.log"
    args = [
        "--device",
        "cpu",
        "--max-total-tokens",
        "4096",
        "--drain-timeout",
        str(drain_s),
        "--log-level",
        "info",
    ]
    proc, url = launch_server(args, log, port=port)
    return proc, url, log


def _long_stream_started(url: str, lines: list[str]) -> threading.Thread:
    """A 3,000-token stream read into `lines` (its `data: ` lines) on a thread, once 3 have come."""
    body = {
        "text": "Tell a long story:",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }

    def stream() -> None:
        with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
            lines.extend(x for x in r.iter_lines() if x.startswith("data: "))

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while len(lines) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) >= 3, "the stream did not start"
    return reader


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_mid_stream_aborts_and_frees_kv(tmp_path: Path, sig: signal.Signals) -> None:
    # SIGINT must not wait for --drain-timeout (far longer than the bounded wait below); SIGTERM
    # drains for 1 s and then aborts the stream, which asks for far more tokens than that allows
    proc, url, log = _start(tmp_path, drain_s=600 if sig == signal.SIGINT else 1)
    lines: list[str] = []
    try:
        reader = _long_stream_started(url, lines)
        proc.send_signal(sig)
        proc.wait(timeout=120)
        reader.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines]
    text = log.read_text()
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "Traceback" not in text and "terminate called" not in text
    assert re.search(r"aborting 1 request|letting them finish", text), text[-2000:]
    kv = re.search(r"KV pool at exit: (\d+) of (\d+) slots free", text)
    assert kv is not None, text[-2000:]
    assert kv.group(1) == kv.group(2)
    assert re.search(r"GET /health 200", text)  # one access-log line per request


def test_a_second_signal_cuts_the_drain_short(tmp_path: Path) -> None:
    proc, url, log = _start(tmp_path, drain_s=600)
    seen: list[str] = []
    try:
        reader = _long_stream_started(url, seen)
        proc.send_signal(signal.SIGTERM)  # drains for up to 600 s
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        assert time.monotonic() - start < 60
        reader.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert seen[-1] == "data: [DONE]" and '"abort"' in seen[-2]
    assert "aborted 1 request(s) at shutdown" in log.read_text()
