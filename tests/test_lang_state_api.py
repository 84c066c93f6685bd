"""The ProgramState and program API an SGLang program uses past gen/select: streamed readers of a
select's value with its meta, a streamed gen that fails (its variable raises as a non-streamed
one's does, its state's repr says it failed), SGLang's flush_cache(empty_cache=...), its
trace()/compile() refused with why, its names radixlm lacks (image, video, ...) importable and
refusing with why when used, a refused global_config setting that points to an option that
exists, fork/copy's position_ids_offset, and positional arguments bound as Python binds them.
On the session's shared engine (CPU, default model)."""

from __future__ import annotations

import asyncio
import time

import pytest

import radixlm as sgl


@pytest.fixture(scope="module")
def rt(engine):
    return sgl.Runtime(engine=engine)


@sgl.function
def sky(s):
    s += "The sky is"
    s += sgl.select("colour", choices=[" blue", " green"])
    with s.var_scope("tail"):
        s += " today"


def test_async_meta_reader_yields_a_streamed_selects_value_and_meta(rt):
    async def read(var: str) -> list[object]:
        st = sky.run(backend=rt, stream=True)
        return [c async for c in st.text_async_iter(var, return_meta_data=True)]

    plain = sky.run(backend=rt)
    [(value, meta)] = asyncio.run(read("colour"))
    assert value == plain["colour"]
    assert isinstance(meta, dict)
    assert meta["normalized_prompt_logprobs"] == pytest.approx(
        plain.get_meta_info("colour")["normalized_prompt_logprobs"]
    )
    assert asyncio.run(read("tail")) == [(" today", None)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_gens_variable_raises_its_error_streamed_or_not(rt, stream):
    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("ok", max_tokens=2, temperature=0)
        s += sgl.gen("too_long", max_tokens=10**6)

    if not stream:
        with pytest.raises(ValueError, match="exceeds the context length"):
            prog.run(backend=rt)
        return
    st = prog.run(backend=rt, stream=True)
    with pytest.raises(ValueError, match="exceeds the context length"):
        list(st.text_iter())
    assert isinstance(st["ok"], str)  # what finished before the error keeps its value
    with pytest.raises(ValueError, match="exceeds the context length"):
        st["too_long"]  # noqa: B018
    with pytest.raises(ValueError, match="exceeds the context length"):
        st.get_meta_info("too_long")


def test_flush_cache_takes_sglangs_empty_cache(rt):
    sky.run(backend=rt)
    deadline = time.monotonic() + 10  # the shared session engine may still be finishing a request
    while not sgl.flush_cache(rt, empty_cache=False) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rt.engine.get_stats()["kv_cached_slots"] == 0
    assert sgl.flush_cache(rt, empty_cache=True)
    assert sgl.flush_cache(backend=rt)
    with pytest.raises(ValueError, match="empty_cache must be True or False"):
        sgl.flush_cache(rt, empty_cache="yes")


def test_sglangs_trace_and_compile_are_refused_with_why():
    for name in ("trace", "compile"):
        with pytest.raises(AttributeError, match=f"no {name}\\(\\): SGLang's traced graph"):
            getattr(sky, name)()
    with pytest.raises(AttributeError, match="has no attribute 'no_such_method'"):
        sky.no_such_method  # noqa: B018


def test_sglang_names_not_provided_import_and_refuse_with_why_when_used(rt):
    from radixlm import Anthropic, image, separate_reasoning, video  # as a port's imports read

    @sgl.function
    def look(s):
        s += sgl.user(image("cat.png") + "What is this?")

    with pytest.raises(NotImplementedError, match="no 'image': multimodal inputs are not supported"):
        look.run(backend=rt)
    with pytest.raises(NotImplementedError, match="no 'video': multimodal"):
        video("clip.mp4", num_frames=4)
    with pytest.raises(NotImplementedError, match="no 'separate_reasoning': reasoning parsers"):
        separate_reasoning(sgl.gen("answer"), model_type="deepseek-r1")
    with pytest.raises(NotImplementedError, match="no 'Anthropic': no Anthropic backend"):
        Anthropic("claude-3-haiku")


def test_a_refused_global_setting_points_to_an_option_that_exists(rt):
    with pytest.raises(AttributeError, match=r"prog\.run\(skip_special_tokens=") as refused:
        sgl.global_config.skip_special_tokens_in_output = False
    assert "per gen" not in str(refused.value)  # gen() takes no skip_special_tokens (nor SGLang's)
    with pytest.raises(TypeError):
        sgl.gen("x", skip_special_tokens=False)  # type: ignore[call-arg]

    @sgl.function
    def hi(s):
        s += sgl.user("hi") + sgl.assistant(sgl.gen("a", max_tokens=3, temperature=0))

    hi.run(backend=rt, skip_special_tokens=False, spaces_between_special_tokens=False)


def test_a_failed_states_repr_shows_the_failure_instead_of_raising(rt):
    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("too_long", max_tokens=10**6)

    st = prog.run(backend=rt, stream=True)
    with pytest.raises(ValueError, match="exceeds the context length"):
        list(st.text_iter())  # to the end of the run
    assert repr(st) == f"ProgramState('Hello', failed: {st.error()!r})"
    assert repr(sky.run(backend=rt)).startswith("ProgramState('The sky is")


def test_fork_and_copy_take_sglangs_position_ids_offset_as_none_only(rt):
    @sgl.function
    def prog(s):
        s += "Pick a number:"
        forks = s.fork(2, position_ids_offset=None)
        forks += sgl.gen("n", max_tokens=2, temperature=0)
        forks.join()
        with s.copy(position_ids_offset=None) as c:
            c += sgl.gen("m", max_tokens=2, temperature=0)
        with pytest.raises(ValueError, match="position_ids_offset=...\\) is not supported"):
            s.fork(2, position_ids_offset=[0, 0])

    st = prog.run(backend=rt)
    assert len(st["n"]) == 2 and len(st["m"]) == 1


def test_positional_arguments_bind_as_a_python_call_binds_them(rt):
    @sgl.function
    def rest(s, a, *more, k="K"):
        s += a + "|" + "".join(more) + "|" + k

    @sgl.function
    def keyword_only(s, a, *, k="K"):
        s += a + "|" + k

    assert rest.run("x", "y", "z", k="Q", backend=rt).text() == "x|yz|Q"
    assert rest.run("x", "y", backend=rt).text() == "x|y|K"  # not k="y"
    assert keyword_only.run("x", k="y", backend=rt).text() == "x|y"
    with pytest.raises(ValueError, match="takes 1 positional argument"):
        keyword_only.run("x", "y", backend=rt)  # Python (and SGLang's call) refuses it too
    with pytest.raises(ValueError, match="takes 1 positional argument"):
        keyword_only.run_batch([["x", "y"]], backend=rt)
    assert keyword_only.bind(k="B").run_batch([["x"]], backend=rt)[0].text() == "x|B"
