"""radixlm.backend.server: the HTTP server (FastAPI + uvicorn) over one Engine — native
SGLang-style API, OpenAI-compatible API, program endpoint, Prometheus metrics."""

from __future__ import annotations

from radixlm.backend.server.app import create_app
from radixlm.backend.server.launch import ServerThread, serve, serve_parser
from radixlm.backend.server.programs import ProgramRegistry
from radixlm.backend.server.runner import ServerLimits

__all__ = ["ProgramRegistry", "ServerLimits", "ServerThread", "create_app", "serve", "serve_parser"]
