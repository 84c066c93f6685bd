"""POST /generate against SGLang's documented request shapes, on real uvicorn (127.0.0.1, the
session engine): the logprob options of a batch given one per prompt, whole and streamed, checked
against the same prompts asked one at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixlm.backend.server import ServerThread, create_app

PROMPTS = ["The capital of France is", "One, two, three,"]
GREEDY = {"max_new_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def srv(engine) -> Iterator[ServerThread]:
    thread = ServerThread(create_app(engine), drain_timeout_s=2.0).start()
    yield thread
    thread.stop()


def _post(srv: ServerThread, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + "/generate", json=body, timeout=120)


def _same_entries(got: list[Any], want: list[Any]) -> None:
    """Logprob entries alike up to the float noise of batching: token ids and texts equal."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None or isinstance(w[0], list):  # a position's top list (None for the first token)
            _same_entries(g or [], w or [])
            continue
        assert g[1:] == w[1:]
        assert (g[0] is None and w[0] is None) or g[0] == pytest.approx(w[0], abs=1e-3)


def test_batch_logprob_options_one_per_prompt(srv: ServerThread) -> None:
    """SGLang's GenerateReqInput types return_logprob, logprob_start_len and top_logprobs_num as
    a value or a list with one per prompt; each prompt gets what its own request would."""
    per_prompt = {"return_logprob": [True, False], "logprob_start_len": [1, 0], "top_logprobs_num": [2, 0]}
    body = {"text": PROMPTS, "sampling_params": GREEDY, "return_text_in_logprobs": True, **per_prompt}
    r = _post(srv, body)
    assert r.status_code == 200, r.text
    first, second = (out["meta_info"] for out in r.json())
    alone = _post(
        srv,
        {
            "text": PROMPTS[0],
            "sampling_params": GREEDY,
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
        },
    ).json()["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs"):
        _same_entries(first[key], alone[key])
    assert all(isinstance(entry[2], str) for entry in first["output_token_logprobs"])
    assert not any("logprobs" in key for key in second)  # this prompt asked for none

    with httpx.stream("POST", srv.url + "/generate", json={**body, "stream": True}, timeout=120) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    last = {e["index"]: e["meta_info"] for e in events}
    _same_entries(last[0]["output_token_logprobs"], alone["output_token_logprobs"])
    assert not any("logprobs" in key for key in last[1])


@pytest.mark.parametrize(
    "field,value", [("return_logprob", [True]), ("logprob_start_len", [0, 0, 0]), ("top_logprobs_num", [1])]
)
def test_a_per_prompt_list_of_the_wrong_length_is_a_400(srv: ServerThread, field: str, value: list) -> None:
    r = _post(srv, {"text": PROMPTS, "sampling_params": GREEDY, "return_logprob": True, field: value})
    assert r.status_code == 400
    assert f"{field} has {len(value)} values for 2 prompts" in r.json()["error"]["message"]


def test_a_per_prompt_top_logprobs_num_is_bounded(srv: ServerThread) -> None:
    r = _post(srv, {"text": PROMPTS, "return_logprob": True, "top_logprobs_num": [1, 21]})
    assert r.status_code == 400 and "top_logprobs_num" in r.json()["error"]["message"]


def test_abort_by_a_listed_rid_stops_that_prompts_samples(srv: ServerThread) -> None:
    """With rid a list and n > 1 the samples run as rid-0, rid-1, ...; /abort_request with a listed
    rid stops that prompt's samples (SGLang aborts every request whose id starts with it) and no
    other prompt's."""
    long = {"max_new_tokens": 400, "ignore_eos": True, "n": 2, "temperature": 0.8}
    short = {"max_new_tokens": 12, "ignore_eos": True, "n": 2, "temperature": 0.8}
    body = {"text": PROMPTS, "rid": ["grp-a", "grp-b"], "sampling_params": [long, short], "stream": True}
    last: dict[int, dict[str, Any]] = {}
    found = None
    with httpx.stream("POST", srv.url + "/generate", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            last[event["index"]] = event["meta_info"]
            if found is None:
                found = httpx.post(srv.url + "/abort_request", json={"rid": "grp-a"}, timeout=30).json()[
                    "found"
                ]
    assert found is True
    reasons = {i: meta["finish_reason"]["type"] for i, meta in last.items()}
    assert reasons == {0: "abort", 1: "abort", 2: "length", 3: "length"}
    assert all(last[i]["completion_tokens"] < 400 for i in (0, 1))
    assert httpx.post(srv.url + "/abort_request", json={"rid": "grp-a"}, timeout=30).json()["found"] is False
