"""Stream replay in the front of `radixlm serve --dp N`, without replicas: a fake router and
fake replicas behind httpx.MockTransport, whose "model" picks each next token from the whole
sequence so far (a continuation from prompt + output ids yields exactly the uninterrupted
answer). A stream cut mid-way reads, at the client, exactly as the uninterrupted stream (one
`meta_info.resumed` aside); what cannot be continued ends with the error event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from radixlm.backend.server import dp_replay
from radixlm.backend.server.dp_front import create_front

ROUTER = "http://router"
BOS = 1


def _next_token(seq: list[int]) -> int:
    return ord("a") + sum(seq) % 26


def _tokenize(text: str, special: bool) -> list[int]:
    return ([BOS] if special else []) + [ord(c) for c in text]


def _detokenize(ids: list[int], skip_special: bool) -> str:
    return "".join(chr(t) for t in ids if not (skip_special and t == BOS))


class _Cut(httpx.AsyncByteStream):
    """An event stream that sends `events`, then `tail` (part of an event), then fails (the
    replica died) or, with `fail` None, just ends; closing it raises `close_fails` if given."""

    def __init__(
        self, events: list[bytes], tail: bytes, fail: Exception | None, close_fails: Exception | None = None
    ) -> None:
        self.events, self.tail, self.fail, self.close_fails = events, tail, fail, close_fails

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield event
        if self.tail:
            yield self.tail
        if self.fail is not None:
            raise self.fail

    async def aclose(self) -> None:
        if self.close_fails is not None:
            raise self.close_fails


@dataclass
class Upstream:
    """The router and replicas: /generate streams; `cuts[k]` is how the k-th /generate call
    breaks (events sent before it, and what then), missing: it runs to the end."""

    cuts: dict[int, tuple[int, str]] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    stale: set[str] = field(default_factory=set)  # a pooled connection to a killed replica
    reset: set[str] = field(default_factory=set)  # a dying replica resets the connection as it opens
    refuse: set[int] = field(default_factory=set)  # /generate calls answered 400
    crlf: bool = False  # events end in CRLF CRLF, split across chunks
    generate_bodies: list[dict[str, Any]] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        self.calls.append(base + request.url.path)
        if base in self.dead:
            raise httpx.ConnectError("refused", request=request)
        if base in self.stale:
            raise httpx.ReadError("", request=request)
        if base in self.reset:  # as anyio under uvloop reads the reset socket: gone
            raise AttributeError(
                "'NoneType' object has no attribute 'getpeername'", name="getpeername", obj=None
            )
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return _json({"tokens": _tokenize(body["prompt"], body["add_special_tokens"])})
        if request.url.path == "/detokenize":
            return _json({"text": _detokenize(body["tokens"], body["skip_special_tokens"])})
        assert base == ROUTER and request.url.path == "/generate"
        call = len(self.generate_bodies)
        self.generate_bodies.append(body)
        if call in self.refuse:
            return httpx.Response(400, json={"error": {"message": "request id 'x' is already running"}})
        events = _generate(body)
        if self.crlf:
            crlf = [e.replace(b"\n", b"\r\n") for e in events]
            events = [part for e in crlf for part in (e[:-1], e[-1:])]  # CR and LF in two chunks
        if call not in self.cuts:
            return httpx.Response(
                200, headers={"content-type": "text/event-stream"}, content=b"".join(events)
            )
        sent, how = self.cuts[call]
        before = events[:sent]
        if how == "drop":  # the connection drops inside an event
            stream = _Cut(before, events[sent][:9], httpx.RemoteProtocolError("incomplete chunked read"))
        elif how == "drop-unmapped":  # it drops with an error httpx does not map, and fails to close
            stream = _Cut(before, events[sent][:9], OSError("reset"), close_fails=OSError("reset on close"))
        elif how == "router-error":  # the router reports the worker's failure as an event
            error = b'data: {"error": {"message": "Stream error: connection reset"}}\n\n'
            stream = _Cut([*before, error, dp_replay.DONE], b"", None)
        elif how == "refusal":
            error = b'data: {"error": {"message": "bad", "type": "invalid_request_error", "code": 400}}\n\n'
            stream = _Cut([*before, error, dp_replay.DONE], b"", None)
        else:  # "ends": the body ends cleanly before the final event
            stream = _Cut(before, b"", None)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)


def _json(payload: Any) -> httpx.Response:
    """A JSON answer as a stream (as from the network: the front relays it unread)."""
    content = httpx.ByteStream(json.dumps(payload).encode())
    return httpx.Response(200, headers={"content-type": "application/json"}, stream=content)


def _generate(body: dict[str, Any]) -> list[bytes]:
    """The replica's /generate stream: cumulative text and output_ids, one token an event."""
    sp = body.get("sampling_params") or {}
    prompt = body["input_ids"] if "input_ids" in body else _tokenize(body["text"], True)
    rid = body.get("rid") or "replica-made-id"
    out: list[int] = []
    events = []
    for k in range(sp.get("max_new_tokens", 128)):
        out.append(_next_token(prompt + out))
        last = k == sp.get("max_new_tokens", 128) - 1
        meta = {
            "id": rid,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out),
            "cached_tokens": 0 if "input_ids" not in body else len(prompt) - 1,
            "finish_reason": {"type": "length", "length": len(out)} if last else None,
        }
        event = {"text": _detokenize(out, True), "output_ids": list(out), "meta_info": meta}
        events.append(b"data: " + json.dumps(event).encode() + b"\n\n")
    return [*events, dp_replay.DONE]


