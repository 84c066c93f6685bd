"""The language where an SGLang program leans on it: @function's own sampling defaults, streamed
typed gens and repeated stream readers, bad backends and bad logprob options refused where they
are given, dtype over regex, run_batch entries that set their own options, SGLang's gen parameters
and choices-method arguments, and keyword programs. On the session's shared engine (CPU, default
model)."""

from __future__ import annotations

import asyncio
import re
import threading
import uuid
import warnings

import pytest

import radixlm as sgl
from radixlm.backend.sampling_params import DEFAULT_MAX_NEW_TOKENS
from radixlm.ir import REGEX_INT


@pytest.fixture(scope="module")
def rt(engine):
    return sgl.Runtime(engine=engine)


def test_function_decorator_max_new_tokens_is_the_default_for_every_gen(rt):
    @sgl.function(max_new_tokens=4, temperature=0)
    def prog(s):
        s += "Once upon a time"
        s += sgl.gen("x", ignore_eos=True)

    assert prog.run(backend=rt).get_meta_info("x")["completion_tokens"] == 4
    assert prog.run_batch([{}], backend=rt)[0].get_meta_info("x")["completion_tokens"] == 4
    assert prog.run(backend=rt, max_new_tokens=6).get_meta_info("x")["completion_tokens"] == 6
    plain = sgl.function(prog.func)  # no decorator value: the engine's one default
    assert (
        plain.run(backend=rt, temperature=0).get_meta_info("x")["completion_tokens"] == DEFAULT_MAX_NEW_TOKENS
    )


def test_streamed_typed_gen_chunks_join_to_its_text(rt, engine):
    engine.generate("x", {"max_new_tokens": 1, "regex": "a"})  # grammars are wired

    @sgl.function
    def prog(s):
        s += "Number:"
        s += sgl.gen("n", max_tokens=4, dtype=int)

    st = prog.run(stream=True, temperature=0, backend=rt)
    chunks = list(st.text_iter("n"))
    assert isinstance(st["n"], int)
    assert "".join(chunks) == st.text()[len("Number:") :] and int("".join(chunks)) == st["n"]


def test_a_second_stream_reader_replays_instead_of_hanging(rt):
    @sgl.function
    def prog(s):
        s += "Hello"
        s += sgl.gen("x", max_tokens=4, ignore_eos=True)

    st = prog.run(stream=True, temperature=0, backend=rt)
    first = "".join(st.text_iter("x"))
    again: list[str] = []
    reader = threading.Thread(
        target=lambda: again.extend(["".join(st.text_iter("x")), "".join(st.text_iter())]), daemon=True
    )
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "a second text_iter on a finished stream hung"
    assert again == [first, st.text()] and first == st["x"]


def test_set_default_backend_refuses_what_is_not_a_backend():
    with pytest.raises(TypeError, match="takes a backend"):
        sgl.set_default_backend("http://localhost:30000")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options,reason",
    [
        ({"return_logprob": "yes"}, "return_logprob must be True or False"),
        ({"logprob_start_len": "a"}, "logprob_start_len must be an int >= -1"),
        ({"top_logprobs_num": -1}, "top_logprobs_num must be an int >= 0"),
    ],
)
def test_logprob_options_are_checked_where_given(options, reason):
    with pytest.raises(ValueError, match=reason):
        sgl.gen("x", max_tokens=2, **options)

    @sgl.function
    def prog(s):
        s += "x"

    with pytest.raises(ValueError, match=reason):
        prog.run(backend=object(), **options)  # refused before the backend is used


def test_dtype_overrides_regex_with_a_warning():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        g = sgl.gen("y", max_tokens=4, dtype=int, regex="[a-z]+")
    assert g.sampling["regex"] == REGEX_INT
    assert any("overrides regex" in str(w.message) for w in seen)


def test_run_batch_entries_set_their_own_options(rt):
    @sgl.function
    def prog(s, q):
        s += q + sgl.gen("a", ignore_eos=True)

    states = prog.run_batch(
        [{"q": "Hi", "max_new_tokens": 3}, {"q": "Yo", "temperature": 0}],
        backend=rt,
        temperature=0.5,
        max_new_tokens=5,
    )
    assert [st.get_meta_info("a")["completion_tokens"] for st in states] == [3, 5]


