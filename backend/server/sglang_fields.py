"""SGLang's request fields beyond sampling, as SGLang clients and sglang-router send them (the router
re-serializes every request and always sends its defaults: `model`, `log_metrics`,
`return_hidden_states`, ... on /generate; `continue_final_message`, `separate_reasoning`, ... on
chat). Each field has one stated fate: honoured, accepted without effect (only where ignoring it
cannot change what the client gets), or refused with the reason when set to what we cannot do.
The logprob options take, as SGLang's do, one value for every prompt or a list with one per prompt."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20
_TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]

# Refused when true (false is the default the router always sends).
REFUSED_FLAGS = {
    "return_hidden_states": "hidden states are not returned (use /v1/embeddings for a pooled state)",
    "return_entropy": "per-token entropy is not computed",
    "return_bytes": "byte output is for image generation; this server generates text",
    "background": "background (stored, polled) responses are not supported",
}
# Refused when set to anything but null.
REFUSED_VALUES = {
    "token_ids_logprob": "logprobs of chosen token ids are not supported; use top_logprobs_num",
    "input_embeds": "input embeddings are not supported; send text or input_ids",
    "image_data": "image input is not supported",
    "video_data": "video input is not supported",
    "audio_data": "audio input is not supported",
    "modalities": "only text is supported",
    "session_params": "sessions are not supported; send the whole prompt (the radix cache reuses its prefix)",
    "lora_path": "LoRA adapters are not supported",
    "lora_id": "LoRA adapters are not supported",
    "custom_logit_processor": "custom logit processors are not supported",
    "bootstrap_host": "prefill/decode disaggregation is not supported",
    "bootstrap_port": "prefill/decode disaggregation is not supported",
    "bootstrap_room": "prefill/decode disaggregation is not supported",
    "bootstrap_pair_key": "prefill/decode disaggregation is not supported",
    "extra_key": "cache salts are not supported (the prefix cache is shared by all requests of a server)",
}
# Accepted without effect on the output, and why that is harmless.
INFORMATIONAL = {
    "model": "one model per server; the router uses it to pick workers",
    "no_logs": "request contents are never logged",
    "conversation_id": "bookkeeping",
    "custom_labels": "metric labels of the caller's own",
    "priority": "scheduling order only; requests are served first come, first served",
    "stream_reasoning": "no reasoning parser: a reply has no separate reasoning to stream",
}


def refuse_unsupported(req: BaseModel, flags: dict[str, str], values: dict[str, str]) -> None:
    """Raise ValueError naming the first field set to what this server cannot honour. Checked by
    the route, not the model, so the client gets a 400 whose message is the reason alone."""
    for key, reason in flags.items():
        if getattr(req, key):
            raise ValueError(f"{key}=true: {reason}")
    for key, reason in values.items():
        if getattr(req, key) is not None:
            raise ValueError(f"{key}: {reason}")


class GenerateFields(BaseModel):
    """Mixin of POST /generate: every field SGLang's GenerateReqInput has that sampling does not."""

    model_config = ConfigDict(extra="forbid")
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: _TopLogprobs | list[_TopLogprobs] = 0
    return_text_in_logprobs: bool = False
    model: str | None = None
    log_metrics: bool = True  # honoured: false keeps the request out of the latency histograms
    no_logs: bool = False
    conversation_id: str | None = None
    custom_labels: dict[str, str] | None = None
    priority: int | None = None
    data_parallel_rank: int | None = None  # honoured: each replica is one DP rank, rank 0
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False
    token_ids_logprob: Any = None
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    extra_key: Any = None

    def check_supported(self) -> None:
        """ValueError (a 400 with the reason) for a field set to what this server cannot do."""
        refuse_unsupported(self, REFUSED_FLAGS, REFUSED_VALUES)
        if self.data_parallel_rank not in (None, 0):
            raise ValueError(
                f"data_parallel_rank={self.data_parallel_rank!r}: this server is one replica (rank 0); "
                "route across replicas with the router"
            )

    def logprob_options(self, n_prompts: int) -> list[tuple[bool, int, int]]:
        """(return_logprob, logprob_start_len, top_logprobs_num) of each prompt; ValueError for a
        list whose length is not the number of prompts."""
        columns = []
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != n_prompts:
                raise ValueError(
                    f"{name} has {len(value)} values for {n_prompts} prompts; give one per prompt"
                )
            columns.append(value if isinstance(value, list) else [value] * n_prompts)
        return list(zip(*columns))


# The SGLang fields the OpenAI routes take (the router forwards them on chat and completions).
OPENAI_REFUSED_FLAGS = {"return_hidden_states": REFUSED_FLAGS["return_hidden_states"]}
OPENAI_REFUSED_VALUES = {k: REFUSED_VALUES[k] for k in ("lora_path", "session_params")}


class SGLangOpenAIFields(BaseModel):
    """Mixin of the OpenAI request models: SGLang's extras on /v1/completions and chat."""

    model_config = ConfigDict(extra="forbid")
    return_hidden_states: bool = False
    sampling_seed: int | None = None  # honoured: SGLang's name for seed
    lora_path: Any = None
    session_params: Any = None

    def check_supported(self) -> None:
        """ValueError (a 400 with the reason) for a field set to what this server cannot do."""
        refuse_unsupported(self, OPENAI_REFUSED_FLAGS, OPENAI_REFUSED_VALUES)

    def seed_value(self, seed: int | None) -> int | None:
        """`seed` and `sampling_seed` name one thing; ValueError when they disagree."""
        if self.sampling_seed is not None and seed is not None and seed != self.sampling_seed:
            raise ValueError(f"seed ({seed}) and sampling_seed ({self.sampling_seed}) disagree; give one")
        return seed if seed is not None else self.sampling_seed
