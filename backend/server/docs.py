"""API docs that work offline: /docs is Swagger UI whose script, style and icon are served by this
server from the `swagger-ui-bundle` package (never a CDN); without that package /docs is a plain
page, with no external assets, listing the routes of /openapi.json."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = "/docs-assets"

_PLAIN_PAGE = """<!DOCTYPE html><html><head><meta charset="utf-8"><title>{title}</title></head>
<body><h1>{title}</h1><p>Routes from <a href="/openapi.json">/openapi.json</a>
(install <code>swagger-ui-bundle</code> for the interactive page).</p><ul id="routes"></ul>
<script>fetch("/openapi.json").then(r => r.json()).then(spec => {{
  const ul = document.getElementById("routes");
  for (const [path, ops] of Object.entries(spec.paths)) for (const [m, op] of Object.entries(ops)) {{
    const li = document.createElement("li");
    li.textContent = m.toUpperCase() + " " + path + (op.summary ? " - " + op.summary : "");
    ul.appendChild(li);
  }}
}});</script></body></html>"""


def swagger_assets_dir() -> Path | None:
    try:
        import swagger_ui_bundle
    except ImportError:
        return None
    path = Path(swagger_ui_bundle.swagger_ui_path)
    return path if (path / "swagger-ui-bundle.js").is_file() else None


def register(app: FastAPI) -> None:
    """Serve /docs (create the app with docs_url=None, redoc_url=None: those load from a CDN)."""
    assets = swagger_assets_dir()
    title = f"{app.title} API"
    if assets is not None:
        app.mount(ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        if assets is None:
            return HTMLResponse(_PLAIN_PAGE.format(title=title))
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=title,
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
        )
