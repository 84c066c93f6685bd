"""FastAPI app factory: one engine per app. Owns cross-cutting HTTP policy (API key, or the
studio's session cookie, on every route but /health; body-size limit; error shapes: 400 bad
JSON, value or field (as SGLang and vLLM answer what FastAPI would make a 422), 401, 413, 503 +
Retry-After, 503 once the engine process died, 500 for anything unexpected, all in OpenAI's error
shape) and the native SGLang-style routes;
OpenAI, program, trace and studio routes are mounted from their own modules."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine_process import EngineDied
from . import docs, embeddings_api, info, native, openai_api, studio, trace_api
from . import programs as programs_api
from .access_log import AccessLogMiddleware
from .body_text import body_problem
from .metrics import ServerMetrics
from .programs import ProgramRegistry
from .protocol import error_body
from .runner import Overloaded, Runner, ServerLimits
from .streams import ClientGone, error_status

PUBLIC_PATHS = frozenset({"/health", studio.LOGIN_PATH})
logger = logging.getLogger("radixlm.server")
PROGRAM_BODY_HINT = (
    ' (POST /programs/{name} expects {"args": {<the program\'s arguments>}, "stream": false, '
    '"max_new_tokens": ..., "temperature": ...}; GET /programs lists each program\'s arguments)'
)


def create_app(
    engine: Any,
    api_key: str | None = None,
    programs: ProgramRegistry | None = None,
    limits: ServerLimits | None = None,
    served_model_name: str | None = None,
    owns_engine: bool = False,
) -> FastAPI:
    """Build the app around `engine`. `programs` is a ProgramRegistry (or None); with
    `owns_engine` the app shuts the engine down when it stops."""
    limits = limits or ServerLimits()
    metrics = ServerMetrics()
    runner = Runner(engine, limits, metrics)
    metrics.bind_engine(engine.get_stats, runner.busy)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await drain(runner, limits.drain_timeout_s)
        if owns_engine:
            await asyncio.to_thread(_shutdown_engine, engine)

    app = FastAPI(title="radixlm", version=info.version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.runner = runner
    app.state.metrics = metrics
    app.state.programs = programs
    app.state.model_name = served_model_name or _model_name(engine)
    _install_error_handlers(app, limits, metrics)
    app.add_middleware(_GuardMiddleware, api_key=api_key, max_body_bytes=limits.max_body_bytes)
    app.add_middleware(AccessLogMiddleware)  # outermost: logs 401/413 answered by the guard too

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    native.register(app)
    info.register(app)
    openai_api.register(app)
    embeddings_api.register(app)
    programs_api.register(app)
    trace_api.register(app)
    studio.register(app, api_key)
    docs.register(app)
    return app


def _shutdown_engine(engine: Any) -> None:
    """Empty the prefix cache and log the KV pool's free count (all slots, unless a request
    still holds KV), then shut the engine down, whatever the flush met. An engine process that
    died has nothing left to flush."""
    if getattr(engine, "exit_reason", None) is not None:
        engine.shutdown()
        return
    try:
        flushed = engine.flush_cache()
        stats = engine.get_stats()
        logger.info(
            "KV pool at exit: %d of %d slots free%s",
            stats["kv_free_slots"],
            stats["kv_total_slots"],
            "" if flushed else " (cache not flushed: requests still running)",
        )
    except Exception:
        logger.exception("emptying the prefix cache at exit failed")
    finally:
        engine.shutdown()


async def drain(runner: Runner, timeout_s: float, cut_short: Callable[[], bool] = lambda: False) -> int:
    """Stop admitting, wait up to `timeout_s` (or until `cut_short()`) for running requests, then
    abort the rest and wait for them to end. Returns how many were aborted."""
    runner.accepting = False
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while runner.busy() and loop.time() < deadline and not cut_short():
        await asyncio.sleep(0.05)
    aborted = runner.abort_all()
    deadline = loop.time() + 5.0
    while runner.busy() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return aborted


def _model_name(engine: Any) -> str:
    """The model file's or folder's name (a GGUF's converted folder name carries a cache hash)."""
    path = str(getattr(engine, "model_path", "") or "")
    if path and not path.startswith("random:"):
        return Path(path).stem if path.endswith(".gguf") else Path(path).name
    name = getattr(engine.model_config, "model_name", None)
    return str(name or path or "default")


def _error(
    status: int, message: str, err_type: str = "invalid_request_error", headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, err_type), status_code=status, headers=headers)


