"""Rotary position embedding: cos/sin tables (plain, linear, llama3 and per-frequency factor
scaling) and their application in the HF rotate-half layout; for decode, fused with the KV store
(and, for a GGUF qkv weight, with the projection itself)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from radixlm.kernels.rotary import apply_rotary, rotary_and_store

from ..quant_linear import QuantLinear

if TYPE_CHECKING:
    from ..forward_batch import ForwardBatch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv, scaling)
    if kind == "freq_factors":  # llama.cpp's rope_freqs: one divisor per inverse frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float64)
        if factors.shape != inv.shape:
            raise ValueError(
                f"rope_freqs has {factors.numel()} factors, head_dim {head_dim} needs {inv.numel()}"
            )
        return inv / factors
    raise ValueError(
        f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, freq_factors)"
    )


def _llama3_scale(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin [max_positions, head_dim] in float32; applied per token position."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)
        self.cos_sin = torch.empty(0)
        self.sin_signed = torch.empty(0)
        self._step: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def build(self, device: torch.device | str) -> None:
        """Compute the tables (after the module is materialised on its device)."""
        inv = inv_frequencies(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.float64)
        emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
        self.cos = emb.cos().float().to(device)
        self.sin = emb.sin().float().to(device)
        half = self.head_dim // 2  # radixlm.kernels.rotary's cache: cos half | sin half
        self.cos_sin = torch.cat([self.cos[:, :half], self.sin[:, :half]], dim=-1).contiguous()
        # sin with the first half negated: rotate-half becomes a swap of halves times this
        self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1).contiguous()

    @contextmanager
    def step(self, positions: torch.Tensor) -> Iterator[None]:
        """Within the block, rotations at exactly these positions reuse one gather of the CPU
        tables (every layer of a step rotates at the same positions)."""
        if positions.is_cuda:
            yield
            return
        self._step = (positions, *self._gather(positions))
        try:
            yield
        finally:
            self._step = None

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin_signed rows [T, D] of a step's positions (contiguous)."""
        if self._step is not None and self._step[0] is positions:
            return self._step[1][:, 0], self._step[2][:, 0]
        return self.cos[positions], self.sin_signed[positions]

    def _gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._step is not None and self._step[0] is positions:
            return self._step[1], self._step[2]
        return self._gather(positions)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (any heads, e.g. q and k side by side) rotated on the CPU (same dtype)."""
        return _rotate(x, *self._tables(positions))

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] → rotated (same dtype)."""
        if q.is_cuda:  # one Triton launch for q and k (same fp32 math, one rounding)
            return apply_rotary(q, k, positions, self.cos_sin)
        cos, sin_signed = self._tables(positions)
        return _rotate(q, cos, sin_signed), _rotate(k, cos, sin_signed)


def rotate_and_store(
    rope: RotaryEmbedding,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode on CUDA: rotated q; rotated k and v written into the pool rows loc (one launch;
    an fp8 pool's rows quantized with k_scale / v_scale)."""
    return rotary_and_store(q, k, v, positions, rope.cos_sin, k_buffer, v_buffer, loc, k_scale, v_scale)


def project_rotate_and_store(
    rope: RotaryEmbedding,
    qkv_proj: torch.nn.Module,
    positions: torch.Tensor,
    x: torch.Tensor,
    fb: ForwardBatch,
    layer: int,
    heads: tuple[int, int, int],
) -> torch.Tensor | None:
    """Decode on CUDA, one row: rotated q, with rotated k and v written into the pool, from the
    qkv projection's own launch where it is a GGUF matmul that can do both (`QuantLinear.
    rope_store_row`); None otherwise (the caller projects, then `rotate_and_store`)."""
    if not isinstance(qkv_proj, QuantLinear):
        return None
    pool = fb.kv_pool
    kv = (pool.k_buffers[layer], pool.v_buffers[layer], fb.out_cache_loc)
    return qkv_proj.rope_store_row(x, heads, positions, rope.cos_sin, kv, pool.store_scales(layer))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF rotate-half, x * cos + [-x2, x1] * sin, as x * cos + [x2, x1] * sin_signed (the same
    products, three ops)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    swapped = xf.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    return torch.addcmul(xf * cos, swapped, sin_signed).to(x.dtype)
