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
from radixlm.program import Program, flush_cache, function, get_default_backend, set_default_backend
from radixlm.state import ProgramState, ProgramStateGroup

_LAZY = {
    "Engine": ("radixlm.backend.engine", "Engine"),
    "Runtime": ("radixlm.runtime", "Runtime"),
    "RuntimeEndpoint": ("radixlm.endpoint", "RuntimeEndpoint"),
    "OpenAI": ("radixlm.openai_backend", "OpenAI"),
}


def __getattr__(name: str) -> Any:
    # Lazy: `import radixlm` must not pull in torch or the HTTP clients until needed.
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
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
