"""The GPU matmul over GGUF blocks (`radixlm.kernels.quant_gemv`) against gguf's own
dequantization: weights quantized by `gguf.quants.quantize`, dequantized by
`gguf.quants.dequantize`, a float64 matmul as the reference. The kernel kinds (CUDA-core "acc" and
"fma" for decode rows, tensor-core "dot" for more, packed-half "half2" and integer "dp4a" and
"int8x" for one 16-bit row) on small odd shapes under TRITON_INTERPRET=1 in a subprocess (the
interpreter must be on before the kernels are defined; there the packed kinds run emulations of
their word layouts, their inline PTX only compiled), and at Llama-3.1-8B shapes in bf16 on a GPU.
"dp4a" and "int8x" round x to int8 alike, so their reference is the float64 matmul with
`quantize_x_ref(x)`."""

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

from radixlm.kernels.quant_gemv_configs import QuantMatmulConfig

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

# (format, M, N, K, kind, block_m, block_n, block_k[, magic]): N not a multiple of block_n, K / 32
# not a multiple of block_k / 32, M not a multiple of block_m
CASES = [
    ("Q4_0", 1, 37, 96, "fma", 16, 16, 64),
    ("Q4_1", 3, 20, 288, "fma", 16, 8, 128),
    ("Q4_1", 1, 64, 64, "fma", 16, 16, 256),
    ("Q8_0", 8, 19, 160, "fma", 16, 8, 128),
    ("Q8_0", 2, 16, 32, "fma", 16, 4, 32),
    ("Q4_0", 5, 40, 160, "dot", 16, 16, 64),
    ("Q4_1", 17, 33, 96, "dot", 16, 32, 64),
    ("Q8_0", 20, 24, 224, "dot", 16, 16, 128),
    ("Q4_0", 1, 37, 96, "acc", 16, 16, 64),
    ("Q4_1", 1, 20, 288, "acc", 16, 8, 128, True),
    ("Q8_0", 1, 19, 160, "acc", 16, 4, 64, True),
    ("Q4_0", 3, 21, 160, "fma", 16, 8, 64, True),
    ("Q8_0", 2, 9, 96, "fma", 16, 4, 64, True),
    ("Q4_K", 1, 13, 512, "acc", 16, 4, 128),
    ("Q4_K", 3, 10, 768, "fma", 16, 4, 512, True),
    ("Q4_K", 18, 24, 256, "dot", 16, 16, 64),
]
# one 16-bit row, packed half arithmetic: (format, N, K, rows per program, block_k, x dtype, x scale);
# N not a multiple of the rows, K / 32 not a multiple of block_k / 32, and x far from 1
HALF2_CASES = [
    ("Q4_0", 37, 96, 4, 64, "bfloat16", 1.0),
    ("Q4_1", 20, 288, 8, 128, "float16", 1.0),
    ("Q4_K", 13, 512, 1, 128, "bfloat16", 1.0),
    ("Q4_0", 9, 160, 4, 128, "float16", 1.0),
    ("Q4_1", 6, 256, 4, 256, "bfloat16", 3000.0),
    ("Q4_0", 5, 64, 2, 64, "bfloat16", 1e-3),
    ("Q4_K", 40, 256, 32, 128, "float16", 1.0),
    ("Q4_0", 19, 160, 16, 64, "bfloat16", 1.0),
]

STREAM_CANDIDATES = [
    QuantMatmulConfig("stream", 1, 4096, 1, num_stages=2, programs_per_sm=21),
    QuantMatmulConfig("stream", 1, 16384, 8, num_stages=3, programs_per_sm=5),
]
# one 16-bit row, x rounded to int8 (kinds "dp4a", "int8x", "stream"): (format, N, K, rows per program,
# block_k, x dtype, x scale)
DP4A_CASES = [
    ("Q4_0", 37, 96, 4, 64, "float16", 1.0),
    ("Q4_1", 20, 288, 8, 128, "bfloat16", 1.0),
    ("Q4_K", 13, 512, 1, 128, "float16", 1.0),
    ("Q8_0", 19, 160, 4, 64, "float16", 1.0),
    ("Q8_0", 9, 256, 16, 256, "bfloat16", 3000.0),
    ("Q4_0", 5, 64, 2, 64, "float16", 1e-3),
    ("Q4_K", 40, 256, 32, 128, "bfloat16", 1.0),
    ("Q4_1", 6, 160, 64, 64, "float16", 1.0),
]


