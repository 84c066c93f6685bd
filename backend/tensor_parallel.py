"""Tensor parallelism for the Llama family: how a model is split over N ranks (TPShard) and each
rank's share of the checkpoint (shard_weights). A rank holds whole KV-head groups (their query
heads with them: uneven when the KV heads do not divide by N), a slice of the MLP's intermediate
columns on the quantization block grid, a slice of the vocabulary (embedding and LM head rows)
and full copies of the norms. Embeddings, attention output and MLP output are partial sums that
an all-reduce completes, so every rank ends each layer with the full hidden state; the LM head's
slices are gathered into the full logits. Promises: the shards of all ranks cover each weight
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
    """One rank's share: KV heads [kv0, kv1), query heads [q0, q1), intermediate [i0, i1),
    vocabulary rows [v0, v1) of the embedding and the LM head."""

    rank: int
    size: int
    kv0: int
    kv1: int
    q0: int
    q1: int
    i0: int
    i1: int
    v0: int = 0
    v1: int = 0
    vocab_sizes: tuple[int, ...] = ()  # every rank's vocabulary slice, by rank


class StepSender(Protocol):
    """Rank 0's link to the other ranks: called with each forward's batch before it runs
    (logits: the LM head runs too, else the model stops at its hidden states)."""

    def send_step(self, fb: ForwardBatch, logits: bool) -> None: ...


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
    shards, kv, col, vocab = [], 0, 0, 0
    vocab_sizes = tuple(cfg.vocab_size // size + (1 if r < cfg.vocab_size % size else 0) for r in range(size))
    for r in range(size):
        n_kv = cfg.num_kv_heads // size + (1 if r < cfg.num_kv_heads % size else 0)
        n_col = cols // size + (1 if r < cols % size else 0)
        n_vocab = vocab_sizes[r]
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
                vocab,
                vocab + n_vocab,
                vocab_sizes,
            )
        )
        kv, col, vocab = kv + n_kv, col + n_col, vocab + n_vocab
    return shards


def local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The model one rank builds: its heads and intermediate columns, everything else whole."""
    return dataclasses.replace(
        cfg,
        num_heads=shard.q1 - shard.q0,
        num_kv_heads=shard.kv1 - shard.kv0,
        intermediate_size=shard.i1 - shard.i0,
        vocab_size=shard.v1 - shard.v0,
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
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            yield name, _rows(w, shard.v0, shard.v1)
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


def reduce_partial(partial: torch.Tensor) -> torch.Tensor:
    """The sum over every rank of their partial results (float32 on the wire: gloo's sums)."""
    full = partial if partial.is_cuda else partial.float()
    dist.all_reduce(full)
    return full.to(partial.dtype)


def embed_rows(embed: torch.nn.Module, ids: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """Embeddings of ids from a vocabulary-sliced table: this rank's rows, zeros for the others',
    summed over the ranks."""
    local = ids - shard.v0
    mine = (local >= 0) & (local < shard.v1 - shard.v0)
    rows = embed(torch.where(mine, local, torch.zeros_like(local)))
    return reduce_partial(rows * mine.unsqueeze(-1).to(rows.dtype))


def gather_logits(local: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """[T, vocab] from every rank's [T, its vocabulary slice] (slices padded to one width for
    the collective, then cut)."""
    widest = max(shard.vocab_sizes)
    padded = torch.nn.functional.pad(local, (0, widest - local.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in shard.vocab_sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[:, :n] for p, n in zip(parts, shard.vocab_sizes)], dim=-1)
