"""Numerical self-checks of every kernel against its torch reference on fresh random inputs,
shared by the CPU tests (under TRITON_INTERPRET=1, small shapes), the GPU tests and the H200
kernel benchmark (all shapes; it puts tests/ on its path). Each check returns records (label, relative error, bound); a record
passes when error <= bound (NaN never passes). Outputs are poisoned with NaN before each run."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from radixlm.backend.cascade_groups import make_cascade_plan
from radixlm.kernels.cascade_attention import cascade_decode_attention
from radixlm.kernels.decode_attention import decode_attention, decode_attention_ref
from radixlm.kernels.extend_attention import extend_attention, extend_attention_ref
from radixlm.kernels.kv_store import kv_store, kv_store_ref
from radixlm.kernels.merge_state import merge_splits, merge_splits_ref, merge_state, merge_state_ref
from radixlm.kernels.quant_gemv_int8x import Int8Row, quantize_x_int8
from radixlm.kernels.rmsnorm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_int8,
    rmsnorm_ref,
)
from radixlm.kernels.rotary import apply_rotary, build_cos_sin_cache, rotary_ref
from radixlm.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref, silu_mul_int8, silu_mul_ref

Record = tuple[str, float, float]
BOUND = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN if out has NaN)."""
    o, r = out.double().cpu(), ref.double().cpu()
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


def ref_dtype(device: torch.device | str) -> torch.dtype:
    return torch.float64 if torch.device(device).type == "cpu" else torch.float32


def paged_kv(
    seq_lens: list[int],
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: str,
    shared: list[int] | None = None,
    group_sizes: list[int] | None = None,
    extra_rows: int = 2,
):
    """Random K/V buffers and a req_to_token table whose rows hold random distinct slots;
    requests of a group share the slots of their first `shared` tokens. Rows are permuted."""
    group_sizes = group_sizes or [1] * len(seq_lens)
    shared = shared or [0] * len(group_sizes)
    n_slots = sum(seq_lens) + 8
    perm = torch.randperm(n_slots, device=device) + 1
    rows = torch.randperm(len(seq_lens) + extra_rows, device=device)[: len(seq_lens)]
    table = torch.zeros(len(seq_lens) + extra_rows, max(seq_lens) + 3, dtype=torch.int64, device=device)
    used, b = 0, 0
    for n, s in zip(group_sizes, shared):
        pre = perm[used : used + s]
        used += s
        for _ in range(n):
            own = seq_lens[b] - s
            table[rows[b], :s] = pre
            table[rows[b], s : seq_lens[b]] = perm[used : used + own]
            used, b = used + own, b + 1
    kb = torch.randn(n_slots + 1, hkv, d, dtype=dtype, device=device)
    vb = torch.randn(n_slots + 1, hkv, d, dtype=dtype, device=device)
    return kb, vb, table, rows


def check_decode(
    device: str,
    dtype: torch.dtype,
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    splits: list[int | None],
    block_n: int = 64,
) -> list[Record]:
    kb, vb, table, rows = paged_kv(seq_lens, hkv, d, dtype, device)
    lens = torch.tensor(seq_lens, device=device)
    q = torch.randn(len(seq_lens), hq, d, dtype=dtype, device=device)
    rd = ref_dtype(device)
    ref = decode_attention_ref(q.to(rd), kb.to(rd), vb.to(rd), table, rows, lens)
    name = f"decode {DTYPE_NAME[dtype]} B={len(seq_lens)} L<={max(seq_lens)} Hq{hq}/Hkv{hkv} D{d}"
    lse_bound = 1e-5 if dtype == torch.float32 else 1e-3
    return decode_records(q, kb, vb, table, rows, lens, ref, splits, block_n, name, BOUND[dtype], lse_bound)


