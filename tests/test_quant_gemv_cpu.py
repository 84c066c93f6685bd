"""The CPU kernel over GGUF blocks (radixlm.kernels.quant_gemv_cpu) against exact arithmetic: the
decode path equals the float64 product with the activations quantized as the kernel documents
(int8 per block of 32, offsets on the rounded block sums), so any wrong lane, pair order, tail
row or tail block shows as an error far above float rounding; the many-row path's weights equal
gguf's dequantization (bf16: once rounded); each row of x gives the same bits whatever rows come
with it; the huge-page arena holds exact copies. Also the CPU decode pieces that changed with it:
the joint q/k rotation and the one-request decode attention."""

from __future__ import annotations

import pytest
import torch
from test_quant_formats import random_blocks, reference

from radixlm.backend.attention import TorchAttentionBackend
from radixlm.backend.models.rotary import RotaryEmbedding
from radixlm.backend.quant_formats import QuantTensor
from radixlm.backend.quant_linear import BlockSegment, QuantLinear
from radixlm.kernels import cpu_decode
from radixlm.kernels import quant_gemv_cpu as K

needs_kernel = pytest.mark.skipif(not K.available(), reason="no C compiler or no AVX2 here")
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def simulated(x: torch.Tensor, raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """What the kernel computes, in float64: x rounded to int8 * scale per block of 32, times the
    dequantized weights; the offset terms (Q4_1's m, Q4_0's -8 d) see the rounded x too."""
    m, k = x.shape
    xb = x.double().view(m, -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))) * d
    return xq.reshape(m, k) @ reference(raw.numpy(), qtype).double().T


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize(("rows", "cols"), [(44, 576), (7, 96), (5, 32), (9, 1536)])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_decode_kernel_is_exact_for_its_quantized_activations(qtype, rows, cols, m) -> None:
    """44, 7 and 5 rows leave a partial group (of 16 rows interleaved with AVX-512 VNNI, of 4 rows
    walked side by side with AVX2); 96 and 32 columns an odd block count."""
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=rows + cols + m))
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    y = K.gemm(x, K.repack(raw, qtype), qtype, rows)
    ref = simulated(x, raw, qtype)
    assert y.shape == (m, rows) and y.dtype == torch.float32
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < 2e-6, err


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize(("rows", "cols"), [(44, 576), (7, 96), (9, 1536)])
def test_a_row_of_x_gives_the_same_bits_among_others(qtype, rows, cols) -> None:
    """A verify step's rows go through the kernel together: each must equal what it gives alone
    (a decode step), for every count the kernel takes (AVX2 runs x rows in passes of up to four)."""
    raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=rows * cols))
    packed = K.repack(raw, qtype)
    x = torch.randn(K.GEMV_MAX_ROWS, cols, generator=torch.Generator().manual_seed(rows))
    alone = torch.cat([K.gemm(x[i : i + 1], packed, qtype, rows) for i in range(x.shape[0])])
    for m in range(2, K.GEMV_MAX_ROWS + 1):
        assert torch.equal(K.gemm(x[:m], packed, qtype, rows), alone[:m]), m


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("rows", [5, 44, 4097])
def test_threads_share_the_columns_with_the_same_bits(qtype, rows) -> None:
    """cpu_decode's thread team (the LM head, the one-call layer loop) splits a matmul's output
    columns in groups of four: any thread count, even more threads than groups, gives the bits of
    one thread, for one decode row and for a verify step's rows; the team is reused call after call.
    No rows (a prompt chunk that needs no logits) is an empty result on either path."""
    if not cpu_decode.available():
        pytest.skip("no C compiler or no AVX2 here")
    raw = torch.from_numpy(random_blocks(qtype, rows, 576, seed=rows))
    packed = K.repack(raw, qtype)
    for m in (0, 1, 3):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        one = K.gemm(x, packed, qtype, rows)
        for threads in (2, 3, 5, 2):
            assert torch.equal(cpu_decode.gemm_threads(x, packed, qtype, rows, threads), one), (m, threads)


