"""Scheduler: the step loop of continuous batching — schedule (BatchPlanner) → launch (one forward
and its sampling, queued on the device) → process (OutputProcessor). With overlap on, step t is
processed after step t+1 is launched (its decode inputs are step t's tokens, read on the device),
so host work hides behind the GPU; a step whose sampling reads state the previous tokens change
(grammar, penalties) samples once those are processed. The KV and the cache belong to the
CacheManager. It owns every Req's state; no request is ever dropped."""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from .batch_planner import BatchPlanner
from .cache_manager import CacheManager
from .forward_batch import to_device
from .kv_pool import ReqToTokenTable
from .model_runner import ModelRunner, ScheduledItem
from .output_processor import OutputProcessor
from .prefix_cache import BasePrefixCache, CacheHandle
from .request import Req
from .request_queues import RequestQueues
from .sampler import Sampler
from .schedule_policy import SchedulePolicy
from .scheduler_config import SchedulerConfig, SchedulerStats
from .slow_phase_watch import SlowPhaseWatch
from .speculative import Speculator
from .step_output import LaunchedStep, LogprobRows, StepPlan, to_host

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, runner: ModelRunner, cache: BasePrefixCache, sampler: Sampler, cfg: SchedulerConfig
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.sampler = sampler
        self.cfg = cfg
        self.stats = SchedulerStats()
        self.queues = RequestQueues()
        self.kv = CacheManager(cache, runner.allocator, runner.req_table)
        self.policy = SchedulePolicy(cache)
        self.spec = Speculator(cfg.speculative, sampler, self.stats, cfg.context_len, runner.fast_rows)
        self.planner = BatchPlanner(
            self.queues, self.kv, cfg, self.stats, sampler, self.policy, self._drain_inflight, self.spec
        )
        self.outputs = OutputProcessor(self.queues, self.kv, cfg, self.stats, self.spec)
        self.inflight: LaunchedStep | None = None  # launched, not yet processed (overlap only)
        self.slow_phase = SlowPhaseWatch.from_env()

    # ---- what the engine reads ----------------------------------------------------------
    @property
    def waiting(self) -> deque[Req]:
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def chunked(self) -> Req | None:
        return self.queues.chunked

    @property
    def pinned(self) -> dict[int, CacheHandle]:
        return self.kv.pinned

    @property
    def req_table(self) -> ReqToTokenTable:
        return self.kv.req_table

    def add_request(self, req: Req) -> None:
        self.queues.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.queues or self.inflight)

    def live_requests(self) -> list[Req]:
        """Every request the scheduler holds, once: queued, running, prefilling or in flight."""
        held = [*self.queues.held(), *(self.inflight.plan.reqs if self.inflight else [])]
        return list({id(r): r for r in held}.values())

    def abort(self, rid: str) -> None:
        for req in self.live_requests():
            if req.rid == rid and not req.finished:
                req.finished_reason = {"type": "abort", "message": "aborted by request"}
                self.finish(req)

    def finish(self, req: Req) -> None:
        self.outputs.finish(req)

    def unpin(self, handle: int) -> None:
        self.kv.unpin(handle)

    # ---- one step ---------------------------------------------------------------------
    def step(self) -> bool:
        """schedule → launch → process. With overlap, what is launched here is processed by the
        next call, after that call has launched its own step."""
        if self.inflight is not None and any(r.rewrites_on_accept for r in self.inflight.gen):
            self._process_step(self._take_inflight())  # its token may add forced tokens: not schedulable yet
        if self.inflight is not None and self.spec.wants_settled(self.inflight.gen):
            self._process_step(self._take_inflight())  # drafts extend its tokens: known first
        t0 = time.perf_counter()
        self.slow_phase.arm()
        try:
            plan = self.schedule()
        except Exception as e:  # a planning bug would otherwise fail the same way every step, forever
            self.fail_all(f"internal error while scheduling: {type(e).__name__}: {e}")
            raise
        finally:
            self.slow_phase.disarm()
        t1 = time.perf_counter()
        self._add_time("host_schedule_us", t1 - t0)
        launched = None
        if plan is not None:
            self.slow_phase.arm()
            try:
                launched = self.launch(plan)
                self._add_time("host_launch_us", time.perf_counter() - t1)
            except Exception as e:
                self.fail_plan(plan, f"internal error: {type(e).__name__}: {e}")
                raise
            finally:
                self.slow_phase.disarm()
        previous = self._take_inflight()
        verifying = launched is not None and launched.verdicts is not None
        if self.cfg.overlap and not verifying:  # a verify step is processed at once, never overlapped
            self.inflight = launched
        try:
            self._process_step(previous)
        finally:
            if launched is not None and launched.deferred_rows is not None:
                self._sample_deferred_or_fail(launched)
        if not self.cfg.overlap or verifying:
            self._process_step(launched)
        if plan is not None and plan.num_decode == len(plan.items):
            drafts = sum(len(d) for d in plan.drafts.drafts) if plan.drafts is not None else 0
            self.spec.record_step(verifying, len(plan.items), drafts, time.perf_counter() - t0)
        return plan is not None

    def _sample_deferred_or_fail(self, step: LaunchedStep) -> None:
        """Deferred sampling; if it raises (a grammar or sampler error), the step is dropped and
        its requests end with the error, rather than the next step meeting it unsampled."""
        try:
            self._launch_deferred_sampling(step)
        except Exception as e:
            if self.inflight is step:
                self.inflight = None
            self.fail_plan(step.plan, f"internal error: {type(e).__name__}: {e}")
            raise

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

    def fail_all(self, message: str) -> None:
        """End every held request with an abort result (each one's cleanup may itself fail: its
        caller still hears about it)."""
        for req in self.live_requests():
            if req.finished:
                continue
            req.finished_reason = {"type": "abort", "message": message}
            try:
                self.finish(req)
            except Exception:
                logger.exception("cleanup of %s failed", req.rid)
                self.queues.discard(req)
                req.sink({"text": "", "output_ids": [], "meta_info": req.meta_info()})

    def fail_plan(self, plan: StepPlan, message: str) -> None:
        """A step raised: end the step's requests with an abort result and free their KV
        (including the slots this step gave them), so no caller waits forever."""
        for req in plan.reqs:
            if not req.finished:
                req.finished_reason = {"type": "abort", "message": message}
                self.finish(req)

    # ---- launch: the forward and its sampling, queued on the device --------------------
    def launch(self, plan: StepPlan) -> LaunchedStep:
        prev = self.inflight
        fb = self.runner.build_batch(
            plan.items, torch.cat(plan.slots), prev.tokens if prev else None, plan.cascade, plan.num_decode
        )
        logits = self.runner.forward(fb)
        self.stats.forward_passes += 1
        if fb.cascade_plan is not None:
            self.stats.extra["cascade_steps"] = self.stats.extra.get("cascade_steps", 0) + 1
        step = LaunchedStep(plan, [], None, None, [])
        picks: list[int] = []
        row = 0
        for i, (req, item, samples) in enumerate(zip(plan.reqs, plan.items, plan.samples)):
            n_rows = len(item.logit_offsets)
            k = len(plan.drafts.drafts[i]) if plan.drafts is not None and i < plan.num_decode else 0
            if req.wants_input_logprobs:
                self._launch_input_logprobs(step, i, req, item, logits[row : row + n_rows - int(samples)])
            if samples and req.params.max_new_tokens > 0 and req.pin_handle is None:
                step.gen.append(req)
                step.drafted.append(k)
                picks.extend(range(row + n_rows - 1 - k, row + n_rows))
            elif samples:  # prefill-only: scoring prompts, or pinning a prefix
                step.prefill_only.append(req)
            row += n_rows
        if plan.drafts is not None:
            self._launch_verify(step, logits[to_device(picks, logits.device)])
            step.seal(logits.device)
            return step
        if step.gen and any(r.needs_fresh_state for r in step.gen):
            # sampled after the previous step is processed (step()); the gather makes a normal
            # tensor the sampler may edit in place (the forward's output is inference-mode)
            step.deferred_rows = logits[to_device(picks, logits.device)]
            return step
        if step.gen:  # decode-only steps return exactly the rows to sample: no gather
            # (a logit bias is added in place: it needs the gather's normal tensor)
            whole = picks[-1] == len(picks) - 1 == logits.shape[0] - 1
            whole = whole and not any(r.params.logit_bias for r in step.gen)
            self._launch_sampling(step, logits if whole else logits[to_device(picks, logits.device)])
        step.seal(logits.device)
        return step

    def _launch_sampling(self, step: LaunchedStep, rows: torch.Tensor) -> None:
        raw = rows.clone() if any(r.return_logprob for r in step.gen) else None
        tokens = self.sampler.sample(rows, step.gen)
        step.tokens, step.tokens_host = tokens, to_host(tokens)
        for k, req in enumerate(step.gen):
            if raw is not None and req.return_logprob:
                step.out_logprobs[k] = LogprobRows.launch(
                    raw[k : k + 1], tokens[k : k + 1], req.top_logprobs_num
                )
            # with overlap, a prompt that just finished joins the decoders before its token is
            # known: the next step reads that token on the device (LaunchedStep.token_positions)
            if self.cfg.overlap and k >= step.plan.num_decode and not req.finished:
                self.queues.running.append(req)

    def _launch_verify(self, step: LaunchedStep, rows: torch.Tensor) -> None:
        """Verify the step's drafts (one host sync: the step is processed right after)."""
        plan = step.plan
        assert plan.drafts is not None
        index = {id(r): i for i, r in enumerate(plan.reqs[: plan.num_decode])}
        drafts = [plan.drafts.drafts[index[id(r)]] if id(r) in index else [] for r in step.gen]
        masks = [plan.drafts.masks[index[id(r)]] if id(r) in index else None for r in step.gen]
        raw = rows.clone() if any(r.return_logprob for r in step.gen) else None
        step.verdicts = self.spec.verify(rows, step.gen, drafts, masks)
        r0 = 0
        for k, (req, verdict) in enumerate(zip(step.gen, step.verdicts)):
            if raw is not None and req.return_logprob:
                n = len(verdict.tokens)
                step.out_logprobs[k] = LogprobRows.launch(
                    raw[r0 : r0 + n], to_device(verdict.tokens, raw.device), req.top_logprobs_num
                )
            r0 += len(drafts[k]) + 1

    def _launch_input_logprobs(
        self, step: LaunchedStep, i: int, req: Req, item: ScheduledItem, rows: torch.Tensor
    ) -> None:
        if rows.shape[0] == 0:
            return
        first = max(max(req.logprob_start_len - 1, 0), item.start)
        targets = to_device(req.input_ids[first + 1 : first + 1 + rows.shape[0]], rows.device)
        step.in_logprobs[i] = LogprobRows.launch(rows, targets, req.top_logprobs_num)

    # ---- the parts ----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        return self.planner.schedule(self.inflight)

    def process(self, step: LaunchedStep) -> None:
        self.outputs.process(step)

    def _drain_inflight(self) -> bool:
        """Process the in-flight step now (the planner needs its requests settled); False if none."""
        if self.inflight is None:
            return False
        self._process_step(self._take_inflight())
        return True
