"""EngineRequests: the Engine's request path. Normalizes a call into RequestSpecs, builds the Reqs
with their detokenizers and grammars, submits them to the scheduler thread, and delivers results
blocking, streamed, or to asyncio; an abandoned stream aborts its request."""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import Any, cast

from .constrained import attach_grammars, wait_grammars, wait_grammars_async
from .engine_inbox import AbortRequest, AddRequests, EngineInbox
from .engine_inputs import RequestSpec, check_sglang_kwargs, normalize_requests
from .loop_mailbox import LoopMailbox, coalesce_chunks
from .model_config import ModelConfig
from .model_runner import ModelRunner
from .prepared_call import PreparedCall
from .request import OutputSink, Req
from .scheduler import Scheduler
from .tokenizer import IncrementalDetokenizer


class EngineRequests:
    """Mixed into Engine, which sets these attributes in its constructor."""

    tokenizer: Any
    model_config: ModelConfig
    runner: ModelRunner
    scheduler: Scheduler
    eos_token_ids: frozenset[int]
    _inbox: EngineInbox
    _tok_lock: threading.Lock
    _live_rids: set[str]
    _rid_lock: threading.Lock
    _closed: bool
    _pin_ids: Iterator[int]

    # ---- request construction ---------------------------------------------------------
    def _make_reqs(self, specs: list[RequestSpec], sink_for: Callable[[int], OutputSink]) -> list[Req]:
        reqs = []
        for k, spec in enumerate(specs):
            reqs.append(
                Req(
                    rid=spec.rid,
                    input_ids=spec.input_ids,
                    params=spec.params,
                    sink=self._releasing_rid(spec.rid, sink_for(k)),
                    detok=IncrementalDetokenizer(
                        self.tokenizer,
                        spec.params.skip_special_tokens,
                        spec.params.spaces_between_special_tokens,
                    ),
                    eos_token_ids=self.eos_token_ids,
                    return_logprob=spec.return_logprob,
                    logprob_start_len=spec.logprob_start_len,
                    top_logprobs_num=spec.top_logprobs_num,
                    stream=spec.stream,
                    pin_handle=spec.pin_handle,
                )
            )
        self._attach_grammars(reqs)
        return reqs

    def _releasing_rid(self, rid: str, sink: OutputSink) -> OutputSink:
        def deliver(item: dict[str, Any]) -> None:
            if item["meta_info"]["finish_reason"] is not None:
                with self._rid_lock:
                    self._live_rids.discard(rid)
            sink(item)

        return deliver

    def _attach_grammars(self, reqs: list[Req]) -> None:
        attach_grammars(self, reqs)  # compiles start off the scheduler thread

    def _specs(
        self, prompt: Any, sampling_params: Any, input_ids: Any, rid: Any, **kw: Any
    ) -> tuple[list[RequestSpec], bool]:
        if self._closed:
            raise RuntimeError("engine is shut down")
        with self._tok_lock:
            specs, single = normalize_requests(
                self.tokenizer,
                self.model_config,
                self.runner.allocator.size,
                prompt,
                sampling_params,
                input_ids,
                rid,
                **kw,
            )
        if "draft" not in self.scheduler.spec.proposers and any(
            s.params.speculative_algorithm == "draft" for s in specs
        ):
            raise ValueError(
                "speculative_algorithm='draft' needs an engine started with a draft model "
                "(speculative_draft_model_path)"
            )
        return specs, single

    def _submit(self, reqs: list[Req]) -> None:
        """Hand the requests to the scheduler thread."""
        wait_grammars(reqs)  # the caller waits for its grammars; a bad one raises ValueError here
        self._reserve_rids(reqs)
        self._put(reqs)

    def _reserve_rids(self, reqs: list[Req]) -> None:
        """A rid may be in flight once: an abort names requests by rid, so a second one would be
        aborted with the first."""
        rids = {r.rid for r in reqs}
        with self._rid_lock:
            taken = sorted(rids & self._live_rids)
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already in flight; give each request its own")
            self._live_rids |= rids

    def _put(self, reqs: list[Req]) -> None:
        try:
            self._inbox.put(AddRequests(reqs))
        except RuntimeError:
            with self._rid_lock:
                self._live_rids -= {r.rid for r in reqs}
            raise

    def _prepare(self, specs: list[RequestSpec], single: bool) -> PreparedCall:
        call = PreparedCall(len(specs), single)
        call.reqs = self._make_reqs(specs, call.sink_for)
        wait_grammars(call.reqs)  # a bad grammar raises ValueError in the caller's thread
        return call

    # ---- public API -------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | None = False,
        logprob_start_len: int | None = -1,
        top_logprobs_num: int | None = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **sglang_kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        check_sglang_kwargs("generate", sglang_kwargs)
        specs, single = self._specs(
            prompt,
            sampling_params,
            input_ids,
            rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            stream=stream,
        )
        if stream:
            return self._stream_sync(specs)
        call = self._prepare(specs, single)
        self.submit_prepared([call])
        return call.wait()

    def prepare_generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        rid: str | list[str] | None = None,
        **logprob: bool | int | list[bool] | list[int] | None,
    ) -> PreparedCall:
        """A blocking generate call, validated and built (grammars compiled, errors raised here) but
        not yet handed to the scheduler: `submit_prepared` hands several such calls over as one
        arrival, so calls that different threads make at about the same time start together.
        `logprob`: generate's return_logprob, logprob_start_len and top_logprobs_num."""
        unknown = sorted(set(logprob) - {"return_logprob", "logprob_start_len", "top_logprobs_num"})
        if unknown:
            raise TypeError(f"prepare_generate() got an unexpected keyword argument {unknown[0]!r}")
        specs, single = self._specs(None, sampling_params, input_ids, rid, **logprob)
        return self._prepare(specs, single)

    def submit_prepared(self, calls: list[PreparedCall]) -> None:
        """Hand the calls' requests to the scheduler thread in one message. A call whose request id
        is already in flight, or one made after shutdown, fails alone: its wait() raises."""
        taken: list[PreparedCall] = []
        for call in calls:
            try:
                self._reserve_rids(call.reqs)
                taken.append(call)
            except ValueError as e:
                call.fail(e)
        if not taken:
            return
        try:
            self._put([r for call in taken for r in call.reqs])
        except RuntimeError as e:
            for call in taken:
                call.fail(e)

    def _stream_sync(self, specs: list[RequestSpec]) -> Iterator[dict[str, Any]]:
        q: queue.Queue[dict[str, Any]] = queue.Queue()
        reqs = self._make_reqs(specs, lambda k: _indexed(q.put, k, len(specs)))
        self._submit(reqs)
        return RequestStream(q, [partial(self.abort_request, r.rid) for r in reqs])

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | None = False,
        logprob_start_len: int | None = -1,
        top_logprobs_num: int | None = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **sglang_kwargs: Any,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        check_sglang_kwargs("async_generate", sglang_kwargs)
        specs, single = self._specs(
            prompt,
            sampling_params,
            input_ids,
            rid,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            stream=stream,
        )
        loop = asyncio.get_running_loop()
        # a stream's requests share one queue, their chunks tagged with "index" when there are several
        queues: list[asyncio.Queue[dict[str, Any]]] = [
            asyncio.Queue() for _ in specs[: 1 if stream else None]
        ]
        box = LoopMailbox.for_loop(loop)  # one wake-up of the loop per batch of results
        reqs = self._make_reqs(
            specs,
            lambda k: _indexed(partial(box.post, queues[0 if stream else k]), k, len(specs) if stream else 1),
        )
        await wait_grammars_async(reqs)
        self._submit(reqs)
        if stream:
            return AsyncRequestStream(queues[0], [partial(self.abort_request, r.rid) for r in reqs])
        try:
            outs = [await q.get() for q in queues]
        except asyncio.CancelledError:
            for r in reqs:
                self.abort_request(r.rid)
            raise
        return outs[0] if single else outs

    def pin_prefix(self, input_ids: list[int]) -> int:
        """Prefill input_ids into the cache and keep them locked until unpin_prefix(handle)."""
        handle = next(self._pin_ids)
        specs, _ = self._specs(None, {"max_new_tokens": 0}, input_ids, f"pin-{uuid.uuid4().hex}")
        specs[0].pin_handle = handle
        call = self._prepare(specs, single=True)
        self.submit_prepared([call])
        out = cast(dict[str, Any], call.wait())
        if out["meta_info"]["finish_reason"]["type"] == "abort":
            raise RuntimeError(f"pin_prefix failed: {out['meta_info']['finish_reason'].get('message')}")
        return handle

    def abort_request(self, rid: str) -> None:
        if not self._closed:
            self._inbox.put(AbortRequest(rid))


