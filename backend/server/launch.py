"""Starting and stopping a server: engine/server command-line options, the uvicorn server with
graceful shutdown (stop accepting; on SIGTERM drain running requests up to a timeout, on SIGINT
not at all; then abort the rest so every stream ends with finish_reason abort, and say so in the
log; when the engine process dies, stop at once and tell the caller: `engine_exit`), and a
background-thread launcher."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
import time
from typing import Any

import uvicorn

from ..arg_types import fraction, non_negative_float, non_negative_int, port_number, positive_int
from .app import drain
from .runner import ServerLimits

logger = logging.getLogger("radixlm.server")


class RadixServer(uvicorn.Server):
    """uvicorn.Server whose shutdown drains the engine's requests before closing connections:
    up to drain_timeout_s after SIGTERM (an orchestrator's stop), none after SIGINT (Ctrl-C), and
    no longer once a second signal comes. It also stops by itself once the engine process has
    died (engine_exit says why): a server that can only answer 503 must not look alive."""

    def __init__(self, config: uvicorn.Config, runner: Any, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.runner = runner
        self.drain_timeout_s = drain_timeout_s
        self.exit_signal: int | None = None
        self.signals = 0
        self.engine_exit: str | None = None

    async def on_tick(self, counter: int) -> bool:
        should_exit = await super().on_tick(counter)
        if self.engine_exit is None:
            self.engine_exit = self.runner.engine_exit()
            if self.engine_exit is not None:
                logger.error("%s; stopping the server", self.engine_exit)
        return should_exit or self.engine_exit is not None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.exit_signal is None:
            self.exit_signal = sig  # logged from shutdown(): a signal handler must not take log locks
        self.signals += 1
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # stop accepting before draining
        # nothing can finish without the engine: its requests have ended with an error already
        stop_now = self.exit_signal == signal.SIGINT or self.engine_exit is not None
        timeout = 0.0 if stop_now else self.drain_timeout_s
        busy = self.runner.busy()
        name = signal.Signals(self.exit_signal).name if self.exit_signal else "stop"
        if self.engine_exit is not None:
            name = "engine process gone"
        if busy and timeout > 0:
            logger.warning(
                "%s: %d request(s) in flight; letting them finish for up to %.0f s (--drain-timeout), "
                "then aborting",
                name,
                busy,
                timeout,
            )
        elif busy:
            logger.warning("%s: aborting %d request(s) in flight", name, busy)
        else:
            logger.info("%s: shutting down (no requests in flight)", name)
        aborted = await drain(self.runner, timeout, cut_short=lambda: self.signals > 1)
        if aborted:
            logger.warning("aborted %d request(s) at shutdown", aborted)
        await super().shutdown(sockets)


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket; port 0 picks a free port (read it back with getsockname)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


# The event loop and the engine's scheduler thread share one GIL: at Python's default 5 ms switch
# interval a busy loop keeps the scheduler from launching the next GPU step for up to 5 ms.
GIL_SWITCH_INTERVAL_S = 0.0005

# Longer than the idle expiry of common client pools (httpx, and so the openai client: 5 s), so
# the client always drops an idle connection first. With equal timeouts a request sent on a
# pooled connection can meet the server's close and fail with a connection reset.
KEEP_ALIVE_S = 65


def make_server(app: Any, log_level: str = "warning", drain_timeout_s: float = 30.0) -> RadixServer:
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=int(drain_timeout_s) + 10,
        timeout_keep_alive=KEEP_ALIVE_S,
        lifespan="on",
        access_log=False,
    )
    return RadixServer(config, app.state.runner, drain_timeout_s)


class ServerThread:
    """Run an app on 127.0.0.1 in a background thread (tests, benchmarks, notebooks)."""

    def __init__(
        self, app: Any, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float = 5.0
    ) -> None:
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = make_server(app, drain_timeout_s=drain_timeout_s)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="radixlm-server", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server failed to start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


# ---------------------------------------------------------------- command-line options


# kv_pool.KV_CACHE_DTYPES and loader.QUANTIZATIONS, spelled out so the CLI starts without importing
# torch (tests pin them equal)
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8_e4m3")
QUANTIZATION_CHOICES = ("auto", "gguf", "dequantize", "fp8", "q4_0", "q4_1", "q8_0")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model-path", default=None, help="HF folder or GGUF file (default: SmolLM2-135M GGUF)")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    g.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default=None,
        help="GGUF weights: kept as blocks (gguf), dequantized to --dtype at load (dequantize), or "
        "auto: kept on the CPU, dequantized on CUDA; float weights: quantized at load to GGUF "
        "blocks (q4_0, q4_1, q8_0) or e4m3 with per-row scales (fp8)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPE_CHOICES,
        default="auto",
        help="KV cache storage: auto (the model dtype) or fp8_e4m3 (per-head scales; ~2x the tokens)",
    )
    g.add_argument("--max-total-tokens", type=positive_int, default=None, help="KV pool size in tokens")
    g.add_argument("--mem-fraction-static", type=fraction, default=0.85)
    g.add_argument(
        "--chunked-prefill-size",
        type=positive_int,
        default=None,
        help="prompt tokens per step (default: from GPU memory, 2048 on CPU)",
    )
    g.add_argument(
        "--max-running-requests",
        type=positive_int,
        default=None,
        help="decoding requests at once (default: from the KV pool size, 256 on CPU)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=positive_int,
        default=None,
        help="largest decode batch run as a CUDA graph (default: from GPU memory)",
    )
    g.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=non_negative_int,
        default=None,
        help="largest extend step whose layers' dense work replays from CUDA graphs (default: 1024 "
        "on CUDA; 0: off)",
    )
    g.add_argument("--disable-radix-cache", action="store_true")
    g.add_argument("--random-weights", action="store_true")
    g.add_argument("--model-shape", default=None, help="e.g. llama-3.1-8b (with --random-weights)")
    g.add_argument("--context-length", type=positive_int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="process each step before launching the next (overlap is on by default on CUDA)",
    )
    g.add_argument("--disable-cascade", action="store_true", help="no cascade attention for shared prefixes")
    g.add_argument(
        "--speculative-algorithm",
        default=None,
        choices=["ngram", "none", "draft"],
        help="speculative decoding for requests that do not choose: ngram (prompt lookup) or "
        "draft (needs --speculative-draft-model-path); a request may still ask with its "
        "speculative_algorithm field (default: off)",
    )
    g.add_argument(
        "--speculative-draft-model-path",
        default=None,
        help="a smaller model with the same tokenizer (HF folder or GGUF) whose greedy tokens are "
        "the drafts of 'draft' requests",
    )
    g.add_argument(
        "--speculative-num-draft-tokens",
        type=positive_int,
        default=None,
        help="most drafts verified per request per step (default: 7 for ngram, 4 for draft)",
    )
    g.add_argument(
        "--speculative-policy",
        default="auto",
        choices=["auto", "always"],
        help="auto: speculate only where measured step costs and acceptance say it pays",
    )
    g.add_argument(
        "--tp",
        "--tp-size",
        dest="tp_size",
        type=positive_int,
        default=1,
        help="tensor parallelism: split the model over this many CPU processes (gloo)",
    )
    g.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the scheduler in the server's process (default: its own process, so the HTTP "
        "event loop and the scheduler never share a GIL)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "model_path",
        "device",
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "max_total_tokens",
        "mem_fraction_static",
        "chunked_prefill_size",
        "max_running_requests",
        "disable_radix_cache",
        "random_weights",
        "model_shape",
        "context_length",
        "seed",
        "disable_cuda_graph",
        "disable_cascade",
        "cuda_graph_max_bs",
        "piecewise_cuda_graph_max_tokens",
        "speculative_algorithm",
        "speculative_num_draft_tokens",
        "speculative_policy",
        "speculative_draft_model_path",
        "tp_size",
    )
    kw = {k: getattr(args, k) for k in keys}
    if args.disable_overlap_schedule:
        kw["overlap_schedule"] = False
    return kw


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=port_number, default=30000)
    g.add_argument(
        "--api-key", default=None, help="required as 'Authorization: Bearer KEY' on all but /health"
    )
    g.add_argument(
        "--programs",
        action="append",
        default=[],
        metavar="MODULE_OR_FILE",
        help="register every @function in this module or .py file (repeatable)",
    )
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--max-body-bytes", type=positive_int, default=ServerLimits.max_body_bytes)
    g.add_argument("--max-prompt-tokens", type=positive_int, default=None)
    g.add_argument("--max-new-tokens-limit", type=positive_int, default=None)
    g.add_argument("--max-pending-requests", type=positive_int, default=ServerLimits.max_pending_requests)
    g.add_argument("--drain-timeout", type=non_negative_float, default=ServerLimits.drain_timeout_s)
    g.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens_limit,
        max_pending_requests=args.max_pending_requests,
        drain_timeout_s=args.drain_timeout,
    )
