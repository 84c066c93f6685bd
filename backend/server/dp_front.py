"""The one URL of `radixlm serve --dp N`: a pass-through proxy that sends every request to
sglang-router, except the routes the router has no route for (it answers 404 to them): program
runs go to one replica chosen by its running program count, so a run and all its forks execute
in that replica's engine and share its KV; tokenization and server facts go to any replica (the
next one where a dead replica refuses or its pooled connection fails).
Bodies stream through unbuffered (event streams event by event: a client never reads half an
event); a client that goes away closes the upstream request.

A stored response lives in the replica that made it: GET, DELETE, cancel and input_items of
/v1/responses/{id} and a new response naming it as previous_response_id go to that replica
(asked in turn).

A streamed native /generate request whose replica dies mid-way (the upstream breaks, or ends,
before the final event) is continued through the router on a live replica: dp_replay.py builds
the continuation (prompt ids + the output ids already sent, the token budget lowered) and
rewrites its events, so the client reads one complete stream. Any other stream cut by a
replica's death (OpenAI streams, requests that cannot be continued, a continuation that fails
too) ends with an error event and [DONE], never as a shorter answer."""

from __future__ import annotations

import hmac
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from . import dp_replay, studio

# Stored responses live in the replica that made them: requests naming one go to that replica.
RESPONSES_PATH = "/v1/responses"
# Paths sglang-router does not proxy; program runs among them need one replica per run.
PROGRAM_PREFIX = "/programs"
# The studio page, its assets and its metrics: served by any replica, which also shows the key
# form and checks the key itself (the front would answer a signed-out browser with bare JSON).
STUDIO_PREFIX = "/studio"
REPLICA_PATHS = frozenset(
    {"/tokenize", "/detokenize", "/apply_chat_template", "/get_server_info", "/server_info", "/version"}
)
# Headers that describe one hop, not the message (RFC 9110 section 7.6.1), plus the ones the
# proxy recomputes.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


class FrontRouting:
    """Which upstream serves a path; counts program runs per replica to balance them."""

    def __init__(self, router_url: str, replica_urls: list[str]) -> None:
        self.router_url = router_url
        self.replica_urls = list(replica_urls)
        self.running = [0] * len(replica_urls)
        self._turn = itertools.cycle(range(len(replica_urls)))

    def targets(self, path: str) -> tuple[list[int | None], bool]:
        """Upstreams to try in order (None: the router, i: replica i) and whether the request is
        a program run. A replica that refuses the connection is skipped for the next."""
        if path.startswith(PROGRAM_PREFIX + "/"):  # POST /programs/{name}: a run
            return [*sorted(self._rotation(), key=lambda i: self.running[i])], True
        if path == PROGRAM_PREFIX or path in REPLICA_PATHS or _is_studio(path):
            return [*self._rotation()], False
        return [None], False

    def replicas(self) -> list[int]:
        """Every replica, the first one rotating."""
        return self._rotation()

    def url(self, target: int | None) -> str:
        return self.router_url if target is None else self.replica_urls[target]

    def _rotation(self) -> list[int]:
        start = next(self._turn)  # ties rotate instead of always picking replica 0
        return [(start + k) % len(self.replica_urls) for k in range(len(self.replica_urls))]


