"""The server's one way into the engine: admission control (limits, back-pressure), request
ids, abort-on-cancel (a cancelled handler or a dropped client always aborts its engine request,
so its KV is freed) and latency metrics; engine stream chunks are increments already."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from ..engine_process import EngineDied
from ..sampling_params import DEFAULT_MAX_NEW_TOKENS
from .metrics import ServerMetrics


@dataclass
class ServerLimits:
    """Limits enforced before any engine work (None → derived from the model's context)."""

    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    max_pending_requests: int = 256
    max_samples_per_request: int = 64
    retry_after_s: int = 1
    drain_timeout_s: float = 30.0


class Overloaded(Exception):
    """Too many pending engine requests (→ 503 with Retry-After)."""


@dataclass
class Seq:
    """One engine request: a single prompt and one sample."""

    prompt: dict[str, Any]
    sampling_params: dict[str, Any]
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    index: int = 0
    log_metrics: bool = True  # false: kept out of the latency histograms (SGLang's log_metrics)
    group: str | None = None  # an id /abort_request takes for this sequence and its siblings


class Runner:
    def __init__(self, engine: Any, limits: ServerLimits, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.limits = limits
        self.metrics = metrics
        self.accepting = True
        self.inflight: dict[str, Seq] = {}
        self.groups: dict[str, list[str]] = {}
        self._reserved = 0
        self._sources: list[tuple[Callable[[], int], Callable[[], int]]] = []
        context = int(getattr(engine.model_config, "context_len", 0) or 0) or None
        self.context_len = context
        self.max_prompt_tokens = limits.max_prompt_tokens or (context - 1 if context else None)
        self.max_new_tokens = limits.max_new_tokens or context

    def rest_of_context(self, prompt_tokens: int) -> int | None:
        """max_new_tokens for a request that names none where the API's default is the rest of
        the context (OpenAI chat, as vLLM and SGLang serve it): what the context leaves after the
        prompt, within a configured max_new_tokens limit. None (the engine's default) where the
        context length is unknown and no limit is set."""
        if self.context_len is None:
            return self.limits.max_new_tokens
        rest = max(self.context_len - prompt_tokens, 1)
        return min(rest, self.limits.max_new_tokens) if self.limits.max_new_tokens else rest

    def engine_exit(self) -> str | None:
        """Why the engine's process exited on its own (an EngineProcess killed or crashed), or
        None while it runs; the in-process Engine has no process of its own to lose."""
        reason = getattr(self.engine, "exit_reason", None)
        return reason if isinstance(reason, str) else None

    # ------------------------------------------------------------ admission

    def check(self, seqs: list[Seq]) -> None:
        """Validate limits for a whole HTTP request; raise ValueError, EngineDied or Overloaded."""
        if len(seqs) > self.limits.max_samples_per_request:
            raise ValueError(
                f"request asks for {len(seqs)} sequences (prompts × n); "
                f"the limit is {self.limits.max_samples_per_request}"
            )
        if len(seqs) > self.limits.max_pending_requests:  # a 503 would invite retries that never pass
            raise ValueError(
                f"request asks for {len(seqs)} sequences (prompts × n), more than the "
                f"{self.limits.max_pending_requests} the server admits at once "
                "(--max-pending-requests): it can never be admitted"
            )
        for seq in seqs:
            self._check_seq(seq)
        reason = self.engine_exit()
        if reason is not None:
            raise EngineDied(reason)
        if not self.accepting:
            raise Overloaded("server is shutting down")
        if self._reserved + len(seqs) > self.limits.max_pending_requests:
            self.metrics.rejected.inc()
            raise Overloaded(
                f"{self._reserved} requests pending; the limit is {self.limits.max_pending_requests}"
            )

    def _check_seq(self, seq: Seq) -> None:
        if seq.rid in self.inflight:
            raise ValueError(f"request id {seq.rid!r} is already running")
        n_tokens = self.count_prompt_tokens(seq.prompt)
        if n_tokens == 0 and "input_ids" in seq.prompt:
            raise ValueError("input_ids must not be empty")
        if self.max_prompt_tokens is not None and n_tokens > self.max_prompt_tokens:
            raise ValueError(f"prompt has {n_tokens} tokens; the limit is {self.max_prompt_tokens}")
        if "max_new_tokens" not in seq.sampling_params and self.limits.max_new_tokens is not None:
            # the engine's default must not slip past a configured limit
            seq.sampling_params["max_new_tokens"] = min(DEFAULT_MAX_NEW_TOKENS, self.limits.max_new_tokens)
        max_new = seq.sampling_params.get("max_new_tokens")
        if max_new is not None and self.max_new_tokens is not None and max_new > self.max_new_tokens:
            raise ValueError(
                f"{max_new} new tokens asked (max_tokens / max_completion_tokens / max_new_tokens) "
                f"exceeds the limit {self.max_new_tokens}"
            )

    def count_prompt_tokens(self, prompt: dict[str, Any]) -> int:
        if "input_ids" in prompt:
            return len(prompt["input_ids"])
        return len(self.engine.tokenizer.encode(prompt["text"]))

    def reserve(self, seqs: list[Seq]) -> None:
        """Take the pending slots (after check) and register the ids, and the groups' ids, for
        /abort_request."""
        self._reserved += len(seqs)
        for seq in seqs:
            self.inflight[seq.rid] = seq
            if seq.group is not None:
                self.groups.setdefault(seq.group, []).append(seq.rid)

    def _release(self, seq: Seq) -> None:
        if self.inflight.pop(seq.rid, None) is not None:
            self._reserved -= 1

    def release_all(self, seqs: list[Seq]) -> None:
        """Final guard of a handler: any of its sequences still registered (never started, or
        cancelled before their own cleanup ran) is aborted and released."""
        for seq in seqs:
            if seq.rid in self.inflight:
                self.engine.abort_request(seq.rid)
                self._release(seq)

    def abort(self, rid: str) -> bool:
        """Abort a running request by its id (or the id of a whole HTTP request)."""
        rids = self.groups.get(rid) or ([rid] if rid in self.inflight else [])
        for r in rids:
            self.engine.abort_request(r)
        return bool(rids)

    def abort_all(self) -> int:
        rids = list(self.inflight)
        for rid in rids:
            self.engine.abort_request(rid)
        return len(rids) + sum(abort() for _, abort in self._sources)

    def add_work_source(self, count: Callable[[], int], abort: Callable[[], int]) -> None:
        """Other engine work the server runs (program runs): counted by `busy`, aborted by abort_all."""
        self._sources.append((count, abort))

    @property
    def num_pending(self) -> int:
        """Admitted engine requests not finished (what the admission limit counts)."""
        return self._reserved

    def busy(self) -> int:
        """Everything shutdown must wait for: pending requests plus running programs."""
        return self._reserved + sum(count() for count, _ in self._sources)

    # ------------------------------------------------------------ running

    async def run(self, seq: Seq, stream: bool) -> AsyncGenerator[dict[str, Any], None]:
        """Chunks of one engine request, each with only the new text/ids/logprobs; the last one
        has meta_info.finish_reason. Cancelling the consumer aborts the engine request."""
        finished = failed = False
        start = time.perf_counter()
        try:
            if stream:
                async with aclosing(self._stream_chunks(seq, start)) as chunks:
                    async for chunk in chunks:
                        finished = chunk["meta_info"].get("finish_reason") is not None
                        yield chunk
            else:
                out = await self.engine.async_generate(stream=False, rid=seq.rid, **self._kwargs(seq))
                finished = True
                yield out
            if seq.log_metrics:
                self.metrics.observe_finished(seq_e2e=time.perf_counter() - start)
        except Exception:
            failed = True  # refused or failed: not a client abort
            raise
        finally:
            if not finished:
                self.engine.abort_request(seq.rid)
                if not failed:  # the consumer left (disconnect, cancel) before the end
                    self.metrics.client_aborts.inc()
            self._release(seq)
            group = seq.group
            if group is not None and not any(r in self.inflight for r in self.groups.get(group, [])):
                self.groups.pop(group, None)

    def _kwargs(self, seq: Seq) -> dict[str, Any]:
        kw: dict[str, Any] = {"sampling_params": seq.sampling_params}
        if "input_ids" in seq.prompt:
            kw["input_ids"] = seq.prompt["input_ids"]
        else:
            kw["prompt"] = seq.prompt["text"]
        if seq.return_logprob:
            kw.update(
                return_logprob=True,
                logprob_start_len=seq.logprob_start_len,
                top_logprobs_num=seq.top_logprobs_num,
            )
        return kw

    async def _stream_chunks(self, seq: Seq, start: float) -> AsyncGenerator[dict[str, Any], None]:
        agen = await self.engine.async_generate(stream=True, rid=seq.rid, **self._kwargs(seq))
        last = start
        n_out = 0
        try:
            async for chunk in agen:
                t = time.perf_counter()
                new_ids = len(chunk.get("output_ids") or []) if seq.log_metrics else 0
                if new_ids:
                    if n_out == 0:
                        self.metrics.ttft.observe(t - start)
                    else:
                        self.metrics.itl.observe((t - last) / new_ids)
                    last = t
                n_out += new_ids
                yield chunk  # the engine's chunks hold only their own text, ids and logprobs
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                await asyncio.shield(_quiet_close(aclose))


async def _quiet_close(aclose: Any) -> None:
    try:
        await aclose()
    except Exception:  # noqa: BLE001 - closing an engine iterator must not mask the real error
        pass


async def run_to_end(runner: Runner, seq: Seq) -> dict[str, Any]:
    """Run one sequence without streaming and return the engine's final dict."""
    result: dict[str, Any] = {}
    async for chunk in runner.run(seq, stream=False):
        result = chunk
    return result
