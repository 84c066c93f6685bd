"""LaunchedStep: one forward whose device work is queued but whose results the host has not read
yet — the sampled tokens and any logprobs, each with a non-blocking copy to (pinned) host memory
and one event behind them. Promises: `wait()` is the step's only host sync; nothing here reads a
device tensor synchronously, so the next step can be queued before this one is processed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cascade_groups import CascadeGroups
    from .model_runner import ScheduledItem
    from .request import LogprobEntry, Req, TopLogprobs
    from .speculative import DraftPlan
    from .speculative_verify import Verdict


@dataclass
class StepPlan:
    reqs: list[Req]
    items: list[ScheduledItem]
    slots: list[torch.Tensor]  # concatenated: one KV slot per new token, in item order
    samples: list[bool]  # does this item end at its sequence's last token?
    num_decode: int = 0  # the first num_decode items are decode steps of running requests
    cascade: CascadeGroups | None = None  # the decode batch's groups when it shares prefixes
    drafts: DraftPlan | None = None  # draft tokens of the decode items (a verify step)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous device→host copy (pinned memory on CUDA); valid after the step's event."""
    return t.to("cpu", non_blocking=True) if t.is_cuda else t


@dataclass
class LogprobRows:
    """Log-probabilities of `targets` under n rows of logits, plus the rows' top-k (host copies)."""

    chosen: torch.Tensor  # [n] float32
    targets: torch.Tensor  # [n] int64
    top_values: torch.Tensor | None  # [n, k]
    top_ids: torch.Tensor | None  # [n, k]

    @classmethod
    def launch(cls, rows: torch.Tensor, targets: torch.Tensor, top_k: int) -> LogprobRows:
        lp = torch.log_softmax(rows.float(), dim=-1)
        chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
        top = lp.topk(top_k, dim=-1) if top_k > 0 else None
        return cls(
            to_host(chosen),
            to_host(targets),
            None if top is None else to_host(top.values),
            None if top is None else to_host(top.indices),
        )

    def row(self, j: int) -> LogprobRows:
        """Row j alone (a verify step records one accepted token at a time)."""
        tv, ti = self.top_values, self.top_ids
        return LogprobRows(
            self.chosen[j : j + 1],
            self.targets[j : j + 1],
            None if tv is None else tv[j : j + 1],
            None if ti is None else ti[j : j + 1],
        )

    def record(self, out: list[LogprobEntry], top_out: list[TopLogprobs] | None) -> None:
        """Append (logprob, token, None) triples (and top-k lists) — host data only."""
        out.extend((c, t, None) for c, t in zip(self.chosen.tolist(), self.targets.tolist()))
        if top_out is not None and self.top_values is not None and self.top_ids is not None:
            for v_row, i_row in zip(self.top_values.tolist(), self.top_ids.tolist()):
                top_out.append([(v, i, None) for v, i in zip(v_row, i_row)])


@dataclass
class LaunchedStep:
    plan: StepPlan
    gen: list[Req]  # requests that sample a token this step, in token order
    tokens: torch.Tensor | None  # [len(gen)] int64 on the device: the next step's placeholders read it
    tokens_host: torch.Tensor | None
    prefill_only: list[Req]  # prompts that finish at their last prefill (scoring, pinning)
    in_logprobs: dict[int, LogprobRows] = field(default_factory=dict)  # by plan item index
    out_logprobs: dict[int, LogprobRows] = field(default_factory=dict)  # by gen index
    event: torch.cuda.Event | None = None
    deferred_rows: torch.Tensor | None = None  # logits rows to sample once the previous step is processed
    verdicts: list[Verdict] | None = None  # a verify step: each gen request's emitted tokens
    drafted: list[int] = field(default_factory=list)  # by gen index: drafts verified

    def token_positions(self) -> dict[int, int]:
        """By id(req): where each sampling request's token sits in `tokens`. The next step reads
        those tokens on the device, as its decode inputs, before the host knows them."""
        return {id(r): k for k, r in enumerate(self.gen)} if self.tokens is not None else {}

    def seal(self, device: torch.device | None = None) -> None:
        """Record the event behind every copy queued so far (call once, after the last copy).
        `device` is the forward's device: a step that samples nothing (prompt scoring, pinning)
        still has logprob copies in flight, and reading them before the event is a race."""
        on_cuda = device.type == "cuda" if device is not None else False
        if on_cuda or (self.tokens is not None and self.tokens.is_cuda):
            self.event = torch.cuda.Event()
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
