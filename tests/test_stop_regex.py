"""Stop regexes: the incremental scan against a naive search of every prefix (hypothesis), the
pattern checks, the search timeout, and the engine's output (trimmed, kept with no_stop_trim,
streamed, past min_new_tokens) on the default model."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.backend.sampling_params import SamplingParams
from radixlm.backend.stop_regex import MAX_STOP_REGEXES, StopRegexScan, StopRegexTimeout

PATTERNS = [r"ab+c", r"a.*z", r"\n\n", r"b|ca", r"(?<=x)y", r"[0-9]{2}\.", r"c\b", r"ba?b"]


def naive_first_stop(patterns: list[str], pieces: list[str]) -> tuple[int, int, str] | None:
    """(piece index, start, pattern) of the first prefix in which some pattern matches: a full
    search of each whole prefix, leftmost start first."""
    text = ""
    for k, piece in enumerate(pieces):
        text += piece
        hits = [(m.start(), p) for p in patterns if (m := re.search(p, text)) is not None]
        if hits:
            return (k, *min(hits))
    return None


def scanned_first_stop(patterns: list[str], pieces: list[str]) -> tuple[int, int, str] | None:
    scan, text = StopRegexScan(patterns), ""
    for k, piece in enumerate(pieces):
        text += piece
        hit = scan.search(text)
        assert scan.hold_from(len(text)) <= len(text)
        if hit is not None:
            return (k, *hit)
    return None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PATTERNS), min_size=1, max_size=3, unique=True),
    st.lists(st.text(alphabet="abcxyz09.\n ", min_size=1, max_size=4), min_size=1, max_size=12),
)
def test_incremental_scan_stops_where_a_search_of_every_prefix_does(patterns, pieces):
    assert scanned_first_stop(patterns, pieces) == naive_first_stop(patterns, pieces)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(PATTERNS),
    st.lists(st.text(alphabet="abcxyz09.\n ", min_size=1, max_size=4), min_size=1, max_size=12),
)
def test_text_before_hold_from_never_starts_a_later_match(pattern, pieces):
    """What hold_from lets a stream send is never cut later: a match, when one comes, starts at
    or after every earlier step's hold_from."""
    scan, text, holds = StopRegexScan([pattern]), "", []
    for piece in pieces:
        text += piece
        hit = scan.search(text)
        if hit is not None:
            assert all(hit[0] >= h for h in holds)
            return
        holds.append(scan.hold_from(len(text)))


def test_skip_to_keeps_matches_out_of_the_skipped_text():
    scan = StopRegexScan([r"ab"])
    scan.skip_to(len("xab"))
    assert scan.search("xab") is None and scan.hold_from(3) == 3
    assert scan.search("xab a") is None and scan.hold_from(5) == 4  # "a" may begin a match
    assert scan.search("xab ab") == (4, "ab")


@pytest.mark.parametrize(
    "value,reason",
    [
        ("(", "not a valid regular expression"),
        ("a*", "matches the empty string"),
        ("$", "matches the empty string"),
        ([""], "non-empty"),
        (["ok", 3], "non-empty"),
        (["x"] * (MAX_STOP_REGEXES + 1), f"at most {MAX_STOP_REGEXES}"),
        ("a" * 1001, "limited to 1000 characters"),
    ],
)
def test_bad_stop_regexes_are_refused_with_the_reason(value, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        SamplingParams.from_dict({"stop_regex": value})


def test_a_string_or_a_tuple_becomes_a_list():
    assert SamplingParams.from_dict({"stop_regex": r"\d"}).stop_regex == [r"\d"]
    p = SamplingParams.from_dict({"stop_regex": ("a", "b"), "stop": ("x",), "stop_token_ids": (1, 2)})
    assert (p.stop_regex, p.stop, p.stop_token_ids) == (["a", "b"], ["x"], [1, 2])


def test_a_search_that_backtracks_too_long_raises_instead_of_stalling():
    scan = StopRegexScan([r"(a|aa)+c"])  # exponential backtracking on a run of a's without a c
    with pytest.raises(StopRegexTimeout, match=r"took over \d+ ms"):
        scan.search("a" * 40 + "d")


PROMPT = "Count: 1, 2, 3, 4, 5, 6, 7,"


def test_engine_stops_at_the_first_match_and_trims_it(engine):
    free = engine.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})["text"]
    m = re.search(r"1\d", free)
    assert m is not None, f"the model's count changed: {free!r}"
    sp = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop_regex": r"1\d"}
    out = engine.generate(PROMPT, sp)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"1\d"}
    assert out["text"] == free[: m.start()]
    kept = engine.generate(PROMPT, {**sp, "no_stop_trim": True})
    assert kept["text"].startswith(free[: m.end()]) and re.search(r"1\d", kept["text"])
    streamed = engine.generate(PROMPT, sp, stream=True)
    assert "".join(c["text"] for c in streamed) == out["text"]


def test_engine_counts_a_stop_regex_only_past_min_new_tokens(engine, tokenizer):
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": r",\s"}
    first = engine.generate(PROMPT, sp)
    assert first["meta_info"]["finish_reason"]["type"] == "stop"
    least = first["meta_info"]["completion_tokens"] + 3
    out = engine.generate(PROMPT, {**sp, "min_new_tokens": least})
    assert out["meta_info"]["completion_tokens"] >= least
    assert len(out["text"]) >= len(tokenizer.decode(out["output_ids"][:least]).rstrip(", "))
    assert out["text"].startswith(first["text"])
