"""Small CPU steps of a GGUF Llama through one C call over all decoder layers
(radixlm.kernels.cpu_decode.decode_layers): a few new tokens of one or more requests (decode
batches, verify steps, short prompts). At the default model's size such a step is bound by
per-op Python dispatch as much as by weight bytes. The call runs the C pieces the modules run for
one request (block matmul, add + RMSNorm, rope + KV store + attention, SiLU-and-mul), each row as
it would run alone, so a one-request step gives the modules' bits and a batch's rows give their
requests' bits alone. It applies where every projection is one bias-free GGUF-block segment,
norms and KV pool are float32, with no q/k norm and no tensor parallel, and the step has at most
quant_gemv_cpu.GEMV_PASSES_MAX_ROWS rows. Past cpu_decode.MAX_ROWS it runs in passes of that many
rows, in order: a pass's tokens attend to the KV the passes before it stored."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from radixlm.kernels import cpu_decode, quant_gemv_cpu

from ..attention import TorchAttentionBackend
from ..forward_batch import ForwardBatch
from ..kv_pool import KVPool
from ..quant_linear import BlockSegment, QuantLinear
from .rotary import RotaryEmbedding


class _Norm(Protocol):
    @property
    def weight(self) -> torch.Tensor: ...
    @property
    def eps(self) -> float: ...


class _Attention(Protocol):
    @property
    def qkv_proj(self) -> nn.Module: ...
    @property
    def o_proj(self) -> nn.Module: ...
    @property
    def q_norm(self) -> nn.Module | None: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class _MLP(Protocol):
    @property
    def gate_up_proj(self) -> nn.Module: ...
    @property
    def down_proj(self) -> nn.Module: ...


class DecoderLayer(Protocol):
    """What the C call reads of a decoder layer (models/llama.py's LlamaDecoderLayer)."""

    @property
    def self_attn(self) -> _Attention: ...
    @property
    def mlp(self) -> _MLP: ...
    @property
    def input_layernorm(self) -> _Norm: ...
    @property
    def post_attention_layernorm(self) -> _Norm: ...
    @property
    def tp_size(self) -> int: ...


def _block_weight(layer: nn.Module) -> BlockSegment | None:
    """The layer's one GGUF-block segment, or None where it has a bias or other paths."""
    if not isinstance(layer, QuantLinear) or layer.bias is not None or len(layer.segments) != 1:
        return None
    seg = layer.segments[0]
    return seg if isinstance(seg, BlockSegment) else None


def _projections(layer: DecoderLayer) -> list[BlockSegment] | None:
    """qkv, o, gate_up, down as GGUF-block segments, or None where one is not."""
    a, m = layer.self_attn, layer.mlp
    segs = [_block_weight(p) for p in (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)]
    return None if any(s is None for s in segs) else [s for s in segs if s is not None]


def _shape(layer: DecoderLayer) -> cpu_decode.DecodeShape | None:
    """The layer's sizes, or None where it takes a path the C call does not have (q/k norm,
    tensor parallel, odd head size, norms not float32 on the CPU, projections not GGUF blocks,
    widths that do not line up)."""
    a, norm = layer.self_attn, layer.input_layernorm
    segs = _projections(layer)
    norms = (norm.weight, layer.post_attention_layernorm.weight)
    if segs is None or layer.tp_size != 1 or a.q_norm is not None or a.head_dim % 2:
        return None
    if any(w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 1 for w in norms):
        return None
    hidden, (hq, hkv, d), inter = (
        norm.weight.shape[0],
        (a.num_heads, a.num_kv_heads, a.head_dim),
        segs[3].cols,
    )
    widths = [(s.rows, s.cols) for s in segs]
    if widths != [((hq + 2 * hkv) * d, hidden), (hidden, hq * d), (2 * inter, hidden), (hidden, inter)]:
        return None
    return cpu_decode.DecodeShape(
        hidden=hidden, inter=inter, hq=hq, hkv=hkv, d=d, eps=norm.eps, scale=d**-0.5
    )


class CpuDecodeLayers:
    """The layers' weights as the C call's table, built once; the KV pool's buffers are filled in
    when a step brings a pool other than the last one."""

    def __init__(
        self, layers: Sequence[DecoderLayer], shape: cpu_decode.DecodeShape, rope: RotaryEmbedding
    ) -> None:
        self.rope, self.layers, self.shape = rope, layers, shape
        # threads past one per 64 output rows of the narrowest matmul cost more in hand-offs
        self.max_threads = max(1, shape.hidden // 64)
        self.table = (cpu_decode.DecodeLayer * len(layers))()
        for entry, layer in zip(self.table, layers):
            entry.attn_norm = layer.input_layernorm.weight.data_ptr()
            entry.mlp_norm = layer.post_attention_layernorm.weight.data_ptr()
            segs = _projections(layer)
            assert segs is not None
            for name, seg in zip(("qkv", "o", "gate_up", "down"), segs):
                setattr(entry, name, seg.packed.data_ptr())
                setattr(entry, f"{name}_fmt", cpu_decode.format_index(seg.qtype))
        self._pool: KVPool | None = None  # the pool whose buffers the table holds

    @staticmethod
    def build(layers: Sequence[DecoderLayer], rope: RotaryEmbedding) -> CpuDecodeLayers | None:
        """The plan, or None where some layer takes a path the C call does not have."""
        shapes = [_shape(layer) for layer in layers]
        first = shapes[0] if shapes else None
        if first is None or any(s is None or bytes(s) != bytes(first) for s in shapes):
            return None
        return CpuDecodeLayers(layers, first, rope) if cpu_decode.available() else None

    def accepts(self, fb: ForwardBatch, h: torch.Tensor) -> bool:
        """Whether this step has few enough new tokens, over a float32 pool the torch attention
        backend reads."""
        pool, rows = fb.kv_pool, h.shape[0]
        return (
            rows <= quant_gemv_cpu.GEMV_PASSES_MAX_ROWS
            and h.dtype == torch.float32
            and fb.req_to_token.dtype == fb.out_cache_loc.dtype == torch.int64
            and fb.req_to_token.is_contiguous()
            and isinstance(fb.attn_backend, TorchAttentionBackend)
            and pool.dtype == torch.float32  # its buffers are made contiguous, one per layer
            and len(pool.k_buffers) == len(pool.v_buffers) == len(self.layers)
        )

    def run(self, fb: ForwardBatch, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(last layer's output, the residual stream before it) for the embedding rows h."""
        self._bind_pool(fb)
        h = h.contiguous().clone()
        residual = torch.empty_like(h)
        cos, sin_signed = self.rope.rows(fb.positions)
        table = fb.req_to_token
        row_bytes = table.stride(0) * table.element_size()
        starts = [table.data_ptr() + i * row_bytes for i in fb.req_pool_indices_cpu]
        row_slots: list[int] = []
        row_lens: list[int] = []
        for start, seq_len, new in zip(starts, fb.seq_lens_cpu, fb.extend_lens_cpu):
            row_slots += [start] * new  # a request's new tokens: causal among themselves
            row_lens += range(seq_len - new + 1, seq_len + 1)
        n = h.shape[0]
        threads = cpu_decode.team_threads(self.max_threads)
        out_slots = fb.out_cache_loc.contiguous()
        for a in range(0, n, cpu_decode.MAX_ROWS):
            b = min(a + cpu_decode.MAX_ROWS, n)
            cpu_decode.decode_layers(
                self.table, self.shape, h[a:b], residual[a:b], cos[a:b], sin_signed[a:b],
                out_slots[a:b], row_slots[a:b], row_lens[a:b], threads,
            )  # fmt: skip
        return h, residual

    def _bind_pool(self, fb: ForwardBatch) -> None:
        """The pool's buffers into the table: a pool makes its buffers once, so once per pool."""
        pool = fb.kv_pool
        if pool is self._pool:
            return
        for entry, k, v in zip(self.table, pool.k_buffers, pool.v_buffers):
            entry.k, entry.v = k.data_ptr(), v.data_ptr()
        self._pool = pool
