"""Our regex engine: byte DFA + per-state token bitmask rows (cached on disk), the compressed FSM
(chains of singular byte transitions → jump-forward strings) and the FSMMatcher.
Promises: EOS is allowed only in accepting states, special tokens never; masks are row copies."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from .byte_dfa import ByteDFA, regex_to_byte_dfa
from .token_index import CHUNK_STATES, TokenVocab, extend_trans, mask_rows


def _source_digest() -> str:
    """Cache entries are keyed by the code that built them, so edits never serve stale tables."""
    h = hashlib.sha256()
    for name in ("byte_dfa.py", "token_index.py", "fsm.py"):
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:16]


CACHE_VERSION = "fsm-" + _source_digest()
TERMINATED = -2


def cache_dir() -> Path:
    root = os.environ.get("RADIXLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "radixlm")
    return Path(root) / "fsm"


def _cache_path(regex: str, vocab: TokenVocab) -> Path:
    key = hashlib.sha256(f"{CACHE_VERSION}\0{vocab.digest}\0{regex}".encode()).hexdigest()[:40]
    return cache_dir() / f"{key}.npz"


class FSMGrammar:
    """A compiled regex for one vocabulary, shared by all its matchers. Mask rows are computed
    eagerly, or lazily (a state's row on first use, the rest by complete() in the background);
    either way a row, once marked ready, never changes."""

    engine = "fsm"

    def __init__(self, regex: str, dfa: ByteDFA, vocab: TokenVocab, masks: np.ndarray | None = None):
        self.regex = regex
        self.dfa = dfa
        self.vocab = vocab
        self.eos_ids = frozenset(vocab.eos_ids)
        words = (vocab.vocab_size + 31) // 32
        self.masks_np = masks if masks is not None else np.zeros((dfa.num_states, words), dtype=np.int32)
        self._ready = np.full(dfa.num_states, masks is not None, dtype=bool)
        self._trans_ext = extend_trans(dfa.trans)
        self._out_degree = (dfa.trans >= 0).sum(axis=1)
        self._jump: dict[int, tuple[bytes, int]] = {}
        eos_words = np.zeros(words * 32, dtype=bool)
        eos_words[list(vocab.eos_ids)] = True
        self.eos_mask_np = np.packbits(eos_words, bitorder="little").view(np.int32).copy()

    @property
    def is_complete(self) -> bool:
        return bool(self._ready.all())

    def mask_row(self, state: int) -> np.ndarray:
        if not self._ready[state]:
            self._compute(np.array([state]))
        row: np.ndarray = self.masks_np[state]
        return row

    def _compute(self, states: np.ndarray) -> None:
        self.masks_np[states] = mask_rows(self._trans_ext, self.dfa.accepting, states, self.vocab)
        self._ready[states] = True

    def complete(self, deadline_check: Callable[[], None] | None = None) -> FSMGrammar:
        """Compute every missing row, CHUNK_STATES at a time."""
        todo = np.nonzero(~self._ready)[0]
        for i in range(0, len(todo), CHUNK_STATES):
            chunk = todo[i : i + CHUNK_STATES]
            chunk = chunk[~self._ready[chunk]]  # rows filled on demand meanwhile
            if len(chunk):
                self._compute(chunk)
            if deadline_check is not None:
                deadline_check()
        return self

    @property
    def num_states(self) -> int:
        return self.dfa.num_states

    def new_matcher(self) -> FSMMatcher:
        return FSMMatcher(self)

    def forced_bytes(self, state: int) -> tuple[bytes, int]:
        """The compressed FSM edge out of `state`: bytes every valid continuation starts with."""
        hit = self._jump.get(state)
        if hit is not None:
            return hit
        out = bytearray()
        s = state
        seen = {s}
        while self._out_degree[s] == 1 and not self.dfa.accepting[s]:
            b = int(np.argmax(self.dfa.trans[s] >= 0))
            out.append(b)
            s = int(self.dfa.trans[s, b])
            if s in seen:
                break
            seen.add(s)
        self._jump[state] = (bytes(out), s)
        return self._jump[state]

    def allows(self, state: int, token: int) -> bool:
        return 0 <= token < self.vocab.vocab_size and bool(
            (self.mask_row(state)[token >> 5] >> (token & 31)) & 1
        )

    def next_state(self, state: int, token: int) -> int:
        """State after an allowed non-stop token (-1 if the token is not allowed)."""
        if not self.allows(state, token):
            return -1
        return self.walk_bytes(state, self.vocab.token_bytes[token])

    def walk_bytes(self, state: int, data: bytes) -> int:
        for b in data:
            state = int(self.dfa.trans[state, b])
            if state < 0:
                return -1
        return state


def compile_regex(
    regex: str,
    vocab: TokenVocab,
    *,
    timeout_s: float = 30.0,
    max_states: int = 10_000,
    use_disk_cache: bool = True,
    lazy: bool = False,
) -> FSMGrammar:
    """regex → FSMGrammar; ValueError for invalid/unsupported regex, too many states or timeout.
    lazy=True returns once the DFA is built (rows fill on demand); complete() + save_to_disk_cache() later."""
    path = _cache_path(regex, vocab)
    if use_disk_cache and path.exists():
        try:
            with np.load(path) as z:
                return FSMGrammar(regex, ByteDFA(z["trans"], z["accepting"]), vocab, z["masks"])
        except Exception:
            path.unlink(missing_ok=True)  # corrupt entry: rebuild
    start = time.monotonic()
    grammar = FSMGrammar(regex, regex_to_byte_dfa(regex, timeout_s=timeout_s, max_states=max_states), vocab)
    if lazy:
        return grammar

    def check() -> None:
        if time.monotonic() - start > timeout_s:
            raise ValueError(f"grammar compile timeout after {timeout_s:.0f} s")

    grammar.complete(check)
    if use_disk_cache:
        save_to_disk_cache(grammar)
    return grammar


def save_to_disk_cache(grammar: FSMGrammar) -> None:
    """Store a complete grammar under the cache dir (atomic rename; read-only dirs are skipped)."""
    path = _cache_path(grammar.regex, grammar.vocab)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp.npz")
        os.close(fd)
        np.savez(tmp, trans=grammar.dfa.trans, accepting=grammar.dfa.accepting, masks=grammar.masks_np)
        os.replace(tmp, path)  # concurrent writers leave one complete file
    except OSError:
        pass


class FSMMatcher:
    """Per-request cursor over an FSMGrammar; a stack of states makes rollback exact."""

    def __init__(self, grammar: FSMGrammar) -> None:
        self._g = grammar
        self._stack: list[int] = [0]

    @property
    def state(self) -> int:
        return self._stack[-1]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        s = self._stack[-1]
        src = self._g.eos_mask_np if s == TERMINATED else self._g.mask_row(s)
        if bitmask.device.type == "cpu":
            bitmask.numpy()[row] = src  # a numpy row copy costs ~1/2 of torch's dispatch
        else:
            bitmask[row].copy_(torch.from_numpy(src))

    def accept_token(self, token_id: int) -> bool:
        s = self._stack[-1]
        if s == TERMINATED:
            return False
        if token_id in self._g.eos_ids:
            if not self._g.dfa.accepting[s]:
                return False
            self._stack.append(TERMINATED)
            return True
        nxt = self._g.next_state(s, int(token_id))
        if nxt < 0:
            return False
        self._stack.append(nxt)
        return True

    def accept_string(self, text: str | bytes) -> bool:
        """Advance over text's bytes as one rollback step; False (state unchanged) if not allowed."""
        s = self._stack[-1]
        if s == TERMINATED:
            return False
        data = text.encode("utf-8") if isinstance(text, str) else text
        nxt = self._g.walk_bytes(s, data)
        if nxt < 0:
            return False
        self._stack.append(nxt)
        return True

    def find_jump_forward_string(self) -> str:
        s = self._stack[-1]
        if s == TERMINATED:
            return ""
        data, _ = self._g.forced_bytes(s)
        return _complete_utf8_prefix(data)

    def is_terminated(self) -> bool:
        return self._stack[-1] == TERMINATED

    def is_accepting(self) -> bool:
        s = self._stack[-1]
        return s == TERMINATED or bool(self._g.dfa.accepting[s])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens >= len(self._stack):
            raise ValueError(f"cannot roll back {num_tokens} steps; {len(self._stack) - 1} accepted")
        if num_tokens:
            del self._stack[-num_tokens:]

    def reset(self) -> None:
        self._stack = [0]


def _complete_utf8_prefix(data: bytes) -> str:
    """Longest prefix of data that is whole UTF-8 characters ('' if it starts mid-character)."""
    for cut in range(len(data), max(-1, len(data) - 4), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""
