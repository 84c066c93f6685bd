"""Speculation over HTTP: `radixlm serve --speculative-algorithm ngram` speculates for /generate and
the OpenAI routes (greedy outputs equal to the same request with the per-request field
`speculative_algorithm: "none"`, the engine's counters show accepted drafts), the field is
checked like any sampling key ('draft' on a server without a draft model is a 400 naming the
reason), and serve refuses `--speculative-algorithm draft` without a draft model before loading
the model."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_helpers import free_port, launch_server

DOC = "Invoice 7731: 3x steel bolts, 2x copper pipes, shipped to 42 Harbor Lane, Portsmouth, on 2025-02-11."


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("spec") / "server.log"
    args = ["--device", "cpu", "--speculative-algorithm", "ngram", "--speculative-policy", "always",
            "--log-level", "warning", "--max-total-tokens", "4096"]  # fmt: skip
    proc, base = launch_server(args, log)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(60)


def _accepted(url: str) -> int:
    return (
        httpx.get(url + "/get_server_info", timeout=30).json()["engine_stats"].get("spec_accepted_tokens", 0)
    )


def test_generate_speculates_and_matches_off(url: str) -> None:
    prompt = f"<|im_start|>user\nRepeat exactly: {DOC}<|im_end|>\n<|im_start|>assistant\n"
    sp = {"temperature": 0, "max_new_tokens": 40}
    before = _accepted(url)
    on = httpx.post(url + "/generate", json={"text": prompt, "sampling_params": sp}, timeout=120).json()
    assert _accepted(url) > before
    off = httpx.post(
        url + "/generate",
        json={"text": prompt, "sampling_params": {**sp, "speculative_algorithm": "none"}},
        timeout=120,
    ).json()
    assert on["output_ids"] == off["output_ids"]


def test_openai_field(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": f"Repeat exactly: {DOC}"}]
    outs = [
        client.chat.completions.create(
            model="m",
            messages=msgs,
            max_tokens=32,
            temperature=0,
            extra_body={"speculative_algorithm": alg, "speculative_num_draft_tokens": 3},
        )
        .choices[0]
        .message.content
        for alg in ("ngram", "none")
    ]
    assert outs[0] == outs[1]
    with pytest.raises(openai.BadRequestError, match="needs an engine started with a draft model"):
        client.completions.create(
            model="m", prompt="hi", max_tokens=4, extra_body={"speculative_algorithm": "draft"}
        )


def test_serve_refuses_draft() -> None:
    cmd = [
        sys.executable,
        "-m",
        "radixlm.launch_server",
        "--port",
        str(free_port()),
        "--device",
        "cpu",
        "--speculative-algorithm",
        "draft",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "needs speculative_draft_model_path" in proc.stdout + proc.stderr
