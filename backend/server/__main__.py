"""`python -m radixlm.backend.server [options]`: the same as `radixlm serve`, without --programs
(programs need the language side: `radixlm serve` or `python -m radixlm.launch_server`)."""

from __future__ import annotations

from .serve_cmd import serve, serve_parser


def main(argv: list[str] | None = None) -> None:
    serve(serve_parser("python -m radixlm.backend.server").parse_args(argv))


if __name__ == "__main__":
    main()
