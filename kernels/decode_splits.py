"""How split-K decode attention is laid out: keys per tile and splits per request, for bf16 and
fp8 pools. Promises: every count is >= 1 and no split is shorter than a tile; the choice reads
host-side sizes only (no device sync)."""

from __future__ import annotations

import math

import torch

# Keys per tile: an fp8 pool's rows are half the bytes, and twice the keys per tile keep the loads
# in flight (H200, B=64 L=4096, best split counts: 172 us at 128 against 196 at 64; bf16 pools
# are best at 64)
BLOCK_N_BF16, BLOCK_N_FP8 = 64, 128
# Programs of the fp8 kernel an H200 SM holds at once: three stages of fp8 K and V tiles plus the
# float16 V tile take 73 KB of its 228 KB of shared memory
FP8_PROGRAMS_PER_SM = 3


def decode_block_n(k_buffer: torch.Tensor) -> int:
    return BLOCK_N_FP8 if k_buffer.dtype == torch.float8_e4m3fn else BLOCK_N_BF16


def choose_decode_splits(
    batch: int, num_kv_heads: int, max_len: int, num_sms: int, kv_dtype: torch.dtype
) -> int:
    """Split count for a pool of kv_dtype: choose_num_splits for bf16; for fp8, the fewest splits
    whose programs fill their last wave at least 90% (or make four waves or more). The fp8
    kernel's programs are long and few fit an SM, so a part-filled last wave idles most of the GPU
    for a whole program (H200, L=4096, B=64: 210 us at one split, 183 at two, 172 at three;
    benchmarks/results/kernels_h200_fp8_splits.json)."""
    if kv_dtype != torch.float8_e4m3fn:
        return choose_num_splits(batch, num_kv_heads, max_len, num_sms)
    if batch <= 0 or max_len <= 0:
        return 1
    programs, slots = batch * num_kv_heads, num_sms * FP8_PROGRAMS_PER_SM
    cap = max(1, min(64, max_len // BLOCK_N_FP8))
    for splits in range(1, cap + 1):
        waves = programs * splits / slots
        if waves >= 4 or waves / math.ceil(waves) >= 0.9:
            return splits
    return cap


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_len: int,
    num_sms: int = 132,
    block_n: int = BLOCK_N_BF16,
    min_per_split: int = 128,
    max_splits: int = 64,
) -> int:
    """Enough programs to fill the GPU about twice over, no split shorter than min_per_split: a
    lone long sequence needs many splits to occupy the SMs, a batch of 64 or more fills them with
    one (figures for Hq 32 / Hkv 8 / D 128: benchmarks/results/kernels_h200.json)."""
    if batch <= 0 or max_len <= 0:
        return 1
    want = math.ceil(2 * num_sms / (batch * num_kv_heads))
    cap = max(1, max_len // max(min_per_split, block_n))
    return int(max(1, min(want, cap, max_splits)))