def _format_validation(exc: RequestValidationError) -> tuple[bool, str]:
    """(whether the body's fields are at fault rather than its JSON, the message)."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = "; ".join(str(e.get("ctx", {}).get("error", e.get("msg"))) for e in errors)
        return False, f"malformed JSON body: {detail}"
    parts = []
    for e in _prune_union_noise(list(errors)):
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body" and not _is_union_tag(x))
        msg = str(e.get("msg", "invalid"))
        if e.get("type") == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc or 'body'}: {msg}")
    return True, "invalid request: " + "; ".join(parts)


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member in an error's loc ('str', 'list[int]', 'SamplingParams');
    field names are lower-case identifiers, so anything else is a member label, not a field."""
    text = str(part)
    return isinstance(part, str) and (not text.isidentifier() or text[0].isupper() or text in _TYPE_WORDS)


def _prune_union_noise(errors: list[Any]) -> list[Any]:
    """When one union member failed deep inside (a bad nested field), drop the other members'
    shallow 'wrong type' errors for the same field: they only hide the real reason."""

    def split(e: Any) -> tuple[tuple[Any, ...] | None, int]:
        loc = tuple(e.get("loc", ()))
        for k, part in enumerate(loc):
            if _is_union_tag(part):
                return loc[:k], len(loc) - k - 1
        return None, 0

    deep = {prefix for prefix, depth in map(split, errors) if prefix is not None and depth > 0}
    return [e for e in errors if not (split(e)[0] in deep and split(e)[1] == 0)]


_TYPE_WORDS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _install_error_handlers(app: FastAPI, limits: ServerLimits, metrics: ServerMetrics) -> None:
    def counted(resp: JSONResponse) -> JSONResponse:
        metrics.http_errors.labels(status=str(resp.status_code)).inc()
        return resp

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        fields, message = _format_validation(exc)
        if request.url.path.startswith("/programs/") and fields:
            message += PROGRAM_BODY_HINT
        return counted(_error(400, message))

    @app.exception_handler(ValueError)
    async def _value(_: Request, exc: ValueError) -> JSONResponse:
        return counted(_error(400, str(exc) or "invalid request"))

    @app.exception_handler(Overloaded)
    async def _overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        return counted(
            _error(
                503,
                f"server overloaded: {exc}",
                "server_overloaded",
                headers={"Retry-After": str(limits.retry_after_s)},
            )
        )

    @app.exception_handler(EngineDied)
    @app.exception_handler(Exception)
    async def _server_failure(_: Request, exc: Exception) -> JSONResponse:
        # for a 500 Starlette still re-raises exc after this answer, so the log keeps its traceback
        return counted(_error(*error_status(exc), "server_error"))

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> JSONResponse:
        return counted(_error(499, "client disconnected", "client_closed_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return counted(
            _error(exc.status_code, str(exc.detail), "http_error", headers=dict(exc.headers or {}))
        )


class _GuardMiddleware:
    """Pure ASGI: API key check, body-size limit and body check (body_text: UTF-8, lone
    surrogates) before the app sees the request."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.key is not None and path not in PUBLIC_PATHS and not self._authorized(headers):
            page = studio.unauthorized_page(path)  # a browser at /studio gets the key form
            await (page or _error(401, "missing or wrong API key", "authentication_error"))(
                scope, receive, send
            )
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            await self._too_large(scope, receive, send)
            return
        body = await self._read_body(receive)
        if body is None:
            await self._too_large(scope, receive, send)
            return
        problem = body_problem(body)
        if problem is not None:
            await _error(400, problem)(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        given = headers.get("authorization", b"")
        if given[:7].lower() == b"bearer ":
            given = given[7:].strip()
        else:
            given = headers.get("x-api-key", b"")
        assert self.key is not None
        return hmac.compare_digest(given, self.key) or studio.cookie_authorized(
            headers.get("cookie", b""), self.key
        )

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _error(413, f"request body exceeds {self.max_body} bytes", "request_too_large")(
            scope, receive, send
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
