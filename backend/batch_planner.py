"""BatchPlanner: what one step runs — every running request's next decode token (in cascade-group
order when cascade pays) and the prompt chunks that fit beside them, within the prefill budget
and the running-request limit. When slots run out it evicts from the cache, then retracts the
request that loses the least work. Invariant: it never drops a request (a retracted one goes back
to the front of the queue) and never retracts one that an in-flight step still uses."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import cascade_groups
from .cascade_groups import CascadeGrouper
from .model_runner import ScheduledItem
from .request import Req
from .step_output import LaunchedStep, StepPlan

if TYPE_CHECKING:
    from .cache_manager import CacheManager
    from .request_queues import RequestQueues
    from .sampler import Sampler
    from .schedule_policy import SchedulePolicy
    from .scheduler_config import SchedulerConfig, SchedulerStats
    from .speculative import Speculator

logger = logging.getLogger(__name__)


class BatchPlanner:
    def __init__(
        self,
        queues: RequestQueues,
        kv: CacheManager,
        cfg: SchedulerConfig,
        stats: SchedulerStats,
        sampler: Sampler,
        policy: SchedulePolicy,
        drain_inflight: Callable[[], bool],
        spec: Speculator | None = None,
    ) -> None:
        """drain_inflight: process the in-flight step now; False when there is none. spec: drafts
        for decode items (speculative decoding), when any request may speculate."""
        self.queues = queues
        self.kv = kv
        self.cfg = cfg
        self.stats = stats
        self.sampler = sampler
        self.policy = policy
        self.drain_inflight = drain_inflight
        self.spec = spec
        # by id(req): positions of the tokens the in-flight step samples (its requests' last
        # tokens, not on the host yet); empty once that step is processed
        self.ahead: dict[int, int] = {}
        self.grouper = (
            CascadeGrouper()
        )  # the cascade grouping of the last decode batch, reused while it holds

    def schedule(self, inflight: LaunchedStep | None) -> StepPlan | None:
        """The next step's plan, given the step still in flight (overlap), if any."""
        self.ahead = inflight.token_positions() if inflight is not None else {}
        plan = StepPlan([], [], [], [])
        self._schedule_decode(plan)
        tokens = sum(len(it.token_ids) for it in plan.items)  # decode items carry drafts when verifying
        self._schedule_prefill(plan, self.cfg.chunked_prefill_size - tokens)
        return plan if plan.items else None

    # ---- decode -------------------------------------------------------------------------
    def decodes_next(self, req: Req) -> bool:
        """False for a request whose in-flight token is certainly its last (length limits):
        scheduling it again would compute a token nobody reads."""
        if id(req) not in self.ahead:
            return True
        return len(req.output_ids) + 1 < req.params.max_new_tokens and req.seq_len + 1 < self.cfg.context_len

    def _schedule_decode(self, plan: StepPlan) -> None:
        self._ensure_decode_slots()
        batch = [r for r in self.queues.running if self.decodes_next(r)]
        if not batch:
            return
        drafts = self.spec.draft(batch, self.ahead) if self.spec is not None else None
        if drafts is not None and self._schedule_verify(plan, batch, drafts.drafts):
            plan.drafts = drafts
            return
        batch = self._order_for_cascade(plan, batch)
        slots = self.kv.alloc(len(batch))
        assert slots is not None, "decode slots were ensured above"
        rows = [r.req_pool_idx for r in batch]
        cols = [r.kv_len for r in batch]
        self.kv.req_table.write_many(rows, cols, slots)  # type: ignore[arg-type]  # one scatter for the batch
        for k, req in enumerate(batch):
            # a token still in flight is written -1 - its index in that step's samples, which the
            # model runner reads on the device
            k_ahead = self.ahead.get(id(req))
            tok = -1 - k_ahead if k_ahead is not None else (req.output_ids or req.input_ids)[-1]
            plan.reqs.append(req)
            plan.items.append(ScheduledItem(rows[k], [tok], cols[k], [0]))  # type: ignore[arg-type]
            plan.samples.append(True)
            req.kv_len += 1
        plan.slots.append(slots)  # KV slots of the step's tokens, in item order
        plan.num_decode = len(batch)

    def _schedule_verify(self, plan: StepPlan, batch: list[Req], drafts: list[list[int]]) -> bool:
        """Decode items that also carry draft tokens (k + 1 positions each, all returning logits),
        when free slots hold the drafts (never evicting for them); False: plain decode instead."""
        slots = self.kv.alloc(len(batch) + sum(len(d) for d in drafts))
        if slots is None:
            return False
        at = 0
        for req, d in zip(batch, drafts):
            row, col, n = req.req_pool_idx, req.kv_len, 1 + len(d)
            assert row is not None and id(req) not in self.ahead, "drafts follow a known last token"
            self.kv.req_table.write(row, col, slots[at : at + n])
            tok = (req.output_ids or req.input_ids)[-1]
            plan.reqs.append(req)
            plan.items.append(ScheduledItem(row, [tok, *d], col, list(range(n))))
            plan.samples.append(True)
            req.kv_len += n
            at += n
        plan.slots.append(slots)
        plan.num_decode = len(batch)
        return True

    def _order_for_cascade(self, plan: StepPlan, batch: list[Req]) -> list[Req]:
        """Members of a group sharing a long cached prefix run contiguously, with the groups in
        plan.cascade; unchanged when cascade is off or would not pay."""
        if not self.cfg.enable_cascade or len(batch) < 2:
            return batch
        cost = self.cfg.cascade_cost
        if cost is None:
            groups = self.grouper.find(batch)
        else:  # the measured cost model decides, not the fixed thresholds
            groups = self.grouper.find(
                batch,
                min_shared_len=cascade_groups.MIN_KERNEL_SHARED_LEN,
                min_saved_fraction=0.0,
                min_saved_tokens=0,
            )
            if groups is not None and not cost.pays(groups.saved_tokens, len(batch), *groups.shared_shape()):
                self.stats.extra["cascade_declined_steps"] = (
                    self.stats.extra.get("cascade_declined_steps", 0) + 1
                )
                groups = None
        if groups is None:
            return batch
        plan.cascade = groups
        return [batch[i] for i in groups.order]

    def _ensure_decode_slots(self) -> None:
        running = self.queues.running
        while running:
            need = sum(1 for r in running if self.decodes_next(r))
            if self.kv.make_room(need):
                return
            if self.drain_inflight():  # never retract a request an in-flight step still uses
                self.ahead = {}
                continue
            self._retract(self._pick_victim())

    def _pick_victim(self) -> Req:
        # The request that loses the least work: fewest outputs, then the longest prompt. A prompt
        # part-way through chunked prefill goes first, so it can never starve running decodes.
        q = self.queues
        candidates = q.running + ([q.chunked] if q.chunked else [])
        return min(candidates, key=lambda r: (len(r.output_ids), -len(r.input_ids)))

    def _retract(self, req: Req) -> None:
        """Free a running request's KV and requeue it first; it recomputes later, with its
        sampling state (outputs, penalties, RNG) intact, so its output does not change."""
        q = self.queues
        if req is q.chunked:
            q.chunked = None
        else:
            q.running.remove(req)
        self.kv.release(req, cache_it=False)
        req.num_retractions += 1
        self.stats.num_retractions += 1
        q.waiting.appendleft(req)
        logger.info("retracted %s (%d tokens) to free KV", req.rid, req.seq_len)

    # ---- prefill ------------------------------------------------------------------------
    def _schedule_prefill(self, plan: StepPlan, budget: int) -> None:
        q = self.queues
        inflight = [q.chunked] if q.chunked else []
        # a running request's forced (jump-forward) tokens: its KV is held, so it goes first, and
        # the prompt policy (cached-prefix order, dedup) has nothing to decide for it
        held = [r for r in q.waiting if r.req_pool_idx is not None]
        fresh = [r for r in q.waiting if r.req_pool_idx is None] if held else list(q.waiting)
        candidates = inflight + held + self.policy.order(fresh, inflight, budget)
        held_back = self._embedding_hold()
        reserve = held_back + sum(self._decode_reserve(r) for r in q.running)
        max_active = self.cfg.max_running_requests - (1 if held_back else 0)
        active = len(q.running)
        for req in candidates:
            if budget <= 0 or active >= max_active:
                break
            if req.req_pool_idx is None and not self._admit(req):
                break
            want = min(req.seq_len - req.kv_len, budget)
            slots = self.kv.alloc_for_prefill(want, reserve, bool(q.running) or held_back > 0)
            if slots is None:
                if req is not q.chunked:
                    self.kv.release(req, cache_it=False)
                break
            n = int(slots.numel())
            active += 1
            completes = self._add_prefill_item(plan, req, n, slots)
            budget -= n
            reserve += self._decode_reserve(req)
            if req is not q.chunked:
                q.waiting.remove(req)
            q.chunked = None if completes else req
            if not completes:
                break

    def _embedding_hold(self) -> int:
        """KV tokens (and so one table row) new prompts must leave to a waiting embedding
        (embeddings.embed_when_room): while requests run, which will free room, or while the room
        is there now, for its next try; 0 when waiting cannot help it (pinned prefixes hold it)."""
        need = max(self.queues.embedding_holds.values(), default=0)
        return need if need and (self.queues.running or self.kv.room() >= need) else 0

    def _decode_reserve(self, req: Req) -> int:
        return min(self.cfg.decode_reserve, max(req.params.max_new_tokens - len(req.output_ids), 1))

    def _admit(self, req: Req) -> bool:
        """Place the request (table row, cached prefix); on its first admission count its cache
        hit and prepare its sampling state."""
        if not self.kv.place(req):
            return False
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = req.prefix_len
            self.stats.cached_prompt_tokens += req.prefix_len
            self.sampler.prepare(req)
        return True

    def _add_prefill_item(self, plan: StepPlan, req: Req, n: int, slots: torch.Tensor) -> bool:
        """Tokens [kv_len, kv_len + n) of req as one item; True when they end its sequence."""
        start = req.kv_len
        self.kv.req_table.write(req.req_pool_idx, start, slots)  # type: ignore[arg-type]
        completes = start + n == req.seq_len
        offsets: list[int] = []
        if req.wants_input_logprobs:
            lo = max(req.logprob_start_len - 1, 0)
            offsets = [p - start for p in range(max(lo, start), min(len(req.input_ids) - 1, start + n))]
        if completes:
            offsets.append(n - 1)
        if start < len(req.input_ids):
            self.stats.computed_prompt_tokens += min(start + n, len(req.input_ids)) - start
        plan.reqs.append(req)
        plan.items.append(ScheduledItem(req.req_pool_idx, req.all_ids[start : start + n], start, offsets))  # type: ignore[arg-type]
        plan.slots.append(slots)
        plan.samples.append(completes)
        req.kv_len = start + n
        return completes
