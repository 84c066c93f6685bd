"""RuntimeEndpoint: the program backend for a radixlm (or SGLang-compatible) server's native
API — POST /generate with input_ids, /flush_cache, /get_model_info. The state's token ids
travel as input_ids, so forks and continuations hit the server's radix cache exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from radixlm.backend_base import TokenBackend


class RuntimeEndpoint(TokenBackend):
    """`RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)`. The tokenizer is loaded
    locally from the server's model path (or `tokenizer=` / `tokenizer_path=` if given)."""

    def __init__(self, base_url: str, api_key: str | None = None, *, tokenizer: Any = None,
                 tokenizer_path: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.model_info = self._get("/get_model_info")
        if tokenizer is None:
            from radixlm.backend.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer_path or self.model_info.get("tokenizer_path")
                                       or self.model_info.get("model_path"))
        self.tokenizer = tokenizer

    # ---- HTTP -------------------------------------------------------------------------

    @staticmethod
    def _check(resp: Any) -> None:
        if resp.status_code < 400:
            return
        try:
            body = resp.json()
            message = body.get("error", {}).get("message") or body.get("detail") or resp.text
        except (ValueError, AttributeError):
            message = resp.text
        cls = ValueError if resp.status_code < 500 else RuntimeError
        raise cls(f"server answered {resp.status_code}: {message}")

    def _get(self, path: str) -> dict[str, Any]:
        resp = self._client.get(path)
        self._check(resp)
        return resp.json()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        resp = self._client.post(path, json=body)
        self._check(resp)
        return resp.json()

    @staticmethod
    def _body(input_ids: Any, sampling: dict[str, Any], stream: bool, **logprob: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": dict(sampling), "stream": stream}
        body.update({k: v for k, v in logprob.items() if v is not None})
        return body

    def _request(self, input_ids: list[list[int]], sampling: dict[str, Any], **logprob: Any) -> list[dict[str, Any]]:
        out = self._post("/generate", self._body(input_ids, sampling, False, **logprob))
        return out if isinstance(out, list) else [out]

    def _request_stream(self, input_ids: list[int], sampling: dict[str, Any], **logprob: Any) -> Iterator[dict[str, Any]]:
        """Turn the server's cumulative SSE events into delta chunks like the engine's."""
        body = self._body(input_ids, sampling, True, **logprob)
        text, n_ids = "", 0
        with self._client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ValueError(f"server stream error: {event['error'].get('message', event['error'])}")
                new_text, ids = event.get("text", ""), event.get("output_ids", [])
                if not new_text.startswith(text):
                    raise RuntimeError("server stream text is not cumulative")
                yield {"text": new_text[len(text):], "output_ids": ids[n_ids:], "meta_info": event.get("meta_info", {})}
                text, n_ids = new_text, len(ids)

    def flush_cache(self) -> bool:
        resp = self._client.post("/flush_cache")
        return resp.status_code < 400

    def shutdown(self) -> None:
        self._client.close()
