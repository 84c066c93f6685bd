"""CPU tests of every Triton kernel against its torch reference, under TRITON_INTERPRET=1 on small
shapes. The interpreter must be switched on before the kernels are defined, so the checks run in
one subprocess (this file run as a script) and each pytest case asserts on its share of records."""

from __future__ import annotations

import importlib.util
import os

import pytest
from interp_runner import assert_records, main, run_script

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

GROUPS = ["decode", "extend", "cascade", "pointwise", "rotary", "backend"]


def _checks(group: str) -> list:
    import kernel_checks as c
    import torch

    f32, b16 = torch.float32, torch.bfloat16
    if group == "decode":
        return c.run(
            [
                lambda: c.check_decode("cpu", f32, [1, 37, 90, 130], 8, 2, 32, [1, 3, None], block_n=32),
                lambda: c.check_decode("cpu", b16, [1, 37, 90, 130], 8, 2, 32, [1, 4], block_n=32),
                lambda: c.check_decode("cpu", b16, [64, 5], 2, 2, 48, [2], block_n=16),  # MHA, head dim 48
                lambda: c.check_decode("cpu", f32, [40, 77], 32, 4, 16, [1, 2], block_n=16),  # group 8
            ]
        )
    if group == "extend":
        return c.run(
            [
                lambda: c.check_extend(
                    "cpu", f32, [0, 17, 40, 5, 0], [20, 1, 0, 37, 70], 8, 2, 32, 32, 16, 4
                ),
                lambda: c.check_extend(
                    "cpu", b16, [0, 17, 40, 5, 0], [20, 1, 0, 37, 70], 8, 2, 32, 32, 16, 4
                ),
                lambda: c.check_extend(
                    "cpu", b16, [33, 0], [45, 10], 9, 3, 48, 16, 32, 4
                ),  # group 3 straddles blocks
                lambda: c.check_extend("cpu", b16, [33, 0], [45, 10], 8, 2, 32, 32, 16, 4, pack_gqa=False),
            ]
        )
    if group == "cascade":
        return c.run(
            [
                lambda: c.check_cascade(
                    "cpu", f32, [3, 1, 2], [50, 0, 20], [5, 1, 12, 30, 3, 17], 8, 2, 32, 16, 16
                ),
                lambda: c.check_cascade(
                    "cpu", b16, [3, 1, 2], [50, 0, 20], [5, 1, 12, 30, 3, 17], 8, 2, 32, 16, 16
                ),
                # no group shares anything: the fused launch has only own programs (plain decode)
                lambda: c.check_cascade("cpu", f32, [1, 1, 1], [0, 0, 0], [9, 70, 1], 8, 2, 32, 16, 16),
                # a group spanning 2 row blocks, a singleton with a shared part, GQA group 3, head dim 48
                lambda: c.check_cascade(
                    "cpu", b16, [5, 2, 1], [40, 33, 10], [3, 20, 1, 7, 2, 9, 1, 5], 9, 3, 48, 16, 16
                ),
                # default tiles (64 x 64), fused impl only
                lambda: c.check_cascade(
                    "cpu",
                    f32,
                    [4, 1],
                    [70, 0],
                    [2, 1, 9, 3, 100],
                    8,
                    2,
                    32,
                    variants=[{"impl": "fused"}, {"impl": "fused", "shared_splits": 2}],
                ),
            ]
        )
    if group == "pointwise":
        pointwise = c.check_pointwise("cpu", f32) + c.check_pointwise("cpu", b16, 5, 130)
        # K not a power of two (160: a masked tail of blocks); I over one SiLU program (1,088)
        return pointwise + c.check_int8_rows("cpu", b16, 160, 1088) + c.check_int8_rows("cpu", f32, 96, 64)
    if group == "rotary":
        return c.check_rotary("cpu", f32) + c.check_rotary("cpu", b16, 5, 3, 1, 64)
    if group == "backend":
        split = _backend_records(f32, 1) + _backend_records(b16, 1)
        assert sum(tag.endswith("split") for tag, _, _ in split) == 4, "mixed steps ran unsplit"
        return _backend_records(f32) + _backend_records(b16) + split
    raise KeyError(group)


