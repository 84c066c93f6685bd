"""Programmatic dependent launch (PDL) of the decode step's kernels: compiled for sm_90 with PDL on,
each kernel waits for the kernel ahead (`griddepcontrol.wait`, SASS `ACQBULK`) before its first
global memory access and then releases the next (`PREEXIT`); with PDL off neither is there. A
kernel that touched memory before the wait could read its producer's output half-written. The
launch keywords turn PDL on unless RADIXLM_PDL=0 says otherwise, and only where it runs: compiled,
on CUDA, sm_90 and up."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from sm90_sass import HAVE_NVDISASM, compile_sm90
from test_decode_sass import fp8_decode_signature

from radixlm.kernels import _triton
from radixlm.kernels._triton import PDL_KERNELS, pdl_args, pdl_kernels_from

# opcodes that read or write global memory (loads, stores, async copies, atomics, reductions)
_MEMORY = re.compile(r"^(LDG|STG|LDGSTS|ATOMG|ATOM|RED|LD|ST)(\.|$)")
_OP = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")

_ONE_ROW = {"QW": "*i32", "D": "*fp16", "MN": "*fp16", "Y": "*bf16"}
_INT8_X = {"XQ": "*i32", "XS": "*fp32", "XO": "*fp32"}
_ONE_ROW_CONSTS = dict(KIND=1, ROWS=1, BLOCK_B=32, EVEN_B=True, ASM=True)


def _kernels() -> dict[str, tuple[object, dict[str, str], dict[str, object], tuple[str, ...]]]:
    """name → (kernel, pointer types, constexprs but PDL, float arguments)."""
    from radixlm.kernels import (
        decode_attention,
        gemv,
        merge_state,
        quant_gemv_dp4a,
        quant_gemv_half2,
        quant_gemv_int8x,
        quant_gemv_rope,
        quant_gemv_stream,
        rmsnorm,
        rotary,
        silu_and_mul,
    )

    bf16 = "*bf16"
    f32 = "*fp32"
    i64 = "*i64"
    int8_row = {"Q": "*i8", "S": f32, "OFF": f32}
    return {
        "rmsnorm": (
            rmsnorm._rmsnorm_kernel,
            {"X": bf16, "R": bf16, "W": bf16, "Y": bf16, "Rout": bf16, **int8_row},
            dict(HAS_RESIDUAL=True, ROUND=True, BLOCK=4096),
            ("eps",),
        ),
        "rotary": (
            rotary._rotary_kernel,
            {n: bf16 for n in ("Q", "K", "Qo", "Ko", "V", "Vbuf")}
            | {"Pos": i64, "Loc": i64, "Cache": f32, "KScale": f32, "VScale": f32},
            dict(HALF=64, BLOCK_H=16, BLOCK_HALF=64, STORE_KV=True, QUANT=False),
            (),
        ),
        "decode_partial": (
            decode_attention._decode_partial_kernel,
            *fp8_decode_signature(True),
            ("sm_scale",),
        ),
        "merge_splits": (
            merge_state._merge_splits_kernel,
            {"MidO": f32, "MidLse": f32, "Out": bf16, "OutLse": f32},
            dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=16, WRITE_LSE=False),
            (),
        ),
        "silu_mul": (
            silu_and_mul._silu_mul_kernel,
            {"G": bf16, "U": bf16, "Out": bf16, **int8_row},
            dict(ROUND=True, BLOCK=1024),
            (),
        ),
        "quantize_x": (
            quant_gemv_int8x._quantize_x_kernel,
            {"X": bf16, **int8_row},
            dict(BLOCKS=16),
            (),
        ),
        "gemv_int8x": (quant_gemv_int8x._gemv_int8x_kernel, _INT8_X | _ONE_ROW, _ONE_ROW_CONSTS, ()),
        "gemv_stream": (
            quant_gemv_stream._gemv_stream_kernel,
            _INT8_X | _ONE_ROW,
            _ONE_ROW_CONSTS | dict(X_WHOLE=True, STAGES=2),
            (),
        ),
        "gemv_dp4a": (
            quant_gemv_dp4a._gemv_dp4a_kernel,
            {"X4": "*i64"} | _ONE_ROW,
            _ONE_ROW_CONSTS | {"X_F16": False},
            (),
        ),
        "qkv_rope_store": (
            quant_gemv_rope._qkv_rope_store_kernel,
            {"X4": "*i64", "QW": "*i32", "D": "*fp16", "MN": "*fp16", "Qo": bf16, "Kbuf": bf16, "Vbuf": bf16}
            | {"Loc": i64, "Pos": i64, "Cache": f32, "KScale": f32, "VScale": f32},
            dict(
                HQ=32,
                HKV=8,
                HALF=64,
                KIND=0,
                ROWS=4,
                BLOCK_B=32,
                EVEN_B=True,
                X_F16=False,
                ASM=True,
                QUANT=False,
            ),
            (),
        ),
        "gemv_half2": (
            quant_gemv_half2._gemv_half2_kernel,
            {"XW": "*i32"} | _ONE_ROW,
            _ONE_ROW_CONSTS | {"X_F16": False},
            (),
        ),
        "gemv_fma": (
            gemv._gemv_fma_kernel,
            {"X": bf16, "W": bf16, "WS": f32, "B": bf16, "Y": bf16},
            dict(M=1, BLOCK_M=2, BLOCK_N=4, BLOCK_K=512, EVEN_K=True, HAS_BIAS=False, HAS_SCALE=False),
            (),
        ),
        "gemv_dot": (
            gemv._gemv_dot_kernel,
            {"X": bf16, "W": bf16, "B": bf16, "Y": bf16},
            dict(M=2, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, EVEN_K=True, HAS_BIAS=False, DOT_PREC="tf32"),
            (),
        ),
    }


def _opcodes(name: str, pdl: int) -> list[str]:
    fn, pointers, consts, floats = _kernels()[name]
    sass = compile_sm90(fn, pointers, {**consts, "PDL": pdl}, num_warps=4, num_stages=2, floats=floats)
    return [m.group(1) for m in _OP.finditer(sass)]


def test_every_pdl_kernel_is_checked() -> None:
    assert sorted(_kernels()) == sorted(PDL_KERNELS)


@pytest.mark.skipif(not HAVE_NVDISASM, reason="triton ships no nvdisasm here")
@pytest.mark.skipif(not _triton._HAS_GDC, reason="this Triton has no griddepcontrol intrinsics")
@pytest.mark.parametrize("name", PDL_KERNELS)
def test_kernel_waits_before_touching_memory(name: str) -> None:
    ops = _opcodes(name, pdl=1)
    memory = [i for i, op in enumerate(ops) if _MEMORY.match(op)]
    assert memory, f"{name}: no global memory access found; the opcode pattern is stale"
    assert "ACQBULK" in ops, f"{name}: compiled with PDL but never waits for the kernel ahead"
    assert ops.index("ACQBULK") < memory[0], f"{name}: {ops[memory[0]]} runs before the wait"
    assert "PREEXIT" in ops, f"{name}: never lets the next kernel launch early"


@pytest.mark.skipif(not HAVE_NVDISASM, reason="triton ships no nvdisasm here")
@pytest.mark.skipif(not _triton._HAS_GDC, reason="this Triton has no griddepcontrol intrinsics")
def test_pdl_modes_compile_apart() -> None:
    """PDL 0: neither instruction; 2: the wait but no early release (the next kernel is placed as
    this one's programs exit)."""
    off, exit_only = _opcodes("rmsnorm", pdl=0), _opcodes("rmsnorm", pdl=2)
    assert "ACQBULK" not in off and "PREEXIT" not in off
    assert "ACQBULK" in exit_only and "PREEXIT" not in exit_only


def test_radixlm_pdl_names_kernels() -> None:
    assert pdl_kernels_from("") == pdl_kernels_from("0") == frozenset()
    assert pdl_kernels_from("1") == frozenset(PDL_KERNELS)
    assert pdl_kernels_from(" rmsnorm, rotary ,") == {"rmsnorm", "rotary"}
    with pytest.raises(ValueError, match="unknown kernel.*rms_norm.*comma-separated list of rmsnorm"):
        pdl_kernels_from("rms_norm,rotary")


def test_pdl_on_by_default_and_only_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    read = "from radixlm.kernels._triton import PDL_ON; print(sorted(PDL_ON))"
    every = str(sorted(PDL_KERNELS))
    for value, asked in (
        (None, every),
        ("1", every),
        ("0", "[]"),
        ("silu_mul,rmsnorm", "['rmsnorm', 'silu_mul']"),
    ):
        env = {k: v for k, v in os.environ.items() if k != "RADIXLM_PDL"}
        if value is not None:
            env["RADIXLM_PDL"] = value
        out = subprocess.run(
            [sys.executable, "-c", read], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == asked, (value, out.stdout, out.stderr)
    off = {"PDL": 0, "launch_pdl": False}
    monkeypatch.setattr(_triton, "PDL_ON", frozenset(PDL_KERNELS))
    assert pdl_args(torch.zeros(1), "rmsnorm") == off
    if torch.cuda.is_available():
        t = torch.zeros(1, device="cuda")
        monkeypatch.setattr(_triton, "PDL_ON", frozenset({"rotary"}))
        assert pdl_args(t, "rmsnorm") == off
        runs = torch.cuda.get_device_capability()[0] >= 9 and _triton._HAS_GDC and not _triton.interpreting()
        assert pdl_args(t, "rotary") == ({"PDL": 1, "launch_pdl": True} if runs else off)
        monkeypatch.setattr(_triton, "PDL_EARLY", frozenset({"rmsnorm"}))
        assert pdl_args(t, "rotary")["PDL"] == (2 if runs else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_decodes_alike_with_and_without_pdl(
    tmp_path, default_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny random Llama 3 on the GPU, bf16 and Q4_0 (one-row GGUF kernels), CUDA graphs and
    overlap on: the same kernels with and without the waits give the same greedy tokens, and with
    PDL on (Hopper) the kernels really were launched with it."""
    from gpu_helpers import mem_fraction
    from test_engine_hf_parity import _tiny_model

    from radixlm.backend.engine import Engine

    _, path = _tiny_model("llama3", tmp_path, default_model_dir)
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=rng).tolist() for n in (4, 19, 60)]
    params = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    outs: dict[tuple[str, str | None], list[list[int]]] = {}
    for pdl in ("0", "1"):
        monkeypatch.setattr(_triton, "PDL_ON", pdl_kernels_from(pdl))
        for quant in (None, "q4_0"):
            eng = Engine(
                model_path=str(path),
                device="cuda",
                dtype="bfloat16",
                quantization=quant,
                max_total_tokens=4096,
                mem_fraction_static=mem_fraction(0.2),
            )
            try:
                assert eng.runner.graph_runner is not None
                outs[pdl, quant] = [
                    o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)
                ]
            finally:
                eng.shutdown()
    assert outs["1", None] == outs["0", None]
    assert outs["1", "q4_0"] == outs["0", "q4_0"]
    hopper = torch.cuda.get_device_capability()[0] >= 9 and _triton._HAS_GDC
    for name, (kernel, *_) in _kernels().items():  # each launch site passes its kernel's own name
        launched = [
            k.metadata.launch_pdl for cache in kernel.device_caches.values() for k in cache[0].values()
        ]
        assert not launched or any(launched) == hopper, name
