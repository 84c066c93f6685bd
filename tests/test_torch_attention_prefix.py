"""The CPU attention path's extend over a cached prefix: prefix_then_causal (the prefix and the new
tokens attended apart, merged by log-sum-exp) against a float64 masked-softmax reference, across
GQA groupings, dtypes and prefix/extend sizes, and TorchAttentionBackend taking it only from
prefix_split_min_tokens new tokens on."""

from __future__ import annotations

import pytest
import torch

import radixlm.backend.attention as attention
from radixlm.backend.attention import TorchAttentionBackend, prefix_then_causal
from radixlm.backend.forward_batch import ForwardBatch


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """Softmax attention in float64 with query i seeing keys 0..prefix+i (GQA by repetition)."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    seq = k.shape[2]
    scores = q64 @ k64.transpose(-1, -2) / q.shape[-1] ** 0.5
    visible = torch.arange(seq).unsqueeze(0) <= torch.arange(prefix, seq).unsqueeze(1)
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hq", "hkv"), [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize(("prefix", "n"), [(1, 1), (5, 40), (300, 17), (64, 300)])
def test_prefix_then_causal_matches_the_masked_reference(dtype, hq, hkv, prefix, n) -> None:
    g = torch.Generator().manual_seed(prefix * 1000 + n + hq)
    d = 32
    q = torch.randn(1, hq, n, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, prefix + n, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, prefix + n, d, generator=g).to(dtype)
    out = prefix_then_causal(q, k, v, prefix)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference(q, k, v, prefix), rtol=tol, atol=tol)


class _Pool:
    """Enough of KVPool for one layer: plain buffers, no scales."""

    def __init__(self, slots: int, hkv: int, d: int) -> None:
        self.k_buffers = [torch.zeros(slots, hkv, d)]
        self.v_buffers = [torch.zeros(slots, hkv, d)]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer][loc], self.v_buffers[layer][loc] = k, v

    def scales(self, layer: int) -> tuple[None, None]:
        return None, None


@pytest.mark.parametrize(("least", "takes_split"), [(None, False), (64, True), (65, False)])
def test_backend_takes_the_split_from_its_threshold(monkeypatch, least, takes_split) -> None:
    """Two requests in one extend: a 64-token extend over a 40-token prefix and a fresh 8-token
    prompt; the split runs only for the first and only when the threshold allows, and the output
    equals the reference either way."""
    hq, hkv, d = 6, 2, 16
    lens = [(40, 64), (0, 8)]  # (prefix, new tokens) per request
    pool = _Pool(200, hkv, d)
    g = torch.Generator().manual_seed(3)
    table = torch.zeros(2, 120, dtype=torch.int64)
    table[0, :104] = torch.arange(104)
    table[1, :8] = torch.arange(104, 112)
    cached = torch.randn(40, hkv, d, generator=g)  # the first request's prefix K (V: half of it)
    pool.k_buffers[0][:40], pool.v_buffers[0][:40] = cached, cached * 0.5
    fb = ForwardBatch.__new__(ForwardBatch)
    fb.req_pool_indices_cpu, fb.req_to_token = [0, 1], table
    fb.prefix_lens_cpu, fb.extend_lens_cpu = [p for p, _ in lens], [n for _, n in lens]
    fb.seq_lens_cpu, fb.extend_start_loc_cpu = [p + n for p, n in lens], [0, 64]
    fb.kv_pool, fb.is_decode = pool, False
    fb.out_cache_loc = torch.cat([torch.arange(40, 104), torch.arange(104, 112)])
    q, k, v = (torch.randn(72, h, d, generator=g) for h in (hq, hkv, hkv))
    calls: list[int] = []  # new-token counts of the extends that took the split

    def counted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor | None:
        calls.append(q.shape[2])
        return prefix_then_causal(q, k, v, prefix)

    monkeypatch.setattr(attention, "prefix_then_causal", counted)
    out = TorchAttentionBackend(prefix_split_min_tokens=least).forward(q, k, v, 0, fb).view(72, hq, d)
    assert calls == ([64] if takes_split else [])
    for (prefix, n), start, row in zip(lens, [0, 64], [0, 1]):
        slots = table[row, : prefix + n]
        kk = pool.k_buffers[0][slots].transpose(0, 1).unsqueeze(0)
        vv = pool.v_buffers[0][slots].transpose(0, 1).unsqueeze(0)
        want = reference(q[start : start + n].transpose(0, 1).unsqueeze(0), kk, vv, prefix)
        torch.testing.assert_close(
            out[start : start + n].double(), want[0].transpose(0, 1), rtol=1e-5, atol=1e-5
        )
