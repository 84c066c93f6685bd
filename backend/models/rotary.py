"""Rotary position embedding: cos/sin tables (plain, linear, llama3 and per-frequency factor
scaling) and their application in the HF rotate-half layout."""

from __future__ import annotations

import math
from typing import Any

import torch

from radixlm.kernels.rotary import apply_rotary, rotary_and_store


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

    def build(self, device: torch.device | str) -> None:
        """Compute the tables (after the module is materialised on its device)."""
        inv = inv_frequencies(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.float64)
        emb = torch.cat([torch.outer(t, inv)] * 2, dim=-1)
        self.cos = emb.cos().float().to(device)
        self.sin = emb.sin().float().to(device)
        half = self.head_dim // 2  # radixlm.kernels.rotary's cache: cos half | sin half
        self.cos_sin = torch.cat([self.cos[:, :half], self.sin[:, :half]], dim=-1).contiguous()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] → rotated (same dtype)."""
        if q.is_cuda:  # one Triton launch for q and k (same fp32 math, one rounding)
            return apply_rotary(q, k, positions, self.cos_sin)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotate_and_store(
    rope: RotaryEmbedding,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
) -> torch.Tensor:
    """Decode on CUDA: rotated q; rotated k and v written into the pool rows loc (one launch)."""
    return rotary_and_store(q, k, v, positions, rope.cos_sin, k_buffer, v_buffer, loc)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
