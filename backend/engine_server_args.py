"""SGLang's ServerArgs names on the Engine: `Engine(**kwargs)` of an SGLang script either maps a
name onto radixlm's own option (honoured), accepts it where it changes nothing here, or refuses
it with a ValueError that says why; a name neither engine has is a TypeError, as Python's own.
Also the Engine's `get_server_info()` record, in the shape SGLang's Engine returns."""

from __future__ import annotations

import importlib.metadata
from typing import Any

# name → why a value other than its "off" one (None, False, SGLang's default) cannot be honoured
_REFUSED: dict[str, str] = {
    "skip_tokenizer_init": "radixlm always loads the tokenizer; pass input_ids and read output_ids instead",
    "dp_size": "an in-process Engine runs one replica; run `radixlm serve --dp N` for data parallelism",
    "pp_size": "pipeline parallelism is not supported",
    "enable_torch_compile": "torch.compile is not used; CUDA graphs cover the decode steps",
    "lora_paths": "LoRA adapters are not supported",
    "enable_lora": "LoRA adapters are not supported",
    "is_embedding": "an Engine serves a generation model; encode() embeds with it",
}
_OFF: dict[str, Any] = {"dp_size": 1, "pp_size": 1}
# accepted with any value: they change nothing in radixlm (reason kept for the reader)
_NO_EFFECT = {
    "trust_remote_code": "radixlm runs no code from a checkpoint; its architectures are its own",
    "served_model_name": "an in-process Engine has no served name",
    "load_format": "the format is read from the files (HF folder or GGUF)",
}
# honoured: SGLang's name → radixlm's
_RENAMED = {"random_seed": "seed"}
# honoured, inverted: SGLang's disable_* switch → radixlm's option set to False when it is True
_DISABLES = {"disable_overlap_schedule": "overlap_schedule"}
# the in-process Engine's stream chunks carry their own text (README), which SGLang's True asks for
_INCREMENTAL = ("stream_output", "incremental_streaming_output")


def resolve_server_args(kwargs: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """→ `own` (radixlm's options as the caller passed them) updated from SGLang's names in kwargs."""
    out = dict(own)
    for key, value in kwargs.items():
        if key in _RENAMED:
            target = _RENAMED[key]
            if value is not None:
                out[target] = value
        elif key in _DISABLES:
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be True or False, got {value!r}")
            if value:
                out[_DISABLES[key]] = False
        elif key in _NO_EFFECT:
            continue
        elif key in _INCREMENTAL:
            if value is not True:
                raise ValueError(
                    f"{key}={value!r}: the in-process Engine's stream chunks always carry their own "
                    "text, ids and logprobs (SGLang's incremental streaming)"
                )
        elif key in _REFUSED:
            if value is None or value is False or value == _OFF.get(key):
                continue
            raise ValueError(f"{key}={value!r}: {_REFUSED[key]}")
        else:
            raise TypeError(f"Engine.__init__() got an unexpected keyword argument {key!r}")
    return out


# Engine's own parameter → SGLang's ServerArgs name, for get_server_info()
_RECORDED = {
    "model_path": "model_path",
    "tokenizer_path": "tokenizer_path",
    "tp_size": "tp_size",
    "seed": "random_seed",
    "mem_fraction_static": "mem_fraction_static",
    "max_running_requests": "max_running_requests",
    "chunked_prefill_size": "chunked_prefill_size",
    "max_total_tokens": "max_total_tokens",
    "context_length": "context_length",
    "dtype": "dtype",
    "kv_cache_dtype": "kv_cache_dtype",
    "quantization": "quantization",
    "log_level": "log_level",
    "disable_radix_cache": "disable_radix_cache",
    "disable_cuda_graph": "disable_cuda_graph",
    "speculative_algorithm": "speculative_algorithm",
}


def recorded_args(params: dict[str, Any]) -> dict[str, Any]:
    """The Engine's parameters (its constructor's locals) under SGLang's names."""
    return {"dp_size": 1, **{sglang: params[own] for own, sglang in _RECORDED.items()}}


def server_info(engine: Any) -> dict[str, Any]:
    """SGLang's get_server_info() keys that have a meaning here (model_path, tp_size, random_seed,
    context_length, max_total_num_tokens, ...), the `internal_states` list SGLang scripts read
    `[0]` of, and `version`."""
    cfg = engine.model_config
    stats = engine.get_stats()
    try:
        version = importlib.metadata.version("radixlm")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        **engine.server_args,
        "model_path": engine.model_path,
        "device": str(engine.device),
        "context_length": cfg.context_len,
        "vocab_size": cfg.vocab_size,
        "max_total_num_tokens": stats["kv_total_slots"],
        "internal_states": [stats],
        "version": version,
    }
