"""Quality of the default model with its GGUF blocks kept against the same weights dequantized to
fp32: greedy agreement (teacher forced on the fp32 model's greedy continuations of 8 prompts,
scored in one prefill and one decode row at a time), logit error, perplexity on a fixed text; and
Engine() load time in a fresh process. Used by cpu_quant.py --quality and by
tests/test_quant_engine.py."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors: red,",
    "Once upon a time, in a small village,",
    "Question: What is 12 times 7?\nAnswer:",
    "The quick brown fox",
    "import numpy as np\n",
    "Water boils at a temperature of",
]
TEXT = (
    "The printing press was developed in the fifteenth century and changed how knowledge moved "
    "through Europe. Before it, books were copied by hand, which made them rare and expensive. A "
    "single workshop could now produce hundreds of copies of the same text in the time a scribe "
    "needed for one. Prices fell, literacy rose, and ideas spread faster than any authority could "
    "control them. Scientists shared their results with colleagues in distant cities, merchants "
    "printed price lists and maps, and religious reformers reached readers who had never owned a "
    "book. Historians still debate how quickly these changes happened, but few doubt that the "
    "press was one of the most important inventions of its age. Its basic idea, movable type "
    "arranged in a frame and pressed onto paper, remained in use for more than four hundred years."
)


def greedy_reference(ref_engine: Any, prompts: list[str], tokens: int) -> list[list[int]]:
    """prompt + the reference engine's greedy continuation, as token ids."""
    seqs = []
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    for p in prompts:
        ids = ref_engine.tokenizer.encode(p)
        out = ref_engine.generate(input_ids=ids, sampling_params=params)
        seqs.append(ids + out["output_ids"])
    return seqs


def agreement(
    engine: Any, ref_engine: Any, seqs: list[list[int]], prompt_lens: list[int], decode_rows: bool = False
) -> dict[str, float]:
    """Share of generated positions where engine's argmax equals the reference continuation
    (both teacher forced on it), and the relative logit error there. decode_rows: engine scores
    them one decode row at a time, as generation does (on the CPU, the int8 kernel), instead of
    in one prefill (the many-row path)."""
    from engine_helpers import decode_logits, position_logits

    same = total = 0
    errs = []
    for seq, n in zip(seqs, prompt_lens):
        ours = decode_logits(engine, seq, n) if decode_rows else position_logits(engine, seq)[n - 1 : -1]
        ref = position_logits(ref_engine, seq)[n - 1 : -1]
        same += int((ours.argmax(-1) == torch.tensor(seq[n:])).sum())
        total += len(seq) - n
        errs.append(((ours - ref).norm() / ref.norm()).item())
    return {
        "greedy_agreement": same / total,
        "positions": total,
        "logits_rel_err_mean": sum(errs) / len(errs),
    }


def perplexity(engine: Any, text: str = TEXT, decode_rows: bool = False) -> float:
    """exp(mean NLL) of text after its first token; decode_rows: scored one decode row at a time."""
    from engine_helpers import decode_logits, position_logits

    ids = engine.tokenizer.encode(text)
    logits = decode_logits(engine, ids, 1) if decode_rows else position_logits(engine, ids)[:-1]
    logp = torch.log_softmax(logits.double(), -1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    return math.exp(nll)


def load_seconds(quantization: str, threads: int) -> dict[str, float]:
    """Engine() in a fresh process (tokenizer cache warm): construction alone, and with imports."""
    code = (
        f"import time; t0 = time.perf_counter(); import torch; torch.set_num_threads({threads});"
        "from radixlm.backend.engine import Engine; t1 = time.perf_counter();"
        f"e = Engine(quantization={quantization!r}); t2 = time.perf_counter(); print(t2 - t1, t2 - t0);"
        "e.shutdown()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    engine_s, total_s = map(float, out.stdout.split()[-2:])
    return {"engine_init_s": engine_s, "with_imports_s": total_s}


def quality(threads: int, tokens: int = 64) -> dict[str, Any]:
    from radixlm.backend.engine import Engine

    torch.set_num_threads(threads)
    loads = {q: [load_seconds(q, threads) for _ in range(3)] for q in ("gguf", "dequantize")}
    t = time.perf_counter()
    quant, ref = Engine(quantization="gguf"), Engine(quantization="dequantize")
    try:
        seqs = greedy_reference(ref, PROMPTS, tokens)
        lens = [len(ref.tokenizer.encode(p)) for p in PROMPTS]
        out: dict[str, Any] = agreement(quant, ref, seqs, lens)
        out["decode_rows"] = agreement(quant, ref, seqs, lens, decode_rows=True)
        ppl_q, ppl_f = perplexity(quant), perplexity(ref)
        out["decode_rows"]["perplexity_ratio"] = perplexity(quant, decode_rows=True) / ppl_f
    finally:
        quant.shutdown()
        ref.shutdown()
    out.update(
        perplexity_gguf=ppl_q,
        perplexity_fp32=ppl_f,
        perplexity_ratio=ppl_q / ppl_f,
        load=loads,
        tokens_per_prompt=tokens,
        seconds=time.perf_counter() - t,
    )
    return out