def test_team_threads_follow_torch_and_step_aside_for_spinning_workers(monkeypatch) -> None:
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    try:
        torch.set_num_threads(2)
        assert cpu_decode.team_threads(9) == 2 and cpu_decode.team_threads(1) == 1
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        assert cpu_decode.team_threads(9) == 1
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("qtype", FORMATS)
def test_many_rows_dequantize_to_gguf_values(qtype) -> None:
    """bf16: gguf's values rounded once; fp32: gguf's values (an FMA may differ in the last bit)."""
    raw = torch.from_numpy(random_blocks(qtype, 13, 160, seed=7))
    ref = reference(raw.numpy(), qtype)
    w = K.dequantize(K.repack(raw, qtype), qtype, 13, 160, torch.bfloat16)
    assert w.dtype == torch.bfloat16 and w.shape == (13, 160)
    torch.testing.assert_close(w.float(), ref, rtol=2**-8, atol=1e-6)
    w = K.dequantize(K.repack(raw, qtype), qtype, 13, 160, torch.float32)
    assert w.dtype == torch.float32 and w.shape == (13, 160)
    torch.testing.assert_close(w, ref, rtol=2**-22, atol=1e-7)


def test_dense_dtype_is_bf16_only_with_bf16_dot_products(monkeypatch) -> None:
    for flags, want in (
        ("fma avx2", torch.float32),
        ("avx2 avx512f avx512_bf16", torch.bfloat16),
        ("amx_bf16", torch.bfloat16),
    ):
        K.dense_dtype.cache_clear()
        monkeypatch.setattr(K, "_cpu_flags", lambda f=flags: "flags\t: " + f)
        assert K.dense_dtype() == want, flags
    K.dense_dtype.cache_clear()


@needs_kernel
@pytest.mark.parametrize("m", [1, K.GEMV_MAX_ROWS + 3, K.GEMV_PASSES_MAX_ROWS + 1])
def test_block_segment_in_quant_linear(m) -> None:
    """QuantLinear takes the block kernel for these formats: one pass, several passes (each row's
    bits as it gets alone), and past the passes' limit the dequantized weight."""
    raw = random_blocks("Q4_1", 64, 256, seed=9)
    layer = QuantLinear(
        [QuantTensor("Q4_1", torch.from_numpy(raw), 256)], None, torch.device("cpu"), torch.float32
    )
    assert isinstance(layer.segments[0], BlockSegment)
    x = torch.randn(m, 256)
    ref = x.double() @ reference(raw, "Q4_1").double().T
    out = layer(x)
    assert out.dtype == torch.float32
    # the kernel: x rounded to int8 per block; many rows: the dense dtype's rounding (fp32: exact)
    dense = m > K.GEMV_PASSES_MAX_ROWS
    exact = dense and K.dense_dtype() == torch.float32
    assert ((out.double() - ref).norm() / ref.norm()).item() < (1e-5 if exact else 2e-2)
    if not dense:
        assert torch.equal(out, torch.cat([layer(x[i : i + 1]) for i in range(m)]))


def test_no_rows_are_an_empty_result_without_a_kernel_call() -> None:
    """The LM head of a prompt chunk that needs no logits gets x of no rows: models.llama.linear
    answers [0, out] without calling the layer (the GPU block kernels refuse an empty x)."""
    from radixlm.backend.models.llama import linear

    raw = random_blocks("Q4_1", 64, 256, seed=9)
    layer = QuantLinear(
        [QuantTensor("Q4_1", torch.from_numpy(raw), 256)], None, torch.device("cpu"), torch.float32
    )

    def refuse(x: torch.Tensor, native: bool = False) -> torch.Tensor:
        raise AssertionError("called with no rows")

    layer.forward = refuse  # type: ignore[method-assign]
    for dense in (False, True):
        target = torch.nn.Linear(256, 64) if dense else layer
        out = linear(target, torch.empty(0, 256))
        assert out.shape == (0, 64) and out.dtype == torch.float32


@needs_kernel
def test_arena_holds_exact_copies_in_one_buffer() -> None:
    ts = [torch.randint(0, 256, (n, 36), dtype=torch.uint8) for n in (3, 70, 1)]
    views = K.arena(ts)
    assert all(torch.equal(a, b) for a, b in zip(ts, views))
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert all(v.data_ptr() % 64 == 0 for v in views)


