"""The end-to-end suite must not rot: `benchmarks/suite.py --small --device cpu` runs every worker
on the default model and reports every CPU-measurable ratio; --compare and the README writer work
on its result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "benchmarks" / "suite.py"
CPU_RATIOS = {
    "few_shot_radix",
    "tree_radix",
    "multi_turn_radix",
    "few_shot_cascade",
    "json_jump_forward",
    "json_vs_free",
    "json_valid",
    "server_vs_engine",
    "server_ttft_p99",
    "server_itl_vs_engine",
    "programs_vs_raw",
    "spec_b1_verify",
    "spec_batch_auto",
    "b128_vs_hf",
    "mixed_out_tok_s",
    "kernel_compiles",
    "q4_decode_b1",
    "fp8_b128",
    "kv_fp8_mixed",
}


@pytest.mark.slow
def test_small_suite_runs_every_worker(tmp_path: Path) -> None:
    out = tmp_path / "suite_cpu.json"
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--small", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {k: v["_worker"]["status"] for k, v in result["workers"].items()} == {
        "engine": "ok",
        "radix_off": "ok",
        "hf": "ok",
        "server": "ok",
        "quant": "ok",
    }
    assert not [k for k, v in result["workers"]["quant"]["quant"].items() if "error" in json.dumps(v)]
    assert CPU_RATIOS <= set(result["ratios"]), sorted(CPU_RATIOS - set(result["ratios"]))
    assert result["ratios"]["json_valid"]["value"] == 1.0  # every finished constrained output validates
    spec = result["workers"]["engine"]["speculative"]
    assert spec["b1_replay"]["greedy_identical"] and spec["batch_auto"]["greedy_identical"]
    assert spec["b1_replay"]["acceptance_length"] > 2  # replayed drafts are accepted
    assert all(v["met"] is None for v in result["ratios"].values())  # targets are judged on the GPU run
    assert (tmp_path / "suite_cpu.md").read_text().count("\n| ") >= len(CPU_RATIOS)

    same = subprocess.run(
        [
            sys.executable,
            str(SUITE),
            "--compare",
            str(out),
            "--workers",
            "",
            "--out",
            str(tmp_path / "again.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert same.returncode == 0, same.stdout + same.stderr


def test_compare_flags_a_fall_in_either_direction() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import suite_report

    old = {
        "ratios": {
            "a": {"value": 2.0, "higher_is_better": True, "what": "a"},
            "b": {"value": 100.0, "higher_is_better": False, "what": "b"},
        }
    }
    new = {
        "ratios": {
            "a": {"value": 1.85, "higher_is_better": True, "what": "a"},
            "b": {"value": 104.0, "higher_is_better": False, "what": "b"},
        }
    }
    assert [x.split(":")[0] for x in suite_report.compare(old, new)] == ["a"]
    new["ratios"]["b"]["value"] = 106.0
    assert [x.split(":")[0] for x in suite_report.compare(old, new)] == ["a", "b"]


def test_throughput_refuses_a_run_with_aborted_requests() -> None:
    """A workload whose requests aborted (an OOM in a step, say) raises, so the suite records an
    error for it instead of a throughput over the requests that survived."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import suite_workloads
    import torch

    def out(tokens: int, finish: dict) -> dict:
        return {
            "output_ids": [1] * tokens,
            "meta_info": {"completion_tokens": tokens, "finish_reason": finish},
        }

    class Stub:
        device = torch.device("cpu")

        def __init__(self, outs: list[dict]) -> None:
            self.outs = outs

        def get_stats(self) -> dict:
            return {}

        def generate(self, input_ids: list, sampling_params: dict) -> list[dict]:
            return self.outs

    ok = out(4, {"type": "length", "length": 4})
    res = suite_workloads.generate_ids(Stub([ok, ok]), [[1], [2]], {})  # type: ignore[arg-type]
    assert res["output_tokens"] == 8
    bad = out(1, {"type": "abort", "message": "CUDA out of memory"})
    with pytest.raises(RuntimeError, match="1 of 2 requests aborted, first: CUDA out of memory"):
        suite_workloads.generate_ids(Stub([ok, bad]), [[1], [2]], {})  # type: ignore[arg-type]


