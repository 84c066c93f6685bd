"""The static side of decode CUDA graphs: what the graph runner reads of the model runner
(GraphTarget), the fixed device buffers every graph reads (StaticDecodeInputs, StaticCascadePlan),
and the host lists mirrored into a graph's batch. Promises: buffers are allocated once and only
written in place, device to device, without a host sync; padding rows never write a live KV slot."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.kernels.cascade_plan import CascadePlan

from .forward_batch import AttentionBackend, ForwardBatch

if TYPE_CHECKING:
    from .kv_pool import KVPool, ReqToTokenTable
    from .model_config import ModelConfig


@dataclass(frozen=True)
class CascadeGraphShape:
    """The cascade plans one kind of cascade graph serves: at most `groups` groups with a shared
    part, none of more than `members` requests (None: up to the whole batch). Its shared-prefix
    split count is the one an eager launch picks for `typical_groups` groups of `typical_members`
    (None: the whole batch); batches with other shapes get the same programs, some idle."""

    groups: int
    members: int | None
    typical_groups: int
    typical_members: int | None
    min_bs: int  # smaller batch sizes get no graph of this kind

    def fits(self, shared_groups: int, max_members: int) -> bool:
        return shared_groups <= self.groups and (self.members is None or max_members <= self.members)


# A few groups of any size: forks of one document, few-shot questions behind one prefix.
FEW_GROUPS = CascadeGraphShape(groups=4, members=None, typical_groups=1, typical_members=None, min_bs=2)
# Many small groups: branches of a tree, n samples of each of many prompts. Its tiles are sized for
# 32-member groups, not for the whole batch, so 64 groups launch about as many programs as 4 do.
MANY_GROUPS = CascadeGraphShape(groups=64, members=32, typical_groups=16, typical_members=8, min_bs=16)
CASCADE_GRAPH_SHAPES = (FEW_GROUPS, MANY_GROUPS)  # tried in this order


@dataclass(frozen=True)
class GraphTarget:
    """What the graph runner needs of the model runner: the eager forward it captures and the
    device state every captured batch reads (the model runner builds it: graph_target())."""

    forward: Callable[[ForwardBatch], torch.Tensor]
    config: ModelConfig
    dtype: torch.dtype
    device: torch.device
    kv_pool: KVPool
    req_table: ReqToTokenTable
    attn_backend: AttentionBackend


class StaticDecodeInputs:
    """The device buffers every graph reads, max_bs rows each, allocated once and only written in
    place. Rows >= `live` always hold padding; rows < `live` may hold the last batch."""

    def __init__(self, max_bs: int, pad_row: int, device: torch.device, vocab_size: int) -> None:
        def zeros() -> torch.Tensor:
            return torch.zeros(max_bs, dtype=torch.int64, device=device)

        self.max_bs, self.pad_row = max_bs, pad_row
        self.input_ids, self.positions, self.out_cache_loc, self.prefix_lens = (
            zeros(),
            zeros(),
            zeros(),
            zeros(),
        )
        self.req_pool_indices = torch.full((max_bs,), pad_row, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int64, device=device)
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=device)  # decode: never written
        self.arange = torch.arange(max_bs, dtype=torch.int64, device=device)  # start locs and logit rows
        # one logits buffer for every graph: per-graph outputs would hold Σ sizes × vocab floats
        # (about 10 GB for Llama-3 at 1,024 rows), and a replay's rows are copied out at once
        self.logits = torch.empty(max_bs, vocab_size, dtype=torch.float32, device=device)
        self.live = 0

    def _pairs(self, fb: ForwardBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (self.input_ids, fb.input_ids),
            (self.positions, fb.positions),
            (self.out_cache_loc, fb.out_cache_loc),
            (self.req_pool_indices, fb.req_pool_indices),
            (self.seq_lens, fb.seq_lens),
            (self.prefix_lens, fb.prefix_lens),
        ]

    def load(self, fb: ForwardBatch) -> None:
        """Copy a decode batch into rows [0, bs) (device to device, no sync) and reset rows the
        previous batch left behind, so no padding row writes a live KV slot."""
        bs = fb.batch_size
        if bs > self.max_bs:
            raise ValueError(f"batch of {bs} exceeds the static buffers' {self.max_bs} rows")
        for dst, src in self._pairs(fb):
            dst[:bs].copy_(src, non_blocking=True)
        if self.live > bs:
            self.pad(bs, self.live)
        self.live = bs

    def pad(self, lo: int, hi: int) -> None:
        for t in (self.input_ids, self.positions, self.out_cache_loc, self.prefix_lens):
            t[lo:hi].zero_()
        self.req_pool_indices[lo:hi].fill_(self.pad_row)
        self.seq_lens[lo:hi].fill_(1)

    def forward_batch(self, gbs: int, target: GraphTarget, num_splits: int) -> ForwardBatch:
        """A ForwardBatch of gbs padding rows whose tensors are views of these buffers."""
        return ForwardBatch(
            input_ids=self.input_ids[:gbs],
            positions=self.positions[:gbs],
            out_cache_loc=self.out_cache_loc[:gbs],
            req_pool_indices=self.req_pool_indices[:gbs],
            seq_lens=self.seq_lens[:gbs],
            prefix_lens=self.prefix_lens[:gbs],
            extend_lens=self.extend_lens[:gbs],
            extend_start_loc=self.arange[:gbs],
            seq_lens_cpu=[1] * gbs,
            prefix_lens_cpu=[0] * gbs,
            extend_lens_cpu=[1] * gbs,
            req_pool_indices_cpu=[self.pad_row] * gbs,
            extend_start_loc_cpu=list(range(gbs)),
            logits_indices=self.arange[:gbs],
            logits_out=self.logits[:gbs],
            req_to_token=target.req_table.table,
            kv_pool=target.kv_pool,
            attn_backend=target.attn_backend,
            is_decode=True,
            decode_num_splits=num_splits,
        )


def cascade_plan_shape(plan: CascadePlan) -> tuple[int, int] | None:
    """(groups with a shared part, members of the largest) from the plan's host ints; None for a
    plan that does not list its shared groups."""
    if plan.shared_groups is None:
        return None
    members = plan.max_shared_group_size if plan.max_shared_group_size is not None else plan.max_group_size
    return int(plan.shared_groups.shape[0]), members


class StaticCascadePlan:
    """A CascadePlan in fixed device buffers, for the plans `shape` admits. Groups past the live
    plan are empty ([bs, bs)), and unused shared-group slots name such an empty group, so their
    programs do nothing."""

    def __init__(self, max_bs: int, device: torch.device, shape: CascadeGraphShape = FEW_GROUPS) -> None:
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int64, device=device)

        self.shape = shape
        self.group_ptr, self.group_shared = zeros(max_bs + 2), zeros(max_bs + 1)
        self.shared_lens, self.shared_groups = zeros(max_bs), zeros(shape.groups)

    def plan(self, gbs: int, context_len: int) -> CascadePlan:
        members = gbs if self.shape.members is None else min(gbs, self.shape.members)
        return CascadePlan(
            self.group_ptr[: gbs + 2],
            self.group_shared[: gbs + 1],
            self.shared_lens[:gbs],
            gbs,
            context_len,
            context_len,
            self.shared_groups,
            members,
        )

    def typical_plan(self, gbs: int, context_len: int) -> CascadePlan:
        """The plan whose eager layout fixes this kind's shared-prefix split count."""
        full = self.plan(gbs, context_len)
        members = gbs if self.shape.typical_members is None else min(gbs, self.shape.typical_members)
        typical = full.shared_groups[: self.shape.typical_groups] if full.shared_groups is not None else None
        return CascadePlan(
            full.group_ptr,
            full.group_shared_lens,
            full.shared_lens,
            gbs,
            context_len,
            context_len,
            typical,
            members,
        )

    def load(self, plan: CascadePlan, bs: int) -> None:
        """Copy a live plan in (device to device, no sync) and pad it with empty groups."""
        assert plan.shared_groups is not None
        g, n_sg = int(plan.group_shared_lens.shape[0]), int(plan.shared_groups.shape[0])
        self.group_ptr[: g + 1].copy_(plan.group_ptr, non_blocking=True)
        self.group_ptr[g + 1 :].fill_(bs)
        self.group_shared[:g].copy_(plan.group_shared_lens, non_blocking=True)
        self.shared_lens[:bs].copy_(plan.shared_lens, non_blocking=True)
        self.shared_lens[bs:].zero_()
        self.shared_groups[:n_sg].copy_(plan.shared_groups, non_blocking=True)
        self.shared_groups[n_sg:].fill_(g)


def sync_host_lists(static: ForwardBatch, fb: ForwardBatch, pad_row: int) -> None:
    """Mirror the real batch's host-side lengths into the static batch (padding past them), so
    any host reader of the static batch sees what its device tensors hold."""
    pad = static.batch_size - fb.batch_size
    static.seq_lens_cpu = fb.seq_lens_cpu + [1] * pad
    static.prefix_lens_cpu = fb.prefix_lens_cpu + [0] * pad
    static.req_pool_indices_cpu = fb.req_pool_indices_cpu + [pad_row] * pad
