"""The mask side of schema_guard's value checks: among the tokens the grammar allows, those that could
complete a checked value are tried on a copy of the JSON tracker and cleared when a check fails.
Promises: a cleared token is one whose bytes would complete a value its location refuses; tokens that
cannot complete a checked value (by their quote, bracket and terminator bytes) are never tried."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .json_tracker import JsonTracker

_SCALAR = frozenset(b"0123456789-+.eEtrufalsn")
_SCALAR_END = frozenset(b",}] \t\n\r")


@dataclass
class TokenFeatures:
    """Per token id: its bytes, and which completions its bytes make possible from each reader mode."""

    token_bytes: list[bytes]
    closes: np.ndarray  # count of '}' and ']' bytes
    from_between: np.ndarray  # bool: two quotes, a bracket close, or a scalar byte then a terminator
    from_string: np.ndarray  # bool: a quote
    from_scalar: np.ndarray  # bool: a terminator byte
    ends_scalar: np.ndarray  # bool: no quote, and the last byte can belong to a number or literal
    stop_ids: frozenset[int]


def token_features(token_bytes: list[bytes], stop_ids: list[int]) -> TokenFeatures:
    n = len(token_bytes)
    closes = np.zeros(n, np.int32)
    between, string, scalar, open_scalar = (np.zeros(n, bool) for _ in range(4))
    for i, b in enumerate(token_bytes):
        if i in stop_ids:
            continue
        closes[i] = b.count(b"}") + b.count(b"]")
        quotes = b.count(b'"')
        string[i] = quotes > 0
        ends = [k for k, c in enumerate(b) if c in _SCALAR_END]
        scalar[i] = bool(ends)
        open_scalar[i] = bool(b) and quotes == 0 and b[-1] in _SCALAR
        first_scalar = next((k for k, c in enumerate(b) if c in _SCALAR), None)
        between[i] = (
            quotes >= 2 or closes[i] > 0 or (first_scalar is not None and any(k > first_scalar for k in ends))
        )
    return TokenFeatures(token_bytes, closes, between, string, scalar, open_scalar, frozenset(stop_ids))


def allowed_ids(row: torch.Tensor, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab_size])


def clear_ids(row: torch.Tensor, ids: list[int]) -> None:
    unsigned = row.numpy().view(np.uint32)
    for t in ids:
        unsigned[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)


def refine_mask(row: torch.Tensor, tracker: JsonTracker, buf: bytearray, features: TokenFeatures) -> None:
    """Clear, in the bitmask row (int32 words), the allowed tokens whose completion a check refuses."""
    depth = tracker.live_depth()
    if depth < 0:
        return
    allowed = allowed_ids(row, len(features.token_bytes))
    bits = np.zeros(len(features.token_bytes), bool)
    bits[allowed] = True
    mode_ok = (features.from_between, features.from_string, features.from_scalar)[tracker.mode]
    picked = allowed[(features.closes[allowed] >= depth) & mode_ok[allowed]]
    stops = [t for t in features.stop_ids if t < len(bits) and bits[t]]
    refused = [int(t) for t in picked if not tracker.copy().feed(features.token_bytes[t], buf)]
    if stops and not tracker.copy().finish(buf):
        refused += stops
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
    allowed = allowed_ids(row, len(features.token_bytes))
    refused = []
    for t in allowed[features.ends_scalar[allowed]].tolist():
        after = tracker.copy()
        if not after.feed(features.token_bytes[t], buf) or not after.open_scalar_checked():
            continue
        extended = bytes(buf) + features.token_bytes[t]
        if not any(_continues(after, int(u), extended, features) for u in allowed_after(t)):
            refused.append(t)
    clear_ids(row, refused)


def _continues(tracker: JsonTracker, token: int, buf: bytes, features: TokenFeatures) -> bool:
    """Whether token, after the open scalar, extends it or ends it where every check accepts."""
    after = tracker.copy()
    if token in features.stop_ids:
        return after.finish(buf)
    return after.feed(features.token_bytes[token], buf)
