"""The mask side of schema_guard's value checks: among the tokens the grammar allows, those that could
complete a checked value are tried on a copy of the JSON tracker and cleared when a check fails.
Promises: a cleared token is one whose bytes would complete a value its location refuses; tokens that
cannot complete a checked value (by their quote, bracket and terminator bytes) are never tried."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .json_tracker import JsonTracker

_SCALAR = frozenset(b"0123456789-+.eEtrufalsn")
_SCALAR_START = frozenset(b"0123456789-tfn")
_SCALAR_END = frozenset(b",}] \t\n\r")
_BEFORE_VALUE = frozenset(b" :,[")


@dataclass
class TokenFeatures:
    """Per token id its bytes, and the ids whose bytes make a completion possible (supersets: a
    token outside every set a state needs cannot complete a checked value from that state)."""

    token_bytes: list[bytes]
    quotes: np.ndarray  # count of '"' bytes
    closes: np.ndarray  # count of '}' and ']' bytes
    quote_ids: np.ndarray  # a quote
    close_ids: np.ndarray  # a closing bracket
    empty_ids: np.ndarray  # an opening bracket with a closing one after it ('[]', '{}')
    term_ids: np.ndarray  # ends an open number or literal the way JSON can (',', '}', ']', space)
    new_scalar_ids: np.ndarray  # a number or literal starts after structure and ends inside
    open_scalar_ids: np.ndarray  # ends inside a number or literal that began after structure
    stop_ids: frozenset[int]
    string_end_heads: list[bytes | None]  # before the quote, for a token that closes a string and no value


def _scalar_run(b: bytes) -> tuple[bool, bool]:
    """(a scalar starts after structure and a terminator follows it, the token ends in such a run)."""
    completes = ends_open = False
    for i, c in enumerate(b):
        if c not in _SCALAR_START or (i > 0 and b[i - 1] not in _BEFORE_VALUE):
            continue
        j = i
        while j < len(b) and b[j] in _SCALAR:
            j += 1
        completes = completes or (j < len(b) and b[j] in _SCALAR_END)
        ends_open = ends_open or j == len(b)
    return completes, ends_open or (bool(b) and all(c in _SCALAR for c in b))


def _ends_scalar(b: bytes) -> bool:
    """After the scalar bytes it continues, the token ends the value as valid JSON can: a comma or
    a closing bracket, possibly after whitespace, or only whitespace."""
    rest = b.lstrip(bytes(_SCALAR))
    after_ws = rest.lstrip(b" \t\n\r")
    return bool(rest) and (not after_ws or after_ws[:1] in (b",", b"}", b"]"))


def _opens_and_closes(b: bytes) -> bool:
    first = min((i for i, c in enumerate(b) if c in b"[{"), default=-1)
    return first >= 0 and any(c in b"]}" for c in b[first + 1 :])


def token_features(token_bytes: list[bytes], stop_ids: list[int]) -> TokenFeatures:
    n = len(token_bytes)
    quotes, closes = np.zeros(n, np.int32), np.zeros(n, np.int32)
    term, empty, new_scalar, open_scalar = (np.zeros(n, bool) for _ in range(4))
    for i, b in enumerate(token_bytes):
        if i in stop_ids:
            continue
        quotes[i] = b.count(b'"')
        closes[i] = b.count(b"}") + b.count(b"]")
        term[i] = _ends_scalar(b)
        empty[i] = _opens_and_closes(b)
        new_scalar[i], ends_open = _scalar_run(b)
        open_scalar[i] = ends_open and quotes[i] == 0
    ids = np.flatnonzero
    return TokenFeatures(
        token_bytes,
        quotes,
        closes,
        ids(quotes > 0),
        ids(closes > 0),
        ids(empty),
        ids(term),
        ids(new_scalar),
        ids(open_scalar),
        frozenset(stop_ids),
        [None if i in stop_ids else _string_end_head(b) for i, b in enumerate(token_bytes)],
    )


def allowed_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    """The ids whose bit is set, ascending. Only the non-zero words are unpacked: a mask after an
    open scalar allows a few hundred of the vocabulary's ids."""
    words = row.numpy().view(np.uint32)
    nonzero = np.flatnonzero(words)
    bits = np.unpackbits(words[nonzero].view(np.uint8), bitorder="little").reshape(len(nonzero), 32)
    word, bit = np.nonzero(bits)
    ids = nonzero[word] * 32 + bit
    return ids[ids < vocab_size]


