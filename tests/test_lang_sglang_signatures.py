"""SGLang frontend signatures a ported program calls: run's use_thread and n, Runtime's
launch_timeout, trust_remote_code, endpoint and async_generate, RuntimeEndpoint's verify,
chat_template_name and get_model_name. On the session's shared engine (CPU, default model); the
TLS case serves the real app over HTTPS with a throwaway self-signed certificate."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

import radixlm as sgl
from radixlm.backend.server import create_app
from radixlm.backend.server.launch import bind_socket

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def rt(engine):
    return sgl.Runtime(engine=engine)


@sgl.function
def hello(s):
    s += "Hello, my name is" + sgl.gen("a", max_tokens=3)


def test_run_takes_sglangs_use_thread_and_it_changes_no_result(rt):
    reference = hello.run(backend=rt, **GREEDY).text()
    assert hello.run(backend=rt, use_thread=False, **GREEDY).text() == reference
    assert hello.run(backend=rt, use_thread=True, **GREEDY).text() == reference
    streamed = hello.run(backend=rt, use_thread=False, stream=True, **GREEDY)
    assert "".join(streamed.text_iter()) == reference
    assert asyncio.run(hello.arun(backend=rt, use_thread=False, **GREEDY)).text() == reference
    with pytest.raises(ValueError, match="use_thread must be True or False"):
        hello.run(backend=rt, use_thread="no")


def test_run_and_run_batch_take_n_1_and_refuse_more(rt):
    reference = hello.run(backend=rt, **GREEDY).text()
    assert hello.run(backend=rt, n=1, **GREEDY).text() == reference
    assert [st.text() for st in hello.run_batch([{}, {}], backend=rt, n=1, **GREEDY)] == [reference] * 2
    with pytest.raises(ValueError, match=r"run\(n=2\) is not supported: fork"):
        hello.run(backend=rt, n=2)
    with pytest.raises(ValueError, match=r"run\(n=3\) is not supported: fork"):
        hello.run_batch([{}], backend=rt, n=3)


def test_runtime_takes_trust_remote_code_and_refuses_what_is_not_a_bool(engine):
    assert sgl.Runtime(engine=engine, trust_remote_code=True).engine is engine
    with pytest.raises(ValueError, match="trust_remote_code must be True or False"):
        sgl.Runtime(engine=engine, trust_remote_code="yes")


def test_launch_timeout_bounds_the_servers_start(engine, monkeypatch):
    from radixlm.backend.server.launch import RadixServer

    real_startup = RadixServer.startup

    async def slow_startup(self, *args, **kwargs):  # a start that surely misses the timeout
        await asyncio.sleep(2.0)
        return await real_startup(self, *args, **kwargs)

    started = time.monotonic()
    with monkeypatch.context() as m:
        m.setattr(RadixServer, "startup", slow_startup)
        with pytest.raises(RuntimeError, match="server failed to start"):
            sgl.Runtime(engine=engine, launch_server=True, launch_timeout=0.2)
    assert time.monotonic() - started < 30  # the default wait is 30 s
    with pytest.raises(ValueError, match="launch_timeout must be a number of seconds > 0"):
        sgl.Runtime(engine=engine, launch_timeout=0)
    rt = sgl.Runtime(engine=engine, launch_server=True, launch_timeout=60.0)
    try:
        assert httpx.get(rt.url + "/health", timeout=30).status_code == 200
    finally:
        rt.shutdown()
    assert engine.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_runtime_endpoint_is_the_launched_servers(engine, rt):
    with pytest.raises(AttributeError, match="launched no server"):
        rt.endpoint  # noqa: B018
    served = sgl.Runtime(engine=engine, launch_server=True)
    try:
        ep = served.endpoint
        assert isinstance(ep, sgl.RuntimeEndpoint) and ep is served.endpoint
        assert ep.base_url == served.url
        assert ep.get_model_name() == str(engine.model_path)
        assert hello.run(backend=ep, **GREEDY).text() == hello.run(backend=rt, **GREEDY).text()
    finally:
        served.shutdown()


def test_runtime_async_generate_streams_the_text(rt, engine):
    async def chunks() -> list[str]:
        return [
            c async for c in rt.async_generate("The capital of France is", {"max_new_tokens": 5, **GREEDY})
        ]

    got = asyncio.run(chunks())
    ref = engine.generate("The capital of France is", {"max_new_tokens": 5, **GREEDY})["text"]
    assert all(isinstance(c, str) and c for c in got) and "".join(got) == ref

    async def first_then_close() -> str:
        stream = rt.async_generate("Once upon a time", {"max_new_tokens": 4000, "ignore_eos": True})
        first = await anext(stream)
        await stream.aclose()
        return first

    assert asyncio.run(first_then_close())
    deadline = time.monotonic() + 30
    while engine.get_stats()["num_running"]:  # closing the stream aborted its request
        assert time.monotonic() < deadline, "the closed stream's request kept running"
        time.sleep(0.05)


def test_runtime_endpoint_refuses_a_chat_template_name_it_cannot_honour():
    with pytest.raises(ValueError, match="radixlm has no named chat templates"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9", chat_template_name="chatml")  # refused before any request


@pytest.fixture(scope="module")
def https_url(engine, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The real app over HTTPS on 127.0.0.1, with a self-signed certificate for that address."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    cas = folder / "cas"  # a CA folder as OpenSSL reads one: each certificate under its subject hash
    cas.mkdir()
    subject_hash = subprocess.run(
        ["openssl", "x509", "-hash", "-noout", "-in", str(cert)], check=True, capture_output=True, text=True
    ).stdout.strip()
    shutil.copy(cert, cas / f"{subject_hash}.0")
    config = uvicorn.Config(
        create_app(engine), ssl_certfile=str(cert), ssl_keyfile=str(key), log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    sock = bind_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the HTTPS server did not start"
        time.sleep(0.02)
    try:
        yield f"https://127.0.0.1:{sock.getsockname()[1]}", cert
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_runtime_endpoint_verify_is_requests_verify(https_url, engine):
    url, cert = https_url
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        sgl.RuntimeEndpoint(url, tokenizer=engine.tokenizer)  # verify=None: the default CAs
    for verify in (False, str(cert), cert.parent / "cas"):
        ep = sgl.RuntimeEndpoint(url, None, verify, tokenizer=engine.tokenizer)  # SGLang's positions
        try:
            assert ep.get_model_name() == str(engine.model_path)
        finally:
            ep.shutdown()
    with pytest.raises(ValueError, match="no CA bundle file or folder"):
        sgl.RuntimeEndpoint(url, verify=str(cert) + ".missing")
