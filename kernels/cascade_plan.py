"""The cascade plan: which requests of a decode batch form each group sharing a cached prefix,
and how long that prefix is, as device tensors built on the host with one copy. Promises: no
host sync; each view starts on a 16-byte boundary."""

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


def make_cascade_plan(group_sizes: list[int], shared_lens: list[int], seq_lens: list[int],
                      device: torch.device | str) -> CascadePlan:
    """Host-side: build the plan from per-group sizes and shared lengths and per-request lengths."""
    if sum(group_sizes) != len(seq_lens) or len(shared_lens) != len(group_sizes):
        raise ValueError("group sizes must cover the batch and match the shared lengths")
    if any(n < 0 for n in group_sizes) or any(s < 0 for s in shared_lens):
        raise ValueError("group sizes and shared lengths must be >= 0")
    per_req = [s for s, n in zip(shared_lens, group_sizes) for _ in range(n)]
    if any(s > L for s, L in zip(per_req, seq_lens)):
        raise ValueError("a shared prefix is longer than a member's sequence")
    ptr = [0]
    for n in group_sizes:
        ptr.append(ptr[-1] + n)
    sh = [g for g, (s, n) in enumerate(zip(shared_lens, group_sizes)) if s > 0 and n > 0]
    # one non-blocking host→device copy: a blocking torch.tensor(..., device=cuda) would wait
    # for the whole stream and stall the overlap scheduler every cascade step
    # each segment padded to 16 bytes: Triton specializes on pointer alignment, and views at
    # varying offsets would compile new kernel variants while serving
    parts = [ptr, shared_lens, per_req, sh]
    flat = torch.tensor([x for p in parts for x in p + [0] * (len(p) % 2)], dtype=torch.int64)
    if torch.device(device).type != "cpu":
        flat = flat.to(device, non_blocking=True)
    views = flat.split([len(p) + len(p) % 2 for p in parts])
    d_ptr, d_shared, d_per_req, d_sh = (v[: len(p)] for v, p in zip(views, parts))
    return CascadePlan(d_ptr, d_shared, d_per_req, max(group_sizes, default=0),
                       max(shared_lens, default=0), max((L - s for L, s in zip(seq_lens, per_req)), default=0),
                       d_sh, max((group_sizes[g] for g in sh), default=0))


def shared_groups_of(plan: CascadePlan) -> tuple[torch.Tensor, int, int]:
    """(device indices, count, max size) of the groups that get shared-prefix programs."""
    if plan.shared_groups is None or plan.max_shared_group_size is None:  # a plan built by hand
        g = plan.group_shared_lens.shape[0]
        return torch.arange(g, device=plan.group_ptr.device), g, plan.max_group_size
    return plan.shared_groups, int(plan.shared_groups.shape[0]), plan.max_shared_group_size
