"""Runtime: the in-process program backend over a radixlm `Engine`. Requests are token
ids; forks pin the shared prefix's KV in the engine (prefilled once, locked until join)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from radixlm.backend_base import TokenBackend
from radixlm.interpreter import Executor


class Runtime(TokenBackend):
    """`Runtime(model_path=None, **engine_options)` starts an Engine in this process;
    `Runtime(engine=existing_engine)` wraps one you already have. As SGLang's `sgl.Runtime`:
    `launch_server=True` also serves the engine over HTTP on 127.0.0.1 (`.url`, `port=`), and
    `.generate(...)` calls the engine directly. shutdown() stops the server and the engine if this
    Runtime started it (a wrapped engine stays up)."""

    supports_pin = True

    def __init__(
        self,
        model_path: str | None = None,
        *,
        engine: Any = None,
        launch_server: bool = False,
        port: int = 0,
        **engine_options: Any,
    ) -> None:
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
        self._server: Any = None
        if launch_server:
            from radixlm.backend.server import ServerThread, create_app

            self._server = ServerThread(create_app(engine), port=port).start()

    @property
    def url(self) -> str | None:
        """The HTTP server's base URL (launch_server=True), else None."""
        return self._server.url if self._server is not None else None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """SGLang's Runtime.generate(prompt, sampling_params, ...): the engine's generate. The
        interpreter calls generate(executor, sampling, logprob) on every backend: that still works."""
        if args and isinstance(args[0], Executor):
            return super().generate(*args, **kwargs)
        return self.engine.generate(*args, **kwargs)

    def _request(
        self,
        input_ids: list[list[int]],
        sampling: dict[str, Any],
        rid: list[str] | None = None,
        **logprob: Any,
    ) -> list[dict[str, Any]]:
        outs = self.engine.generate(input_ids=input_ids, sampling_params=dict(sampling), rid=rid, **logprob)
        return outs if isinstance(outs, list) else [outs]

    def _request_stream(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str | None = None, **logprob: Any
    ) -> Iterator[dict[str, Any]]:
        return self.engine.generate(
            input_ids=input_ids, sampling_params=dict(sampling), stream=True, rid=rid, **logprob
        )

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.engine.abort_request(rid)

    def pin_prefix(self, ids: list[int]) -> Any:
        return self.engine.pin_prefix(list(ids))

    def unpin_prefix(self, handle: Any) -> None:
        self.engine.unpin_prefix(handle)

    def flush_cache(self) -> bool:
        return bool(self.engine.flush_cache())

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
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
