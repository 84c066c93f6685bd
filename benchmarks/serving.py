"""Serving benchmark: a load generator against a radixlm server (one it starts, or --base-url).
Requests arrive as a Poisson process at each given rate (or all at once for `inf`), with random
or chat-like lengths; every request streams, so TTFT, inter-token latency and end-to-end time
are measured per request. Reports throughput and p50/p99, and writes a JSON result.

CPU (default model):  python benchmarks/serving.py --launch --device cpu
H200 (random 8B):     python benchmarks/serving.py --launch --device cuda --random-weights \
                          --model-shape llama-3.1-8b --num-prompts 512 --input-len 1024 --output-len 256 \
                          --request-rates 4,16,inf --out benchmarks/results/serving_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "government company number group problem fact water room mother area money story month lot right "
    "study book job word business issue side kind head house service friend father power hour game line"
).split()


@dataclass
class Item:
    """One request to send: token ids (random) or chat messages (chat), and its output length."""

    output_len: int
    input_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    input_len: int = 0


@dataclass
class Result:
    ok: bool
    input_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    sent_s: float = 0.0  # when it was sent, seconds after the run's first send


# ---------------------------------------------------------------- workloads


def random_items(
    n: int, input_len: int, output_len: int, ratio: float, vocab: int, rng: random.Random
) -> list[Item]:
    """Uniform lengths in [ratio*L, L]; token ids drawn away from the special-token range."""
    lo, hi = min(1000, vocab // 4), max(min(vocab - 1, 30000), min(1000, vocab // 4) + 1)
    items = []
    for _ in range(n):
        il = rng.randint(max(1, int(input_len * ratio)), input_len)
        ol = rng.randint(max(1, int(output_len * ratio)), output_len)
        items.append(Item(ol, input_ids=[rng.randrange(lo, hi) for _ in range(il)], input_len=il))
    return items


def chat_items(n: int, input_len: int, output_len: int, rng: random.Random) -> list[Item]:
    """Chat-like: a shared system prompt, log-normal user and reply lengths (ShareGPT-like skew)."""
    system = "You are a helpful assistant. " + " ".join(
        rng.choice(WORDS) for _ in range(max(8, input_len // 4))
    )
    items = []
    for _ in range(n):
        words = max(4, min(4 * input_len, int(rng.lognormvariate(math.log(input_len / 2), 0.8))))
        out = max(4, min(4 * output_len, int(rng.lognormvariate(math.log(output_len), 0.7))))
        user = " ".join(rng.choice(WORDS) for _ in range(words))
        items.append(
            Item(out, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])
        )
    return items


# ---------------------------------------------------------------- one request


def make_items(args: argparse.Namespace, vocab: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    if args.dataset == "random":
        return random_items(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, rng)
    return chat_items(args.num_prompts, args.input_len, args.output_len, rng)


def _request(item: Item) -> tuple[str, dict[str, Any]]:
    if item.messages is not None:
        return "/v1/chat/completions", {
            "messages": item.messages,
            "max_tokens": item.output_len,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
    return "/generate", {
        "input_ids": item.input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": item.output_len, "ignore_eos": True, "temperature": 0},
    }


def _new_tokens(path: str, event: dict[str, Any], seen: int) -> tuple[int, dict[str, Any] | None]:
    """(total output tokens so far, usage if this event carries it)."""
    if path == "/generate":
        return len(event.get("output_ids", [])), None
    if event.get("usage"):
        return seen, event["usage"]
    delta = (event.get("choices") or [{}])[0].get("delta", {})
    return seen + (1 if delta.get("content") else 0), None


async def send(session: aiohttp.ClientSession, item: Item) -> Result:
    """One streamed request; the client's clock gives TTFT and the gaps between token events."""
    path, body = _request(item)
    res = Result(ok=False, input_len=item.input_len)
    start = last = time.perf_counter()
    tokens = 0
    try:
        async with session.post(path, json=body) as resp:
            if resp.status != 200:
                res.error = f"{resp.status}: {(await resp.read())[:200]!r}"
                return res
            async for raw in resp.content:  # one SSE line at a time
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                total, usage = _new_tokens(path, json.loads(raw[6:]), tokens)
                if usage:
                    res.input_len, total = usage["prompt_tokens"], usage["completion_tokens"]
                elif total > tokens:
                    if tokens == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                tokens = max(tokens, total)
        res.e2e = time.perf_counter() - start
        res.output_len, res.ok = tokens, True
    except aiohttp.ClientError as exc:
        res.error = repr(exc)
    return res


