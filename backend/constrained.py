"""Constrained decoding inside the engine: compiles a request's regex / json_schema / ebnf off the
scheduler thread (the caller waits, the scheduler keeps serving), then per step: accept the sampled
token and, when the grammar forces a string, jump forward (canonical retokenization at the boundary,
forced tokens queued for one extend step); at the end, a JSON-schema output is validated with
jsonschema and the verdict goes into meta_info. Promises: a bad grammar raises ValueError before the
request reaches the scheduler; jump-forward only appends tokens whose bytes equal the forced text and
keeps penalty counts equal to the output's token counts."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
from concurrent.futures import Future
from typing import Any, Literal

import jsonschema
import numpy as np

from radixlm.grammars import GrammarBackend, allocate_token_bitmask
from radixlm.grammars.base import CompiledGrammar, GrammarMatcher
from radixlm.grammars.llguidance_backend import stop_mask

from .sampler import forget_token, record_token

logger = logging.getLogger(__name__)

COMPILE_WAIT_S = 120.0
_BACKEND_LOCK = threading.Lock()


def grammar_backend(engine: Any) -> GrammarBackend:
    """The engine's GrammarBackend, created on first use (the tokenizer's vocabulary is indexed once)."""
    with _BACKEND_LOCK:  # the start-up warm-up thread and a first request may both get here
        backend = getattr(engine, "_grammar_backend", None)
        if backend is None:
            backend = GrammarBackend(
                engine.tokenizer, engine.model_config.vocab_size, stop_token_ids=sorted(engine.eos_token_ids)
            )
            engine._grammar_backend = backend
        return backend


def warm_grammars(engine: Any) -> None:
    """Build the engine's grammar indexes now (its start-up thread on CUDA), so the first
    constrained request compiles only its own grammar."""
    try:
        backend = grammar_backend(engine)
        backend.vocab  # noqa: B018 - builds the token index (our FSM)
        backend.llguidance  # noqa: B018 - builds llguidance's tokenizer (JSON schemas)
        backend.xgrammar  # noqa: B018 - builds xgrammar's vocabulary (masks of the exact subset)
    except Exception:  # the first constrained request will then build and report it
        logger.exception("grammar warm-up failed")


class RequestGrammar:
    """A request's grammar state: the compile future, then its matcher (set on the caller's thread
    before the request is submitted; after that only the scheduler thread touches it)."""

    def __init__(
        self,
        future: Future[CompiledGrammar],
        backend: GrammarBackend,
        jump_forward: bool,
        spec: tuple[str, str] | None = None,
    ) -> None:
        self.future = future
        self.backend = backend
        self.jump_forward = jump_forward
        self.spec = spec
        self.matcher: GrammarMatcher | None = None
        self._report: dict[str, Any] | None = None
        # [start, end) output positions the grammar wrote by jump-forward (read by traces; only
        # a jump appends here, so plain decode steps pay nothing)
        self.jump_spans: list[list[int]] = []
        # a sampled token the matcher refused: no allowed token could continue (e.g. every completion
        # of a value fails its value check), so the request ends here, reported, never as valid
        self.dead_end = False
        # the matcher raised (a bug or an input no check foresaw): this request ends with the
        # message; the other requests of its batch go on
        self.error: str | None = None

    def report(self, req: Any) -> dict[str, Any]:
        """meta_info entries of a finished request: keywords dropped (non-strict) and keywords held
        by value checks, and for a JSON schema whether the output validates (jsonschema; a
        truncated output does not)."""
        if self._report is None:
            out: dict[str, Any] = {}
            compiled = self.future.result() if self.future.done() else None
            dropped = getattr(compiled, "dropped_keywords", None)
            if dropped:
                out["grammar_dropped_keywords"] = list(dropped)
            checked = getattr(compiled, "checked_keywords", None)
            if checked:  # held by value checks, not by the grammar (a dead end is possible)
                out["grammar_checked_keywords"] = list(checked)
            if self.spec is not None and self.spec[0] == "json_schema":
                error = json_schema_error(self.spec[1], req.final_text())
                out["json_schema_valid"] = error is None
                if error is not None:
                    out["json_schema_error"] = error
            self._report = out
        return self._report

    def resolve(self, timeout: float | None = COMPILE_WAIT_S) -> None:
        if self.matcher is None:
            try:
                compiled = self.future.result(timeout=timeout)
            except TimeoutError as e:
                raise ValueError(f"grammar compile timeout: not ready after {timeout:.0f} s") from e
            self.matcher = compiled.new_matcher()

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        """The matcher's mask; after an error, a row that allows nothing (the stop tokens are
        opened for it, and the request ends with the error when one is sampled)."""
        if self.error is None:
            try:
                self.matcher.fill_next_token_bitmask(bitmask, row)  # type: ignore[union-attr]
                return
            except Exception as e:
                self._fail(e)
        bitmask[row] = 0

    def _fail(self, e: Exception) -> None:
        logger.exception("grammar matcher failed")
        self.error = f"grammar error: {type(e).__name__}: {e}"

    def parallel_mask_matcher(self) -> Any:
        """The llguidance or xgrammar matcher behind this request's mask, if any (one batched fill
        per step and engine)."""
        if self.error is not None:
            return None
        source = getattr(self.matcher, "parallel_mask_matcher", None)
        return source() if source is not None else None

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def accept_and_jump(self, req: Any, tok: int, stats: Any) -> list[int]:
        """Accept the sampled token (already appended to req.output_ids); then maybe jump forward.
        Returns the ids this step added to the output (tok, or a retokenized tail replacing it)."""
        if self.error is not None:
            return [tok]
        try:
            return self._accept_and_jump(req, tok, stats)
        except Exception as e:
            self._fail(e)
            return [tok]

    def _accept_and_jump(self, req: Any, tok: int, stats: Any) -> list[int]:
        m = self.matcher
        assert m is not None, "grammar not resolved before scheduling"
        if not m.accept_token(tok):
            logger.warning("request %s: sampled token %d rejected by its grammar (dead end)", req.rid, tok)
            self.dead_end = True
            return [tok]
        if not self.jump_forward or m.is_terminated():
            return [tok]
        jump = m.find_jump_forward_string()
        if not jump:
            return [tok]
        step = self._retokenize(req, tok, jump)
        if step is None:
            return [tok]
        replaced, new_ids = step
        room = req.params.max_new_tokens - (len(req.output_ids) - replaced)
        if len(new_ids) > room:  # would overshoot max_new_tokens: undo, decode normally
            m.rollback(len(new_ids))
            if replaced:
                m.accept_token(tok)
            return [tok]
        stop = self._forced_stop(room - len(new_ids))
        if stop is not None:  # the forced text ends the grammar: the stop token is forced too
            new_ids = [*new_ids, stop]
        del req.output_ids[len(req.output_ids) - replaced :]
        if replaced:  # the sampled token is gone from the output: so is its penalty count
            forget_token(req, tok)
        req.output_ids.extend(new_ids)
        self.jump_spans.append([len(req.output_ids) - len(new_ids), len(req.output_ids)])
        for t in new_ids:
            record_token(req, t)
        added = new_ids if replaced else [tok, *new_ids]
        stats.extra["jump_forward_steps"] = stats.extra.get("jump_forward_steps", 0) + 1
        stats.extra["jump_forward_passes_saved"] = (
            stats.extra.get("jump_forward_passes_saved", 0) + len(added) - 1
        )
        return added

    def _forced_stop(self, room: int) -> int | None:
        """If only stop tokens are allowed now (and one more output fits), accept one and return it."""
        accepting = getattr(self.matcher, "is_accepting", None)
        if room < 1 or (accepting is not None and not accepting()):
            return None  # a stop token is allowed only where the text could end
        vocab = self.backend.vocab
        bitmask = allocate_token_bitmask(1, vocab.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask, 0)  # type: ignore[union-attr]
        # word-wise: a string's mask allows most of the vocabulary, far too many ids to list
        words = bitmask.numpy().view(np.uint32)[0]
        stops = stop_words(vocab.vocab_size, tuple(vocab.eos_ids))
        if (words & ~stops).any():
            return None
        allowed = [t for t in sorted(vocab.eos_ids) if words[t // 32] >> np.uint32(t % 32) & 1]
        if allowed and self.matcher.accept_token(allowed[0]):  # type: ignore[union-attr]
            return allowed[0]
        return None

    def _retokenize(self, req: Any, tok: int, jump: str) -> tuple[int, list[int]] | None:
        """Canonical tokens for (tok's text + jump), else for jump alone; the matcher is moved onto
        them (rollback + accept). Returns (how many output ids they replace, the ids) or None."""
        vocab = self.backend.vocab
        m = self.matcher
        tok_bytes = vocab.token_bytes[tok] if 0 <= tok < vocab.vocab_size else b""
        try:
            whole_chars = bool(tok_bytes.decode("utf-8"))
        except UnicodeDecodeError:
            whole_chars = False  # tok ends mid-character: keep it, tokenize the jump alone
        attempts = [(tok_bytes + jump.encode(), 1)] if whole_chars else []
        attempts.append((jump.encode(), 0))
        for data, replace in attempts:
            ids = list(self.backend.token_ids(data.decode("utf-8")))
            if b"".join(vocab.token_bytes[i] if i < vocab.vocab_size else b"\0" for i in ids) != data:
                continue
            keep = 1 if replace and ids[:1] == [tok] else 0
            fresh = ids[keep:]
            if replace and not keep:
                m.rollback(1)  # type: ignore[union-attr]
            n_ok = 0
            for t in fresh:
                if not m.accept_token(t):  # type: ignore[union-attr]
                    break
                n_ok += 1
            if n_ok == len(fresh) and fresh:
                return replace - keep, fresh
            if n_ok:
                m.rollback(n_ok)  # type: ignore[union-attr]
            if replace and not keep:
                m.accept_token(tok)  # type: ignore[union-attr]
        return None


@functools.lru_cache(maxsize=8)
def stop_words(vocab_size: int, stop_ids: tuple[int, ...]) -> np.ndarray:
    """The bitmask row (uint32 words) that allows exactly stop_ids."""
    return stop_mask(vocab_size, list(stop_ids)).numpy().view(np.uint32)


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> jsonschema.protocols.Validator:
    """The schema's validator (formats checked), built once per schema: a batch of one schema
    validates every output against it, and building one costs more than most validations."""
    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def json_schema_error(schema_text: str, output: str) -> str | None:
    """None if output is JSON that validates against the schema (formats checked), else why not."""
    try:
        value = json.loads(output)
    except json.JSONDecodeError as e:
        return f"output is not JSON: {e}"
    try:
        err = jsonschema.exceptions.best_match(_validator(schema_text).iter_errors(value))
    except jsonschema.exceptions.SchemaError as e:
        return f"schema cannot be checked: {e.message}"
    except Exception as e:  # an unresolvable $ref or a regex Python cannot compile
        return f"schema cannot be checked: {type(e).__name__}: {e}"
    return None if err is None else f"{err.message} (at {err.json_path}, keyword {err.validator!r})"


def attach_grammars(engine: Any, reqs: list[Any]) -> None:
    """Start compiling each constrained request's grammar (argument errors raise here)."""
    jump = not getattr(engine, "disable_jump_forward", False)
    which: Literal["auto", "xgrammar", "fsm"] = getattr(engine, "grammar_engine", "auto")  # tests, benchmarks
    for req in reqs:
        spec = req.params.grammar
        if spec:
            kind, text = spec
            backend = grammar_backend(engine)
            # forced tokens carry no logprobs: keep one sampled token per output id when they are asked for
            strict = getattr(req.params, "json_schema_strict", True)
            req.grammar = RequestGrammar(
                backend.compile_async(kind, text, which, strict),
                backend,
                jump and not req.return_logprob,
                (kind, text),
            )


def wait_grammars(reqs: list[Any]) -> None:
    """Block the calling thread (never the scheduler's) until its requests' grammars are compiled."""
    for req in reqs:
        if isinstance(req.grammar, RequestGrammar):
            req.grammar.resolve()


async def wait_grammars_async(reqs: list[Any]) -> None:
    """Same, without blocking the event loop."""
    for req in reqs:
        if isinstance(req.grammar, RequestGrammar) and req.grammar.matcher is None:
            await asyncio.wrap_future(req.grammar.future)
            req.grammar.resolve()
