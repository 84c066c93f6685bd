"""Test helpers shared by engine tests: raw logits through the real KV-pool path."""

from __future__ import annotations

import torch


def last_logits(engine, ids: list[int]) -> torch.Tensor:
    """Our model's last-position logits for one prompt, computed on the scheduler thread
    through the real KV pool and attention backend."""
    from radixlm.backend.model_runner import ScheduledItem

    runner = engine.runner

    def run() -> torch.Tensor:
        row = runner.req_table.alloc()
        slots = runner.allocator.alloc(len(ids))
        runner.req_table.write(row, 0, slots)
        fb = runner.build_batch([ScheduledItem(row, ids, 0, [len(ids) - 1])], slots)
        logits = runner.forward(fb)[0].clone()
        runner.allocator.free(slots)
        runner.req_table.free(row)
        return logits

    return engine._call(run)


def position_logits(engine, ids: list[int]) -> torch.Tensor:
    """Our model's logits at every position of one sequence [len(ids), vocab] (teacher forced),
    through the real KV pool and attention backend on the scheduler thread."""
    from radixlm.backend.model_runner import ScheduledItem

    runner = engine.runner

    def run() -> torch.Tensor:
        row = runner.req_table.alloc()
        slots = runner.allocator.alloc(len(ids))
        runner.req_table.write(row, 0, slots)
        fb = runner.build_batch([ScheduledItem(row, ids, 0, list(range(len(ids))))], slots)
        logits = runner.forward(fb).clone()
        runner.allocator.free(slots)
        runner.req_table.free(row)
        return logits

    return engine._call(run)
