"""Reliability run (issue 8): the scenarios of tests/test_reliability_server.py, longer, against
real servers on 127.0.0.1 (default model, CPU). Writes benchmarks/results/reliability.json with
requests sent / finished / lost, retractions, fuzz cases / 5xx, disconnects / leaked slots, soak
RSS start / end, shutdown outcome, and the environment. Every loop is bounded in count and time.

    python benchmarks/reliability.py [--soak-seconds 300] [--fuzz-seconds 120] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from bench_env import environment, write_result  # noqa: E402
from test_reliability_support import (  # noqa: E402
    disconnects,
    fuzz_api,
    graceful_shutdown,
    overload,
    soak,
    start_subprocess,
    start_thread,
)


def in_process_scenarios(args: argparse.Namespace) -> dict[str, Any]:
    from radixlm.backend.engine import Engine

    engine = Engine(device="cpu")
    try:
        srv = start_thread(engine, max_pending_requests=256)
        try:
            out = {
                "disconnects": disconnects(srv, n_drop=args.disconnects, n_abort=args.aborts, n_bystanders=4)
            }
        finally:
            srv.close()
        print("disconnects", out["disconnects"], flush=True)
        srv = start_thread(
            engine, max_prompt_tokens=64, max_new_tokens=4
        )  # cases, not the model, fill the time
        try:
            out["fuzz_api"] = fuzz_api(srv, examples_per_op=args.fuzz_examples, time_cap_s=args.fuzz_seconds)
        finally:
            srv.close()
        print("fuzz_api", {k: v for k, v in out["fuzz_api"].items() if k != "per_operation"}, flush=True)
        return out
    finally:
        engine.shutdown()


def subprocess_scenarios(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    tiny = start_subprocess(
        ["--max-total-tokens", str(args.pool_tokens), "--chunked-prefill-size", "32", "--drain-timeout", "2"],
        log_dir,
    )
    try:
        out = {"overload": overload(tiny, n_requests=args.overload_requests, prompt_words=6, max_new=24)}
        print("overload", out["overload"], flush=True)
        out["soak"] = soak(tiny, seconds=args.soak_seconds, rate_per_s=args.soak_rate)
        print("soak", out["soak"], flush=True)
    finally:
        tiny.close()
    srv = start_subprocess(["--drain-timeout", "3"], log_dir)
    try:
        out["shutdown"] = graceful_shutdown(srv, n_short=3, n_long=5)
        print("shutdown", out["shutdown"], flush=True)
    finally:
        srv.close()
    return out


def summary(r: dict[str, Any]) -> dict[str, Any]:
    ov, dc, fz, sk = r["overload"], r["disconnects"], r["fuzz_api"], r["soak"]
    sent = ov["sent"] + sk["sent"] + dc["bystanders"]
    finished = ov["finished"] + sk["ok"] + dc["bystanders_identical"]
    return {
        "requests_sent": sent,
        "requests_finished": finished,
        "requests_lost": sent - finished,
        "retractions": ov["retractions"],
        "overload_identical_to_alone": ov["identical_to_alone"],
        "tok_s_before_during_after": [ov["tok_s_before"], ov["tok_s_during"], ov["tok_s_after"]],
        "fuzz_cases_tried": fz["cases_tried"],
        "fuzz_5xx_seen": fz["5xx_seen"],
        "disconnects": dc["disconnects"] + dc["aborted_by_id"],
        "leaked_slots": dc["leaked_slots"],
        "soak_seconds": sk["seconds"],
        "soak_rss_start_mb": sk["rss_start_mb"],
        "soak_rss_end_mb": sk["rss_end_mb"],
        "soak_kv_free_initial_after": [sk["kv_free_initial"], sk["kv_free_after"]],
        "shutdown_exit_code": r["shutdown"]["exit_code"],
        "shutdown_threads_hung": r["shutdown"]["threads_hung"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--soak-seconds", type=float, default=180.0)
    p.add_argument("--soak-rate", type=float, default=2.0, help="requests per second (at most 8 in flight)")
    p.add_argument("--fuzz-seconds", type=float, default=120.0)
    p.add_argument("--fuzz-examples", type=int, default=50, help="per operation and generation mode")
    p.add_argument("--disconnects", type=int, default=100)
    p.add_argument("--aborts", type=int, default=20)
    p.add_argument("--overload-requests", type=int, default=12)
    p.add_argument("--pool-tokens", type=int, default=64)
    p.add_argument("--out", default=str(HERE / "results" / "reliability.json"))
    args = p.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        results = {**in_process_scenarios(args), **subprocess_scenarios(args, Path(tmp))}
    write_result(
        args.out,
        {
            "benchmark": "reliability",
            "env": environment(),
            "settings": vars(args),
            "summary": summary(results),
            "scenarios": results,
            "wall_seconds": time.monotonic() - t0,
        },
    )


if __name__ == "__main__":
    main()