def _indexed(put: Callable[[Any], None], k: int, n: int) -> OutputSink:
    """The sink of request k of n: its chunks tagged with "index" k when n > 1 (SGLang's shape)."""
    return put if n == 1 else (lambda item: put({**item, "index": k}))


class _AbortOnDrop:
    """The reader of a stream of one or more requests (chunks tagged with "index" when several):
    it ends when every request has finished, and closing it before that, or dropping it (read or
    not), aborts the unfinished ones, so an abandoned stream never runs on to max_new_tokens."""

    def __init__(self, aborts: list[Callable[[], None]]) -> None:
        self._aborts = aborts
        self._open = set(range(len(aborts)))  # the requests not finished (empty: the stream ended)

    def _seen(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if chunk["meta_info"]["finish_reason"] is not None:
            self._open.discard(chunk.get("index", 0))
        return chunk

    def close(self) -> None:
        unfinished, self._open = sorted(self._open), set()
        for k in unfinished:
            self._aborts[k]()

    def __del__(self) -> None:
        self.close()


class RequestStream(_AbortOnDrop):
    """A streamed request's chunks, to its finish."""

    def __init__(self, q: queue.Queue[dict[str, Any]], aborts: list[Callable[[], None]]) -> None:
        super().__init__(aborts)
        self._q = q

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self._open:
            raise StopIteration
        return self._seen(self._q.get())


class AsyncRequestStream(_AbortOnDrop):
    """RequestStream for asyncio: chunks that arrived together are read as one."""

    def __init__(self, q: asyncio.Queue[dict[str, Any]], aborts: list[Callable[[], None]]) -> None:
        super().__init__(aborts)
        self._q = q

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self._open:
            raise StopAsyncIteration
        try:
            chunk = coalesce_chunks(await self._q.get(), self._q)
        except BaseException:  # cancelled while waiting: the request goes with the reader
            self.close()
            raise
        return self._seen(chunk)

    async def aclose(self) -> None:
        self.close()
