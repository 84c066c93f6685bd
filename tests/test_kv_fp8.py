"""CPU tests of the fp8 (e4m3) KV cache: the Triton writers and readers under TRITON_INTERPRET=1
(one subprocess, as tests/test_kernels_interp.py), the torch paths in process, the KVPool and its
scales, the CLI flag, and Engine(kv_cache_dtype="fp8_e4m3") on the default model against the
full-precision engine."""

from __future__ import annotations

import importlib.util
import os
import sys

import kv_fp8_checks
import pytest
import torch
from interp_runner import assert_records, main, run_script

GROUPS = ["store", "decode", "extend", "cascade", "backend"]
CASCADE_SMALL = [
    {"impl": "fused", "block_m": 16, "block_n": 16},
    {"impl": "two_launch", "fused_merge": True, "block_m": 16, "block_n": 16},
]


def _checks(group: str) -> list:
    import kv_fp8_checks as c
    from kernel_checks import run

    f32, b16 = torch.float32, torch.bfloat16
    if group == "store":
        return c.check_store_fp8("cpu", f32) + c.check_store_fp8("cpu", b16)
    if group == "decode":
        return run(
            [
                lambda: c.check_decode_fp8("cpu", b16, [1, 37, 90], 8, 2, 32, [1, 3], block_n=16),
                lambda: c.check_decode_fp8("cpu", f32, [20, 5], 8, 2, 32, [2], block_n=16),
                lambda: c.check_decode_fp8("cpu", b16, [33], 8, 2, 32, [2], unit=True, block_n=16),
            ]
        )
    if group == "extend":
        tiles = {"block_m": 32, "block_n": 16, "num_warps": 4}
        return run(
            [
                lambda: c.check_extend_fp8("cpu", b16, [0, 17, 40], [20, 1, 37], 8, 2, 32, **tiles),
                lambda: c.check_extend_fp8("cpu", f32, [5, 0], [9, 30], 8, 2, 32, **tiles),
                lambda: c.check_extend_fp8("cpu", b16, [12], [7], 8, 2, 32, unit=True, **tiles),
            ]
        )
    if group == "cascade":
        return run(
            [
                lambda: c.check_cascade_fp8(
                    "cpu", b16, [3, 1], [40, 0], [5, 1, 12, 30], 8, 2, 32, CASCADE_SMALL
                ),
                lambda: c.check_cascade_fp8("cpu", f32, [2], [20], [3, 9], 8, 2, 32, CASCADE_SMALL[:1]),
            ]
        )
    if group == "backend":
        return (
            c.check_backend_fp8("cpu", torch.bfloat16, "triton")
            + c.check_backend_fp8("cpu", torch.float32, "triton", unit=True)
            + c.check_backend_fp8("cpu", torch.bfloat16, "triton_split")
        )
    raise KeyError(group)


@pytest.fixture(scope="module")
def interp_results() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    return run_script(__file__)


@pytest.mark.parametrize("group", GROUPS)
def test_triton_kernels_read_and_write_fp8_pool(interp_results: dict, group: str) -> None:
    assert_records(interp_results[group], interp_results["_seed"], group)


