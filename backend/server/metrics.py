"""Prometheus metrics of one server: engine gauges/counters read from `engine.get_stats()` at
scrape time (so they never drift from the engine's own books) and server-side latency
histograms (TTFT, inter-token, end-to-end). One registry per app, so apps never collide."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..scheduler_config import FIRST_TOKEN_EDGES_MS, first_token_key

_LATENCY_BUCKETS = tuple(edge / 1000 for edge in FIRST_TOKEN_EDGES_MS)
_ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

# (stats key, metric name, help) for engine counters and gauges.
_ENGINE_GAUGES = (
    ("num_running", "radixlm_num_running_requests", "Requests in the running batch"),
    ("num_waiting", "radixlm_num_waiting_requests", "Requests waiting to be scheduled"),
    ("kv_total_slots", "radixlm_kv_total_slots", "KV pool size in token slots"),
    ("kv_free_slots", "radixlm_kv_free_slots", "Free KV token slots"),
    ("kv_cached_slots", "radixlm_kv_cached_slots", "KV token slots held by the radix cache"),
)
_ENGINE_COUNTERS = (
    ("computed_prompt_tokens", "radixlm_computed_prompt_tokens", "Prompt tokens prefilled"),
    ("cached_prompt_tokens", "radixlm_cached_prompt_tokens", "Prompt tokens served from the radix cache"),
    ("generated_tokens", "radixlm_generation_tokens", "Tokens generated"),
    ("num_retractions", "radixlm_retractions", "Requests retracted (preempted) for lack of KV"),
    ("forward_passes", "radixlm_forward_passes", "Model forward passes"),
    ("num_finished", "radixlm_engine_finished_requests", "Requests the engine finished"),
    ("num_aborted", "radixlm_engine_aborted_requests", "Requests the engine aborted"),
)


class _EngineCollector(Collector):
    def __init__(self, get_stats: Callable[[], dict[str, Any]], get_pending: Callable[[], int]) -> None:
        self._get_stats = get_stats
        self._get_pending = get_pending

    def collect(self) -> Iterator[Metric]:
        stats = self._get_stats()
        for key, name, doc in _ENGINE_GAUGES:
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=float(stats[key]))
        for key, name, doc in _ENGINE_COUNTERS:
            if key in stats:
                yield CounterMetricFamily(name, doc, value=float(stats[key]))
        total, free = stats.get("kv_total_slots"), stats.get("kv_free_slots")
        if total:
            yield GaugeMetricFamily(
                "radixlm_kv_usage", "Fraction of KV slots in use", value=1.0 - float(free or 0) / float(total)
            )
        if "first_token_count" in stats:
            yield _engine_first_token(stats)
        cached = float(stats.get("cached_prompt_tokens", 0))
        computed = float(stats.get("computed_prompt_tokens", 0))
        yield CounterMetricFamily(
            "radixlm_prompt_tokens", "Prompt tokens (cached + computed)", value=cached + computed
        )
        yield GaugeMetricFamily(
            "radixlm_radix_hit_rate",
            "Share of prompt tokens served from cache",
            value=cached / (cached + computed) if cached + computed else 0.0,
        )
        yield GaugeMetricFamily(
            "radixlm_server_pending_requests",
            "Engine requests admitted by the server and program runs, not finished",
            value=float(self._get_pending()),
        )


def _engine_first_token(stats: dict[str, Any]) -> Metric:
    """The engine's own first-token times (from taking a request to its first token), beside the
    server's TTFT, which adds the HTTP and process hops on either side."""
    buckets = [
        (str(edge / 1000), float(stats.get(first_token_key(edge), 0))) for edge in FIRST_TOKEN_EDGES_MS
    ]
    return HistogramMetricFamily(
        "radixlm_engine_time_to_first_token_seconds",
        "Time from the engine taking a request to its first output token",
        buckets=[*buckets, ("+Inf", float(stats["first_token_count"]))],
        sum_value=stats.get("first_token_sum_us", 0) / 1e6,
    )


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "radixlm_time_to_first_token_seconds",
            "Time to first token (streamed)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "radixlm_inter_token_latency_seconds",
            "Time per output token after the first",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "radixlm_e2e_request_latency_seconds",
            "End-to-end time of a finished request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.rejected = Counter(
            "radixlm_rejected_requests", "Requests refused with 503 (queue full)", registry=r
        )
        self.client_aborts = Counter(
            "radixlm_client_aborted_requests",
            "Engine requests aborted because the client left or was cancelled",
            registry=r,
        )
        self.http_errors = Counter(
            "radixlm_http_errors", "Requests answered with an error status", ["status"], registry=r
        )

    def bind_engine(self, get_stats: Callable[[], dict[str, Any]], get_pending: Callable[[], int]) -> None:
        self.registry.register(_EngineCollector(get_stats, get_pending))

    def observe_finished(self, seq_e2e: float) -> None:
        self.e2e.observe(seq_e2e)

    def render(self) -> bytes:
        return generate_latest(self.registry)
