"""Scheduler: continuous batching over the KV pool and the prefix cache. Each step reads
schedule → launch → process: pick the decode requests and prompt chunks that fit (evicting from
the cache, then retracting, when slots run out), queue one forward and its sampling on the device,
then read the tokens back to stream and finish. With overlap on, step t is processed after step
t+1 is launched (its decode inputs are step t's tokens, read on the device), so host work hides
behind the GPU. It owns every Req's state; no request is ever dropped."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from . import cascade_groups
from .cascade_cost import CascadeCostModel
from .forward_batch import to_device
from .model_runner import ModelRunner, ScheduledItem
from .request import Req
from .sampler import Sampler, record_token
from .schedule_policy import SchedulePolicy
from .step_output import LaunchedStep, LogprobRows, StepPlan, to_host

logger = logging.getLogger(__name__)


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
        self.inflight: LaunchedStep | None = None  # launched, not yet processed (overlap only)

    # ---- queue management -------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.inflight)

    def live_requests(self) -> list[Req]:
        """Every request the scheduler holds, once: queued, running, prefilling or in flight."""
        held = [*self.waiting, *self.running, *([self.chunked] if self.chunked else []),
                *(self.inflight.plan.reqs if self.inflight else [])]
        return list({id(r): r for r in held}.values())

    def abort(self, rid: str) -> None:
        for req in self.live_requests():
            if req.rid == rid and not req.finished:
                req.finished_reason = {"type": "abort", "message": "aborted by request"}
                self._finish(req)

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> bool:
        """schedule → launch → process. With overlap, what is launched here is processed by the
        next call, after that call has launched its own step."""
        if self.inflight is not None and any(r.rewrites_on_accept for r in self.inflight.gen):
            self._process_step(self._take_inflight())  # its token may add forced tokens: not schedulable yet
        t0 = time.perf_counter()
        plan = self.schedule()
        t1 = time.perf_counter()
        self._add_time("host_schedule_us", t1 - t0)
        launched = None
        if plan is not None:
            try:
                launched = self.launch(plan)
                self._add_time("host_launch_us", time.perf_counter() - t1)
            except Exception as e:
                self.fail_plan(plan, f"internal error: {type(e).__name__}: {e}")
                raise
        previous = self._take_inflight()
        if self.cfg.overlap:
            self.inflight = launched
        try:
            self._process_step(previous)
        finally:
            if launched is not None and launched.deferred_rows is not None:
                self._launch_deferred_sampling(launched)
        if not self.cfg.overlap:
            self._process_step(launched)
        return plan is not None

    def _launch_deferred_sampling(self, step: LaunchedStep) -> None:
        """Sample a step whose requests read state the previous step's tokens change (grammar
        masks, penalty counts, min_new_tokens): now that those tokens are processed, while the
        device still runs this step's forward."""
        rows, step.deferred_rows = step.deferred_rows, None
        assert rows is not None
        self.stats.extra["deferred_sampling_steps"] = self.stats.extra.get("deferred_sampling_steps", 0) + 1
        t0 = time.perf_counter()
        self._launch_sampling(step, rows)
        step.seal(rows.device)
        self._add_time("host_launch_us", time.perf_counter() - t0)

    def settle(self) -> None:
        """Process the in-flight step now (between steps, on the scheduler thread), so callers that
        need an idle engine (flush_cache) do not see a step that only holds finished requests."""
        self._process_step(self._take_inflight())

    def _take_inflight(self) -> LaunchedStep | None:
        step, self.inflight = self.inflight, None
        return step

    def _add_time(self, key: str, seconds: float) -> None:
        """Host time per phase, in the engine stats (where a step's time goes, at no cost)."""
        self.stats.extra[key] = self.stats.extra.get(key, 0) + int(seconds * 1e6)

    def _process_step(self, step: LaunchedStep | None) -> None:
        if step is None:
            return
        try:
            t0 = time.perf_counter()
            step.wait()  # the step's one host sync
            t1 = time.perf_counter()
            self.process(step)
            self._add_time("wait_device_us", t1 - t0)
            self._add_time("host_process_us", time.perf_counter() - t1)
        except Exception as e:
            self.fail_plan(step.plan, f"internal error: {type(e).__name__}: {e}")
            raise

    def fail_plan(self, plan: StepPlan, message: str) -> None:
        """A step raised: end the step's requests with an abort result and free their KV
        (including the slots this step gave them), so no caller waits forever."""
        for req in plan.reqs:
            if not req.finished:
                req.finished_reason = {"type": "abort", "message": message}
                self._finish(req)

    def schedule(self) -> StepPlan | None:
        plan = StepPlan([], [], [], [])
        self._schedule_decode(plan)
        self._schedule_prefill(plan, self.cfg.chunked_prefill_size - len(plan.items))
        return plan if plan.items else None

    def _decodes_next(self, req: Req) -> bool:
        """False for a request whose in-flight token is certainly its last (length limits):
        scheduling it again would compute a token nobody reads."""
        if req.pending < 0:
            return True
        return len(req.output_ids) + 1 < req.params.max_new_tokens and req.seq_len + 1 < self.cfg.context_len

    def _schedule_decode(self, plan: StepPlan) -> None:
        self._ensure_decode_slots()
        batch = [r for r in self.running if self._decodes_next(r)]
        if not batch:
            return
        batch = self._order_for_cascade(plan, batch)
        slots = self.allocator.alloc(len(batch))
        assert slots is not None, "decode slots were ensured above"
        rows = [r.req_pool_idx for r in batch]
        cols = [r.kv_len for r in batch]
        self.req_table.write_many(rows, cols, slots)  # type: ignore[arg-type]  # one scatter for the batch
        for k, req in enumerate(batch):
            # an in-flight token is a placeholder: -1 - its index in the in-flight step's samples
            tok = -1 - req.pending if req.pending >= 0 else (req.output_ids or req.input_ids)[-1]
            plan.reqs.append(req)
            plan.items.append(ScheduledItem(rows[k], [tok], cols[k], [0]))  # type: ignore[arg-type]
            plan.samples.append(True)
            req.kv_len += 1
        plan.slots.append(slots)  # KV slots of the step's tokens, in item order
        plan.num_decode = len(batch)

    def _order_for_cascade(self, plan: StepPlan, batch: list[Req]) -> list[Req]:
        """Members of a group sharing a long cached prefix run contiguously, with the groups in
        plan.cascade; unchanged when cascade is off or would not pay."""
        if not self.cfg.enable_cascade or len(batch) < 2:
            return batch
        cost = self.cfg.cascade_cost
        if cost is None:
            groups = cascade_groups.find_cascade_groups(batch)
        else:  # the measured cost model decides, not the fixed thresholds
            groups = cascade_groups.find_cascade_groups(batch, min_shared_len=cascade_groups.MIN_KERNEL_SHARED_LEN,
                                                        min_saved_fraction=0.0, min_saved_tokens=0)
            if groups is not None and not cost.pays(groups.saved_tokens, len(batch),
                                                    sum(1 for s in groups.shared_lens if s > 0)):
                self.stats.extra["cascade_declined_steps"] = self.stats.extra.get("cascade_declined_steps", 0) + 1
                groups = None
        if groups is None:
            return batch
        plan.cascade = groups
        return [batch[i] for i in groups.order]

    def _ensure_decode_slots(self) -> None:
        while self.running:
            need = sum(1 for r in self.running if self._decodes_next(r))
            short = need - self.allocator.available_size()
            if short <= 0:
                return
            self.cache.evict(short)
            if need <= self.allocator.available_size():
                return
            if self.inflight is not None:  # never retract a request an in-flight step still uses
                self._process_step(self._take_inflight())
                continue
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
            completes = self._add_prefill_item(plan, req, n, slots)
            budget -= n
            reserve += self._decode_reserve(req)
            if req is not self.chunked:
                self.waiting.remove(req)
            self.chunked = None if completes else req
            if not completes:
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

    def _add_prefill_item(self, plan: StepPlan, req: Req, n: int, slots: torch.Tensor) -> bool:
        """Tokens [kv_len, kv_len + n) of req as one item; True when they end its sequence."""
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
        req.kv_len = start + n
        return completes

    # ---- launch: the forward and its sampling, queued on the device --------------------
    def launch(self, plan: StepPlan) -> LaunchedStep:
        prev = self.inflight
        fb = self.runner.build_batch(plan.items, torch.cat(plan.slots), prev.tokens if prev else None,
                                     plan.cascade, plan.num_decode)
        logits = self.runner.forward(fb)
        self.stats.forward_passes += 1
        if "cascade_plan" in fb.extras:
            self.stats.extra["cascade_steps"] = self.stats.extra.get("cascade_steps", 0) + 1
        step = LaunchedStep(plan, [], None, None, [])
        picks: list[int] = []
        row = 0
        for i, (req, item, samples) in enumerate(zip(plan.reqs, plan.items, plan.samples)):
            n_rows = len(item.logit_offsets)
            if req.wants_input_logprobs:
                self._launch_input_logprobs(step, i, req, item, logits[row : row + n_rows - int(samples)])
            if samples and req.params.max_new_tokens > 0 and req.pin_handle is None:
                step.gen.append(req)
                picks.append(row + n_rows - 1)
            elif samples:  # prefill-only: scoring prompts, or pinning a prefix
                step.prefill_only.append(req)
            row += n_rows
        if step.gen and any(r.needs_fresh_state for r in step.gen):
            # sampled after the previous step is processed (step()); the gather makes a normal
            # tensor the sampler may edit in place (the forward's output is inference-mode)
            step.deferred_rows = logits[to_device(picks, logits.device)]
            return step
        if step.gen:  # decode-only steps return exactly the rows to sample: no gather
            whole = picks[-1] == len(picks) - 1 == logits.shape[0] - 1
            self._launch_sampling(step, logits if whole else logits[to_device(picks, logits.device)])
        step.seal(logits.device)
        return step

    def _launch_sampling(self, step: LaunchedStep, rows: torch.Tensor) -> None:
        raw = rows.clone() if any(r.return_logprob for r in step.gen) else None
        tokens = self.sampler.sample(rows, step.gen)
        step.tokens, step.tokens_host = tokens, to_host(tokens)
        for k, req in enumerate(step.gen):
            if raw is not None and req.return_logprob:
                step.out_logprobs[k] = LogprobRows.launch(raw[k : k + 1], tokens[k : k + 1], req.top_logprobs_num)
            if self.cfg.overlap:  # it decodes next step from this token, read on the device
                req.pending, req.pending_step = k, step
                if k >= step.plan.num_decode and not req.finished:  # a prompt that just finished joins the decoders
                    self.running.append(req)

    def _launch_input_logprobs(self, step: LaunchedStep, i: int, req: Req, item: ScheduledItem,
                               rows: torch.Tensor) -> None:
        if rows.shape[0] == 0:
            return
        first = max(max(req.logprob_start_len - 1, 0), item.start)
        targets = to_device(req.input_ids[first + 1 : first + 1 + rows.shape[0]], rows.device)
        step.in_logprobs[i] = LogprobRows.launch(rows, targets, req.top_logprobs_num)

    # ---- process: read the step's results on the host -----------------------------------
    def process(self, step: LaunchedStep) -> None:
        step.wait()  # the step's one host sync
        plan = step.plan
        for i, (req, item, samples) in enumerate(zip(plan.reqs, plan.items, plan.samples)):
            if req.finished:  # aborted (or failed) while the step ran
                continue
            if req.wants_input_logprobs:
                self._record_input_logprobs(req, item, step.in_logprobs.get(i))
            if samples:
                req.input_logprobs_done = True
            else:
                self._cache_unfinished(req, item.start + len(item.token_ids))
        for req in step.prefill_only:
            if not req.finished:
                req.finished_reason = {"type": "length", "length": 0}
                self._finish(req)
        tokens = step.tokens_host.tolist() if step.tokens_host is not None else []
        for k, (req, tok) in enumerate(zip(step.gen, tokens)):
            if req.pending_step is step:  # else a later launch already points it at its own step
                req.pending, req.pending_step = -1, None
            if req.finished:
                continue
            if k in step.out_logprobs:
                top = req.output_top_logprobs if req.top_logprobs_num > 0 else None
                step.out_logprobs[k].record(req.output_token_logprobs, top)
            self._append_token(req, tok, was_running=self.cfg.overlap or k < plan.num_decode)
        for i in range(plan.num_decode, len(plan.reqs)):  # share a finished prompt now, not at its end
            req, item = plan.reqs[i], plan.items[i]
            if plan.samples[i] and not req.finished and req.req_pool_idx is not None:
                self._cache_unfinished(req, item.start + len(item.token_ids))

    def _append_token(self, req: Req, tok: int, was_running: bool) -> None:
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
            if was_running:
                self.running.remove(req)
            self.waiting.appendleft(req)
        elif not was_running:
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
        """Give the request's KV to the cache (or free it) and unlock its prefix. Slots past its
        known tokens (written for an in-flight token) are freed, never cached."""
        row = req.req_pool_idx
        assert row is not None
        slots = self.req_table.read(row, 0, req.kv_len)
        keep = req.prefix_len
        if cache_it:
            keep = max(min(req.kv_len, req.seq_len), req.prefix_len)
            ids = req.all_ids[:keep]
            self.cache.insert(ids, slots[:keep])
            if req.pin_handle is not None:
                _, node = self.cache.match_prefix(ids)
                self.cache.inc_lock_ref(node)
                self.pinned[req.pin_handle] = node
        self.allocator.free(slots[keep:])
        self.cache.dec_lock_ref(req.last_node)
        self.req_table.free(row)
        req.req_pool_idx, req.last_node, req.prefix_len, req.kv_len = None, None, 0, 0
        req.pending, req.pending_step = -1, None

    def _cache_unfinished(self, req: Req, upto: int) -> None:
        """After a prompt chunk: put its first `upto` tokens (computed) in the cache and lock them
        there, so others can share them while the rest is still being prefilled."""
        if self.cache.disabled:  # NoPrefixCache.insert would free the request's own slots
            return
        row = req.req_pool_idx
        assert row is not None
        ids = req.all_ids[:upto]
        self.cache.insert(ids, self.req_table.read(row, 0, upto))
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

    @staticmethod
    def _record_input_logprobs(req: Req, item: ScheduledItem, rows: LogprobRows | None) -> None:
        if item.start == 0 and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.input_ids[0], None))
            req.input_top_logprobs.append(None)
        if rows is not None:
            rows.record(req.input_token_logprobs, req.input_top_logprobs if req.top_logprobs_num > 0 else None)
