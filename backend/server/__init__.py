"""radixlm.backend.server: the HTTP server (FastAPI + uvicorn) over one Engine — native
SGLang-style API, OpenAI-compatible API, program endpoint, Prometheus metrics."""

from __future__ import annotations

from .app import create_app
from .launch import ServerThread
from .programs import ProgramHost, ProgramRegistry
from .runner import ServerLimits
from .serve_cmd import serve, serve_parser

__all__ = [
    "ProgramHost",
    "ProgramRegistry",
    "ServerLimits",
    "ServerThread",
    "create_app",
    "serve",
    "serve_parser",
]
