"""The dequantize-in-the-loop decode GEMV (`radixlm.kernels.quant_gemv`) against gguf's own
dequantization: weights quantized by `gguf.quants.quantize`, dequantized by
`gguf.quants.dequantize`, a float64 matmul as the reference. Small odd shapes under
TRITON_INTERPRET=1 in a subprocess (the interpreter must be on before the kernels are defined)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

# (format, M, N, K, block_n, block_b): N not a multiple of block_n; K / 32 not a multiple of block_b
CASES = [
    ("Q4_0", 1, 37, 96, 16, 2),
    ("Q4_1", 3, 20, 288, 8, 4),
    ("Q4_1", 1, 64, 64, 16, 8),
    ("Q8_0", 8, 19, 160, 8, 4),
    ("Q8_0", 2, 16, 32, 4, 1),
]


def run_case(qtype: str, m: int, n: int, k: int, block_n: int, block_b: int, device: str) -> dict:
    from radixlm.kernels.quant_gemv import quant_gemv

    rng = np.random.default_rng(m * 1000 + n)
    raw = gguf.quants.quantize(
        rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[qtype]
    )
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = quant_gemv(x.to(device), torch.from_numpy(raw).to(device), qtype, k, block_n=block_n, block_b=block_b)
    ref = x.double() @ torch.from_numpy(w).double().T
    err = ((y.cpu().double() - ref).norm() / ref.norm()).item()
    return {"err": err, "shape": list(y.shape), "finite": bool(torch.isfinite(y).all())}


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU check under the interpreter; the GPU runs it compiled"
)
def test_quant_gemv_matches_gguf_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(CASES)
    for case, r in zip(CASES, results):
        assert r["finite"] and r["shape"] == [case[1], case[2]], (case, r)
        assert r["err"] < 1e-5, (case, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quant_gemv_matches_gguf_on_gpu() -> None:
    for case in CASES + [("Q4_1", 1, 4096, 4096, 16, 8), ("Q8_0", 4, 14336, 4096, 16, 8)]:
        r = run_case(*case, device="cuda")
        assert r["finite"] and r["err"] < 1e-5, (case, r)


def test_quant_gemv_refuses_bad_input() -> None:
    from radixlm.kernels.quant_gemv import quant_gemv

    raw = torch.zeros(4, 40, dtype=torch.uint8)  # two Q4_1 blocks per row: K = 64
    for x, qtype, k in [
        (torch.randn(1, 64), "Q6_K", 64),
        (torch.randn(1, 32), "Q4_1", 32),
        (torch.randn(9, 64), "Q4_1", 64),
        (torch.randn(1, 60), "Q4_1", 60),
    ]:
        with pytest.raises(ValueError):
            quant_gemv(x, raw, qtype, k)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps([run_case(*c, device="cpu") for c in CASES]))
