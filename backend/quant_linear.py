"""Linear layers and the token embedding over GGUF weights kept quantized (QuantTensor blocks).
QuantLinear computes x @ W^T (+ bias) for W = the dequantized blocks, to the precision of its
path: on the CPU the C block kernel (radixlm.kernels.quant_gemv_cpu) for Q4_0/Q4_1/Q8_0, torch's
packed int4 matmul for other formats that are sums of 4-bit affine terms (or where no C
compiler is found), a dense dequantized copy where no such path exists; on CUDA
radixlm.kernels.quant_gemv for Q4_0/Q4_1/Q8_0/Q4_K, a dense copy for Q5_K and Q6_K."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.kernels import cpu_decode, quant_gemv_cpu
from radixlm.kernels.quant_gemv import GEMV_FORMATS, quant_matmul, repack, takes_int8_row
from radixlm.kernels.quant_gemv_int8x import Int8Row
from radixlm.kernels.quant_gemv_rope import fuses_rope, qkv_rope_store

from .quant_formats import AFFINE_FORMATS, AffineGroups, QuantTensor, stack_rows

GROUP = 32  # every affine term has one scale and offset per 32 values
PACK_ROWS = 64  # rows padded to whole 64-row tiles of torch's CPU int4 packing
# The CPU's packed int4 matmul is only vectorised for bf16 activations (fp32 input takes a
# scalar path ~10x slower); its output is bf16 too. benchmarks/cpu_quant.py --kernels measures it.
CPU_ACT_DTYPE = torch.bfloat16


class Int4PackSegment(nn.Module):
    """Rows of one format on the CPU as torch int4-packed terms: w = sum over terms of
    (q - 8) * scale + zero per group of 32 (zero = offset + 8 * scale)."""

    def __init__(self, qt: QuantTensor) -> None:
        super().__init__()
        self.rows, self.cols = qt.rows, qt.cols
        self.padded = qt.rows % PACK_ROWS != 0
        self.terms = len(terms := qt.affine_terms())
        self.names = [(f"packed{i}", f"scale_zero{i}") for i in range(self.terms)]
        for (pn, sn), g in zip(self.names, terms):
            packed, scale_zero = _pack_int4(g, self.rows)
            self.register_buffer(pn, packed, persistent=False)
            self.register_buffer(sn, scale_zero, persistent=False)

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        """x @ W^T in x's dtype, or with native in the kernel's own (bf16, skipping two casts)
        where that needs no sum of terms and no row slice."""
        xa = x.to(CPU_ACT_DTYPE)
        if native and len(self.names) == 1 and not self.padded:
            pn, sn = self.names[0]
            out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xa, getattr(self, pn), GROUP, getattr(self, sn)
            )
            return out
        y: torch.Tensor | None = None
        for pn, sn in self.names:  # terms summed in x's dtype: a bf16 sum would round again
            t: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xa, getattr(self, pn), GROUP, getattr(self, sn)
            )
            y = t.to(x.dtype) if y is None else y.add_(t)
        assert y is not None
        return y[:, : self.rows] if self.padded else y


def _pack_int4(g: AffineGroups, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    pad = -rows % PACK_ROWS
    q, scale, offset = g.q, g.scale, g.offset
    if pad:  # zero rows (scale 0, zero 0) whose outputs forward() drops
        q = F.pad(q, (0, 0, 0, pad), value=8)
        scale, offset = F.pad(scale, (0, 0, 0, pad)), F.pad(offset, (0, 0, 0, pad))
    packed = (
        _int4pack_layout(q)
        if _direct_packing_matches()
        else (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
    )
    scale_zero = torch.stack([scale, offset + 8 * scale], dim=-1).transpose(0, 1).contiguous()
    return packed, scale_zero.to(CPU_ACT_DTYPE)


def _int4pack_layout(q: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 packing of q (uint8 [N, K], N a multiple of 64) done in uint8 ops (the
    op itself wants int32, four times the bytes): byte (n // 64, k, i) holds rows i (low
    nibble) and i + 32 (high nibble) of the 64-row tile at column k."""
    n, k = q.shape
    v = q.view(n // 64, 2, 32, k).permute(0, 3, 1, 2)
    return (v[:, :, 0, :] | (v[:, :, 1, :] << 4)).contiguous().view(n, k // 2)


_PACKING_CHECKED: list[bool] = []


def _direct_packing_matches() -> bool:
    """Whether _int4pack_layout equals torch's own packing here (its tile width follows the
    CPU's vector width); checked once on a small random weight."""
    if not _PACKING_CHECKED:
        q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        ours = _int4pack_layout(q.to(torch.uint8))
        _PACKING_CHECKED.append(torch.equal(ours, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)))
    return _PACKING_CHECKED[0]


# Output rows per thread below which a decode matmul runs on one thread: a hand-off to the team
# costs microseconds, which a layer-sized matmul called from Python does not repay; the LM head does.
THREAD_ROWS = 4096


class BlockSegment(nn.Module):
    """Rows kept as their GGUF blocks on the CPU (each row's scales, then its quants) for
    radixlm.kernels.quant_gemv_cpu: up to GEMV_PASSES_MAX_ROWS rows (decode batches, short
    prompts) run its int8 dot-product kernel, GEMV_MAX_ROWS rows per pass, each row's bits as it
    would get alone; more rows dequantize once per call (fp32, or bf16 where the CPU multiplies
    bf16) and run one matmul."""

    packed: torch.Tensor

    def __init__(self, qt: QuantTensor) -> None:
        super().__init__()
        self.qtype, self.rows, self.cols = qt.qtype, qt.rows, qt.cols
        self.register_buffer("packed", quant_gemv_cpu.repack(qt.raw, qt.qtype), persistent=False)

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        m, step = x.shape[0], quant_gemv_cpu.GEMV_MAX_ROWS
        if m <= step:
            y = self._gemv(x)
        elif m <= quant_gemv_cpu.GEMV_PASSES_MAX_ROWS:
            y = torch.cat([self._gemv(x[i : i + step]) for i in range(0, m, step)])
        else:
            dtype = quant_gemv_cpu.dense_dtype()
            w = quant_gemv_cpu.dequantize(self.packed, self.qtype, self.rows, self.cols, dtype)
            y = F.linear(x.to(dtype), w)
        return y if native else y.to(x.dtype)

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        """One pass of the kernel over at most GEMV_MAX_ROWS rows."""
        threads = cpu_decode.team_threads(self.rows // THREAD_ROWS) if cpu_decode.available() else 1
        if threads > 1:  # the same bits, columns shared by threads
            return cpu_decode.gemm_threads(x, self.packed, self.qtype, self.rows, threads)
        return quant_gemv_cpu.gemm(x, self.packed, self.qtype, self.rows)


def fast_rows_limit(model: nn.Module) -> int | None:
    """Most rows a forward runs in one pass of its decode kernel (the CPU block kernel's
    GEMV_MAX_ROWS; past it each further pass streams the weights again, and past
    GEMV_PASSES_MAX_ROWS the whole weight is dequantized); None where every path costs about the
    same per extra row."""
    if any(isinstance(m, BlockSegment) for m in model.modules()):
        return quant_gemv_cpu.GEMV_MAX_ROWS
    return None


class DenseSegment(nn.Module):
    """Rows dequantized once into a dense weight: the path for formats without a packed one."""

    weight: torch.Tensor

    def __init__(self, qt: QuantTensor, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("weight", qt.dequantize().to(device=device, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class CudaSegment(nn.Module):
    """Rows kept as GGUF blocks on the GPU, repacked for radixlm.kernels.quant_gemv: decode rows
    run its CUDA-core kernel, more rows its tensor-core one; both dequantize inside the loop."""

    def __init__(self, qt: QuantTensor, device: torch.device) -> None:
        super().__init__()
        self.qtype, self.cols = qt.qtype, qt.cols
        self.blocks = repack(qt.raw.to(device), qt.qtype)

    def forward(self, x: torch.Tensor, native: bool = False) -> torch.Tensor:
        return quant_matmul(x, self.blocks)


def _segment(qt: QuantTensor, device: torch.device, dtype: torch.dtype) -> nn.Module:
    if device.type == "cuda":
        if qt.qtype in GEMV_FORMATS:
            return CudaSegment(qt, device)
        return DenseSegment(qt, dtype, device)
    if quant_gemv_cpu.supports(qt.qtype, qt.cols):
        return BlockSegment(qt)
    if qt.qtype in AFFINE_FORMATS:
        return Int4PackSegment(qt)
    return DenseSegment(qt, dtype, device)


def _runs_of_one_format(parts: list[QuantTensor]) -> list[QuantTensor]:
    """Consecutive parts of one format stacked: q/k/v of one type become one segment."""
    runs: list[list[QuantTensor]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [r[0] if len(r) == 1 else stack_rows(r) for r in runs]


class QuantLinear(nn.Module):
    """y = x @ W^T (+ bias), W the row-wise concatenation of parts (GGUF blocks)."""

    bias: torch.Tensor | None

    def __init__(
        self, parts: list[QuantTensor], bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if len({p.cols for p in parts}) != 1:
            raise ValueError("QuantLinear parts must share their input width")
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self.formats = sorted({p.qtype for p in parts})
        self.segments = nn.ModuleList(_segment(qt, device, dtype) for qt in _runs_of_one_format(parts))
        self.register_buffer(
            "bias", None if bias is None else bias.to(device=device, dtype=dtype), persistent=False
        )

    if TYPE_CHECKING:  # nn.Module.__call__ runs forward (with hooks); torch types it as returning Any

        def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and x.dim() == 2 and len(self.segments) == 1:
            y: torch.Tensor = self.segments[0](x)  # the decode shape: no reshapes, cat or bias
            return y
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        ys = [s(x2) for s in self.segments]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def takes_int8_row(self, x: torch.Tensor) -> bool:
        """Whether `forward_int8` serves x: one unbiased GPU segment whose one-row matmul reads x
        rounded to int8, which the op writing x can then round in its own launch."""
        if x.dim() != 2 or x.shape[0] != 1 or self.bias is not None or len(self.segments) != 1:
            return False  # the cheap refusals first: prefill steps ask this of every layer
        seg = self.segments[0]
        return isinstance(seg, CudaSegment) and takes_int8_row(x, seg.blocks)

    def forward_int8(self, x: torch.Tensor, x_int8: Int8Row) -> torch.Tensor:
        """forward(x) given x_int8, x already rounded (`quant_gemv_int8x`); only where
        `takes_int8_row(x)`."""
        seg = self.segments[0]
        assert isinstance(seg, CudaSegment)
        return quant_matmul(x, seg.blocks, x_int8=x_int8)

    def rope_store_row(
        self,
        x: torch.Tensor,
        heads: tuple[int, int, int],
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        scales: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> torch.Tensor | None:
        """For a qkv projection of one decode row: q rotated, k rotated and v written into the
        pool (kv: k buffer, v buffer, slots), all in the matmul's launch (`quant_gemv_rope`);
        None where that kernel does not serve this weight and row (the caller runs the two steps)."""
        if x.dim() != 2 or x.shape[0] != 1 or self.bias is not None or len(self.segments) != 1:
            return None
        seg = self.segments[0]
        if not isinstance(seg, CudaSegment) or not fuses_rope(x, seg.blocks, heads):
            return None
        return qkv_rope_store(x, seg.blocks, heads, positions, cos_sin, *kv, *scales)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """forward() whose output may stay in the CPU kernel's dtype (bf16), for callers whose
        next op casts or promotes anyway (the MLP's SiLU-and-mul, a residual add)."""
        if self.bias is None and x.dim() == 2 and len(self.segments) == 1:
            seg = self.segments[0]
            y: torch.Tensor = (
                seg(x, native=True) if isinstance(seg, (Int4PackSegment, BlockSegment)) else seg(x)
            )
            return y
        return self(x)

    def extra_repr(self) -> str:
        kinds = ",".join(type(s).__name__ for s in self.segments)
        return f"in={self.in_features}, out={self.out_features}, formats={self.formats}, paths={kinds}"


class QuantEmbedding(nn.Module):
    """Token embedding over GGUF blocks: the rows looked up are dequantized, nothing else."""

    def __init__(self, qt: QuantTensor, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.qt = QuantTensor(qt.qtype, qt.raw.to(device), qt.cols)
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = qt.rows, qt.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qt.select_rows(ids.reshape(-1))
        return rows.dequantize().to(self.dtype).reshape(*ids.shape, self.embedding_dim)


def install_quantized(model: nn.Module, parts: dict[str, list[tuple[int, QuantTensor]]], tied: bool) -> None:
    """Replace each module named in parts (its rows as (row offset, blocks)) by a QuantLinear, or
    a QuantEmbedding for the token embedding (also the LM head when tied); device and dtype
    follow the module replaced, its bias carries over."""
    for path, pieces in parts.items():
        old = model.get_submodule(path)
        ref = next(old.parameters())
        device, dtype = ref.device, ref.dtype
        blocks = [qt for _, qt in sorted(pieces, key=lambda p: p[0])]
        parent, _, attr = path.rpartition(".")
        if isinstance(old, nn.Embedding):
            emb = QuantEmbedding(blocks[0], device, dtype)
            setattr(model.get_submodule(parent), attr, emb)
            if tied:
                model.lm_head = QuantLinear(blocks, None, device, dtype)
            continue
        bias = getattr(old, "bias", None)
        setattr(model.get_submodule(parent), attr, QuantLinear(blocks, bias, device, dtype))
    segments = [m for m in model.modules() if isinstance(m, BlockSegment)]
    if segments:  # one huge-page buffer, in the order decode reads them
        for seg, packed in zip(segments, quant_gemv_cpu.arena([s.packed for s in segments])):
            seg.packed = packed
