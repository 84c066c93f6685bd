"""Cascade planning for a decode batch, all host-side: the groups, read from the radix tree (which
running requests share a long cached prefix — the same KV slots —, in what order the batch must
run so each group is contiguous, and how many KV reads that saves), the memo of the last grouping
(CascadeGrouper, owned by the batch planner), and the kernels' CascadePlan built from a grouping.
Promises: grouping is host-only, O(batch * tree depth), and the plan costs one non-blocking copy;
every group's members hold the same slots for the first `shared` tokens, shared <= each member's
prefix_len <= its KV length, so each member keeps at least its new token as its own part."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.kernels.cascade_plan import CascadePlan

from .forward_batch import to_device_packed

if TYPE_CHECKING:
    from .prefix_cache import TreeNode
    from .request import Req

# Defaults (each a keyword argument of find_cascade_groups, so tests can lower them). A cascade
# step runs eagerly (no CUDA graph: its plan changes shape every step), which costs the launch
# overhead graphs hide (about 1-3 ms per step for an 8B-class model), and adds one kernel and a
# merge. It pays only when attention reads dominate and shrink a lot:
MIN_SHARED_LEN = 512  # shorter shared prefixes save less than the shared kernel's own cost
MIN_SAVED_FRACTION = 0.5  # at least half of the batch's KV reads avoided: attention time halves
MIN_SAVED_TOKENS = 16384  # KV rows (per KV head) avoided; 8B shape: 2 GB, ~0.5 ms at 4.2 TB/s
# With a measured cost model (backend/cascade_cost.py) the savings thresholds are left to it and
# only prefixes shorter than one shared-kernel chunk stay ungrouped.
MIN_KERNEL_SHARED_LEN = 256


@dataclass
class CascadeGroups:
    order: list[int]  # positions in the input list, in the order the decode batch must run
    group_sizes: list[int]  # contiguous runs of `order`; sum == len(reqs)
    shared_lens: list[int]  # KV tokens each group shares (0 for a group that shares nothing)
    saved_tokens: int  # KV rows per KV head the plan avoids reading: sum (n_g - 1) * shared_g

    def shared_shape(self) -> tuple[int, int]:
        """(groups that share a prefix, members of the largest of them): what decides whether a
        cascade graph can run the step."""
        sizes = [n for n, s in zip(self.group_sizes, self.shared_lens) if s > 0]
        return len(sizes), max(sizes, default=0)


@dataclass
class _Option:
    """One way to settle a subtree: groups formed inside it, their savings, and the members left
    over for an ancestor to group (each would save that ancestor's depth if it groups them)."""

    value: int
    groups: list[tuple[int, list[int]]]  # (shared length, member positions)
    leftover: list[int]

    def score(self, weight: int) -> int:
        return self.value + len(self.leftover) * weight


Grouping = list[tuple[int, list[int]]]  # (shared length, member positions) per group


class CascadeGrouper:
    """find_cascade_groups with a memo of its last grouping, owned by the batch planner. The
    grouping depends only on each request's locked node and shareable length, which change when
    requests join, leave or finish a prompt — not every step. The memo keeps its nodes alive until
    the next call (one entry)."""

    def __init__(self) -> None:
        self._last: tuple[tuple[object, ...], Grouping] | None = None

    def find(
        self,
        reqs: Sequence[Req],
        min_shared_len: int = MIN_SHARED_LEN,
        min_group_size: int = 2,
        min_saved_fraction: float = MIN_SAVED_FRACTION,
        min_saved_tokens: int = MIN_SAVED_TOKENS,
    ) -> CascadeGroups | None:
        """Group decode requests by their deepest shared radix-tree ancestors, or None when cascade
        would not pay (no group, or the saved reads are below the thresholds). The decode step's
        sequence length of a request is taken as kv_len + 1 (its new token is written at kv_len)."""
        if min_group_size < 2:
            raise ValueError(f"min_group_size must be at least 2, got {min_group_size}")
        if len(reqs) < min_group_size:
            return None
        picked = sharing_candidates(reqs, min_shared_len, min_group_size)
        if not picked:
            return None
        some = [reqs[i] for i in picked]
        key = (min_shared_len, min_group_size, *[(_node(r), _limit(r)) for r in some])
        if self._last is not None and self._last[0] == key:
            groups = self._last[1]
        else:
            groups = _group(some, min_shared_len, min_group_size)
            self._last = (key, groups)
        groups = [(s, [picked[i] for i in m]) for s, m in groups]
        saved = sum((len(m) - 1) * s for s, m in groups)
        total = sum(r.kv_len + 1 for r in reqs)
        if not groups or saved < min_saved_tokens or saved < min_saved_fraction * total:
            return None
        return _layout(len(reqs), groups, saved)


def find_cascade_groups(
    reqs: Sequence[Req],
    min_shared_len: int = MIN_SHARED_LEN,
    min_group_size: int = 2,
    min_saved_fraction: float = MIN_SAVED_FRACTION,
    min_saved_tokens: int = MIN_SAVED_TOKENS,
) -> CascadeGroups | None:
    """CascadeGrouper.find without a memo (one call)."""
    return CascadeGrouper().find(reqs, min_shared_len, min_group_size, min_saved_fraction, min_saved_tokens)


def make_cascade_plan(
    group_sizes: list[int], shared_lens: list[int], seq_lens: list[int], device: torch.device | str
) -> CascadePlan:
    """The kernels' CascadePlan from per-group sizes and shared lengths and per-request lengths, in
    one non-blocking host→device copy (a blocking copy would stall the overlap scheduler every
    cascade step; each view is 16-byte aligned, so Triton compiles no new variants)."""
    if sum(group_sizes) != len(seq_lens) or len(shared_lens) != len(group_sizes):
        raise ValueError("group sizes must cover the batch and match the shared lengths")
    if any(n < 0 for n in group_sizes) or any(s < 0 for s in shared_lens):
        raise ValueError("group sizes and shared lengths must be >= 0")
    per_req = [s for s, n in zip(shared_lens, group_sizes) for _ in range(n)]
    if any(s > n for s, n in zip(per_req, seq_lens)):
        raise ValueError("a shared prefix is longer than a member's sequence")
    ptr = [0]
    for n in group_sizes:
        ptr.append(ptr[-1] + n)
    sh = [g for g, (s, n) in enumerate(zip(shared_lens, group_sizes)) if s > 0 and n > 0]
    d_ptr, d_shared, d_per_req, d_sh = to_device_packed([ptr, shared_lens, per_req, sh], device)
    max_own = max((n - s for n, s in zip(seq_lens, per_req)), default=0)
    max_sg = max((group_sizes[g] for g in sh), default=0)
    return CascadePlan(
        d_ptr,
        d_shared,
        d_per_req,
        max(group_sizes, default=0),
        max(shared_lens, default=0),
        max_own,
        d_sh,
        max_sg,
    )


def sharing_candidates(reqs: Sequence[Req], min_shared_len: int, min_group_size: int) -> list[int]:
    """Positions of the requests that may group: at least min_shared_len shareable tokens, and
    their first min_shared_len prompt tokens equal to those of min_group_size - 1 others (sharing
    that many cached tokens means sharing those ids). The rest can only be singletons, so grouping
    the candidates alone gives the same groups; a batch of unrelated prompts costs one dict pass
    instead of a tree walk per request. A request whose shareable part runs past its prompt (a
    re-admitted one) cannot be keyed by its prompt: then every request is a candidate."""
    classes: dict[int, list[int]] = {}
    for i, req in enumerate(reqs):
        if _limit(req) < min_shared_len:
            continue
        if len(req.input_ids) < min_shared_len:
            return [i for i, r in enumerate(reqs) if _limit(r) >= min_shared_len]
        classes.setdefault(_prompt_key(req, min_shared_len), []).append(i)
    return sorted(i for members in classes.values() if len(members) >= min_group_size for i in members)


def _prompt_key(req: Req, n: int) -> int:
    """Hash of the first n prompt tokens, memoized on the request (the prompt never changes)."""
    memo = req.prompt_key
    if memo is None or memo[0] != n:
        memo = req.prompt_key = (n, hash(tuple(req.input_ids[:n])))
    return memo[1]


def _node(req: Req) -> TreeNode | None:
    return req.cache_handle.node if req.cache_handle is not None else None


def _limit(req: Req) -> int:
    """Tokens of a request that may be shared: its cached prefix (tree slots), within its KV."""
    return min(req.prefix_len, req.kv_len) if req.cache_handle is not None else 0


def _group(reqs: Sequence[Req], min_shared_len: int, min_group_size: int) -> list[tuple[int, list[int]]]:
    tree = _TouchedTree(reqs, min_shared_len)
    if tree.root is None:
        return []
    groups = _settle(tree, min_shared_len, min_group_size)
    groups = [(min(shared, *(tree.limit[i] for i in members)), members) for shared, members in groups]
    return [(s, m) for s, m in groups if s >= min_shared_len]


class _TouchedTree:
    """The part of the radix tree on the paths root -> each request's cache handle node, with each node's
    depth (tokens from the root) and the positions of the requests whose path ends there. Requests
    with fewer than min_shared_len shareable tokens stay out (they can only be singletons)."""

    def __init__(self, reqs: Sequence[Req], min_shared_len: int) -> None:
        self.depth: dict[TreeNode, int] = {}
        self.kids: dict[TreeNode, list[TreeNode]] = {}
        self.own: dict[TreeNode, list[int]] = {}
        self.limit: list[int] = []
        self.root: TreeNode | None = None
        for i, req in enumerate(reqs):
            limit = _limit(req)
            self.limit.append(limit)
            if limit >= min_shared_len:
                node = req.cache_handle.node  # type: ignore[union-attr]  # a limit > 0 has a handle
                self._add_path(node)
                self.own.setdefault(node, []).append(i)

    def _add_path(self, node: TreeNode) -> None:
        path = []
        while node not in self.depth and node.parent is not None:
            path.append(node)
            node = node.parent
        if node not in self.depth:  # the root
            self.depth[node] = 0
            self.root = node
        d = self.depth[node]
        for child in reversed(path):
            d += len(child.key)
            self.depth[child] = d
            parent = child.parent
            assert parent is not None  # every node on the path below the root has one
            self.kids.setdefault(parent, []).append(child)

    def post_order(self) -> list[TreeNode]:
        assert self.root is not None, "called on a tree with no request path"
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(self.kids.get(node, ()))
        out.reverse()
        return out


def _settle(tree: _TouchedTree, min_shared_len: int, min_group_size: int) -> list[tuple[int, list[int]]]:
    """Bottom-up over the touched tree; each node keeps a few options (pass everything up, best
    with leftovers, best fully grouped) and its parent picks one per child, weighing a leftover
    member at the parent's depth. A chain node (one child, no request of its own) only forwards
    its child's options: grouping there is never better than at the deeper child."""
    options: dict[TreeNode, list[_Option]] = {}
    for node in tree.post_order():
        kids = tree.kids.get(node, [])
        own = tree.own.get(node, [])
        if len(kids) == 1 and not own:
            options[node] = options.pop(kids[0])
            continue
        d = tree.depth[node] if tree.depth[node] >= min_shared_len else 0
        child_opts = [options.pop(k) for k in kids]
        options[node] = _node_options(own, child_opts, d, min_group_size)
    assert tree.root is not None
    best = max(options[tree.root], key=lambda o: (o.value, -len(o.groups)))
    return best.groups


def _node_options(
    own: list[int], child_opts: list[list[_Option]], d: int, min_group_size: int
) -> list[_Option]:
    """Options of one node of depth d (0: too shallow to group at): choose each child's option as
    if leftovers were grouped here (weight d) or not (weight 0), then close a group here or not."""
    everyone = own + [i for opts in child_opts for i in opts[0].leftover]  # opts[0]: pass all up
    out = [_Option(0, [], everyone)]
    if not child_opts:  # a leaf (most nodes of a fork batch): pass up, or group its own requests
        if d and len(own) >= min_group_size:
            out.append(_Option((len(own) - 1) * d, [(d, own)], []))
        return out
    for weight in {d, 0}:
        picks = [opts[0] if len(opts) == 1 else _pick(opts, weight) for opts in child_opts]
        value = sum(o.value for o in picks)
        groups = [g for o in picks for g in o.groups]
        pool = own + [i for o in picks for i in o.leftover]
        out.append(_Option(value, groups, pool))
        if d and len(pool) >= min_group_size:
            out.append(_Option(value + (len(pool) - 1) * d, groups + [(d, pool)], []))
    return out


def _pick(opts: list[_Option], weight: int) -> _Option:
    """The option with the best score at this weight; on a tie, the one leaving more members."""
    best = opts[0]
    for o in opts[1:]:
        if (o.score(weight), len(o.leftover)) > (best.score(weight), len(best.leftover)):
            best = o
    return best


def _layout(n: int, groups: list[tuple[int, list[int]]], saved: int) -> CascadeGroups:
    """Groups contiguous, in the order of their first member; ungrouped requests as singletons."""
    group_of: dict[int, int] = {}
    for g, (_, members) in enumerate(groups):
        for i in members:
            group_of[i] = g
    order: list[int] = []
    sizes: list[int] = []
    shared: list[int] = []
    emitted: set[int] = set()
    for i in range(n):
        group = group_of.get(i)
        if group is None:
            order.append(i)
            sizes.append(1)
            shared.append(0)
        elif group not in emitted:
            emitted.add(group)
            members = sorted(groups[group][1])
            order.extend(members)
            sizes.append(len(members))
            shared.append(groups[group][0])
    return CascadeGroups(order, sizes, shared, saved)
