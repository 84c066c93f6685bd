"""JSON-schema constrained decoding vs free decoding on the same engine, in the same run:
output tok/s for a batch of requests, the constrained overhead, and the forward passes that
jump-forward saved (engine counters). Outputs are validated with jsonschema.

CPU:  python benchmarks/constrained_decode.py --batch 8 --max-new-tokens 96
H200: python benchmarks/constrained_decode.py --model-shape llama-3.1-8b --device cuda --batch 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_env import environment, write_result  # noqa: E402

from radixlm.backend.engine import Engine  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "engineer", "designer", "manager"]},
        "active": {"type": "boolean"},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "active", "skills", "address"],
    # closed, as a typed (pydantic) record is: JSON Schema leaves objects open, and a random-weight
    # model then adds keys until max_new_tokens
    "additionalProperties": False,
}


def run(engine: Engine, prompts: list[list[int]], params: dict[str, Any]) -> dict[str, Any]:
    engine.flush_cache()
    before = engine.get_stats()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    dt = time.perf_counter() - t0
    after = engine.get_stats()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("forward_passes", "jump_forward_passes_saved")}
    return {
        "duration_s": dt,
        "output_tokens": tokens,
        "output_throughput": tokens / dt,
        **delta,
        "outputs": outs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import jsonschema

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    engine = Engine(model_shape=args.model_shape, device=args.device, mem_fraction_static=0.8)
    try:
        tok = engine.tokenizer
        prompt = tok.encode("Generate a JSON record of a fictional employee:\n")
        prompts = [prompt + tok.encode(f" #{i}\n") for i in range(args.batch)]
        base = {"max_new_tokens": args.max_new_tokens, "temperature": 0.7, "seed": 1}
        engine.generate(
            input_ids=prompts[:2], sampling_params={**base, "json_schema": SCHEMA}
        )  # compile + warm
        result: dict[str, Any] = {
            "benchmark": "constrained_decode",
            "env": environment(),
            "args": vars(args),
            "model": engine.model_config.model_name,
            "schema": SCHEMA,
        }
        free = run(engine, prompts, {**base, "ignore_eos": True})
        for jf in (True, False):
            engine.disable_jump_forward = not jf
            con = run(engine, prompts, {**base, "json_schema": SCHEMA})
            valid = 0
            for o in con.pop("outputs"):
                try:
                    jsonschema.validate(json.loads(o["text"]), SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            con["valid_fraction"] = valid / len(prompts)
            result["constrained_jump_forward" if jf else "constrained_no_jump_forward"] = con
        engine.disable_jump_forward = False
        free.pop("outputs")
        result["free"] = free
        # Per-token cost: constrained vs free decode steps (tokens differ, so compare per token).
        con = result["constrained_no_jump_forward"]
        result["per_token_overhead"] = (con["duration_s"] / con["output_tokens"]) / (
            free["duration_s"] / free["output_tokens"]
        ) - 1
        print(
            json.dumps({k: v for k, v in result.items() if k not in ("env", "schema")}, indent=1, default=str)
        )
    finally:
        engine.shutdown()
    dev = "cpu" if engine.device.type == "cpu" else "h200"
    write_result(args.out or Path(__file__).parent / "results" / f"constrained_decode_{dev}.json", result)
    return result


if __name__ == "__main__":
    main()
