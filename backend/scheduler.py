"""Scheduler: continuous batching over the KV pool and the prefix cache. Each step reads
schedule → run → process: pick the decode requests and prompt chunks that fit (evicting from
the cache, then retracting, when slots run out), run one forward, then sample, stream and
finish. It owns every Req's state; no request is ever dropped."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.backend.model_runner import ModelRunner, ScheduledItem
from radixlm.backend.request import Req
from radixlm.backend.sampler import Sampler, record_token
from radixlm.backend.schedule_policy import SchedulePolicy

logger = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    context_len: int
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    decode_reserve: int = 8  # slots per running request kept free before admitting new prompts


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


@dataclass
class StepPlan:
    reqs: list[Req]
    items: list[ScheduledItem]
    slots: list[torch.Tensor]  # concatenated: one KV slot per new token, in item order
    samples: list[bool]  # does this item end at its sequence's last token?


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: Any, sampler: Sampler, cfg: SchedulerConfig) -> None:
        self.runner = runner
        self.cache = cache
        self.sampler = sampler
        self.cfg = cfg
        self.allocator = runner.allocator
        self.req_table = runner.req_table
        self.policy = SchedulePolicy(cache)
        self.stats = SchedulerStats()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # prefill done, decoding
        self.chunked: Req | None = None  # a prompt part-way through chunked prefill
        self.pinned: dict[int, Any] = {}  # handle → locked radix node (engine.pin_prefix)

    # ---- queue management -------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def abort(self, rid: str) -> None:
        for req in [*self.waiting, *self.running, *([self.chunked] if self.chunked else [])]:
            if req.rid == rid and not req.finished:
                req.finished_reason = {"type": "abort", "message": "aborted by request"}
                self._finish(req)

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> bool:
        plan = self.schedule()
        if plan is None:
            return False
        try:
            fb = self.runner.build_batch(plan.items, torch.cat(plan.slots))
            logits = self.runner.forward(fb)
            self.stats.forward_passes += 1
            self.process(plan, logits)
        except Exception as e:
            self.fail_plan(plan, f"internal error: {type(e).__name__}: {e}")
            raise
        return True

    def fail_plan(self, plan: StepPlan, message: str) -> None:
        """A step raised: end the step's requests with an abort result and free their KV
        (including the slots this step gave them), so no caller waits forever."""
        for req, item in zip(plan.reqs, plan.items):
            if req.finished:
                continue
            if req.req_pool_idx is not None:
                req.kv_len = max(req.kv_len, item.start + len(item.token_ids))
            req.finished_reason = {"type": "abort", "message": message}
            self._finish(req)

    def schedule(self) -> StepPlan | None:
        plan = StepPlan([], [], [], [])
        self._schedule_decode(plan)
        self._schedule_prefill(plan, self.cfg.chunked_prefill_size - len(plan.items))
        return plan if plan.items else None

    def _schedule_decode(self, plan: StepPlan) -> None:
        self._ensure_decode_slots()
        if not self.running:
            return
        slots = self.allocator.alloc(len(self.running))
        assert slots is not None, "decode slots were ensured above"
        rows = [r.req_pool_idx for r in self.running]
        cols = [r.kv_len for r in self.running]
        self.req_table.write_many(rows, cols, slots)  # one scatter for the whole decode batch
        for k, req in enumerate(self.running):
            plan.reqs.append(req)
            plan.items.append(ScheduledItem(rows[k], [req.output_ids[-1] if req.output_ids else req.input_ids[-1]], cols[k], [0]))  # type: ignore[arg-type]
            plan.samples.append(True)
        plan.slots.append(slots)  # KV slots of the step's tokens, in item order

    def _ensure_decode_slots(self) -> None:
        while self.running:
            short = len(self.running) - self.allocator.available_size()
            if short <= 0:
                return
            self.cache.evict(short)
            if len(self.running) > self.allocator.available_size():
                self._retract(self._pick_victim())

    def _pick_victim(self) -> Req:
        # The request that loses the least work: fewest outputs, then the longest prompt. A prompt
        # part-way through chunked prefill goes first, so it can never starve running decodes.
        candidates = self.running + ([self.chunked] if self.chunked else [])
        return min(candidates, key=lambda r: (len(r.output_ids), -len(r.input_ids)))

    def _retract(self, req: Req) -> None:
        """Free a running request's KV and requeue it first; it recomputes later, with its
        sampling state (outputs, penalties, RNG) intact, so its output does not change."""
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self._release_kv(req, cache_it=False)
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.waiting.appendleft(req)
        logger.info("retracted %s (%d tokens) to free KV", req.rid, req.seq_len)

    def _schedule_prefill(self, plan: StepPlan, budget: int) -> None:
        inflight = [self.chunked] if self.chunked else []
        candidates = inflight + self.policy.order(list(self.waiting), inflight, budget)
        reserve = sum(self._decode_reserve(r) for r in self.running)
        active = len(self.running)
        for req in candidates:
            if budget <= 0 or active >= self.cfg.max_running_requests:
                break
            if req.req_pool_idx is None and not self._place(req):
                break
            slots = self._alloc_for_prefill(min(req.seq_len - req.kv_len, budget), reserve)
            if slots is None:
                if req is not self.chunked:
                    self._release_kv(req, cache_it=False)
                break
            n = int(slots.numel())
            active += 1
            self._add_prefill_item(plan, req, n, slots)
            budget -= n
            reserve += self._decode_reserve(req)
            if req is not self.chunked:
                self.waiting.remove(req)
            self.chunked = req if req.kv_len + n < req.seq_len else None
            if self.chunked is req:
                break

    def _decode_reserve(self, req: Req) -> int:
        return min(self.cfg.decode_reserve, max(req.params.max_new_tokens - len(req.output_ids), 1))

    def _alloc_for_prefill(self, want: int, reserve: int) -> torch.Tensor | None:
        """Slots for up to `want` prompt tokens, keeping `reserve` free for running decodes
        (unless nothing runs). Evicts from the cache only what is needed; None if nothing fits."""
        room = self.allocator.available_size() + self.cache.evictable_size()
        n = min(want, room - reserve if self.running else room)
        if n <= 0:
            return None
        if n > self.allocator.available_size():
            self.cache.evict(n - self.allocator.available_size())
        n = min(n, self.allocator.available_size())
        return self.allocator.alloc(n) if n > 0 else None

    def _place(self, req: Req) -> bool:
        """Give a request a table row and its cached prefix (locked)."""
        row = self.req_table.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        prefix_slots, node = self.cache.match_prefix(req.all_ids[: req.max_prefix_len()])
        self.cache.inc_lock_ref(node)
        req.last_node = node
        req.prefix_len = req.kv_len = int(prefix_slots.numel())
        if prefix_slots.numel():
            self.req_table.write(row, 0, prefix_slots)
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = req.prefix_len
            self.stats.cached_prompt_tokens += req.prefix_len
            self.sampler.prepare(req)
        return True

    def _add_prefill_item(self, plan: StepPlan, req: Req, n: int, slots: torch.Tensor) -> None:
        start = req.kv_len
        self.req_table.write(req.req_pool_idx, start, slots)  # type: ignore[arg-type]
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

    # ---- after the forward -------------------------------------------------------------
    def process(self, plan: StepPlan, logits: torch.Tensor) -> None:
        row = 0
        to_sample: list[tuple[Req, int]] = []
        decoding = set(self.running)
        prefilled = [r for r, s in zip(plan.reqs, plan.samples) if s and r not in decoding]
        for req, item, samples in zip(plan.reqs, plan.items, plan.samples):
            n_rows = len(item.logit_offsets)
            req.kv_len = item.start + len(item.token_ids)
            if req.wants_input_logprobs:
                self._record_input_logprobs(req, item, logits[row : row + n_rows - int(samples)])
            if samples:
                to_sample.append((req, row + n_rows - 1))
            elif not req.finished:
                self._cache_unfinished(req)
            row += n_rows
        if to_sample:
            self._sample_and_advance(to_sample, logits)
        for req in prefilled:  # share a finished prompt now, not only when its request ends
            if not req.finished and req.req_pool_idx is not None:
                self._cache_unfinished(req)

    def _sample_and_advance(self, to_sample: list[tuple[Req, int]], logits: torch.Tensor) -> None:
        gen: list[tuple[Req, int]] = []
        for req, i in to_sample:
            if req.finished:
                continue
            req.input_logprobs_done = True
            if req.params.max_new_tokens > 0 and req.pin_handle is None:
                gen.append((req, i))
            else:  # prefill-only: scoring prompts, or pinning a prefix
                req.finished_reason = {"type": "length", "length": 0}
                self._finish(req)
        if not gen:
            return
        reqs = [r for r, _ in gen]
        rows = logits[torch.tensor([i for _, i in gen], device=logits.device)]
        raw = rows.clone() if any(r.return_logprob for r in reqs) else None
        tokens = self.sampler.sample(rows, reqs).tolist()  # the step's one host sync
        for k, (req, tok) in enumerate(zip(reqs, tokens)):
            if raw is not None and req.return_logprob:
                self._record_output_logprob(req, raw[k], tok)
            self._append_token(req, tok)

    def _append_token(self, req: Req, tok: int) -> None:
        req.output_ids.append(tok)
        record_token(req, tok)
        self.stats.generated_tokens += 1
        step_ids = [tok]
        if req.grammar is not None:  # accept; jump-forward may append forced tokens (backend/constrained.py)
            step_ids = req.grammar.accept_and_jump(req, tok, self.stats)
        if req.stream or req.params.stop:  # otherwise the text is decoded once, at the end
            req.detok.add(step_ids)
        req.check_finished(step_ids[-1], self.cfg.context_len)
        if req.finished:
            self._finish(req)
            return
        if req.seq_len - req.kv_len > 1:  # forced tokens: one extend step through the prefill path
            if req in self.running:
                self.running.remove(req)
            self.waiting.appendleft(req)
        elif req not in self.running:
            self.running.append(req)
        if req.stream:
            self._emit_chunk(req)

    def _finish(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.chunked is req:
            self.chunked = None
        if req.req_pool_idx is not None:
            self._release_kv(req, cache_it=req.finished_reason.get("type") != "abort")  # type: ignore[union-attr]
        self.stats.num_finished += 1
        if req.finished_reason and req.finished_reason.get("type") == "abort":
            self.stats.num_aborted += 1
        req.detok.add(req.output_ids[len(req.detok.ids) :])
        req.detok.flush()
        self._emit_chunk(req) if req.stream else req.sink(self._final_output(req))

    def _release_kv(self, req: Req, cache_it: bool) -> None:
        """Give the request's KV to the cache (or free it) and unlock its prefix."""
        row = req.req_pool_idx
        assert row is not None
        slots = self.req_table.table[row, : req.kv_len].to("cpu")
        if cache_it:
            ids = req.all_ids[: req.kv_len]
            self.cache.insert(ids, slots)
            if req.pin_handle is not None:
                _, node = self.cache.match_prefix(ids)
                self.cache.inc_lock_ref(node)
                self.pinned[req.pin_handle] = node
        else:
            own = slots[req.prefix_len :]
            self.allocator.free(own)
        self.cache.dec_lock_ref(req.last_node)
        self.req_table.free(row)
        req.req_pool_idx, req.last_node, req.prefix_len, req.kv_len = None, None, 0, 0

    def _cache_unfinished(self, req: Req) -> None:
        """After a prompt chunk: put the computed prefix in the cache and lock it there, so
        others can share it while the rest is still being prefilled."""
        if self.cache.disabled:  # NoPrefixCache.insert would free the request's own slots
            return
        row = req.req_pool_idx
        assert row is not None
        ids = req.all_ids[: req.kv_len]
        self.cache.insert(ids, self.req_table.table[row, : req.kv_len].to("cpu"))
        slots, node = self.cache.match_prefix(ids)
        self.req_table.write(row, 0, slots)
        self.cache.dec_lock_ref(req.last_node)
        self.cache.inc_lock_ref(node)
        req.last_node, req.prefix_len = node, int(slots.numel())

    def unpin(self, handle: int) -> None:
        node = self.pinned.pop(handle, None)
        if node is not None:
            self.cache.dec_lock_ref(node)

    # ---- outputs ----------------------------------------------------------------------
    def _emit_chunk(self, req: Req) -> None:
        text = req.streamable_text()
        delta = text[req.stream_sent :]
        req.stream_sent = len(text)
        new_ids = req.output_ids[req.ids_sent :]
        req.ids_sent = len(req.output_ids)
        if delta or new_ids or req.finished:
            req.sink({"text": delta, "output_ids": new_ids, "meta_info": req.meta_info()})

    @staticmethod
    def _final_output(req: Req) -> dict[str, Any]:
        return {"text": req.final_text(), "output_ids": list(req.output_ids), "meta_info": req.meta_info()}

    def _record_input_logprobs(self, req: Req, item: ScheduledItem, rows: torch.Tensor) -> None:
        if item.start == 0 and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.input_ids[0], None))
            req.input_top_logprobs.append(None)
        if rows.shape[0] == 0:
            return
        lo = max(req.logprob_start_len - 1, 0)
        positions = range(max(lo, item.start), max(lo, item.start) + rows.shape[0])
        targets = torch.tensor([req.input_ids[p + 1] for p in positions], device=rows.device)
        self._append_logprobs(req, rows, targets, req.input_token_logprobs, req.input_top_logprobs)

    def _record_output_logprob(self, req: Req, row: torch.Tensor, tok: int) -> None:
        target = torch.tensor([tok], device=row.device)
        self._append_logprobs(req, row.unsqueeze(0), target, req.output_token_logprobs, req.output_top_logprobs)

    @staticmethod
    def _append_logprobs(req: Req, rows: torch.Tensor, targets: torch.Tensor, out: list, top_out: list) -> None:
        lp = torch.log_softmax(rows.float(), dim=-1)
        chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        out.extend((c, t, None) for c, t in zip(chosen, targets.tolist()))
        if req.top_logprobs_num > 0:
            vals, ids = lp.topk(req.top_logprobs_num, dim=-1)
            for v_row, i_row in zip(vals.tolist(), ids.tolist()):
                top_out.append([(v, i, None) for v, i in zip(v_row, i_row)])
