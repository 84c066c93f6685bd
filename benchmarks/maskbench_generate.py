"""Generation check for the MaskBench runner: the default model (SmolLM2-135M, CPU, T=1) writes one
output per schema that compiles in strict mode; every finished output is validated with jsonschema
(the engine's own meta_info verdict and an independent check here must agree); outputs that end in a
value check's dead end are counted apart."""

from __future__ import annotations

import json
from typing import Any

from maskbench_core import Doc, broken_keyword

from radixlm.backend.request import GRAMMAR_DEAD_END

PROMPT = "Write one JSON value that follows this JSON schema, and nothing else.\nSchema: {schema}\nJSON: "
MAX_NEW_TOKENS = 256


def generate(docs: list[Doc], n: int, batch: int = 50) -> dict[str, Any]:
    from radixlm import Engine

    engine = Engine()
    picked: list[Doc] = []
    stride = max(1, len(docs) // (2 * n))  # spread over the subsets, not the first file's
    for doc in docs[::stride] + docs:
        if len(picked) >= n:
            break
        try:
            engine.generate("x", {"json_schema": doc.schema, "max_new_tokens": 0})
        except ValueError:
            continue
        if doc not in picked:
            picked.append(doc)
    outs: list[dict] = []
    for i in range(0, len(picked), batch):
        part = picked[i : i + batch]
        prompts = [PROMPT.format(schema=json.dumps(d.schema)[:1500]) for d in part]
        params = [
            {"json_schema": d.schema, "temperature": 1.0, "max_new_tokens": MAX_NEW_TOKENS, "seed": i + k}
            for k, d in enumerate(part)
        ]
        res = engine.generate(prompts, params)
        outs += res if isinstance(res, list) else [res]
    finished = [(d, o) for d, o in zip(picked, outs) if o["meta_info"]["finish_reason"]["type"] == "stop"]
    failures = []
    for d, o in finished:
        try:
            verdict = broken_keyword(d.schema, json.loads(o["text"]))
        except json.JSONDecodeError:
            verdict = "not JSON"
        if verdict != "valid" or not o["meta_info"].get("json_schema_valid"):
            failures.append(
                {
                    "doc": d.name,
                    "verdict": verdict,
                    "text": o["text"][:300],
                    "engine_error": o["meta_info"].get("json_schema_error"),
                }
            )
    reasons = [o["meta_info"]["finish_reason"] for o in outs]
    dead = [d.name for d, r in zip(picked, reasons) if r.get("message") == GRAMMAR_DEAD_END]
    return {
        "schemas": len(picked),
        "finished": len(finished),
        "finished_valid": len(finished) - len(failures),
        "length": sum(r["type"] == "length" for r in reasons),
        "dead_ends": len(dead),
        "dead_end_docs": dead[:20],
        "max_new_tokens": MAX_NEW_TOKENS,
        "failures": failures[:20],
    }