def create_front(
    router_url: str,
    replica_urls: list[str],
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """The front app. With `api_key`, every path but /health needs it, as on a single server (the
    router's own admin routes, such as /workers, are reachable only through here). `transport`
    replaces the network (tests)."""
    routing = FrontRouting(router_url, replica_urls)
    network = ResetOnOpenIsConnectError(transport or httpx.AsyncHTTPTransport())
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), transport=network)
    # Each continuation needs a replica other than the ones that died under this stream.
    max_resumes = max(1, len(replica_urls) - 1)

    async def replica_json(path: str, payload: dict[str, Any], headers: dict[str, str]) -> Any:
        """POST to any live replica (tokenization for a continuation)."""
        for target in routing.targets(path)[0]:
            try:
                resp = await client.post(routing.url(target) + path, json=payload, headers=headers)
            except httpx.TransportError:  # a dead replica (also a pooled connection to it): idempotent
                continue
            resp.raise_for_status()
            return resp.json()
        raise dp_replay.CannotResume(f"no replica answered {path}")

    def resumer(headers: dict[str, str]) -> Callable[[dp_replay.NativeStream], Awaitable[httpx.Response]]:
        async def resume(stream: dp_replay.NativeStream) -> httpx.Response:
            text = stream.prompt_text()
            if stream.prompt_ids is None and text is not None:
                # as the engine tokenizes a text prompt: with the tokenizer's special tokens
                out = await replica_json("/tokenize", {"prompt": text, "add_special_tokens": True}, headers)
                stream.prompt_ids = [int(t) for t in out["tokens"]]
            seam_text = None
            if stream.output_ids:
                ask = {"tokens": stream.output_ids, "skip_special_tokens": stream.skip_special_tokens}
                seam_text = str((await replica_json("/detokenize", ask, headers))["text"])
            body = json.dumps(stream.continuation(stream.prompt_ids, seam_text)).encode()
            upstream = client.build_request(
                "POST", router_url + dp_replay.REPLAY_PATH, headers=headers, content=body
            )
            return await client.send(upstream, stream=True)

        return resume

    async def response_owner(response_id: str, headers: dict[str, str]) -> int | None:
        """The replica that stores a response (each keeps its own), or None: then the request
        goes where it would have, which answers that the response is not found."""
        for target in routing.replicas():
            try:
                found = await client.get(
                    f"{routing.url(target)}{RESPONSES_PATH}/{response_id}", headers=headers
                )
            except httpx.TransportError:  # a dead replica stores nothing any longer
                continue
            if found.status_code == 200:
                return target
        return None

    async def proxy(request: Request) -> Response:
        path = request.url.path
        public = path == "/health" or _is_studio(path)
        if api_key is not None and not public and not _authorized(request, api_key):
            return _error(401, "missing or wrong API key", "authentication_error")
        targets, is_run = routing.targets(request.url.path)
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = await request.body()
        stored = stored_response_id(request.method, request.url.path, body)
        if stored is not None and (owner := await response_owner(stored, headers)) is not None:
            targets = [owner]
        replay = dp_replay.plan(request.method, request.url.path, body) if targets == [None] else None
        for target in targets:
            upstream = client.build_request(
                request.method, routing.url(target) + path, headers=headers, content=body
            )
            try:
                resp = await client.send(upstream, stream=True)
            except httpx.ConnectError:  # nothing was sent: the next upstream may take it
                continue
            except httpx.TransportError as exc:
                idempotent = request.method in ("GET", "HEAD") or request.url.path in REPLICA_PATHS
                if is_run or target is None or not idempotent:
                    return _unavailable(routing.url(target), exc)
                # a replica that died after its last answer leaves a pooled connection that
                # fails on use (not a refused connect); the next replica may answer instead
                continue
            except httpx.HTTPError as exc:
                return _unavailable(routing.url(target), exc)
            counted = target if is_run else None
            if counted is not None:
                routing.running[counted] += 1
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
            if dp_replay.is_event_stream(resp):
                out_headers.pop("content-encoding", None)  # events are relayed decoded
            if replay is not None and resp.status_code == 200 and dp_replay.is_event_stream(resp):
                relay = dp_replay.relay_resuming(resp, replay, resumer(headers), max_resumes)
                return StreamingResponse(relay, resp.status_code, out_headers)
            return StreamingResponse(_relay(resp, routing, counted), resp.status_code, out_headers)
        return _unavailable(", ".join(routing.url(t) for t in targets), httpx.ConnectError("refused"))

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(routes=[Route("/{path:path}", proxy, methods=METHODS)], lifespan=lifespan)
    app.state.routing = routing
    return app


class ResetOnOpenIsConnectError(httpx.AsyncBaseTransport):
    """The front's network: `inner`, where a connection reset as it opens fails with
    httpx.ConnectError, as a refused one does. Under uvloop, anyio reads a reset connection's
    socket as None and raises AttributeError when httpcore checks the new connection for TLS; a
    replica killed while the front connects to it resets it so. Nothing was sent yet, so the
    next replica may take the request."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.inner.handle_async_request(request)
        except AttributeError as exc:
            if exc.obj is not None:  # only a socket that is gone (None), no other fault
                raise
            raise httpx.ConnectError(
                f"the connection was reset as it opened ({exc})", request=request
            ) from exc

    async def aclose(self) -> None:
        await self.inner.aclose()


async def _relay(resp: httpx.Response, routing: FrontRouting, replica: int | None) -> AsyncIterator[bytes]:
    """The upstream body, chunk by chunk; an event stream event by event, ending with an error
    event where its upstream breaks (its replica died: the router cannot replay a stream it has
    begun)."""
    try:
        if dp_replay.is_event_stream(resp):
            async for event in dp_replay.relay_events(resp):
                yield event
        else:
            async for chunk in resp.aiter_raw():
                yield chunk
    finally:
        await dp_replay.close_quietly(resp)  # also when the client left: the upstream request is cancelled
        if replica is not None:
            routing.running[replica] -= 1


def stored_response_id(method: str, path: str, body: bytes) -> str | None:
    """The stored response a request names: the id in /v1/responses/{id}[/...], or a new
    response's previous_response_id."""
    if path.startswith(RESPONSES_PATH + "/"):
        return path[len(RESPONSES_PATH) + 1 :].split("/")[0] or None
    if method != "POST" or path != RESPONSES_PATH:
        return None
    try:
        previous = json.loads(body).get("previous_response_id")
    except (ValueError, AttributeError):  # not a JSON object: the replica's 400 says why
        return None
    return previous if isinstance(previous, str) and previous else None


def _is_studio(path: str) -> bool:
    return path == STUDIO_PREFIX or path.startswith(STUDIO_PREFIX + "/")


def _authorized(request: Request, api_key: str) -> bool:
    """The single server's rule: a bearer token, an X-API-Key header or the studio's cookie."""
    given = request.headers.get("authorization", "")
    if given[:7].lower() == "bearer ":
        token = given[7:].strip()
    else:
        token = request.headers.get("x-api-key", "")
    key = api_key.encode()
    cookie = request.headers.get("cookie", "").encode("latin-1")
    return hmac.compare_digest(token.encode(), key) or studio.cookie_authorized(cookie, key)


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> Response:
    body: dict[str, Any] = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return Response(json.dumps(body), status, media_type="application/json", headers=headers)


def _unavailable(base: str, exc: Exception) -> Response:
    message = f"upstream {base} unavailable: {type(exc).__name__}"
    return _error(503, message, "server_error", {"Retry-After": "1"})