def test_joint_rotation_equals_hf_rotate_half() -> None:
    rope = RotaryEmbedding(64, 128, 10000.0, None)
    rope.build("cpu")
    pos = torch.tensor([0, 5, 77])
    q, k = torch.randn(3, 9, 64), torch.randn(3, 3, 64)

    def hf(x: torch.Tensor) -> torch.Tensor:
        cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
        return x * cos + torch.cat([-x[..., 32:], x[..., :32]], dim=-1) * sin

    with rope.step(pos):
        qk = rope.rotate(pos, torch.cat([q, k], dim=1))
        q2, k2 = rope(pos, q, k)
    torch.testing.assert_close(qk, torch.cat([hf(q), hf(k)], dim=1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(q2, hf(q), rtol=1e-6, atol=1e-6)
    assert rope._step is None  # the step's tables are dropped after it
    other = torch.tensor([1, 2, 3])
    with rope.step(pos):  # positions other than the step's are gathered afresh
        torch.testing.assert_close(rope.rotate(other, q), rope.rotate(other.clone(), q))
        assert not torch.allclose(rope.rotate(other, q), rope.rotate(pos, q))


def test_one_request_decode_equals_batched_decode() -> None:
    class Fb:  # the fields the decode paths read
        seq_lens_cpu = [6]
        req_pool_indices_cpu = [1]
        req_pool_indices = torch.tensor([1])
        seq_lens = torch.tensor([6])
        req_to_token = torch.zeros(3, 16, dtype=torch.int64)

    Fb.req_to_token[1, :6] = torch.tensor([9, 2, 14, 3, 7, 11])
    k_buf, v_buf = torch.randn(16, 3, 64), torch.randn(16, 3, 64)
    q = torch.randn(1, 9, 64)
    one = TorchAttentionBackend._decode_one(q, k_buf, v_buf, Fb)
    batched = TorchAttentionBackend._decode(q, k_buf, v_buf, Fb)
    torch.testing.assert_close(one, batched, rtol=1e-5, atol=1e-6)


def test_avx2_build_is_exact_and_row_independent(tmp_path, monkeypatch) -> None:
    """The fallback for CPUs without AVX-512 VNNI (rows kept whole, AVX2 dots), compiled here for
    Haswell whatever this CPU has, with the row layout repack() gives it: exact for its quantized
    activations, each row of x the same alone as among others, its dequantization gguf's."""
    import ctypes
    import os
    import shutil
    import subprocess

    cc = shutil.which(os.environ.get("CC", "cc"))
    if not cc or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no C compiler, or a CPU that cannot run AVX2 code")
    so = tmp_path / "quant_gemv_avx2.so"
    src = tmp_path / "quant_gemv.c"
    src.write_text(K._SOURCE)
    flags = ["-march=haswell" if f == "-march=native" else f for f in K._FLAGS]  # the build's, for Haswell
    subprocess.run([cc, *flags, str(src), "-o", str(so), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.matmul.argtypes = [p, i, i, p, i, ctypes.c_int, p]
    lib.dequant_f32.argtypes = [p, i, i, ctypes.c_int, p]
    assert lib.group_rows() == 1
    for qtype, (rows, cols) in [(t, shape) for t in FORMATS for shape in ((7, 96), (9, 320))]:
        raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed=rows + cols))
        monkeypatch.setattr(K, "group_rows", lambda: 1)  # the layout this build reads
        packed = K.repack(raw, qtype)
        monkeypatch.undo()
        x = torch.randn(5, cols, generator=torch.Generator().manual_seed(5))
        y = torch.empty(5, rows)
        lib.matmul(x.data_ptr(), 5, cols, packed.data_ptr(), rows, K.FORMATS.index(qtype), y.data_ptr())
        ref = simulated(x, raw, qtype)
        assert ((y.double() - ref).norm() / ref.norm()).item() < 2e-6, (qtype, cols)
        y0 = torch.empty(1, rows)
        lib.matmul(x[2:3].data_ptr(), 1, cols, packed.data_ptr(), rows, K.FORMATS.index(qtype), y0.data_ptr())
        assert torch.equal(y0[0], y[2]), qtype
        w = torch.empty(rows, cols)
        lib.dequant_f32(packed.data_ptr(), rows, cols // 32, K.FORMATS.index(qtype), w.data_ptr())
        assert torch.equal(w, reference(raw.numpy(), qtype)), qtype


def test_kernel_builds_where_a_compiler_and_avx2_exist() -> None:
    """The callers fall back silently (and the kernel tests skip) when a build fails: here, with
    a compiler and AVX2, a failed build is an error."""
    import os
    import shutil

    if not shutil.which(os.environ.get("CC", "cc")) or os.environ.get("RADIXLM_NO_CPU_GEMV"):
        pytest.skip("no C compiler, or the kernel is switched off")
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2")
    assert K.build_c(K._SOURCE, "quant_gemv") is not None
    assert K.build_c(cpu_decode._SOURCE, "cpu_decode") is not None
