"""GPU tests of every Triton kernel against its torch reference at model-sized shapes
(Llama-3.1-8B heads and SmolLM2 heads, ragged batches, bf16 and fp32). Skipped without CUDA."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from gpu_helpers import assert_sync_free_graph_replay

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
        reason="needs a CUDA GPU and triton",
    ),
]

F32, B16 = torch.float32, torch.bfloat16
CASES = {
    "decode_llama8b": lambda c: c.check_decode(
        "cuda", B16, [1, 77, 1000, 4097, 333], 32, 8, 128, [1, 3, None]
    ),
    "decode_fp32": lambda c: c.check_decode("cuda", F32, [1, 77, 1000, 333], 32, 8, 128, [1, 5]),
    "decode_smollm": lambda c: c.check_decode("cuda", B16, [5, 300, 2000], 9, 3, 64, [None]),
    "extend_ragged": lambda c: c.check_extend(
        "cuda", B16, [0, 17, 300, 5, 1000], [20, 1, 0, 377, 129], 32, 8, 128
    ),
    "extend_fp32": lambda c: c.check_extend("cuda", F32, [0, 17, 300], [20, 1, 177], 32, 8, 128, 32, 32, 4),
    "extend_smollm": lambda c: c.check_extend("cuda", B16, [3, 0, 250], [100, 64, 7], 9, 3, 64),
    "cascade": lambda c: c.check_cascade(
        "cuda", B16, [3, 1, 5], [500, 0, 130], [7, 1, 40, 3, 9, 100, 2, 2, 60], 32, 8, 128
    ),
    # fused impl: a group spanning several row blocks beside singletons sharing nothing, tile variants
    "cascade_fused_mixed": lambda c: c.check_cascade(
        "cuda",
        B16,
        [40, 1, 1, 20],
        [3000, 0, 0, 1000],
        [1 + (7 * i) % 300 for i in range(62)],
        32,
        8,
        128,
        variants=[
            {"impl": "fused"},
            {"impl": "fused", "block_n": 32},
            {"impl": "fused", "block_m": 128, "num_warps": 8},
            {"impl": "fused", "shared_first": False, "shared_splits": 5, "own_splits": 3},
        ],
    ),
    "cascade_fp32_smollm": lambda c: c.check_cascade(
        "cuda", F32, [2, 1, 3], [300, 0, 77], [5, 9, 1, 40, 2, 3], 9, 3, 64
    ),
    "pointwise": lambda c: (
        c.check_pointwise("cuda", B16, 300, 4096)
        + c.check_pointwise("cuda", F32, 33, 576)
        + c.check_int8_rows("cuda", B16, 4096, 14336)
        + c.check_int8_rows("cuda", B16, 160, 1088)
    ),
    "rotary": lambda c: c.check_rotary("cuda", B16, 500, 32, 8, 128) + c.check_rotary("cuda", F32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference_on_gpu(name: str) -> None:
    import kernel_checks as checks

    torch.manual_seed(int.from_bytes(os.urandom(2), "little"))
    recs = CASES[name](checks)
    bad = [(label, err, bound) for label, err, bound in recs if not err <= bound]
    assert recs and not bad, f"failed: {bad}"


@pytest.mark.parametrize("impl", ["fused", "two_launch"])
def test_cascade_is_sync_free_and_graph_capturable(impl: str) -> None:
    """The cascade call never syncs with the host (sync debug mode raises) and, captured in a CUDA
    graph, replays on new queries to the same result as an eager call on them."""
    import kernel_checks as checks

    from radixlm.backend.cascade_groups import make_cascade_plan
    from radixlm.kernels.cascade_attention import cascade_decode_attention

    groups, shared, own = [6, 1, 3], [700, 0, 300], [5, 80, 1, 9, 2, 40, 33, 1, 7, 19]
    seq = [s + o for s, o in zip([s for s, n in zip(shared, groups) for _ in range(n)], own)]
    kb, vb, table, rows = checks.paged_kv(seq, 8, 128, B16, "cuda", shared, groups)
    lens = torch.tensor(seq, device="cuda")
    plan = make_cascade_plan(groups, shared, seq, "cuda")
    q = torch.randn(len(seq), 32, 128, dtype=B16, device="cuda")
    run = lambda: cascade_decode_attention(q, kb, vb, table, rows, lens, plan, impl=impl)  # noqa: E731
    assert_sync_free_graph_replay(run, q)