@pytest.fixture()
def upstream() -> Upstream:
    return Upstream()


def _client(upstream: Upstream, replicas: int = 2) -> Iterator[TestClient]:
    urls = [f"http://replica{i}" for i in range(replicas)]
    app = create_front(ROUTER, urls, transport=httpx.MockTransport(upstream.handle))
    with TestClient(app) as client:
        yield client


def _stream(upstream: Upstream, body: dict[str, Any], replicas: int = 2) -> list[Any]:
    """The client's events (parsed; "[DONE]" as the string)."""
    for client in _client(upstream, replicas):
        with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            text = r.read().decode()
    out: list[Any] = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            out.append("[DONE]" if block == "data: [DONE]" else json.loads(block[6:]))
    return out


def _body(**sp: Any) -> dict[str, Any]:
    return {"text": "Tale 6:", "stream": True, "sampling_params": {"max_new_tokens": 12, **sp}}


def _without_resumed(events: list[Any]) -> list[Any]:
    for e in events:
        if isinstance(e, dict):
            e.get("meta_info", {}).pop("resumed", None)
    return events


@pytest.mark.parametrize("how", ["drop", "router-error", "ends"])
def test_a_cut_stream_reads_as_the_uninterrupted_one(upstream: Upstream, how: str) -> None:
    whole = _stream(Upstream(), _body())
    upstream.cuts = {0: (5, how)}
    resumed = _stream(upstream, _body())
    assert resumed[-1] == "[DONE]" and resumed[-2]["meta_info"]["resumed"] == 1
    assert _without_resumed(resumed) == whole
    final = whole[-2]
    assert final["meta_info"]["completion_tokens"] == 12 and len(final["output_ids"]) == 12
    # the continuation: the prompt as the engine tokenizes it + the 5 ids sent, 7 tokens more
    cont = upstream.generate_bodies[1]
    assert cont["input_ids"] == _tokenize("Tale 6:", True) + whole[4]["output_ids"]
    assert "text" not in cont and cont["sampling_params"]["max_new_tokens"] == 7
    assert cont["rid"] == "replica-made-id"  # the answer keeps one id


@pytest.mark.parametrize("how", ["refuses", "stale", "reset"])
def test_a_dead_replica_is_skipped_for_tokenization(upstream: Upstream, how: str) -> None:
    upstream.cuts = {0: (3, "drop")}
    {"refuses": upstream.dead, "stale": upstream.stale, "reset": upstream.reset}[how].add("http://replica0")
    events = _stream(upstream, _body(min_new_tokens=10))
    assert events[-2]["meta_info"]["completion_tokens"] == 12
    assert upstream.generate_bodies[1]["sampling_params"]["min_new_tokens"] == 7
    for client in _client(upstream):  # the front's own replica paths skip it too
        for _ in range(2):  # whichever replica the rotation tries first
            assert client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": False}).json() == {
                "tokens": [97, 98]
            }


def test_input_ids_prompt_needs_no_tokenization(upstream: Upstream) -> None:
    body = {"input_ids": [5, 6, 7], "stream": True, "rid": "mine", "sampling_params": {"max_new_tokens": 9}}
    whole = _stream(Upstream(), body)
    upstream.cuts = {0: (4, "drop")}
    assert _without_resumed(_stream(upstream, body)) == whole
    assert not any(c.endswith("/tokenize") for c in upstream.calls)
    assert upstream.generate_bodies[1]["input_ids"] == [5, 6, 7] + whole[3]["output_ids"]
    assert whole[-2]["meta_info"]["id"] == "mine"


def test_a_cut_before_any_event_sends_the_request_again(upstream: Upstream) -> None:
    upstream.cuts = {0: (0, "drop")}
    events = _stream(upstream, _body())
    assert _without_resumed(events) == _stream(Upstream(), _body())
    assert upstream.generate_bodies[1]["text"] == "Tale 6:"


def test_each_continuation_needs_another_replica(upstream: Upstream) -> None:
    upstream.cuts = {0: (3, "drop"), 1: (4, "drop")}
    events = _stream(upstream, _body(), replicas=3)  # two may die under one stream
    assert events[-2]["meta_info"]["completion_tokens"] == 12 and events[-2]["meta_info"]["resumed"] == 2
    assert _without_resumed(events) == _stream(Upstream(), _body())
    failed = Upstream(cuts={0: (3, "drop"), 1: (4, "drop")})
    events = _stream(failed, _body(), replicas=2)  # the continuation failed too: an error event
    assert events[-1] == "[DONE]" and "failed mid-way" in events[-2]["error"]["message"]
    assert events[-3]["meta_info"]["completion_tokens"] == 7  # never a shorter answer as complete
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])