def client_session(base_url: str, headers: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, as SGLang's and vLLM's serving benchmarks use.
    httpx's async streaming costs about 2.5x the CPU per token event, enough to make the client,
    not the server, the bottleneck at ten thousand events a second."""
    return aiohttp.ClientSession(
        base_url=base_url,
        headers=headers,
        connector=aiohttp.TCPConnector(limit=0),  # one connection per concurrent request
        timeout=aiohttp.ClientTimeout(total=3600),
    )


# ---------------------------------------------------------------- a run at one rate


async def run_arrivals(
    base_url: str, headers: dict[str, str], items: list[Item], gaps: list[float], rate: float
) -> dict[str, Any]:
    """Send items[i], then wait gaps[i] seconds; summarize once every stream has ended."""
    async with client_session(base_url, headers) as session:
        results, duration = await arrive(items, gaps, lambda item: send(session, item))
    return summarize(results, duration, rate)


async def arrive(
    items: list[Item], gaps: list[float], send_one: Callable[[Item], Awaitable[Result]]
) -> tuple[list[Result], float]:
    """send_one(items[i]), then wait gaps[i] seconds: every result, with its send time, and the
    seconds from the first send until the last one ended."""
    tasks, sent = [], []
    start = time.perf_counter()
    for item, gap in zip(items, gaps):
        sent.append(time.perf_counter() - start)
        tasks.append(asyncio.create_task(send_one(item)))
        if gap:
            await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    return with_send_times(list(results), sent), time.perf_counter() - start


def with_send_times(results: list[Result], sent: list[float]) -> list[Result]:
    for res, at in zip(results, sent):
        res.sent_s = at
    return results


async def run_rate(
    base_url: str, api_key: str | None, items: list[Item], rate: float, rng: random.Random
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gaps = [rng.expovariate(rate) if math.isfinite(rate) else 0.0 for _ in items]
    return await run_arrivals(base_url, headers, items, gaps, rate)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _stats(values: list[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values]
    return {
        "mean_ms": sum(ms) / len(ms) if ms else float("nan"),
        "p50_ms": _pct(ms, 50),
        "p99_ms": _pct(ms, 99),
    }


def summarize(results: list[Result], duration: float, rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    return {
        "request_rate": "inf" if not math.isfinite(rate) else rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft": _stats([r.ttft for r in ok]),
        "itl": _stats([x for r in ok for x in r.itl]),
        "e2e": _stats([r.e2e for r in ok]),
        "slowest_ttft": slowest_ttft(ok),
    }


def slowest_ttft(ok: list[Result], n: int = 5) -> list[dict[str, float]]:
    """The n longest first-token waits, each with its send time and how many requests were in
    flight when it was sent: a tail that clusters in time is a stall, one spread out a burst."""

    def in_flight(at: float) -> int:
        return sum(1 for r in ok if r.sent_s < at < r.sent_s + r.e2e)

    return [
        {
            "sent_s": r.sent_s,
            "ttft_ms": r.ttft * 1000,
            "input_len": r.input_len,
            "in_flight": in_flight(r.sent_s),
        }
        for r in sorted(ok, key=lambda r: r.ttft, reverse=True)[:n]
    ]


# ---------------------------------------------------------------- server and environment


def launch_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "radixlm.backend.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--max-pending-requests",
        str(max(256, 2 * args.num_prompts)),
    ]
    for flag in _ENGINE_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    if args.random_weights:
        cmd.append("--random-weights")
    if args.disable_radix_cache:
        cmd.append("--disable-radix-cache")
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.launch_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start in time")


_ENGINE_FLAGS = (
    "model_path",
    "device",
    "dtype",
    "max_total_tokens",
    "model_shape",
    "context_length",
    "max_running_requests",
    "chunked_prefill_size",
)


def offline_anchor(args: argparse.Namespace, items: list[Item]) -> dict[str, Any]:
    """The same requests through an in-process Engine, all at once and without HTTP: the
    anchor that says what the server costs (run after the server is stopped)."""
    from radixlm.backend.engine import Engine

    kwargs = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k) is not None}
    engine = Engine(
        random_weights=args.random_weights, disable_radix_cache=args.disable_radix_cache, **kwargs
    )
    try:
        # warm up on the same batch shape (other tokens, 2 steps), as the server was by its earlier runs
        warm = [list(reversed(it.input_ids)) for it in items]
        engine.generate(input_ids=warm, sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        params = [{"max_new_tokens": it.output_len, "ignore_eos": True, "temperature": 0} for it in items]
        start = time.perf_counter()
        outs = engine.generate(input_ids=[it.input_ids for it in items], sampling_params=params)
        duration = time.perf_counter() - start
    finally:
        engine.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "what": "in-process Engine.generate, all requests at once, no HTTP",
        "duration_s": duration,
        "output_tokens": tokens,
        "output_throughput": tokens / duration,
    }


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15": os.getloadavg(),
        "gpu": "none",
    }
    for pkg in ("radixlm", "torch", "transformers", "fastapi", "uvicorn", "httpx"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode == 0 and out.stdout.strip():
            env["gpu"] = out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="benchmark a running server (else use --launch)")
    p.add_argument("--launch", action="store_true", help="start a server with the engine options below")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("random", "chat"), default="random")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.5, help="random lengths are uniform in [r*L, L]")
    p.add_argument("--request-rates", default="2,inf", help="comma list of req/s; inf = all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument(
        "--offline-anchor",
        action="store_true",
        help="also run the random workload through an in-process Engine (same engine options)",
    )
    g = p.add_argument_group("engine (with --launch)")
    for flag in ("--model-path", "--device", "--dtype", "--model-shape"):
        g.add_argument(flag, default=None)
    for flag in (
        "--max-total-tokens",
        "--context-length",
        "--max-running-requests",
        "--chunked-prefill-size",
    ):
        g.add_argument(flag, type=int, default=None)
    g.add_argument("--random-weights", action="store_true")
    g.add_argument("--disable-radix-cache", action="store_true")
    args = p.parse_args(argv)
    if bool(args.base_url) == bool(args.launch):
        p.error("give exactly one of --base-url or --launch")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    env = environment()
    proc, url = launch_server(args) if args.launch else (None, args.base_url.rstrip("/"))
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        info = httpx.get(url + "/model_info", headers=headers, timeout=30).json()
        rates = [float(r) for r in args.request_rates.split(",")]
        rng = random.Random(args.seed)
        warm = random_items(1, 8, 4, 1.0, int(info.get("vocab_size") or 32000), rng)
        asyncio.run(run_rate(url, args.api_key, warm, math.inf, rng))
        runs = []
        for k, rate in enumerate(rates):
            # fresh prompts per run and an empty cache: no run is sped up by an earlier one's prefixes
            httpx.post(url + "/flush_cache", headers=headers, timeout=60)
            items = make_items(args, int(info.get("vocab_size") or 32000), args.seed + 1 + k)
            run = asyncio.run(run_rate(url, args.api_key, items, rate, random.Random(args.seed + 1 + k)))
            run["seed"] = args.seed + 1 + k
            runs.append(run)
            print(
                json.dumps(
                    {
                        k: run[k]
                        for k in (
                            "request_rate",
                            "completed",
                            "failed",
                            "output_throughput",
                            "ttft",
                            "itl",
                            "e2e",
                        )
                    }
                ),
                flush=True,
            )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(120)
    anchor = None
    if args.offline_anchor and args.dataset == "random":
        burst = next((r for r in runs if r["request_rate"] == "inf"), runs[-1])
        anchor = offline_anchor(args, make_items(args, int(info.get("vocab_size") or 32000), burst["seed"]))
        anchor["compared_with_request_rate"] = burst["request_rate"]
        anchor["server_over_offline_throughput"] = burst["output_throughput"] / anchor["output_throughput"]
        print(json.dumps({"offline_anchor": anchor}), flush=True)
    result = {
        "benchmark": "serving",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "environment": {**env, "load_average_end": os.getloadavg()},
        "model": info,
        "config": {k: v for k, v in vars(args).items() if k not in ("api_key",)},
        "runs": runs,
        "offline_anchor": anchor,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
