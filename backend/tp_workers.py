"""The ranks of a tensor-parallel engine: rank 0 is the engine (scheduler, cache, sampling) and
drives ranks 1..N-1, worker processes that each hold a shard of the model and its KV heads.
Before every forward, rank 0 sends the step's inputs and the req_to_token rows the step reads
(TPDriver.send_step); every rank then runs the same forward, whose all-reduces join them. Promises:
workers only ever run what rank 0 runs, in the same order; a worker that dies makes rank 0's next
collective fail with an error (gloo sees the closed connection), never a silent hang."""

from __future__ import annotations

import multiprocessing as mp
import socket
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .forward_batch import ForwardBatch
from .model_config import ModelConfig
from .model_runner import ModelRunner
from .spawned import wait_started
from .tensor_parallel import TPShard, plan_shards

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
WORKER_START_S = 300.0  # a spawned worker imports torch and the main script before its own code
STEP_TENSORS = (
    "input_ids",
    "positions",
    "out_cache_loc",
    "req_pool_indices",
    "seq_lens",
    "prefix_lens",
    "extend_lens",
    "extend_start_loc",
    "logits_indices",
)
STEP_LISTS = (
    "seq_lens_cpu",
    "prefix_lens_cpu",
    "extend_lens_cpu",
    "req_pool_indices_cpu",
    "extend_start_loc_cpu",
)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build the same runner as rank 0, on its own shard."""

    config: ModelConfig
    model_dir: Path
    dtype: torch.dtype
    kv_tokens: int
    max_running_requests: int
    quantization: str | None
    kv_cache_dtype: str = "auto"


class TPDriver:
    """Rank 0's end: starts the workers, sends each step, stops them."""

    def __init__(self, spec: WorkerSpec, shards: list[TPShard]) -> None:
        self.size = len(shards)
        port = _free_port()
        ctx = mp.get_context("spawn")
        started = [ctx.Event() for _ in shards[1:]]
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(shard, port, spec, event),
                name=f"radixlm-tp{shard.rank}",
                daemon=True,
            )
            for shard, event in zip(shards[1:], started)
        ]
        for p in self.procs:
            p.start()
        # the group's rendezvous below would wait out its whole timeout for a worker that died
        # while starting; this sees it go
        try:
            wait_started(self.procs, started, WORKER_START_S, "a tensor-parallel worker")
        except RuntimeError:
            for p in self.procs:
                p.kill()
            raise
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=self.size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        self.closed = False

    def send_step(self, fb: ForwardBatch, logits: bool) -> None:
        """The step's inputs and the table rows it reads, to every worker (logits: whether the
        LM head runs, so every rank joins the same collectives)."""
        self.check_workers()
        seq = dict(zip(fb.req_pool_indices_cpu, fb.seq_lens_cpu))
        table = {r: fb.req_to_token[r, : max(n, 1)].cpu() for r, n in seq.items()}
        msg = {
            "op": "forward",
            "tensors": {k: getattr(fb, k).cpu() for k in STEP_TENSORS},
            "lists": {k: getattr(fb, k) for k in STEP_LISTS},
            "is_decode": fb.is_decode,
            "table": table,
            "logits": logits,
        }
        dist.broadcast_object_list([msg], src=0)

    def check_workers(self) -> None:
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(
                "tensor-parallel worker "
                + ", ".join(f"{p.name} exited (status {p.exitcode})" for p in dead)
                + ": the engine cannot run its model"
            )

    def stop(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                dist.broadcast_object_list([{"op": "stop"}], src=0)
        finally:
            for p in self.procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()


def engine_shards(
    tp_size: int, config: ModelConfig, device: torch.device, random_weights: bool
) -> list[TPShard] | None:
    """The split an Engine(tp_size=...) runs with (None for one rank), or ValueError saying why not."""
    if tp_size == 1:
        return None
    if tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}")
    if device.type != "cpu":
        raise ValueError("tensor parallelism runs on the CPU (gloo) only; on GPUs (NCCL) it is not built yet")
    if random_weights:
        raise ValueError("tp_size > 1 needs a real checkpoint: random weights would differ per rank")
    if dist.is_initialized():
        raise ValueError("tp_size > 1 starts its own torch.distributed group: this process already has one")
    return plan_shards(config, tp_size)


def start_workers(
    runner: ModelRunner, model_dir: Path, quantization: str | None, shards: list[TPShard]
) -> TPDriver:
    """Ranks 1.. for rank 0's runner (same pool size, table and dtype), and the driver its model
    calls before every forward."""
    spec = WorkerSpec(
        runner.full_config,
        model_dir,
        runner.dtype,
        runner.kv_pool.size,
        runner.max_running_requests,
        quantization,
        runner.kv_cache_dtype,
    )
    driver = TPDriver(spec, shards)
    runner.model.tp_driver = driver
    return driver


def worker_main(shard: TPShard, port: int, spec: WorkerSpec, started: Event) -> None:
    """A worker rank: say it started, join the group, build its shard, run every step rank 0 sends."""
    started.set()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=shard.rank,
        world_size=shard.size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        runner = ModelRunner(
            spec.config,
            spec.model_dir,
            torch.device("cpu"),
            spec.dtype,
            spec.kv_tokens,
            0.9,
            spec.max_running_requests,
            quantization=spec.quantization,
            tp=shard,
            kv_cache_dtype=spec.kv_cache_dtype,
        )
        while True:
            box: list[dict[str, Any] | None] = [None]
            dist.broadcast_object_list(box, src=0)
            msg = box[0]
            assert msg is not None
            if msg["op"] == "stop":
                return
            fb = _rebuild(runner, msg)
            if msg["logits"]:
                runner.model(fb)
            else:  # an embeddings request stops at the hidden states
                runner.model.hidden_states(fb)
    finally:
        dist.destroy_process_group()


def _rebuild(runner: ModelRunner, msg: dict[str, Any]) -> ForwardBatch:
    """Rank 0's ForwardBatch on this rank's pool, table and backend."""
    for row, slots in msg["table"].items():
        runner.req_table.table[row, : slots.numel()] = slots
    return ForwardBatch(
        **msg["tensors"],
        **msg["lists"],
        req_to_token=runner.req_table.table,
        kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
        is_decode=msg["is_decode"],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
