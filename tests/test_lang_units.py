"""Model-free unit tests of the language: choice-scoring methods on fixed logprob lists with
known winners, expression validation, typed values, the chat-template differ and the
interpreter's error reporting (on a tiny scripted backend)."""

from __future__ import annotations

import json
import statistics
import threading

import pytest
from pydantic import BaseModel, ConfigDict

import radixlm as sgl
from radixlm.backend_base import GenOutput, ProgramBackend
from radixlm.chat_template import MEMO_KEY_CHARS, ChatTemplate, PlainChatTemplate
from radixlm.ir import REGEX_INT, convert_value, make_gen, normalize_json_schema


def _lp(values):
    """Logprob entries (lp, token_id, None) with distinct fake token ids."""
    return [(v, 100 + i, None) for i, v in enumerate(values)]


# ---- choice scoring --------------------------------------------------------------------


def test_token_length_normalized_uses_mean_not_sum():
    choices = ["long", "short"]
    cond = [_lp([-1.0, -0.01, -0.01]), _lp([-0.5])]
    means = [statistics.mean([-1.0, -0.01, -0.01]), -0.5]
    d = sgl.token_length_normalized(choices=choices, input_token_logprobs=cond)
    assert d.decision == "long"  # the sum would pick "short" (-0.5 > -1.02)
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx(means)
    assert d.meta_info["input_token_logprobs"] is cond


def test_greedy_token_selection_follows_first_token():
    choices = ["A", "B"]
    cond = [_lp([-0.5, -5.0]), _lp([-0.6, -0.1])]
    assert sgl.greedy_token_selection(choices=choices, input_token_logprobs=cond).decision == "A"
    assert sgl.token_length_normalized(choices=choices, input_token_logprobs=cond).decision == "B"


def test_greedy_token_selection_breaks_ties_on_later_tokens_and_pads_short_choices():
    tie = [_lp([-0.5, -0.2]), _lp([-0.5, -0.1])]
    assert sgl.greedy_token_selection(choices=["x", "y"], input_token_logprobs=tie).decision == "y"
    # "organ" is one token; padded with its own mean (-0.1) it beats "organism"'s -0.3.
    pad = [_lp([-0.1]), _lp([-0.1, -0.3])]
    d = sgl.greedy_token_selection(choices=["organ", "organism"], input_token_logprobs=pad)
    assert d.decision == "organ"
    assert d.meta_info["greedy_logprob_matrix"] == [[-0.1, -0.1], [-0.1, -0.3]]


def test_unconditional_likelihood_normalized_discounts_common_choices():
    choices = ["rare", "common"]
    cond = [_lp([-1.0, -1.0]), _lp([-0.5, -0.5])]
    uncond = [_lp([None, -3.0]), _lp([None, -0.5])]
    d = sgl.unconditional_likelihood_normalized(
        choices=choices, input_token_logprobs=cond, unconditional_token_logprobs=uncond
    )
    assert d.decision == "rare"
    expect = [statistics.mean([-1.0 - 0.0, -1.0 + 3.0]), statistics.mean([-0.5 - 0.0, -0.5 + 0.5])]
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx(expect)
    assert sgl.token_length_normalized(choices=choices, input_token_logprobs=cond).decision == "common"


def test_scoring_rejects_bad_inputs():
    with pytest.raises(ValueError, match="unconditional"):
        sgl.unconditional_likelihood_normalized(choices=["a"], input_token_logprobs=[_lp([-1.0])])
    with pytest.raises(ValueError, match="length"):
        sgl.unconditional_likelihood_normalized(
            choices=["a"],
            input_token_logprobs=[_lp([-1.0, -2.0])],
            unconditional_token_logprobs=[_lp([None])],
        )
    with pytest.raises(ValueError):
        sgl.token_length_normalized(choices=["a", "b"], input_token_logprobs=[_lp([-1.0])])
    with pytest.raises(ValueError, match="at least one token"):
        sgl.token_length_normalized(choices=["a"], input_token_logprobs=[[]])


# ---- expressions -----------------------------------------------------------------------


