"""The trace of a program run (dsl/trace_run.py, schema in docs/studio.md) on the session's shared
engine: the tree rebuilt from the events must equal the state an untraced run of the same program
returns (text, branches, variables, select scores); prompt ranges decode to the text they cover;
a JSON-schema gen is flagged constrained with jump-forward tokens the engine reported; an error
carries the program's own line. Plus the engine's jump_forward_spans themselves."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import radixlm as sgl
from radixlm.program_host import ProgramsHost
from radixlm.trace_view import TraceTree

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GREEDY = {"temperature": 0, "max_new_tokens": 16}
PROBLEM = "A farmer has 12 sheep and buys 5 more. How many sheep does he have?"


@sgl.function
def fails(s, word: str):
    s += "Say " + word + ":" + sgl.gen("said", max_tokens=2)
    raise RuntimeError("failed on purpose")  # the line the error event must name


FAIL_LINE = next(
    i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "raise RuntimeError(" in line
)


@pytest.fixture(scope="module")
def host() -> ProgramsHost:
    return ProgramsHost.load([str(EXAMPLES / "tree_of_thought.py"), str(EXAMPLES / "json_extraction.py")])


def traced(host: Any, engine: Any, name: str, args: dict[str, Any], timeout_s: float = 120) -> TraceTree:
    run = host.trace(name, engine, options=dict(GREEDY), args=args)
    deadline = time.monotonic() + timeout_s
    while not run.is_finished:
        assert time.monotonic() < deadline, "traced run did not finish"
        time.sleep(0.02)
    return TraceTree.of(run.events())


def untraced(host: Any, engine: Any, name: str, args: dict[str, Any]) -> Any:
    return host.run(name, engine, stream=False, options=dict(GREEDY), args=args).result()


def test_tree_of_thought_trace_equals_the_state(host: Any, engine: Any) -> None:
    args = {"problem": PROBLEM, "width": 3}
    tree = traced(host, engine, "tree_of_thought", args)
    ref = untraced(host, engine, "tree_of_thought", args)
    assert tree.done is not None and tree.done["ok"], tree.errors
    assert tree.done["text"] == ref.text and tree.root.text == ref.text
    assert tree.done["variables"]["step"] == ref.variables["step"]
    assert tree.done["return_value"] == ref.return_value
    (fork,) = tree.forks
    branches = tree.branches(fork)
    assert len(branches) == 3 and tree.forks[fork]["join"] == "gather"
    approaches = ["write an equation", "count directly", "reason in words"]
    for i, node in enumerate(branches):
        expect = (
            f"Step 1 ({approaches[i]}):{ref.variables['step'][i]}\nIs this step correct? Answer yes or no: "
        )
        assert node.text == expect + ref.variables["verdict"][i]
        assert node.done and node.stats["generated_tokens"] > 0
    assert [s["decision"] for s in tree.selects] != [] and len(tree.selects) == 3
    for sel in tree.selects:
        i = [n.node for n in branches].index(sel["node"])
        assert sel["decision"] == ref.variables["verdict"][i] == sel["choices"][sel["index"]]
        want = ref.meta_info["verdict"][i]["normalized_prompt_logprobs"]
        assert sel["scores"]["normalized_prompt_logprobs"] == pytest.approx(want, abs=1e-4)
    assert all(n.done for n in tree.nodes.values())


def test_prompt_ranges_decode_to_their_text_and_report_the_cache(host: Any, engine: Any) -> None:
    args = {"problem": PROBLEM, "width": 2}
    traced(host, engine, "tree_of_thought", args)  # warm the cache with the same prompt
    run = host.trace("tree_of_thought", engine, options=dict(GREEDY), args=args)
    while not run.is_finished:
        time.sleep(0.02)
    events = run.events()
    tree = TraceTree.of(events)
    prompts = [e for e in events if e["type"] == "prompt"]
    assert prompts
    for p in prompts:
        text = tree.nodes[p["node"]].text
        assert engine.tokenizer.decode(p["ids"]) == text[p["start"] : p["end"]]
        assert 0 <= p["cached_tokens"] <= len(p["ids"]) and p["start"] <= p["cached_end"] <= p["end"]
    first = prompts[0]  # the root's prefix, prefilled before the fork: all but the last token cached
    assert first["node"] == tree.root.node and first["request"] == "prefill"
    assert first["cached_tokens"] >= len(first["ids"]) - 1
    assert tree.root.stats["cached_tokens"] > 0


def test_json_schema_gen_is_constrained_with_jump_forward(host: Any, engine: Any) -> None:
    args = {"text": "Maria is a 34 year old nurse who lives in Lisbon."}
    run = host.trace("extract_person", engine, options=dict(GREEDY), args=args)
    while not run.is_finished:
        time.sleep(0.02)
    events = run.events()
    gen_text = [e for e in events if e["type"] == "text" and e["source"] == "generated"]
    assert gen_text and all("constrained" in e["flags"] for e in gen_text)
    assert {e["constraint"]["kind"] for e in gen_text} == {"json_schema"}
    assert {e["constraint"]["name"] for e in gen_text} == {"Person"}
    jumped = [e for e in gen_text if "jump_forward" in e["flags"]]
    assert jumped, "the schema's keys should be written by jump-forward"
    for e in jumped:
        assert engine.tokenizer.decode(e["ids"]) == e["text"]
    (done_gen,) = [e for e in events if e["type"] == "gen_done"]
    assert done_gen["json_schema_valid"] is True
    assert done_gen["jump_forward_tokens"] >= sum(len(e["ids"]) for e in jumped)
    ref = untraced(host, engine, "extract_person", args)
    assert done_gen["value"] == ref.variables["person"].model_dump()
    assert json.loads("".join(e["text"] for e in gen_text)) == done_gen["value"]


def test_error_names_the_program_line(engine: Any) -> None:
    host = ProgramsHost({"fails": fails})
    tree = traced(host, engine, "fails", {"word": "hi"})
    assert tree.done is not None and tree.done["ok"] is False
    (err,) = tree.errors
    assert err["error_type"] == "RuntimeError" and err["message"] == "failed on purpose"
    assert err["file"] == __file__ and err["line"] == FAIL_LINE
    assert "raise RuntimeError" in err["code"]
    assert "failed on purpose" in tree.render()


def test_engine_reports_jump_forward_spans(engine: Any) -> None:
    schema = '{"type":"object","properties":{"name":{"type":"string","maxLength":8}},"required":["name"]}'
    chunks = list(
        engine.generate("Name:", {"max_new_tokens": 24, "temperature": 0, "json_schema": schema}, stream=True)
    )
    meta = chunks[-1]["meta_info"]
    spans = meta["jump_forward_spans"]
    assert spans and all(0 <= s < e <= meta["completion_tokens"] for s, e in spans)
    ids = [t for c in chunks for t in c["output_ids"]]
    first = engine.tokenizer.decode(ids[spans[0][0] : spans[0][1]])
    assert "name" in first  # the grammar wrote the key, not the model
    plain = engine.generate("Name:", {"max_new_tokens": 2, "temperature": 0})
    assert "jump_forward_spans" not in plain["meta_info"]
