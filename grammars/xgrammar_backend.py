"""xgrammar adapter: regex, JSON schema, EBNF and built-in JSON through xgrammar, behind our
GrammarMatcher interface. Promises: the same vocabulary view as our FSM (special tokens blanked so
they are never allowed, the same stop tokens, ids past the tokenizer's own never allowed);
xgrammar errors become ValueError."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import torch
import xgrammar as xgr

from .token_index import detect_vocab_type, special_token_ids

CACHE_LIMIT_BYTES = 256 << 20

_VOCAB_TYPES = {
    "byte_level": xgr.VocabType.BYTE_LEVEL,
    "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
    "raw": xgr.VocabType.RAW,
}


def defined_vocab_size(tokenizer: Any, vocab_size: int) -> int:
    """How many leading ids of the model's vocab_size the tokenizer defines. A model may pad its
    vocabulary (a 49,152-token tokenizer on a 128,256-row LM head): xgrammar would take every
    padding id as a special token, and it scans its special-token list on every accept_token,
    which then costs tens of microseconds instead of one or two."""
    return min(vocab_size, max(tokenizer.get_vocab().values(), default=-1) + 1)


def make_tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's TokenizerInfo, decoding tokens itself, with special tokens blanked (never allowed),
    over the ids the tokenizer defines (defined_vocab_size): padding ids are not xgrammar's. Stop
    ids past those (a model's EOS ids beyond its tokenizer's, as in a Llama-3 shape over a smaller
    tokenizer) are not brought in with the padding before them: xgrammar stops on one blanked
    special token in their place, its proxy (XGrammarCompiled maps it back)."""
    vocab = tokenizer.get_vocab()
    specials = special_token_ids(tokenizer)
    size = defined_vocab_size(tokenizer, vocab_size)
    stops = [s for s in stop_token_ids if s < size]
    if len(stops) < len(stop_token_ids):
        proxy = min((i for i in specials if i < size and i not in stop_token_ids), default=None)
        if proxy is None:  # no spare special token: the far stops come in, padding and all
            size, stops = min(vocab_size, max(stop_token_ids) + 1), list(stop_token_ids)
        else:
            stops.append(proxy)
    encoded = [""] * size
    for tok, idx in vocab.items():
        if idx < size and idx not in specials:
            encoded[idx] = tok
    vtype = _VOCAB_TYPES[detect_vocab_type(tokenizer, vocab)]
    return xgr.TokenizerInfo(encoded, vocab_type=vtype, vocab_size=size, stop_token_ids=stops)


class XGrammarVocab(NamedTuple):
    """Where xgrammar's ids sit among the model's: its first `size` ids are the model's own; the
    model's stop ids past them (far_stops) are xgrammar's `proxy` id, which is never allowed
    itself."""

    size: int
    proxy: int | None
    far_stops: tuple[int, ...]


class XGrammarRows(NamedTuple):
    """A matcher handed to a batched fill (grammars/masking.py), with its vocabulary layout (its
    bitmask rows are `layout.size` ids wide; the model's may be wider)."""

    matcher: xgr.GrammarMatcher
    layout: XGrammarVocab


def fill_xgrammar_rows(
    bitmask: torch.Tensor, matchers: list[xgr.GrammarMatcher], rows: list[int], layout: XGrammarVocab
) -> None:
    """Fill bitmask[rows] (int32 words, CPU, as wide as the model's vocabulary) from xgrammar
    matchers of one layout, in one call: ids past layout.size are not allowed, except the far stop
    ids where xgrammar allows their proxy (which is then cleared)."""
    vocab_size = layout.size
    words = (vocab_size + 31) // 32
    out = bitmask.numpy().view(np.uint32)
    if words == bitmask.shape[1]:
        _batch().batch_fill_next_token_bitmask(matchers, bitmask, rows)
    else:
        narrow = torch.empty((len(rows), words), dtype=torch.int32)
        _batch().batch_fill_next_token_bitmask(matchers, narrow, list(range(len(rows))))
        out[rows, :words] = narrow.numpy().view(np.uint32)
        out[rows, words:] = 0
    if vocab_size % 32:  # xgrammar leaves the last word's bits past its vocabulary as they were
        out[rows, words - 1] &= np.uint32((1 << (vocab_size % 32)) - 1)
    if layout.proxy is not None:
        word, bit = divmod(layout.proxy, 32)
        stopping = np.asarray(rows)[np.flatnonzero(out[rows, word] >> np.uint32(bit) & 1)]
        out[stopping, word] &= ~np.uint32(1 << bit)
        for s in layout.far_stops:
            out[stopping, s // 32] |= np.uint32(1 << (s % 32))


@functools.cache
def _batch() -> xgr.BatchGrammarMatcher:
    """One thread: an xgrammar row takes microseconds, less than handing it to another thread."""
    return xgr.BatchGrammarMatcher(max_threads=1)


class XGrammarCompiled:
    engine = "xgrammar"

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, stop_token_ids: list[int]) -> None:
        """vocab_size: the model's (the width of the masks it reads); the grammar's own TokenizerInfo
        may cover fewer ids, and stand in one proxy id for the stop ids past them
        (make_tokenizer_info)."""
        self.compiled = compiled
        info = compiled.tokenizer_info
        self.stop_token_ids = list(stop_token_ids)
        far = tuple(s for s in stop_token_ids if s >= info.vocab_size)
        proxies = [s for s in info.stop_token_ids if s not in self.stop_token_ids]
        self.layout = XGrammarVocab(info.vocab_size, proxies[0] if far and proxies else None, far)
        self.xgrammar_stop_ids = [s for s in stop_token_ids if s < info.vocab_size] + proxies[:1]
        words = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.bool)
        words[self.stop_token_ids] = True
        shifts = torch.arange(32, dtype=torch.int64)
        packed = (words.view(-1, 32).to(torch.int64) << shifts).sum(dim=1)
        self.eos_mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def xgrammar_id(self, token_id: int) -> int:
        """The id xgrammar knows token_id by (a far stop id is its proxy)."""
        proxy = self.layout.proxy
        return proxy if proxy is not None and token_id in self.layout.far_stops else token_id

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self)


