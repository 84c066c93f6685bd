"""Grammar benchmark (CPU): per-token mask time (p50/p99) and compile time, our FSM vs xgrammar on the
same regexes and JSON schemas, side by side in one run → benchmarks/results/grammar_cpu.json.

    python benchmarks/grammar.py [--walks 3] [--out benchmarks/results/grammar_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from radixlm.grammars import GrammarBackend, allocate_token_bitmask, json_schema_to_regex
from radixlm.grammars.fsm import compile_regex

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from grammar_helpers import allowed_ids, load_default_tokenizer, pick_token  # noqa: E402

REGEXES = {
    "date": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z0-9._%+-]{1,20}@[a-z0-9-]{1,12}\.(com|org|net)",
    "ipv4": r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)",
    "number": r"-?(0|[1-9]\d{0,8})(\.\d{1,4})?",
    "enum": r"(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)",
    "quoted": r'"([^"\\]|\\.){0,40}"',
    "non_ascii": r"(café|naïve|résumé|日本語) [α-ω]{1,5}",
    "json_shaped": r'\{"name": "[A-Za-z ]{1,16}", "tags": \["[a-z]{1,6}"(, "[a-z]{1,6}"){0,2}\]\}',
}
S = {"type": "string", "maxLength": 20}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer"}, "email": S},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "tags": {"type": "array", "items": S, "maxItems": 4},
                },
                "required": ["id", "tags"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "enum_anyof": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["a", "b", "c"]},
            "v": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
        "required": ["kind", "v"],
    },
    "defs_array": {
        "$defs": {
            "P": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/P"},
        "minItems": 1,
        "maxItems": 3,
    },
}


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q)) if xs else float("nan")


def time_walks(grammar, vocab, walks: int, max_steps: int = 200) -> dict:
    """Time fill_next_token_bitmask and accept_token at every step of random walks."""
    fill_us, accept_us = [], []
    bitmask = allocate_token_bitmask(1, vocab.vocab_size)
    preferred = [i for i, b in enumerate(vocab.token_bytes) if b in (b'"', b"}", b"]")]
    single = [i for i, b in enumerate(vocab.token_bytes) if len(b) == 1]
    steps = 0
    for seed in range(walks):
        rng = np.random.default_rng(seed)
        m = grammar.new_matcher()
        for _ in range(max_steps):
            t0 = time.perf_counter_ns()
            m.fill_next_token_bitmask(bitmask, 0)
            t1 = time.perf_counter_ns()
            tok = pick_token(allowed_ids(bitmask[0], vocab.vocab_size), rng, vocab.eos_ids, preferred, single)
            t2 = time.perf_counter_ns()
            assert m.accept_token(tok)
            t3 = time.perf_counter_ns()
            fill_us.append((t1 - t0) / 1e3)
            accept_us.append((t3 - t2) / 1e3)
            steps += 1
            if m.is_terminated():
                break
    return {
        "steps": steps,
        "mask_p50_us": percentile(fill_us, 50),
        "mask_p99_us": percentile(fill_us, 99),
        "accept_p50_us": percentile(accept_us, 50),
        "accept_p99_us": percentile(accept_us, 99),
    }


def bench_one(tokenizer, vocab_size: int, kind: str, spec, walks: int) -> dict:
    out = {}
    for engine in ("fsm", "xgrammar"):
        # a fresh backend (no disk cache, no in-memory cache) measures a cold compile
        be = GrammarBackend(tokenizer, vocab_size, use_disk_cache=False)
        be.vocab.trie  # noqa: B018 - per-vocabulary work, shared by all grammars: not compile time
        if engine == "xgrammar":
            be.xgrammar  # noqa: B018 - tokenizer info setup, likewise
        if engine == "fsm":
            regex = spec if kind == "regex" else json_schema_to_regex(spec)
            t0 = time.perf_counter()
            grammar = compile_regex(regex, be.vocab, use_disk_cache=False)  # every mask row
            row: dict = {"compile_ms": (time.perf_counter() - t0) * 1e3, "dfa_states": grammar.num_states}
            # GrammarBackend returns once the DFA and the first mask row exist; the other rows fill
            # on demand and in the background. 'cold' walks start right then.
            t0 = time.perf_counter()
            lazy = be.compile(kind, spec, engine=engine)
            row["first_mask_ready_ms"] = (time.perf_counter() - t0) * 1e3
            row["cold"] = time_walks(lazy, be.vocab, walks)
            be.shutdown(wait=True)  # its background row filling would contend for the GIL below
        else:
            t0 = time.perf_counter()
            grammar = be.compile(kind, spec, engine=engine)
            row = {"compile_ms": (time.perf_counter() - t0) * 1e3}
        row.update(time_walks(grammar, be.vocab, walks))
        out[engine] = row
        be.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--walks", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "grammar_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("RADIXLM_CACHE", tempfile.mkdtemp(prefix="radixlm-bench-"))
    tokenizer = load_default_tokenizer()
    vocab_size = 49152
    cases = [("regex", name, r) for name, r in REGEXES.items()]
    cases += [("json_schema", name, json.dumps(s)) for name, s in SCHEMAS.items()]
    if args.only:
        cases = [c for c in cases if c[1] in args.only.split(",")]
    results = []
    for kind, name, spec in cases:
        r = bench_one(tokenizer, vocab_size, kind, spec, args.walks)
        results.append({"kind": kind, "name": name, **r})
        print(
            f"{kind:11s} {name:12s} fsm mask p50 {r['fsm']['mask_p50_us']:6.1f} us p99 {r['fsm']['mask_p99_us']:6.1f}"
            f" compile {r['fsm']['compile_ms']:7.1f} ms | xgrammar mask p50 {r['xgrammar']['mask_p50_us']:6.1f} us"
            f" p99 {r['xgrammar']['mask_p99_us']:6.1f} compile {r['xgrammar']['compile_ms']:7.1f} ms",
            flush=True,
        )
    summary = {}
    for engine in ("fsm", "xgrammar"):
        summary[engine] = {
            "median_of_mask_p50_us": float(np.median([r[engine]["mask_p50_us"] for r in results])),
            "max_mask_p99_us": float(np.max([r[engine]["mask_p99_us"] for r in results])),
            "median_compile_ms": float(np.median([r[engine]["compile_ms"] for r in results])),
        }
    versions = {
        p: importlib.metadata.version(p)
        for p in ("torch", "xgrammar", "interegular", "numpy", "transformers")
    }
    doc = {
        "benchmark": "grammar mask/compile, our FSM vs xgrammar, CPU",
        "gpu": "none",
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "versions": versions,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "tokenizer": "SmolLM2-135M-Instruct (GPT-2 byte-level BPE)",
        "vocab_size": vocab_size,
        "walks_per_grammar": args.walks,
        "method": "random walks sampling from the mask; time.perf_counter_ns around each fill_next_token_bitmask "
        "(one bitmask row) and accept_token. compile_ms = fresh backend, no caches, after the "
        "per-vocabulary setup (token trie / xgrammar TokenizerInfo); for our FSM it is the full "
        "compile (every mask row), first_mask_ready_ms is when GrammarBackend.compile returns "
        "(DFA + first row; other rows fill on demand / in the background), and 'cold' are walks "
        "started right then (rows computed on first visit). The top-level mask/accept numbers are "
        "with the grammar complete (a cached grammar: the steady state while serving).",
        "goal": {"fsm_mask_p50_us_max": 20.0},
        "summary": summary,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
