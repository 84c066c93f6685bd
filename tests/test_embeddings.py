"""Embeddings of a generation model: Engine.encode against HF transformers' final hidden state
(last token, and the mean over tokens), the KV pool untouched afterwards, bad input refused, an
embedding waiting for KV room neither starved by queued prompts nor holding them back when waiting
cannot help it, and /v1/embeddings through the official openai client (float and base64)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import openai
import pytest
import torch

from radixlm.backend.server import ServerThread, create_app

TEXTS = ["The cat sat on the mat.", "Rivers run to the sea, and the sea is never full."]


def hf_embedding(hf_model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][
            0
        ]  # after the final norm
    return torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(dim=0), dim=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_encode_matches_hf_hidden_states(engine, hf_model, pooling) -> None:
    vectors = engine.encode_vectors(TEXTS, pooling=pooling)
    for text, vec in zip(TEXTS, vectors):
        ref = hf_embedding(hf_model, engine.tokenizer.encode(text), pooling)
        assert float(torch.dot(ref, torch.tensor(vec))) > 0.9999
    stats = engine.get_stats()
    assert stats["kv_free_slots"] + stats["kv_cached_slots"] == stats["kv_total_slots"]


def test_encode_refuses_bad_input(engine) -> None:
    with pytest.raises(ValueError, match="pooling"):
        engine.encode("x", pooling="max")
    with pytest.raises(ValueError, match="exactly one"):
        engine.encode()
    with pytest.raises(ValueError, match="empty"):
        engine.encode(input_ids=[[]])
    with pytest.raises(ValueError, match="token ids"):
        engine.encode(input_ids=[10**9])


def test_encode_in_a_small_pool_refuses_what_cannot_fit_and_waits_for_what_can() -> None:
    """An input larger than the KV pool is a ValueError (a 400 over HTTP); one that fits but finds
    the pool held by a running request waits for it, and gets the vector it gets alone."""
    import threading

    from radixlm.backend.engine import Engine

    eng = Engine(max_total_tokens=1000)
    try:
        ids = eng.tokenizer.encode(" ".join(f"item{i}" for i in range(3000)))
        with pytest.raises(ValueError, match="KV pool holds"):
            eng.encode(input_ids=ids[:1500])
        alone = eng.encode_vectors(input_ids=ids[:600])[0]
        done = threading.Event()
        busy = threading.Thread(
            target=lambda: (
                eng.generate(
                    input_ids=ids[1000:1700], sampling_params={"max_new_tokens": 60, "ignore_eos": True}
                ),
                done.set(),
            )
        )
        busy.start()
        while eng.get_stats()["num_running"] == 0 and not done.is_set():  # the prompt is in the pool
            threading.Event().wait(0.01)
        assert not done.is_set()  # the request still holds its KV when the embedding asks
        vec = eng.encode_vectors(input_ids=ids[:600])[0]
        busy.join(120)
        assert np.allclose(vec, alone, atol=1e-5)
    finally:
        eng.shutdown()


def test_encode_is_not_starved_by_a_queue_of_generation_requests(monkeypatch) -> None:
    """Prompts that each need most of a small pool, queued deeper than it holds: as each finishes,
    the next takes its room in the same scheduler pass, before the embedding's next try (tries half
    a second apart here, so they rarely land in that pass). The embedding holds the room it waits
    for, so it runs once the request running when it asked is done, not after the whole queue."""
    import threading

    from radixlm.backend import embeddings
    from radixlm.backend.engine import Engine

    monkeypatch.setattr(embeddings, "RETRY_S", 0.5)
    eng = Engine(max_total_tokens=1000, quantization="gguf")  # its GGUF weights: a fast CPU decode
    try:
        ids = eng.tokenizer.encode(" ".join(f"item{i}" for i in range(3000)))
        alone = eng.encode_vectors(input_ids=ids[:600])[0]
        finished: list[int] = []
        params = {"max_new_tokens": 24, "ignore_eos": True}

        def one(k: int) -> None:
            eng.generate(input_ids=ids[k * 7 : k * 7 + 700], sampling_params=params)
            finished.append(k)

        queue = [threading.Thread(target=one, args=(k,)) for k in range(8)]
        for t in queue:
            t.start()
        while not (eng.get_stats()["num_running"] and eng.get_stats()["num_waiting"]):
            threading.Event().wait(0.01)
        vec = eng.encode_vectors(input_ids=ids[:600])[0]
        done_when_embedded = len(finished)
        for t in queue:
            t.join(300)
        assert len(finished) == 8
        assert done_when_embedded <= 3, f"the embedding waited for {done_when_embedded} of 8 queued requests"
        assert np.allclose(vec, alone, atol=1e-5)
    finally:
        eng.shutdown()


def test_an_embedding_that_waiting_cannot_help_holds_nothing_back(monkeypatch) -> None:
    """A pinned prefix leaves too little room for the embedding and nothing runs to free more:
    prompts that fit are still served while it waits, and it fails with KVPoolBusy at its limit."""
    import threading

    from radixlm.backend import embeddings
    from radixlm.backend.engine import Engine

    monkeypatch.setattr(embeddings, "WAIT_S", 4.0)
    eng = Engine(max_total_tokens=1000)
    try:
        ids = eng.tokenizer.encode(" ".join(f"item{i}" for i in range(3000)))
        eng.pin_prefix(ids[2000:2600])
        failed: list[BaseException] = []

        def wait_for_room() -> None:
            try:
                eng.encode(input_ids=ids[:600])
            except embeddings.KVPoolBusy as e:
                failed.append(e)

        waiter = threading.Thread(target=wait_for_room)
        waiter.start()
        threading.Event().wait(0.5)
        out = eng.generate(input_ids=ids[:100], sampling_params={"max_new_tokens": 4, "ignore_eos": True})
        assert waiter.is_alive(), "the embedding gave up before the prompt was served"
        assert len(out["output_ids"]) == 4
        waiter.join(30)
        assert failed and "after waiting 4 s" in str(failed[0])
        assert eng.scheduler.queues.embedding_holds == {}  # the room it held goes back to prompts
    finally:
        eng.shutdown()


def test_v1_embeddings_answers_503_when_the_pool_stays_held(monkeypatch) -> None:
    import httpx

    from radixlm.backend import embeddings
    from radixlm.backend.engine import Engine
    from radixlm.backend.engine_process import _rebuild

    assert isinstance(_rebuild(("KVPoolBusy", "held")), embeddings.KVPoolBusy)  # across the pipe
    monkeypatch.setattr(embeddings, "WAIT_S", 1.0)
    eng = Engine(max_total_tokens=1000)
    thread = ServerThread(create_app(eng), drain_timeout_s=2.0).start()
    try:
        ids = eng.tokenizer.encode(" ".join(f"item{i}" for i in range(3000)))
        eng.pin_prefix(ids[2000:2600])
        r = httpx.post(thread.url + "/v1/embeddings", json={"input": [ids[:600]]}, timeout=60)
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        assert "no room in the KV pool" in r.json()["error"]["message"]
        ok = httpx.post(thread.url + "/v1/embeddings", json={"input": [ids[:100]]}, timeout=60)
        assert ok.status_code == 200 and len(ok.json()["data"]) == 1
    finally:
        thread.stop()
        eng.shutdown()


@pytest.fixture(scope="module")
def client(engine) -> Iterator[openai.OpenAI]:
    thread = ServerThread(create_app(engine), drain_timeout_s=2.0).start()
    try:
        yield openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        thread.stop()


def test_v1_embeddings_with_the_openai_client(client, engine) -> None:
    model = client.models.list().data[0].id
    got = client.embeddings.create(model=model, input=TEXTS)
    direct = engine.encode_vectors(TEXTS)
    assert [d.index for d in got.data] == [0, 1]
    assert np.allclose([d.embedding for d in got.data], direct, atol=1e-6)
    assert got.usage.prompt_tokens == sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
    packed = client.embeddings.create(model=model, input=TEXTS[0])  # the client asks for base64 by default
    assert np.allclose(packed.data[0].embedding, direct[0], atol=1e-6)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="x", dimensions=7)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=model, input=[])