class Person(BaseModel):
    name: str
    age: int


def test_gen_maps_options_to_engine_names():
    g = sgl.gen(
        "x", max_tokens=5, min_tokens=2, stop=")", temperature=0.0, top_logprobs_num=3, return_logprob=True
    )
    assert g.sampling == {"max_new_tokens": 5, "min_new_tokens": 2, "stop": ")", "temperature": 0.0}
    assert g.logprob == {"return_logprob": True, "top_logprobs_num": 3}
    assert sgl.gen_int("n").sampling["regex"] == REGEX_INT
    assert isinstance(sgl.gen("c", choices=["a", "b"]), type(sgl.select("c", ["a", "b"])))


@pytest.mark.parametrize(
    "schema", [Person, Person.model_json_schema(), json.dumps(Person.model_json_schema())]
)
def test_json_schema_accepts_str_dict_and_pydantic(schema):
    g = sgl.gen("p", json_schema=schema)
    # A pydantic class is closed (no undeclared properties); a schema given as data is kept as is.
    closed = schema is Person
    assert json.loads(g.sampling["json_schema"]) == Person.model_json_schema() | (
        {"additionalProperties": False} if closed else {}
    )
    assert (g.schema_cls is Person) == (schema is Person)


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        ({"regex": "["}, "invalid regex"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": 3}, "json_schema must be"),
        ({"regex": "a", "json_schema": {}}, "at most one"),
        ({"max_tokens": -1}, "non-negative"),
        ({"dtype": list}, "dtype"),
    ],
)
def test_gen_rejects_bad_options(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        sgl.gen("x", **kwargs)


@pytest.mark.parametrize("choices", [[], None, ["a", ""], ["a", 3]])
def test_select_rejects_bad_choices(choices):
    with pytest.raises(ValueError):
        sgl.select("x", choices)


def test_typed_values_convert_or_fail_with_reason():
    assert convert_value(make_gen("n", {}, int), " 42") == 42
    assert convert_value(make_gen("f", {}, float), "-1.5") == -1.5
    assert convert_value(make_gen("s", {}, str), '"hi there"') == "hi there"
    p = convert_value(sgl.gen("p", json_schema=Person), '{"name": "Ann", "age": 3}')
    assert isinstance(p, Person) and p.age == 3
    with pytest.raises(ValueError, match="does not validate as Person"):
        convert_value(sgl.gen("p", json_schema=Person), '{"name": "Ann"}')
    with pytest.raises(ValueError, match="does not parse as int"):
        convert_value(make_gen("n", {}, int), "4x")


def test_expressions_concatenate_and_reject_none():
    e = "Q: " + sgl.gen("a") + "\n"
    assert [type(x).__name__ for x in e.exprs] == ["Constant", "Gen", "Constant"]
    with pytest.raises(ValueError, match="None"):
        sgl.user(None) + None  # noqa: B018


# ---- chat template differ --------------------------------------------------------------


def test_chat_template_prefix_suffix_from_render():
    def render(msgs):
        return "<s>" + "".join(f"[{m['role']}]{m['content']}[/{m['role']}]" for m in msgs)

    t = ChatTemplate(render)
    assert t.prefix_and_suffix("user", []) == ("[user]", "[/user]")
    assert t.prefix_and_suffix("assistant", [{"role": "user", "content": "x"}]) == (
        "[assistant]",
        "[/assistant]",
    )
    with pytest.raises(ValueError, match="unknown role"):
        t.prefix_and_suffix("robot", [])


def test_chat_template_memo_renders_each_role_and_messages_once():
    calls = []

    def render(msgs):
        calls.append(len(msgs))
        return "".join(f"[{m['role']}]{m['content']}[/{m['role']}]" for m in msgs)

    t = ChatTemplate(render, memoize=True)
    user = [{"role": "user", "content": "x"}]
    first = t.prefix_and_suffix("assistant", user)
    assert t.prefix_and_suffix("assistant", [{"role": "user", "content": "x"}]) == first
    assert len(calls) == 2  # with and without the new message, once
    assert t.prefix_and_suffix("assistant", [{"role": "user", "content": "y"}]) == first
    assert len(calls) == 4  # other messages: rendered again
    parts = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]  # unhashable: no memo
    t.prefix_and_suffix("assistant", parts)
    t.prefix_and_suffix("assistant", parts)
    assert len(calls) == 8
    long = [{"role": "user", "content": "z" * (MEMO_KEY_CHARS + 1)}]  # too long to keep
    t.prefix_and_suffix("assistant", long)
    t.prefix_and_suffix("assistant", long)
    assert len(calls) == 12