def test_a_choices_method_written_to_sglangs_interface_gets_all_five_arguments(rt):
    seen: dict[str, object] = {}

    class Shortest(sgl.ChoicesSamplingMethod):
        def __call__(
            self,
            *,
            choices,
            normalized_prompt_logprobs,
            input_token_logprobs,
            output_token_logprobs,
            unconditional_token_logprobs=None,
        ):
            seen.update(normalized=normalized_prompt_logprobs, output=output_token_logprobs)
            best = min(range(len(choices)), key=lambda i: len(input_token_logprobs[i]))
            return sgl.ChoicesDecision(decision=choices[best], meta_info={})

    @sgl.function
    def prog(s):
        s += "The capital of France is"
        s += sgl.select("c", choices=[" the city of Paris", " Paris"], choices_method=Shortest())

    assert prog.run(backend=rt)["c"] == " Paris"
    assert seen["output"] == [[], []] and len(seen["normalized"]) == 2  # type: ignore[arg-type]


def test_run_batch_takes_lists_of_positional_arguments(rt):
    @sgl.function
    def prog(s, q, tail="!"):
        s += q + tail + sgl.gen("a", max_tokens=2)

    states = prog.run_batch([["Hi"], ("Yo", "?")], backend=rt, temperature=0)
    assert [st.text()[:3] for st in states] == ["Hi!", "Yo?"]
    with pytest.raises(ValueError, match="a batch entry has 3"):
        prog.run_batch([["a", "b", "c"]], backend=rt)


def test_gen_takes_sglangs_parameters_in_sglangs_order():
    g = sgl.gen("x", 4, None, None, "\n")  # name, max_tokens, min_tokens, n, stop
    assert g.sampling["max_new_tokens"] == 4 and g.sampling["stop"] == "\n"
    # name, max_tokens, n, stop; a number also stops at a space or newline, as SGLang's does
    assert sgl.gen_int("i", 3, 1, ".").sampling["stop"] == [".", " ", "\n"]
    assert sgl.gen("f", dtype=float, stop=["\n", "x"]).sampling["stop"] == ["\n", "x", " "]
    with pytest.raises(ValueError, match="s.fork"):
        sgl.gen("x", n=2)
    with pytest.raises(ValueError, match="stop_regex .* matches the empty string"):
        sgl.gen("x", stop_regex="a*")
    with pytest.raises(ValueError, match="choices"):
        sgl.gen("x", choices=[])  # SGLang would silently generate free text instead


def test_stop_regex_and_stop_tuples_reach_the_engine(rt):
    @sgl.function
    def prog(s):
        s += "Count: 1, 2, 3, 4, 5, 6, 7,"
        s += sgl.gen("free", max_tokens=12, ignore_eos=True)
        s += "\nAgain: 1, 2, 3, 4, 5, 6, 7,"
        s += sgl.gen("cut", max_tokens=12, ignore_eos=True, stop_regex=r"1\d", stop=("zzz",))

    st = prog.run(backend=rt, temperature=0)
    start = re.search(r"1\d", st["free"])
    assert start is not None, f"the model's count changed: {st['free']!r}"
    assert st["cut"] == st["free"][: start.start()]
    assert st.get_meta_info("cut")["finish_reason"] == {"type": "stop", "matched": r"1\d"}


def test_stream_readers_yield_what_sglangs_do(rt):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("x", max_tokens=2)

    st = prog.run(backend=rt, temperature=0, stream=True)
    assert list(st.text_iter("never_set")) == [""]

    async def chunks() -> list[object]:
        return [c async for c in st.text_async_iter(return_meta_data=True)]

    assert all(isinstance(c, str) for c in asyncio.run(chunks()))


