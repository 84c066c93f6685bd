"""The --dp front with stored responses (fake router and replicas over httpx's mock transport):
a request naming a stored response (GET, DELETE or cancel of /v1/responses/{id}, or a new
response's previous_response_id) goes to the replica that stores it, whichever replica the router
would pick; a dead replica is skipped in the search; a response no replica stores, and every other
request, goes to the router as before."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from starlette.testclient import TestClient

from radixlm.backend.server.dp_front import create_front, stored_response_id

ROUTER = "http://router"
REPLICAS = [f"http://replica{i}" for i in range(3)]
STORED_IN = {"resp_a": "http://replica2", "resp_b": "http://replica0"}


def _json(status: int, payload: object) -> httpx.Response:
    """A JSON answer as a stream (as from the network: the front relays it unread)."""
    stream = httpx.ByteStream(json.dumps(payload).encode())
    return httpx.Response(status, headers={"content-type": "application/json"}, stream=stream)


class Upstreams:
    def __init__(self, dead: frozenset[str] = frozenset()) -> None:
        self.dead = dead
        self.served: list[tuple[str, str, str]] = []  # (upstream, method, path) of non-lookup calls

    async def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        if base in self.dead:
            raise httpx.ConnectError("refused", request=request)
        path = request.url.path
        rid = path.removeprefix("/v1/responses/").split("/")[0] if path.startswith("/v1/responses/") else None
        if request.method == "GET" and rid is not None and base != ROUTER:
            found = STORED_IN.get(rid) == base
            return _json(200 if found else 404, {"id": rid} if found else {"error": "not found"})
        self.served.append((base, request.method, path))
        return _json(200, {"served_by": base})


@pytest.fixture()
def upstreams() -> Upstreams:
    return Upstreams()


def _front(upstreams: Upstreams) -> Iterator[TestClient]:
    app = create_front(ROUTER, REPLICAS, transport=httpx.MockTransport(upstreams.handle))
    with TestClient(app) as client:
        yield client


def test_a_chained_response_goes_to_the_replica_storing_the_previous_one(upstreams: Upstreams) -> None:
    for client in _front(upstreams):
        for rid, owner in STORED_IN.items():
            r = client.post("/v1/responses", json={"input": "more", "previous_response_id": rid})
            assert r.json() == {"served_by": owner}
        assert client.post("/v1/responses", json={"input": "new"}).json() == {"served_by": ROUTER}


@pytest.mark.parametrize("method,suffix", [("DELETE", ""), ("POST", "/cancel")])
def test_requests_on_a_stored_response_go_to_its_replica(
    upstreams: Upstreams, method: str, suffix: str
) -> None:
    for client in _front(upstreams):
        r = client.request(method, f"/v1/responses/resp_a{suffix}")
        assert r.json() == {"served_by": "http://replica2"}
    assert upstreams.served == [("http://replica2", method, f"/v1/responses/resp_a{suffix}")]


def test_a_retrieve_is_answered_by_the_replica_storing_it(upstreams: Upstreams) -> None:
    for client in _front(upstreams):
        assert client.get("/v1/responses/resp_b").json() == {"id": "resp_b"}


def test_a_dead_replica_is_skipped_and_an_unknown_id_goes_to_the_router() -> None:
    upstreams = Upstreams(dead=frozenset({"http://replica0", "http://replica1"}))
    for client in _front(upstreams):
        r = client.post("/v1/responses", json={"input": "more", "previous_response_id": "resp_a"})
        assert r.json() == {"served_by": "http://replica2"}
        r = client.post("/v1/responses", json={"input": "more", "previous_response_id": "resp_b"})
        assert r.json() == {"served_by": ROUTER}  # its replica is dead: the router answers


def test_which_requests_name_a_stored_response() -> None:
    body = json.dumps({"previous_response_id": "resp_a"}).encode()
    assert stored_response_id("POST", "/v1/responses", body) == "resp_a"
    assert stored_response_id("GET", "/v1/responses/resp_x/input_items", b"") == "resp_x"
    assert stored_response_id("POST", "/v1/responses", b'{"input": "x"}') is None
    assert stored_response_id("POST", "/v1/responses", b"[1, 2]") is None  # not an object
    assert stored_response_id("POST", "/v1/responses", b"{bad") is None
    assert stored_response_id("POST", "/v1/chat/completions", body) is None
    assert stored_response_id("GET", "/v1/responses/", b"") is None
