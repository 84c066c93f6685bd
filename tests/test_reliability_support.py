"""Reliability scenarios shared by tests/test_reliability_*.py and benchmarks/reliability.py (no
tests here): real servers on free 127.0.0.1 ports (a `radixlm serve` subprocess, or an in-process
uvicorn thread around a shared Engine), Prometheus reads, and one function per scenario that
drives the server and returns its figures as a dict. Every loop is bounded in count and time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WORDS = "the cat sat on a mat while birds sang over green hills and rivers ran to the sea".split()


@dataclass
class Srv:
    """A running server: its URL, an authorized client, and (subprocess only) the process."""

    url: str
    proc: subprocess.Popen | None = None
    thread: Any = None
    log: Path | None = None
    http: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.http = httpx.Client(base_url=self.url, headers=AUTH, timeout=120)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in fam.samples:
                if not s.labels:
                    out[s.name] = s.value
        return out

    def gen(self, **body: Any) -> Any:
        r = self.http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle_flushed(self, timeout_s: float = 60) -> dict[str, float]:
        """Wait until nothing runs and the radix cache flushes; the metrics after the flush."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = not (
                m["radixlm_num_running_requests"]
                or m["radixlm_num_waiting_requests"]
                or m["radixlm_server_pending_requests"]
            )
            if idle and self.http.post("/flush_cache").status_code == 200:
                return self.metrics()
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout_s} s: {m}")
            time.sleep(0.1)

    def close(self) -> None:
        self.http.close()
        if self.thread is not None:
            self.thread.stop(60)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_subprocess(args: list[str], log_dir: Path, timeout_s: float = 240) -> Srv:
    """`python -m radixlm.backend.server ARGS` (the same parser as `radixlm serve`) on a free loopback port."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "radixlm.backend.server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--device",
        "cpu",
        "--log-level",
        "warning",
        *args,
    ]
    log = log_dir / f"server-{port}.log"
    with open(log, "w") as f:  # a file, not a pipe: a full pipe would stall the server
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Srv(url, proc=proc, log=log)
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("server did not start")
        time.sleep(0.3)


def start_thread(engine: Any, programs: Any = None, **limits: Any) -> Srv:
    """An in-process uvicorn server on a free loopback port around an existing Engine."""
    from radixlm.backend.server.app import create_app
    from radixlm.backend.server.launch import ServerThread
    from radixlm.backend.server.runner import ServerLimits

    app = create_app(engine, api_key=KEY, programs=programs, limits=ServerLimits(**limits))
    thread = ServerThread(app, drain_timeout_s=2.0).start()
    return Srv(thread.url, thread=thread)


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield "[DONE]" if data == "[DONE]" else json.loads(data)


def prompt(i: int, n_words: int) -> str:
    return f"Story {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n_words))


def greedy(max_new: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}


def rss_bytes(pid: int) -> int:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        text = Path(f"/proc/{pid}/status").read_text()
        kb = next(line.split()[1] for line in text.splitlines() if line.startswith("VmRSS:"))
        return int(kb) * 1024


# ---------------------------------------------------------------- 1. overload


class TokenRate:
    """Samples the generation-token counter in the background: tok/s over any time window."""

    def __init__(self, srv: Srv, period_s: float = 0.25) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._client = httpx.Client(base_url=srv.url, headers=AUTH, timeout=30)
        self._period = period_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            text = self._client.get("/metrics").text
            for fam in text_string_to_metric_families(text):
                if fam.name == "radixlm_generation_tokens":
                    self.samples.append((time.monotonic(), fam.samples[0].value))
            self._stop.wait(self._period)

    def rate(self, t0: float, t1: float) -> float:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return 0.0
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._client.close()


def overload(srv: Srv, n_requests: int, prompt_words: int, max_new: int) -> dict[str, Any]:
    """Half the requests alone (reference + 'before' tok/s), all at once (the storm), the other
    half alone again ('after' tok/s). Greedy outputs of the storm must equal the alone runs."""
    start = srv.wait_idle_flushed()
    prompts = [prompt(i, prompt_words) for i in range(n_requests)]
    params = greedy(max_new)
    rate = TokenRate(srv)
    try:
        half = n_requests // 2
        t0 = time.monotonic()
        alone = {i: srv.gen(text=prompts[i], sampling_params=params)["output_ids"] for i in range(half)}
        t1 = time.monotonic()
        with ThreadPoolExecutor(n_requests) as pool:
            storm = list(
                pool.map(
                    lambda p: srv.http.post("/generate", json={"text": p, "sampling_params": params}), prompts
                )
            )
        t2 = time.monotonic()
        alone.update(
            {
                i: srv.gen(text=prompts[i], sampling_params=params)["output_ids"]
                for i in range(half, n_requests)
            }
        )
        t3 = time.monotonic()
    finally:
        rate.stop()
    ok = [r for r in storm if r.status_code == 200]
    outs = [r.json() for r in ok]
    end = srv.wait_idle_flushed()
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return {
        "kv_pool_tokens": int(end["radixlm_kv_total_slots"]),
        "tokens_demanded": prompt_tokens + n_requests * max_new,
        "oversubscription": (prompt_tokens + n_requests * max_new) / end["radixlm_kv_total_slots"],
        "sent": n_requests,
        "finished": len(ok),
        "lost": n_requests - len(ok),
        "status_codes": sorted({r.status_code for r in storm}),
        "identical_to_alone": sum(o["output_ids"] == alone[i] for i, o in enumerate(outs)),
        "finish_length": sum(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs),
        "retractions": end["radixlm_retractions_total"] - start["radixlm_retractions_total"],
        "tok_s_before": rate.rate(t0, t1),
        "tok_s_during": rate.rate(t1, t2),
        "tok_s_after": rate.rate(t2, t3),
        "seconds": {"before": t1 - t0, "storm": t2 - t1, "after": t3 - t2},
        "kv_free_after_flush": int(end["radixlm_kv_free_slots"]),
        "kv_free_initial": int(start["radixlm_kv_free_slots"]),
    }


# ---------------------------------------------------------------- 2. disconnects and aborts


def _drop_midway(url: str, i: int, events_before_drop: int) -> int:
    body = {"text": prompt(i, 4), "stream": True, "sampling_params": greedy(400)}
    path = "/generate"
    if i % 2:
        path, body = (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": prompt(i, 4)}],
                "stream": True,
                "max_tokens": 400,
                "ignore_eos": True,
            },
        )
    seen = 0
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= events_before_drop:
                break  # leaving the block closes the connection mid-stream
    return seen


def _abort_by_id(url: str, i: int) -> str:
    rid = f"rel-abort-{i}-{time.monotonic_ns()}"
    body = {"text": prompt(i, 4), "rid": rid, "stream": True, "sampling_params": greedy(400)}
    last: Any = None
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        with c.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            for k, event in enumerate(sse_events(r.iter_lines())):
                if k == 1:
                    assert c.post("/abort_request", json={"rid": rid}).json()["found"] is True
                if event != "[DONE]":
                    last = event
    return last["meta_info"]["finish_reason"]["type"]


def disconnects(srv: Srv, n_drop: int, n_abort: int, n_bystanders: int) -> dict[str, Any]:
    """n_drop streaming clients close early, n_abort are aborted by id, while n_bystanders
    greedy requests run beside them; their outputs must equal the same requests run alone."""
    start = srv.wait_idle_flushed()
    ref_params = greedy(12)
    refs = [
        srv.gen(text=prompt(1000 + i, 6), sampling_params=ref_params)["output_ids"]
        for i in range(n_bystanders)
    ]
    start = srv.wait_idle_flushed()
    with ThreadPoolExecutor(n_drop + n_abort + n_bystanders) as pool:
        bystanders = [
            pool.submit(srv.gen, text=prompt(1000 + i, 6), sampling_params=ref_params)
            for i in range(n_bystanders)
        ]
        drops = [pool.submit(_drop_midway, srv.url, i, 2) for i in range(n_drop)]
        aborts = [pool.submit(_abort_by_id, srv.url, i) for i in range(n_abort)]
        seen = [f.result(timeout=300) for f in drops]
        abort_reasons = [f.result(timeout=300) for f in aborts]
        outs = [f.result(timeout=300)["output_ids"] for f in bystanders]
    end = srv.wait_idle_flushed()
    delta = {
        k: end[k] - start[k]
        for k in (
            "radixlm_client_aborted_requests_total",
            "radixlm_engine_aborted_requests_total",
            "radixlm_generation_tokens_total",
        )
    }
    return {
        "disconnects": n_drop,
        "dropped_after_events": sorted(set(seen)),
        "aborted_by_id": n_abort,
        "abort_finish_reasons": sorted(set(abort_reasons)),
        "client_aborts_counted": delta["radixlm_client_aborted_requests_total"],
        "engine_aborts_counted": delta["radixlm_engine_aborted_requests_total"],
        "tokens_generated": delta["radixlm_generation_tokens_total"],
        "bystanders": n_bystanders,
        "bystanders_identical": sum(a == b for a, b in zip(outs, refs)),
        "kv_free_initial": int(start["radixlm_kv_free_slots"]),
        "kv_free_after": int(end["radixlm_kv_free_slots"]),
        "kv_total": int(end["radixlm_kv_total_slots"]),
        "leaked_slots": int(start["radixlm_kv_free_slots"] - end["radixlm_kv_free_slots"]),
    }


# ---------------------------------------------------------------- 6. soak


def soak(srv: Srv, seconds: float, rate_per_s: float, max_new: int = 8) -> dict[str, Any]:
    """Steady arrivals (one every 1/rate s, at most 8 in flight) for `seconds`; every response
    must be 200; KV free count after a flush and the server's RSS are compared start vs end."""
    assert srv.proc is not None, "soak measures a subprocess server's RSS"
    start = srv.wait_idle_flushed()
    rss0 = rss_bytes(srv.proc.pid)
    codes: list[int] = []
    t_end = time.monotonic() + seconds
    with ThreadPoolExecutor(8) as pool:
        futures = []
        k = 0
        while time.monotonic() < t_end:
            if sum(not f.done() for f in futures) < 8:
                body = {
                    "text": prompt(k, 3 + k % 7),
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0.7, "seed": k},
                }
                futures.append(pool.submit(lambda b=body: srv.http.post("/generate", json=b).status_code))
                k += 1
            time.sleep(1.0 / rate_per_s)
        codes = [f.result(timeout=300) for f in futures]
    end = srv.wait_idle_flushed()
    rss1 = rss_bytes(srv.proc.pid)
    return {
        "seconds": seconds,
        "sent": len(codes),
        "ok": codes.count(200),
        "errors": len(codes) - codes.count(200),
        "kv_free_initial": int(start["radixlm_kv_free_slots"]),
        "kv_free_after": int(end["radixlm_kv_free_slots"]),
        "rss_start_mb": rss0 / 2**20,
        "rss_end_mb": rss1 / 2**20,
        "rss_growth": rss1 / rss0 - 1.0,
    }