def test_a_template_that_reads_the_clock_is_not_memoized():
    class Tokenizer:
        def __init__(self, source):
            self.chat_template = source
            self.renders = 0

        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            self.renders += 1
            return "".join(f"<{m['role']}>{m['content']}" for m in msgs)

    plain, clock = Tokenizer("{{ messages }}"), Tokenizer("{{ strftime_now('%d %b %Y') }}")
    for tok in (plain, clock):
        t = ChatTemplate.from_tokenizer(tok)
        for _ in range(3):
            assert t.prefix_and_suffix("user", []) == ("<user>", "")
    assert plain.renders == 2 and clock.renders == 6


def test_chat_template_rejects_non_incremental_template():
    def render(msgs):  # the last message is rendered differently: not incremental
        return "".join(("LAST:" if i == len(msgs) - 1 else "") + m["content"] for i, m in enumerate(msgs))

    with pytest.raises(ValueError, match="not incremental"):
        ChatTemplate(render).prefix_and_suffix("user", [{"role": "user", "content": "a"}])


# ---- interpreter on a scripted text backend ----------------------------------------------


class ScriptedBackend(ProgramBackend):
    """Returns canned text; fails on request. Only for interpreter mechanics."""

    def __init__(self):
        self._template = PlainChatTemplate()
        self.prompts: list[str] = []

    def generate(self, ex, sampling, logprob):
        self.prompts.append(ex.text_)
        if sampling.get("stop") == "boom":
            raise ValueError("backend refused")
        return GenOutput(f"<{len(self.prompts)}>", None, {"n": len(self.prompts)})


def test_worker_error_reaches_caller_with_program_line():
    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x")
        s += sgl.gen("y", stop="boom")  # the failing line
        s += sgl.gen("z")

    with pytest.raises(ValueError, match="backend refused") as info:
        prog.run(backend=ScriptedBackend())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "test_lang_units.py" in notes and 's += sgl.gen("y", stop="boom")' in notes


def test_reading_a_failed_variable_raises_inside_the_program():
    seen = []

    @sgl.function
    def prog(s):
        s += sgl.gen("y", stop="boom")
        seen.append("before")
        s["y"]  # noqa: B018 - raises the worker's error here
        seen.append("after")

    with pytest.raises(ValueError, match="backend refused"):
        prog.run(backend=ScriptedBackend())
    assert seen == ["before"]


def test_state_text_roles_vars_and_forks_on_text_backend():
    be = ScriptedBackend()

    @sgl.function
    def prog(s, q):
        with s.user():
            s += q
        s += sgl.assistant(sgl.gen("a"))
        with s.var_scope("tail"):
            s += "T"
        forks = s.fork(3)
        forks += [f"f{i}" for i in range(3)]
        forks += sgl.gen("g")
        forks.join()
        return "done"

    st = prog.run(q="hi", backend=be)
    assert st.ret_value == "done"
    assert st.messages() == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<1>"}]
    assert st.text() == "User: hi\nAssistant: <1>\nT"
    assert st["tail"] == "T" and st["a"] == "<1>"
    assert sorted(st["g"]) == ["<2>", "<3>", "<4>"] and len(st.get_meta_info("g")) == 3
    assert sorted(be.prompts[1:]) == [st.text() + f"f{i}" for i in range(3)]


