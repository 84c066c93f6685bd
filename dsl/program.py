"""`@function` programs: run, run_batch (generator style; its lanes in batch_lanes.py), bind,
async arun/arun_batch, and the tracer that pre-caches a program's constant prefix before a
batch. Promise: a program's exception reaches the caller, tagged with the program line."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from radixlm.backend.sampling_params import (
    CONSTRAINT_KEYS,
    DEFAULT_MAX_NEW_TOKENS,
    SAMPLING_KEYS,
    check_values,
)
from radixlm.backend_base import ProgramBackend
from radixlm.batch_lanes import num_threads_for, run_all
from radixlm.global_config import global_config
from radixlm.interpreter import Executor
from radixlm.ir import check_logprob_options
from radixlm.prefix_trace import trace_prefix
from radixlm.run_cancel import RunCancel
from radixlm.state import ProgramState
from radixlm.threads import PROGRAM_THREADS

# The cancellation of the async call (arun) a run belongs to; run_batch's runs read it in the
# caller's thread, each program's forks inherit it from their executor.
_RUN_CANCEL: contextvars.ContextVar[RunCancel | None] = contextvars.ContextVar(
    "radixlm_run_cancel", default=None
)
_T = TypeVar("_T")
# Tracing pre-caches a constant prefix only when it is at least this many tokens long.
PRECACHE_MIN_TOKENS = 32

# Sampling options a run sets for every gen: the one definition's keys (radixlm.backend.
# sampling_params) except those that belong to a single request (n, its constraint).
_RUN_SAMPLING_KEYS = tuple(k for k in SAMPLING_KEYS if k not in ("n", *CONSTRAINT_KEYS, "json_schema_strict"))
_RUN_LOGPROB_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
_RUN_OPTION_KEYS = frozenset((*_RUN_SAMPLING_KEYS, *_RUN_LOGPROB_KEYS, "n"))


def set_default_backend(backend: ProgramBackend | None) -> None:
    """Programs run on `backend` unless given another. At interpreter exit the default backend
    is shut down, before the engines under it (their own exit hook was registered earlier)."""
    global_config.default_backend = backend


def get_default_backend() -> ProgramBackend | None:
    return global_config.default_backend


def flush_cache(backend: ProgramBackend | None = None, empty_cache: bool = True) -> bool:
    """Empty the backend's prefix cache, as SGLang's; `empty_cache` also returns the device
    allocator's free blocks to the driver afterwards (see the backend's flush_cache)."""
    if not isinstance(empty_cache, bool):
        raise ValueError(f"empty_cache must be True or False, got {empty_cache!r}")
    backend = backend or global_config.default_backend
    return False if backend is None else backend.flush_cache(empty_cache=empty_cache)


def get_server_info(backend: ProgramBackend | None = None) -> dict[str, Any]:
    """The backend's model and engine facts, as SGLang's `get_server_info`."""
    backend = backend or global_config.default_backend
    if backend is None:
        raise ValueError("get_server_info: no backend given and no default set (set_default_backend)")
    info = getattr(backend, "get_server_info", None)
    if info is None:
        raise ValueError(f"get_server_info: a {type(backend).__name__} backend has no server info")
    return dict(info())


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    # SGLang's run and run_batch take n=1 (one sample per gen); more changes what a gen returns
    if options.get("n") not in (None, 1):
        raise ValueError(
            f"run(n={options['n']!r}) is not supported: fork the state (s.fork(n)) and gen in each"
        )
    unknown = set(options) - set(_RUN_SAMPLING_KEYS) - set(_RUN_LOGPROB_KEYS) - {"n"}
    if unknown:
        raise ValueError(f"unknown run option(s): {sorted(unknown)}")
    sampling = {k: options[k] for k in _RUN_SAMPLING_KEYS if options.get(k) is not None}
    check_values(sampling)
    logprob = check_logprob_options({k: options[k] for k in _RUN_LOGPROB_KEYS if options.get(k) is not None})
    return sampling, logprob


class Program:
    """A function `def prog(s, *args)` made runnable. Created by `@function`."""

    def __init__(
        self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None, **options: Any
    ) -> None:
        if not callable(func):
            raise ValueError("@function decorates a callable")
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise ValueError(f"program {func.__name__!r} must take the state as its first parameter")
        self.func = func
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        self.arg_names = [p.name for p in params[1:] if p.kind not in variadic]
        # positional arguments fill these, as a Python call does (never a keyword-only parameter);
        # past them only a def prog(s, a, *rest) takes more
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.positional_names = [p.name for p in params[1:] if p.kind in positional]
        self.takes_more_positional = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params[1:])
        # def prog(s, **kwargs): run's keywords that are not run options are the program's
        self.takes_any_keyword = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params[1:])
        self.bind_arguments = dict(bind_arguments or {})
        if options.get("num_api_spec_tokens"):
            raise ValueError(
                "num_api_spec_tokens (SGLang's speculative execution for OpenAI-API backends) is not "
                "supported: each gen is its own request here; remove the option"
            )
        options.pop("num_api_spec_tokens", None)
        _split_options(options)
        self.options = options  # default sampling options given to @function(...)
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def __getattr__(self, name: str) -> Any:
        # SGLang's program methods a port may call that radixlm does not provide, and why
        if name in ("trace", "compile"):
            raise AttributeError(
                f"radixlm programs have no {name}(): SGLang's traced graph and its compiler are not "
                "provided; run, run_batch and cache (prefix precaching by tracing) are"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def bind(self, **kwargs: Any) -> Program:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise ValueError(f"{self.__name__} has no argument(s) {sorted(unknown)}")
        return Program(self.func, {**self.bind_arguments, **kwargs}, **self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling a program inside another program runs it on the caller's state."""
        if args and isinstance(args[0], ProgramState):
            return self.func(args[0], *args[1:], **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    # ---- running ----------------------------------------------------------------------

    def _backend(self, backend: ProgramBackend | None) -> ProgramBackend:
        backend = backend or global_config.default_backend
        if backend is None:
            raise ValueError("no backend: pass backend=... or call radixlm.set_default_backend(...)")
        return backend

    def _executor(
        self,
        backend: ProgramBackend,
        kwargs: dict[str, Any],
        options: dict[str, Any],
        stream: bool,
    ) -> Executor:
        given = {k: v for k, v in options.items() if v is not None}
        merged = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, **self.options, **given}
        sampling, logprob = _split_options(merged)
        _require_program_backend(backend)
        # a streamed run's body runs on a thread of its own while the caller reads the stream,
        # so its expressions need a worker; otherwise the body's thread runs them itself
        inline = not stream
        cancel = _RUN_CANCEL.get()
        return Executor(
            backend, kwargs, sampling, logprob, stream, self.__name__, inline=inline, cancel=cancel
        )

    def run(
        self,
        *args: Any,
        max_new_tokens: int | None = None,
        stream: bool = False,
        backend: ProgramBackend | None = None,
        use_thread: bool = True,
        **options: Any,
    ) -> ProgramState:
        """Run once. Sampling options (temperature, stop, ...) are defaults for every gen, over
        those given to @function(...); max_new_tokens None: @function's, else DEFAULT_MAX_NEW_TOKENS.
        use_thread (SGLang's: whether the state runs its expressions on a thread of its own) is
        accepted and changes nothing: the text and variables are the same either way, and here a
        non-streamed run's own state always runs them in the calling thread, a streamed run's
        state and every fork on worker threads."""
        if not isinstance(use_thread, bool):
            raise ValueError(f"use_thread must be True or False, got {use_thread!r}")
        kwargs = self._arguments(args, options)
        more = args[len(self.positional_names) :]
        ex = self._executor(
            self._backend(backend), kwargs, {"max_new_tokens": max_new_tokens, **options}, stream
        )
        state = ProgramState(ex)
        if stream:
            PROGRAM_THREADS.run(lambda: self._body(state, kwargs, more, True))
        else:
            self._body(state, kwargs, more, False)
        return state

    def _arguments(self, args: tuple[Any, ...], options: dict[str, Any]) -> dict[str, Any]:
        """The program's named arguments; positional ones past its named parameters (for *rest)
        are not among them."""
        n = len(self.positional_names)
        if len(args) > n and not self.takes_more_positional:
            raise ValueError(f"{self.__name__} takes {n} positional argument(s), got {len(args)}")
        kwargs = dict(zip(self.positional_names, args))
        for name in list(options):
            if name in self.arg_names or (self.takes_any_keyword and name not in _RUN_OPTION_KEYS):
                if name in kwargs:
                    raise TypeError(f"{self.__name__}() got multiple values for argument {name!r}")
                kwargs[name] = options.pop(name)
        return {**self.bind_arguments, **kwargs}

    def _body(
        self, state: ProgramState, kwargs: dict[str, Any], more: tuple[Any, ...], in_thread: bool
    ) -> None:
        ex = state.stream_executor
        try:
            if more:  # *rest follows the named positional parameters: those go by position too
                named = {k: v for k, v in kwargs.items() if k not in self.positional_names}
                state.ret_value = self.func(
                    state, *(kwargs[k] for k in self.positional_names), *more, **named
                )
            else:
                state.ret_value = self.func(state, **kwargs)
        except BaseException as e:
            if ex.error_ is None:
                ex.error_ = e
            ex.release_waiters()  # the gens it queued will not run: their readers must not wait
            if not in_thread:
                ex.end()
                raise
        finally:
            ex.end()
        if not in_thread:
            ex.raise_error()
        if global_config.verbosity >= 2 and ex.error_ is None:
            print(state.text())

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        max_new_tokens: int | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        backend: ProgramBackend | None = None,
        **options: Any,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Run the program once per entry, concurrently: a dict of arguments (and options), or,
        as in SGLang, a list of positional arguments. The first error is raised."""
        batch_kwargs = [self._batch_entry(b) for b in _batch_list(batch_kwargs)]
        backend = self._backend(backend)
        _split_options(options)  # validate before any work
        if len(batch_kwargs) > 1 and global_config.enable_precache_with_tracing:
            self.precache(backend)
        threads = num_threads_for(num_threads, len(batch_kwargs))

        cancel = _RUN_CANCEL.get()  # the pool's threads do not inherit this thread's context

        def one(kw: dict[str, Any]) -> ProgramState:
            token = _RUN_CANCEL.set(cancel)
            try:  # an entry's own key (an argument, or an option it sets for itself) wins over the batch's
                return self.run(backend=backend, **{"max_new_tokens": max_new_tokens, **options, **kw})
            finally:
                _RUN_CANCEL.reset(token)

        it = run_all(one, list(batch_kwargs), threads, progress_bar, backend)
        return it if generator_style else list(it)

    def _batch_entry(self, entry: Any) -> dict[str, Any]:
        if isinstance(entry, dict):
            return entry
        if len(entry) > len(self.positional_names):  # as SGLang's: a list fills the named parameters only
            raise ValueError(
                f"{self.__name__} takes {len(self.positional_names)} positional argument(s), a batch entry "
                f"has {len(entry)}"
            )
        return dict(zip(self.positional_names, entry))

    async def arun(self, *args: Any, **kwargs: Any) -> ProgramState:
        """run() on a thread; cancelling the task (or a timeout) aborts the model calls in flight
        and stops the program at its next one (RunCancelled)."""
        return await _cancellable(lambda: self.run(*args, **kwargs))

    async def arun_batch(self, batch_kwargs: list[dict[str, Any]], **kwargs: Any) -> list[ProgramState]:
        kwargs.pop("generator_style", None)
        return await _cancellable(lambda: list(self.run_batch(batch_kwargs, **kwargs)))

    # ---- tracing ----------------------------------------------------------------------

    def trace_prefix(self, backend: ProgramBackend) -> str:
        """The text the program appends before it first needs an argument or the model."""
        return trace_prefix(self.func, self.arg_names, self.bind_arguments, backend, self.__name__)

    def precache(self, backend: ProgramBackend) -> int:
        """Cache the constant prefix on the backend; returns its token count (0 if skipped)."""
        if backend.codec is None:
            return 0
        ids = backend.codec.encode(self.trace_prefix(backend))
        if len(ids) < PRECACHE_MIN_TOKENS:
            return 0
        backend.cache_prefix(ids)
        return len(ids)

    def cache(self, backend: ProgramBackend | None = None) -> int:
        """SGLang's name for precache, on the default backend when none is given."""
        resolved = self._backend(backend)
        _require_program_backend(resolved)
        return self.precache(resolved)


