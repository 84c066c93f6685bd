"""GGUF blocks read in torch against gguf's own dequantization (`gguf.quants.dequantize`), block
for block, for every supported format; the 4-bit affine terms summing to the same weight; and
QuantLinear / QuantEmbedding on the CPU against F.linear / row lookup with that reference."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from radixlm.backend.quant_formats import AFFINE_FORMATS, BLOCKS, QuantTensor
from radixlm.backend.quant_linear import (
    QuantEmbedding,
    QuantLinear,
    _direct_packing_matches,
    _int4pack_layout,
)

# where each format keeps its fp16 scales (random bytes there could be inf/nan)
HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
CPU = torch.device("cpu")


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes for every field, finite small halves for the scales: any bit pattern of
    the quants, scale bytes and high bits is exercised."""
    rng = np.random.default_rng(seed)
    nbytes, nvalues = BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // nvalues, nbytes), dtype=np.uint8)
    for off in HALF_OFFSETS[qtype]:
        halves = (rng.standard_normal((rows, cols // nvalues, 1)) * 0.02).astype(np.float16)
        raw[..., off : off + 2] = halves.view(np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).copy())


@pytest.mark.parametrize("qtype", list(BLOCKS))
def test_dequantize_equals_gguf_block_for_block(qtype: str) -> None:
    raw = random_blocks(qtype, 6, 512)
    ours = QuantTensor(qtype, torch.from_numpy(raw), 512).dequantize()
    ref = reference(raw, qtype)
    assert ours.shape == ref.shape == (6, 512)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", AFFINE_FORMATS)
def test_affine_terms_sum_to_the_weight(qtype: str) -> None:
    raw = random_blocks(qtype, 4, 256, seed=1)
    qt = QuantTensor(qtype, torch.from_numpy(raw), 256)
    total = torch.zeros(4, 256)
    for g in qt.affine_terms():
        assert g.q.dtype == torch.uint8 and int(g.q.max()) <= 15
        total += (g.scale.unsqueeze(-1) * g.q.float().reshape(4, -1, 32) + g.offset.unsqueeze(-1)).reshape(
            4, 256
        )
    torch.testing.assert_close(total, reference(raw, qtype), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_real_weights_quantized_by_gguf(qtype: str) -> None:
    w = np.random.default_rng(2).standard_normal((8, 320)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    ours = QuantTensor(qtype, torch.from_numpy(raw), 320).dequantize()
    torch.testing.assert_close(ours, reference(raw, qtype), rtol=1e-6, atol=1e-7)


def test_wrong_row_width_is_refused() -> None:
    with pytest.raises(ValueError, match="need"):
        QuantTensor("Q4_1", torch.zeros(2, 21, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="not supported"):
        QuantTensor("Q3_K", torch.zeros(2, 110, dtype=torch.uint8), 256)


def test_int4_packing_matches_torch_where_the_layout_says_so() -> None:
    """torch's CPU int4 tile follows the CPU's vector width: where it is the layout
    _int4pack_layout writes, the bytes are equal, and _direct_packing_matches must say which case
    this CPU is (QuantLinear packs through torch's own op otherwise)."""
    q = torch.randint(0, 16, (192, 96), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    expected = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    assert torch.equal(_int4pack_layout(q.to(torch.uint8)), expected) == _direct_packing_matches()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("qtype", list(BLOCKS))
@pytest.mark.parametrize("rows", [96, 40])  # 40: not a whole 64-row packing tile
def test_quant_linear_matches_dequantized_matmul(qtype: str, rows: int) -> None:
    raw = random_blocks(qtype, rows, 512, seed=4)
    x = torch.randn(5, 512)
    layer = QuantLinear([QuantTensor(qtype, torch.from_numpy(raw), 512)], None, CPU, torch.float32)
    ref = F.linear(x.double(), reference(raw, qtype).double())
    out = layer(x)
    assert out.shape == (5, rows) and out.dtype == torch.float32
    # the block kernel (Q4_0/Q4_1/Q8_0) quantizes activations to int8 per block of 32 as
    # llama.cpp does: ~1e-2 relative on random data; the packed path's bf16 ~3e-3
    assert rel_err(out, ref) < (2e-2 if qtype in ("Q4_0", "Q4_1", "Q8_0") else 1e-2)


def test_mixed_formats_with_bias_stack_in_order() -> None:
    """A fused q/k/v whose parts differ in format (as Q4_K_M files mix Q4_K and Q6_K)."""
    parts = [("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)]
    raws = [random_blocks(q, r, 256, seed=i) for i, (q, r) in enumerate(parts)]
    tensors = [QuantTensor(q, torch.from_numpy(raw), 256) for (q, _), raw in zip(parts, raws)]
    bias = torch.randn(128)
    layer = QuantLinear(tensors, bias, CPU, torch.float32)
    assert len(layer.segments) == 2
    w = torch.cat([reference(raw, q) for (q, _), raw in zip(parts, raws)])
    x = torch.randn(3, 256)
    assert rel_err(layer(x), F.linear(x.double(), w.double(), bias.double())) < 1e-2


def test_quant_embedding_rows_are_exact() -> None:
    raw = random_blocks("Q8_0", 50, 64, seed=5)
    emb = QuantEmbedding(QuantTensor("Q8_0", torch.from_numpy(raw), 64), CPU, torch.float32)
    ids = torch.tensor([[3, 49, 0], [7, 7, 12]])
    assert torch.equal(emb(ids), reference(raw, "Q8_0")[ids])
