"""radixlm.backend.server: the HTTP server (FastAPI + uvicorn) over one Engine — native
SGLang-style API, OpenAI-compatible API, program endpoint, Prometheus metrics."""

from __future__ import annotations

from radixlm.backend.server.app import create_app
from radixlm.backend.server.launch import ServerThread
from radixlm.backend.server.programs import ProgramRegistry
from radixlm.backend.server.runner import ServerLimits
from radixlm.backend.server.serve_cmd import serve, serve_parser

__all__ = ["ProgramRegistry", "ServerLimits", "ServerThread", "create_app", "serve", "serve_parser"]
