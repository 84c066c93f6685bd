"""Sampling on the device with no host sync: temperature, then top-k, top-p and min-p filters
(each judged on the temperature-scaled distribution, kept tokens = their intersection, as SGLang
does), then an exact draw from the renormalised kept mass by the exponential race
argmax(p_i / E_i), E_i ~ Exp(1). No sort: the top-k and top-p thresholds are found by binary
search over the float bit patterns. temperature <= 0 means greedy (first argmax). Promises:
with the same noise E, `sample` picks the same token as `sample_ref`."""

from __future__ import annotations

import torch

from ._triton import tl, triton, use_triton

_ONE_BITS = 0x3F800000  # bit pattern of 1.0f: every scaled probability e_i = exp((x_i - max) / T) <= 1


@triton.jit
def _mass_at_least(X, V, m, inv_t, thr, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """sum (or count) of e_i = exp((x_i - m) * inv_t) over e_i >= thr."""
    total = 0.0
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        e = tl.exp((x - m) * inv_t)
        keep = (e >= thr) & (offs < V)
        if COUNT:
            total += tl.sum(keep.to(tl.float32), 0)
        else:
            total += tl.sum(tl.where(keep, e, 0.0), 0)
    return total


@triton.jit
def _largest_threshold(X, V, m, inv_t, target, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """Largest float thr in [0, 1] with mass_at_least(thr) >= target (bisection on the bits)."""
    lo = 0
    hi = 0x3F800001
    for _ in range(31):
        mid = (lo + hi) // 2
        ok = _mass_at_least(X, V, m, inv_t, mid.to(tl.float32, bitcast=True), COUNT, BLOCK) >= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo.to(tl.float32, bitcast=True)


@triton.jit
def _sample_kernel(Logits, Noise, Temp, TopK, TopP, MinP, Out, stride_l, stride_n, V, seed,
                   HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X = Logits + row * stride_l
    best = float("-inf")
    best_i = 0
    for v0 in range(0, V, BLOCK):  # max logit and its first index
        offs = v0 + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 0)
        bi = tl.argmax(x, 0) + v0
        take = bm > best
        best_i = tl.where(take, bi, best_i)
        best = tl.where(take, bm, best)
    t = tl.load(Temp + row).to(tl.float32)
    if t > 0:
        inv_t = 1.0 / t
        thr = tl.load(MinP + row).to(tl.float32)  # e_max = 1, so min-p's threshold is min_p itself
        k = tl.load(TopK + row)
        if (k > 0) & (k < V):
            thr = tl.maximum(thr, _largest_threshold(X, V, best, inv_t, k.to(tl.float32), True, BLOCK))
        p = tl.load(TopP + row).to(tl.float32)
        if p < 1.0:
            need = p * _mass_at_least(X, V, best, inv_t, 0.0, False, BLOCK)
            thr = tl.maximum(thr, _largest_threshold(X, V, best, inv_t, need, False, BLOCK))
        thr = tl.minimum(thr, 1.0)  # the top token always survives
        race = -1.0
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            valid = offs < V
            x = tl.load(X + offs, mask=valid, other=float("-inf")).to(tl.float32)
            e = tl.exp((x - best) * inv_t)
            if HAS_NOISE:
                noise = tl.load(Noise + row * stride_n + offs, mask=valid, other=1.0)
            else:
                bits = tl.randint(seed, row * V + offs).to(tl.uint32) >> 8
                noise = -tl.log((bits.to(tl.float32) + 0.5) * 5.9604644775390625e-08)
            score = tl.where(valid & (e >= thr), e / noise, -1.0)
            bm = tl.max(score, 0)
            bi = tl.argmax(score, 0) + v0
            take = bm > race
            best_i = tl.where(take, bi, best_i)
            race = tl.where(take, bm, race)
    tl.store(Out + row, best_i.to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: int = 0, exp_noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V]; per-row temperature, top_k (<= 0 or >= V: off), top_p (>= 1: off), min_p
    (0: off) [B] → token ids [B] int64 on the device. exp_noise [B, V] (Exp(1) draws) makes the
    draw reproducible; otherwise in-kernel Philox noise from `seed` (vary it per step)."""
    _check(logits, temperature, top_k, top_p, min_p, exp_noise)
    if not use_triton(logits):
        return sample_ref(logits, temperature, top_k, top_p, min_p, exp_noise)
    bsz, vocab = logits.shape
    out = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    if bsz:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        noise = exp_noise.float().contiguous() if exp_noise is not None else logits
        _sample_kernel[(bsz,)](
            logits, noise, temperature, top_k, top_p, min_p, out, logits.stride(0), noise.stride(0), vocab,
            seed, HAS_NOISE=exp_noise is not None, BLOCK=min(4096, triton.next_power_of_2(vocab)), num_warps=8)
    return out


def _check(logits: torch.Tensor, *per_row: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got {tuple(logits.shape)}")
    for t in per_row[:4]:
        if t is None or t.shape != (logits.shape[0],):
            raise ValueError(f"sampling parameters must be [B] = [{logits.shape[0]}] tensors")
    noise = per_row[4]
    if noise is not None and noise.shape != logits.shape:
        raise ValueError(f"exp_noise shape {tuple(noise.shape)} != logits shape {tuple(logits.shape)}")


def sample_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, exp_noise: torch.Tensor | None = None) -> torch.Tensor:
    """Sort-based torch reference (float64), the same race on the same noise."""
    x = logits.double()
    bsz, vocab = x.shape
    if exp_noise is None:
        exp_noise = torch.empty_like(x).exponential_()
    greedy = x.argmax(-1)
    t = temperature.double().clamp_min(1e-30)[:, None]
    e = torch.exp((x - x.max(-1, keepdim=True).values) / t)
    srt = e.sort(-1, descending=True).values
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    kth = srt.gather(1, (k - 1)[:, None])
    before = srt.cumsum(-1) - srt  # mass strictly ahead of each sorted token
    kept_sorted = before < top_p.double()[:, None] * e.sum(-1, keepdim=True)
    p_thr = torch.where(kept_sorted, srt, torch.inf).min(-1, keepdim=True).values
    p_thr = torch.where(top_p.double()[:, None] < 1.0, p_thr, 0.0)
    thr = torch.maximum(torch.maximum(kth, p_thr), min_p.double()[:, None]).clamp_max(1.0)
    score = torch.where(e >= thr, e / exp_noise.double(), -1.0)
    drawn = score.argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)
