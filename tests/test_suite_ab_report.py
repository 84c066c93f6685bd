"""benchmarks/suite_ab_report.py: a version's results split over device calls merge into rounds
(a repeat of some engine steps replaces only those steps), and the side-by-side table compares
the versions' round means in each ratio's better direction."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from suite_ab_report import merge_rounds, side_by_side  # noqa: E402


def _result(**workers: dict[str, Any]) -> dict[str, Any]:
    return {"env": {"gpu": "x"}, "small": False, "workers": workers}


def test_calls_split_by_worker_merge_and_repeats_replace_their_steps() -> None:
    engine = {"decode_b1": 1, "forks": 2, "_worker": {"status": "ok"}}
    others = _result(hf={"b128": 3, "_worker": {}}, server={"_worker": {"status": "exit 1"}})
    repeat = _result(engine={"forks": 5, "_worker": {"status": "ok"}})
    rounds = merge_rounds([_result(engine=engine), others, repeat])
    assert [r["workers"] for r in rounds] == [
        {"engine": {"decode_b1": 1, "forks": 2}, "hf": {"b128": 3}},
        {"engine": {"decode_b1": 1, "forks": 5}, "hf": {"b128": 3}},
    ]  # the failed server worker counts nowhere; round 1 is left as it was
    assert merge_rounds([_result(engine={"_worker": {}})]) == []


def test_steps_split_over_calls_pair_run_by_run() -> None:
    first_call = [_result(engine={"decode_b1": d}) for d in (1, 2, 3)]
    second_call = [_result(engine={"serving": s}, server={"rate": s * 10}) for s in (7, 8)]
    rounds = merge_rounds(first_call + second_call)
    assert [r["workers"] for r in rounds] == [
        {"engine": {"decode_b1": 1, "serving": 7}, "server": {"rate": 70}},
        {"engine": {"decode_b1": 2, "serving": 8}, "server": {"rate": 80}},
        {"engine": {"decode_b1": 3, "serving": 7}, "server": {"rate": 70}},
    ]  # the second serving run meets the second server run, not the first


def test_side_by_side_takes_each_ratios_better_direction() -> None:
    def ratio(value: float, higher: bool) -> dict[str, Any]:
        return {"value": value, "higher_is_better": higher, "what": "w"}

    old = [{"speed": ratio(2.0, True), "ttft": ratio(100.0, False), "gone": ratio(1.0, True)}]
    new = [{"speed": ratio(1.0, True), "ttft": ratio(50.0, False)}, {"speed": ratio(2.0, True)}]
    rows = side_by_side({"old": old, "new": new})
    assert set(rows) == {"speed", "ttft"}
    assert rows["speed"]["new_vs_old"] == 0.75 and rows["speed"]["new"] == [1.0, 2.0]
    assert rows["ttft"]["new_vs_old"] == 2.0  # lower is better: half the TTFT is twice as good
    late = side_by_side({"old": old, "new": [{"speed": ratio(1.0, True)}, {"gone": ratio(2.0, True)}]})
    assert late["gone"]["new_vs_old"] == 2.0  # a ratio first reported in a later round still counts
    repeated = side_by_side(
        {"old": old, "new": [{"speed": ratio(1.0, True)}] * 3 + [{"speed": ratio(4.0, True)}]}
    )
    assert repeated["speed"]["new"] == [1.0, 4.0] and repeated["speed"]["new_vs_old"] == 1.25
    named = side_by_side({"main": old, "direct": new}, ("main", "direct"))
    assert named["speed"]["new_vs_old"] == 0.75 and named["speed"]["direct"] == [1.0, 2.0]
