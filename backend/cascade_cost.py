"""CascadeCostModel: decides per decode step whether cascade attention pays, from costs measured
on this device at start-up: the time to read one token's K/V rows over all layers, the extra
fixed cost of the cascade kernels over plain decode, and what an eager step costs over a CUDA
graph replay (a cascade plan the graphs cannot hold runs eagerly). Promises: host-only, O(1)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# (batch size, groups with a shared part, members of the largest such group)
#   -> (plain decode runs as a graph, cascade runs as a graph)
GraphFit = Callable[[int, int, int], tuple[bool, bool]]


@dataclass
class CascadeCostModel:
    kv_row_s: float  # seconds to read one token's K and V, all layers
    cascade_extra_s: float  # cascade kernels' fixed cost over plain decode, per step
    eager_penalty_s: float  # eager decode step minus its graph replay
    graph_fit: GraphFit
    margin: float = 1.25  # savings must beat the costs by this factor

    def pays(self, saved_tokens: int, batch_size: int, shared_groups: int, max_members: int) -> bool:
        plain_graph, cascade_graph = self.graph_fit(batch_size, shared_groups, max_members)
        extra = self.cascade_extra_s + (self.eager_penalty_s if plain_graph and not cascade_graph else 0.0)
        return saved_tokens * self.kv_row_s > self.margin * extra


def time_cuda(fn: Callable[[], object], reps: int = 5) -> float:
    """Median seconds of fn() on the current stream (one untimed call first)."""
    fn()
    times: list[float] = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bytes_per_s(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_cuda(lambda: dst.copy_(src))
