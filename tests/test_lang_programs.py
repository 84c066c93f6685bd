"""The issue-5 program suite on the default model (CPU, in-process Runtime): structural
assertions, checked against independent references (raw engine calls on the same tokens,
`apply_chat_template`, jsonschema, re.fullmatch). Runs on the session's shared engine."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time

import pytest
from pydantic import BaseModel, Field

import radixlm as sgl
from radixlm.ir import REGEX_INT, convert_value, make_gen

GREEDY = {"temperature": 0}
FEW_SHOT = (
    "Answer each question with one word.\n"
    "Q: What color is the sky on a clear day?\nA: Blue\n"
    "Q: What color is fresh grass?\nA: Green\n"
    "Q: What is frozen water called?\nA: Ice\n"
)


@pytest.fixture(scope="module")
def rt(engine):
    """The in-process backend over the session's shared engine (tests/conftest.py)."""
    return sgl.Runtime(engine=engine)


@pytest.fixture(scope="module")
def tok(rt):
    return rt.tokenizer


@pytest.fixture(scope="module")
def grammar(rt):
    """Constrained decoding must work on this engine (no skip: grammars are wired)."""
    rt.engine.generate("x", {"max_new_tokens": 1, "regex": "a"})


def flush(rt, timeout_s: float = 10.0) -> bool:
    """flush_cache, retried briefly: the shared session engine may still be finishing
    requests (e.g. aborted streams) left by other test modules."""
    deadline = time.monotonic() + timeout_s
    while not rt.flush_cache():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def raw(rt, ids, **sampling):
    return rt.engine.generate(input_ids=ids, sampling_params={**GREEDY, **sampling})


@sgl.function
def qa(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=4, stop="\n")


def test_few_shot_qa_run_batch_matches_raw_engine(rt, tok):
    questions = ["What color is snow?", "What animal barks?", "What is the opposite of hot?"]
    states = qa.run_batch([{"question": q} for q in questions], backend=rt, progress_bar=True, **GREEDY)
    assert len(states) == 3
    for st, q in zip(states, questions):
        prompt = FEW_SHOT + "Q: " + q + "\nA:"
        ref = raw(rt, enc(tok, prompt), max_new_tokens=4, stop="\n")
        assert st["answer"] == ref["text"]
        assert "\n" not in st["answer"]
        assert st.text() == prompt + ref["text"]
        assert st.get_meta_info("answer")["prompt_tokens"] == len(enc(tok, prompt))


def test_tracing_finds_and_precaches_the_constant_prefix(rt, tok):
    assert qa.trace_prefix(rt) == FEW_SHOT + "Q: "
    assert flush(rt)
    before = rt.get_stats()["kv_cached_slots"]
    n = qa.precache(rt)
    assert n == len(enc(tok, FEW_SHOT + "Q: ")) and n >= 32
    assert rt.get_stats()["kv_cached_slots"] - before >= n - 1
    st = qa.run("What is 1+1?", backend=rt, max_new_tokens=1, **GREEDY)
    assert st.get_meta_info("answer")["cached_tokens"] >= n - 2  # the traced prefix was reused
    assert flush(rt) and qa.cache(rt) == n  # SGLang's name
    assert rt.get_stats()["kv_cached_slots"] - before >= n - 1


@sgl.function
def role_qa(s, question):
    s += sgl.system("Answer in one short sentence.")
    with s.user():
        s += "Question: " + question
    s += sgl.assistant(sgl.gen("answer", max_tokens=1))


def test_a_traced_prefix_inside_a_role_block_is_where_every_run_starts(rt):
    prefix = role_qa.trace_prefix(rt)
    assert prefix.endswith("Question: ")  # not the role's closing text, added as the trace unwinds
    for question in ("Why is the sky blue?", "Hi"):
        assert role_qa.run(question, backend=rt, **GREEDY).text().startswith(prefix)


def test_generator_style_and_bind(rt):
    bound = qa.bind(question="What color is coal?")
    st = bound.run(backend=rt, max_new_tokens=2, **GREEDY)
    assert st.text().startswith(FEW_SHOT + "Q: What color is coal?\nA:")
    gen_states = qa.run_batch(
        [{"question": "Hi?"}, {"question": "Yo?"}],
        backend=rt,
        generator_style=True,
        max_new_tokens=2,
        num_threads=2,
        **GREEDY,
    )
    assert not isinstance(gen_states, list)
    texts = [s.text() for s in gen_states]
    assert "Q: Hi?\nA:" in texts[0] and "Q: Yo?\nA:" in texts[1]