def _raw(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks gguf's quantizer writes; for Q4_K, which it cannot write, random bytes with small
    finite fp16 d and dmin (every sub-scale, sub-min and quant pattern)."""
    if qtype != "Q4_K":
        return gguf.quants.quantize(
            rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[qtype]
        )
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    raw[..., 0:4] = (rng.standard_normal((n, k // 256, 2)) * 0.02).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def run_half2_case(
    qtype: str, n: int, k: int, rows: int, bk: int, dtype: str, scale: float, *, device: str
) -> dict:
    """y from kind "half2" against the float64 matmul with gguf's dequantized weight, and the
    error of the fp32 reference rounded to x's dtype beside it."""
    from radixlm.kernels.quant_gemv import QuantMatmulConfig, quant_matmul, quant_matmul_ref, repack

    rng = np.random.default_rng(n * 1000 + k)
    raw = _raw(qtype, n, k, rng)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32) * scale).to(
        device, getattr(torch, dtype)
    )
    blocks = repack(torch.from_numpy(raw).to(device), qtype)
    y = quant_matmul(x, blocks, QuantMatmulConfig("half2", rows, bk, 4))
    ref = x.double().cpu() @ torch.from_numpy(w).double().T
    err = ((y.cpu().double() - ref).norm() / ref.norm()).item()
    own = ((quant_matmul_ref(x, blocks).cpu().double() - ref).norm() / ref.norm()).item()
    return {"err": err, "ref_err": own, "shape": list(y.shape), "finite": bool(torch.isfinite(y).all())}


def run_int8_case(
    kind: str,
    qtype: str,
    n: int,
    k: int,
    rows: int,
    bk: int,
    dtype: str,
    scale: float,
    *,
    device: str,
    warps: int = 4,
    stages: int = 1,
    per_sm: int = 0,
) -> dict:
    """y from kind "dp4a", "int8x" or "stream" against the float64 matmul of gguf's dequantized
    weight with x as they round it (and with x itself), and the rounding of that reference to x's
    dtype. "stream" runs per_sm programs per multiprocessor, by default (0) 1 + N % 3 of them and
    1 + N % 2 stages, so several cases give a program more than one row group."""
    from radixlm.kernels.quant_gemv import QuantMatmulConfig, quant_matmul, repack
    from radixlm.kernels.quant_gemv_dp4a import quantize_x_ref

    rng = np.random.default_rng(n * 1000 + k)
    raw = _raw(qtype, n, k, rng)
    w = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])).double()
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32) * scale).to(
        device, getattr(torch, dtype)
    )
    persistent = {"num_stages": 1 + n % 2, "programs_per_sm": 1 + n % 3} if kind == "stream" else {}
    if per_sm:
        persistent = {"num_stages": stages, "programs_per_sm": per_sm}
    cfg = QuantMatmulConfig(kind, rows, bk, warps, **{"num_stages": stages, **persistent})
    y = quant_matmul(x, repack(torch.from_numpy(raw).to(device), qtype), cfg)
    ref_q = quantize_x_ref(x).cpu().double() @ w.T
    ref = x.cpu().double() @ w.T
    own = ((ref_q.to(x.dtype).double() - ref_q).norm() / ref_q.norm()).item()
    return {
        "err_q": ((y.cpu().double() - ref_q).norm() / ref_q.norm()).item(),
        "err": ((y.cpu().double() - ref).norm() / ref.norm()).item(),
        "round": own,
        "shape": list(y.shape),
        "finite": bool(torch.isfinite(y).all()),
    }