# ---------------------------------------------------------------- 7. graceful shutdown


def graceful_shutdown(srv: Srv, n_short: int, n_long: int, short_new: int = 4) -> dict[str, Any]:
    """SIGTERM while `n_short` short and `n_long` endless streams run: shorts finish by length,
    longs end with finish_reason abort after the drain timeout, the process exits."""
    assert srv.proc is not None
    results: dict[str, Any] = {}

    def stream(name: str, max_new: int) -> None:
        body = {"text": f"{name}:", "stream": True, "sampling_params": greedy(max_new)}
        try:
            with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
                with c.stream("POST", "/generate", json=body) as r:
                    results[name] = list(sse_events(r.iter_lines()))
        except httpx.HTTPError as e:
            results[name] = [f"error: {e!r}"]

    names = [(f"short{i}", short_new) for i in range(n_short)] + [(f"long{i}", 5000) for i in range(n_long)]
    threads = [threading.Thread(target=stream, args=a, daemon=True) for a in names]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while srv.metrics()["radixlm_num_running_requests"] < len(names) and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    os.kill(srv.proc.pid, signal.SIGTERM)
    for t in threads:
        t.join(90)
    code = srv.proc.wait(90)
    reasons = {
        name: (
            ev[-2]["meta_info"]["finish_reason"]["type"]
            if len(ev) >= 2 and ev[-1] == "[DONE]"
            else repr(ev[-1:])
        )
        for name, ev in results.items()
    }
    return {
        "exit_code": code,
        "seconds_to_exit": time.monotonic() - t0,
        "threads_hung": sum(t.is_alive() for t in threads),
        "finish_reasons": reasons,
    }