@sgl.function
def chat(s):
    s += sgl.system("You are terse.")
    with s.user():
        s += "Name a color."
    s += sgl.assistant(sgl.gen("c1", max_tokens=4))
    with s.user():
        s += "Another one."
    s += sgl.assistant_begin() + sgl.gen("c2", max_tokens=4) + sgl.assistant_end()


def test_multi_turn_chat_messages_roles_and_template(rt, tok):
    st = chat.run(backend=rt, **GREEDY)
    msgs = st.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == "Name a color." and msgs[3]["content"] == "Another one."
    assert msgs[2]["content"] == st["c1"] and msgs[4]["content"] == st["c2"]
    assert st.text() == tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(st.token_ids(), skip_special_tokens=False) == st.text()
    # The first gen saw exactly the tokens apply_chat_template gives for the first turn.
    first = tok.apply_chat_template(msgs[:2], tokenize=True, add_generation_prompt=True)
    first_ids = first["input_ids"] if isinstance(first, dict) or hasattr(first, "keys") else first
    assert st.get_meta_info("c1")["prompt_tokens"] == len(first_ids)


def test_constant_program_tokens_equal_apply_chat_template(rt, tok):
    @sgl.function
    def convo(s):
        s += sgl.user("Hi! How are you?")
        s += sgl.assistant("Fine, thanks.")
        with s.user():
            s += "Tell me "
            s += "a joke."

    st = convo.run(backend=rt)
    ref = tok.apply_chat_template(st.messages(), tokenize=True)
    ref_ids = list(ref["input_ids"] if hasattr(ref, "keys") else ref)
    assert st.token_ids() == ref_ids


@sgl.function
def pick(s, method):
    s += "Question: What is the capital of France?\nAnswer: The capital of France is"
    s += sgl.select("city", choices=[" Paris", " London", " a banana"], choices_method=method)
    s += "."


@pytest.mark.parametrize(
    "method",
    [sgl.token_length_normalized, sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized],
)
def test_select_scores_exactly_each_choice(rt, tok, method):
    choices = [" Paris", " London", " a banana"]
    st = pick.run(method, backend=rt)
    meta = st.get_meta_info("city")
    assert st["city"] in choices
    prefix = enc(tok, "Question: What is the capital of France?\nAnswer: The capital of France is")
    means = []
    for c, got in zip(choices, meta["input_token_logprobs"]):
        ids = enc(tok, c)
        assert [e[1] for e in got] == ids  # the choice's own tokens, nothing of the prefix
        ref = rt.engine.generate(
            input_ids=prefix + ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=len(prefix),
        )
        ref_lps = [e[0] for e in ref["meta_info"]["input_token_logprobs"]]
        assert [e[0] for e in got] == pytest.approx(ref_lps, abs=1e-4)
        means.append(statistics.mean(ref_lps))
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means, abs=1e-4)
    if method is sgl.token_length_normalized:
        assert st["city"] == choices[max(range(3), key=means.__getitem__)]
    if method is sgl.unconditional_likelihood_normalized:
        assert len(meta["normalized_unconditional_prompt_logprobs"]) == 3
    assert st.token_ids() == prefix + enc(tok, st["city"]) + enc(tok, ".")


CAPITAL_Q = "Question: What is the capital of France?\nAnswer: The capital of France is "


@sgl.function
def capital(s):
    s += CAPITAL_Q
    s += sgl.select("city", choices=["Paris", "London", "Berlin"])


