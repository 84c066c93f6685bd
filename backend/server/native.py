"""Native, SGLang-compatible routes: /generate (text or input_ids, single or batch, SSE
streaming whose events carry, as SGLang's default streams do, the cumulative text, output_ids and
output logprob lists with their count `output_token_logprobs_length`, and end with
`data: [DONE]`), /health, /health_generate, /model_info, /get_load, /flush_cache, /abort_request.
/generate takes SGLang's other fields as sglang_fields.py states (sglang-router sends them)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..logprob_text import LENGTH_KEY, OUTPUT_LISTS, add_logprob_text
from .protocol import AbortRequest, GenerateRequest, SamplingParams, error_body
from .runner import Runner, Seq, run_to_end
from .streams import (
    SSE_DONE,
    gather_all,
    merge_streams,
    sse_response,
    stream_error_event,
    until_disconnect,
)


def build_seqs(req: GenerateRequest) -> list[Seq]:
    """Fan the request out to one engine request per (prompt, sample), prompt-major."""
    prompts = req.prompts()
    params = req.sampling_params
    if isinstance(params, list):
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        per_prompt = params
    else:
        per_prompt = [params or SamplingParams()] * len(prompts)
    rids = _rids(req.rid, len(prompts))
    logprobs = req.logprob_options(len(prompts))
    seqs: list[Seq] = []
    for i, (prompt, sp, (return_logprob, start, top)) in enumerate(zip(prompts, per_prompt, logprobs)):
        n = sp.n or 1
        group = _abort_group(req.rid, rids[i], n)
        for j in range(n):
            engine_sp = sp.to_engine()
            if "max_new_tokens" in sp.model_fields_set and sp.max_new_tokens is None:
                engine_sp["max_new_tokens"] = None  # an explicit null: the rest of the context
            if n > 1 and sp.seed is not None:
                engine_sp["seed"] = sp.seed + j
            rid = rids[i] if n == 1 else f"{rids[i]}-{j}"
            seqs.append(
                Seq(
                    prompt=prompt,
                    sampling_params=engine_sp,
                    rid=rid,
                    return_logprob=return_logprob,
                    logprob_start_len=start,
                    top_logprobs_num=top,
                    index=len(seqs),
                    log_metrics=req.log_metrics,
                    group=group,
                )
            )
    return seqs


def _abort_group(rid: str | list[str] | None, prompt_rid: str, n: int) -> str | None:
    """The id /abort_request takes for several sequences at once: a string rid names all of the
    request's, a listed rid its prompt's n samples (run as rid-0, rid-1, ...)."""
    if isinstance(rid, str):
        return rid
    return prompt_rid if rid is not None and n > 1 else None


def _rids(rid: str | list[str] | None, n: int) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [rid] if n == 1 else [f"{rid}_{i}" for i in range(n)]  # SGLang's names
    if len(rid) != n or len(set(rid)) != n:
        raise ValueError(f"rid must be {n} distinct ids, one per prompt")
    return list(rid)


def _with_text(seq: Seq, req: GenerateRequest) -> bool:
    """Whether this sequence's logprob entries carry their token's text."""
    return seq.return_logprob and req.return_text_in_logprobs


def _finish_meta(meta: dict[str, Any], with_text: bool, tokenizer: Any) -> dict[str, Any]:
    if meta.get("output_token_logprobs") is not None and LENGTH_KEY not in meta:
        meta = {**meta, LENGTH_KEY: len(meta["output_token_logprobs"])}
    if with_text:
        meta = add_logprob_text(meta, tokenizer)
    return meta


def _finish(result: dict[str, Any], with_text: bool, tokenizer: Any) -> dict[str, Any]:
    return {
        "text": result.get("text", ""),
        "output_ids": list(result.get("output_ids", [])),
        "meta_info": _finish_meta(result.get("meta_info", {}), with_text, tokenizer),
    }


class CumulativeEvents:
    """One sequence's stream events, each with the cumulative text, output_ids and output logprob
    lists. Text and ids are encoded incrementally: an event costs the encoding of its new tokens
    plus a copy, not a re-encoding of the whole output so far. A logprob entry's text is decoded
    once, when its chunk arrives. The bytes equal json.dumps of the whole event."""

    def __init__(self, index: int | None, with_text: bool, tokenizer: Any) -> None:
        self.index = index
        self.meta: dict[str, Any] = {}
        self._text = ""  # JSON-escaped, without quotes
        self._ids = ""  # JSON list items, without brackets
        self._lists: dict[str, list[Any]] = {key: [] for key in OUTPUT_LISTS}
        self._with_text = with_text
        self._tokenizer = tokenizer

    def add(self, chunk: dict[str, Any]) -> None:
        text = chunk.get("text", "")
        if text:
            self._text += json.dumps(text, ensure_ascii=False)[1:-1]
        ids = chunk.get("output_ids")
        if ids:
            self._ids += (", " if self._ids else "") + ", ".join(str(int(t)) for t in ids)
        meta = dict(chunk.get("meta_info", {}))
        if "input_token_logprobs" in self.meta:  # complete since prefill: decoded once
            meta.pop("input_token_logprobs", None)
            meta.pop("input_top_logprobs", None)
        if self._with_text:
            meta = add_logprob_text(meta, self._tokenizer)
        for key in OUTPUT_LISTS:
            if meta.get(key) is not None:
                self._lists[key].extend(meta[key])
                meta[key] = self._lists[key]
        if meta.get("output_token_logprobs") is not None:
            meta[LENGTH_KEY] = len(self._lists["output_token_logprobs"])
        self.meta = {**self.meta, **meta}

    def event(self) -> bytes:
        meta = json.dumps(self.meta, ensure_ascii=False)
        index = "" if self.index is None else f', "index": {self.index}'
        body = f'{{"text": "{self._text}", "output_ids": [{self._ids}], "meta_info": {meta}{index}}}'
        return b"data: " + body.encode() + b"\n\n"


async def _stream_events(
    runner: Runner, seqs: list[Seq], req: GenerateRequest
) -> AsyncGenerator[bytes, None]:
    """SSE events: per sequence, cumulative text, output_ids and output logprobs."""
    indexed = req.is_batch or len(seqs) > 1
    tokenizer = runner.engine.tokenizer
    acc = [
        CumulativeEvents(i if indexed else None, _with_text(s, req), tokenizer) for i, s in enumerate(seqs)
    ]
    gens = [runner.run(s, stream=True) for s in seqs]
    started = False  # an error before the first event propagates: sse_response makes it the status
    try:
        async for i, chunk in merge_streams(gens):
            started = True
            acc[i].add(chunk)
            yield acc[i].event()
    except Exception as exc:  # noqa: BLE001 - the stream ends with it as an error event
        if not started:
            raise
        yield stream_error_event(exc)
    finally:
        runner.release_all(seqs)
    yield SSE_DONE


def route_methods(app: FastAPI, path: str, endpoint: Callable[..., Any], methods: list[str]) -> None:
    """path served by endpoint for each of methods, one OpenAPI operation each (a route taking
    several methods would list them all under one operation id)."""
    for method in methods:
        app.add_api_route(
            path, endpoint, methods=[method], operation_id=f"{endpoint.__name__}_{method.lower()}"
        )


def register(app: FastAPI) -> None:
    runner: Runner = app.state.runner
    engine = app.state.engine

    async def generate(req: GenerateRequest, request: Request) -> Any:
        req.check_supported()
        seqs = build_seqs(req)
        for s in seqs:  # SGLang serves max_new_tokens: null up to the context's end
            if "max_new_tokens" in s.sampling_params and s.sampling_params["max_new_tokens"] is None:
                rest = runner.rest_of_context(runner.count_prompt_tokens(s.prompt))
                s.sampling_params["max_new_tokens"] = rest
        runner.check(seqs)
        runner.reserve(seqs)
        if req.stream:
            return await sse_response(request, _stream_events(runner, seqs, req))
        try:
            results = await until_disconnect(request, gather_all([run_to_end(runner, s) for s in seqs]))
        finally:
            runner.release_all(seqs)
        outs = [_finish(r, _with_text(s, req), engine.tokenizer) for r, s in zip(results, seqs)]
        return outs if req.is_batch or len(outs) > 1 else outs[0]

    route_methods(app, "/generate", generate, ["POST", "PUT"])  # SGLang takes both

    @app.get("/health")
    async def health() -> Response:
        reason = runner.engine_exit()
        if reason is not None:
            return JSONResponse(error_body(f"{reason}; the server is shutting down", 503), status_code=503)
        if not runner.accepting:
            return JSONResponse(error_body("shutting down", 503), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        seq = Seq(prompt={"input_ids": [_probe_token(engine)]}, sampling_params={"max_new_tokens": 1})
        runner.check([seq])
        runner.reserve([seq])
        try:
            out = await asyncio.wait_for(until_disconnect(request, run_to_end(runner, seq)), 60.0)
        except TimeoutError:
            return JSONResponse(error_body("generation timed out", 503), status_code=503)
        return JSONResponse({"status": "ok", "completion_tokens": out["meta_info"]["completion_tokens"]})

    async def model_info() -> dict[str, Any]:
        cfg = engine.model_config
        return {
            "model_path": str(engine.model_path),
            "tokenizer_path": str(engine.model_path),
            "is_generation": True,
            "model_name": app.state.model_name,
            "context_length": getattr(cfg, "context_len", None),
            "vocab_size": getattr(cfg, "vocab_size", None),
        }

    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, Any]]:
        """SGLang's load report (one entry per DP rank; a replica is one rank), which
        sglang-router's load monitor reads."""
        stats = engine.get_stats()
        return [
            {
                "dp_rank": 0,
                "num_reqs": stats["num_running"] + stats["num_waiting"],
                "num_waiting_reqs": stats["num_waiting"],
                "num_tokens": stats["kv_total_slots"] - stats["kv_free_slots"],
            }
        ]

    async def flush_cache() -> Response:
        if engine.flush_cache():
            return JSONResponse({"flushed": True, "message": "cache flushed"})
        return JSONResponse(error_body("cache not flushed: requests are running", 400), status_code=400)

    route_methods(app, "/flush_cache", flush_cache, ["GET", "POST"])  # SGLang takes both

    @app.post("/abort_request")
    async def abort_request(req: AbortRequest) -> dict[str, Any]:
        if req.abort_all:
            return {"abort_all": True, "aborted": runner.abort_all()}
        found = runner.abort(req.rid)
        if not found:
            engine.abort_request(req.rid)
        return {"rid": req.rid, "found": found}


def _probe_token(engine: Any) -> int:
    tok = engine.tokenizer
    for tid in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None)):
        if isinstance(tid, int):
            return tid
    return 0