# ---------------------------------------------------------------- 3. API fuzzing


def fuzz_api(
    srv: Srv, examples_per_op: int, time_cap_s: float, path_values: dict[str, str] | None = None
) -> dict[str, Any]:
    """schemathesis cases (valid and invalid) from the server's own /openapi.json, sent with the
    API key; every answer must be 2xx/4xx (a transport error or timeout counts as status 599).
    Stops taking new cases after `time_cap_s`."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_dict(srv.http.get("/openapi.json").json())
    tried: dict[str, int] = {}
    errors: list[str] = []
    statuses: dict[int, int] = {}
    unsatisfiable: list[str] = []
    deadline = time.monotonic() + time_cap_s
    ops = [r.ok() for r in schema.get_all_operations()]
    plan = [
        (op, mode, None)
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
        for op in ops
    ]
    for op in ops:  # also aim at real path values (a registered program), not only random ones
        given_values = {k: v for k, v in (path_values or {}).items() if "{" + k + "}" in op.path}
        if given_values:
            plan.append((op, schemathesis.GenerationMode.POSITIVE, given_values))
    for op, mode, values in plan:

        @settings(
            max_examples=examples_per_op,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.generate],
        )
        @given(case=op.as_strategy(generation_mode=mode, path_parameters=values))
        def run(case: Any) -> None:
            label = case.operation.label
            if time.monotonic() > deadline:
                return
            tried[label] = tried.get(label, 0) + 1
            try:
                resp = case.call(base_url=srv.url, headers=AUTH, timeout=60)
            except Exception as e:  # noqa: BLE001 - a hang or dropped connection is a finding
                errors.append(f"{type(e).__name__} {label} body={case.body!r:.300}")
                statuses[599] = statuses.get(599, 0) + 1
                return
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            if resp.status_code >= 500 or resp.status_code < 200:
                errors.append(f"{resp.status_code} {label} body={case.body!r:.300} -> {resp.text[:300]}")

        try:
            run()
        except Unsatisfiable:  # e.g. no invalid input exists for a GET without parameters
            unsatisfiable.append(f"{mode.value} {op.label}")
    healthy = srv.http.get("/health_generate").status_code == 200
    return {
        "operations": len(ops),
        "cases_tried": sum(tried.values()),
        "per_operation": tried,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "5xx_seen": sum(v for k, v in statuses.items() if k >= 500),
        "errors": errors[:20],
        "no_cases_for": unsatisfiable,
        "healthy_after": healthy,
    }
