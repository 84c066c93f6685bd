"""GGUF block layouts read and written in torch: a weight is uint8 raw [rows, blocks * bytes] (one
row of ggml blocks per output row). Promises: `dequantize_blocks` equals `gguf.quants.dequantize`,
`quantize_blocks` equals `gguf.quants.quantize` byte for byte (Q4_0, Q4_1, Q8_0), and the
`affine_terms` of a weight sum to it (the form packed 4-bit matmuls take)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256
# bytes per block and values per block, as ggml lays them out
BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, QK_K),
    "Q5_K": (176, QK_K),
    "Q6_K": (210, QK_K),
}
AFFINE_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K")  # those affine_terms splits


def _f16(b: torch.Tensor, offset: int) -> torch.Tensor:
    """The half at byte offset of each block b [..., bytes] → float32 [..., 1]. Block sizes
    and offsets are even, so the blocks read as int16 in place (no copy of the bytes)."""
    halves = b.contiguous().view(torch.int16)
    return halves[..., offset // 2 : offset // 2 + 1].view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes → 32 values: low nibbles are values 0-15, high nibbles 16-31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes → eight 6-bit scales and eight 6-bit mins per super-block."""
    s = s.to(torch.int32)
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes → [.., 8, 32]: each run of 32 bytes holds sub-block 2j (low) and 2j+1 (high)."""
    qs = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=-2).reshape(*qs.shape[:-3], 8, 32)


@dataclass
class AffineGroups:
    """w = scale * q + offset per group of 32 values: q [rows, cols] in 0..15 (uint8),
    scale and offset float32 [rows, cols // 32]. Q4 formats are one term; Q8_0 and Q5_K split
    into a high and a low 4-bit term whose sum is the weight."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


def _blocks(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF type {qtype} is not supported (supported: {', '.join(BLOCKS)})")
    return raw.reshape(raw.shape[0], -1, BLOCKS[qtype][0])


def affine_terms(raw: torch.Tensor, qtype: str) -> list[AffineGroups]:
    """The weight as a sum of 4-bit affine terms with groups of 32; [] for formats that have
    none (Q6_K scales groups of 16)."""
    b, rows = _blocks(raw, qtype), raw.shape[0]
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        d = _f16(b, 0)
        m = _f16(b, 2) if qtype == "Q4_1" else -8 * d
        return [
            AffineGroups(_nibbles(b[..., head:]).reshape(rows, -1), d.reshape(rows, -1), m.reshape(rows, -1))
        ]
    if qtype == "Q8_0":
        d = _f16(b, 0).reshape(rows, -1)
        u = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(rows, -1)
        return [AffineGroups(u >> 4, 16 * d, -128 * d), AffineGroups(u & 0x0F, d, torch.zeros_like(d))]
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scales(b[..., 4:16])
        scale, offset = (d * sc).reshape(rows, -1), (-dmin * mn).reshape(rows, -1)
        qs = b[..., 16:144] if qtype == "Q4_K" else b[..., 48:176]
        low = AffineGroups(_k_low_nibbles(qs).reshape(rows, -1), scale, offset)
        if qtype == "Q4_K":
            return [low]
        return [
            low,
            AffineGroups(
                _q5k_high_bits(b[..., 16:48]).reshape(rows, -1), 16 * scale, torch.zeros_like(scale)
            ),
        ]
    return []


def _q5k_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """32 bytes → [.., 8, 32]: bit j of byte i is the fifth bit of value i of sub-block j."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).reshape(8, 1)
    return (qh.unsqueeze(-2) >> shifts) & 1


def _q6k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [..., 210] → values [..., 256]: 4 low bits in ql, 2 high bits in qh, int8
    scales per 16 values, one half scale per block."""
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=-2).reshape(*lead, 8, 32)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(4, 1)
    qh = ((qh >> shifts) & 0x03).reshape(*lead, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int16) - 32).reshape(*lead, 16, 16).float()
    sc = b[..., 192:208].contiguous().view(torch.int8).float().unsqueeze(-1)
    d = _f16(b, 208).unsqueeze(-1)
    return (d * sc * q).reshape(*lead, QK_K)


def dequantize_blocks(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """float32 [rows, cols] on raw's device, as gguf.quants.dequantize gives it."""
    b, rows = _blocks(raw, qtype), raw.shape[0]
    if qtype == "Q6_K":
        return _q6k(b).reshape(rows, -1)
    if qtype == "Q8_0":  # one term, d * q: the rounding gguf's own dequantization has
        return (_f16(b, 0) * b[..., 2:].contiguous().view(torch.int8).float()).reshape(rows, -1)
    w = None
    for g in affine_terms(raw, qtype):
        q = g.q.float().reshape(rows, -1, 32)
        term = (g.scale.unsqueeze(-1) * q + g.offset.unsqueeze(-1)).reshape(rows, -1)
        w = term if w is None else w + term
    assert w is not None
    return w


QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0")


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), which ggml's Q8_0 uses; torch.round rounds to even."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def quantize_blocks(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float weight [rows, cols] (cols a multiple of 32) → raw uint8 [rows, cols / 32 * bytes] on
    w's device, the bytes ggml's reference quantizer writes (computed in float32 as it does)."""
    if qtype not in QUANTIZABLE:
        raise ValueError(f"quantize_blocks writes {', '.join(QUANTIZABLE)}, got {qtype}")
    if w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(
            f"quantize_blocks needs [rows, cols] with cols a multiple of 32, got {tuple(w.shape)}"
        )
    rows = w.shape[0]
    x = w.float().reshape(rows, -1, 32)
    if qtype == "Q8_0":
        d = x.abs().amax(dim=-1, keepdim=True) / 127
        q = _round_away(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_half_bytes(d), q], dim=-1).reshape(rows, -1)
    if qtype == "Q4_0":
        peak = torch.gather(x, -1, x.abs().argmax(dim=-1, keepdim=True))  # signed value of max |x|
        d = peak / -8
        q = torch.trunc(x * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
        head = [_half_bytes(d)]
    else:
        lo, hi = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.trunc((x - lo) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
        head = [_half_bytes(d), _half_bytes(lo)]
    packed = q[..., :16] | (q[..., 16:] << 4)
    return torch.cat([*head, packed], dim=-1).reshape(rows, -1)


def _half_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] → its fp16's two little-endian bytes [..., 2]."""
    return v.to(torch.float16).view(torch.uint8)
