"""Embeddings from a generation model: one prompt at a time through the model's prefill, on the
scheduler thread between steps, pooled from the final normalized hidden states (the last token's,
or the mean over tokens) and L2-normalized. Promises: the KV slots and the table row it borrows are
back in the pool when it returns; bad input raises ValueError, a pool that running requests hold
for now KVPoolBusy; an embedding that waits for room holds it against newly admitted prompts, so a
stream of generation requests cannot starve it. Engine.encode answers in SGLang's shape
(sglang_embeddings)."""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from .model_runner import ScheduledItem

if TYPE_CHECKING:
    from .cache_manager import CacheManager
    from .model_runner import ModelRunner

POOLINGS = ("last", "mean")
WAIT_S = 60.0  # how long an embedding waits for running requests to free the KV it needs
RETRY_S = 0.02
_tickets = itertools.count()
T = TypeVar("T")
R = TypeVar("R")


class OnScheduler(Protocol):
    """Runs a function on the scheduler thread, between steps, and returns its result (Engine._call)."""

    def __call__(self, fn: Callable[[], R]) -> R: ...


class KVPoolBusy(RuntimeError):
    """Running requests hold the KV slots or table rows an input needs now: worth waiting for."""


def check_inputs(
    id_lists: list[list[int]], pooling: str, context_len: int, vocab_size: int, pool_slots: int
) -> None:
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, not {pooling!r}")
    if not id_lists:
        raise ValueError("no input to embed")
    for ids in id_lists:
        if not ids:
            raise ValueError("an input to embed is empty")
        if len(ids) > context_len:
            raise ValueError(f"an input has {len(ids)} tokens; the context length is {context_len}")
        if len(ids) > pool_slots:
            raise ValueError(f"an input has {len(ids)} tokens; the KV pool holds {pool_slots}")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"token ids must be in [0, {vocab_size})")


def embed(runner: ModelRunner, kv: CacheManager, ids: list[int], pooling: str) -> list[float]:
    """One prompt's embedding (call on the scheduler thread, between steps)."""
    row = runner.req_table.alloc()
    if row is None:
        raise KVPoolBusy("no free request row to embed with (too many running requests)")
    slots = None
    try:
        kv.make_room(len(ids))
        slots = runner.allocator.alloc(len(ids))
        if slots is None:
            raise KVPoolBusy(f"no room in the KV pool for {len(ids)} tokens to embed")
        runner.req_table.write(row, 0, slots)
        offsets = [len(ids) - 1] if pooling == "last" else list(range(len(ids)))
        fb = runner.build_batch([ScheduledItem(row, list(ids), 0, offsets)], slots)
        h = runner.model.hidden_states(fb).float()
        vec = h[-1] if pooling == "last" else h.mean(dim=0)
        return torch.nn.functional.normalize(vec, dim=0).cpu().tolist()
    finally:
        if slots is not None:
            runner.allocator.free(slots)
        runner.req_table.free(row)


def embed_when_room(
    on_scheduler: OnScheduler,
    attempt: Callable[[], T],
    holds: dict[int, int],
    tokens: int,
) -> T:
    """attempt() run on the scheduler thread until it stops raising KVPoolBusy (up to WAIT_S).
    While it waits, holds[ticket] = tokens: the planner admits no prompt into that room (and keeps
    a table row free), so running requests, as they finish, free it for this embedding."""
    ticket = next(_tickets)

    def once() -> T:
        holds.pop(ticket, None)  # on this thread: no step is planned between this and a new hold
        try:
            return attempt()
        except KVPoolBusy:
            holds[ticket] = tokens
            raise

    deadline = time.monotonic() + WAIT_S
    try:
        while True:
            try:
                return on_scheduler(once)
            except KVPoolBusy as e:
                if time.monotonic() > deadline:
                    raise KVPoolBusy(f"{e}, after waiting {WAIT_S:.0f} s") from e
                time.sleep(RETRY_S)
    finally:  # however the wait ends (its limit, an interrupt), the room goes back to prompts
        if ticket in holds:
            with contextlib.suppress(RuntimeError):  # an engine already shut down holds nothing
                on_scheduler(lambda: holds.pop(ticket, None))


def embedding_inputs(
    tokenizer: object, prompt: str | list[str] | None, input_ids: list[int] | list[list[int]] | None
) -> list[list[int]]:
    """Token id lists from exactly one of prompt (a string or strings) and input_ids (a list or lists)."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is not None:
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a list of strings")
        return [tokenizer.encode(t) for t in texts]  # type: ignore[attr-defined]
    assert input_ids is not None
    lists = [input_ids] if input_ids and isinstance(input_ids[0], int) else input_ids
    if not all(isinstance(x, list) and all(isinstance(i, int) for i in x) for x in lists):
        raise ValueError("input_ids must be a list of ints or a list of lists of ints")
    return [list(x) for x in lists]  # type: ignore[arg-type]


def single_input(prompt: object, input_ids: object) -> bool:
    """Whether encode() was given one input (a string, or one flat list of ids), as SGLang tells a
    single request from a batch: its answer is then one dict, not a list."""
    if prompt is not None:
        return isinstance(prompt, str)
    return isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], int)


def sglang_embeddings(
    id_lists: list[list[int]], vectors: list[list[float]], single: bool, start: float
) -> dict[str, Any] | list[dict[str, Any]]:
    """SGLang's Engine.encode answer: per input {"embedding", "meta_info"} with the id, the
    finish reason of a request that generates nothing, prompt_tokens and e2e_latency."""
    latency = time.perf_counter() - start
    outs = [
        {
            "embedding": vec,
            "meta_info": {
                "id": uuid.uuid4().hex,
                "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(ids),
                "e2e_latency": latency,
            },
        }
        for ids, vec in zip(id_lists, vectors)
    ]
    return outs[0] if single else outs