def test_one_row_experiments_run_only_when_named_and_restore_the_choice() -> None:
    """SUITE_QUANT_VARIANTS may name an experiment (the Q4_0 engine with another one-row kernel
    kind); the default run never includes one, and the kind applies only inside its engine's run,
    at SUITE_INT8X's configs where set."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import suite_quant
    import torch

    from radixlm.kernels.quant_gemv_configs import choose_config

    assert [v[0] for v in suite_quant.variants(None)] == [v[0] for v in suite_quant.VARIANTS]
    picked = {label: (kwargs, kind) for label, kwargs, _, kind in suite_quant.variants("q4_0,q4_0_int8x")}
    assert picked == {
        "q4_0": ({"quantization": "q4_0"}, None),
        "q4_0_int8x": ({"quantization": "q4_0"}, "int8x"),
    }

    class Shape:
        qtype, cols, rows = "Q4_0", 4096, 4096

    row = torch.zeros(1, 4096, dtype=torch.bfloat16)
    default = choose_config(row, Shape())
    with suite_quant.one_row_kind("int8x"):
        assert choose_config(row, Shape()).kind == "int8x"
    assert choose_config(row, Shape()) == default and default.kind != "int8x"

    class LongShape:
        qtype, cols, rows = "Q4_0", 14336, 4096

    long_default = choose_config(row, LongShape())
    os.environ["SUITE_INT8X"] = "8:4096:4/16:2048:2:3"  # the sweep's fastest, short K / long K
    try:
        with suite_quant.one_row_kind("int8x"):
            short, long = choose_config(row, Shape()), choose_config(row, LongShape())
    finally:
        del os.environ["SUITE_INT8X"]
    assert (short.label(), long.label()) == ("int8x m16 n8 k4096 w4 s1", "int8x m16 n16 k2048 w2 s3")
    assert choose_config(row, LongShape()) == long_default  # restored on leaving


def test_large_weights_take_int8x_by_default_and_the_experiments_set_one_kind() -> None:
    """By default one row against a Q4_0 weight of at least LARGE_WEIGHT values runs INT8X_ONE_ROW,
    long rows included, smaller weights dp4a; q4_0_dp4a puts every weight on dp4a and q4_0_int8x
    every weight on int8x's configs, q4_0_stream gate_up, down and the other Q4 weights on
    SUITE_STREAM's where it names one; every choice is as before on leaving."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import suite_quant
    import torch

    from radixlm.kernels.quant_gemv_configs import DP4A, INT8X, INT8X_ONE_ROW, LARGE_WEIGHT, choose_config

    picked = {label: kind for label, _, _, kind in suite_quant.variants("q4_0_dp4a")}
    assert picked == {"q4_0_dp4a": "dp4a"}

    def shape(rows: int, cols: int) -> object:
        return type("Shape", (), {"qtype": "Q4_0", "rows": rows, "cols": cols})()

    small, just_small = shape(6144, 4096), shape(LARGE_WEIGHT // 4096 - 1, 4096)
    large, down = shape(LARGE_WEIGHT // 4096, 4096), shape(4096, 14336)
    x, x_long = torch.zeros(1, 4096, dtype=torch.bfloat16), torch.zeros(1, 14336, dtype=torch.bfloat16)
    cases = [(x, small), (x, just_small), (x, large), (x_long, down)]
    before = [choose_config(a, w) for a, w in cases]
    assert before[:2] == [DP4A, DP4A] and before[2:] == [INT8X_ONE_ROW, INT8X_ONE_ROW]
    assert choose_config(torch.zeros(2, 4096, dtype=torch.bfloat16), large).kind != "int8x"
    with suite_quant.one_row_kind("dp4a"):
        assert [choose_config(a, w).kind for a, w in cases] == ["dp4a"] * 4
    with suite_quant.one_row_kind("int8x"):
        assert [choose_config(a, w) for a, w in cases[:3]] == [INT8X] * 3
    assert [choose_config(a, w) for a, w in cases] == before
    shape_q8 = type("Shape", (), {"qtype": "Q8_0", "rows": 128256, "cols": 4096})()
    q8_before = choose_config(x, shape_q8)
    short, long, rest = (
        "stream m16 n1 k4096 w1 s2 p21",
        "stream m16 n1 k16384 w8 s3 p5",
        "stream m16 n2 k1024 w1 s1 p16",
    )
    for spec, want in [  # small, just small, large (gate_up), down
        ("1:4096:1:2:21/-/-", [DP4A.label(), DP4A.label(), short, INT8X_ONE_ROW.label()]),
        ("-/1:16384:8:3:5/-", [DP4A.label(), DP4A.label(), INT8X_ONE_ROW.label(), long]),
        ("1:4096:1:2:21/1:16384:8:3:5/2:1024:1:1:16", [rest, rest, short, long]),
        ("1:4096:1:2:21/1:16384:8:3:5/1:4096:1:2:21", [short, short, short, long]),  # rest = short
    ]:
        os.environ["SUITE_STREAM"] = spec
        try:
            with suite_quant.one_row_kind("stream"):
                got = [choose_config(a, w).label() for a, w in cases]
                q8 = choose_config(x, shape_q8)
        finally:
            del os.environ["SUITE_STREAM"]
        assert got == want, spec
        assert q8 == q8_before, spec  # Q8_0 (the lm_head) keeps its kernel
    assert [choose_config(a, w) for a, w in cases] == before
    with pytest.raises(ValueError, match="no one-row experiment kind"):
        with suite_quant.one_row_kind("int4x"):
            pass


def test_the_ttft_tail_names_when_each_slow_request_was_sent() -> None:
    """A serving run's slowest first tokens come with their send times and the requests in flight
    then, so a stall (slow requests close in time) reads apart from a burst (many in flight)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving

    results = [serving.Result(ok=True, ttft=0.01, e2e=1.0) for _ in range(8)]
    results[5].ttft, results[6].ttft = 0.3, 0.2
    results = serving.with_send_times(results, [0.1 * i for i in range(8)])
    tail = serving.summarize(results, 2.0, 16.0)["slowest_ttft"]
    assert [round(t["ttft_ms"]) for t in tail[:3]] == [300, 200, 10]
    assert [t["sent_s"] for t in tail[:2]] == pytest.approx([0.5, 0.6])
    assert tail[0]["in_flight"] == 5  # the five sent before it, each still streaming at 0.5 s
    assert len(tail) == 5


def test_quant_gpu_names_its_fastest_int8x_configs_in_the_form_the_suite_reads() -> None:
    """quant_gpu.py's sweep names the int8x configs with the least time (x rounded beforehand):
    summed over the layer shapes of K < LONG_K, and the down projection's own; the string it
    prints is what SUITE_INT8X takes, and reads back as those two configs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import quant_gpu
    import suite_quant

    a, b = "int8x m16 n8 k4096 w4 s1", "int8x m16 n16 k2048 w2 s3"
    times = {"qkv": (3.0, 2.0), "o": (2.0, 2.5), "gate_up": (9.0, 8.0), "down": (6.0, 7.0)}
    shapes = {
        f"{name} Q4_0": {"by_m": {1: {"int8x_pre_rounded_us": {a: ta, b: tb}}}}
        for name, (ta, tb) in times.items()
    }
    fastest = quant_gpu.fastest_int8x(shapes)
    assert fastest is not None and (fastest["short"], fastest["long"]) == (b, a)
    assert fastest["short_us"] == 12.5 and fastest["suite_int8x"] == "16:2048:2:3/8:4096:4:1"
    short, long = suite_quant.int8x_configs(fastest["suite_int8x"])
    assert (short.label(), long.label()) == (b, a)
    assert quant_gpu.fastest_int8x({f"{n} Q4_0": {"by_m": {1: {}}} for n in times}) is None
