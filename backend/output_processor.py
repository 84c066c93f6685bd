"""OutputProcessor: reads a launched step's results on the host — appends each sampled token (the
grammar accepts it, jump-forward may add forced tokens), checks stops, detokenizes and streams,
records logprobs, shares finished prompts with the cache, and finishes requests (KV to the cache
or the free list, the final result to the caller). Promises: every finished request gets exactly
one final result (its last stream chunk, or the whole output)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .logprob_text import LENGTH_KEY, OUTPUT_LISTS
from .model_runner import ScheduledItem
from .request import Req
from .sampler import record_token
from .step_output import LaunchedStep, LogprobRows

if TYPE_CHECKING:
    from .cache_manager import CacheManager
    from .request_queues import RequestQueues
    from .scheduler_config import SchedulerConfig, SchedulerStats
    from .speculative import Speculator
    from .speculative_verify import Verdict


class OutputProcessor:
    def __init__(
        self,
        queues: RequestQueues,
        kv: CacheManager,
        cfg: SchedulerConfig,
        stats: SchedulerStats,
        spec: Speculator | None = None,
    ) -> None:
        self.queues = queues
        self.kv = kv
        self.cfg = cfg
        self.stats = stats
        self.spec = spec

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
                self.kv.cache_unfinished(req, item.start + len(item.token_ids))
        for req in step.prefill_only:
            if not req.finished:
                req.finished_reason = {"type": "length", "length": 0}
                self.finish(req)
        if step.verdicts is not None:
            for k, (req, verdict) in enumerate(zip(step.gen, step.verdicts)):
                if not req.finished:
                    self._append_verified(
                        req, verdict, step.drafted[k], step.out_logprobs.get(k), k < plan.num_decode
                    )
        tokens = step.tokens_host.tolist() if step.tokens_host is not None else []
        for k, (req, tok) in enumerate(zip(step.gen, tokens)):
            if req.finished:
                continue
            if k in step.out_logprobs:
                top = req.output_top_logprobs if req.top_logprobs_num > 0 else None
                step.out_logprobs[k].record(req.output_token_logprobs, top)
            self._append_token(req, tok, was_running=self.cfg.overlap or k < plan.num_decode)
        for i in range(plan.num_decode, len(plan.reqs)):  # share a finished prompt now, not at its end
            req, item = plan.reqs[i], plan.items[i]
            # forced (jump-forward) tokens are output: cached when the request ends, like decoded
            # ones, not after every jump (each insert walks the tree with the whole sequence)
            prompt = item.start < len(req.input_ids)
            if prompt and plan.samples[i] and not req.finished and req.req_pool_idx is not None:
                self.kv.cache_unfinished(req, item.start + len(item.token_ids))

    def _append_token(self, req: Req, tok: int, was_running: bool) -> None:
        req.output_ids.append(tok)
        record_token(req, tok)
        self.stats.generated_tokens += 1
        if len(req.output_ids) == 1:
            self.stats.observe_first_token(time.perf_counter() - req.created)
        step_ids = [tok]
        if req.grammar is not None:  # accept; jump-forward may append forced tokens (backend/constrained.py)
            step_ids = req.grammar.accept_and_jump(req, tok, self.stats)
        if req.stream or req.stops_on_text:  # otherwise the text is decoded once, at the end
            req.detok.add(step_ids)
        req.check_finished(step_ids[-1], self.cfg.context_len)
        if req.finished:
            self.finish(req)
            return
        q = self.queues
        if req.seq_len - req.kv_len > 1:  # forced tokens: one extend step through the prefill path
            if was_running:
                q.running.remove(req)
            q.waiting.appendleft(req)
        elif not was_running:
            q.running.append(req)
        if req.stream:
            self._emit_chunk(req)

    def _append_verified(
        self, req: Req, verdict: Verdict, drafted: int, logprobs: LogprobRows | None, was_running: bool
    ) -> None:
        """A verify step's tokens, one by one as plain decoding would append them (stops, stop
        strings and max_new_tokens end the run exactly where they would); the KV of rejected
        drafts is freed first, so a request that finishes caches only verified tokens."""
        fed = req.all_ids[-1:] + verdict.tokens[:-1]  # the tokens whose KV this step computed
        start = req.kv_len - drafted - 1
        self.kv.truncate(req, start + 1 + verdict.accepted)
        if self.spec is not None:
            self.spec.observe(req, drafted, verdict.accepted)
        for j, tok in enumerate(verdict.tokens):
            if logprobs is not None:
                logprobs.row(j).record(
                    req.output_token_logprobs, req.output_top_logprobs if req.top_logprobs_num > 0 else None
                )
            self._append_token(req, tok, was_running)
            if req.finished:
                return
            was_running = True
            if req.all_ids[start : start + j + 2] != fed[: j + 2] or req.seq_len - req.kv_len > 1:
                break  # jump-forward rewrote the output: keep only KV that still matches it
        ids = req.all_ids
        valid = next((i for i, t in enumerate(fed) if start + i >= len(ids) or ids[start + i] != t), len(fed))
        self.kv.truncate(req, min(req.kv_len, start + valid))

    def finish(self, req: Req) -> None:
        """End a request whose finished_reason is set: out of the queues, KV released (cached
        unless aborted), text flushed, its final result delivered."""
        self.queues.discard(req)
        aborted = bool(req.finished_reason) and req.finished_reason.get("type") == "abort"  # type: ignore[union-attr]
        if req.req_pool_idx is not None:
            self.kv.release(req, cache_it=not aborted)
        if self.spec is not None:
            self.spec.finished(req)
        self.stats.num_finished += 1
        if aborted:
            self.stats.num_aborted += 1
        req.detok.add(req.output_ids[len(req.detok.ids) :])
        req.detok.flush()
        req.cut_stop_token()
        req.e2e_latency = time.perf_counter() - req.created
        self._emit_chunk(req) if req.stream else req.sink(self._final_output(req))

    @staticmethod
    def _emit_chunk(req: Req) -> None:
        text = req.streamable_text()
        delta = text[req.stream_sent :]
        req.stream_sent = len(text)
        new_ids = req.output_ids[req.ids_sent :]
        req.ids_sent = len(req.output_ids)
        if delta or new_ids or req.finished:
            req.sink({"text": delta, "output_ids": new_ids, "meta_info": _chunk_meta(req)})

    @staticmethod
    def _final_output(req: Req) -> dict[str, Any]:
        return {"text": req.final_text(), "output_ids": list(req.output_ids), "meta_info": req.meta_info()}

    @staticmethod
    def _record_input_logprobs(req: Req, item: ScheduledItem, rows: LogprobRows | None) -> None:
        if item.start == 0 and req.logprob_start_len == 0:
            req.input_token_logprobs.append((None, req.input_ids[0], None))
            req.input_top_logprobs.append(None)
        if rows is not None:
            rows.record(
                req.input_token_logprobs, req.input_top_logprobs if req.top_logprobs_num > 0 else None
            )


def _chunk_meta(req: Req) -> dict[str, Any]:
    """A stream chunk's meta: like its text and ids, its output logprob lists hold only the
    chunk's own entries (copies: the scheduler goes on appending to the request's lists), with
    the running count under LENGTH_KEY, as SGLang's incremental streams carry them. The input
    lists are shared as they are: a chunk comes after the prefill, which completed them."""
    meta = req.meta_info()
    if not req.return_logprob:
        return meta
    end = len(req.output_token_logprobs)
    for key in OUTPUT_LISTS:
        if key in meta:
            meta[key] = meta[key][req.logprobs_sent : end]
    meta[LENGTH_KEY] = end
    req.logprobs_sent = end
    return meta
