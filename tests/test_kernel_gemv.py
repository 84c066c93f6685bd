"""The decode GEMV kernel (`radixlm.kernels.gemv`) against `gemv_ref` and a float64 F.linear:
small odd shapes under TRITON_INTERPRET=1 in a subprocess (the interpreter must be on before the
kernels are defined), the real llama-3.1-8b shapes on a GPU; plus input validation and dispatch."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

F32, B16 = torch.float32, torch.bfloat16
CONFIGS = [("fma", 16, 32, 4, 1), ("fma", 4, 64, 2, 1), ("dot", 16, 32, 4, 2)]
# (M, N, K, bias): N and K not multiples of any block; K = 64 and 96 also take the even-K path
SMALL = [(1, 37, 100, False), (3, 45, 96, True), (8, 33, 130, True), (5, 20, 64, False)]
REAL = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


def tol(dtype: torch.dtype) -> float:
    from kernel_checks import BOUND

    return BOUND[dtype]


def check(device: str, dtype: torch.dtype, m: int, n: int, k: int, bias: bool, cfg: tuple) -> dict:
    """Rel. errors vs gemv_ref and vs float64 F.linear; whether the output was fully written."""
    from kernel_checks import rel_err

    from radixlm.kernels.gemv import GemvConfig, gemv, gemv_ref

    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    y = gemv(x, w, b, GemvConfig(*cfg), out=out)
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    return {
        "ref": rel_err(y, gemv_ref(x, w, b)),
        "f64": rel_err(y, exact),
        "same_buffer": y is out,
        "finite": bool(torch.isfinite(y).all()),
    }


def _small_cases() -> list[tuple]:
    return [(dt, *s, cfg) for dt in (F32, B16) for s in SMALL for cfg in CONFIGS]


def _assert_ok(case: tuple, r: dict) -> None:
    dtype = case[0]
    assert r["finite"] and r["same_buffer"], (case, r)
    assert r["ref"] <= tol(dtype) and r["f64"] <= tol(dtype), (case, r)


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU CI check; on a GPU the compiled kernel is tested "
    "instead (the GPU image's Triton 3.6 interpreter cannot run this kernel's K loop)",
)
def test_gemv_matches_reference_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    cases = _small_cases()
    assert len(results) == len(cases)
    for case, r in zip(cases, results):
        _assert_ok(case, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_reference_on_gpu_real_shapes(m: int) -> None:
    from radixlm.kernels.gemv import default_config

    d = default_config(m)
    default = (d.kind, d.block_n, d.block_k, d.num_warps, d.num_stages)
    for n, k in REAL:
        for cfg in (default, ("fma", 2, 4096, 4, 1), ("dot", 32, 256, 4, 4)):
            case = (B16, m, n, k, n == 6144, cfg)
            _assert_ok(case, check("cuda", *case))
    case = (F32, m, 4096 + 3, 4096 - 8, True, default)
    _assert_ok(case, check("cuda", *case))


def test_gemv_rejects_bad_input() -> None:
    from radixlm.kernels.gemv import GemvConfig, gemv

    w = torch.randn(6, 4)
    for x, b in [
        (torch.randn(2, 5), None),
        (torch.randn(9, 4), None),
        (torch.randn(4), None),
        (torch.randn(2, 4, dtype=torch.float64), None),
        (torch.randn(2, 4), torch.randn(5)),
    ]:
        with pytest.raises(ValueError):
            gemv(x, w, b)
    for bad in [dict(kind="mma"), dict(block_n=12), dict(kind="dot", block_n=8), dict(num_stages=0)]:
        with pytest.raises(ValueError):
            GemvConfig(**bad)


def test_use_gemv_only_for_cuda_few_rows() -> None:
    from radixlm.kernels.gemv import use_gemv

    w = torch.randn(6, 4)
    assert not use_gemv(torch.randn(1, 4), w)  # CPU tensors keep F.linear
    meta_w = torch.empty(6, 4, device="meta")
    assert not use_gemv(torch.empty(1, 4, device="meta"), meta_w)
    if torch.cuda.is_available():
        wc = w.cuda()
        assert use_gemv(torch.randn(1, 4, device="cuda"), wc)
        assert use_gemv(torch.randn(8, 4, device="cuda"), wc)
        assert not use_gemv(torch.randn(9, 4, device="cuda"), wc)
        assert not use_gemv(torch.randn(2, 4, device="cuda"), wc.T.contiguous().T)  # K not unit-stride
        assert not use_gemv(torch.randn(2, 4, device="cuda", dtype=torch.bfloat16), wc)


def test_gemv_on_cpu_without_interpreter_is_the_reference() -> None:
    from radixlm.kernels.gemv import gemv, gemv_ref

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("interpreter on in this process")
    x, w, b = torch.randn(3, 10), torch.randn(7, 10), torch.randn(7)
    assert torch.equal(gemv(x, w, b), gemv_ref(x, w, b))


if __name__ == "__main__":
    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    print(json.dumps([check("cpu", *case) for case in _small_cases()]))
