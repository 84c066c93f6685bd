"""The program studio: GET /studio (one page, its assets shipped in this package under
static/studio, no build step, nothing fetched from elsewhere), its login when the server has an
API key (POST /studio/login sets an HttpOnly, SameSite=Strict session cookie derived from the key),
and GET /studio/api/metrics (the engine's counters for the live panel). Runs stream from
POST /programs/{name}/trace (trace_api.py)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import time
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

PAGE_PATH = "/studio"
LOGIN_PATH = "/studio/login"
COOKIE = "radixlm_studio"
STATIC_DIR = Path(__file__).parent / "static" / "studio"
ASSETS = {"studio.css": "text/css", "studio.js": "text/javascript", "trace_view.js": "text/javascript"}
# The page loads only its own assets: a CDN or inline script would be refused by the browser.
PAGE_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_STATS = (
    "num_running", "num_waiting", "kv_total_slots", "kv_free_slots", "kv_cached_slots",
    "cached_prompt_tokens", "computed_prompt_tokens", "generated_tokens", "num_finished", "num_aborted",
)  # fmt: skip


def session_token(api_key: bytes) -> bytes:
    """The cookie's value: derived from the key, so the key itself never sits in a cookie."""
    return hmac.new(api_key, b"radixlm studio session", hashlib.sha256).hexdigest().encode()


def cookie_authorized(cookie_header: bytes, api_key: bytes) -> bool:
    """Whether the request's Cookie header carries the studio session for this key."""
    if not cookie_header:
        return False
    try:
        jar = SimpleCookie(cookie_header.decode("latin-1"))
    except CookieError:
        return False
    morsel = jar.get(COOKIE)
    return morsel is not None and hmac.compare_digest(morsel.value.encode(), session_token(api_key))


def login_page(message: str = "") -> HTMLResponse:
    """What an unauthenticated browser gets at /studio: a key form, nothing of the server."""
    note = f'<p role="alert">{html.escape(message)}</p>' if message else ""
    body = f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>radixlm studio: sign in</title>
<style>body{{font:16px system-ui,sans-serif;max-width:24rem;margin:4rem auto;padding:0 1rem}}
input,button{{font:inherit;padding:.5rem;margin:.25rem 0;width:100%;box-sizing:border-box}}
[role=alert]{{color:#b00020}}</style></head><body><main><h1>radixlm studio</h1>
<p>This server needs its API key.</p>{note}
<form method="post" action="{LOGIN_PATH}"><label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="current-password" autofocus required>
<button type="submit">Sign in</button></form></main></body></html>"""
    return HTMLResponse(body, status_code=401, headers={"Cache-Control": "no-store"})


def unauthorized_page(path: str) -> HTMLResponse | None:
    """The login form for the page itself; other paths get the API's JSON 401."""
    return login_page() if path == PAGE_PATH else None


def register(app: FastAPI, api_key: str | None) -> None:
    key = api_key.encode() if api_key else None

    @app.get(PAGE_PATH, include_in_schema=False)
    async def page() -> Response:
        return FileResponse(
            STATIC_DIR / "index.html",
            media_type="text/html",
            headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-store"},
        )

    @app.get(PAGE_PATH + "/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            return Response(status_code=404)
        return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    @app.post(LOGIN_PATH, include_in_schema=False)
    async def login(request: Request) -> Response:
        if key is None:
            return RedirectResponse(PAGE_PATH, status_code=303)
        given = parse_qs((await request.body()).decode("utf-8", "replace")).get("key", [""])[0]
        if not hmac.compare_digest(given.encode(), key):
            return login_page("That key is not this server's API key.")
        resp = RedirectResponse(PAGE_PATH, status_code=303)
        resp.set_cookie(COOKIE, session_token(key).decode(), httponly=True, samesite="strict", path="/")
        return resp

    @app.get(PAGE_PATH + "/api/metrics", include_in_schema=False)
    async def metrics() -> dict[str, Any]:
        stats = await asyncio.to_thread(app.state.engine.get_stats)
        out: dict[str, Any] = {k: stats.get(k) for k in _STATS}
        registry = app.state.programs
        out["programs_running"] = len(registry.active) if registry is not None else 0
        out["server_pending"] = app.state.runner.busy()
        out["time"] = time.time()
        return out
