"""One log line per HTTP request ("POST /generate 200 12.3 ms"), 4xx and 5xx included, at INFO on
the `radixlm.server.access` logger; streams are logged when their body ends. Pure ASGI, so it
never buffers a streamed body."""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("radixlm.server.access")


class AccessLogMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def logged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            client = scope.get("client") or ("-", 0)
            ms = (time.perf_counter() - start) * 1e3
            extra = scope.get("state", {}).get("log_extra", "")
            logger.info(
                "%s %s %s %d %.1f ms%s",
                client[0],
                scope.get("method", "-"),
                scope.get("path", "-"),
                status[0],
                ms,
                f" {extra}" if extra else "",
            )
