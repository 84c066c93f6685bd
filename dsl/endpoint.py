"""RuntimeEndpoint: the program backend for a radixlm (or SGLang-compatible) server's native
API — POST /generate with input_ids, /flush_cache, /get_model_info. The state's token ids
travel as input_ids, so forks and continuations hit the server's radix cache exactly. The server
tokenizes (/tokenize, /detokenize, /apply_chat_template): the client needs no model files."""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Iterator
from typing import Any

from radixlm.backend_base import TokenBackend


class RemoteTokenizer:
    """The parts of an HF tokenizer programs use, answered by the server (cached per text/ids)."""

    def __init__(self, endpoint: RuntimeEndpoint, has_chat_template: bool) -> None:
        self._endpoint = endpoint
        self.chat_template = "server" if has_chat_template else None
        self._encoded: dict[tuple[str, bool], list[int]] = {}
        self._decoded: dict[tuple[tuple[int, ...], bool], str] = {}
        self._rendered: dict[str, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        key = (text, add_special_tokens)
        if key not in self._encoded:
            body = {"prompt": text, "add_special_tokens": add_special_tokens}
            self._encoded[key] = list(self._endpoint._post("/tokenize", body)["tokens"])
        return list(self._encoded[key])

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        key = (tuple(int(i) for i in ids), skip_special_tokens)
        if key not in self._decoded:
            body = {"tokens": list(key[0]), "skip_special_tokens": skip_special_tokens}
            self._decoded[key] = self._endpoint._post("/detokenize", body)["text"]
        return self._decoded[key]

    def batch_decode(self, seqs: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        """Each sequence decoded, those not seen before in one request."""
        keys = [(tuple(int(i) for i in ids), skip_special_tokens) for ids in seqs]
        missing = list(dict.fromkeys(k for k in keys if k not in self._decoded))
        if missing:
            body = {"tokens": [list(k[0]) for k in missing], "skip_special_tokens": skip_special_tokens}
            for key, text in zip(missing, self._endpoint._post("/detokenize", body)["text"], strict=True):
                self._decoded[key] = text
        return [self._decoded[k] for k in keys]

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        body = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "chat_template_kwargs": kwargs or None,
        }
        key = json.dumps(body, sort_keys=True)
        if key not in self._rendered:
            self._rendered[key] = self._endpoint._post("/apply_chat_template", body)["text"]
        text = self._rendered[key]
        return self.encode(text, add_special_tokens=False) if tokenize else text


# An abort is sent on the way out of a failed or cancelled call: it must not wait as long as a generation.
ABORT_TIMEOUT_S = 5.0


def tls_verify(verify: Any) -> bool | ssl.SSLContext:
    """requests' `verify` for httpx: None or True checks the server's certificate against the
    default CAs, False does not check, a path names a CA bundle file or folder."""
    if verify is None or isinstance(verify, (bool, ssl.SSLContext)):
        return True if verify is None else verify
    if isinstance(verify, (str, os.PathLike)):
        path = os.fspath(verify)
        if os.path.isdir(path):
            return ssl.create_default_context(capath=path)
        if os.path.isfile(path):
            return ssl.create_default_context(cafile=path)
        raise ValueError(f"verify: no CA bundle file or folder at {path!r}")
    raise ValueError(f"verify must be None, a bool, a CA bundle path or an SSLContext, got {verify!r}")


class RuntimeEndpoint(TokenBackend):
    """`RuntimeEndpoint("http://127.0.0.1:30000", api_key=None, verify=None)`. Tokenization and the
    chat template run on the server; `tokenizer=` / `tokenizer_path=` use a local tokenizer instead.
    `verify` is requests' (see tls_verify). SGLang's `chat_template_name` picks one of its frontend's
    named templates; radixlm has none (roles render with the model's own template), so a name is
    refused rather than ignored."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: Any = None,
        chat_template_name: str | None = None,
        *,
        tokenizer: Any = None,
        tokenizer_path: str | None = None,
        timeout: float = 600.0,
    ) -> None:
        import httpx

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        if chat_template_name is not None:
            raise ValueError(
                f"RuntimeEndpoint(chat_template_name={chat_template_name!r}): radixlm has no named chat "
                "templates; programs use the model's own template (the server's, or that of tokenizer= / "
                "tokenizer_path=): leave chat_template_name out"
            )
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, verify=tls_verify(verify)
        )
        self.model_info = self._get("/get_model_info")
        if tokenizer is None and tokenizer_path is not None:
            from radixlm.backend.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(tokenizer_path)
        if tokenizer is None:
            info = self._get("/get_server_info")
            tokenizer = RemoteTokenizer(self, bool(info.get("has_chat_template")))
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

    def _request(
        self,
        input_ids: list[list[int]],
        sampling: dict[str, Any],
        rid: list[str] | None = None,
        **logprob: Any,
    ) -> list[dict[str, Any]]:
        out = self._post("/generate", self._body(input_ids, sampling, False, rid=rid, **logprob))
        return out if isinstance(out, list) else [out]

    def _request_stream(
        self, input_ids: list[int], sampling: dict[str, Any], rid: str | None = None, **logprob: Any
    ) -> Iterator[dict[str, Any]]:
        """Turn the server's cumulative SSE events into delta chunks like the engine's."""
        body = self._body(input_ids, sampling, True, rid=rid, **logprob)
        text, n_ids = "", 0
        with self._client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._check(resp)
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ValueError(f"server stream error: {event['error'].get('message', event['error'])}")
                new_text, ids = event.get("text", ""), event.get("output_ids", [])
                if not new_text.startswith(text):
                    raise RuntimeError("server stream text is not cumulative")
                yield {
                    "text": new_text[len(text) :],
                    "output_ids": ids[n_ids:],
                    "meta_info": event.get("meta_info", {}),
                }
                text, n_ids = new_text, len(ids)

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            try:
                self._client.post("/abort_request", json={"rid": rid}, timeout=ABORT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - best effort: the server may be gone, the request with it
                pass

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def get_model_name(self) -> str:
        """The served model's path, from /get_model_info (as SGLang's)."""
        return str(self.model_info["model_path"])

    def flush_cache(self, empty_cache: bool = True) -> bool:
        """POST /flush_cache with SGLang's body; a radixlm server empties its prefix cache and
        reads nothing else of it (its device allocator is the server's to manage)."""
        resp = self._client.post("/flush_cache", json={"empty_cache": empty_cache})
        return resp.status_code < 400

    def shutdown(self) -> None:
        self._client.close()