def _backend_records(dtype, mixed_decode_min_rows: int | None = None) -> list:
    """TritonAttentionBackend over the forked workload (tests/forked_steps.py): extend, mixed
    extend, then decode steps plain and through a cascade plan, then a mixed step. Reference:
    attention over each request's own K/V history kept outside the pool. mixed_decode_min_rows 1:
    mixed steps run their leading decode rows through decode attention; None: never."""
    import torch
    from forked_steps import FORK_LEN, causal_ref, forked_steps
    from kernel_checks import BOUND, DTYPE_NAME, rel_err

    from radixlm.backend.attention_triton import TritonAttentionBackend
    from radixlm.backend.kv_pool import KVPool

    hq, hkv, d = 8, 2, 32
    dev = os.environ.get("KERNEL_TEST_DEVICE", "cpu")  # the GPU run sets cuda
    pool = KVPool(1, 100, hkv, d, dtype, dev)
    hist: list[list] = [[], [], []]  # per request: (k, v) rows so far
    recs = []
    backend = TritonAttentionBackend(mixed_decode_min_rows=mixed_decode_min_rows)
    for st in forked_steps(pool, backend, dev):
        if st.index == 1:
            hist[1], hist[2] = list(hist[0][:FORK_LEN]), list(hist[0][:FORK_LEN])
        t = st.tokens
        q, k, v = (torch.randn(t, h, d, dtype=dtype, device=dev) for h in (hq, hkv, hkv))
        out = st.fb.attn_backend.forward(q, k, v, 0, st.fb)
        ref = torch.empty(t, hq, d, dtype=torch.float64)
        for r, p, e, s0 in zip(st.reqs, st.prefix, st.ext, st.starts):
            hist[r] += [(k[s0 + j].cpu(), v[s0 + j].cpu()) for j in range(e)]
            kk = torch.stack([x for x, _ in hist[r]]).double()
            vv = torch.stack([y for _, y in hist[r]]).double()
            ref[s0 : s0 + e] = causal_ref(q[s0 : s0 + e], kk, vv, p)
        tag = f"backend {DTYPE_NAME[dtype]} {st.label()}" + (" split" if st.fb.mixed_split else "")
        recs.append((tag, rel_err(out.view(t, hq, d), ref), BOUND[dtype]))
        slots = st.slots
        stored = (pool.k_buffers[0][slots] - k).abs().max() + (pool.v_buffers[0][slots] - v).abs().max()
        recs.append((tag + " KV stored", float(stored), 0.0))
    return recs


@pytest.fixture(scope="module")
def results() -> dict:
    return run_script(__file__)


@pytest.mark.parametrize("group", GROUPS)
def test_kernel_matches_reference(results: dict, group: str) -> None:
    assert_records(results[group], results["_seed"], group)


def test_cascade_plan_rejects_bad_input() -> None:
    from radixlm.backend.cascade_groups import make_cascade_plan

    for sizes, shared, seq in [
        ([2], [3], [5]),
        ([1, 1], [0], [4, 4]),
        ([2], [-1], [3, 3]),
        ([2, -1], [0, 0], [4]),
        ([2], [6], [9, 5]),
    ]:
        with pytest.raises(ValueError):
            make_cascade_plan(sizes, shared, seq, "cpu")


def test_fused_layout_gives_shared_programs_only_to_groups_with_a_shared_part() -> None:
    """Singleton groups of shared length 0 (as the scheduler builds them) add no shared-prefix
    program: the launch then equals plain split-K decode's own programs."""
    from radixlm.backend.cascade_groups import make_cascade_plan
    from radixlm.kernels.cascade_attention import fused_layout, resolve_config

    cfg = resolve_config(block_m=16, shared_waves=1.0)
    plain = make_cascade_plan([1] * 6, [0] * 6, [40] * 6, "cpu")
    lay = fused_layout(6, 8, 2, plain, cfg, 132)
    assert (lay.s_sh, lay.n_shared_tiles, plain.shared_groups.tolist()) == (0, 0, [])
    assert lay.n_own_tiles == 6 * 2 * lay.s_own
    mixed = make_cascade_plan(
        [1, 5, 1, 2], [0, 900, 0, 300], [40, 950, 950, 950, 950, 950, 7, 320, 330], "cpu"
    )
    lay = fused_layout(9, 8, 2, mixed, cfg, 132)
    assert mixed.shared_groups.tolist() == [1, 3] and mixed.max_shared_group_size == 5
    m_blocks = -(-5 * 4 // 16)  # the largest shared group's rows (5 members x 4 heads) in 16-row tiles
    assert lay.m_blocks == m_blocks and lay.n_shared_tiles == 2 * 2 * m_blocks * lay.s_sh
    assert fused_layout(9, 8, 2, mixed, cfg, 132, shared_splits=3, own_splits=2).n_own_tiles == 9 * 2 * 2


def test_cascade_config_rejects_unknown_knobs() -> None:
    from radixlm.kernels.cascade_attention import resolve_config

    with pytest.raises(ValueError):
        resolve_config("two_launch", shared_waves=2.0)
    with pytest.raises(ValueError):
        resolve_config("three_launch")
    assert resolve_config(block_m=128)["block_m"] == 128


if __name__ == "__main__":
    main(_checks, GROUPS)
