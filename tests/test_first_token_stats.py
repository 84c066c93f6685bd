"""The engine's own first-token histogram: cumulative buckets a delta of two readings turns into
the histogram of the requests between them, its Prometheus form, the suite's summary of it, and
an engine run that counts one first token per request that produced one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from radixlm.backend.scheduler_config import FIRST_TOKEN_EDGES_MS, SchedulerStats, first_token_key
from radixlm.backend.server.metrics import _EngineCollector

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from suite_serving import engine_first_token, stats_delta  # noqa: E402


def test_buckets_are_cumulative_and_a_delta_is_the_window() -> None:
    stats = SchedulerStats()
    for s in (0.004, 0.03, 0.03, 0.15):
        stats.observe_first_token(s)
    before = dict(stats.extra)
    stats.observe_first_token(0.3)
    e = stats.extra
    assert e["first_token_count"] == 5 and e["first_token_sum_us"] == 514_000
    assert [e.get(first_token_key(m), 0) for m in (5, 10, 50, 200, 500)] == [1, 1, 3, 4, 5]
    delta = stats_delta(before, e)
    assert delta["first_token_count"] == 1 and delta[first_token_key(200)] == 0
    assert delta[first_token_key(500)] == 1
    summary = engine_first_token(delta)
    assert summary == {"count": 1, "mean_ms": 300.0, "p50_within_ms": 500, "p99_within_ms": 500}
    stats.reset()
    assert "first_token_count" not in stats.extra


def test_the_summary_takes_the_first_edge_holding_each_quantile() -> None:
    stats = SchedulerStats()
    for _ in range(98):
        stats.observe_first_token(0.008)
    stats.observe_first_token(0.07)
    stats.observe_first_token(1.5)
    s = engine_first_token(dict(stats.extra))
    assert (s["p50_within_ms"], s["p99_within_ms"]) == (10, 100)  # the 99th of 100 is the 70 ms one
    assert engine_first_token({})["count"] == 0 and engine_first_token({})["p99_within_ms"] is None
    stats.observe_first_token(500.0)  # past the last edge: counted, in no finite bucket
    assert stats.extra["first_token_count"] == 101
    assert stats.extra[first_token_key(FIRST_TOKEN_EDGES_MS[-1])] == 100


def test_prometheus_histogram_of_the_engine_stats() -> None:
    stats = SchedulerStats()
    for s in (0.004, 0.03, 0.3):
        stats.observe_first_token(s)
    registry = CollectorRegistry()
    registry.register(_EngineCollector(lambda: dict(stats.extra), lambda: 0))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    samples = fams["radixlm_engine_time_to_first_token_seconds"].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert buckets["0.005"] == 1 and buckets["0.05"] == 2 and buckets["0.2"] == 2 and buckets["+Inf"] == 3
    total = next(s.value for s in samples if s.name.endswith("_sum"))
    assert total == pytest.approx(0.334)


def test_an_engine_counts_one_first_token_per_request_that_made_one() -> None:
    from radixlm.backend.engine import Engine

    engine = Engine(model_shape="smollm2-tiny", device="cpu", context_length=256)
    try:
        before = engine.get_stats()
        engine.generate(
            input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 3, "ignore_eos": True}
        )
        engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 0})  # prefill only
        delta = stats_delta(before, engine.get_stats())
        assert delta["first_token_count"] == 2
        assert delta["first_token_sum_us"] > 0
        assert delta[first_token_key(FIRST_TOKEN_EDGES_MS[-1])] == 2
    finally:
        engine.shutdown()
