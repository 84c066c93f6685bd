"""Stream replay for the front of `radixlm serve --dp N` (dp_front.py): a streamed native
/generate request whose replica dies mid-way is continued on a live replica, and the client
reads one uninterrupted, complete stream.

What it owns: deciding whether a streamed /generate request can be continued (`plan`), reading
the upstream event stream event by event (`events`), and turning what the client has already
read into a continuation request and the continuation's events into the same stream
(`NativeStream`). The front owns the HTTP side: sending the continuation through the router
(which picks a live replica) and the /tokenize and /detokenize calls to a replica.

What it promises:
- The continuation's prompt is the original prompt's token ids plus every output id the client
  has read, with max_new_tokens (and min_new_tokens) lowered by the tokens already generated, so
  the model continues from exactly the tokens it produced; the client keeps reading cumulative
  `text` and `output_ids`, `meta_info.completion_tokens` counting the whole answer, the original
  `meta_info.id`, `prompt_tokens` and `cached_tokens`; the events after a seam say how many
  continuations the answer took in `meta_info.resumed` (absent before the first); a `length`
  finish reason counts the whole answer too.
- Only complete events reach the client; a half-received event of a dying upstream is dropped.
- A request is continued only where the continuation is the same computation: one prompt, one
  sample, no logprobs, no grammar (regex, json_schema, ebnf), no stop strings (one could match
  across the seam, which neither side would see), no frequency/presence/repetition penalty (they
  would not count the tokens before the seam). A continuation is also refused where the seam
  splits a UTF-8 character or what the client read does not match the replica's own decoding.
  Sampling with a seed continues with the seed's stream restarted, so the answer is a valid
  sample but not the one an uninterrupted run would give. Without max_new_tokens the engine's
  default (DEFAULT_MAX_NEW_TOKENS) is assumed.
- Anything that cannot be continued, or a continuation that fails too, ends as before: an error
  event and [DONE], never a shorter answer presented as complete. The OpenAI streams are among
  them: their chunks carry text deltas without token ids or counts, so a continuation could not
  count the answer's tokens exactly."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..sampling_params import DEFAULT_MAX_NEW_TOKENS

log = logging.getLogger(__name__)

REPLAY_PATH = "/generate"
DONE = b"data: [DONE]\n\n"

# Request fields a continuation carries over unchanged; any other field set to a non-empty
# value makes the request one that is not continued.
_PLAIN_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "stream",
        "rid",
        "model",
        "log_metrics",
        "no_logs",
        "conversation_id",
        "custom_labels",
        "priority",
        "data_parallel_rank",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
    }
)
# Sampling fields that mean the same on a continuation (the token budgets are lowered apart).
_PLAIN_SAMPLING = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop_token_ids",
        "ignore_eos",
        "no_stop_trim",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "seed",
        "json_schema_strict",
        "speculative_algorithm",
        "speculative_num_draft_tokens",
    }
)
# Sampling fields allowed only at their neutral value.
_NEUTRAL_SAMPLING = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "n": 1}


class CannotResume(Exception):
    """The stream cannot be continued; the message says why (it goes into the error event)."""


@dataclass
class Event:
    """One server-sent event: its bytes as received, and its data parsed where it is JSON."""

    raw: bytes
    data: Any = None
    done: bool = False  # the `data: [DONE]` sentinel


def plan(method: str, path: str, body: bytes) -> NativeStream | None:
    """The replay state of a streamed /generate request that can be continued, else None."""
    if method != "POST" or path != REPLAY_PATH or b"stream" not in body:
        return None  # not a stream: no need to parse the body
    try:
        req = json.loads(body)
    except ValueError:
        return None
    if not isinstance(req, dict) or req.get("stream") is not True:
        return None
    if any(v not in (None, False, [], {}, "") for k, v in req.items() if k not in _PLAIN_FIELDS):
        return None  # logprobs, hidden states, sessions, ...: a continuation would differ
    text, ids = req.get("text"), req.get("input_ids")
    if not (isinstance(text, str) and ids is None) and not (_is_ids(ids) and text is None):
        return None  # a batch (or a malformed request the replica refused anyway)
    if req.get("data_parallel_rank") not in (None, 0):
        return None
    sp = req.get("sampling_params") or {}
    if not isinstance(sp, dict):
        return None
    for key, value in sp.items():
        neutral = _NEUTRAL_SAMPLING.get(key)
        if value is None or key in _PLAIN_SAMPLING or (neutral is not None and value == neutral):
            continue
        if key == "stop" and value in ([], ""):
            continue
        return None
    max_new = sp.get("max_new_tokens")
    min_new = sp.get("min_new_tokens")
    return NativeStream(
        request=req,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else int(max_new),
        min_new_tokens=int(min_new or 0),
        skip_special_tokens=sp.get("skip_special_tokens") is not False,
    )


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


async def events(resp: httpx.Response) -> AsyncIterator[Event]:
    """The complete events of an upstream event stream, as they arrive. Raises httpx errors of
    a broken upstream; a trailing incomplete event is never yielded."""
    buffer = b""
    async for chunk in resp.aiter_bytes():
        buffer = (buffer + chunk).replace(b"\r\n", b"\n")  # a CRLF may span two chunks
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            if block.strip():
                yield parse_event(block + b"\n\n")


def parse_event(raw: bytes) -> Event:
    lines = raw.decode("utf-8", "replace").split("\n")
    data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
    if not data:
        return Event(raw)  # a comment or keep-alive: relayed as it is
    payload = "\n".join(data)
    if payload.strip() == "[DONE]":
        return Event(raw, done=True)
    try:
        return Event(raw, json.loads(payload))
    except ValueError:
        return Event(raw)


def upstream_failure(event: Event) -> bool:
    """An error event that reports a failed upstream (the router's stream error, a 5xx), not a
    refusal of the request itself (a 4xx), which a continuation would only repeat."""
    if not isinstance(event.data, dict) or "error" not in event.data:
        return False
    error = event.data["error"]
    code = error.get("code") if isinstance(error, dict) else None
    return not (isinstance(code, int) and 400 <= code < 500)


@dataclass
class NativeStream:
    """One streamed /generate request: what its client has read, and the seam of the
    continuation now streaming (the answer so far when that continuation was sent)."""

    request: dict[str, Any]
    max_new_tokens: int
    min_new_tokens: int
    skip_special_tokens: bool
    text: str = ""  # as the client read it: cumulative
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    finished: bool = False  # the client read the final event (or a refusal of the request)
    resumes: int = 0
    prompt_ids: list[int] | None = None  # a text prompt's ids, once tokenized for a continuation
    seam_text: str = ""
    seam_ids: list[int] = field(default_factory=list)
    first_meta: dict[str, Any] = field(default_factory=dict)

    def relay(self, event: Event) -> bytes:
        """The bytes the client reads for one upstream event; the state follows them."""
        data = event.data
        if event.done or not isinstance(data, dict):
            return event.raw
        if "error" in data:  # a refusal of the request: the stream ends with it
            self.finished = True
            return event.raw
        found = data.get("meta_info")
        meta: dict[str, Any] = found if isinstance(found, dict) else {}
        if self.resumes == 0:  # the original upstream: passed through byte for byte
            if not self.first_meta and meta:
                self.first_meta = dict(meta)
            self._follow(data.get("text", self.text), list(data.get("output_ids", self.output_ids)), meta)
            return event.raw
        out = dict(data)
        out["text"] = self.seam_text + str(data.get("text", ""))
        out["output_ids"] = self.seam_ids + list(data.get("output_ids") or [])
        merged = {**meta}
        for key in ("id", "prompt_tokens", "cached_tokens"):
            if key in self.first_meta:
                merged[key] = self.first_meta[key]
        merged["completion_tokens"] = len(self.seam_ids) + int(meta.get("completion_tokens", 0))
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and isinstance(reason.get("length"), int):
            # a length finish counts the answer's tokens, which began before the seam
            merged["finish_reason"] = {**reason, "length": len(self.seam_ids) + reason["length"]}
        merged["resumed"] = self.resumes
        out["meta_info"] = merged
        self._follow(out["text"], out["output_ids"], merged)
        return b"data: " + json.dumps(out, ensure_ascii=False).encode() + b"\n\n"

    def _follow(self, text: Any, output_ids: list[int], meta: dict[str, Any]) -> None:
        self.text = str(text)
        self.output_ids = output_ids
        self.meta = meta or self.meta
        if meta.get("finish_reason") is not None:
            self.finished = True

    def prompt_text(self) -> str | None:
        """The prompt as text, where it must be tokenized to be continued as ids."""
        text = self.request.get("text")
        return text if isinstance(text, str) and self.output_ids else None

    def seam_check(self, prompt_ids: list[int] | None, seam_text: str | None) -> None:
        """Raise CannotResume unless the answer so far can be the continuation's prompt tail:
        its ids counted as the replica counted them, its decoding extending what was read."""
        done = len(self.output_ids)
        if "completion_tokens" in self.meta and int(self.meta["completion_tokens"]) != done:
            raise CannotResume(f"{done} output ids read for {self.meta['completion_tokens']} tokens")
        if done >= self.max_new_tokens:
            raise CannotResume("the answer has all its tokens but no final event")
        counted = self.first_meta.get("prompt_tokens")
        if prompt_ids is not None and counted is not None and len(prompt_ids) != int(counted):
            raise CannotResume(f"the prompt re-tokenizes to {len(prompt_ids)} tokens, not {counted}")
        seam = seam_text or ""
        if not seam.startswith(self.text):
            raise CannotResume("the answer so far does not decode to the text already sent")
        if seam.endswith("\ufffd"):
            raise CannotResume("the answer so far ends inside a character")

    def continuation(self, prompt_ids: list[int] | None, seam_text: str | None) -> dict[str, Any]:
        """The request that continues the answer: prompt ids + output ids read so far, the
        budgets lowered by those tokens, the same request id. Moves the seam to here."""
        self.seam_check(prompt_ids, seam_text)
        body = copy.deepcopy(self.request)
        done = len(self.output_ids)
        rid = self.first_meta.get("id") or body.get("rid")
        if isinstance(rid, str):  # one id for the whole answer: /abort_request keeps working
            body["rid"] = rid
        if done:
            ids = prompt_ids if prompt_ids is not None else list(body["input_ids"])
            body.pop("text", None)
            body["input_ids"] = ids + self.output_ids
        sp = dict(body.get("sampling_params") or {})
        sp["max_new_tokens"] = self.max_new_tokens - done
        if self.min_new_tokens:
            sp["min_new_tokens"] = max(0, self.min_new_tokens - done)
        body["sampling_params"] = sp
        self.seam_ids = list(self.output_ids)
        self.seam_text = seam_text or ""
        self.resumes += 1
        return body


async def relay_resuming(
    first: httpx.Response,
    stream: NativeStream,
    resume: Callable[[NativeStream], Awaitable[httpx.Response]],
    max_resumes: int,
) -> AsyncIterator[bytes]:
    """The client's stream: the upstream's complete events, and where the upstream breaks
    before the final event, those of a continuation `resume` sends (at most `max_resumes`
    times), rewritten into the same answer."""
    resp = first
    try:
        while True:
            reason = "the stream ended without its final event"
            try:
                async for event in events(resp):
                    if event.done and not stream.finished:
                        break
                    if not stream.finished and upstream_failure(event):
                        reason = _error_message(event)
                        break
                    yield stream.relay(event)
                    if event.done:
                        return
            except Exception as exc:  # noqa: BLE001 - a broken upstream, whatever it raised
                reason = type(exc).__name__
                if not isinstance(exc, httpx.HTTPError):
                    log.warning("stream upstream failed with %s", reason, exc_info=True)
            await close_quietly(resp)
            if stream.finished:  # complete; only the upstream's [DONE] was lost
                yield DONE
                return
            if stream.resumes >= max_resumes:
                yield error_event(reason)
                return
            try:
                resp = await resume(stream)
            except Exception as exc:  # noqa: BLE001 - any failure to continue ends in the error event
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.warning(
                    "stream not continued after %s: %s",
                    reason,
                    why,
                    exc_info=not isinstance(exc, CannotResume),
                )
                yield error_event(f"{reason}; not continued: {why}")
                return
            log.warning(
                "stream %s continued after %s: %d tokens were sent",
                stream.first_meta.get("id"),
                reason,
                len(stream.seam_ids),
            )
            if resp.status_code != 200 or not is_event_stream(resp):
                answer = (await read_quietly(resp))[:300].decode("utf-8", "replace")
                log.warning("stream continuation answered %d: %s", resp.status_code, answer)
                yield error_event(f"{reason}; the continuation was answered {resp.status_code}: {answer}")
                return
    finally:
        await close_quietly(resp)  # also when the client left: the upstream request is cancelled


async def close_quietly(resp: httpx.Response) -> None:
    """Close an upstream response. httpx does not map the transport's errors on close, and a
    connection that breaks while closing must not cut the client's stream: it is only logged."""
    try:
        await resp.aclose()
    except Exception as exc:  # noqa: BLE001
        log.debug("closing an upstream response failed: %s: %s", type(exc).__name__, exc)


async def read_quietly(resp: httpx.Response) -> bytes:
    """An upstream's whole body for an error message; b"" where the upstream breaks."""
    try:
        return await resp.aread()
    except Exception as exc:  # noqa: BLE001
        log.debug("reading an upstream answer failed: %s: %s", type(exc).__name__, exc)
        return b""


async def relay_events(resp: httpx.Response) -> AsyncIterator[bytes]:
    """An event stream that is not continued: its complete events; where the upstream breaks,
    an error event and [DONE], so the client reads why its answer is incomplete instead of a
    cut connection or half an event."""
    try:
        async for event in events(resp):
            yield event.raw
    except Exception as exc:  # noqa: BLE001 - a broken upstream, whatever it raised
        yield error_event(type(exc).__name__)


def is_event_stream(resp: httpx.Response) -> bool:
    content_type: str = resp.headers.get("content-type", "")
    return content_type.startswith("text/event-stream")


def _error_message(event: Event) -> str:
    error = event.data.get("error") if isinstance(event.data, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return f"upstream error: {message}"


def error_event(reason: str) -> bytes:
    """The event that ends a stream whose answer is incomplete, then [DONE]."""
    message = f"the replica serving this stream failed mid-way ({reason}); the answer is incomplete: send the request again"
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": 502}}
    return b"\n\ndata: " + json.dumps(body).encode() + b"\n\n" + DONE