class ThreadRecordingBackend(ScriptedBackend):
    """Records the thread of every generate; fork branches ("f" in the prompt) meet at a
    barrier, so branches run one after another fail it."""

    def __init__(self, branches: int):
        super().__init__()
        self.threads: list[tuple[str, int]] = []
        self.barrier = threading.Barrier(branches, timeout=5)

    def generate(self, ex, sampling, logprob):
        if ex.text_.endswith("f"):
            self.barrier.wait()
        out = super().generate(ex, sampling, logprob)
        self.threads.append((ex.text_, threading.get_ident()))
        return out


def test_a_run_executes_its_own_state_inline_and_its_forks_concurrently():
    be = ThreadRecordingBackend(branches=3)
    body_thread = []

    @sgl.function
    def prog(s):
        body_thread.append(threading.get_ident())
        s += "root" + sgl.gen("a")
        forks = s.fork(3)
        forks += "f"
        forks += sgl.gen("g")
        forks.join()

    st = prog.run(backend=be)
    assert st["a"] == "<1>" and sorted(st["g"]) == ["<2>", "<3>", "<4>"]
    assert be.threads[0] == ("root", body_thread[0])  # the body's own thread ran its gen
    fork_threads = {t for text, t in be.threads if text.endswith("f")}
    assert len(fork_threads) == 3 and body_thread[0] not in fork_threads


def test_an_interrupt_in_an_inline_expression_stops_the_program_there():
    class InterruptingBackend(ScriptedBackend):
        def generate(self, ex, sampling, logprob):
            raise KeyboardInterrupt

    seen = []

    @sgl.function
    def prog(s):
        s += sgl.gen("x")
        seen.append("after")

    with pytest.raises(KeyboardInterrupt):
        prog.run(backend=InterruptingBackend())
    assert seen == []


def test_stream_mode_error_ends_iteration_with_the_error():
    @sgl.function
    def prog(s):
        s += "x" + sgl.gen("a")
        s += sgl.gen("b", stop="boom")

    st = prog.run(backend=ScriptedBackend(), stream=True)
    with pytest.raises(ValueError, match="backend refused"):
        list(st.text_iter())
    assert isinstance(st.error(), ValueError)


def test_role_method_result_is_not_appended_twice_and_copy_joins():
    @sgl.function
    def prog(s):
        s += s.user("hello")  # s.user(...) already appended; += adds nothing more
        with s.copy() as c:
            c += "side" + sgl.gen("side")
        s += "main"

    st = prog.run(backend=ScriptedBackend())
    assert st.messages() == [{"role": "user", "content": "hello"}]
    assert st.text() == "User: hello\nmain" and st["side"] == ["<1>"]


def test_nested_program_call_runs_on_the_callers_state():
    @sgl.function
    def inner(s, word):
        s += f"[{word}]"

    @sgl.function
    def outer(s):
        s += "a"
        inner(s, "b")
        s += "c"

    assert outer.run(backend=ScriptedBackend()).text() == "a[b]c"


def test_run_rejects_unknown_options_and_batches_of_non_dicts():
    @sgl.function
    def prog(s, x):
        s += x

    with pytest.raises(ValueError, match="unknown run option"):
        prog.run("a", backend=ScriptedBackend(), temprature=0)
    with pytest.raises(ValueError, match="list of dicts"):
        prog.run_batch(["a"], backend=ScriptedBackend())
    with pytest.raises(ValueError, match="no backend"):
        prog.run("a")


def test_typed_gen_closes_objects_unless_the_model_allows_extra() -> None:
    class Place(BaseModel):
        city: str

    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        x: int

    class Person(BaseModel):
        name: str
        home: Place
        notes: Open

    text, cls = normalize_json_schema(Person)
    schema = json.loads(text)
    assert cls is Person
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["Place"]["additionalProperties"] is False
    assert schema["$defs"]["Open"]["additionalProperties"] is True
    # Closing drops nothing pydantic would have kept: the model ignores undeclared fields anyway.
    doc = {"name": "Bo", "home": {"city": "Oslo"}, "notes": {"x": 1, "y": 2}}
    assert Person.model_validate(doc).model_dump() == {
        "name": "Bo",
        "home": {"city": "Oslo"},
        "notes": {"x": 1, "y": 2},
    }
