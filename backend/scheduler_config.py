"""The scheduler's configuration (fixed limits, and switches the engine may flip between steps)
and its counters (what get_stats reports). Promises: plain data; every scheduler part shares the
same two objects, so a switch flipped on the config is seen by all of them at the next step."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cascade_cost import CascadeCostModel


@dataclass
class SchedulerConfig:
    context_len: int
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    decode_reserve: int = 8  # slots per running request kept free before admitting new prompts
    overlap: bool = False  # process step t after launching step t+1
    enable_cascade: bool = False  # decode batches sharing long prefixes use cascade attention
    cascade_cost: CascadeCostModel | None = None  # measured per-step decision (None: fixed thresholds)


@dataclass
class SchedulerStats:
    cached_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    num_retractions: int = 0
    forward_passes: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    extra: dict[str, int] = field(default_factory=dict)
