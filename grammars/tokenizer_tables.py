"""The tables every grammar engine builds from a tokenizer (our FSM's TokenVocab, xgrammar's compiler
over its TokenizerInfo, llguidance's tokenizer), each built lazily and once per process for each
distinct tokenizer, so engines and grammar backends that load the same tokenizer share them.
Promises: thread-safe; a table is built at most once per TokenizerTables; two tokenizers share
tables only when their serialized vocabularies, special tokens and lengths are equal."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .token_index import TokenVocab, special_token_ids, vocab_from_tokenizer

if TYPE_CHECKING:
    from .llguidance_backend import LLGuidanceCompiler
    from .xgrammar_backend import XGrammarCompiler

T = TypeVar("T")
MAX_SHARED = 4  # distinct tokenizers whose tables a process keeps (a server loads one)


class _Built(Generic[T]):
    """A value built on first use, once, under its own lock: a request that needs only one table
    does not wait for another being built by a warm-up thread."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._value: T | None = None

    def get(self) -> T:
        with self._lock:
            if self._value is None:
                self._value = self._build()
            return self._value


class TokenizerTables:
    """One tokenizer's grammar tables at one vocabulary width and set of stop ids."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = list(stop_token_ids)
        self._vocab = _Built(lambda: vocab_from_tokenizer(tokenizer, self.vocab_size, self.stop_token_ids))
        self._xgr = _Built(self._new_xgrammar)
        self._llg = _Built(self._new_llguidance)

    @property
    def vocab(self) -> TokenVocab:
        return self._vocab.get()

    @property
    def xgrammar(self) -> XGrammarCompiler:
        return self._xgr.get()

    @property
    def llguidance(self) -> LLGuidanceCompiler:
        return self._llg.get()

    def _new_xgrammar(self) -> XGrammarCompiler:
        from .xgrammar_backend import XGrammarCompiler

        return XGrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)

    def _new_llguidance(self) -> LLGuidanceCompiler:
        from .llguidance_backend import LLGuidanceCompiler

        return LLGuidanceCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)


def tokenizer_fingerprint(tokenizer: Any) -> str | None:
    """A digest of everything the tables read from the tokenizer, or None where it cannot be
    serialized (a tokenizer without a fast backend: its tables are then never shared)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    h = hashlib.sha256(type(tokenizer).__qualname__.encode())
    h.update(backend.to_str().encode())
    h.update(repr((len(tokenizer), getattr(tokenizer, "eos_token_id", None))).encode())
    h.update(repr(sorted(special_token_ids(tokenizer))).encode())
    return h.hexdigest()


_shared: OrderedDict[tuple[str, int, tuple[int, ...]], TokenizerTables] = OrderedDict()
_shared_lock = threading.Lock()


def shared_tables(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> TokenizerTables:
    """The process's tables for this tokenizer, vocabulary width and stop ids (the last MAX_SHARED
    used are kept); fresh, unshared tables for a tokenizer tokenizer_fingerprint cannot read."""
    fingerprint = tokenizer_fingerprint(tokenizer)
    if fingerprint is None:
        return TokenizerTables(tokenizer, vocab_size, stop_token_ids)
    key = (fingerprint, int(vocab_size), tuple(stop_token_ids))
    with _shared_lock:
        tables = _shared.get(key)
        if tables is None:
            tables = _shared[key] = TokenizerTables(tokenizer, vocab_size, stop_token_ids)
            while len(_shared) > MAX_SHARED:
                _shared.popitem(last=False)
        _shared.move_to_end(key)
        return tables
