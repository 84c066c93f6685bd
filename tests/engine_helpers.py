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


def decode_logits(engine, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits that score ids[prompt_len:] [len(ids) - prompt_len, vocab], teacher forced the way
    generation runs: the prompt in one prefill, then one decode row per token (on the CPU with
    GGUF blocks kept, the int8 kernel's path)."""
    from radixlm.backend.model_runner import ScheduledItem

    runner = engine.runner

    def run() -> torch.Tensor:
        row = runner.req_table.alloc()
        slots = runner.allocator.alloc(len(ids))
        runner.req_table.write(row, 0, slots)
        n = prompt_len
        out = [
            runner.forward(runner.build_batch([ScheduledItem(row, ids[:n], 0, [n - 1])], slots[:n]))[
                -1
            ].clone()
        ]
        for pos in range(n, len(ids) - 1):
            fb = runner.build_batch([ScheduledItem(row, [ids[pos]], pos, [0])], slots[pos : pos + 1])
            out.append(runner.forward(fb)[-1].clone())
        runner.allocator.free(slots)
        runner.req_table.free(row)
        return torch.stack(out)

    return engine._call(run)
