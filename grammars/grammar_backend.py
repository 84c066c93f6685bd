"""GrammarBackend: compiles (kind, spec) with our FSM, llguidance or xgrammar, caches the results
(errors too) and compiles off the caller's thread. JSON schemas pass the keyword policy first
(schema_policy: strict refuses what the grammar cannot enforce, non-strict drops and names it).
Promises: thread-safe; one compile per distinct grammar even under concurrent requests; every bad
grammar surfaces as ValueError with the reason."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .base import CompiledGrammar, EngineName, GrammarKind
from .fsm import FSMGrammar, compile_regex, save_to_disk_cache
from .json_schema import (
    NotRegularError,
    check_schema,
    json_schema_to_regex,
    normalize_json_schema,
)
from .schema_empty import empty_reason
from .schema_exact import xgrammar_exact
from .schema_policy import (
    PreparedSchema,
    checkable,
    drop_from,
    generation_policy,
    one_of_pointers,
    prepare,
)
from .schema_walk import python_regex_problem
from .token_index import TokenVocab
from .tokenizer_tables import shared_tables

if TYPE_CHECKING:
    from .llguidance_backend import LLGuidanceCompiler
    from .xgrammar_backend import XGrammarCompiled, XGrammarCompiler

KINDS = ("regex", "json_schema", "ebnf", "json")
ENGINES = ("fsm", "xgrammar", "llguidance", "auto")
MAX_RELAX = 6  # non-strict: refusals answered by dropping a construct, per schema
RELAX_BUDGET_S = 1.5  # non-strict: no further relaxation once a compile has taken this long


def _refusing_python_unreadable_patterns(compiled: CompiledGrammar, spec: str) -> CompiledGrammar:
    """compiled, unless its value checks would meet a regex Python's re cannot compile (they read
    patterns with it): refused here, at compile time, not from inside a decoding step."""
    checked: list[str] = getattr(compiled, "checked_keywords", None) or []
    problem = python_regex_problem(json.loads(spec)) if checked else None
    if problem is not None:
        raise ValueError(
            f"JSON schema not supported: {problem}, and the value check for {checked[0]} reads it; "
            "write the pattern in Python's re syntax"
        )
    return compiled


class GrammarBackend:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        stop_token_ids: list[int] | None = None,
        max_threads: int = 2,
        compile_timeout_s: float = 30.0,
        max_states: int = 10_000,
        use_disk_cache: bool = True,
        max_cached: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = list(stop_token_ids or ([eos] if eos is not None else []))
        if not self.stop_token_ids:
            raise ValueError("no stop token: the tokenizer has no eos_token_id and none was given")
        self.compile_timeout_s = compile_timeout_s
        self.max_states = max_states
        self.use_disk_cache = use_disk_cache
        self._lock = threading.Lock()
        # LRU of grammars
        self._cache: OrderedDict[tuple[str, str, str, bool], Future[CompiledGrammar]] = OrderedDict()
        self.max_cached = max_cached
        # the vocabulary indexes (~1 s to build) are the process's, shared with every backend
        # over the same tokenizer
        self.tables = shared_tables(tokenizer, self.vocab_size, self.stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar-compile")
        # jump-forward retokenizes the texts a grammar forces (keys, separators), which recur
        # across a batch's requests and steps
        self.token_ids = functools.lru_cache(maxsize=4096)(self._token_ids)

    def _token_ids(self, text: str) -> tuple[int, ...]:
        """The tokenizer's ids for text, no special tokens (memoized as token_ids)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def vocab(self) -> TokenVocab:
        return self.tables.vocab

    @property
    def xgrammar(self) -> XGrammarCompiler:
        return self.tables.xgrammar

    @property
    def llguidance(self) -> LLGuidanceCompiler:
        return self.tables.llguidance

    def compile(
        self, kind: GrammarKind, spec: Any, engine: EngineName = "auto", strict: bool = True
    ) -> CompiledGrammar:
        """Compile (or fetch from cache); ValueError naming the problem. strict applies to JSON schemas:
        False drops the assertions the grammar cannot enforce (named in .dropped_keywords)."""
        return self.compile_async(kind, spec, engine, strict).result()

    def compile_async(
        self, kind: GrammarKind, spec: Any, engine: EngineName = "auto", strict: bool = True
    ) -> Future[CompiledGrammar]:
        """Future of a CompiledGrammar; validation errors of the arguments raise at once."""
        key = (*self._key(kind, spec, engine), bool(strict))
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._pool.submit(self._compile, *key)
                self._cache[key] = fut
                while len(self._cache) > self.max_cached:  # matchers keep their grammar alive
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return fut

    def shutdown(self, wait: bool = False) -> None:
        """Stop the compile threads (wait=True: let queued work, e.g. mask completion, finish first)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    @staticmethod
    def _key(kind: str, spec: Any, engine: str) -> tuple[str, str, str]:
        if kind not in KINDS:
            raise ValueError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")
        if engine not in ENGINES:
            raise ValueError(f"unknown grammar engine {engine!r}; expected one of {ENGINES}")
        if kind == "json_schema":
            spec = normalize_json_schema(spec)
        elif kind == "json":
            spec = ""
        elif not isinstance(spec, str) or not spec:
            raise ValueError(f"{kind} must be a non-empty string")
        return kind, spec, engine

    def _compile(self, kind: str, spec: str, engine: str, strict: bool = True) -> CompiledGrammar:
        if kind == "json_schema":
            check_schema(json.loads(spec))
            prepared = prepare(json.loads(spec), strict)
            empty = empty_reason(prepared.schema)
            if empty is not None:
                raise ValueError(f"invalid JSON schema: it matches nothing ({empty})")
            if engine in ("auto", "llguidance"):
                return _refusing_python_unreadable_patterns(self._llguidance_schema(prepared, strict), spec)
            if prepared.checked and strict:  # value checks run beside llguidance's grammars only
                key, _, where = prepared.checked[0].partition(" at ")
                raise ValueError(
                    f"JSON schema keyword {key!r} at {where} cannot be enforced by the {engine} engine "
                    "(strict mode; use engine 'auto', or pass strict=False to drop it)"
                )
            # one grammar only: these engines accept what generation should write
            spec = json.dumps(generation_policy(prepared.schema), ensure_ascii=False)
            compiled = self._compile_grammar(kind, spec, engine)
            dropped = prepared.dropped + prepared.checked  # non-strict: dropped, and named
            if dropped:
                compiled.dropped_keywords = dropped  # type: ignore[attr-defined]
            return compiled
        return self._compile_grammar(kind, spec, engine)

    def _compile_grammar(self, kind: str, spec: str, engine: str) -> CompiledGrammar:
        """One grammar, by the engine asked for (auto: xgrammar for EBNF / JSON, else our FSM)."""
        if engine == "llguidance":
            return self.llguidance.compile(kind, spec)
        if engine == "xgrammar" or (engine == "auto" and kind in ("ebnf", "json")):
            return self.xgrammar.compile(kind, spec)
        if kind in ("ebnf", "json"):
            raise ValueError(f"the fsm engine compiles regex and json_schema only, not {kind}")
        if kind == "regex":
            return self._fsm(spec)
        try:
            regex = json_schema_to_regex(spec)
        except NotRegularError as e:
            if engine == "fsm":
                raise ValueError(f"json_schema not supported by the fsm engine: {e}") from e
            return self.xgrammar.compile(kind, spec)
        return self._fsm(regex)

    def _llguidance_schema(self, prepared: PreparedSchema, strict: bool) -> CompiledGrammar:
        """llguidance's refusals are answered by relaxing: the construct it names is left out of the
        grammar (schema_relax; a oneOf it cannot prove exclusive is enforced as anyOf) and held by a
        value check where jsonschema can check it, else refused (strict) or dropped and named; at most
        MAX_RELAX times and within RELAX_BUDGET_S."""
        from .schema_matcher import SchemaGrammar
        from .schema_relax import relax

        if prepared.schema is False:
            raise ValueError("invalid JSON schema: it matches nothing")
        start = time.monotonic()
        coerce = False
        for attempt in range(MAX_RELAX + 1):
            generation = generation_policy(prepared.schema)
            try:
                return SchemaGrammar(
                    self.llguidance,
                    prepared.schema,
                    generation,
                    prepared.dropped,
                    coerce_one_of=coerce,
                    full=prepared.full,
                    checked=prepared.checked,
                    generation_grammar=None if prepared.checked else self._exact_xgrammar(generation),
                )
            except ValueError as e:
                error = e
            reason = str(error)
            if attempt == MAX_RELAX:
                break
            if time.monotonic() - start > RELAX_BUDGET_S:
                raise ValueError(
                    f"JSON schema not supported: compile over its {RELAX_BUDGET_S} s budget "
                    f"after {attempt} relaxations ({error})"
                ) from error
            if "oneOf constraints are not supported" in reason and not coerce:
                coerce = True
                names = [f"oneOf at {ptr} (as anyOf)" for ptr in one_of_pointers(prepared.schema)]
            else:
                names = relax(prepared.schema, reason, self.llguidance)
            if not names:
                break
            self._sort_relaxed(prepared, names, strict, reason)
        raise ValueError(f"JSON schema not supported: {error}") from error

    def _exact_xgrammar(self, generation: Any) -> XGrammarCompiled | None:
        """xgrammar's grammar of a generation schema it holds exactly (schema_exact), else None."""
        if not xgrammar_exact(generation):
            return None
        try:
            return self.xgrammar.compile("json_schema", json.dumps(generation, ensure_ascii=False))
        except ValueError:
            return None

    @staticmethod
    def _sort_relaxed(prepared: PreparedSchema, names: list[str], strict: bool, reason: str) -> None:
        """Each relaxed construct goes to the value checks, or is refused (strict) or dropped."""
        for name in names:
            if name.startswith("annotations "):  # they assert nothing
                continue
            if checkable(name, prepared.full):
                prepared.checked.append(name)
            elif strict:
                raise ValueError(
                    f"JSON schema keyword {name} cannot be enforced (strict mode; pass strict=False to "
                    f"drop it): {reason}"
                )
            else:
                prepared.dropped.append(name)
                drop_from(prepared.full, name)

    def _fsm(self, regex: str) -> CompiledGrammar:
        """Ready once the DFA is built; the mask rows are filled on demand and by a background task."""
        grammar = compile_regex(
            regex,
            self.vocab,
            timeout_s=self.compile_timeout_s,
            max_states=self.max_states,
            use_disk_cache=self.use_disk_cache,
            lazy=True,
        )
        if not grammar.is_complete:
            grammar.mask_row(0)
            try:
                self._pool.submit(self._finish, grammar)
            except RuntimeError:  # pool shut down: rows keep filling on demand
                pass
        return grammar

    def _finish(self, grammar: FSMGrammar) -> None:
        grammar.complete()
        if self.use_disk_cache:
            save_to_disk_cache(grammar)
