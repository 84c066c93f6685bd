"""Numerical checks of the fp8 (e4m3) KV cache, shared by the CPU tests (Triton interpreter, small
shapes) and the GPU tests (model shapes): every pool writer against the quantization rule written
out here, and every pool reader against the plain-torch references run on the pool dequantized
here (fp8 → float64 × per-head scale), never through the code under test. Records are (label,
error, bound) as in kernel_checks; a record passes when error <= bound (NaN never passes)."""

from __future__ import annotations

import torch
from kernel_checks import BOUND, DTYPE_NAME, Record, decode_records, paged_kv, ref_dtype, rel_err

from radixlm.backend.cascade_groups import make_cascade_plan
from radixlm.kernels.cascade_attention import cascade_decode_attention
from radixlm.kernels.decode_attention import decode_attention_ref
from radixlm.kernels.extend_attention import extend_attention, extend_attention_ref
from radixlm.kernels.kv_store import kv_store
from radixlm.kernels.rotary import build_cos_sin_cache, rotary_and_store, rotary_ref


def bound(dtype: torch.dtype, unit: bool) -> float:
    """kernel_checks' bound, doubled where per-head scales are folded into q: q is rounded once
    more in its own dtype (bf16 over an 8192-token prefix measured 1.1e-2 against 1e-2)."""
    return BOUND[dtype] * (1 if unit else 2)


F8 = torch.float8_e4m3fn


def expected_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The storage rule, spelled out: (x / scale).clamp(-448, 448) as e4m3, scale per KV head."""
    return (x.float() / scale.float().view(-1, 1)).clamp(-448.0, 448.0).to(F8)


def deq(buf: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 buffer [S, Hkv, D] as the real values it stands for, in dtype."""
    s = torch.ones(buf.shape[1], device=buf.device) if scale is None else scale
    return (buf.double() * s.double().view(-1, 1)).to(dtype)


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> float:
    """How many fp8 entries differ bit for bit (0 = exact)."""
    return float((a.view(torch.uint8) != b.view(torch.uint8)).sum())


