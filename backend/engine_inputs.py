"""Request normalisation for the Engine API: prompts or token ids, one or many, with one or
many sampling dicts and n samples each → validated RequestSpecs. Every rejection is a
ValueError that says what is wrong."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

import torch

from .model_config import ModelConfig
from .sampling_params import SamplingParams


@dataclass
class RequestSpec:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    pin_handle: int | None = None


def normalize_requests(
    tokenizer: Any,
    config: ModelConfig,
    kv_capacity: int,
    prompt: Any,
    sampling_params: Any,
    input_ids: Any,
    rid: Any,
    return_logprob: bool | None = False,
    logprob_start_len: int | None = -1,
    top_logprobs_num: int | None = 0,
    stream: bool = False,
) -> tuple[list[RequestSpec], bool]:
    """→ (one spec per sample, whether the caller passed a single prompt). A logprob option is one
    value for every prompt or, as SGLang's Engine takes it, a list with one per prompt; None means
    its default."""
    id_lists, single = _token_lists(tokenizer, prompt, input_ids)
    params_list = _params_list(sampling_params, len(id_lists))
    rids = _rids(rid, len(id_lists))
    options = _logprob_columns(
        len(id_lists), config.vocab_size, return_logprob, logprob_start_len, top_logprobs_num
    )
    specs: list[RequestSpec] = []
    for ids, params, r, (wants_logprob, start, top) in zip(id_lists, params_list, rids, options):
        _check_lengths(ids, params, config, kv_capacity)
        if not -1 <= start < max(len(ids), 1):
            raise ValueError(f"logprob_start_len must be in [-1, {len(ids) - 1}], got {start}")
        for i in range(params.n):
            p = (
                params
                if params.n == 1
                else replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            )
            specs.append(
                RequestSpec(
                    rid=r if params.n == 1 else f"{r}-{i}",
                    input_ids=list(ids),
                    params=p,
                    return_logprob=wants_logprob,
                    logprob_start_len=start,
                    top_logprobs_num=top,
                    stream=stream,
                )
            )
    return specs, single and params_list[0].n == 1


def _token_lists(tokenizer: Any, prompt: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("pass exactly one of prompt (text) or input_ids (token ids)")
    if prompt is not None:
        single = isinstance(prompt, str)
        texts = [prompt] if single else prompt
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        lists = [tokenizer.encode(t) if t else [] for t in texts]
    else:
        input_ids = _as_lists(input_ids)
        single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
        lists = [input_ids] if single else input_ids
        if not isinstance(lists, list) or not lists or not all(isinstance(x, list) for x in lists):
            raise ValueError("input_ids must be a list of ints or a non-empty list of lists of ints")
    for ids in lists:
        if not ids:
            raise ValueError("empty prompt: at least one input token is needed")
    return lists, single


def _as_lists(input_ids: Any) -> Any:
    """A numpy array or torch tensor of ids as (nested) Python lists; anything else as given."""
    to_list = getattr(input_ids, "tolist", None)
    return to_list() if callable(to_list) and not isinstance(input_ids, list) else input_ids


def _params_list(sampling_params: Any, n: int) -> list[SamplingParams]:
    if isinstance(sampling_params, list):
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        return [SamplingParams.from_dict(p) for p in sampling_params]
    p = SamplingParams.from_dict(sampling_params)
    return [p] * n


def _logprob_columns(n: int, vocab: int, *options: Any) -> list[tuple[bool, int, int]]:
    """(return_logprob, logprob_start_len, top_logprobs_num) of each of n prompts."""
    columns = []
    for name, value in zip(("return_logprob", "logprob_start_len", "top_logprobs_num"), options):
        if isinstance(value, list) and len(value) != n:
            raise ValueError(f"{name} has {len(value)} values for {n} prompts; give one, or one per prompt")
        columns.append(value if isinstance(value, list) else [value] * n)
    return [_logprob_options(vocab, *row) for row in zip(*columns)]


def _logprob_options(vocab: int, return_logprob: Any, start: Any, top: Any) -> tuple[bool, int, int]:
    return_logprob = False if return_logprob is None else return_logprob
    start = -1 if start is None else start
    top = 0 if top is None else top
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be True or False, got {return_logprob!r}")
    if isinstance(start, bool) or not isinstance(start, int):
        raise ValueError(f"logprob_start_len must be an integer, got {start!r}")
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= vocab:
        raise ValueError(f"top_logprobs_num must be an integer in [0, {vocab}], got {top!r}")
    return return_logprob, start, top


# Keywords of SGLang's Engine.generate that radixlm has no use for: accepted at their "off" value
# (None, False, an empty list; a dp rank also 0, this engine's one rank), refused otherwise.
_SGLANG_UNUSED_KWARGS = {
    "image_data": "multimodal inputs are not supported (text-only models)",
    "audio_data": "multimodal inputs are not supported (text-only models)",
    "video_data": "multimodal inputs are not supported (text-only models)",
    "lora_path": "LoRA adapters are not supported",
    "custom_logit_processor": "custom logit processors are not supported",
    "return_hidden_states": "hidden states are not returned (embed() gives the final normalized one)",
    "token_ids_logprob": "logprobs of chosen token ids are not supported; use top_logprobs_num",
    "data_parallel_rank": "an in-process Engine has one data-parallel rank, 0",
    "bootstrap_host": "disaggregated prefill/decode is not supported",
    "bootstrap_port": "disaggregated prefill/decode is not supported",
    "bootstrap_room": "disaggregated prefill/decode is not supported",
    "external_trace_header": "request tracing headers are not supported",
    "routed_dp_rank": "an in-process Engine has one data-parallel rank, 0",
    "disagg_prefill_dp_rank": "disaggregated prefill/decode is not supported",
    "session_params": "sessions are not supported; send the whole prompt (the radix cache reuses its prefix)",
    "session_id": "sessions are not supported; send the whole prompt (the radix cache reuses its prefix)",
    "cache_salt": "cache salts are not supported (the prefix cache is shared by every request of an engine)",
    "require_reasoning": "there is no reasoning parser to require reasoning from",
    "return_routed_experts": "routed experts are not recorded (no MoE routing here)",
    "mm_hashes": "multimodal inputs are not supported (text-only models)",
    "mm_content_hashes": "multimodal inputs are not supported (text-only models)",
}
_RANK_KWARGS = ("data_parallel_rank", "routed_dp_rank")
# Accepted with any value: they cannot change what the caller gets back.
_SGLANG_NO_EFFECT_KWARGS = {
    "priority": "scheduling order only; requests are served first come, first served",
    "kv_router_hint": "a hint for a hierarchical cache's storage backend, which radixlm has not",
    "routed_experts_start_len": "used only with return_routed_experts, which is refused",
}


def check_sglang_kwargs(method: str, kwargs: dict[str, Any]) -> None:
    """SGLang's extra Engine.generate keywords: fine when off; a reason when set; TypeError for a
    keyword neither engine has."""
    for key, value in kwargs.items():
        if key in _SGLANG_NO_EFFECT_KWARGS:
            continue
        if key not in _SGLANG_UNUSED_KWARGS:
            raise TypeError(f"{method}() got an unexpected keyword argument {key!r}")
        if value is None or value is False or value == [] or (key in _RANK_KWARGS and value == 0):
            continue
        raise ValueError(f"{key}={value!r}: {_SGLANG_UNUSED_KWARGS[key]}")


def _rids(rid: Any, n: int) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str) and rid and n > 1:  # as SGLang names a batch's requests
        return [f"{rid}_{i}" for i in range(n)]
    rids = [rid] if isinstance(rid, str) else list(rid) if isinstance(rid, (list, tuple)) else None
    if rids is None or len(rids) != n or not all(isinstance(r, str) and r for r in rids):
        raise ValueError(f"rid must be one non-empty string per prompt ({n}), got {rid!r}")
    if len(set(rids)) != n:
        raise ValueError("rid must differ between the prompts of one call")
    return rids


def _check_lengths(ids: list[int], params: SamplingParams, config: ModelConfig, kv_capacity: int) -> None:
    vocab = config.vocab_size
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
    biased = [t for t in params.logit_bias if t >= vocab]
    if biased:
        raise ValueError(f"logit_bias: token id {biased[0]} is outside the vocabulary [0, {vocab})")
    total = len(ids) + params.max_new_tokens
    if total > config.context_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} "
            f"exceeds the context length {config.context_len}"
        )
    if total > kv_capacity:
        raise ValueError(f"request needs {total} KV slots but the KV pool holds only {kv_capacity}")


def check_engine_options(
    device: str | None,
    off_if_zero: dict[str, int | None],
    mem_fraction_static: float = 0.85,
    **sizes: int | None,
) -> None:
    """The Engine's size options (None: derived from the machine) are positive integers, those of
    off_if_zero non-negative ones (0 turns the feature off), mem_fraction_static a fraction in
    (0, 1], and a CUDA device is one torch can see; ValueError naming the option otherwise."""
    fraction = mem_fraction_static
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        # a share of the GPU's memory: past 1 the KV pool is sized beyond the device and its
        # allocation fails deep in start-up instead of naming the option
        raise ValueError(f"mem_fraction_static must be a number in (0, 1], got {fraction!r}")
    for name, value in [*sizes.items(), *off_if_zero.items()]:
        least = 0 if name in off_if_zero else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            kind = "a non-negative integer (0: off, " if least == 0 else "a positive integer ("
            raise ValueError(f"{name} must be {kind}or None for the default), got {value!r}")
    if device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}, but torch sees no CUDA GPU (torch.cuda.is_available() is False)"
        )
