"""MaskBench runner: for each engine, the schemas it compiles, the valid test instances it accepts and
the invalid ones it wrongly accepts (by subset and by the keyword the instance breaks), compile and
per-token mask time percentiles, side by side → JSON + Markdown under benchmarks/results/.

    python benchmarks/maskbench.py PATH [--engine ours|ours_nonstrict|xgrammar|llguidance|all]
        [--limit N] [--sources A,B] [--compile-only] [--generate N] [--out benchmarks/results/maskbench_dev]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from bench_env import environment, write_result
from maskbench_core import ENGINES, EngineRunner, broken_keyword, load_docs, run_engine

from radixlm.grammars import GrammarBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from grammar_helpers import load_default_tokenizer  # noqa: E402

VOCAB = 49152


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 3) if xs else None


def summarize(engine: str, records: list[dict], docs_by_name: dict[str, Any], mask_us: list[float]) -> dict:
    by_src: dict[str, Counter] = defaultdict(Counter)
    inv_kw: Counter = Counter()
    rejected_valid, accepted_invalid = [], []
    for rec in records:
        src = by_src[rec["source"]]
        src["schemas"] += 1
        src["compiled"] += rec["compiled"]
        for inst, test in zip(rec["instances"], docs_by_name[rec["name"]].tests):
            kind = "valid" if inst["valid"] else "invalid"
            src[f"{kind}_total"] += 1
            src[f"{kind}_accepted"] += inst["accepted"]
            src[f"{kind}_in_mask"] += inst["accepted"] and inst.get("in_mask", True)
            if inst["valid"] and not inst["accepted"]:
                rejected_valid.append({"doc": rec["name"], "description": inst["description"]})
            if not inst["valid"] and inst["accepted"]:
                kw = broken_keyword(docs_by_name[rec["name"]].schema, test["data"])
                inv_kw[kw] += 1
                accepted_invalid.append(
                    {"doc": rec["name"], "keyword": kw, "description": inst["description"]}
                )
    total = sum(by_src.values(), Counter())
    compile_ms = [r["compile_ms"] for r in records if r["compiled"]]
    errors = Counter(
        r["error"].split(":")[0] + ":" + r["error"].split(":")[1][:60]
        for r in records
        if not r["compiled"] and ":" in r["error"]
    )
    return {
        "engine": engine,
        "schemas": total["schemas"],
        "compiled": total["compiled"],
        "valid_total": total["valid_total"],
        "valid_accepted": total["valid_accepted"],
        "valid_in_mask": total["valid_in_mask"],
        "invalid_total": total["invalid_total"],
        "invalid_accepted": total["invalid_accepted"],
        "invalid_accepted_by_keyword": dict(inv_kw.most_common()),
        "by_source": {k: dict(v) for k, v in sorted(by_src.items())},
        "compile_ms": {
            "p50": pct(compile_ms, 50),
            "p90": pct(compile_ms, 90),
            "p99": pct(compile_ms, 99),
            "max": pct(compile_ms, 100),
        },
        "mask_us": {"p50": pct(mask_us, 50), "p99": pct(mask_us, 99), "n": len(mask_us)},
        "compile_errors_top": dict(errors.most_common(15)),
        "dropped_keywords": dict(
            Counter(d.split(" at ")[0] for r in records for d in r.get("dropped", [])).most_common()
        ),
        "checked_keywords": dict(
            Counter(d.split(" at ")[0] for r in records for d in r.get("checked", [])).most_common()
        ),
        "schemas_with_checks": sum(bool(r.get("checked")) for r in records),
        "rejected_valid": rejected_valid[:50],
        "accepted_invalid": accepted_invalid[:50],
    }


def rate(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.2f}%)" if b else "-"


def markdown(result: dict) -> str:
    env, rows = result["environment"], result["engines"]
    lines = [
        f"# MaskBench — {result['path']}",
        "",
        f"{env['date']}; {env['cpu_count']} CPU cores, load {env['load_average_1_5_15']}; python "
        f"{env['python']}; xgrammar {env.get('xgrammar')}; llguidance {env.get('llguidance')}; "
        f"jsonschema-rs {env.get('jsonschema_rs')}; "
        f"torch {env['torch']}; tokenizer SmolLM2-135M (vocab {VOCAB}). Instances are written "
        "with separators ', ' / ': ' in their own key order. Accepted: every token accepted and EOS "
        "terminates (the grammar's language). Inside the mask: accepted with every token also inside "
        "the generation mask (ours writes declared order and integers of at most 16 digits, so it is narrower).",
        "",
        "| engine | compiled | valid accepted | valid inside the mask | invalid accepted | "
        "compile p50 / p99 ms | mask p50 / p99 µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {rate(r['compiled'], r['schemas'])} | "
            f"{rate(r['valid_accepted'], r['valid_total'])} | "
            f"{rate(r.get('valid_in_mask', 0), r['valid_total'])} | "
            f"{rate(r['invalid_accepted'], r['invalid_total'])} | {r['compile_ms']['p50']} / "
            f"{r['compile_ms']['p99']} | {r['mask_us']['p50']} / {r['mask_us']['p99']} |"
        )
    sources = sorted({s for r in rows for s in r["by_source"]})
    lines += [
        "",
        "Compiled by source:",
        "",
        "| source | " + " | ".join(r["engine"] for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for s in sources:
        cells = [
            rate(r["by_source"].get(s, {}).get("compiled", 0), r["by_source"].get(s, {}).get("schemas", 0))
            for r in rows
        ]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Valid instances inside the mask / invalid instances accepted, by source:",
        "",
        "| source | " + " | ".join(r["engine"] for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for s in sources:
        cells = []
        for r in rows:
            b = r["by_source"].get(s, {})
            valid = rate(b.get("valid_in_mask", 0), b.get("valid_total", 0))
            cells.append(f"{valid} / {b.get('invalid_accepted', 0)} of {b.get('invalid_total', 0)}")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "Invalid instances accepted, by the keyword they break (jsonschema's best match):", ""]
    for r in rows:
        lines.append(f"- {r['engine']}: {r['invalid_accepted_by_keyword'] or 'none'}")
    lines += ["", "Keywords held by value checks (schemas with at least one check; keyword counts):", ""]
    for r in rows:
        if r.get("schemas_with_checks"):
            lines.append(f"- {r['engine']}: {r['schemas_with_checks']} schemas; {r['checked_keywords']}")
    lines += ["", "Keywords dropped (non-strict) / top compile refusals:", ""]
    for r in rows:
        lines.append(
            f"- {r['engine']}: dropped {r['dropped_keywords'] or 'none'}; "
            f"refusals {r['compile_errors_top'] or 'none'}"
        )
    if "generation" in result:
        g = result["generation"]
        lines += [
            "",
            f"Generation (SmolLM2, T=1, {g['schemas']} schemas): {g['finished']} finished, "
            f"{g['finished_valid']} of them validate; {g['length']} hit max_new_tokens; "
            f"{g.get('dead_ends', 0)} ended in a value check's dead end.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--engine", default="all", choices=[*ENGINES, "all"])
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument(
        "--sources", default=None, help="only these subsets, comma-separated (e.g. Synthesized,JME)"
    )
    ap.add_argument("--compile-only", action="store_true", help="skip the instance walks")
    ap.add_argument(
        "--generate", type=int, default=0, help="also generate for N compiled schemas (SmolLM2, T=1)"
    )
    ap.add_argument("--out", default="benchmarks/results/maskbench_dev")
    ap.add_argument(
        "--doc-timeout", type=int, default=60, help="seconds per document (compile + walks); 0: none"
    )
    ap.add_argument(
        "--memory-gb", type=float, default=0, help="address-space limit for the run (a schema over it fails)"
    )
    args = ap.parse_args(argv)
    if args.memory_gb:
        limit = int(args.memory_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    docs = load_docs(args.path, args.limit)
    if args.sources:
        docs = [d for d in docs if d.source in set(args.sources.split(","))]
    by_name = {d.name: d for d in docs}
    tok = load_default_tokenizer()
    backend = GrammarBackend(tok, VOCAB, use_disk_cache=False, max_cached=8)
    _ = backend.llguidance, backend.xgrammar  # tokenizer set-up is not a schema's compile time
    env = environment()
    import importlib.metadata as md

    env["llguidance"] = md.version("llguidance")
    env["jsonschema_rs"] = md.version("jsonschema-rs")  # computes the value checks' verdicts
    result: dict[str, Any] = {"path": args.path, "environment": env, "engines": []}
    for engine in ENGINES if args.engine == "all" else [args.engine]:
        runner = EngineRunner(backend, engine)
        t0 = time.time()
        records = list(run_engine(runner, docs, walk=not args.compile_only, doc_timeout_s=args.doc_timeout))
        summary = summarize(engine, records, by_name, runner.mask_us)
        summary["wall_s"] = round(time.time() - t0, 1)
        result["engines"].append(summary)
        print(
            f"{engine}: compiled {summary['compiled']}/{summary['schemas']}, valid "
            f"{rate(summary['valid_accepted'], summary['valid_total'])}, invalid "
            f"{rate(summary['invalid_accepted'], summary['invalid_total'])}, compile {summary['compile_ms']}, "
            f"mask {summary['mask_us']} ({summary['wall_s']} s)",
            file=sys.stderr,
            flush=True,
        )
    if args.generate:
        from maskbench_generate import generate

        result["generation"] = generate(docs, args.generate)
    write_result(f"{args.out}.json", result)
    Path(f"{args.out}.md").write_text(markdown(result))
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()