def decode_records(
    q: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    ref: tuple[torch.Tensor, torch.Tensor],
    splits: list[int | None],
    block_n: int,
    name: str,
    bound: float,
    lse_bound: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> list[Record]:
    """decode_attention at each split count (output and lse, into a NaN-filled buffer) against
    ref = (out, lse): two records per split count, named `name splits=S`."""
    recs = []
    for s in splits:
        out = torch.full_like(q, float("nan"))
        o, lse = decode_attention(
            q,
            kb,
            vb,
            table,
            rows,
            lens,
            num_splits=s,
            max_len=int(lens.max()),
            out=out,
            return_lse=True,
            block_n=block_n,
            k_scale=k_scale,
            v_scale=v_scale,
        )
        tag = f"{name} splits={s}"
        recs.append((tag, rel_err(o, ref[0]), bound))
        recs.append((tag + " lse", rel_err(lse, ref[1]), lse_bound))
    return recs


def check_extend(
    device: str,
    dtype: torch.dtype,
    prefix_lens: list[int],
    extend_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    pack_gqa: bool = True,
) -> list[Record]:
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    kb, vb, table, rows = paged_kv(seq, hkv, d, dtype, device)
    t = sum(extend_lens)
    q = torch.randn(t, hq, d, dtype=dtype, device=device)
    kn = torch.randn(t, hkv, d, dtype=dtype, device=device)
    vn = torch.randn(t, hkv, d, dtype=dtype, device=device)
    pl = torch.tensor(prefix_lens, device=device)
    el = torch.tensor(extend_lens, device=device)
    starts = torch.cumsum(el, 0) - el
    rd = ref_dtype(device)
    ref = extend_attention_ref(
        q.to(rd), kn.to(rd), vn.to(rd), kb.to(rd), vb.to(rd), table, rows, pl, el, starts
    )
    out = torch.full_like(q, float("nan"))
    o = extend_attention(
        q,
        kn,
        vn,
        kb,
        vb,
        table,
        rows,
        pl,
        el,
        starts,
        max(extend_lens),
        out=out,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        pack_gqa=pack_gqa,
    )
    tag = (
        f"extend {DTYPE_NAME[dtype]} prefix={prefix_lens[:4]} extend={extend_lens[:4]} Hq{hq}/Hkv{hkv} D{d} "
        f"pack_gqa={pack_gqa}"
    )
    return [(tag, rel_err(o, ref), BOUND[dtype])]


CASCADE_VARIANTS: list[dict] = [
    {"impl": "fused"},
    {"impl": "fused", "shared_splits": 3, "own_splits": 2, "shared_first": False},
    {"impl": "two_launch", "fused_merge": True},
    {"impl": "two_launch", "fused_merge": False},
]


def check_cascade(
    device: str,
    dtype: torch.dtype,
    group_sizes: list[int],
    shared: list[int],
    own: list[int],
    hq: int,
    hkv: int,
    d: int,
    block_m: int = 64,
    block_n: int = 64,
    variants: list[dict] | None = None,
) -> list[Record]:
    """own: per-request own lengths. Reference: plain decode over each whole sequence. variants:
    keyword sets for cascade_decode_attention (impl, split counts, tiles), CASCADE_VARIANTS by default."""
    per_req_shared = [s for s, n in zip(shared, group_sizes) for _ in range(n)]
    seq = [s + o for s, o in zip(per_req_shared, own)]
    kb, vb, table, rows = paged_kv(seq, hkv, d, dtype, device, shared, group_sizes)
    lens = torch.tensor(seq, device=device)
    q = torch.randn(len(seq), hq, d, dtype=dtype, device=device)
    rd = ref_dtype(device)
    ref, _ = decode_attention_ref(q.to(rd), kb.to(rd), vb.to(rd), table, rows, lens)
    plan = make_cascade_plan(group_sizes, shared, seq, device)
    recs = []
    for kw in variants if variants is not None else CASCADE_VARIANTS:
        kw = {"block_m": block_m, "block_n": block_n} | kw
        o = cascade_decode_attention(q, kb, vb, table, rows, lens, plan, **kw)
        tag = (
            f"cascade {DTYPE_NAME[dtype]} groups={group_sizes[:4]} shared={shared[:4]} Hq{hq}/Hkv{hkv} D{d} "
            + " ".join(f"{k}={v}" for k, v in kw.items())
        )
        recs.append((tag, rel_err(o, ref), BOUND[dtype]))
    return recs


def _int8_row_mismatch(got: Int8Row, y: torch.Tensor) -> float:
    """Entries of got's arrays that differ from `quantize_x_int8(y)` (0 when the fused rounding
    is the standalone one, exactly)."""
    want = quantize_x_int8(y)
    pairs = [(got.q, want.q), (got.scales, want.scales), (got.offsets, want.offsets)]
    return float(sum(int((a != b).sum()) for a, b in pairs))


def check_int8_rows(device: str, dtype: torch.dtype, hidden: int, inter: int) -> list[Record]:
    """The norms and SiLU-and-mul that also round their one-row output to int8 for the next
    matmul: the output as the unrounded op's reference, the int8 row as `quantize_x_int8` of it."""
    bound, name = BOUND[dtype], DTYPE_NAME[dtype]
    x, r = (torch.randn(1, hidden, dtype=dtype, device=device) * 3 for _ in range(2))
    w = torch.randn(hidden, dtype=dtype, device=device)
    y, res, rounded = rmsnorm_int8(x, r, w, 1e-5)
    y_ref, res_ref = fused_add_rmsnorm_ref(x, r, w, 1e-5)
    y0, none, rounded0 = rmsnorm_int8(x, None, w, 1e-5)
    assert res is not None and none is None
    g, u = (torch.randn(1, inter, dtype=dtype, device=device) for _ in range(2))
    act, act_rounded = silu_mul_int8(g, u)
    return [
        (f"rmsnorm_int8 {name} out", rel_err(y, y_ref), bound),
        (f"rmsnorm_int8 {name} residual", rel_err(res, res_ref), bound),
        (f"rmsnorm_int8 {name} int8 row", _int8_row_mismatch(rounded, y), 0.0),
        (f"rmsnorm_int8 {name} no residual", rel_err(y0, rmsnorm_ref(x, w, 1e-5)), bound),
        (f"rmsnorm_int8 {name} no residual int8 row", _int8_row_mismatch(rounded0, y0), 0.0),
        (f"silu_mul_int8 {name} out", rel_err(act, silu_mul_ref(g, u)), bound),
        (f"silu_mul_int8 {name} int8 row", _int8_row_mismatch(act_rounded, act), 0.0),
    ]


def check_merge_splits(device: str, dtype: torch.dtype) -> list[Record]:
    """merge_splits at head counts that are not powers of two (12, 20, 3), with one split and with
    several, a row with every split empty and one with some."""
    recs = []
    for heads, splits in ((12, 1), (20, 1), (3, 1), (12, 5), (20, 17)):
        mid_o = torch.randn(3, heads, splits, 32, device=device)
        mid_lse = torch.randn(3, heads, splits, device=device) * 4
        mid_lse[0, heads - 1] = float("-inf")
        mid_lse[1, 0, : max(1, splits - 1)] = float("-inf")
        out = torch.empty(3, heads, 32, dtype=dtype, device=device)
        lse = torch.empty(3, heads, device=device)
        merge_splits(mid_o, mid_lse, out, lse)
        o_ref, lse_ref = merge_splits_ref(mid_o, mid_lse)
        finite = torch.isfinite(lse_ref)
        same_inf = bool((lse[~finite] == lse_ref[~finite]).all())
        tag = f"merge_splits {DTYPE_NAME[dtype]} heads={heads} splits={splits}"
        recs += [
            (f"{tag} out", rel_err(out, torch.nan_to_num(o_ref)), BOUND[dtype]),
            (f"{tag} lse", rel_err(lse[finite], lse_ref[finite]) + (0.0 if same_inf else math.inf), 1e-5),
        ]
    return recs


def check_pointwise(device: str, dtype: torch.dtype, rows: int = 7, hidden: int = 96) -> list[Record]:
    """RMSNorm (+ residual), SiLU-and-mul, merge_state, KV store."""
    bound = BOUND[dtype]
    name = DTYPE_NAME[dtype]
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    r = torch.randn(rows, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, dtype=dtype, device=device)
    y, res = fused_add_rmsnorm(x, r, w, 1e-5)
    y_ref, res_ref = fused_add_rmsnorm_ref(x, r, w, 1e-5)
    gu = torch.randn(rows, 2 * hidden + 2, dtype=dtype, device=device)
    recs = [
        (f"rmsnorm {name}", rel_err(rmsnorm(x, w), rmsnorm_ref(x, w)), bound),
        (f"fused_add_rmsnorm {name} out", rel_err(y, y_ref), bound),
        (f"fused_add_rmsnorm {name} residual", rel_err(res, res_ref), bound),
        (f"silu_and_mul {name}", rel_err(silu_and_mul(gu), silu_and_mul_ref(gu)), bound),
    ]
    oa, ob = (torch.randn(rows, 4, 32, device=device) for _ in range(2))
    la, lb = (torch.randn(rows, 4, device=device) * 5 for _ in range(2))
    la[0, 0] = float("-inf")
    la[1], lb[1] = float("-inf"), float("-inf")
    o, lse = merge_state(oa, la, ob, lb, return_lse=True)
    o_ref, lse_ref = merge_state_ref(oa, la, ob, lb)
    finite = torch.isfinite(lse_ref)
    same_inf = bool((lse[~finite] == lse_ref[~finite]).all())
    recs += [
        ("merge_state out", rel_err(o, o_ref), 1e-5),
        ("merge_state lse", rel_err(lse[finite], lse_ref[finite]) + (0.0 if same_inf else math.inf), 1e-5),
    ]
    recs += check_merge_splits(device, dtype)
    kb = torch.randn(40, 3, 16, dtype=dtype, device=device)
    vb = torch.randn(40, 3, 16, dtype=dtype, device=device)
    kb2, vb2 = kb.clone(), vb.clone()
    loc = torch.randperm(39, device=device)[:9] + 1
    k = torch.randn(9, 3, 16, dtype=dtype, device=device)
    v = torch.randn(9, 3, 16, dtype=dtype, device=device)
    kv_store(kb, vb, loc, k, v)
    kv_store_ref(kb2, vb2, loc, k, v)
    recs.append(
        (
            f"kv_store {name} (exact, untouched rows too)",
            float((kb - kb2).abs().max() + (vb - vb2).abs().max()),
            0.0,
        )
    )
    return recs


def check_rotary(
    device: str, dtype: torch.dtype, tokens: int = 6, hq: int = 4, hkv: int = 2, d: int = 32
) -> list[Record]:
    """Against our reference and, independently, HF's apply_rotary_pos_emb (fp32 math)."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    cache = build_cos_sin_cache(inv_freq, 256)
    q = torch.randn(tokens, hq, d, dtype=dtype, device=device)
    k = torch.randn(tokens, hkv, d, dtype=dtype, device=device)
    pos = torch.randint(0, 256, (tokens,), device=device)
    qo, ko = apply_rotary(q, k, pos, cache)
    qr, kr = rotary_ref(q, k, pos, cache)
    recs = [
        (f"rotary {DTYPE_NAME[dtype]} q", rel_err(qo, qr), BOUND[dtype]),
        (f"rotary {DTYPE_NAME[dtype]} k", rel_err(ko, kr), BOUND[dtype]),
    ]
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        return recs
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    hq_ref, hk_ref = apply_rotary_pos_emb(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], emb.cos()[None], emb.sin()[None]
    )
    recs += [
        (f"rotary {DTYPE_NAME[dtype]} q vs HF", rel_err(qo, hq_ref[0].transpose(0, 1)), BOUND[dtype]),
        (f"rotary {DTYPE_NAME[dtype]} k vs HF", rel_err(ko, hk_ref[0].transpose(0, 1)), BOUND[dtype]),
    ]
    return recs


def run(checks: list[Callable[[], list[Record]]]) -> list[Record]:
    out: list[Record] = []
    for c in checks:
        out += c()
    return out
