"""Tensor parallelism for the Llama family: how a model is split over N ranks (TPShard) and each
rank's share of the checkpoint (shard_weights). A rank holds whole KV-head groups (their query
heads with them: uneven when the KV heads do not divide by N), a slice of the MLP's intermediate
columns on the quantization block grid, and full copies of the embedding, norms and LM head.
Attention output and MLP output are partial sums that an all-reduce completes, so every rank
ends each layer with the full hidden state. Promises: the shards of all ranks cover each weight
exactly once; a split the model cannot take raises ValueError with the sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from .model_config import ModelConfig
from .quant_formats import BLOCKS, QuantTensor

if TYPE_CHECKING:
    from .forward_batch import ForwardBatch

COLUMN_GRID = 32  # intermediate splits fall on GGUF block boundaries (32 values, K-quants 256)


@dataclass(frozen=True)
class TPShard:
    """One rank's share: KV heads [kv0, kv1), query heads [q0, q1), intermediate [i0, i1)."""

    rank: int
    size: int
    kv0: int
    kv1: int
    q0: int
    q1: int
    i0: int
    i1: int


class StepSender(Protocol):
    """Rank 0's link to the other ranks: called with each forward's batch before it runs."""

    def send_step(self, fb: ForwardBatch) -> None: ...


def plan_shards(cfg: ModelConfig, size: int) -> list[TPShard]:
    """The split of cfg over `size` ranks: KV heads as evenly as whole heads allow (rank r gets
    one more while r < remainder), each with its query-head group; intermediate columns evenly on
    the COLUMN_GRID."""
    if size < 1:
        raise ValueError(f"tp_size must be at least 1, got {size}")
    if cfg.num_kv_heads < size:
        raise ValueError(f"cannot split {cfg.num_kv_heads} KV heads over {size} ranks (each needs one)")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"{cfg.num_heads} query heads do not form groups over {cfg.num_kv_heads} KV heads")
    group = cfg.num_heads // cfg.num_kv_heads
    cols = cfg.intermediate_size // COLUMN_GRID
    if cfg.intermediate_size % COLUMN_GRID or cols < size:
        raise ValueError(
            f"intermediate size {cfg.intermediate_size} does not split over {size} ranks on a grid of {COLUMN_GRID}"
        )
    shards, kv, col = [], 0, 0
    for r in range(size):
        n_kv = cfg.num_kv_heads // size + (1 if r < cfg.num_kv_heads % size else 0)
        n_col = cols // size + (1 if r < cols % size else 0)
        shards.append(
            TPShard(
                r,
                size,
                kv,
                kv + n_kv,
                kv * group,
                (kv + n_kv) * group,
                col * COLUMN_GRID,
                (col + n_col) * COLUMN_GRID,
            )
        )
        kv, col = kv + n_kv, col + n_col
    return shards


def local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The model one rank builds: its heads and intermediate columns, everything else whole."""
    return dataclasses.replace(
        cfg,
        num_heads=shard.q1 - shard.q0,
        num_kv_heads=shard.kv1 - shard.kv0,
        intermediate_size=shard.i1 - shard.i0,
    )


Weight = torch.Tensor | QuantTensor


def shard_weights(
    weights: Iterable[tuple[str, Weight]], cfg: ModelConfig, shard: TPShard
) -> Iterator[tuple[str, Weight]]:
    """Each HF-named weight cut to this rank's share: q/k/v rows (and biases) by head, o_proj
    columns by query head, gate/up rows and down columns by intermediate slice; a row-parallel
    bias (added once after the all-reduce) stays on rank 0 only, zero elsewhere."""
    d = cfg.head_dim
    for name, w in weights:
        if ".q_proj." in name:
            yield name, _rows(w, shard.q0 * d, shard.q1 * d)
        elif ".k_proj." in name or ".v_proj." in name:
            yield name, _rows(w, shard.kv0 * d, shard.kv1 * d)
        elif ".gate_proj." in name or ".up_proj." in name:
            yield name, _rows(w, shard.i0, shard.i1)
        elif name.endswith(".o_proj.weight"):
            yield name, _cols(w, shard.q0 * d, shard.q1 * d)
        elif name.endswith(".down_proj.weight"):
            yield name, _cols(w, shard.i0, shard.i1)
        elif name.endswith((".o_proj.bias", ".down_proj.bias")):
            yield name, w if shard.rank == 0 else torch.zeros_like(w)  # type: ignore[arg-type]
        else:
            yield name, w


def _rows(w: Weight, a: int, b: int) -> Weight:
    if isinstance(w, QuantTensor):
        return QuantTensor(w.qtype, w.raw[a:b].contiguous(), w.cols)
    return w[a:b].contiguous()


def _cols(w: Weight, a: int, b: int) -> Weight:
    if isinstance(w, QuantTensor):
        nbytes, nvalues = BLOCKS[w.qtype]
        if a % nvalues or b % nvalues:
            raise ValueError(
                f"a {w.qtype} weight splits only on its {nvalues}-value blocks; columns [{a}, {b}) do not"
            )
        return QuantTensor(
            w.qtype, w.raw[:, a // nvalues * nbytes : b // nvalues * nbytes].contiguous(), b - a
        )
    return w[:, a:b].contiguous()


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum t over the group's ranks, in place (the partial sums of a row-parallel layer)."""
    dist.all_reduce(t, group=group)
    return t
