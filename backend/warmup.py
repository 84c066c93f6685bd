"""Start-up warm-up: runs, once, every Triton kernel variant the engine can launch outside its
CUDA graphs (extends of both tile configs, eager decode and cascade decode with each merge width,
the grammar bitmask), so no kernel compiles on the request path. Promises: touches only the
padding KV slot 0 through a padding table row, and leaves no state behind."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from radixlm.kernels import compiled_kernel_count

from .cascade_cost import CascadeCostModel, copy_bytes_per_s, time_cuda
from .kv_pool import KVPool
from .model_runner import ScheduledItem

if TYPE_CHECKING:
    from .model_runner import ModelRunner

logger = logging.getLogger(__name__)

EXTEND_LENS = (16, 2048)  # one extend per tile config of kernels.extend_attention.extend_config
SPLIT_COUNTS = (1, 17, 65)  # one decode/cascade merge per kernels._triton.split_block width


def warm_up(runner: ModelRunner, cascade: bool) -> dict[str, float]:
    """Compile what eager steps use; returns {"kernels": variants compiled, "seconds": time}."""
    if runner.device.type != "cuda":
        return {"kernels": 0, "seconds": 0.0}
    t0, c0 = time.perf_counter(), compiled_kernel_count()
    row = runner.req_table.alloc()
    if row is None:
        return {"kernels": 0, "seconds": 0.0}
    try:
        runner.req_table.clear_row(row)  # every column -> slot 0
        with torch.inference_mode():
            _extend_and_decode(runner, row)
            _attention_variants(runner, row, cascade)
            _bitmask(runner)
        torch.cuda.synchronize(runner.device)
    finally:
        runner.req_table.free(row)
    out = {"kernels": compiled_kernel_count() - c0, "seconds": time.perf_counter() - t0}
    logger.info("warm-up compiled %d kernel variants in %.1f s", out["kernels"], out["seconds"])
    return out


WARM_PROMPT_LENS = (1, 7, 30, 100)
WARM_SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
# closed: its masks come from xgrammar (grammars/schema_exact.py), WARM_SCHEMA's from llguidance
WARM_CLOSED_SCHEMA = json.dumps({**json.loads(WARM_SCHEMA), "additionalProperties": False})


def warm_request_path(generate: Callable[..., object], vocab_size: int, context_len: int) -> None:
    """One small mixed batch through the engine's whole request path (prefills of several lengths
    in one step, graph decode, seeded and greedy sampling, JSON-schema masks of both engines), so
    nothing a first real batch runs is compiled on its request path."""
    lens = [max(1, min(n, context_len - 16)) for n in WARM_PROMPT_LENS]
    prompts = [[(7 * i + j) % (vocab_size - 1) + 1 for j in range(n)] for i, n in enumerate(lens)]
    sampled: dict[str, object] = {"max_new_tokens": 4, "temperature": 0.7, "seed": 0}
    params: list[dict[str, object]] = [sampled, {"max_new_tokens": 4, "temperature": 0.0}] * (
        len(prompts) // 2
    )
    for schema in (WARM_SCHEMA, WARM_CLOSED_SCHEMA):
        params.append({**sampled, "max_new_tokens": 8, "json_schema": schema})
    generate(input_ids=[*prompts, prompts[-1], prompts[-1]], sampling_params=params)


def _forward_eager(runner: ModelRunner, items: list[ScheduledItem]) -> None:
    n = sum(len(it.token_ids) for it in items)
    runner.model(runner.build_batch(items, torch.zeros(n, dtype=torch.int64), keep_extend=True))


def _extend_and_decode(runner: ModelRunner, row: int) -> None:
    """Whole eager forwards: every non-attention kernel (norms, rope, activations, GEMV) too."""
    limit = runner.config.context_len - 1
    for n in EXTEND_LENS:
        n = min(n, limit)
        _forward_eager(runner, [ScheduledItem(row, [0] * n, 0, [n - 1])])
    for bs in (1, 3):
        _forward_eager(runner, [ScheduledItem(row, [0], min(64, limit), [0]) for _ in range(bs)])


def _attention_variants(runner: ModelRunner, row: int, cascade: bool) -> None:
    """The decode and cascade kernels at each merge width (the split count picks one)."""
    from radixlm.kernels.cascade_attention import cascade_decode_attention
    from radixlm.kernels.decode_attention import decode_attention

    from .cascade_groups import make_cascade_plan

    c, dev = runner.config, runner.device
    k_buf, v_buf = runner.kv_pool.k_buffers[0], runner.kv_pool.v_buffers[0]
    bs, length = 4, min(4096, c.context_len)
    q = torch.randn(bs, c.num_heads, c.head_dim, dtype=runner.dtype, device=dev)
    rows = torch.full((bs,), row, dtype=torch.int64, device=dev)
    seq = torch.full((bs,), length, dtype=torch.int64, device=dev)
    k_scale, v_scale = runner.kv_pool.scales(0)  # the decode kernel applies them inside: its variant
    for s in SPLIT_COUNTS[:2]:  # plain decode never exceeds 64 splits
        decode_attention(
            q, k_buf, v_buf, runner.req_table.table, rows, seq, num_splits=s, k_scale=k_scale, v_scale=v_scale
        )
    if not cascade:
        return
    plan = make_cascade_plan([bs], [length // 2], [length] * bs, dev)
    for s in SPLIT_COUNTS:
        half = max(1, s // 2)
        cascade_decode_attention(
            q,
            k_buf,
            v_buf,
            runner.req_table.table,
            rows,
            seq,
            plan,
            shared_splits=half,
            own_splits=max(1, s - half),
        )


def measure_cascade_costs(runner: ModelRunner) -> CascadeCostModel | None:
    """The cost model's inputs, timed on this device (CUDA only; None elsewhere)."""
    if runner.device.type != "cuda":
        return None
    from radixlm.kernels.cascade_attention import cascade_decode_attention
    from radixlm.kernels.decode_attention import decode_attention

    from .cascade_groups import make_cascade_plan

    c, dev, graphs = runner.config, runner.device, runner.graph_runner
    row = runner.req_table.alloc()
    if row is None:
        return None
    try:
        runner.req_table.clear_row(row)
        with torch.inference_mode():
            per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, runner.kv_dtype)
            kv_row_s = per_token / copy_bytes_per_s(dev)
            k_buf, v_buf, table = (
                runner.kv_pool.k_buffers[0],
                runner.kv_pool.v_buffers[0],
                runner.req_table.table,
            )
            # a batch the decode graphs hold (their largest may be under 8)
            bs = min(8, graphs.max_bs) if graphs is not None and graphs.enabled else 8
            length = min(512, c.context_len)
            q = torch.randn(bs, c.num_heads, c.head_dim, dtype=runner.dtype, device=dev)
            rows = torch.full((bs,), row, dtype=torch.int64, device=dev)
            seq = torch.full((bs,), length, dtype=torch.int64, device=dev)
            plan = make_cascade_plan([bs], [length // 2], [length] * bs, dev)
            plain = time_cuda(lambda: decode_attention(q, k_buf, v_buf, table, rows, seq))
            casc = time_cuda(lambda: cascade_decode_attention(q, k_buf, v_buf, table, rows, seq, plan))
            extra = max(0.0, casc - plain) * c.num_layers
            penalty = 0.0
            if graphs is not None and graphs.enabled:
                items = [ScheduledItem(row, [0], length - 1, [0]) for _ in range(bs)]
                fb = runner.build_batch(items, torch.zeros(bs, dtype=torch.int64))
                penalty = max(0.0, time_cuda(lambda: runner.model(fb)) - time_cuda(lambda: graphs.replay(fb)))
    finally:
        runner.req_table.free(row)

    def graph_fit(batch: int, shared_groups: int, max_members: int) -> tuple[bool, bool]:
        if graphs is None or not graphs.enabled or batch > graphs.max_bs:
            return False, False
        return True, graphs.cascade_fits(batch, shared_groups, max_members)

    model = CascadeCostModel(kv_row_s, extra, penalty, graph_fit)
    logger.info(
        "cascade costs: %.3g s per KV row, %.3g s kernel extra, %.3g s eager penalty",
        kv_row_s,
        extra,
        penalty,
    )
    return model


def _bitmask(runner: ModelRunner) -> None:
    from radixlm.grammars import apply_token_bitmask_

    vocab = runner.config.vocab_size
    logits = torch.zeros(2, vocab, dtype=torch.float32, device=runner.device)
    mask = torch.full((2, (vocab + 31) // 32), -1, dtype=torch.int32)
    apply_token_bitmask_(logits, mask)
    apply_token_bitmask_(logits, mask[:1], torch.tensor([1]))
