"""CascadePlan: what a cascade decode kernel reads — which requests of a decode batch form each
group sharing a cached prefix and how long that prefix is, as device tensors, plus the host-side
upper bounds that size the launch grid. The backend builds it (backend/cascade_groups.py); the
kernels only read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CascadePlan:
    """Groups are contiguous runs of the batch: group g is requests group_ptr[g]..group_ptr[g+1]-1,
    sharing the first group_shared_lens[g] tokens of the first member's req_to_token row.
    shared_groups lists (on the device) the groups with a non-empty shared part: only they get
    shared-prefix programs, so singleton groups with shared length 0 cost nothing."""

    group_ptr: torch.Tensor  # [G + 1] int64, device
    group_shared_lens: torch.Tensor  # [G] int64, device
    shared_lens: torch.Tensor  # [B] int64 per request, device (kv_start of its own part)
    max_group_size: int
    max_shared_len: int
    max_own_len: int
    shared_groups: torch.Tensor | None = None  # [G'] int64 indices of groups with shared len > 0
    max_shared_group_size: int | None = None  # largest group among shared_groups (host int)


def shared_groups_of(plan: CascadePlan) -> tuple[torch.Tensor, int, int]:
    """(device indices, count, max size) of the groups that get shared-prefix programs."""
    if plan.shared_groups is None or plan.max_shared_group_size is None:  # a plan built by hand
        g = plan.group_shared_lens.shape[0]
        return torch.arange(g, device=plan.group_ptr.device), g, plan.max_group_size
    return plan.shared_groups, int(plan.shared_groups.shape[0]), plan.max_shared_group_size