def run_x_rounding(*, device: str) -> dict:
    """`quantize_x_int8` against `quantize_x_ref`: the int8 values times their group's scale, and
    each block's offset (its groups' scales times their integer sums), on a row with a zero
    block, a large block and a tie-prone block."""
    from radixlm.kernels.quant_gemv_dp4a import quantize_x_ref
    from radixlm.kernels.quant_gemv_int8x import quantize_x_int8

    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((1, 32 * 37)).astype(np.float32))
    x[0, 32:64] = 0.0
    x[0, 64:96] *= 5000.0
    x[0, 96:128] = torch.arange(32) * 0.5 - 8.0  # x / scale lands on halves
    x = x.to(device, torch.bfloat16)
    got = quantize_x_int8(x)
    # [block, half, t, value] as the groups are: group t of a block is [:, t, :] over both halves
    q = got.q.cpu().float().reshape(-1, 2, 4, 4)
    scales = got.scales.cpu()
    values = (q * scales[:, None, :, None]).reshape(1, -1)
    offsets = (q.sum(dim=(1, 3)) * scales).sum(dim=1)
    return {
        "values_equal": bool(torch.equal(values, quantize_x_ref(x).cpu())),
        "offset_err": (got.offsets.cpu() - offsets).abs().max().item() / offsets.abs().max().item(),
        "q_range": [q.min().item(), q.max().item()],
    }


def _check_int8(kind: str, results: list[dict]) -> None:
    """Equal to the quantized-x reference to the rounding of y (an fp32 sum near a rounding
    boundary may round the other way); a wrong pairing of quants and x,
    a lost scale or offset would be off by orders of magnitude. Against x itself, within x's
    int8 rounding."""
    assert len(results) == len(DP4A_CASES)
    for case, r in zip(DP4A_CASES, results):
        assert r["finite"] and r["shape"] == [1, case[1]], (kind, case, r)
        assert r["err_q"] < 3 * r["round"] + 1e-5, (kind, case, r)
        assert r["err"] < 2e-2, (kind, case, r)


def _check_x_rounding(r: dict) -> None:
    assert r["values_equal"] and r["offset_err"] < 1e-6, r
    assert r["q_range"] == [-127.0, 127.0], r  # the large block reaches both ends


def _check_half2(results: list[dict]) -> None:
    """Within fp16 arithmetic of the rounded reference: a wrong pairing of quants and x, a lost
    offset or scale, or an overflow would be off by orders of magnitude."""
    assert len(results) == len(HALF2_CASES)
    for case, r in zip(HALF2_CASES, results):
        assert r["finite"] and r["shape"] == [1, case[1]], (case, r)
        assert r["err"] < 2 * r["ref_err"] + 2e-3, (case, r)