def allowed_among(row: torch.Tensor, ids: np.ndarray) -> np.ndarray:
    """The ids (int array) whose bit is set in the bitmask row."""
    words = row.numpy().view(np.uint32)
    allowed: np.ndarray = ids[((words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).astype(bool)]
    return allowed


def clear_ids(row: torch.Tensor, ids: list[int]) -> None:
    unsigned = row.numpy().view(np.uint32)
    for t in ids:
        unsigned[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)


def candidate_ids(tracker: JsonTracker, f: TokenFeatures) -> np.ndarray | None:
    """Token ids that could make a check fire from the reader's state; None when none could."""
    fires_now, close_at, live = tracker.fire_profile()
    if not (fires_now or close_at or live):
        return None
    first = 1 if tracker.mode == 1 else 0  # inside a string, its closing quote comes first
    pools = []
    if fires_now:
        pools.append(f.quote_ids if tracker.mode == 1 else f.term_ids)
    if close_at:
        pools.append(f.close_ids[f.closes[f.close_ids] >= close_at])
    if live:  # a new value may start and end inside the token
        pools += [f.quote_ids[f.quotes[f.quote_ids] >= 2 + first], f.empty_ids, f.new_scalar_ids]
    ids = np.concatenate(pools)
    if tracker.mode == 1:
        ids = ids[f.quotes[ids] > 0]
    return ids


_WS = b" \t\n\r"
# what may follow a closing quote without completing a value: separators, opened containers, then
# at most an opened string or an unterminated number or literal
_INERT_TAIL = re.compile(rb'[ \t\n\r,:\[{]*(?:"[^"\\]*|[0-9A-Za-z.+-]*)\Z')


def _string_end_head(data: bytes) -> bytes | None:
    """The bytes before data's first quote when data, read inside a string, closes it and completes
    nothing more: no backslash before the quote, and nothing after it that can complete a value."""
    head, quote, tail = data.partition(b'"')
    if quote and b"\\" not in head and _INERT_TAIL.match(tail):
        return head
    return None


def _judge_string_ends(
    tracker: JsonTracker, ids: list[int], f: TokenFeatures, buf: bytearray
) -> tuple[list[int], list[int]]:
    """(refused, not judged) among ids, for a reader inside a string (a value or a key): a token that
    closes the string and completes nothing after it is judged without copying the reader, once per
    distinct string that tokens complete, since the verdict depends on that string alone."""
    refused: list[int] = []
    others: list[int] = []
    verdicts: dict[bytes, bool] = {}
    for t in ids:
        head = f.string_end_heads[t]
        if head is None:
            others.append(t)
            continue
        verdict = verdicts.get(head)
        if verdict is None:
            verdict = verdicts[head] = tracker.string_end_verdict(head, buf)
        if not verdict:
            refused.append(t)
    return refused, others


def _verdict_key(tracker: JsonTracker, data: bytes) -> bytes:
    """Tokens with one key get one verdict: between values, leading whitespace changes nothing the
    reader records but offsets, and no check reads an offset."""
    return data.lstrip(_WS) if tracker.mode == 0 else data


def _refused_by_feed(tracker: JsonTracker, ids: list[int], f: TokenFeatures, buf: bytearray) -> list[int]:
    """The ids whose bytes, fed to a copy of the reader, complete a value a check refuses."""
    verdicts: dict[bytes, bool] = {}
    refused = []
    for t in ids:
        data = f.token_bytes[t]
        key = _verdict_key(tracker, data)
        verdict = verdicts.get(key)
        if verdict is None:
            verdict = verdicts[key] = tracker.copy().feed(data, buf)
        if not verdict:
            refused.append(t)
    return refused


def refine_mask(row: torch.Tensor, tracker: JsonTracker, buf: bytearray, features: TokenFeatures) -> None:
    """Clear, in the bitmask row (int32 words), the allowed tokens whose completion a check refuses."""
    ids = candidate_ids(tracker, features)
    if ids is None:
        return
    picked = np.unique(allowed_among(row, ids)).tolist()  # the pools of candidate_ids overlap
    refused: list[int] = []
    if tracker.mode == 1 and not tracker.escape:
        refused, picked = _judge_string_ends(tracker, picked, features, buf)
    refused += _refused_by_feed(tracker, picked, features, buf)
    if tracker.mode == 2 and not tracker.stack:  # a root number or literal ends at the stop token
        stops = allowed_among(row, np.array(sorted(features.stop_ids), dtype=np.int64))
        if len(stops) and not tracker.copy().finish(buf):
            refused += stops.tolist()
    clear_ids(row, refused)


def prune_open_scalars(
    row: torch.Tensor,
    tracker: JsonTracker,
    buf: bytearray,
    features: TokenFeatures,
    allowed_after: Callable[[int], np.ndarray],
) -> None:
    """A number or literal is checked only when it ends, so a token that leaves a checked one open is
    kept only if the grammar then allows a token that ends it in a value the check accepts, or one
    that extends it further (one token of lookahead: a digit that can only end in a refused value,
    such as a duplicate under uniqueItems, is cleared before the dead end)."""
    if tracker.mode == 1 or tracker.live_depth() < 0:
        return
    refused = []
    kept: set[bytes] = set()  # verdict keys (_verdict_key) of tokens kept without the lookahead
    for t in allowed_among(row, features.open_scalar_ids).tolist():
        data = features.token_bytes[t]
        key = _verdict_key(tracker, data)
        if key in kept:
            continue
        after = tracker.copy()
        if not after.feed(data, buf) or not after.open_scalar_checked():
            kept.add(key)
            continue
        extended = bytes(buf) + data
        # no scalar ends here ("tr", "-", "1e"): the mask allows only prefixes of the grammar's
        # sentences and the vocabulary holds every single byte, so the grammar allows a token that
        # extends it, and an extension is all the lookahead below would look for; or ending here
        # passes (or the grammar must extend it)
        if _incomplete_scalar(extended[after.value_start :]) or _ends_accepted(after, extended):
            kept.add(key)
            continue
        if not any(_continues(after, int(u), extended, features) for u in allowed_after(t)):
            refused.append(t)
    clear_ids(row, refused)


@functools.lru_cache(maxsize=4096)  # a position's tokens leave few distinct scalars open
def _incomplete_scalar(text: bytes) -> bool:
    """The open number or literal's text is not yet a JSON value (a prefix of one that must go on)."""
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def _ends_accepted(tracker: JsonTracker, buf: bytes) -> bool:
    """Whether the open scalar, ended right here, passes its checks. When it does, the lookahead
    cannot refuse the token: either the grammar lets it end here, or it must allow an extension."""
    after = tracker.copy()
    return after.feed(b",", buf) if after.stack else after.finish(buf)


def _continues(tracker: JsonTracker, token: int, buf: bytes, features: TokenFeatures) -> bool:
    """Whether token, after the open scalar, extends it or ends it where every check accepts."""
    after = tracker.copy()
    if token in features.stop_ids:
        return after.finish(buf)
    return after.feed(features.token_bytes[token], buf)
