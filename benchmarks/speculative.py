"""Speculative decoding (n-gram / prompt lookup) on and off, side by side in one engine: per
workload and batch size, timed runs alternate off/on (the per-request switch), after one untimed
warm-up that fills the prefix cache, so both modes decode from cached prompts under the same
machine load. Reports output tokens/s per run, the on/off ratio per pair (its spread is the
noise), acceptance length, verify steps per on-run, and whether greedy outputs matched (on the CPU
a batch-1 verify step's rows run the decode step's kernels, bit for bit; beside other requests
they may take other kernels, which round differently, so a near tie can flip; --quantization
dequantize is exact). Workloads: JSON extraction from a document, a ReAct step quoting an
observation, editing a code block (copy-heavy), free chat.
--replay-wrong W measures the verify machinery instead: drafts replay the target's own greedy output
(recorded by the off run), each one wrong with probability W, verified on every step (policy
"always") — acceptance on demand, as on random weights, where n-grams accept nothing.

    python benchmarks/speculative.py [--batch-sizes 1,8,64] [--reps 3] [--replay-wrong 0] [--out PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench_env import device_tag, environment, write_result

from radixlm import Engine
from radixlm.backend.speculative_policy import SpecPolicy
from radixlm.backend.speculative_proposer import ReplayProposer

NAMES = ["Maria Gonzalez", "Wei Chen", "Amara Okafor", "Lukas Schmidt", "Priya Raman", "Diego Alvarez"]
STREETS = ["Market Street", "Oak Avenue", "Hillside Road", "Harbor Lane", "Elm Court"]
ITEMS = ["USB-C cable", "wireless mouse", "laptop stand", "HDMI adapter", "desk lamp", "notebook"]


def chat(text: str, prefix: str = "") -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{prefix}"


def document(rng: random.Random) -> dict[str, str]:
    name = rng.choice(NAMES)
    return {
        "name": name,
        "email": name.lower().replace(" ", ".") + "@example.com",
        "address": f"{rng.randint(10, 9999)} {rng.choice(STREETS)}, Apt {rng.randint(1, 40)}B, Springfield",
        "items": ", ".join(f"{rng.randint(1, 5)}x {rng.choice(ITEMS)}" for _ in range(3)),
        "order": str(rng.randint(1000, 99999)),
    }


def json_extract(rng: random.Random) -> str:
    d = document(rng)
    doc = (
        f"Order #{d['order']} was placed by {d['name']} ({d['email']}). Items: {d['items']}. "
        f"Shipping address: {d['address']}. The customer asked for delivery before Friday."
    )
    return chat(f"Document:\n{doc}\n\nExtract name, email, address and items as JSON.", '{"name": "')


def react(rng: random.Random) -> str:
    d = document(rng)
    obs = (
        f"Customer record: {d['name']}, email {d['email']}, address {d['address']}. "
        f"Last order {d['order']}: {d['items']}. Status: shipped, tracking number {rng.randint(10**9, 10**10)}."
    )
    return (
        "<|im_start|>system\nYou are an agent. Use tools, then quote the observation you rely on.<|im_end|>\n"
        f"<|im_start|>user\nWhere is the last order of {d['name']}?<|im_end|>\n<|im_start|>assistant\n"
        f"Action: lookup_customer[{d['name']}]\nObservation: {obs}\n"
        'Thought: I quote the observation verbatim: "'
    )


def code_edit(rng: random.Random) -> str:
    v = rng.choice(["total", "acc", "result", "value"])
    code = (
        "def order_total(items, tax_rate):\n"
        f"    {v} = 0\n"
        "    for item in items:\n"
        f"        {v} += item.price * item.quantity\n"
        f"    {v} = {v} * (1 + tax_rate)\n"
        f"    return round({v}, 2)\n"
    )
    return chat(
        f"Rename the function order_total to compute_total and return the whole code:\n```python\n{code}```",
        "```python\n",
    )


def free_chat(rng: random.Random) -> str:
    topic = rng.choice(["the sea", "a mountain village", "learning to cook", "a robot gardener", "autumn"])
    return chat(f"Write a short original story about {topic}.")


WORKLOADS = {"json_extract": json_extract, "react": react, "code_edit": code_edit, "free_chat": free_chat}
MAX_NEW = {1: 96, 8: 64, 64: 32}


def run_once(
    engine: Engine, prompts: list[str], max_new: int, algorithm: str, drafts: int | None = None
) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": max_new, "speculative_algorithm": algorithm}
    if drafts is not None:
        params["speculative_num_draft_tokens"] = drafts
    before = engine.get_stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [dict(params) for _ in prompts])
    dt = time.perf_counter() - t0
    after = engine.get_stats()
    delta = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in (
            "spec_accepted_tokens",
            "spec_verify_requests",
            "spec_draft_tokens",
            "spec_verify_steps",
            "forward_passes",
        )
    }
    n_tok = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "seconds": dt,
        "tokens": n_tok,
        "tok_s": n_tok / dt,
        "ids": [o["output_ids"] for o in outs],
        **delta,
    }


def install_replay(
    engine: Engine,
    prompts: list[str],
    max_new: int,
    wrong: float,
    verified_rounds: int = 0,
    drafts: int | None = None,
) -> int:
    """Record the greedy outputs, then let drafts replay them on every step. verified_rounds: up
    to that many speculative runs, each replaying the last one's output, until a run reproduces
    the output it replays: then the drafts are the tokens as the verify forward itself computes
    them (in bf16 on a GPU, a verify step's batched matmuls may round a near-tie of the random-
    weight model differently from the one-row decode path, and after one flip the recorded output
    offers no drafts). Returns the speculative runs made."""
    ids = [engine.tokenizer.encode(p) for p in prompts]  # as the engine tokenizes a text prompt
    greedy = {"temperature": 0, "max_new_tokens": max_new}
    outs = engine.generate(input_ids=ids, sampling_params=[greedy] * len(ids))
    refs = {tuple(i): o["output_ids"] for i, o in zip(ids, outs)}
    spec = engine.scheduler.spec
    spec.proposers["ngram"] = ReplayProposer(refs, wrong)
    spec.policy = SpecPolicy(adaptive=False, fast_rows=spec.policy.fast_rows)
    verified = {**greedy, "speculative_algorithm": "ngram"}
    if drafts is not None:
        verified["speculative_num_draft_tokens"] = drafts
    for rounds in range(1, verified_rounds + 1):
        outs = engine.generate(input_ids=ids, sampling_params=[verified] * len(ids))
        again = {tuple(i): o["output_ids"] for i, o in zip(ids, outs)}
        spec.proposers["ngram"] = ReplayProposer(again, wrong)
        if again == refs:
            return rounds
        refs = again
    return verified_rounds


def bench(
    engine: Engine, workload: str, batch: int, reps: int, replay: float | None, algorithm: str = "ngram"
) -> dict[str, Any]:
    rng = random.Random(batch * 7 + len(workload))
    prompts = [WORKLOADS[workload](rng) for _ in range(batch)]
    max_new = MAX_NEW.get(batch, 32)
    run_once(engine, prompts, 4, "none")  # untimed: fills the prefix cache for both modes
    if replay is not None:
        install_replay(engine, prompts, max_new, replay)
    off, on = [], []
    for r in range(reps):
        order = ("none", algorithm) if r % 2 == 0 else (algorithm, "none")
        for alg in order:
            (off if alg == "none" else on).append(run_once(engine, prompts, max_new, alg))
    ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(off, on)]
    verify_reqs = sum(x["spec_verify_requests"] for x in on)
    accept_len = (
        (sum(x["spec_accepted_tokens"] for x in on) + verify_reqs) / verify_reqs if verify_reqs else 0.0
    )
    row = {
        "workload": workload,
        "batch": batch,
        "max_new_tokens": max_new,
        "off_tok_s": [round(x["tok_s"], 2) for x in off],
        "on_tok_s": [round(x["tok_s"], 2) for x in on],
        "ratio_per_pair": [round(x, 3) for x in ratios],
        "ratio_median": round(statistics.median(ratios), 3),
        "acceptance_length": round(accept_len, 3),
        "verify_fraction": round(verify_reqs / max(sum(x["tokens"] for x in on), 1), 3),
        "forward_passes_off": sum(x["forward_passes"] for x in off),
        "forward_passes_on": sum(x["forward_passes"] for x in on),
        # per timed on-run: a verify step beside a batch can cost several plain steps (on the CPU,
        # more rows than the GEMV kernel takes), so these say which pairs paid for measuring
        "verify_steps_on": [x["spec_verify_steps"] for x in on],
        "greedy_identical": all(a["ids"] == b["ids"] for a, b in zip(off, on)),
    }
    print(
        f"{workload:13s} B={batch:<3d} off {row['off_tok_s']} on {row['on_tok_s']} ratio {row['ratio_per_pair']} "
        f"accept_len {row['acceptance_length']} identical {row['greedy_identical']}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="the engine's (default: by algorithm)")
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--quantization", default=None, help="the engine's (default: GGUF blocks kept on CPU)")
    ap.add_argument("--algorithm", default="ngram", choices=["ngram", "draft"])
    ap.add_argument("--draft-model", default=None, help="the draft model for --algorithm draft")
    ap.add_argument(
        "--replay-wrong", type=float, default=None, help="measure the verify machinery (see above)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    env = environment()
    engine = Engine(
        speculative_num_draft_tokens=args.num_draft_tokens,
        speculative_policy=args.policy,
        quantization=args.quantization,
        speculative_draft_model_path=args.draft_model,
    )
    rows = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for workload in args.workloads.split(","):
            rows.append(bench(engine, workload, batch, args.reps, args.replay_wrong, args.algorithm))
    env["load_average_after"] = __import__("os").getloadavg()
    result = {
        "benchmark": "speculative",
        "environment": env,
        "policy": args.policy,
        "num_draft_tokens": args.num_draft_tokens or engine.scheduler.spec.cfg.draft_tokens(args.algorithm),
        "algorithm": args.algorithm,
        "draft_model": args.draft_model,
        "quantization": args.quantization,
        "rows": rows,
        "how": f"one engine, per-request speculative_algorithm {args.algorithm} vs none, timed runs alternating, greedy",
    }
    tag = device_tag(env) + ("" if args.replay_wrong is None else f"_replay{args.replay_wrong:g}")
    tag += "" if args.algorithm == "ngram" else f"_{args.algorithm}"
    out = args.out or Path(__file__).parent / "results" / f"speculative_{tag}.json"
    write_result(out, result)
    engine.shutdown()


if __name__ == "__main__":
    main()