def test_select_heals_a_prompt_that_ends_in_a_space(rt, tok):
    """The prompt's trailing space token would split " Paris" unnaturally: every choice is scored
    as text tokenizes it, from the token before, and the state keeps the healed ids."""
    prefix = enc(tok, CAPITAL_Q)
    assert tok.decode(prefix[-1:]) == " "
    st = capital.run(backend=rt)
    meta = st.get_meta_info("city")
    means = []
    for c, got in zip(["Paris", "London", "Berlin"], meta["input_token_logprobs"]):
        ids = enc(tok, " " + c)
        assert [e[1] for e in got] == ids
        ref = rt.engine.generate(
            input_ids=prefix[:-1] + ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=len(prefix) - 1,
        )
        ref_lps = [e[0] for e in ref["meta_info"]["input_token_logprobs"]]
        assert [e[0] for e in got] == pytest.approx(ref_lps, abs=1e-4)
        means.append(statistics.mean(ref_lps))
    assert st["city"] == "Paris" == ["Paris", "London", "Berlin"][max(range(3), key=means.__getitem__)]
    assert [e[2] for e in meta["input_token_logprobs"][0]] == [tok.decode([t]) for t in enc(tok, " Paris")]
    assert st.token_ids() == prefix[:-1] + enc(tok, " Paris")
    assert tok.decode(st.token_ids(), skip_special_tokens=False) == st.text() == CAPITAL_Q + "Paris"


@sgl.function
def tool_loop(s):
    s += "You can call calc(expression).\n"
    for i in range(2):
        s += f"Step {i}: calc(" + sgl.gen(f"arg{i}", max_tokens=6, stop=")") + ")\n"
        s += f"Result {i}: {len(s[f'arg{i}'])}\n"


def test_tool_use_loop_with_stop(rt, tok):
    st = tool_loop.run(backend=rt, **GREEDY)
    for i in range(2):
        arg = st[f"arg{i}"]
        assert ")" not in arg
        assert f"Step {i}: calc({arg})\nResult {i}: {len(arg)}\n" in st.text()
        reason = st.get_meta_info(f"arg{i}")["finish_reason"]
        assert reason["type"] in ("stop", "length")
    assert tok.decode(st.token_ids(), skip_special_tokens=False) == st.text()


@sgl.function
def react(s, question):
    s += "Question: " + question + "\n"
    for step in range(3):
        s += "Action: " + sgl.select("act", choices=["Search", "Finish"]) + "\n"
        if s["act"] == "Finish":
            s += "Answer:" + sgl.gen("answer", max_tokens=4, stop="\n")
            return step
        s += "Query:" + sgl.gen("query", max_tokens=4, stop="\n") + "\nObservation: nothing found.\n"
    return 3


def test_react_loop_branches_on_select(rt):
    st = react.run("Who wrote Hamlet?", backend=rt, **GREEDY)
    text = st.text()
    actions = re.findall(r"^Action: (\w+)$", text, flags=re.M)
    assert actions and set(actions) <= {"Search", "Finish"}
    assert text.count("Observation: nothing found.") == actions.count("Search")
    assert st.ret_value == (len(actions) - 1 if actions[-1] == "Finish" else 3)
    assert ("Answer:" in text) == (actions[-1] == "Finish")


@sgl.function
def fruits(s):
    s += "A numbered list of fruits:\n"
    forks = s.fork(5)
    forks += lambda i: f"{i + 1}."
    forks += sgl.gen("fruit", max_tokens=3, stop="\n")
    forks.join()


def test_fork_join_gathers_five_values(rt, tok):
    st = fruits.run(backend=rt, **GREEDY)
    got = st["fruit"]
    assert isinstance(got, list) and len(got) == 5
    prompts = [enc(tok, "A numbered list of fruits:\n") + enc(tok, f"{i + 1}.") for i in range(5)]
    refs = raw(rt, prompts, max_new_tokens=3, stop="\n")
    assert sorted(got) == sorted(r["text"] for r in refs)
    assert st.text() == "A numbered list of fruits:\n"  # gather_variable leaves the text alone


def test_fork_prefills_shared_prefix_once_and_keeps_it_locked(rt, tok):
    long_prefix = "The quick brown fox jumps over the lazy dog. " * 25
    n_prefix = len(enc(tok, long_prefix))
    seen = {}

    @sgl.function
    def branches(s):
        s += long_prefix
        forks = s.fork(4)
        seen["flush_while_forked"] = rt.flush_cache()
        seen["protected"] = rt.engine.cache.protected_size()
        forks += lambda i: f" Part {i}:"
        forks += sgl.gen("x", max_tokens=2)
        forks.join("concate_and_append")

    assert flush(rt)
    before = rt.get_stats()
    st = branches.run(backend=rt, **GREEDY)
    after = rt.get_stats()
    computed = after["computed_prompt_tokens"] - before["computed_prompt_tokens"]
    assert n_prefix > 200
    assert computed < n_prefix + 4 * 10  # prefix once, plus each fork's own few tokens
    assert seen["flush_while_forked"] is False and seen["protected"] >= n_prefix
    assert flush(rt)  # unpinned after join
    parts = re.findall(r" Part (\d):", st.text())
    assert sorted(parts) == ["0", "1", "2", "3"] and st.text().startswith(long_prefix)
    assert tok.decode(st.token_ids(), skip_special_tokens=False) == st.text()


