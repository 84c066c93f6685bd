"""`python -m radixlm.launch_server [MODEL] [options]`: SGLang's way to start a server (the same
options as `radixlm serve`; `--model-path` and `--port` as in SGLang)."""

from __future__ import annotations

from radixlm.backend.server.serve_cmd import serve_parser
from radixlm.cli import serve_with_programs


def main(argv: list[str] | None = None) -> None:
    serve_with_programs(serve_parser("python -m radixlm.launch_server").parse_args(argv))


if __name__ == "__main__":
    main()
