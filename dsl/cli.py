"""The `radixlm` command: `radixlm serve [options]` starts the HTTP server; `radixlm run FILE
[args...]` runs a program file as __main__ with the default backend set to an in-process
engine (or to a running server with --url); `radixlm trace URL PROGRAM` prints a served
program's run as a tree (trace_cli.py). It lives with the language because it composes
both: the server, and the programs it serves or runs."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path
from typing import Any

from radixlm.backend.server.launch import add_engine_args, engine_kwargs
from radixlm.backend.server.serve_cmd import serve, serve_parser

USAGE = "usage: radixlm {serve,run,trace} ...  (radixlm serve --help, radixlm run --help, ...)"
HELP = f"""{USAGE}

radixlm: structured-output and agent-program runtime for LLMs.

commands:
  serve [MODEL] [options]    serve a model over HTTP: SGLang's native API, the OpenAI API (/v1),
                             registered programs (/programs) and API docs (/docs)
  run FILE [args...]         run a Python program file with an in-process engine (or --url SERVER)
                             as the default backend
  trace URL PROGRAM [--args NAME=VALUE ...]
                             run a program registered on a server and print its trace as a tree
                             (the browser shows the same at URL/studio)

examples:
  radixlm serve                                   # the default model (SmolLM2-135M) on 127.0.0.1:30000
  radixlm serve model.gguf --port 8000 --served-model-name my-model
  radixlm run examples/quickstart.py
  radixlm trace http://127.0.0.1:30000 tree_of_thought --args problem="2+3?"
  python -m radixlm.launch_server --model-path hf_folder --port 30000   # SGLang-style

The first use of a GGUF model converts it once into ~/.cache/radixlm (about 20 s)."""


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="radixlm run", description="Run a program file on the default backend.")
    p.add_argument("file", help="a Python file using radixlm programs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the file (sys.argv[1:])")
    p.add_argument("--url", default=None, help="run on a radixlm server at this URL instead of in-process")
    p.add_argument("--api-key", default=None)
    add_engine_args(p)
    return p


def run_file(argv: list[str]) -> None:
    args = _run_parser().parse_args(argv)
    path = Path(args.file)
    if not path.is_file():
        raise SystemExit(f"radixlm run: no such file: {args.file}")
    import radixlm

    backend: Any
    try:
        if args.url:
            backend = radixlm.RuntimeEndpoint(args.url, api_key=args.api_key)
        else:
            backend = radixlm.Runtime(**engine_kwargs(args))
    except Exception as e:  # a bad option, model or server: the reason in one line, not a traceback
        where = f"the server at {args.url}" if args.url else "the engine"
        raise SystemExit(f"radixlm run: cannot use {where}: {type(e).__name__}: {e}") from None
    radixlm.set_default_backend(backend)
    old_argv = sys.argv
    sys.argv = [str(path), *args.args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = old_argv
        radixlm.set_default_backend(None)
        backend.shutdown()


def serve_with_programs(args: argparse.Namespace) -> None:
    """`radixlm serve`: the server, with --programs loaded by the language side."""
    from radixlm.program_host import ProgramsHost

    serve(args, load_programs=ProgramsHost.load)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(HELP, file=sys.stderr)
        raise SystemExit(2)
    if argv[0] in ("-h", "--help"):
        print(HELP)
        return
    command, rest = argv[0], argv[1:]
    if command == "serve":
        serve_with_programs(serve_parser().parse_args(rest))
    elif command == "run":
        run_file(rest)
    elif command == "trace":
        from radixlm.trace_cli import main as trace_main

        raise SystemExit(trace_main(rest))
    else:
        raise SystemExit(f"radixlm: unknown command {command!r}\n{USAGE}")


if __name__ == "__main__":
    main()
