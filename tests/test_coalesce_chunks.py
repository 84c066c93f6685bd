"""coalesce_chunks merges a request's waiting chunks, never across requests of one stream."""

from __future__ import annotations

import asyncio

from radixlm.backend.loop_mailbox import coalesce_chunks


def _chunk(text: str, index: int | None, done: bool = False) -> dict[str, object]:
    c: dict[str, object] = {
        "text": text,
        "output_ids": [len(text)],
        "meta_info": {"finish_reason": "x" if done else None},
    }
    if index is not None:
        c["index"] = index
    return c


def test_merges_one_requests_chunks_and_stops_at_another() -> None:
    async def main() -> list[dict[str, object]]:
        q: asyncio.Queue[dict[str, object]] = asyncio.Queue()
        for c in [_chunk("b", 0), _chunk("c", 1), _chunk("d", 1, done=True)]:
            q.put_nowait(c)
        first = coalesce_chunks(_chunk("a", 0), q)
        second = coalesce_chunks(await asyncio.wait_for(q.get(), 5), q)
        return [first, second]

    first, second = asyncio.run(main())
    assert first["text"] == "ab" and first["index"] == 0
    assert second["text"] == "cd" and second["index"] == 1 and second["meta_info"]["finish_reason"] == "x"
