"""The Engine as an SGLang offline script uses it: `get_server_info()`, SGLang's ServerArgs names
passed to `Engine(**kwargs)` (honoured, accepted, or refused with the reason before any model
work), and `encode` answering in SGLang's shape."""

from __future__ import annotations

import pytest

from radixlm.backend.engine import Engine


def test_get_server_info_has_sglangs_keys(engine):
    info = engine.get_server_info()
    assert info["model_path"] == engine.model_path
    assert info["tp_size"] == 1 and info["dp_size"] == 1 and info["random_seed"] == 0
    assert info["max_total_num_tokens"] == engine.get_stats()["kv_total_slots"]
    assert info["context_length"] == engine.model_config.context_len
    assert isinstance(info["internal_states"], list) and "num_running" in info["internal_states"][0]
    assert isinstance(info["version"], str)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"skip_tokenizer_init": True}, "always loads the tokenizer"),
        ({"dp_size": 2}, "radixlm serve --dp"),
        ({"enable_torch_compile": True}, "torch.compile"),
        ({"stream_output": False}, "incremental"),
        ({"disable_overlap_schedule": "yes"}, "True or False"),
        ({"mem_fraction_static": 2.0}, r"mem_fraction_static must be a number in \(0, 1\]"),
        ({"mem_fraction_static": 0}, "mem_fraction_static"),
    ],
)
def test_sglang_server_args_it_cannot_honour_are_refused_with_the_reason(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        Engine(**kwargs)


def test_a_name_neither_engine_has_is_a_type_error():
    with pytest.raises(TypeError, match="no_such_option"):
        Engine(no_such_option=1)


def test_sglang_server_arg_names_are_honoured():
    with Engine(random_seed=7, disable_overlap_schedule=True, trust_remote_code=True, dp_size=1) as eng:
        assert eng.get_server_info()["random_seed"] == 7
        assert eng.scheduler.cfg.overlap is False
        sampled = {"max_new_tokens": 6, "temperature": 1.0}
        first = eng.generate("Once upon a time", sampled)["output_ids"]
    with Engine(seed=7) as same:
        assert same.generate("Once upon a time", sampled)["output_ids"] == first


def test_encode_answers_in_sglangs_shape(engine):
    one = engine.encode("The cat sat.")
    assert set(one) == {"embedding", "meta_info"}
    assert one["embedding"] == engine.encode_vectors("The cat sat.")[0]
    assert one["meta_info"]["prompt_tokens"] == len(engine.tokenizer.encode("The cat sat."))
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert {"id", "e2e_latency"} <= set(one["meta_info"])
    many = engine.encode(["a", "b c"])
    assert isinstance(many, list) and [len(m["embedding"]) for m in many] == [len(one["embedding"])] * 2
    assert isinstance(engine.encode(input_ids=[1, 2, 3]), dict)
    assert isinstance(engine.encode(input_ids=[[1, 2, 3]]), list)


def test_newer_sglang_generate_keywords_are_taken_or_refused_with_the_reason(engine):
    params = {"max_new_tokens": 2, "temperature": 0}
    ref = engine.generate("Hi", params)["output_ids"]
    off = dict(priority=5, routed_dp_rank=0, session_params=None, cache_salt=None, require_reasoning=False)
    assert engine.generate("Hi", params, **off)["output_ids"] == ref
    with pytest.raises(ValueError, match="sessions are not supported"):
        engine.generate("Hi", params, session_params={"id": "s"})
    with pytest.raises(ValueError, match="cache salts"):
        engine.generate("Hi", params, cache_salt="user-1")
    with pytest.raises(ValueError, match="one data-parallel rank"):
        engine.generate("Hi", params, routed_dp_rank=1)