class XGrammarMatcher:
    """Thin wrapper; after termination the mask allows only the stop tokens (xgrammar would raise).
    Whether it terminated is kept here, not asked of xgrammar at every query: each binding call
    costs microseconds of host time per request and step, and only accepting a stop token
    terminates (a rollback or reset may undo it, so those ask again)."""

    def __init__(self, grammar: XGrammarCompiled) -> None:
        self._g = grammar
        self._m = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=grammar.xgrammar_stop_ids)
        self._terminated: bool | None = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.is_terminated():
            bitmask[row].copy_(self._g.eos_mask)
        else:
            fill_xgrammar_rows(bitmask, [self._m], [row], self._g.layout)

    def accept_token(self, token_id: int) -> bool:
        if self.is_terminated() or not self._m.accept_token(self._g.xgrammar_id(int(token_id))):
            return False
        self._terminated = None if int(token_id) in self._g.stop_token_ids else False
        return True

    def accept_string(self, text: str) -> bool:
        return not self.is_terminated() and bool(self._m.accept_string(text))

    def find_jump_forward_string(self) -> str:
        return "" if self.is_terminated() else self._m.find_jump_forward_string()

    def is_terminated(self) -> bool:
        if self._terminated is None:
            self._terminated = bool(self._m.is_terminated())
        return self._terminated

    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match (a stop token may come now)."""
        return self.is_terminated() or self._m.is_completed()

    def parallel_mask_matcher(self) -> XGrammarRows | None:
        """The xgrammar matcher whose mask fill_next_token_bitmask would compute, for a batched fill
        (grammars/masking.py); None once terminated (the row is then the stop-token row)."""
        return None if self.is_terminated() else XGrammarRows(self._m, self._g.layout)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)
            self._terminated = None

    def reset(self) -> None:
        self._m.reset()
        self._terminated = False


# Textual fixes to xgrammar's (0.2.9) JSON-schema EBNF, each making its language a subset:
# - length-bounded strings use [^"\\\r\n]{m,n}, which lets raw control characters (invalid JSON)
#   through: use the class its unbounded strings use;
# - integers, fractions and exponents have unbounded digit runs, which a small model at temperature
#   1.0 can loop on until max_new_tokens: bound them like our regexes (16 / 16 / 3 digits).
_EBNF_FIXES = (
    (r"[^\"\\\r\n]", r"[^\"\\\0-\x1f]"),
    ("[1-9] [0-9]*", "[1-9] [0-9]{0, 15}"),
    ('("." basic_number_digits{1, -1})', '("." basic_number_digits{1, 16})'),
    ("basic_number_4 basic_number_digits{1, -1}", "basic_number_4 basic_number_digits{1, 3}"),
)


def json_schema_ebnf(schema: str) -> str:
    """xgrammar's EBNF for a JSON schema in compact form (separators ", " and ": "), with _EBNF_FIXES."""
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    for old, new in _EBNF_FIXES:
        text = text.replace(old, new)
    return text


def python_dot(regex: str) -> str:
    """The regex with each bare `.` (outside a character class) written [^\\n]: in Python, the
    reference our outputs are checked with, `.` matches anything but a newline; xgrammar's `.`
    also matches a newline."""
    out: list[str] = []
    escaped = False
    class_start = -1  # index of the open class's "[", -1 outside classes
    for i, ch in enumerate(regex):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif class_start >= 0:
            first = class_start + (2 if regex[class_start + 1 : class_start + 2] == "^" else 1)
            if ch == "]" and i > first:  # a "]" first in the class is a literal
                class_start = -1
        elif ch == "[":
            class_start = i
        elif ch == ".":
            out.append("[^\\n]")
            continue
        out.append(ch)
    return "".join(out)


class XGrammarCompiler:
    """Compiles each grammar kind with one shared (internally cached, thread-safe) GrammarCompiler."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.info = make_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # bounded: GrammarBackend keeps its own LRU of compiled grammars, and a server that sees
        # many distinct schemas must not grow xgrammar's cache without end
        self.compiler = xgr.GrammarCompiler(
            self.info, max_threads=max_threads, cache_limit_bytes=CACHE_LIMIT_BYTES
        )

    def compile(self, kind: str, spec: str) -> XGrammarCompiled:
        try:
            if kind == "regex":
                out = self.compiler.compile_regex(python_dot(spec))
            elif kind == "json_schema":
                out = self.compiler.compile_grammar(json_schema_ebnf(spec))
            elif kind == "ebnf":
                out = self.compiler.compile_grammar(spec)
            elif kind == "json":
                out = self.compiler.compile_builtin_json_grammar()
            else:
                raise ValueError(f"unknown grammar kind {kind!r}")
        except (RuntimeError, xgr.InvalidJSONError) as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise ValueError(f"invalid {kind}: {msg}") from e
        return XGrammarCompiled(out, self.vocab_size, self.stop_token_ids)