def run_case(
    qtype: str,
    m: int,
    n: int,
    k: int,
    kind: str,
    bm: int,
    bn: int,
    bk: int,
    magic: bool = False,
    *,
    device: str,
    dtype: str,
) -> dict:
    from radixlm.kernels.quant_gemv import QuantMatmulConfig, quant_matmul, quant_matmul_ref, repack

    rng = np.random.default_rng(m * 1000 + n)
    raw = _raw(qtype, n, k, rng)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(device, getattr(torch, dtype))
    blocks = repack(torch.from_numpy(raw).to(device), qtype)
    y = quant_matmul(x, blocks, QuantMatmulConfig(kind, bn, bk, 4, bm, 1, magic))
    ref = x.double().cpu() @ torch.from_numpy(w).double().T
    err = ((y.cpu().double() - ref).norm() / ref.norm()).item()
    own = ((quant_matmul_ref(x, blocks).cpu().double() - ref).norm() / ref.norm()).item()
    return {"err": err, "ref_err": own, "shape": list(y.shape), "finite": bool(torch.isfinite(y).all())}


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU check under the interpreter; the GPU runs it compiled"
)
def test_quant_matmul_matches_gguf_under_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    results = out["cases"]
    _check_half2(out["half2"])
    _check_int8("dp4a", out["dp4a"])
    _check_int8("int8x", out["int8x"])
    _check_int8("stream", out["stream"])
    _check_x_rounding(out["x_rounding"])
    assert len(results) == len(CASES)
    for case, r in zip(CASES, results):
        assert r["finite"] and r["shape"] == [case[1], case[2]], (case, r)
        assert r["err"] < 1e-5 and r["ref_err"] < 1e-6, (case, r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quant_matmul_matches_gguf_on_gpu() -> None:
    from radixlm.kernels.quant_gemv import HALF2, default_config
    from radixlm.kernels.quant_gemv_configs import DP4A, DP4A_LONG_K, INT8X, INT8X_LONG_K, INT8X_ONE_ROW

    for case in CASES:
        r = run_case(*case, device="cuda", dtype="float32")
        assert r["finite"] and r["err"] < 1e-5, (case, r)
    _check_half2([run_half2_case(*c, device="cuda") for c in HALF2_CASES])
    for kind in ("dp4a", "int8x", "stream"):
        _check_int8(kind, [run_int8_case(kind, *c, device="cuda") for c in DP4A_CASES])
    _check_x_rounding(run_x_rounding(device="cuda"))
    # Llama-3.1-8B shapes in bf16 with each M's default config: bf16 operands, so ~1e-2
    for qtype, n, k in [
        ("Q4_0", 6144, 4096),
        ("Q4_1", 4096, 14336),
        ("Q8_0", 28672, 4096),
        ("Q4_K", 4096, 4096),
    ]:
        for m in (1, 2, 4, 8, 16, 128):
            cfg = default_config(m)
            r = run_case(
                qtype,
                m,
                n,
                k,
                cfg.kind,
                cfg.block_m,
                cfg.block_n,
                cfg.block_k,
                cfg.magic,
                device="cuda",
                dtype="bfloat16",
            )
            assert r["finite"] and r["err"] < 2e-2, (qtype, m, r)
        # the one-row configs choose_config gives, and the persistent candidates: x read once per
        # program where one tile spans K (K = 4096 at 4096 values, 14336 at 16384), else per tile
        for c in (DP4A, DP4A_LONG_K, INT8X, INT8X_LONG_K, INT8X_ONE_ROW, *STREAM_CANDIDATES):
            tiles = (c.block_n, c.block_k, "bfloat16", 1.0)
            more = {"warps": c.num_warps, "stages": c.num_stages, "per_sm": c.programs_per_sm}
            r = run_int8_case(c.kind, qtype, n, k, *tiles, device="cuda", **more)
            close = r["err_q"] < 3 * r["round"] + 1e-5 and r["err"] < 2e-2
            assert r["finite"] and close, (qtype, c.label(), r)
        if qtype == "Q8_0":
            continue
        r = run_half2_case(qtype, n, k, HALF2.block_n, HALF2.block_k, "bfloat16", 1.0, device="cuda")
        assert r["finite"] and r["err"] < 2e-2, (qtype, "half2", r)


def test_repack_and_refusals() -> None:
    from radixlm.kernels.quant_blocks import dequantize_blocks
    from radixlm.kernels.quant_gemv import QuantMatmulConfig, dequantize, quant_matmul, repack

    rng = np.random.default_rng(3)
    for qtype in ("Q4_0", "Q4_1", "Q8_0", "Q4_K"):
        raw = torch.from_numpy(_raw(qtype, 6, 512, rng))
        assert torch.equal(dequantize(repack(raw, qtype)), dequantize_blocks(raw, qtype)), qtype
    blocks = repack(torch.zeros(4, 40, dtype=torch.uint8), "Q4_1")  # two Q4_1 blocks per row: K = 64
    with pytest.raises(ValueError, match="Q6_K"):
        repack(torch.zeros(4, 210, dtype=torch.uint8), "Q6_K")
    with pytest.raises(ValueError, match="Q4_K raw"):
        repack(torch.zeros(4, 150, dtype=torch.uint8), "Q4_K")
    with pytest.raises(ValueError, match="x \\[M, 64\\]"):
        quant_matmul(torch.randn(1, 32), blocks)
    with pytest.raises(ValueError, match="fma"):
        quant_matmul(torch.randn(9, 64), blocks, QuantMatmulConfig("fma"))
    with pytest.raises(ValueError, match="one row"):
        quant_matmul(torch.randn(2, 64), blocks, QuantMatmulConfig("acc"))
    with pytest.raises(ValueError, match="half2"):
        quant_matmul(torch.randn(2, 64, dtype=torch.bfloat16), blocks, QuantMatmulConfig("half2"))
    with pytest.raises(ValueError, match="half2"):
        quant_matmul(torch.randn(1, 64), blocks, QuantMatmulConfig("half2"))
    q8 = repack(torch.zeros(4, 68, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="half2"):
        quant_matmul(torch.randn(1, 64, dtype=torch.bfloat16), q8, QuantMatmulConfig("half2"))
    with pytest.raises(ValueError, match="dp4a"):
        quant_matmul(torch.randn(1, 64), q8, QuantMatmulConfig("dp4a"))
    with pytest.raises(ValueError, match="dp4a"):
        quant_matmul(torch.randn(3, 64, dtype=torch.float16), q8, QuantMatmulConfig("dp4a"))
    with pytest.raises(ValueError, match="int8x"):
        quant_matmul(torch.randn(2, 64, dtype=torch.float16), q8, QuantMatmulConfig("int8x"))
    with pytest.raises(ValueError, match="stream"):
        quant_matmul(
            torch.randn(2, 64, dtype=torch.float16), q8, QuantMatmulConfig("stream", programs_per_sm=4)
        )
    with pytest.raises(ValueError, match="programs_per_sm"):
        QuantMatmulConfig("stream")
    with pytest.raises(ValueError, match="programs_per_sm"):
        QuantMatmulConfig("int8x", programs_per_sm=4)
    with pytest.raises(ValueError, match="1 to 8 stages"):
        QuantMatmulConfig("stream", num_stages=9, programs_per_sm=4)
    with pytest.raises(ValueError, match="block_k"):
        QuantMatmulConfig("dot", block_k=48)
    with pytest.raises(ValueError, match="kind must be one of"):
        QuantMatmulConfig("int4")


def test_stream_grid_is_resident_and_balanced() -> None:
    """Kind "stream" launches at most programs_per_sm programs per multiprocessor, as few as take
    the least rounds of row groups that cap allows (pid takes groups pid, pid + G, ...)."""
    from radixlm.kernels.quant_gemv_stream import stream_programs

    for groups, sms, per_sm in [(28672, 132, 32), (6144, 132, 32), (4096, 132, 24), (7, 132, 32), (1, 4, 1)]:
        g = stream_programs(groups, sms, per_sm)
        counts = [len(range(pid, groups, g)) for pid in range(g)]
        assert 1 <= g <= sms * per_sm and max(counts) == -(-groups // (sms * per_sm)), (groups, g)
        assert min(counts) >= max(counts) - 1 and sum(counts) == groups


@pytest.mark.parametrize("kind,offset", [("half2", 1), ("dp4a", 1), ("dp4a", 2), ("int8x", 1)])
def test_packed_kinds_read_a_row_at_an_unaligned_offset(kind: str, offset: int) -> None:
    """x is read as 32-bit pairs ("half2") or 64-bit groups of four ("dp4a"); a row view that
    starts inside one gives the same y as a fresh copy (compiled on a GPU, else interpreted)."""
    gpu = torch.cuda.is_available()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if not gpu:
        env["TRITON_INTERPRET"] = "1"
    device = "cuda" if gpu else "cpu"
    code = (
        "import torch, numpy as np, gguf\n"
        "from radixlm.kernels.quant_gemv import QuantMatmulConfig, quant_matmul, repack\n"
        "raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32),"
        " gguf.GGMLQuantizationType.Q4_0)\n"
        f"w = repack(torch.from_numpy(raw).to({device!r}), 'Q4_0')\n"
        f"buf = torch.randn(1, 64 + {offset}).to({device!r}, torch.bfloat16)\n"
        f"cfg = QuantMatmulConfig({kind!r}, 4, 64, 4)\n"
        f"a = quant_matmul(buf[:, {offset}:], w, cfg)\n"
        f"b = quant_matmul(buf[0, {offset}:].clone().view(1, -1), w, cfg)\n"
        f"assert buf[:, {offset}:].storage_offset() == {offset} and torch.equal(a, b), (a, b)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    cases = [run_case(*c, device="cpu", dtype="float32") for c in CASES]
    half2 = [run_half2_case(*c, device="cpu") for c in HALF2_CASES]
    dp4a = [run_int8_case("dp4a", *c, device="cpu") for c in DP4A_CASES]
    int8x = [run_int8_case("int8x", *c, device="cpu") for c in DP4A_CASES]
    stream = [run_int8_case("stream", *c, device="cpu") for c in DP4A_CASES]
    rounding = run_x_rounding(device="cpu")
    out = {"cases": cases, "half2": half2, "dp4a": dp4a, "int8x": int8x, "stream": stream}
    print(json.dumps({**out, "x_rounding": rounding}))
