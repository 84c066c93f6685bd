"""SchedulePolicy: the order in which waiting requests are admitted. Cache-aware: longest cached
prefix first (FCFS among equals, and FCFS outright when the queue is long); in-batch dedup: a
request whose not-yet-cached prefix is shared with one admitted ahead of it waits a step and
then reuses that request's KV. Never starves the head: the first candidate is never held back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .prefix_cache import BasePrefixCache
from .radix_cache import RadixCache


class _SharedPrefixes:
    """The token sequences admitted so far in one scheduling pass (a scratch radix tree)."""

    def __init__(self) -> None:
        self._tree = RadixCache()  # its 'slots' are all 0: only the token paths matter

    def add(self, key: list[int]) -> None:
        self._tree.insert(key, torch.zeros(len(key), dtype=torch.int64))

    def shared_len(self, key: list[int]) -> int:
        return self._tree.cached_len(key)


class SchedulePolicy:
    def __init__(
        self,
        cache: BasePrefixCache,
        lpm_queue_limit: int = 128,
        dedup_min_tokens: int = 32,
    ) -> None:
        self.cache = cache
        self.lpm_queue_limit = lpm_queue_limit
        self.dedup_min_tokens = dedup_min_tokens
        self.num_deferred = 0  # requests held back a step by in-batch dedup (a counter for stats)

    def order(self, waiting: list[Any], inflight: Sequence[Any] = (), budget: int | None = None) -> list[Any]:
        """Admission order for this step. `inflight`: requests whose prompt is still being
        prefilled (their uncached tokens count as 'being computed'); `budget`: prompt tokens
        the step can take — dedup looks no further than that. Held-back requests are left out
        of the returned list (they stay in the queue)."""
        if not self.cache.shares_prefixes or not waiting:
            return waiting
        lpm = len(waiting) <= self.lpm_queue_limit
        matched = {id(r): self._cached_len(r) for r in waiting} if lpm else {}
        ordered = sorted(waiting, key=lambda r: -matched[id(r)]) if lpm else list(waiting)
        if self.dedup_min_tokens <= 0:
            return ordered
        return self._dedup(ordered, matched, inflight, budget)

    def _cached_len(self, req: Any) -> int:
        return self.cache.cached_len(req.all_ids[: req.max_prefix_len()])

    def _dedup(
        self, ordered: list[Any], matched: dict[int, int], inflight: Sequence[Any], budget: int | None
    ) -> list[Any]:
        shared = _SharedPrefixes()
        for req in inflight:
            shared.add(req.all_ids)
        kept: list[Any] = []
        planned = 0  # uncached tokens of the requests kept so far
        for i, req in enumerate(ordered):
            if budget is not None and planned >= budget:
                return kept + ordered[i:]
            cached = matched[id(req)] if id(req) in matched else self._cached_len(req)
            key = req.all_ids[: req.max_prefix_len()]
            if (kept or inflight) and shared.shared_len(key) - cached >= self.dedup_min_tokens:
                self.num_deferred += 1
                continue
            shared.add(req.all_ids)
            kept.append(req)
            planned += req.seq_len - cached
        return kept
