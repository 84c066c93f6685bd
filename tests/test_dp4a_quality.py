"""What the GPU's one-row GEMVs ("dp4a", `radixlm.kernels.quant_gemv_dp4a`, and "int8x", which
rounds alike) do to the default model: they round each linear layer's input to int8 per eight
values (`quantize_x_ref`, which the kernel tests hold them to). On the default model's own weights (its GGUF dequantized, HF
transformers in fp32 on the CPU), that rounding at every linear layer and every position must stay
within the bar the quantized weights are held to: >= 95% of teacher-forced greedy positions over
8 prompts agree with the unrounded model, and perplexity on a fixed text is within 1%. (Measured
with transformers 5.25 and torch 2.13: 95.3% and x0.998; bf16 rounding alone gives 98.4% and
x1.001, llama.cpp's int8 per 32 values 94.9% and x0.989, below the bar: why "dp4a" and "int8x"
keep eight values per scale.)"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from cpu_quant_quality import PROMPTS, TEXT  # noqa: E402

TOKENS = 32


def _round_inputs(model: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Every nn.Linear sees its input as the dp4a kernel does: bf16, then int8 per eight values."""
    from radixlm.kernels.quant_gemv_dp4a import quantize_x_ref

    def hook(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0]
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        return (quantize_x_ref(flat).reshape(x.shape).to(x.dtype), *args[1:])

    return [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    logp = torch.log_softmax(logits[:-1].double(), -1)
    return -logp.gather(1, ids[1:, None]).mean().item()


def test_int8_rounded_inputs_keep_greedy_tokens_and_perplexity() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from radixlm.backend.gguf_loader import export_hf_folder
    from radixlm.backend.loader import default_model_path

    folder = export_hf_folder(Path(default_model_path()))
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert all(m.in_features % 32 == 0 for m in model.modules() if isinstance(m, torch.nn.Linear))
    seqs, starts = [], []
    with torch.no_grad():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
            seqs.append(out[0])
            starts.append(ids.shape[1])
        text = tok(TEXT, return_tensors="pt").input_ids[0]
        ref_nll = _nll(model(text[None]).logits[0], text)
        handles = _round_inputs(model)
        try:
            same = total = 0
            for seq, n in zip(seqs, starts):
                pred = model(seq[None]).logits[0, n - 1 : -1].argmax(-1)
                same += int((pred == seq[n:]).sum())
                total += len(seq) - n
            rounded_nll = _nll(model(text[None]).logits[0], text)
        finally:
            for h in handles:
                h.remove()
    agreement, ppl_ratio = same / total, math.exp(rounded_nll - ref_nll)
    print(f"dp4a x rounding: greedy agreement {agreement:.4f} of {total}, perplexity ratio {ppl_ratio:.5f}")
    assert total == len(PROMPTS) * TOKENS
    assert agreement >= 0.95, agreement
    assert abs(ppl_ratio - 1) < 0.01, ppl_ratio
