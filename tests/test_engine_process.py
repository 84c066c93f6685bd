"""EngineProcess: the Engine API over a pipe to an engine in a child process must behave like the
in-process Engine (same greedy outputs, streams, ValueError on bad input, aborts freeing KV)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from radixlm.backend.engine_process import EngineDied, EngineProcess

GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def proc():
    ep = EngineProcess(max_total_tokens=4096)
    yield ep
    ep.shutdown()


def test_outputs_match_the_in_process_engine(proc, engine) -> None:
    prompts = ["The capital of France is", "1, 2, 3,"]
    assert [o["output_ids"] for o in proc.generate(prompts, GREEDY)] == [
        o["output_ids"] for o in engine.generate(prompts, GREEDY)
    ]
    streamed = list(proc.generate(prompts[0], GREEDY, stream=True))
    assert streamed[-1]["meta_info"]["finish_reason"] is not None
    assert "".join(c["text"] for c in streamed) == engine.generate(prompts[0], GREEDY)["text"]


def test_bad_input_raises_value_error(proc) -> None:
    with pytest.raises(ValueError, match="bogus"):
        proc.generate("x", {"max_new_tokens": 2, "bogus": 1})
    with pytest.raises(ValueError, match="JSON"):
        asyncio.run(proc.async_generate("x", {"json_schema": "{not json"}))


def test_async_stream_abort_frees_kv(proc) -> None:
    async def run() -> tuple[str, list[str]]:
        out = await proc.async_generate("Hello", GREEDY)
        it = await proc.async_generate(
            "Once upon a time", {"max_new_tokens": 200, "ignore_eos": True}, stream=True
        )
        texts = []
        async for chunk in it:
            texts.append(chunk["text"])
            if len(texts) == 2:
                break  # leaving the stream early aborts the request
        await it.aclose()
        return out["text"], texts

    text, texts = asyncio.run(run())
    assert text and len(texts) == 2
    for _ in range(100):  # the abort reaches the scheduler between steps
        if proc.get_stats()["num_running"] == 0:
            break
        time.sleep(0.05)
    assert proc.flush_cache()
    stats = proc.get_stats()
    assert stats["kv_free_slots"] == stats["kv_total_slots"]


def test_pin_prefix_round_trip(proc) -> None:
    ids = proc.tokenizer.encode("a shared document " * 8)
    handle = proc.pin_prefix(ids)
    assert not proc.flush_cache()  # a pinned prefix refuses the flush
    proc.unpin_prefix(handle)
    assert proc.flush_cache()


def test_engine_process_death_ends_every_waiter() -> None:
    """The child killed mid-batch: the blocked caller gets EngineDied (not an empty result that
    looks like an abort), also for the requests it had not started waiting on; later calls raise
    it too, and exit_reason says how the child went."""
    import threading

    ep = EngineProcess(max_total_tokens=2048)
    try:
        threading.Timer(2.0, ep._proc.kill).start()
        with pytest.raises(EngineDied, match="killed by SIGKILL"):
            ep.generate(["a b c", "d e f"], {"max_new_tokens": 2000, "ignore_eos": True})
        with pytest.raises(EngineDied):
            ep.generate("x", GREEDY)
        with pytest.raises(EngineDied):
            ep.get_stats()
        assert ep.exit_reason is not None and "SIGKILL" in ep.exit_reason
    finally:
        ep.shutdown()
    assert ep._proc.exitcode is not None  # reaped, not left a zombie


@pytest.mark.parametrize(
    "exc,kind",
    [
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), "ValueError"),
        (json.JSONDecodeError("bad", "x", 0), "ValueError"),
        (ValueError("v"), "ValueError"),
        (TypeError("t"), "TypeError"),
        (KeyError("k"), "KeyError"),
        (RuntimeError("r"), "RuntimeError"),
    ],
)
def test_child_errors_keep_their_request_error_base(exc: Exception, kind: str) -> None:
    """A ValueError subclass raised in the engine process reaches the caller as ValueError (the
    server's 400), not as the RuntimeError every unknown name becomes."""
    from radixlm.backend.engine_child import error_kind

    assert error_kind(exc) == kind