def test_unjoined_forks_are_ended_and_unpinned_with_the_program(rt):
    @sgl.function
    def leaky(s):
        s += "Some shared prefix text for the forks. " * 3
        forks = s.fork(2)
        forks += sgl.gen("x", max_tokens=1)

    leaky.run(backend=rt, **GREEDY)
    assert flush(rt)  # refused while a prefix is still pinned


@sgl.function
def story(s):
    s += "Once upon a time"
    s += sgl.gen("a", max_tokens=8, ignore_eos=True)


def test_streaming_chunks_concatenate_to_final_text(rt):
    st = story.run(backend=rt, stream=True, **GREEDY)
    chunks = list(st.text_iter())
    assert len(chunks) >= 2 and "".join(chunks) == st.text()
    st2 = story.run(backend=rt, stream=True, **GREEDY)
    var_chunks = list(st2.text_iter("a"))
    assert "".join(var_chunks) == st2["a"] and len(var_chunks) >= 2
    assert st2["a"] == st["a"]

    async def collect():
        st3 = story.run(backend=rt, stream=True, **GREEDY)
        out = [(c, m) async for c, m in st3.text_async_iter("a", return_meta_data=True)]
        return st3, out

    st3, out = asyncio.run(collect())
    assert "".join(c for c, _ in out) == st3["a"] == st["a"]
    assert all(m is not None for _, m in out)


def test_min_tokens_respected(rt, tok):
    comma = enc(tok, ",")

    @sgl.function
    def count(s, min_tokens):
        s += "1, 2, 3, 4, 5,"
        s += sgl.gen("n", max_tokens=8, min_tokens=min_tokens, stop_token_ids=comma)

    free = count.run(None, backend=rt, **GREEDY)
    forced = count.run(6, backend=rt, **GREEDY)
    assert free.get_meta_info("n")["completion_tokens"] < 6  # control: the stop fires early
    assert forced.get_meta_info("n")["completion_tokens"] >= 6


def test_engine_error_reaches_caller_with_program_line(rt):
    @sgl.function
    def too_long(s):
        s += "Hello"
        s += sgl.gen("x", max_tokens=10**7)

    with pytest.raises(ValueError) as info:
        too_long.run(backend=rt)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "test_lang_programs.py" in notes and 's += sgl.gen("x", max_tokens=10**7)' in notes


def test_arun_and_arun_batch_match_run(rt):
    async def main():
        one = await story.arun(backend=rt, **GREEDY)
        many = await qa.arun_batch(
            [{"question": "Sky?"}, {"question": "Sea?"}], backend=rt, max_new_tokens=2, **GREEDY
        )
        return one, many

    one, many = asyncio.run(main())
    assert one["a"] == story.run(backend=rt, **GREEDY)["a"]
    assert [m.text().split("Q: ")[-1].split("\n")[0] for m in many] == ["Sky?", "Sea?"]


# ---- constrained generation (needs the grammar backend in the engine) --------------------


class Person(BaseModel):
    name: str = Field(max_length=10)  # bounded, so the JSON always closes within max_tokens
    age: int = Field(ge=0, le=150)


PERSON_REGEX = r'\{"name": "[A-Z][a-z]{1,8}", "age": [1-9][0-9]?\}'


def test_gen_int_parses(rt, grammar):
    @sgl.function
    def num(s):
        s += "The number of legs of a dog is "
        s += sgl.gen_int("n", max_tokens=4)

    st = num.run(backend=rt, **GREEDY)
    raw_text = st.text()[len("The number of legs of a dog is ") :]
    assert re.fullmatch(REGEX_INT, raw_text) and isinstance(st["n"], int) and st["n"] == int(raw_text)


