"""SchedulePolicy: the order in which waiting requests are admitted. First come, first served;
the cache-aware (longest prefix match) order builds on this class."""

from __future__ import annotations

from typing import Any


class SchedulePolicy:
    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def order(self, waiting: list[Any]) -> list[Any]:
        return waiting
