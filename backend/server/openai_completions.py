"""/v1/completions pieces: the engine sequences of a request (one per prompt and sample), the
per-choice accumulator that turns engine chunks into OpenAI choice fragments (echo and logprobs
included), and the SSE event stream; the route itself is in openai_api.py."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from .openai_shapes import Tok, choice_rid, finish_reason, grammar_report, sample_params, usage
from .protocol import CompletionRequest, now
from .runner import Runner, Seq
from .streams import SSE_DONE, merge_streams, sse, stream_error_event


def completion_seqs(req: CompletionRequest) -> list[Seq]:
    prompts = req.prompts()
    sp = req.sampling_params(req.max_tokens)
    seqs: list[Seq] = []
    for p in prompts:
        for j in range(req.n):
            k = len(seqs)
            seqs.append(
                Seq(
                    prompt=p,
                    sampling_params=sample_params(sp, j, req.n),
                    rid=choice_rid(req.rid, k, len(prompts) * req.n),
                    return_logprob=req.logprobs is not None,
                    logprob_start_len=0 if req.echo else -1,
                    top_logprobs_num=req.logprobs or 0,
                    index=k,
                )
            )
    return seqs


@dataclass
class CompletionChoice:
    """Accumulates one completion choice from chunks (streamed or whole)."""

    seq: Seq
    echo_text: str
    tok: Tok
    want_logprobs: bool
    text: str = ""
    offset: int = 0
    echoed: bool = False
    meta: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """Fold a chunk in; return this chunk's OpenAI choice fragment."""
        meta = chunk.get("meta_info", {})
        self.meta = {**(self.meta or {}), **meta}
        piece = chunk.get("text", "")
        entries, tops = [], []
        if not self.echoed:
            self.echoed = True
            piece = self.echo_text + piece
            entries = list(meta.get("input_token_logprobs") or [])
            tops = list(meta.get("input_top_logprobs") or [None] * len(entries))
        out_entries = list(meta.get("output_token_logprobs") or [])
        entries += out_entries
        tops += list(meta.get("output_top_logprobs") or [None] * len(out_entries))
        logprobs = None
        if self.want_logprobs:
            logprobs = self.tok.completion_logprobs(entries, tops, self.offset)
        self.offset += len(piece)
        self.text += piece
        fragment = {
            "index": self.seq.index,
            "text": piece,
            "logprobs": logprobs,
            "finish_reason": finish_reason(meta),
        }
        report = grammar_report(meta) if fragment["finish_reason"] else None
        return {**fragment, "radixlm": report} if report else fragment


def completion_choices(req: CompletionRequest, seqs: list[Seq], tok: Tok) -> list[CompletionChoice]:
    choices = []
    for s in seqs:
        echo = ""
        if req.echo:
            echo = s.prompt["text"] if "text" in s.prompt else tok.tokenizer.decode(s.prompt["input_ids"])
        choices.append(CompletionChoice(s, echo, tok, req.logprobs is not None))
    return choices


def prompt_usage(choices: list[Any], n: int) -> tuple[int, int, int]:
    metas = [c.meta or {} for c in choices]
    prompt = sum(int(m.get("prompt_tokens", 0)) for m in metas[::n])
    cached = sum(int(m.get("cached_tokens", 0)) for m in metas[::n])
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas)
    return prompt, completion, cached


async def completion_events(
    runner: Runner,
    req: CompletionRequest,
    seqs: list[Seq],
    choices: list[CompletionChoice],
    rid: str,
    model: str,
) -> AsyncGenerator[bytes, None]:
    head = {"id": rid, "object": "text_completion", "created": now(), "model": model}
    continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
    started = False  # an error before the first event propagates: sse_response makes it the status
    try:
        async for i, chunk in merge_streams([runner.run(s, stream=True) for s in seqs]):
            started = True
            fragment = choices[i].add(chunk)
            if fragment["text"] or fragment["finish_reason"] or fragment["logprobs"]:
                if continuous:  # the choice's own counts so far, as SGLang and vLLM send them
                    yield sse({**head, "choices": [fragment], "usage": usage(*prompt_usage([choices[i]], 1))})
                else:
                    yield sse({**head, "choices": [fragment]})
        if req.stream_options and req.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": usage(*prompt_usage(choices, req.n))})
    except Exception as exc:  # noqa: BLE001 - the stream ends with it as an error event
        if not started:
            raise
        yield stream_error_event(exc)
    finally:
        runner.release_all(seqs)
    yield SSE_DONE
