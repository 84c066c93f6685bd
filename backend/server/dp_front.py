"""The one URL of `radixlm serve --dp N`: a pass-through proxy that sends every request to
sglang-router, except the routes the router has no route for (it answers 404 to them): program
runs go to one replica chosen by its running program count, so a run and all its forks execute
in that replica's engine and share its KV; tokenization and server facts go to any replica.
Bodies stream through unbuffered; a client that goes away closes the upstream request; a stream
cut by a replica's death ends with an error event."""

from __future__ import annotations

import hmac
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from . import studio

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

    def url(self, target: int | None) -> str:
        return self.router_url if target is None else self.replica_urls[target]

    def _rotation(self) -> list[int]:
        start = next(self._turn)  # ties rotate instead of always picking replica 0
        return [(start + k) % len(self.replica_urls) for k in range(len(self.replica_urls))]


def create_front(router_url: str, replica_urls: list[str], api_key: str | None = None) -> Starlette:
    """The front app. With `api_key`, every path but /health needs it, as on a single server (the
    router's own admin routes, such as /workers, are reachable only through here)."""
    routing = FrontRouting(router_url, replica_urls)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    async def proxy(request: Request) -> Response:
        path = request.url.path
        public = path == "/health" or _is_studio(path)
        if api_key is not None and not public and not _authorized(request, api_key):
            return _error(401, "missing or wrong API key", "authentication_error")
        targets, is_run = routing.targets(request.url.path)
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = await request.body()
        for target in targets:
            upstream = client.build_request(
                request.method, routing.url(target) + path, headers=headers, content=body
            )
            try:
                resp = await client.send(upstream, stream=True)
            except httpx.ConnectError:  # nothing was sent: the next upstream may take it
                continue
            except httpx.HTTPError as exc:
                return _unavailable(routing.url(target), exc)
            counted = target if is_run else None
            if counted is not None:
                routing.running[counted] += 1
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS}
            return StreamingResponse(_relay(resp, routing, counted), resp.status_code, out_headers)
        return _unavailable(", ".join(routing.url(t) for t in targets), httpx.ConnectError("refused"))

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(routes=[Route("/{path:path}", proxy, methods=METHODS)], lifespan=lifespan)
    app.state.routing = routing
    return app


async def _relay(resp: httpx.Response, routing: FrontRouting, replica: int | None) -> AsyncIterator[bytes]:
    """The upstream body, chunk by chunk. An event stream whose upstream breaks (its replica
    died: the router cannot replay a stream it has begun) ends with an error event and [DONE],
    so the client reads why its answer is incomplete instead of a cut connection."""
    events = resp.headers.get("content-type", "").startswith("text/event-stream")
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        if not events:
            raise
        yield _stream_error(exc)
    finally:
        await resp.aclose()  # also when the client left: the upstream request is cancelled
        if replica is not None:
            routing.running[replica] -= 1


def _stream_error(exc: Exception) -> bytes:
    message = (
        f"the replica serving this stream failed mid-way ({type(exc).__name__}); "
        "the answer is incomplete: send the request again"
    )
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    return b"\n\ndata: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


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