def head_scales(hkv: int, device: str, unit: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head K / V scales far from 1 and from each other (or all 1)."""
    if unit:
        one = torch.ones(hkv, dtype=torch.float32, device=device)
        return one, one.clone()
    ks = torch.tensor([0.02 * 3.0**i for i in range(hkv)], dtype=torch.float32, device=device)
    vs = torch.tensor([0.5 / 2.0**i for i in range(hkv)], dtype=torch.float32, device=device)
    return ks, vs


def fp8_pool(
    seq_lens: list[int],
    hkv: int,
    d: int,
    device: str,
    unit: bool,
    shared: list[int] | None = None,
    group_sizes: list[int] | None = None,
):
    """paged_kv's buffers and table, the values sized to their head's scale (so the e4m3 range
    matters: a scale that were ignored would change the result), then quantized."""
    kb, vb, table, rows = paged_kv(seq_lens, hkv, d, torch.float32, device, shared, group_sizes)
    ks, vs = head_scales(hkv, device, unit)
    k8 = expected_fp8(kb * 40 * ks.view(-1, 1), ks)
    v8 = expected_fp8(vb * 40 * vs.view(-1, 1), vs)
    return k8, v8, ks, vs, table, rows


def _tag(kind: str, dtype: torch.dtype, unit: bool, shape: str) -> str:
    return f"fp8 {kind} q {DTYPE_NAME[dtype]} {'unit' if unit else 'per-head'} scales {shape}"


def check_decode_fp8(
    device: str,
    dtype: torch.dtype,
    seq_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    splits: list[int | None],
    unit: bool = False,
    block_n: int = 64,
) -> list[Record]:
    k8, v8, ks, vs, table, rows = fp8_pool(seq_lens, hkv, d, device, unit)
    lens = torch.tensor(seq_lens, device=device)
    q = torch.randn(len(seq_lens), hq, d, dtype=dtype, device=device)
    rd = ref_dtype(device)
    ref = decode_attention_ref(q.to(rd), deq(k8, ks, rd), deq(v8, vs, rd), table, rows, lens)
    name = _tag("decode", dtype, unit, f"B={len(seq_lens)} Hq{hq}/Hkv{hkv} D{d}")
    lse_bound = 1e-5 if dtype == torch.float32 else 2e-3
    scales = {} if unit else {"k_scale": ks, "v_scale": vs}
    return decode_records(
        q, k8, v8, table, rows, lens, ref, splits, block_n, name, bound(dtype, unit), lse_bound, **scales
    )


def check_extend_fp8(
    device: str,
    dtype: torch.dtype,
    prefix_lens: list[int],
    extend_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    unit: bool = False,
    **tiles: int,
) -> list[Record]:
    """Cached and new K/V both fp8 under one scale per head (what the backend passes)."""
    seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k8, v8, ks, vs, table, rows = fp8_pool(seq, hkv, d, device, unit)
    t = sum(extend_lens)
    q = torch.randn(t, hq, d, dtype=dtype, device=device)
    kn = expected_fp8(torch.randn(t, hkv, d, device=device) * 40 * ks.view(-1, 1), ks)
    vn = expected_fp8(torch.randn(t, hkv, d, device=device) * 40 * vs.view(-1, 1), vs)
    pl, el = torch.tensor(prefix_lens, device=device), torch.tensor(extend_lens, device=device)
    starts = torch.cumsum(el, 0) - el
    rd = ref_dtype(device)
    ref = extend_attention_ref(
        q.to(rd),
        deq(kn, ks, rd),
        deq(vn, vs, rd),
        deq(k8, ks, rd),
        deq(v8, vs, rd),
        table,
        rows,
        pl,
        el,
        starts,
    )
    out = torch.full_like(q, float("nan"))
    o = extend_attention(
        q,
        kn,
        vn,
        k8,
        v8,
        table,
        rows,
        pl,
        el,
        starts,
        max(extend_lens),
        out=out,
        k_scale=None if unit else ks,
        v_scale=None if unit else vs,
        **tiles,
    )
    tag = _tag(
        "extend", dtype, unit, f"prefix={prefix_lens[:4]} extend={extend_lens[:4]} Hq{hq}/Hkv{hkv} D{d}"
    )
    return [(tag, rel_err(o, ref), bound(dtype, unit))]


def check_cascade_fp8(
    device: str,
    dtype: torch.dtype,
    group_sizes: list[int],
    shared: list[int],
    own: list[int],
    hq: int,
    hkv: int,
    d: int,
    variants: list[dict],
    unit: bool = False,
) -> list[Record]:
    """Reference: plain decode over each whole (dequantized) sequence."""
    per_req = [s for s, n in zip(shared, group_sizes) for _ in range(n)]
    seq = [s + o for s, o in zip(per_req, own)]
    k8, v8, ks, vs, table, rows = fp8_pool(seq, hkv, d, device, unit, shared, group_sizes)
    lens = torch.tensor(seq, device=device)
    q = torch.randn(len(seq), hq, d, dtype=dtype, device=device)
    rd = ref_dtype(device)
    ref, _ = decode_attention_ref(q.to(rd), deq(k8, ks, rd), deq(v8, vs, rd), table, rows, lens)
    plan = make_cascade_plan(group_sizes, shared, seq, device)
    recs = []
    for kw in variants:
        o = cascade_decode_attention(
            q,
            k8,
            v8,
            table,
            rows,
            lens,
            plan,
            k_scale=None if unit else ks,
            v_scale=None if unit else vs,
            **kw,
        )
        tag = _tag("cascade", dtype, unit, f"groups={group_sizes[:4]} shared={shared[:4]} {kw}")
        recs.append((tag, rel_err(o, ref), bound(dtype, unit)))
    return recs


def check_store_fp8(
    device: str, dtype: torch.dtype, tokens: int = 9, hkv: int = 3, d: int = 16
) -> list[Record]:
    """kv_store and rotary_and_store into fp8 buffers: bit-exact to the rule (values past ±448 ×
    scale included, so the clamp is exercised), rows not written untouched."""
    ks, vs = head_scales(hkv, device, unit=False)
    n_slots = 2 * tokens + 8  # slot 0 and half the rest never written
    loc = torch.randperm(n_slots - 1, device=device)[:tokens] + 1
    k = torch.randn(tokens, hkv, d, device=device) * 200 * ks.view(-1, 1)
    v = torch.randn(tokens, hkv, d, device=device) * 200 * vs.view(-1, 1)
    k[0, 0, :3] = torch.tensor([1e4, -1e4, 0.0], device=device) * ks[0]  # beyond the e4m3 range
    k, v = k.to(dtype), v.to(dtype)
    recs = []
    name = DTYPE_NAME[dtype]
    kb = torch.randn(n_slots, hkv, d, device=device).to(F8)
    vb = torch.randn(n_slots, hkv, d, device=device).to(F8)
    kb0, vb0 = kb.clone(), vb.clone()
    kv_store(kb, vb, loc, k, v, ks, vs)
    keep = torch.ones(n_slots, dtype=torch.bool, device=device)
    keep[loc] = False
    recs.append((f"kv_store fp8 from {name}: K bits off", bits_differ(kb[loc], expected_fp8(k, ks)), 0.0))
    recs.append((f"kv_store fp8 from {name}: V bits off", bits_differ(vb[loc], expected_fp8(v, vs)), 0.0))
    recs.append(
        (
            f"kv_store fp8 {name}: other rows",
            bits_differ(kb[keep], kb0[keep]) + bits_differ(vb[keep], vb0[keep]),
            0,
        )
    )
    # rotary_and_store: the same rotation into a pool in k's dtype gives the rotated k the fp8
    # store must quantize (same kernel arithmetic up to that rounding); q is checked against rotary_ref.
    hq = 2 * hkv
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    cache = build_cos_sin_cache(inv_freq, 64)
    q = torch.randn(tokens, hq, d, dtype=dtype, device=device)
    pos = torch.randint(0, 64, (tokens,), device=device)
    kw, vw = (
        torch.zeros(n_slots, hkv, d, dtype=dtype, device=device),
        torch.zeros(n_slots, hkv, d, dtype=dtype, device=device),
    )
    rotary_and_store(q, k, v, pos, cache, kw, vw, loc)
    kb, vb = kb0.clone(), vb0.clone()
    qo = rotary_and_store(q, k, v, pos, cache, kb, vb, loc, ks, vs)
    qr, kr = rotary_ref(q, k, pos, cache)
    recs += [
        (f"rotary_and_store fp8 {name}: K bits off", bits_differ(kb[loc], expected_fp8(kw[loc], ks)), 0.0),
        (f"rotary_and_store fp8 {name}: V bits off", bits_differ(vb[loc], expected_fp8(v, vs)), 0.0),
        (f"rotary_and_store fp8 {name}: other rows", bits_differ(kb[keep], kb0[keep]), 0.0),
        (f"rotary_and_store fp8 {name}: q", rel_err(qo, qr), BOUND[dtype]),
        (f"rotary_and_store fp8 {name}: rotated k", rel_err(kw[loc], kr), BOUND[dtype]),
    ]
    return recs


def check_backend_fp8(device: str, dtype: torch.dtype, backend_name: str, unit: bool = False) -> list[Record]:
    """An attention backend on an fp8 KVPool with per-head scales over the forked workload
    (tests/forked_steps.py): extend, mixed extend, decode, cascade decode, mixed; backend_name
    "triton_split" runs mixed steps' leading decode rows through decode attention. Reference: attention
    (float64) over each request's history of its K/V quantized by the rule and dequantized here;
    the pool rows must hold exactly the quantized K/V."""
    from forked_steps import FORK_LEN, causal_ref, forked_steps

    from radixlm.backend.attention import TorchAttentionBackend
    from radixlm.backend.attention_triton import TritonAttentionBackend
    from radixlm.backend.kv_pool import KVPool

    hq, hkv, d = 8, 2, 32
    pool = KVPool(1, 100, hkv, d, F8, device)
    ks, vs = head_scales(hkv, device, unit)
    if not unit:
        pool.set_scales(ks.cpu(), vs.cpu())
    backend = {
        "triton": lambda: TritonAttentionBackend(mixed_decode_min_rows=None),
        "triton_split": lambda: TritonAttentionBackend(mixed_decode_min_rows=1),
        "torch": TorchAttentionBackend,
    }[backend_name]()
    hist: list[list] = [[], [], []]
    recs: list[Record] = []
    for st in forked_steps(pool, backend, device):
        if st.index == 1:
            hist[1], hist[2] = list(hist[0][:FORK_LEN]), list(hist[0][:FORK_LEN])
        t = st.tokens
        q = torch.randn(t, hq, d, dtype=dtype, device=device)
        k = (torch.randn(t, hkv, d, device=device) * 40 * ks.view(-1, 1)).to(dtype)
        v = (torch.randn(t, hkv, d, device=device) * 40 * vs.view(-1, 1)).to(dtype)
        out = backend.forward(q, k, v, 0, st.fb)
        k8, v8 = expected_fp8(k, ks), expected_fp8(v, vs)
        ref = torch.empty(t, hq, d, dtype=torch.float64)
        for r, p, e, s0 in zip(st.reqs, st.prefix, st.ext, st.starts):
            hist[r] += [(k8[s0 + j], v8[s0 + j]) for j in range(e)]
            kk = deq(torch.stack([x for x, _ in hist[r]]), ks, torch.float64).cpu()
            vv = deq(torch.stack([y for _, y in hist[r]]), vs, torch.float64).cpu()
            ref[s0 : s0 + e] = causal_ref(q[s0 : s0 + e], kk, vv, p)
        tag = _tag(f"{backend_name} backend step {st.index} {st.mode or ''}", dtype, unit, "")
        if backend_name == "triton_split" and not st.fb.is_decode and st.ext[0] == 1:
            assert st.fb.mixed_split is not None, f"{tag}: the mixed step ran unsplit"
        recs.append((tag, rel_err(out.view(t, hq, d), ref), BOUND[dtype]))
        stored = bits_differ(pool.k_buffers[0][st.slots], k8) + bits_differ(pool.v_buffers[0][st.slots], v8)
        recs.append((tag + " pool bits off", stored, 0.0))
    return recs


# prompts and sampling for the engine-level fp8-KV tests (CPU and GPU)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "My favourite programming language is",
    "In 1492,",
    "The quick brown fox",
]
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
