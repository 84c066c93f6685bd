"""`radixlm.global_config`, SGLang's `sgl.global_config`: the language's process-wide settings,
each with its effect here. `default_backend` is the backend programs run on (what
set_default_backend sets; shut down at interpreter exit). SGLang's runtime constants (token ratio
estimates, workspace sizes, detokenization flags) are engine or request arguments here: setting
one is refused with where it goes, never ignored."""

from __future__ import annotations

import atexit

from radixlm.backend_base import ProgramBackend

# SGLang's runtime constants, and where each is set in radixlm.
_ADMISSION = "the scheduler's admission, which reserves decode slots per running request and retracts when they run out"
_ELSEWHERE = {
    "default_init_new_token_ratio": _ADMISSION,
    "default_min_new_token_ratio_factor": _ADMISSION,
    "default_new_token_ratio_decay_steps": _ADMISSION,
    "retract_decode_steps": _ADMISSION,
    "flashinfer_workspace_size": "radixlm's own kernels, which need no workspace setting",
    "skip_special_tokens_in_output": "the run option skip_special_tokens (prog.run(skip_special_tokens=...))",
    "spaces_between_special_tokens_in_out": "the run option spaces_between_special_tokens (prog.run(...))",
    "enable_gds": "nothing: radixlm loads weights without GPUDirect Storage",
    "gds_path": "nothing: radixlm loads weights without GPUDirect Storage",
}


class GlobalConfig:
    """verbosity: 2 prints each run's text when the run ends (as SGLang does).
    enable_precache_with_tracing: run_batch first caches the program's traced constant prefix.
    enable_parallel_encoding: kept so SGLang programs that set it run; no effect here (SGLang
    uses it when a state appends other states; here a state appends their text, state.text(),
    and the radix cache serves the KV it already holds for it)."""

    def __init__(self) -> None:
        self.verbosity = 0
        self.enable_precache_with_tracing = True
        self.enable_parallel_encoding = True
        self._default_backend: ProgramBackend | None = None
        self._exit_hook_registered = False

    @property
    def default_backend(self) -> ProgramBackend | None:
        return self._default_backend

    @default_backend.setter
    def default_backend(self, backend: ProgramBackend | None) -> None:
        if backend is not None and not isinstance(backend, ProgramBackend):
            raise TypeError(
                "set_default_backend (global_config.default_backend) takes a backend (radixlm.Runtime(), "
                f"RuntimeEndpoint(url), OpenAI(...)), not {type(backend).__name__}"
            )
        self._default_backend = backend
        if backend is not None and not self._exit_hook_registered:
            # registered after the engines' own hooks, so it runs before them
            atexit.register(self._shutdown_default_backend)
            self._exit_hook_registered = True

    def _shutdown_default_backend(self) -> None:
        if self._default_backend is not None:
            self._default_backend.shutdown()

    def __setattr__(self, name: str, value: object) -> None:
        if name in _ELSEWHERE:
            raise AttributeError(
                f"global_config.{name} is not a setting here: it belongs to {_ELSEWHERE[name]}"
            )
        if not name.startswith("_") and name not in _SETTINGS:
            raise AttributeError(f"global_config has no setting {name!r}; it has {', '.join(_SETTINGS)}")
        super().__setattr__(name, value)


_SETTINGS = ("verbosity", "default_backend", "enable_precache_with_tracing", "enable_parallel_encoding")

global_config = GlobalConfig()
