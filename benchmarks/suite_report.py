"""The suite's verdicts: every ratio it reports (what it divides, which way is better, the target),
the Markdown table, the PNG, --compare against an earlier result, and README.md's Measured
section. A ratio whose inputs are missing (a worker failed or was skipped) is absent, never 0."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = ("few_shot", "tree", "multi_turn")
README_BEGIN, README_END = "<!-- suite:begin -->", "<!-- suite:end -->"


@dataclass
class Ratio:
    key: str
    what: str
    fn: Callable[[dict[str, Any]], float]
    higher_is_better: bool = True
    target: float | None = None  # on the GPU suite; the CPU --small run reports without targets
    unit: str = "x"


def _w(r: dict[str, Any], *path: str) -> Any:
    x: Any = r["workers"]
    for p in path:
        x = x[p]
    return x


def _forks(r: dict[str, Any]) -> float:
    runs = _w(r, "engine", "forks", "runs")
    off = next(x["decode_tok_s"] for x in runs if not x["cascade"])
    return min(x["decode_tok_s"] for x in runs if x["cascade"]) / off


def _compiles(r: dict[str, Any]) -> float:
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, dict):
            for k, v in x.items():
                total += v if k == "kernel_compiles" and isinstance(v, int) else 0
                if k != "kernel_compiles":
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(_w(r, "engine"))
    return total


def _json_first(r: dict[str, Any]) -> float:
    j = _w(r, "engine", "json")
    first = j.get("default_first") or j["jump_forward_first"]  # the latter: results before the rename
    warm = j["jump_forward"] if j.get("default_jump_forward", True) else j["no_jump_forward"]
    return first["duration_s"] / warm["duration_s"]


def _json_valid(r: dict[str, Any]) -> float:
    """Worst valid fraction among runs with finished outputs (a run where none finished says nothing)."""
    runs = [v for k, v in _w(r, "engine", "json").items() if isinstance(v, dict) and "valid_fraction" in v]
    return min(v["valid_fraction"] for v in runs if v.get("finished", 1) > 0)


def _programs(r: dict[str, Any]) -> float:
    vals = [
        v["raw_out_tok_per_s"] and v["program_out_tok_per_s"] / v["raw_out_tok_per_s"]
        for v in _w(r, "engine", "programs").values()
    ]
    return min(vals)


RATIOS: list[Ratio] = [
    Ratio(
        "decode_b1_roofline",
        "batch-1 decode tok/s / weight-streaming roofline",
        lambda r: _w(r, "engine", "decode_b1", "fraction_of_roofline"),
        target=0.88,
    ),
    Ratio(
        "decode_b1_overlap",
        "batch-1 decode, overlap scheduling on / off",
        lambda r: (
            _w(r, "engine", "decode_b1", "overlap_on", "decode_tok_s")
            / _w(r, "engine", "decode_b1", "overlap_off", "decode_tok_s")
        ),
    ),
    Ratio(
        "b128_vs_hf",
        "batch of equal requests (H200: 128 x in 512 / out 256), output tok/s, radixlm / HF generate",
        lambda r: _w(r, "engine", "b128", "output_tok_s") / _w(r, "hf", "b128", "output_throughput"),
    ),
    Ratio(
        "mixed_out_tok_s",
        "mixed requests all at once (H200: 1,000, in 256-1,024 / out 128-512), output tok/s",
        lambda r: _w(r, "engine", "mixed", "output_tok_s"),
        target=9000,
        unit=" tok/s",
    ),
    Ratio(
        "mixed_decode_split",
        "mixed requests, output tok/s: mixed steps' decode rows through decode attention / through the extend kernel",
        lambda r: _w(r, "engine", "mixed", "output_tok_s") / _w(r, "engine", "mixed_unsplit", "output_tok_s"),
    ),
    *[
        Ratio(
            f"{w}_radix",
            f"{w}: radix cache on / off (wall time, same tokens)",
            lambda r, w=w: (
                _w(r, "radix_off", "prefix", w, "duration_s") / _w(r, "engine", "prefix", w, "duration_s")
            ),
            target={"few_shot": 8.0, "tree": 2.0, "multi_turn": 2.0}[w],
        )
        for w in PREFIX
    ],
    *[
        Ratio(
            f"{w}_cascade",
            f"{w}: cascade on / off (default engine, radix on)",
            lambda r, w=w: (
                _w(r, "engine", "prefix_cascade_off", w, "duration_s")
                / _w(r, "engine", "prefix", w, "duration_s")
            ),
            target=0.98,
        )
        for w in PREFIX
    ],
    Ratio(
        "forks64_cascade",
        "fork program (H200: 64 forks of an 8,192-token document): decode tok/s cascade on / off (worse of 2)",
        _forks,
        target=1.9,
    ),
    Ratio(
        "json_jump_forward",
        "JSON batch (H200: B=64): jump-forward on / off (wall time)",
        lambda r: (
            _w(r, "engine", "json", "no_jump_forward", "duration_s")
            / _w(r, "engine", "json", "jump_forward", "duration_s")
        ),
        target=1.3,
    ),
    Ratio(
        "json_first_batch",
        "JSON batch: the first constrained batch after start / the same batch warm (time)",
        _json_first,
        higher_is_better=False,
        target=1.1,
    ),
    Ratio(
        "json_vs_free",
        "JSON batch without jump-forward / free decoding of the same token counts (speed)",
        lambda r: (
            _w(r, "engine", "json", "free_same_lengths", "duration_s")
            / _w(r, "engine", "json", "no_jump_forward", "duration_s")
        ),
        target=0.95,
    ),
    Ratio(
        "json_valid", "finished JSON outputs that validate (worst of the three runs)", _json_valid, target=1.0
    ),
    Ratio(
        "server_vs_engine",
        "HTTP server / in-process Engine output tok/s, all requests at once",
        lambda r: (
            _w(r, "server", "serving", "rate_inf", "output_throughput")
            / _w(r, "engine", "serving", "rate_inf", "output_throughput")
        ),
        target=0.9,
    ),
    Ratio(
        "server_ttft_p99",
        "HTTP server TTFT p99 at the fixed request rate",
        lambda r: next(
            v["ttft"]["p99_ms"]
            for k, v in _w(r, "server", "serving").items()
            if k.startswith("rate_") and k != "rate_inf"
        ),
        higher_is_better=False,
        target=150,
        unit=" ms",
    ),
    Ratio(
        "server_itl_vs_engine",
        "ITL p50 at the fixed rate, server / in-process Engine",
        lambda r: next(
            v["itl"]["p50_ms"] / _w(r, "engine", "serving", k, "itl", "p50_ms")
            for k, v in _w(r, "server", "serving").items()
            if k.startswith("rate_") and k != "rate_inf"
        ),
        higher_is_better=False,
        target=1.1,
    ),
    Ratio(
        "programs_vs_raw",
        "DSL programs / the same engine calls replayed raw (tok/s, worst kind)",
        _programs,
        target=0.95,
    ),
    Ratio(
        "spec_b1_verify",
        "batch-1 decode, speculation on / off, drafts replaying the target's greedy output (4 drafts, all accepted)",
        lambda r: _w(r, "engine", "speculative", "b1_replay", "ratio"),
        target=3.0,
    ),
    Ratio(
        "spec_batch_auto",
        "large batch (H200: 64) of copy-heavy prompts, n-gram speculation on / off under the automatic policy",
        lambda r: _w(r, "engine", "speculative", "batch_auto", "ratio"),
        target=0.97,
    ),
    Ratio(
        "q4_decode_b1",
        "batch-1 decode tok/s, Q4_0 weights (quantized at load) / bf16",
        lambda r: (
            _w(r, "quant", "quant", "q4_0", "decode_b1", "overlap_on", "decode_tok_s")
            / _w(r, "engine", "decode_b1", "overlap_on", "decode_tok_s")
        ),
        target=2.5,
    ),
    Ratio(
        "q4_int8x_vs_default",
        "batch-1 decode tok/s, Q4_0 weights, one-row kernel int8x / the default kind (only where "
        "SUITE_QUANT_VARIANTS names q4_0_int8x)",
        lambda r: (
            _w(r, "quant", "quant", "q4_0_int8x", "decode_b1", "overlap_on", "decode_tok_s")
            / _w(r, "quant", "quant", "q4_0", "decode_b1", "overlap_on", "decode_tok_s")
        ),
    ),
    Ratio(
        "q4_dp4a_vs_default",
        "batch-1 decode tok/s, Q4_0 weights, one-row kernel dp4a for every weight / the default "
        "choice (only where SUITE_QUANT_VARIANTS names q4_0_dp4a)",
        lambda r: (
            _w(r, "quant", "quant", "q4_0_dp4a", "decode_b1", "overlap_on", "decode_tok_s")
            / _w(r, "quant", "quant", "q4_0", "decode_b1", "overlap_on", "decode_tok_s")
        ),
    ),
    Ratio(
        "q4_stream_vs_default",
        "batch-1 decode tok/s, Q4_0 weights, persistent one-row kernel (SUITE_STREAM's configs) / "
        "the default choice (only where SUITE_QUANT_VARIANTS names q4_0_stream)",
        lambda r: (
            _w(r, "quant", "quant", "q4_0_stream", "decode_b1", "overlap_on", "decode_tok_s")
            / _w(r, "quant", "quant", "q4_0", "decode_b1", "overlap_on", "decode_tok_s")
        ),
    ),
    Ratio(
        "fp8_b128",
        "batch of equal requests (H200: 128 x in 512 / out 256), output tok/s, FP8 weights / bf16",
        lambda r: (
            _w(r, "quant", "quant", "fp8", "b128", "output_tok_s") / _w(r, "engine", "b128", "output_tok_s")
        ),
        target=1.3,
    ),
    Ratio(
        "kv_fp8_mixed",
        "mixed requests all at once, output tok/s, fp8 KV cache / bf16 KV cache",
        lambda r: (
            _w(r, "quant", "quant", "kv_fp8", "mixed", "output_tok_s")
            / _w(r, "engine", "mixed", "output_tok_s")
        ),
        target=1.2,
    ),
    Ratio(
        "kernel_compiles",
        "Triton compilations during the default engine's timed runs",
        _compiles,
        higher_is_better=False,
        target=0,
        unit="",
    ),
]


def ratios(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for r in RATIOS:
        try:
            value = float(r.fn(result))
        except (KeyError, TypeError, StopIteration, ValueError, ZeroDivisionError):
            continue
        if math.isnan(value):
            continue
        met = None
        if r.target is not None and not result.get("small"):
            met = value >= r.target if r.higher_is_better else value <= r.target
        out[r.key] = {
            "value": value,
            "what": r.what,
            "higher_is_better": r.higher_is_better,
            "target": r.target,
            "met": met,
            "unit": r.unit,
        }
    return out


def _fmt(v: float, unit: str) -> str:
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:,.0f}{unit}" if abs(v) >= 100 else f"{v:.3g}{unit}"


def table(result: dict[str, Any]) -> str:
    rows = ["| ratio | value | target | met | what |", "|---|---|---|---|---|"]
    for key, r in result.get("ratios", {}).items():
        tgt = (
            ""
            if r["target"] is None
            else ("≥ " if r["higher_is_better"] else "≤ ") + _fmt(r["target"], r["unit"])
        )
        met = {True: "yes", False: "**no**", None: ""}[r["met"]]
        rows.append(f"| {key} | {_fmt(r['value'], r['unit'])} | {tgt} | {met} | {r['what']} |")
    workers = ", ".join(
        f"{k}: {v.get('_worker', {}).get('status', '?')}" for k, v in result["workers"].items()
    )
    return "\n".join(rows) + f"\n\nworkers: {workers}\n"


def write_markdown(result: dict[str, Any], path: Path) -> None:
    env = result["env"]
    head = (
        f"# End-to-end suite ({'small, ' if result['small'] else ''}{env.get('gpu')}, {env.get('date')})\n\n"
        f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}; "
        f"wall {result.get('wall_s', 0):.0f} s. Every ratio is measured side by side in this run.\n\n"
    )
    path.write_text(head + table(result))


def plot(result: dict[str, Any], path: Path) -> None:
    """Each ratio over its target (1.0 = target met exactly, log scale); skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    rows = [(k, r) for k, r in result.get("ratios", {}).items() if r["target"]]
    if not rows:
        return
    score = [
        (r["value"] / r["target"]) if r["higher_is_better"] else (r["target"] / max(r["value"], 1e-9))
        for _, r in rows
    ]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.2))
    ax.barh([k for k, _ in rows], score, color=["tab:green" if s >= 1 else "tab:red" for s in score])
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("measured / target (>= 1 is met)")
    ax.set_title(f"radixlm suite, {result['env'].get('gpu')}, {result['env'].get('date', '')[:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def compare(old: dict[str, Any], new: dict[str, Any], tolerance: float = 0.05) -> list[str]:
    """Ratios that got worse by more than `tolerance` (relative), in the ratio's own direction."""
    fell = []
    for key, r in new.get("ratios", {}).items():
        before = old.get("ratios", {}).get(key)
        if not before or before["value"] == 0:
            continue
        change = r["value"] / before["value"]
        worse = change < 1 - tolerance if r["higher_is_better"] else change > 1 + tolerance
        if worse:
            fell.append(f"{key}: {before['value']:.4g} -> {r['value']:.4g} ({r['what']})")
    return fell


def write_readme(results: list[tuple[str, dict[str, Any]]], readme: Path) -> None:
    """Replace the text between the suite markers in README.md with the results' table: the first
    (path, result) is the full run; rows of later (partial) runs replace its rows and are marked."""
    (path, base), later = results[0], results[1:]
    merged = dict(base.get("ratios", {}))
    notes = []
    for k, (p, r) in enumerate(later, start=1):
        mark = "†" * k
        for key, row in r.get("ratios", {}).items():
            merged[key] = {**row, "what": f"{row['what']} {mark}"}
        notes.append(f"{mark} from `{p}` ({r['env'].get('date', '')[:10]}, a partial run after fixes).")
    env = base["env"]
    body = (
        f"{README_BEGIN}\nFrom `{path}` ({env.get('gpu')}, {env.get('date', '')[:10]}, "
        f"`python benchmarks/suite.py`): every feature on and off in the same run, on default settings; "
        f"rows marked **no** miss their target.\n\n"
        + table({**base, "ratios": merged}).split("\n\nworkers:")[0]
        + "".join(f"\n\n{n}" if i == 0 else f"\n{n}" for i, n in enumerate(notes))
        + f"\n{README_END}"
    )
    text = readme.read_text()
    if README_BEGIN in text and README_END in text:
        pre, rest = text.split(README_BEGIN, 1)
        text = pre + body + rest.split(README_END, 1)[1]
    else:
        raise ValueError(f"{readme} has no {README_BEGIN} ... {README_END} markers")
    readme.write_text(text)
