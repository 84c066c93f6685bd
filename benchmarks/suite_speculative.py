"""The suite's speculative decoding rows, on the default engine: batch 1 with drafts that replay the
target's own greedy output as the verify forward computes it (the verify machinery at full
acceptance, 4 drafts per step; random weights would accept no n-gram), and a large batch of copy-heavy prompts with n-gram drafts under the automatic
policy (which must back off where drafts do not pay). Timed runs alternate off/on; the engine's
proposer and policy are put back afterwards."""

from __future__ import annotations

import random
import statistics
from typing import Any

import speculative as spec_bench

from radixlm.backend.engine import Engine

REPLAY_DRAFTS = 4  # the batch-1 line is stated at this many drafts per step
REPLAY_ROUNDS = 24  # speculative runs that may pass before the replayed output is a fixed point


def speculative_rows(engine: Engine, b1_new: int, batch: int, batch_new: int, reps: int) -> dict[str, Any]:
    rng = random.Random(0)
    spec = engine.scheduler.spec
    proposer, policy = spec.proposers["ngram"], spec.policy
    try:
        one = [spec_bench.code_edit(rng)]
        spec_bench.run_once(engine, one, 4, "none")  # untimed: both modes decode from a cached prompt
        rounds = spec_bench.install_replay(
            engine, one, b1_new, 0.0, verified_rounds=REPLAY_ROUNDS, drafts=REPLAY_DRAFTS
        )
        replay = {**_alternate(engine, one, b1_new, reps, REPLAY_DRAFTS), "replay_rounds": rounds}
    finally:
        spec.proposers["ngram"], spec.policy = proposer, policy
    many = [spec_bench.code_edit(rng) for _ in range(batch)]
    spec_bench.run_once(engine, many, 4, "none")
    auto = _alternate(engine, many, batch_new, reps)
    return {"b1_replay": replay, "batch_auto": {"batch": batch, **auto}}


def _alternate(
    engine: Engine, prompts: list[str], max_new: int, reps: int, drafts: int | None = None
) -> dict[str, Any]:
    off, on = [], []
    for r in range(reps):
        for alg in ("none", "ngram") if r % 2 == 0 else ("ngram", "none"):
            (off if alg == "none" else on).append(spec_bench.run_once(engine, prompts, max_new, alg, drafts))
    verify = sum(x["spec_verify_requests"] for x in on)
    return {
        "off_tok_s": [x["tok_s"] for x in off],
        "on_tok_s": [x["tok_s"] for x in on],
        "ratio": statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(off, on)),
        "acceptance_length": (sum(x["spec_accepted_tokens"] for x in on) + verify) / verify
        if verify
        else 0.0,
        "greedy_identical": all(a["ids"] == b["ids"] for a, b in zip(off, on)),
    }
