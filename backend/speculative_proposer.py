"""Draft proposers for speculative decoding: one interface (up to k guessed next tokens for a
request, from host state only, so EAGLE heads or a draft model can sit behind it) and the n-gram /
prompt-lookup proposer. Promises: a proposal is a deterministic function of the request's tokens
(and of the shared corpus), never longer than asked, and costs no device work."""

from __future__ import annotations

import random
import weakref
from collections import OrderedDict
from typing import Protocol

from .request import Req


class Proposer(Protocol):
    """What the speculator asks of a draft source."""

    name: str

    def propose(self, req: Req, k: int) -> list[int]:
        """Up to k tokens guessed to follow req.all_ids (empty: no guess)."""
        ...

    def observe_finished(self, req: Req) -> None:
        """A request ended: a proposer may keep its text as a source for later requests."""
        ...


class NgramIndex:
    """For one growing token list: each n-gram (min_n ≤ n ≤ max_n) → the end of its latest
    occurrence that is not the list's own suffix, so a lookup of the suffix finds an earlier copy."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ids: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}

    def sync(self, ids: list[int]) -> None:
        """Index the tokens added since the last call (rebuilt if earlier tokens changed, as a
        jump-forward retokenization may do)."""
        old = self.ids
        if len(ids) < len(old) or (old and ids[len(old) - 1] != old[-1]):
            self.ids, self.ends = [], {}
            old = self.ids
        # n-grams ending before the last token (the suffix is indexed once a token follows it),
        # built by zip and dict.update: a prompt of thousands of tokens is indexed at C speed, and
        # later ends overwrite earlier ones, so each n-gram maps to its latest occurrence
        last = len(ids)
        for n in range(self.min_n, self.max_n + 1):
            first = max(len(old), n)
            if first < last:
                grams = zip(*(ids[first - n + j : last - n + j] for j in range(n)))
                self.ends.update(zip(grams, range(first, last)))
        self.ids = ids

    def lookup(self, k: int) -> list[int]:
        """What followed the latest earlier copy of the longest matching suffix (≤ k tokens)."""
        ids = self.ids
        for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
            end = self.ends.get(tuple(ids[len(ids) - n :]))
            if end is not None:
                return ids[end : end + k]
        return []

    def continuation(self, suffix: list[int], k: int) -> list[int]:
        """What followed the latest copy of the longest matching suffix of another list."""
        for n in range(min(self.max_n, len(suffix)), self.min_n - 1, -1):
            end = self.ends.get(tuple(suffix[len(suffix) - n :]))
            if end is not None:
                found = self.ids[end : end + k]
                return found[: found.index(-1)] if -1 in found else found
        return []


class NgramProposer:
    """Prompt lookup: the request's own prompt and output first, then the text of recently
    finished requests (a program's other branches, earlier turns that share its prefix)."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4, corpus_requests: int = 16) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._own: weakref.WeakKeyDictionary[Req, NgramIndex] = weakref.WeakKeyDictionary()
        # finished requests, newest last: their tokens, indexed on first use
        self._corpus: OrderedDict[str, NgramIndex | list[int]] = OrderedDict()
        self._corpus_cap = corpus_requests

    def propose(self, req: Req, k: int) -> list[int]:
        if k <= 0:
            return []
        index = self._own.get(req)
        if index is None:
            index = self._own[req] = NgramIndex(self.min_n, self.max_n)
        index.sync(req.all_ids)
        found = index.lookup(k)
        if found:
            return found
        tail = index.ids[-self.max_n :]
        for rid in reversed(self._corpus):
            found = self._corpus_index(rid).continuation(tail, k)
            if found:
                return found
        return []

    def _corpus_index(self, rid: str) -> NgramIndex:
        """A finished request's n-gram index, built the first time a proposal consults it."""
        entry = self._corpus[rid]
        if isinstance(entry, NgramIndex):
            return entry
        index = NgramIndex(self.min_n, self.max_n)
        index.sync(entry)
        self._corpus[rid] = index
        return index

    def observe_finished(self, req: Req) -> None:
        # Only the tokens are kept here: every finished request passes through, speculating or not,
        # and indexing thousands of prompt tokens each would cost the scheduler more than a step.
        self._own.pop(req, None)
        if self._corpus_cap <= 0 or len(req.output_ids) == 0:
            return
        # a sentinel, so n-grams ending at the last real token are indexed
        self._corpus[req.rid] = [*req.all_ids, -1]
        self._corpus.move_to_end(req.rid)
        while len(self._corpus) > self._corpus_cap:
            self._corpus.popitem(last=False)


class ReplayProposer:
    """For measuring the verify machinery, not for users: proposes a recorded continuation of the
    prompt (the target's own earlier greedy output), each draft replaced by a wrong token with
    probability `wrong`, so acceptance is what the benchmark asks (random weights accept no n-gram)."""

    name = "replay"

    def __init__(
        self, references: dict[tuple[int, ...], list[int]], wrong: float = 0.0, seed: int = 0
    ) -> None:
        self.references = references
        self.wrong = wrong
        self.rng = random.Random(seed)

    def propose(self, req: Req, k: int) -> list[int]:
        ref = self.references.get(tuple(req.input_ids))
        n = len(req.output_ids)
        if ref is None or k <= 0 or (n and (n > len(ref) or ref[n - 1] != req.output_ids[-1])):
            return []
        return [t + 1 if self.rng.random() < self.wrong else t for t in ref[n : n + k]]

    def observe_finished(self, req: Req) -> None:
        return None
