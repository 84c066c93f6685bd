"""The `radixlm serve` command (also `python -m radixlm.launch_server`): its options, each with help
and its default shown; the model as a positional argument or --model-path; logging set up before
anything slow; a busy port reported before the model loads; the server run until SIGINT/SIGTERM,
or until its engine process dies (then it exits with status 1).
With --dp N, N replicas behind sglang-router on the same port instead (dp.py)."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
from typing import Any

from ..arg_types import positive_int
from .dp import POLICIES
from .launch import add_engine_args, add_server_args, bind_socket, engine_kwargs
from .programs import ProgramLoader
from .runner import ServerLimits

logger = logging.getLogger("radixlm.server")

# Help for options declared without any; every option of `serve` ends up with help and a default.
OPTION_HELP = {
    "model_path": "HF folder (config.json + safetensors + tokenizer) or a .gguf file (default: SmolLM2-135M)",
    "device": "cpu, cuda or cuda:N (default: cuda when available, else cpu)",
    "dtype": "float32, float16 or bfloat16 (default: bfloat16 on CUDA, float32 on CPU)",
    "mem_fraction_static": "fraction of GPU memory for weights + KV pool (CUDA only)",
    "disable_radix_cache": "do not reuse KV of shared prompt prefixes",
    "random_weights": "random weights instead of the checkpoint's (benchmarks)",
    "context_length": "override the model's context length",
    "seed": "seed of the sampler's random state",
    "disable_cuda_graph": "run decode steps eagerly instead of replaying CUDA graphs",
    "host": "address to listen on",
    "port": "port to listen on",
    "served_model_name": "model id shown in /v1/models and accepted in requests (default: the model file's name)",
    "max_body_bytes": "largest request body accepted (413 above)",
    "max_prompt_tokens": "longest prompt accepted (default: the context length - 1)",
    "max_new_tokens_limit": "largest max_tokens accepted (default: the context length)",
    "max_pending_requests": "engine requests admitted at once; more get 503 + Retry-After (a request "
    "that alone asks for more: 400)",
    "drain_timeout": "on SIGTERM, seconds to let running requests finish before aborting them "
    "(SIGINT / Ctrl-C aborts them at once)",
    "log_level": "debug, info, warning or error (info logs one line per request)",
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default in (None, [], argparse.SUPPRESS)
            or action.default is False
        ):
            return text
        return text + " (default: %(default)s)"


def serve_parser(prog: str = "radixlm serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over HTTP: SGLang's native API (/generate, /tokenize, ...), the OpenAI "
        "API (/v1/...), registered programs (/programs) and /docs.",
        epilog="examples:\n  radixlm serve\n  radixlm serve path/to/model.gguf --port 8000\n"
        "  radixlm serve --model-path hf_folder --served-model-name my-model --api-key KEY",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None, help="the model (same as --model-path)")
    add_server_args(p)
    add_engine_args(p)
    g = p.add_argument_group("data parallelism")
    g.add_argument(
        "--dp",
        type=positive_int,
        default=1,
        help="replicas of the model, each a server with its own engine, behind sglang-router on --port",
    )
    g.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=POLICIES,
        help="sglang-router's policy across replicas (with --dp)",
    )
    for action in p._actions:
        if action.help is None and action.dest in OPTION_HELP:
            action.help = OPTION_HELP[action.dest]
    return p


def setup_logging(level: str) -> None:
    """Timestamped lines on stderr for radixlm's loggers (the engine, the server, its requests)."""
    root = logging.getLogger("radixlm")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(level.upper())


def open_port(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a busy port ends the command at once."""
    try:
        return bind_socket(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(
                f"radixlm serve: {host}:{port} is already in use (another server running?); "
                "stop it or pick another port with --port"
            ) from None
        raise SystemExit(f"radixlm serve: cannot listen on {host}:{port}: {e.strerror or e}") from None


def serve(args: argparse.Namespace, load_programs: ProgramLoader | None = None) -> None:
    """Build the engine and serve until SIGINT/SIGTERM (then drain or abort, shut down).
    `load_programs` turns --programs into a program host; the language side passes it
    (`radixlm serve`, `python -m radixlm.launch_server`), since the server never imports it."""
    from ..engine import Engine
    from ..engine_process import EngineProcess, EngineStartError
    from .app import create_app
    from .launch import limits_from_args, make_server
    from .programs import ProgramRegistry

    if args.model is not None:
        if args.model_path not in (None, args.model):
            raise SystemExit("radixlm serve: give the model once (positional or --model-path), not both")
        args.model_path = args.model
    setup_logging(args.log_level)
    sock = open_port(args.host, args.port)
    if args.dp > 1:
        from .dp import serve_dp

        serve_dp(serve_parser(), args, sock)
        return
    limits: ServerLimits = limits_from_args(args)
    registry = None
    if args.programs:
        if load_programs is None:
            raise SystemExit(
                "--programs needs the language side: start the server with `radixlm serve` "
                "or `python -m radixlm.launch_server`"
            )
        try:
            registry = ProgramRegistry(load_programs(args.programs), limits.max_pending_requests)
        except ValueError as e:  # a missing file, no programs in it (errors in its code keep their traceback)
            raise SystemExit(f"radixlm serve: --programs: {e}") from None
    logger.info("loading the model (%s)", args.model_path or args.model_shape or "default: SmolLM2-135M")
    try:
        if args.engine_in_process:
            engine: Any = Engine(**engine_kwargs(args), log_level=args.log_level)
        else:  # the scheduler in its own process: no GIL shared with the HTTP event loop
            engine = EngineProcess(**engine_kwargs(args), log_level=args.log_level)
    except (ValueError, TypeError, EngineStartError) as e:  # a bad option or model: the reason, no traceback
        raise SystemExit(f"radixlm serve: {e}") from None
    except Exception as e:  # e.g. a damaged model file: one line; the traceback at --log-level debug
        logger.debug("the engine did not start", exc_info=True)
        raise SystemExit(f"radixlm serve: the engine did not start: {type(e).__name__}: {e}") from None
    app = create_app(
        engine,
        api_key=args.api_key,
        programs=registry,
        limits=limits,
        served_model_name=args.served_model_name,
        owns_engine=True,
    )
    if registry is not None:
        logger.info(
            'registered programs: %s (POST /programs/{name} with {"args": {...}})',
            ", ".join(sorted(registry.programs)) or "none",
        )
    url = f"http://{args.host}:{sock.getsockname()[1]}"
    logger.info("serving %s as %r on %s (docs: %s/docs)", engine.model_path, app.state.model_name, url, url)
    print(f"radixlm serving {engine.model_path} on {url}", flush=True)
    server = make_server(app, log_level=args.log_level, drain_timeout_s=limits.drain_timeout_s)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; the shutdown is done
        pass
    if server.engine_exit is not None:  # a supervisor sees a failure, and may restart the server
        raise SystemExit(f"radixlm serve: {server.engine_exit}; the server stopped")
    logger.info("server stopped")
