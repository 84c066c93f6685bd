"""The scheduler thread beside a busy Python thread, at several GIL switch intervals: every torch
op and kernel launch releases the GIL, so each reacquisition can wait for the other thread's
whole interval. Runs one engine, then times the same greedy batch with and without an
always-runnable pure-Python thread (rounds alternate, median reported).

    python benchmarks/gil_switch_interval.py                     # CPU, the default model
    python benchmarks/gil_switch_interval.py --device cuda --model-shape llama-3.1-8b

Writes benchmarks/results/gil_switch_interval_<device>.json."""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench_env import device_tag, environment, write_result

from radixlm.backend.engine import Engine


class BusyThread:
    """A thread that never blocks: the worst case of an event loop or program threads beside the
    scheduler."""

    def __init__(self) -> None:
        self.stop = False
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        x = 0
        while not self.stop:
            for i in range(200):
                x += i

    def __enter__(self) -> BusyThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop = True
        self.thread.join()


def timed_batch(engine: Engine, prompts: list[list[int]], out_len: int) -> dict[str, float]:
    params = {"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True}
    s0, t0 = engine.get_stats(), time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    wall, s1 = time.perf_counter() - t0, engine.get_stats()
    return {
        "wall_s": wall,
        "host_launch_s": (s1.get("host_launch_us", 0) - s0.get("host_launch_us", 0)) / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--model-shape", default=None, help="a named random-weight shape (default: the default model)"
    )
    p.add_argument("--intervals-ms", default="5,0.5,0.2")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--in-len", type=int, default=16)
    p.add_argument("--out-len", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    engine = Engine(device=args.device, model_shape=args.model_shape)
    prompts = [[100 + 7 * r + i for i in range(args.in_len)] for r in range(args.batch)]
    timed_batch(engine, prompts, args.out_len)  # warm
    intervals = [float(x) / 1000 for x in args.intervals_ms.split(",")]
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for interval in intervals:
            sys.setswitchinterval(interval)
            for busy in (False, True):
                key = f"{interval * 1000:g} ms, {'busy thread' if busy else 'alone'}"
                with BusyThread() if busy else contextlib.nullcontext():
                    runs.setdefault(key, []).append(timed_batch(engine, prompts, args.out_len))
    engine.shutdown()
    summary = {
        k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "host_launch_s")}
        for k, v in runs.items()
    }
    for k, v in summary.items():
        print(f"{k:28s} wall {v['wall_s']:.3f} s   host launch {v['host_launch_s']:.3f} s")
    env = environment()
    result: dict[str, Any] = {
        "benchmark": "gil_switch_interval",
        "env": env,
        "args": vars(args),
        "runs": runs,
    }
    result["median"] = summary
    out = args.out or Path(__file__).parent / "results" / f"gil_switch_interval_{device_tag(env)}.json"
    write_result(out, result)


if __name__ == "__main__":
    main()