async def _cancellable(call: Callable[[], _T]) -> _T:
    """`call` on a thread, its program runs under one RunCancel that the task's cancellation fires."""
    cancel = RunCancel()
    token = _RUN_CANCEL.set(cancel)  # to_thread copies this context into the thread
    try:
        return await asyncio.to_thread(call)
    except asyncio.CancelledError:
        cancel.cancel()
        raise
    finally:
        _RUN_CANCEL.reset(token)


def _require_program_backend(backend: Any) -> None:
    if not isinstance(backend, ProgramBackend):
        raise TypeError(
            f"backend must be a program backend (radixlm.Runtime(), RuntimeEndpoint(url), OpenAI(...)), "
            f"got {type(backend).__name__}; an Engine runs programs as radixlm.Runtime(engine=engine)"
        )


def _batch_list(batch: Any) -> list[Any]:
    if not isinstance(batch, (list, tuple)) or not all(isinstance(b, (dict, list, tuple)) for b in batch):
        raise ValueError(
            "run_batch takes a list of dicts of program arguments (or of lists of positional ones)"
        )
    return list(batch)


def function(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: `@function` or `@function(temperature=0, max_new_tokens=64)`."""
    if func is not None:
        return Program(func, **options)

    def wrap(f: Callable[..., Any]) -> Program:
        return Program(f, **options)

    return wrap