@pytest.mark.parametrize("group", ["store", "decode", "extend", "cascade"])
def test_torch_reference_paths_handle_fp8_pool(group: str) -> None:
    """Without the interpreter every op takes its *_ref torch path (the CPU path): same checks."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("the interpreter is on: this test is for the torch paths")
    torch.manual_seed(1)
    assert_records(_checks(group), what=group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_attention_backend_reads_fp8_pool(dtype: torch.dtype) -> None:
    import kv_fp8_checks as c

    torch.manual_seed(2)
    assert_records(
        c.check_backend_fp8("cpu", dtype, "torch") + c.check_backend_fp8("cpu", dtype, "torch", True)
    )


def test_fp8_checks_fail_when_scales_are_ignored() -> None:
    """The checks can fail: a reader that drops the per-head scales is caught."""
    import kv_fp8_checks as c

    from radixlm.kernels.decode_attention import decode_attention_ref

    k8, v8, ks, vs, table, rows = c.fp8_pool([30, 7], 2, 16, "cpu", unit=False)
    lens = torch.tensor([30, 7])
    q = torch.randn(2, 4, 16, dtype=torch.float64)
    ref, _ = decode_attention_ref(
        q, c.deq(k8, ks, torch.float64), c.deq(v8, vs, torch.float64), table, rows, lens
    )
    good, _ = decode_attention_ref(q, k8, v8, table, rows, lens, None, None, ks, vs)
    dropped, _ = decode_attention_ref(q, k8, v8, table, rows, lens)
    assert c.rel_err(good, ref) < 1e-6
    assert c.rel_err(dropped, ref) > 0.1


def test_kv_pool_fp8_bytes_scales_and_store() -> None:
    from radixlm.backend.kv_pool import KV_CACHE_DTYPES, KVPool, resolve_kv_cache_dtype
    from radixlm.backend.server.launch import KV_CACHE_DTYPE_CHOICES

    f8 = torch.float8_e4m3fn
    assert KV_CACHE_DTYPE_CHOICES == KV_CACHE_DTYPES
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype(None, torch.float32) == torch.float32
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == f8
    with pytest.raises(ValueError, match="auto, fp8_e4m3"):
        resolve_kv_cache_dtype("fp8", torch.bfloat16)
    bf16 = KVPool.bytes_per_token(4, 2, 8, torch.bfloat16)
    assert KVPool.bytes_per_token(4, 2, 8, f8) * 2 == bf16
    assert KVPool.bytes_per_token(4, 2, 8, torch.float32) == 2 * bf16

    pool = KVPool(2, 10, 2, 8, f8, "cpu")
    assert pool.k_buffers[0].dtype == f8 and pool.scales(0) == (None, None)
    assert pool.k_scales.tolist() == [[1.0, 1.0]] * 2  # default 1, as vLLM's
    with pytest.raises(ValueError):
        pool.set_scales(torch.tensor([1.0, 0.0]), 1.0)
    with pytest.raises(ValueError):
        pool.set_scales(float("nan"), 1.0)
    with pytest.raises(ValueError):
        KVPool(1, 4, 2, 8, torch.float32, "cpu").set_scales(2.0, 2.0)
    pool.set_scales(torch.tensor([[0.5, 2.0], [1.0, 4.0]]), torch.tensor([0.25, 8.0]))
    k_scale, v_scale = pool.scales(1)
    assert k_scale is not None and v_scale is not None
    assert k_scale.tolist() == [1.0, 4.0] and v_scale.tolist() == [0.25, 8.0]
    k = torch.randn(3, 2, 8) * 1000  # far past 448 × scale: clamped
    v = torch.randn(3, 2, 8)
    loc = torch.tensor([4, 1, 9])
    pool.store(1, loc, k, v)
    want_k = (k / torch.tensor([1.0, 4.0])[:, None]).clamp(-448, 448).to(f8)
    want_v = (v / torch.tensor([0.25, 8.0])[:, None]).clamp(-448, 448).to(f8)
    assert torch.equal(pool.k_buffers[1][loc].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pool.v_buffers[1][loc].view(torch.uint8), want_v.view(torch.uint8))
    assert pool.k_buffers[1][[0, 2, 3, 5, 6, 7, 8, 10]].float().abs().sum() == 0
    pool.set_scales(1.0, 1.0)
    assert pool.scales(0) == (None, None)


def test_cli_flag_reaches_engine_kwargs() -> None:
    import argparse

    from radixlm.backend.server.launch import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs(p.parse_args([]))["kv_cache_dtype"] == "auto"
    assert engine_kwargs(p.parse_args(["--kv-cache-dtype", "fp8_e4m3"]))["kv_cache_dtype"] == "fp8_e4m3"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])


PROMPTS = kv_fp8_checks.PROMPTS
GREEDY = kv_fp8_checks.GREEDY


@pytest.fixture(scope="module")
def fp8_engine():
    from radixlm.backend.engine import Engine

    eng = Engine(kv_cache_dtype="fp8_e4m3", max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def full_greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


def test_engine_rejects_unknown_kv_cache_dtype() -> None:
    from radixlm.backend.engine import Engine

    with pytest.raises(ValueError, match="fp8_e4m3"):
        Engine(kv_cache_dtype="int8", max_total_tokens=64)


def test_engine_fp8_pool_takes_a_quarter_of_fp32_bytes(engine, fp8_engine) -> None:
    from radixlm.backend.kv_pool import KVPool

    full, fp8 = engine.runner, fp8_engine.runner
    assert full.kv_pool.k_buffers[0].dtype == full.dtype == torch.float32  # "auto": the model dtype
    assert fp8.kv_pool.k_buffers[0].dtype == torch.float8_e4m3fn and fp8.dtype == torch.float32
    c = fp8.config
    per = {
        d: KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, d)
        for d in (full.kv_dtype, fp8.kv_dtype)
    }
    assert per[torch.float32] == 4 * per[torch.float8_e4m3fn]
    pool = fp8.kv_pool
    held = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
    assert held == per[torch.float8_e4m3fn] * (pool.size + 1)


def test_engine_fp8_teacher_forced_logits_close(engine, fp8_engine, full_greedy) -> None:
    """Each prompt and the fp32-KV engine's greedy continuation, prefilled through both engines
    (every K/V read back from the pool): the fp8 engine's argmax agrees at >= 90% of the
    generated positions and its logits stay within 12% (rel. L2) of fp32's. Measured on the
    default model: 95.3% agreement, rel. error 0.049 mean / 0.072 worst prompt."""
    from engine_helpers import position_logits

    agree = total = 0
    for prompt, out in zip(PROMPTS, full_greedy):
        ids = engine.tokenizer.encode(prompt) + out
        n = len(ids) - len(out)
        ref, got = position_logits(engine, ids)[n - 1 : -1], position_logits(fp8_engine, ids)[n - 1 : -1]
        assert ref.argmax(-1).tolist() == out  # the fp32 prefill reproduces the fp32 decode
        assert float((got - ref).norm() / ref.norm()) < 0.12
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(out)
    assert agree / total >= 0.9, agree / total


def test_engine_fp8_scales_set_through_the_runner(engine, fp8_engine) -> None:
    """Per-head scales reach the torch path: logits stay close to fp32's with scales far from 1,
    and readers that ignored them (the writers still divide) would not."""
    from engine_helpers import position_logits

    runner = fp8_engine.runner
    hkv = runner.config.num_kv_heads
    ids = engine.tokenizer.encode(PROMPTS[2] + " " + PROMPTS[3])
    ref = position_logits(engine, ids)
    ks = torch.linspace(0.5, 2.0, hkv)
    try:
        fp8_engine.flush_cache()
        fp8_engine._call(lambda: runner.set_kv_scales(ks, ks.flip(0)))
        assert runner.kv_pool.scales(0)[0] is not None
        got = position_logits(fp8_engine, ids)
        runner.kv_pool.scales = lambda layer: (None, None)  # readers that ignore the scales
        wrong = position_logits(fp8_engine, ids)
    finally:
        del runner.kv_pool.scales
        fp8_engine.flush_cache()
        fp8_engine._call(lambda: runner.set_kv_scales(1.0, 1.0))
    assert float((got - ref).norm() / ref.norm()) < 0.12
    assert float((wrong - ref).norm() / ref.norm()) > 0.2


def test_engine_fp8_greedy_decode_tracks_full_precision(fp8_engine, full_greedy, monkeypatch) -> None:
    """Free-running greedy decode (batched, and alone for one prompt) through the fp8 pool: the
    first two tokens of every prompt equal the fp32-KV engine's; later, near-ties of a 135M model
    let trajectories part (measured: 59% of all 24-token positions equal, first divergence at
    token 2 at the earliest). The CPU's fused C decode reads float32 pools only: with an fp8
    pool it must never be called."""
    from radixlm.kernels import cpu_decode

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the C decode path was handed an fp8 pool")

    monkeypatch.setattr(cpu_decode, "rope_store_attend", refuse)
    got = [o["output_ids"] for o in fp8_engine.generate(PROMPTS, GREEDY)]
    assert fp8_engine.generate(PROMPTS[0], GREEDY)["output_ids"] == got[0]
    assert all(r[:2] == g[:2] for r, g in zip(full_greedy, got)), (full_greedy, got)
    same = sum(a == b for r, g in zip(full_greedy, got) for a, b in zip(r, g))
    assert same / sum(len(r) for r in full_greedy) >= 0.4


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main(_checks, GROUPS)


@pytest.mark.parametrize(
    "batch,max_len",
    [(1, 100), (1, 4096), (8, 16384), (16, 2048), (64, 4096), (128, 2048), (512, 512), (825, 16384)],
)
def test_fp8_decode_splits_fill_the_last_wave(batch: int, max_len: int) -> None:
    """The fp8 split count is the fewest whose last wave of programs is >= 90% full (or that
    make four waves), within [1, max_len / tile]; bf16 keeps its own rule."""
    from radixlm.kernels import decode_splits as da

    sms, hkv = 132, 8
    s = da.choose_decode_splits(batch, hkv, max_len, sms, torch.float8_e4m3fn)
    cap = max(1, min(64, max_len // da.BLOCK_N_FP8))
    assert 1 <= s <= cap

    def good(n: int) -> bool:
        waves = batch * hkv * n / (sms * da.FP8_PROGRAMS_PER_SM)
        return waves >= 4 or waves / -(-waves // 1) >= 0.9

    assert (good(s) or s == cap) and not any(good(n) for n in range(1, s))
    assert da.choose_decode_splits(batch, hkv, max_len, sms, torch.bfloat16) == da.choose_num_splits(
        batch, hkv, max_len, sms
    )


def test_v_widened_in_registers_only_on_cuda_fp8() -> None:
    from radixlm.kernels.kv_quant import widen_v_in_registers

    q = torch.zeros(1, 4, 8, dtype=torch.bfloat16)
    assert not widen_v_in_registers(q, torch.zeros(2, 1, 8, dtype=torch.float8_e4m3fn))  # CPU: interpreter
    assert not widen_v_in_registers(q, torch.zeros(2, 1, 8, dtype=torch.bfloat16))