@pytest.mark.parametrize(
    "extra",
    [
        {"return_logprob": True},
        {"sampling_params": {"max_new_tokens": 12, "stop": ["\n"]}},
        {"sampling_params": {"max_new_tokens": 12, "json_schema": "{}"}},
        {"sampling_params": {"max_new_tokens": 12, "n": 2}},
        {"sampling_params": {"max_new_tokens": 12, "frequency_penalty": 0.5}},
    ],
)
def test_what_cannot_be_continued_ends_with_the_error_event(
    upstream: Upstream, extra: dict[str, Any]
) -> None:
    upstream.cuts = {0: (5, "drop")}
    events = _stream(upstream, {**_body(), **extra})
    assert events[-1] == "[DONE]" and "failed mid-way" in events[-2]["error"]["message"]
    assert len(upstream.generate_bodies) == 1


def test_a_refusal_mid_stream_is_relayed_not_replayed(upstream: Upstream) -> None:
    upstream.cuts = {0: (2, "refusal")}
    events = _stream(upstream, _body())
    assert events[-2]["error"]["code"] == 400 and events[-1] == "[DONE]"
    assert len(upstream.generate_bodies) == 1


def test_plan_takes_plain_single_streams_only() -> None:
    def plan(body: dict[str, Any]) -> dp_replay.NativeStream | None:
        return dp_replay.plan("POST", "/generate", json.dumps(body).encode())

    neutral = {
        "max_new_tokens": 4,
        "repetition_penalty": 1.0,
        "n": 1,
        "stop": [],
        "temperature": 0.7,
        "seed": 3,
    }
    assert (
        plan({"text": "a", "stream": True, "sampling_params": neutral, "return_logprob": False}) is not None
    )
    assert plan({"text": "a", "stream": True}).max_new_tokens == 128  # type: ignore[union-attr]
    assert plan({"text": "a"}) is None  # not streamed
    assert plan({"text": ["a", "b"], "stream": True}) is None
    assert plan({"input_ids": [[1], [2]], "stream": True}) is None
    assert plan({"text": "a", "stream": True, "sampling_params": [{}]}) is None
    assert plan({"text": "a", "stream": True, "sampling_params": {"regex": "a+"}}) is None
    assert dp_replay.plan("POST", "/v1/completions", b'{"prompt": "a", "stream": true}') is None


def test_the_seam_must_extend_what_the_client_read() -> None:
    stream = dp_replay.plan("POST", "/generate", b'{"text": "a", "stream": true}')
    assert stream is not None
    event = {
        "text": "xy",
        "output_ids": [120, 121],
        "meta_info": {"completion_tokens": 2, "prompt_tokens": 2},
    }
    stream.relay(dp_replay.Event(b"", event))
    with pytest.raises(dp_replay.CannotResume, match="inside a character"):
        stream.continuation([1, 97], "xy\ufffd")
    with pytest.raises(dp_replay.CannotResume, match="does not decode"):
        stream.continuation([1, 97], "xz")
    with pytest.raises(dp_replay.CannotResume, match="re-tokenizes"):
        stream.continuation([1, 97, 98], "xy")
    body = stream.continuation([1, 97], "xyz")  # a held-back tail ("z") reaches the client next
    assert body["input_ids"] == [1, 97, 120, 121] and stream.seam_text == "xyz"
    out = json.loads(stream.relay(dp_replay.Event(b"", {"text": "!", "output_ids": [33]}))[6:])
    assert out["text"] == "xyz!" and out["output_ids"] == [120, 121, 33]


def test_a_refused_continuation_ends_with_the_error_event(upstream: Upstream) -> None:
    upstream.cuts = {0: (5, "drop")}
    upstream.refuse = {1}
    events = _stream(upstream, _body())
    assert events[-1] == "[DONE]" and "already running" in events[-2]["error"]["message"]
    assert events[-3]["meta_info"]["completion_tokens"] == 5


def test_crlf_events_split_across_chunks(upstream: Upstream) -> None:
    whole = _stream(Upstream(), _body())
    upstream.crlf = True
    upstream.cuts = {0: (10, "drop")}  # chunks here: 5 events, then part of the 6th
    assert _without_resumed(_stream(upstream, _body())) == whole
    assert upstream.generate_bodies[1]["sampling_params"]["max_new_tokens"] == 7


def test_an_upstream_failing_outside_httpx_errors_is_still_continued(upstream: Upstream) -> None:
    """httpx does not map a transport's errors on close (nor could it every error a dying
    connection raises): the client must still read the whole answer, never a cut stream."""
    upstream.cuts = {0: (4, "drop-unmapped")}
    assert _without_resumed(_stream(upstream, _body())) == _stream(Upstream(), _body())
    assert len(upstream.generate_bodies) == 2