@pytest.mark.parametrize("stream", [False, True])
def test_return_text_in_logprobs_fills_each_tokens_text(rt, stream):
    @sgl.function
    def prog(s):
        s += "The sky is"
        s += sgl.gen("x", max_tokens=3, return_logprob=True, top_logprobs_num=2, ignore_eos=True)

    plain = prog.run(backend=rt, temperature=0, stream=stream)
    with_text = prog.run(backend=rt, temperature=0, stream=stream, return_text_in_logprobs=True)
    if stream:
        for st in (plain, with_text):
            list(st.text_iter())
    entries = with_text.get_meta_info("x")["output_token_logprobs"]
    assert [e[2] for e in plain.get_meta_info("x")["output_token_logprobs"]] == [None] * 3
    assert [e[2] for e in entries] == [rt.tokenizer.decode([e[1]]) for e in entries]
    assert "".join(e[2] for e in entries) == with_text["x"]
    tops = with_text.get_meta_info("x")["output_top_logprobs"]
    assert all(isinstance(t[2], str) for row in tops for t in row)


def test_keyword_programs_get_their_keywords_and_duplicates_are_refused(rt):
    @sgl.function
    def kw(s, **kwargs):
        s += "x" + kwargs.get("a", "") + sgl.gen("g", max_tokens=1)

    assert kw.run(backend=rt, a="b", temperature=0).text().startswith("xb")  # temperature: a run option

    @sgl.function
    def one(s, a):
        s += a

    with pytest.raises(TypeError, match="multiple values for argument 'a'"):
        one.run("x", a="y", backend=rt)


def test_cache_prefix_takes_text_as_sglangs_runtime_does(rt, engine):
    text = f"Instructions {uuid.uuid4().hex}: answer every question in one word. " * 3
    n = len(rt.get_tokenizer().encode(text, add_special_tokens=False))
    rt.cache_prefix(text)
    out = engine.generate(text + "Question: why?", {"max_new_tokens": 1})
    assert out["meta_info"]["cached_tokens"] >= n - 1  # the seam token may re-tokenize


def test_get_server_info_in_process_and_refusals(rt, engine):
    info = sgl.get_server_info(rt)
    assert info["context_length"] == engine.model_config.context_len
    assert info["internal_states"][0]["num_running"] >= 0
    with pytest.raises(ValueError, match="no backend given"):
        sgl.get_server_info()
    with pytest.raises(NotImplementedError, match="no 'image': multimodal inputs are not supported"):
        sgl.image("cat.png")
    with pytest.raises(AttributeError, match="no_such_name"):
        sgl.no_such_name  # noqa: B018


def test_global_config_settings_act_and_sglangs_runtime_constants_are_refused(rt, capsys):
    import importlib.metadata

    class Counting(sgl.Runtime):
        prefixes = 0

        def cache_prefix(self, ids):
            Counting.prefixes += 1
            return super().cache_prefix(ids)

    @sgl.function
    def qa(s, q):
        s += "Answer each question in one word, as briefly as you can, and never explain. " * 2
        s += "Q: " + q + "\nA:" + sgl.gen("a", max_tokens=2, temperature=0)

    counting = Counting(engine=rt.engine)
    cfg = sgl.global_config
    try:
        cfg.default_backend = counting  # what set_default_backend sets
        assert sgl.get_default_backend() is counting
        qa.run_batch([{"q": "a"}, {"q": "b"}])
        assert Counting.prefixes == 1  # the traced constant prefix, cached first
        cfg.enable_precache_with_tracing = False
        qa.run_batch([{"q": "a"}, {"q": "b"}])
        assert Counting.prefixes == 1
        capsys.readouterr()
        cfg.verbosity = 2
        state = qa.run(q="c")
        assert capsys.readouterr().out == state.text() + "\n"
    finally:
        cfg.verbosity, cfg.enable_precache_with_tracing, cfg.default_backend = 0, True, None
    with pytest.raises(TypeError, match="takes a backend"):
        cfg.default_backend = "http://localhost:30000"
    with pytest.raises(AttributeError, match="retract_decode_steps is not a setting here"):
        cfg.retract_decode_steps = 5
    with pytest.raises(AttributeError, match="no setting 'verbose'"):
        cfg.verbose = 2
    assert sgl.__version__ == importlib.metadata.version("radixlm")
