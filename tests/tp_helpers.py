"""Tensor-parallel test helpers: a greedy decode loop on a ModelRunner (prefill, then one decode
row per step, through the runner's own KV pool), and a spawned gloo rank that runs it on its
shard and saves rank 0's tokens and logits."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from radixlm.backend.loader import load_config
from radixlm.backend.model_runner import ModelRunner, ScheduledItem
from radixlm.backend.tensor_parallel import TPShard, plan_shards


def make_runner(model_dir: Path, quantization: str, tp: TPShard | None) -> ModelRunner:
    config = load_config(model_dir)
    return ModelRunner(
        config, model_dir, torch.device("cpu"), torch.float32, 1024, 0.9, 4, quantization=quantization, tp=tp
    )


def greedy_run(
    runner: ModelRunner, prompt: list[int], steps: int, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after prompt, and the logits [steps + 1, vocab] that chose them (the last row
    scores the token after the last one). With forced, those tokens are fed instead of the picks
    (teacher forcing), so two runs score the same sequence."""
    row = runner.req_table.alloc()
    slots = runner.allocator.alloc(len(prompt) + steps)
    assert row is not None and slots is not None
    runner.req_table.write(row, 0, slots)
    n = len(prompt)
    logits = [runner.model(runner.build_batch([ScheduledItem(row, prompt, 0, [n - 1])], slots[:n]))[-1]]
    tokens: list[int] = []
    for pos in range(n, n + steps):
        tokens.append(int(logits[-1].argmax()))
        fed = tokens[-1] if forced is None else forced[pos - n]
        fb = runner.build_batch([ScheduledItem(row, [fed], pos, [0])], slots[pos : pos + 1])
        logits.append(runner.model(fb)[-1])
    return tokens, torch.stack(logits)


def tp_rank(
    rank: int,
    size: int,
    port: int,
    model_dir: str,
    quantization: str,
    prompt: list[int],
    steps: int,
    out: str,
    forced: list[int] | None = None,
) -> None:
    """One rank of a gloo group: its shard of the model, the same greedy loop as every rank."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    try:
        shard = plan_shards(load_config(Path(model_dir)), size)[rank]
        tokens, logits = greedy_run(make_runner(Path(model_dir), quantization, shard), prompt, steps, forced)
        if rank == 0:
            torch.save({"tokens": tokens, "logits": logits}, out)
    finally:
        dist.destroy_process_group()
