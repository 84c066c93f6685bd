"""The model's int8 rows for one-row GGUF matmuls of kind "int8x": where a QuantLinear's matmul
reads its input rounded to int8, the RMSNorm or SiLU-and-mul that writes that input rounds it in
its own launch, and the layer's output is bit for bit what the standalone rounding inside the
matmul gives, with no standalone rounding left. Run under Triton's interpreter in a subprocess
(GPU segments built on the CPU), so the CPU checks the GPU path's plumbing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
HIDDEN, INTER = 64, 96


def check() -> dict:
    import gguf
    import numpy as np
    import torch

    from radixlm.backend.model_config import ModelConfig
    from radixlm.backend.models import llama
    from radixlm.backend.quant_formats import QuantTensor
    from radixlm.backend.quant_linear import CudaSegment, QuantLinear
    from radixlm.kernels import quant_gemv_configs as qc
    from radixlm.kernels import quant_gemv_int8x
    from radixlm.kernels.rmsnorm import fused_add_rmsnorm

    rng = np.random.default_rng(0)
    cpu = torch.device("cpu")

    def gguf_linear(rows: int, cols: int) -> QuantLinear:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        qt = QuantTensor(
            "Q4_0", torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)), cols
        )
        layer = QuantLinear([qt], None, cpu, torch.bfloat16)
        layer.segments[0] = CudaSegment(qt, cpu)  # the GPU path's arrays, run by the interpreter
        return layer

    cfg = ModelConfig("llama", 100, HIDDEN, INTER, 1, 2, 1, 32)
    mlp = llama.LlamaMLP(cfg)
    mlp.gate_up_proj = gguf_linear(2 * INTER, HIDDEN)  # type: ignore[assignment]
    mlp.down_proj = gguf_linear(HIDDEN, INTER)  # type: ignore[assignment]
    norm = llama.RMSNorm(HIDDEN, 1e-5)
    norm.weight.data = torch.randn(HIDDEN)
    norm.to(torch.bfloat16)
    h, residual = (torch.randn(1, HIDDEN, dtype=torch.bfloat16) * 2 for _ in range(2))

    standalone = []
    plain_round = quant_gemv_int8x.quantize_x_int8

    def counted(x: torch.Tensor) -> quant_gemv_int8x.Int8Row:
        standalone.append(tuple(x.shape))
        return plain_round(x)

    saved = dict(qc.ONE_ROW)
    out: dict = {"default_rounds": llama._norm(norm, h, residual, mlp.gate_up_proj)[2] is not None}
    qc.ONE_ROW["Q4_0"] = qc.INT8X
    quant_gemv_int8x.quantize_x_int8 = counted  # type: ignore[assignment]
    try:
        y, r, h_int8 = llama._norm(norm, h, residual, mlp.gate_up_proj)
        fused = mlp.forward_fused(y, h_int8)
        out["fused_standalone_rounds"] = len(standalone)
        # the same layer with every rounding done inside its matmul
        gate, up = mlp.gate_up_proj(y).chunk(2, dim=-1)
        unfused = mlp.down_proj(llama.silu_mul(gate, up))
        out["unfused_standalone_rounds"] = len(standalone) - out["fused_standalone_rounds"]
    finally:
        qc.ONE_ROW.clear()
        qc.ONE_ROW.update(saved)
        quant_gemv_int8x.quantize_x_int8 = plain_round  # type: ignore[assignment]
    y_ref, r_ref = fused_add_rmsnorm(h, residual, norm.weight, 1e-5)
    dense = [layer.segments[0].blocks for layer in (mlp.gate_up_proj, mlp.down_proj)]
    from radixlm.kernels.quant_gemv import quant_matmul_ref

    gu = quant_matmul_ref(y_ref.float(), dense[0])
    exact = quant_matmul_ref(torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:], dense[1])
    out |= {
        "rounded": h_int8 is not None,
        "norm_equal": bool(torch.equal(y, y_ref) and torch.equal(r, r_ref)),
        "fused_equals_unfused": bool(torch.equal(fused, unfused)),
        "err_vs_float": ((fused.double() - exact.double()).norm() / exact.double().norm()).item(),
    }
    return out


def test_norm_and_silu_round_for_the_int8_matmul_and_match_the_standalone_rounding() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not r["default_rounds"], r  # the default kind rounds inside its own matmul
    assert r["rounded"] and r["norm_equal"], r
    assert r["fused_standalone_rounds"] == 0 and r["unfused_standalone_rounds"] == 2, r
    assert r["fused_equals_unfused"], r
    assert r["err_vs_float"] < 0.03, r  # int8 x, bf16 activations


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps(check()))
