"""radixlm: the language users write (programs with gen/select/fork and roles) and the
entry points of the runtime. `import radixlm as sgl` runs SGLang frontend programs."""

from __future__ import annotations

from typing import Any

import radixlm._hub_kernels  # noqa: F401 - first: routes `kernels` before transformers loads
from radixlm.api import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixlm.backend_base import ProgramBackend
from radixlm.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixlm.global_config import global_config
from radixlm.program import (
    Program,
    flush_cache,
    function,
    get_default_backend,
    get_server_info,
    set_default_backend,
)
from radixlm.state import ProgramState, ProgramStateGroup

_LAZY = {
    "Engine": ("radixlm.backend.engine", "Engine"),
    "Runtime": ("radixlm.runtime", "Runtime"),
    "RuntimeEndpoint": ("radixlm.endpoint", "RuntimeEndpoint"),
    "OpenAI": ("radixlm.openai_backend", "OpenAI"),
}


# SGLang frontend names radixlm does not provide, with the reason a ported program needs.
_NOT_PROVIDED = {
    "image": "multimodal inputs are not supported (text-only Llama-family models)",
    "video": "multimodal inputs are not supported (text-only Llama-family models)",
    "separate_reasoning": "reasoning parsers are not supported; gen the reasoning into its own variable",
    "Anthropic": "no Anthropic backend; use Runtime, RuntimeEndpoint or OpenAI",
    "LiteLLM": "no LiteLLM backend; use Runtime, RuntimeEndpoint or OpenAI",
    "VertexAI": "no VertexAI backend; use Runtime, RuntimeEndpoint or OpenAI",
}


def _not_provided(name: str) -> Any:
    """A stand-in that raises, saying why, when a program calls it. A stand-in and not an
    AttributeError: `from radixlm import image` would turn that into an ImportError without it."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"radixlm has no {name!r}: {_NOT_PROVIDED[name]}")

    refuse.__name__ = refuse.__qualname__ = name
    return refuse


def __getattr__(name: str) -> Any:
    # Lazy: `import radixlm` must not pull in torch or the HTTP clients until needed.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name == "__version__":
        import importlib.metadata

        return importlib.metadata.version("radixlm")
    if name in _NOT_PROVIDED:
        return _not_provided(name)
    raise AttributeError(name)


__all__ = [
    "ChoicesDecision",
    "ChoicesSamplingMethod",
    "Engine",
    "OpenAI",
    "Program",
    "ProgramBackend",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_default_backend",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
