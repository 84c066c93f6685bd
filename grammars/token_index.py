"""Token vocabulary as raw bytes (GPT-2 byte-level BPE, SentencePiece byte fallback, plain) and the
vectorised per-DFA-state allowed-token bitmasks. Promises: special tokens have no bytes and are never
indexed; the index is built with numpy over (state, token) pairs, pruned byte by byte."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

CHUNK_STATES = 64


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable char standing for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _decoder_type(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return ""
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except Exception:
        return ""
    types = [decoder.get("type", "")] + [d.get("type", "") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" if "ByteLevel" in types else ("ByteFallback" if "ByteFallback" in types else "")


def detect_vocab_type(tokenizer: Any, vocab: dict[str, int]) -> str:
    """'byte_level' (GPT-2 style), 'byte_fallback' (SentencePiece <0xNN> + ▁) or 'raw'."""
    dtype = _decoder_type(tokenizer)
    if dtype == "ByteLevel":
        return "byte_level"
    if dtype == "ByteFallback" or ("<0x0A>" in vocab and any("▁" in t for t in list(vocab)[:5000])):
        return "byte_fallback"
    if "Ġ" in vocab or "Ċ" in vocab:
        return "byte_level"
    return "raw"


def token_to_bytes(token: str, vocab_type: str) -> bytes:
    """Raw bytes a (non-special) vocabulary entry stands for."""
    if vocab_type == "byte_level":
        table = _byte_level_decoder()
        try:
            return bytes(table[c] for c in token)
        except KeyError:
            return token.encode("utf-8")  # an added (non byte-level) token
    if vocab_type == "byte_fallback":
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            return bytes([int(token[3:5], 16)])
        return token.replace("▁", " ").encode("utf-8")
    return token.encode("utf-8")


def special_token_ids(tokenizer: Any) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for idx, tok in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(idx))
    return ids


@dataclass
class TokenVocab:
    """The model's vocabulary as bytes; ids ≥ len(tokenizer) and special tokens map to b''."""

    token_bytes: list[bytes]
    eos_ids: tuple[int, ...]
    vocab_type: str
    vocab_size: int = field(init=False)
    digest: str = field(init=False)
    _trie: TokenTrie | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self.vocab_size = len(self.token_bytes)
        h = hashlib.sha256()
        for b in self.token_bytes:
            h.update(len(b).to_bytes(2, "little") + b)
        h.update(repr(self.eos_ids).encode())
        self.digest = h.hexdigest()[:32]

    @property
    def trie(self) -> TokenTrie:
        if self._trie is None:
            self._trie = build_trie(self.token_bytes)
        return self._trie


def vocab_from_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int] | None = None) -> TokenVocab:
    """Decode every id < vocab_size to bytes; vocab_size may exceed the tokenizer's length."""
    vocab = tokenizer.get_vocab()
    vtype = detect_vocab_type(tokenizer, vocab)
    specials = special_token_ids(tokenizer)
    added = {int(i): t for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    out = [b""] * vocab_size
    for tok, idx in vocab.items():
        if idx >= vocab_size or idx in specials:
            continue
        out[idx] = added[idx].content.encode("utf-8") if idx in added else token_to_bytes(tok, vtype)
    if eos_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = [eos] if eos is not None else []
    if not eos_ids:
        raise ValueError("tokenizer has no eos_token_id; pass stop_token_ids")
    return TokenVocab(out, tuple(sorted(set(int(e) for e in eos_ids))), vtype)


@dataclass
class TokenTrie:
    """Byte prefixes of all tokens, level by level: node i of level d has byte[d][i] and parent
    parent[d][i] in level d-1 (level 0 = the root); ends[d] = (token ids, node positions)."""

    byte: list[np.ndarray]
    parent: list[np.ndarray]
    ends: list[tuple[np.ndarray, np.ndarray]]


def build_trie(token_bytes: list[bytes]) -> TokenTrie:
    depth = max((len(b) for b in token_bytes), default=0)
    levels: list[dict[bytes, int]] = [{b"": 0}] + [{} for _ in range(depth)]
    for b in token_bytes:
        for d in range(1, len(b) + 1):
            levels[d].setdefault(b[:d], 0)
    byte, parent = [np.zeros(1, np.int64)], [np.zeros(1, np.int64)]
    for d in range(1, depth + 1):
        keys = sorted(levels[d])
        for i, k in enumerate(keys):
            levels[d][k] = i
        byte.append(np.array([k[-1] for k in keys], dtype=np.int64))
        parent.append(np.array([levels[d - 1][k[:-1]] for k in keys], dtype=np.int64))
    ends_lists: list[tuple[list[int], list[int]]] = [([], []) for _ in range(depth + 1)]
    for t, b in enumerate(token_bytes):
        if b:
            ends_lists[len(b)][0].append(t)
            ends_lists[len(b)][1].append(levels[len(b)][b])
    ends = [(np.array(a, dtype=np.int64), np.array(p, dtype=np.int64)) for a, p in ends_lists]
    return TokenTrie(byte, parent, ends)


def _chunk_allowed(trans_ext: np.ndarray, states: np.ndarray, trie: TokenTrie, dense: np.ndarray) -> None:
    """dense[i, t] = True iff token t's bytes stay alive from states[i]. Walks the trie level by
    level for the whole chunk at once, dropping nodes dead for every state of the chunk."""
    cur = states[:, None]  # [C, alive nodes of the previous level]
    prev_col = np.zeros(1, dtype=np.int64)  # previous level node position → column of cur (-1 dead)
    for d in range(1, len(trie.byte)):
        pc = prev_col[trie.parent[d]]
        kept = np.nonzero(pc >= 0)[0]
        if not len(kept):
            return
        nxt = trans_ext[cur[:, pc[kept]], trie.byte[d][kept]]  # dead (-1) indexes the all -1 row
        alive = (nxt >= 0).any(axis=0)
        nxt, kept = nxt[:, alive], kept[alive]
        col = np.full(len(trie.byte[d]), -1, dtype=np.int64)
        col[kept] = np.arange(len(kept))
        toks, pos = trie.ends[d]
        c = col[pos]
        hit = c >= 0
        dense[:, toks[hit]] = nxt[:, c[hit]] >= 0
        cur, prev_col = nxt, col


def mask_rows(
    trans_ext: np.ndarray, accepting: np.ndarray, states: np.ndarray, vocab: TokenVocab
) -> np.ndarray:
    """Bitmask rows [len(states), ceil(V/32)] int32 for some states of the DFA (trans_ext = trans plus
    a last all -1 row): bit t is set iff token t's bytes stay alive from the state, or t is a stop
    token and the state accepts."""
    words = (vocab.vocab_size + 31) // 32
    dense = np.zeros((len(states), words * 32), dtype=bool)
    _chunk_allowed(trans_ext, states, vocab.trie, dense)
    dense[np.ix_(np.nonzero(accepting[states])[0], np.array(vocab.eos_ids, dtype=np.int64))] = True
    return np.packbits(dense, axis=1, bitorder="little").view(np.int32)


def extend_trans(trans: np.ndarray) -> np.ndarray:
    return np.vstack([trans, np.full((1, 256), -1, dtype=trans.dtype)])
