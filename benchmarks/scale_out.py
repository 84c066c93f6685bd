"""Scale-out benchmark: `radixlm serve --dp N` behind sglang-router, cache-aware vs round-robin,
on a multi-tenant few-shot workload: T tenants, each with its own long few-shot prefix shared by
R requests, sent shuffled at a fixed concurrency. Per policy, a fresh deployment (cold caches);
reported: prompt-prefix hit rate from the replicas' own counters (cached / (cached + computed)
prompt tokens), output tok/s, requests per replica, every request answered. The KV pool of each
replica is sized to hold about half the tenants' prefixes, the regime where routing decides hits.

CPU (default model):  python benchmarks/scale_out.py            # → results/scale_out_cpu.json
Smaller:              python benchmarks/scale_out.py --tenants 8 --requests-per-tenant 6
"""

from __future__ import annotations

import argparse
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_env import environment, write_result  # noqa: E402

WORDS = (
    "river stone apple cloud lamp garden mirror copper violet harbor pencil meadow "
    "lantern engine thunder basket candle orbit silver forest window marble saddle"
).split()


def tenant_prefix(tenant: int, shots: int, rng: random.Random) -> str:
    """A few-shot prompt of its own: an instruction and `shots` worked examples."""
    lines = [f"Tenant {tenant} assistant. Answer with the word count of each sentence."]
    for _ in range(shots):
        sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14)))
        lines.append(f"Sentence: {sentence}\nCount: {len(sentence.split())}")
    return "\n".join(lines) + "\n"


def workload(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    prefixes = [tenant_prefix(t, args.shots, rng) for t in range(args.tenants)]
    prompts = []
    for prefix in prefixes:
        for _ in range(args.requests_per_tenant):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 9)))
            prompts.append(f"{prefix}Sentence: {question}\nCount:")
    rng.shuffle(prompts)
    return prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Deployment:
    """`python -m radixlm.launch_server --dp N` as a subprocess; the replicas' URLs from its log."""

    def __init__(self, args: argparse.Namespace, policy: str, log: Path) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "radixlm.launch_server", "--dp", str(args.dp), "--port", str(self.port)]
        cmd += ["--router-policy", policy, "--max-total-tokens", str(args.kv_tokens), "--log-level", "info"]
        cmd += ["--device", "cpu"]
        self.log = log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600
        while "replicas behind sglang-router" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"deployment did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        self.url = f"http://127.0.0.1:{self.port}"
        self.replicas = re.search(r"over replicas (.+)$", log.read_text(), re.M).group(1).split(", ")

    def stats(self) -> list[dict[str, int]]:
        return [httpx.get(r + "/get_server_info", timeout=30).json()["engine_stats"] for r in self.replicas]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def run_policy(args: argparse.Namespace, policy: str, prompts: list[str], workdir: Path) -> dict[str, Any]:
    dep = Deployment(args, policy, workdir / f"{policy}.log")
    try:
        before = dep.stats()
        client = httpx.Client(timeout=600)

        def one(prompt: str) -> int:
            body = {
                "text": prompt,
                "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True},
            }
            r = client.post(dep.url + "/generate", json=body)
            return r.json()["meta_info"]["completion_tokens"] if r.status_code == 200 else -1

        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outputs = list(pool.map(one, prompts))
        wall = time.perf_counter() - start
        after = dep.stats()
    finally:
        dep.stop()
    delta = [
        {k: a[k] - b[k] for k in ("cached_prompt_tokens", "computed_prompt_tokens", "num_finished")}
        for a, b in zip(after, before)
    ]
    cached = sum(d["cached_prompt_tokens"] for d in delta)
    computed = sum(d["computed_prompt_tokens"] for d in delta)
    answered = sum(1 for o in outputs if o >= 0)
    result = {
        "policy": policy,
        "requests": len(prompts),
        "answered": answered,
        "wall_s": round(wall, 2),
        "output_tok_s": round(sum(o for o in outputs if o > 0) / wall, 2),
        "prefix_hit_rate": round(cached / max(1, cached + computed), 4),
        "cached_prompt_tokens": cached,
        "computed_prompt_tokens": computed,
        "requests_per_replica": [d["num_finished"] for d in delta],
    }
    print(result, flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--requests-per-tenant", type=int, default=8)
    p.add_argument("--shots", type=int, default=24, help="worked examples per tenant prefix")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--kv-tokens", type=int, default=None, help="KV pool per replica (default: ~half the prefixes)"
    )
    p.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "scale_out_cpu.json"))
    args = p.parse_args()
    prompts = workload(args)
    if (
        args.kv_tokens is None
    ):  # ~20 tokens a worked example: half the prefixes, plus each request's own tokens
        args.kv_tokens = max(2048, args.tenants * args.shots * 20 // 2 + args.concurrency * 64)
    env = environment()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_policy(args, policy, prompts, Path(tmp)) for policy in args.policies]
    by = {r["policy"]: r for r in results}
    summary: dict[str, Any] = {}
    if "cache_aware" in by and "round_robin" in by:
        ca, rr = by["cache_aware"], by["round_robin"]
        summary = {
            "hit_rate_ratio": round(ca["prefix_hit_rate"] / max(1e-9, rr["prefix_hit_rate"]), 2),
            "throughput_ratio": round(ca["output_tok_s"] / max(1e-9, rr["output_tok_s"]), 2),
            "all_answered": all(r["answered"] == r["requests"] for r in results),
        }
        print(summary)
    env["load_average_after"] = __import__("os").getloadavg()
    write_result(
        args.out,
        {
            "benchmark": "scale_out",
            "config": vars(args),
            "environment": env,
            "results": results,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
