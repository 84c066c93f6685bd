"""The suite's serving comparison: the same requests, at the same Poisson arrival times, streamed
through the in-process Engine (async API, no HTTP) and through a radixlm HTTP server started
with default settings. TTFT, inter-token latency and output tok/s from the client's clock."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import serving  # noqa: E402

from radixlm.backend.engine import Engine  # noqa: E402
from radixlm.backend.scheduler_config import FIRST_TOKEN_EDGES_MS, first_token_key  # noqa: E402

ITEM_VOCAB = 32000  # token ids drawn below this on both sides (every supported model's vocab is larger)


def items_for(size: dict[str, Any], seed: int) -> list[serving.Item]:
    rng = random.Random(seed)
    return serving.random_items(
        size["num_requests"], size["input_len"], size["output_len"], size["ratio"], ITEM_VOCAB, rng
    )


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds between consecutive sends (all zero for rate inf); the same for both sides."""
    rng = random.Random(seed)
    return [rng.expovariate(rate) if math.isfinite(rate) else 0.0 for _ in range(n)]


async def _engine_request(engine: Engine, item: serving.Item) -> serving.Result:
    res = serving.Result(ok=False, input_len=item.input_len)
    start = last = time.perf_counter()
    tokens = 0
    params = {"max_new_tokens": item.output_len, "ignore_eos": True, "temperature": 0}
    stream = await engine.async_generate(input_ids=item.input_ids, sampling_params=params, stream=True)
    async for chunk in stream:  # type: ignore[union-attr]
        new = len(chunk.get("output_ids", []))
        if new:
            now = time.perf_counter()
            if tokens == 0:
                res.ttft = now - start
            else:
                res.itl.append(now - last)
            last = now
            tokens += new
    res.e2e, res.output_len, res.ok = time.perf_counter() - start, tokens, True
    return res


async def _engine_rate(
    engine: Engine, items: list[serving.Item], gaps: list[float], rate: float
) -> dict[str, Any]:
    results, duration = await serving.arrive(items, gaps, lambda item: _engine_request(engine, item))
    return serving.summarize(results, duration, rate)


async def _server_rate(url: str, items: list[serving.Item], gaps: list[float], rate: float) -> dict[str, Any]:
    return await serving.run_arrivals(url, {}, items, gaps, rate)


def _server_stats(url: str) -> dict[str, Any]:
    """The server engine's counters (empty when the server does not report them)."""
    import httpx

    resp = httpx.get(url + "/get_server_info", timeout=30)
    return resp.json().get("engine_stats", {}) if resp.status_code == 200 else {}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """Counter increments over a run (a counter first reported during the run counts from 0)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, int)}


def engine_first_token(delta: dict[str, int]) -> dict[str, Any]:
    """The engine's own first-token times over a run, from its histogram's delta: how many, the
    mean, and the bucket edges (ms) the median and the 99th percentile fall within. Beside the
    client's TTFT, it tells the engine's share of a tail from the hops around it."""
    n = delta.get("first_token_count", 0)

    def within(q: float) -> int | None:
        return next((e for e in FIRST_TOKEN_EDGES_MS if delta.get(first_token_key(e), 0) >= q * n), None)

    return {
        "count": n,
        "mean_ms": delta.get("first_token_sum_us", 0) / 1e3 / n if n else None,
        "p50_within_ms": within(0.5) if n else None,
        "p99_within_ms": within(0.99) if n else None,
    }


def _runs(size: dict[str, Any]) -> list[tuple[str, float, list[serving.Item], list[float]]]:
    """(label, rate, items, gaps) for each rate: fresh prompts per rate (no cross-run cache hits)."""
    out = []
    for k, rate in enumerate(size["rates"]):
        items = items_for(size, seed=100 + k)
        out.append((f"rate_{rate}", float(rate), items, arrival_gaps(len(items), float(rate), seed=200 + k)))
    return out


def engine_side(engine: Engine, size: dict[str, Any]) -> dict[str, Any]:
    """The anchor, in the engine worker: every rate through Engine.async_generate."""
    out: dict[str, Any] = {}
    for label, rate, items, gaps in _runs(size):
        engine.flush_cache()
        before = engine.get_stats()
        out[label] = asyncio.run(_engine_rate(engine, items, gaps, rate))
        delta = out[label]["engine_stats_delta"] = stats_delta(before, engine.get_stats())
        out[label]["engine_first_token"] = engine_first_token(delta)
    return out


def server_side(size: dict[str, Any], engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A server process with default settings, then every rate over HTTP from this process."""
    ns = argparse.Namespace(
        model_path=engine_kwargs.get("model_path"),
        device=engine_kwargs.get("device"),
        dtype=None,
        max_total_tokens=engine_kwargs.get("max_total_tokens"),
        model_shape=engine_kwargs.get("model_shape"),
        context_length=engine_kwargs.get("context_length"),
        max_running_requests=None,
        chunked_prefill_size=None,
        random_weights=False,
        disable_radix_cache=False,
        api_key=None,
        num_prompts=size["num_requests"],
        launch_timeout=600,
    )
    t0 = time.perf_counter()
    proc, url = serving.launch_server(ns)
    out: dict[str, Any] = {"server_start_s": time.perf_counter() - t0}
    try:
        import httpx

        for label, rate, items, gaps in _runs(size):
            httpx.post(url + "/flush_cache", timeout=60)
            before = _server_stats(url)
            out[label] = asyncio.run(_server_rate(url, items, gaps, rate))
            after = _server_stats(url)
            delta = out[label]["engine_stats_delta"] = stats_delta(before, after)
            out[label]["engine_first_token"] = engine_first_token(delta)
    finally:
        proc.terminate()
        proc.wait(120)
    return out