def test_gen_int_ends_at_its_separator(rt, grammar):
    """A small model rarely writes end-of-text after a number: the gen must stop at the space or
    newline the pattern lets in, not run on to max_tokens as one long digit string."""

    @sgl.function
    def year(s):
        s += "The year World War II ended was "
        s += sgl.gen_int("y", max_tokens=16)

    st = year.run(backend=rt, **GREEDY)
    assert st.get_meta_info("y")["finish_reason"]["type"] == "stop", st.text()
    assert isinstance(st["y"], int) and 0 < st["y"] < 10**6


def test_a_typed_gen_cut_by_its_token_limit_says_so(rt, grammar):
    @sgl.function
    def person(s):
        s += "Alice is 30. As JSON: " + sgl.gen("p", json_schema=Person, max_tokens=5)

    with pytest.raises(ValueError, match=r"(?s)does not validate as Person.*hit its token limit, 5 tokens"):
        person.run(backend=rt, **GREEDY)


def test_gen_str_keeps_newlines_and_tabs():
    assert convert_value(make_gen("v", {}, str), '"a\nb\tc"') == "a\nb\tc"


def test_json_from_regex_and_schema_validates(rt, grammar):
    import jsonschema

    @sgl.function
    def extract(s):
        s += "Alice is 30 years old. As JSON: "
        s += sgl.gen("by_regex", regex=PERSON_REGEX, max_tokens=24)
        s += "\nAgain: "
        s += sgl.gen("by_schema", json_schema=Person.model_json_schema(), max_tokens=40)

    st = extract.run(backend=rt, **GREEDY)
    assert re.fullmatch(PERSON_REGEX, st["by_regex"])
    jsonschema.validate(json.loads(st["by_regex"]), Person.model_json_schema())
    jsonschema.validate(json.loads(st["by_schema"]), Person.model_json_schema())


def test_typed_gen_returns_pydantic_object(rt, grammar):
    @sgl.function
    def typed(s):
        s += "Bob is 41 years old. As JSON: "
        s += sgl.gen("person", json_schema=Person, max_tokens=40)

    st = typed.run(backend=rt, **GREEDY)
    assert isinstance(st["person"], Person)
    assert st["person"] == Person.model_validate_json(st.text()[len("Bob is 41 years old. As JSON: ") :])


def test_quickstart_example_runs(rt, tok):
    """The README's main job: examples/quickstart.py on the default backend."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sgl.set_default_backend(rt)
    try:
        st = module.main()
    finally:
        sgl.set_default_backend(None)
    assert [m["role"] for m in st.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert st["topic"] in ("science", "art") and st.messages()[-1]["content"] == st["topic"]
    assert st.text() == tok.apply_chat_template(st.messages(), tokenize=False)


def test_continuation_extends_exactly_the_cached_tokens(rt):
    """After a gen, the next request starts with the very tokens the model produced, so the
    radix cache covers the whole previous prompt + output (re-tokenized text could not)."""

    @sgl.function
    def two(s):
        s += "Some animals, one per line:\n1."
        s += sgl.gen("a", max_tokens=6, ignore_eos=True)
        s += "\n2."
        s += sgl.gen("b", max_tokens=2)

    assert flush(rt)
    st = two.run(backend=rt, **GREEDY)
    a, b = st.get_meta_info("a"), st.get_meta_info("b")
    assert b["prompt_tokens"] > a["prompt_tokens"] + a["completion_tokens"]
    assert b["cached_tokens"] >= a["prompt_tokens"] + a["completion_tokens"] - 1


def test_gen_logprob_options_reach_the_engine(rt, tok):
    @sgl.function
    def lp(s):
        s += "The capital of France is"
        s += sgl.gen("a", max_tokens=3, ignore_eos=True, return_logprob=True, top_logprobs_num=2)

    st = lp.run(backend=rt, **GREEDY)
    meta = st.get_meta_info("a")
    out = meta["output_token_logprobs"]
    assert len(out) == meta["completion_tokens"] == 3
    assert tok.decode([e[1] for e in out]) == st["a"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert all(top[0][0] >= e[0] - 1e-5 for top, e in zip(meta["output_top_logprobs"], out))  # greedy = top-1
