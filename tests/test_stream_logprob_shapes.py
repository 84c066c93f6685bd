"""A gen's streamed logprobs join to the same list whichever of SGLang's stream shapes the backend
sends: per-chunk lists with the running count (the Engine's), cumulative lists with the count (a
server's), or cumulative lists without it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from radixlm.backend_base import LENGTH_KEY, chunk_logprobs


def _entries(n: int) -> list[list[object]]:
    return [[-0.1 * i, i, None] for i in range(n)]


@given(
    cuts=st.lists(st.integers(0, 4), min_size=1, max_size=8), shape=st.sampled_from(["chunk", "cum", "bare"])
)
def test_every_shape_joins_to_the_whole_list(cuts: list[int], shape: str) -> None:
    total, joined, sent = 0, [], 0
    for size in cuts:
        start, total = total, total + size
        if shape == "chunk":
            meta = {"output_token_logprobs": _entries(total)[start:], LENGTH_KEY: total}
        elif shape == "cum":
            meta = {"output_token_logprobs": _entries(total), LENGTH_KEY: total}
        else:
            meta = {"output_token_logprobs": _entries(total), "completion_tokens": total}
        out = chunk_logprobs(meta, sent)
        assert out[LENGTH_KEY] == total
        joined += out["output_token_logprobs"]
        sent = out[LENGTH_KEY]
    assert joined == _entries(total)
