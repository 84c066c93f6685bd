"""Runtime: the in-process program backend over a radixlm `Engine`. Requests are token
ids; forks pin the shared prefix's KV in the engine (prefilled once, locked until join)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from radixlm.backend_base import TokenBackend
from radixlm.interpreter import Executor
from radixlm.submit_gate import gate_for


class Runtime(TokenBackend):
    """`Runtime(model_path=None, **engine_options)` starts an Engine in this process;
    `Runtime(engine=existing_engine)` wraps one you already have. As SGLang's `sgl.Runtime`:
    `launch_server=True` also serves the engine over HTTP on 127.0.0.1 (`.url`, `port=`,
    `.endpoint`), and `.generate(...)` / `.async_generate(...)` call the engine directly.
    `launch_timeout` bounds the wait for the launched server to answer (seconds; the engine loads
    in this process before it, unbounded). `trust_remote_code` is accepted and changes nothing:
    models run on radixlm's own model code, never on code from the model's files. shutdown()
    stops the server and the engine if this Runtime started it (a wrapped engine stays up)."""

    supports_pin = True

    def __init__(
        self,
        model_path: str | None = None,
        *,
        engine: Any = None,
        launch_server: bool = False,
        port: int = 0,
        launch_timeout: float | None = None,
        trust_remote_code: bool = False,
        **engine_options: Any,
    ) -> None:
        if launch_timeout is not None and (
            isinstance(launch_timeout, bool)
            or not isinstance(launch_timeout, (int, float))
            or launch_timeout <= 0
        ):
            raise ValueError(f"launch_timeout must be a number of seconds > 0, got {launch_timeout!r}")
        if not isinstance(trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
        self._owns_engine = engine is None
        if engine is None:
            from radixlm.backend.engine import Engine

            engine = Engine(model_path=model_path, **engine_options)
        elif model_path is not None or engine_options:
            raise ValueError("give either engine=... or model_path/engine options, not both")
        elif getattr(engine, "is_shut_down", False):
            raise ValueError("Runtime(engine=...) got an engine that is shut down")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._gate = gate_for(engine)  # run_batch's programs reach the engine together
        self._server: Any = None
        self._endpoint: Any = None
        if launch_server:
            from radixlm.backend.server import ServerThread, create_app

            server = ServerThread(create_app(engine), port=port)
            try:
                self._server = (
                    server.start() if launch_timeout is None else server.start(float(launch_timeout))
                )
            except BaseException:
                server.stop()  # a server that did not start in time must not start serving later
                if self._owns_engine:
                    engine.shutdown()
                raise

    @property
    def url(self) -> str | None:
        """The HTTP server's base URL (launch_server=True), else None."""
        return self._server.url if self._server is not None else None

    @property
    def endpoint(self) -> Any:
        """As SGLang's: a RuntimeEndpoint to the launched server (this Runtime's tokenizer, so no
        tokenizing over HTTP). Without a server there is none: this Runtime runs programs itself."""
        if self._server is None:
            raise AttributeError(
                "Runtime.endpoint: this Runtime launched no server (Runtime(launch_server=True) does); "
                "it is a program backend itself: set_default_backend(runtime)"
            )
        if self._endpoint is None:
            from radixlm.endpoint import RuntimeEndpoint

            self._endpoint = RuntimeEndpoint(self._server.url, tokenizer=self.tokenizer)
        return self._endpoint

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """SGLang's Runtime.generate(prompt, sampling_params, ...): the engine's generate. The
        interpreter calls generate(executor, sampling, logprob) on every backend: that still works."""
        if args and isinstance(args[0], Executor):
            return super().generate(*args, **kwargs)
        return self.engine.generate(*args, **kwargs)

    async def async_generate(
        self, prompt: str, sampling_params: dict[str, Any] | None = None
    ) -> AsyncIterator[str]:
        """SGLang's Runtime.async_generate: one streamed generation, its text chunk by chunk.
        Closing the generator before the end (aclose) aborts the request."""
        stream = await self.engine.async_generate(prompt, sampling_params, stream=True)
        try:
            async for chunk in stream:
                if chunk["text"]:
                    yield chunk["text"]
        finally:
            await stream.aclose()

    def _request(
        self,
        input_ids: list[list[int]],
        sampling: dict[str, Any],
        rid: list[str] | None = None,
        **logprob: Any,
    ) -> list[dict[str, Any]]:
        if self._gate is not None:
            return self._gate.generate(input_ids, dict(sampling), rid, **logprob)
        outs = self.engine.generate(input_ids=input_ids, sampling_params=dict(sampling), rid=rid, **logprob)
        return outs if isinstance(outs, list) else [outs]

    def _request_stream(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str | None = None, **logprob: Any
    ) -> Iterator[dict[str, Any]]:
        return self.engine.generate(
            input_ids=input_ids, sampling_params=dict(sampling), stream=True, rid=rid, **logprob
        )

    def abort(self, rids: list[str]) -> None:
        if self._gate is not None:
            self._gate.flush()  # a held call must reach the engine before its abort does
        for rid in rids:
            self.engine.abort_request(rid)

    def pin_prefix(self, ids: list[int]) -> Any:
        with self._counted():
            return self.engine.pin_prefix(list(ids))

    def _counted(self) -> AbstractContextManager[None]:
        """An engine call past the gate (a prefix pin), which still keeps its run_batch lane busy."""
        return self._gate.direct() if self._gate is not None else nullcontext()

    def lanes_opened(self, n: int) -> None:
        if self._gate is not None:
            self._gate.lanes_opened(n)

    def lane_closed(self) -> None:
        if self._gate is not None:
            self._gate.lane_closed()

    def unpin_prefix(self, handle: Any) -> None:
        self.engine.unpin_prefix(handle)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """Empty the engine's prefix cache (False while requests run or prefixes are pinned). With
        `empty_cache`, as SGLang's, a flushed engine on CUDA then gives the allocator's free blocks
        back to the driver (this process's: an Engine runs its model here)."""
        flushed = bool(self.engine.flush_cache())
        device = getattr(self.engine, "device", None)
        if flushed and empty_cache and getattr(device, "type", None) == "cuda":
            import torch

            torch.cuda.empty_cache()
        return flushed

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's server-info keys that an in-process engine has (internal_states: its stats)."""
        cfg = self.engine.model_config
        return {
            "model_path": str(self.engine.model_path),
            "context_length": cfg.context_len,
            "vocab_size": cfg.vocab_size,
            "device": str(self.engine.device),
            "internal_states": [self.engine.get_stats()],
        }

    def shutdown(self) -> None:
        if self._endpoint is not None:
            self._endpoint.shutdown()
            self._endpoint = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
