"""Regex → byte-level DFA: interegular's character FSM re-expressed over UTF-8 bytes.
Promises: a dense table trans [S, 256] (-1 = dead) whose every live state can still reach an
accepting state; state 0 is initial; multi-byte characters pass through shared middle states."""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import interegular
import numpy as np
from interegular.fsm import Alphabet, State, TransitionKey, anything_else

MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)
UTF8_LENGTHS = (
    (2, 0xC2, 0xDF, 0x80, 0x7FF),
    (3, 0xE0, 0xEF, 0x800, 0xFFFF),
    (4, 0xF0, 0xF4, 0x10000, MAX_CODEPOINT),
)

Ranges = list[tuple[int, int]]
# A middle state's memo key: bytes left and, per target state, its ranges relative to the prefix.
_MemoKey = tuple[int, tuple[tuple[int, tuple[tuple[int, int], ...]], ...]]


@dataclass
class ByteDFA:
    trans: np.ndarray  # [S, 256] int32, -1 = dead
    accepting: np.ndarray  # [S] bool

    @property
    def num_states(self) -> int:
        return int(self.trans.shape[0])


def _to_ranges(points: list[int]) -> Ranges:
    out: Ranges = []
    for p in sorted(points):
        if out and p == out[-1][1] + 1:
            out[-1] = (out[-1][0], p)
        else:
            out.append((p, p))
    return out


def _complement(ranges: Ranges) -> Ranges:
    out: Ranges = []
    nxt = 0
    for a, b in ranges + [SURROGATES, (MAX_CODEPOINT + 1, MAX_CODEPOINT + 1)]:
        if a > nxt:
            out.append((nxt, a - 1))
        nxt = max(nxt, b + 1)
    return out


def _clip(ranges: Ranges, lo: int, hi: int) -> Ranges:
    return [(max(a, lo), min(b, hi)) for a, b in ranges if b >= lo and a <= hi]


class _Builder:
    """Accumulates byte transitions; middle states of multi-byte chars are memoised by what they lead to."""

    def __init__(self, n_char_states: int, check: Callable[[], None], max_states: int) -> None:
        self.rows: list[np.ndarray] = [np.full(256, -1, np.int32) for _ in range(n_char_states)]
        self.memo: dict[_MemoKey, int] = {}
        self.check = check
        self.max_states = max_states

    def new_state(self) -> int:
        if len(self.rows) >= self.max_states:
            raise ValueError(f"grammar too large: byte DFA exceeds {self.max_states} states")
        self.rows.append(np.full(256, -1, np.int32))
        return len(self.rows) - 1

    def middle(self, items: list[tuple[int, Ranges]], lo: int, rem: int) -> int:
        """State after a UTF-8 prefix covering code points [lo, lo + 64**rem): rem bytes left."""
        span = 64**rem
        live = [(t, _clip(r, lo, lo + span - 1)) for t, r in items]
        live = [(t, r) for t, r in live if r]
        if not live:
            return -1
        if rem == 0:
            return live[0][0]
        key = (rem, tuple((t, tuple((a - lo, b - lo) for a, b in r)) for t, r in live))
        if key in self.memo:
            return self.memo[key]
        sid = self.new_state()
        self.memo[key] = sid
        step = span // 64
        row = self.rows[sid]
        for c in range(64):
            row[0x80 + c] = self.middle(live, lo + c * step, rem - 1)
        return sid

    def add_char_state(self, sid: int, by_target: dict[int, Ranges]) -> None:
        row = self.rows[sid]
        items = sorted(by_target.items())
        for t, ranges in items:
            for a, b in _clip(ranges, 0, 0x7F):
                row[a : b + 1] = t
        for n, lead_lo, lead_hi, cp_lo, cp_hi in UTF8_LENGTHS:
            clipped = [(t, _clip(r, cp_lo, cp_hi)) for t, r in items]
            clipped = [(t, r) for t, r in clipped if r]
            if not clipped:
                continue
            bits = 6 * (n - 1)
            for lead in range(lead_lo, lead_hi + 1):
                base = (lead & (0x7F >> n)) << bits
                row[lead] = self.middle(clipped, base, n - 1)
            self.check()


def _char_transitions(fsm: interegular.FSM) -> tuple[list[State], dict[int, Ranges]]:
    """State order (initial first) and, per alphabet transition key, its code point ranges."""
    alphabet = fsm.alphabet
    explicit = [ord(c) for c in alphabet._symbol_mapping if isinstance(c, str) and len(c) == 1]
    key_ranges: dict[int, Ranges] = {}
    for key, chars in alphabet.by_transition.items():
        pts = [ord(c) for c in chars if c is not anything_else and len(c) == 1]
        rs = _to_ranges(pts)
        if any(c is anything_else for c in chars):
            rs = sorted(rs + _complement(_to_ranges(explicit)))
        key_ranges[key] = rs
    states = [fsm.initial] + sorted(s for s in fsm.states if s != fsm.initial)
    return states, key_ranges


def _prune(trans: np.ndarray, accepting: np.ndarray) -> ByteDFA:
    """Drop states that cannot reach acceptance or be reached from 0; renumber with 0 initial."""
    n = trans.shape[0]
    rev: list[list[int]] = [[] for _ in range(n)]
    src, byte = np.nonzero(trans >= 0)
    for s, t in zip(src.tolist(), trans[src, byte].tolist()):
        rev[t].append(s)
    live = accepting.copy()
    queue = deque(np.nonzero(accepting)[0].tolist())
    while queue:
        for p in rev[queue.popleft()]:
            if not live[p]:
                live[p] = True
                queue.append(p)
    if not live[0]:
        raise ValueError("regex matches no string")
    trans = np.where((trans >= 0) & live[np.maximum(trans, 0)], trans, -1)
    order, seen = [0], {0}
    for s in order:  # BFS from the initial state
        for t in np.unique(trans[s][trans[s] >= 0]).tolist():
            if t not in seen:
                seen.add(t)
                order.append(t)
    remap = np.full(n + 1, -1, np.int32)
    remap[np.array(order)] = np.arange(len(order), dtype=np.int32)
    new_trans = remap[trans[np.array(order)]]  # -1 indexes remap[-1] == -1
    return ByteDFA(new_trans.astype(np.int32), accepting[np.array(order)].copy())


_UNICODE_ESCAPE = re.compile(
    r"(?<!\\)((?:\\\\)*)\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|x\{([0-9a-fA-F]{1,6})\})"
)


def _expand_unicode_escapes(regex: str) -> str:
    """Python's \\uXXXX / \\UXXXXXXXX (and \\x{...}) escapes → the literal (escaped) character."""

    def sub(m: re.Match[str]) -> str:
        cp = int(m.group(2) or m.group(3) or m.group(4), 16)
        return m.group(1) + re.escape(chr(cp))

    return _UNICODE_ESCAPE.sub(sub, regex)


def _freeze(x: object) -> object:
    """A hashable stand-in with the same equality (interegular's crawl states may be sets/lists)."""
    if isinstance(x, set):
        return frozenset(x)  # set members are hashable already
    try:
        hash(x)
        return x
    except TypeError:
        pass
    if isinstance(x, (list, tuple)):
        return (type(x) is list, tuple(_freeze(v) for v in x))
    if isinstance(x, dict):
        return frozenset((k, _freeze(v)) for k, v in x.items())
    raise TypeError(f"cannot index interegular state of type {type(x).__name__}")


def _crawl(
    alphabet: Alphabet,
    initial: object,
    final: Callable[[object], bool],
    follow: Callable[[object, TransitionKey], object],
) -> interegular.FSM:
    """interegular.fsm.crawl with a dict index instead of list.index (O(n) instead of O(n²) for the
    large FSMs JSON schemas produce); same states, numbering, finals and map."""
    states: list[object] = [initial]
    index: dict[object, int] = {_freeze(initial): 0}
    finals: set[int] = set()
    fsm_map: dict[int, dict[TransitionKey, int]] = {}
    i = 0
    while i < len(states):
        state = states[i]
        if final(state):
            finals.add(i)
        fsm_map[i] = {}
        for transition in alphabet.by_transition:
            try:
                nxt = follow(state, transition)
            except interegular.fsm.OblivionError:
                continue
            key = _freeze(nxt)
            j = index.get(key)
            if j is None:
                j = index[key] = len(states)
                states.append(nxt)
            fsm_map[i][transition] = j
        i += 1
    return interegular.fsm.FSM(
        alphabet=alphabet,
        states=range(len(states)),
        initial=0,
        finals=finals,
        map=fsm_map,
        __no_validation__=True,
    )


interegular.fsm.crawl = _crawl  # behaviour-preserving speed-up, see _crawl


def parse_regex(regex: str) -> interegular.FSM:
    """interegular's FSM for `regex` (full-match semantics); ValueError on unsupported syntax."""
    if not isinstance(regex, str):
        raise ValueError(f"regex must be a string, got {type(regex).__name__}")
    body = _expand_unicode_escapes(regex)
    body = body[1:] if body.startswith("^") else body  # full-match semantics: anchors are no-ops
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    try:
        re.compile(body)  # interegular accepts some invalid syntax (e.g. 'a**'); Python's re decides
    except re.error as e:
        raise ValueError(f"invalid or unsupported regex {regex!r}: {e}") from e
    if _lookahead_past_the_end(body):
        raise ValueError(
            f"unsupported regex {regex!r}: a lookahead that may read past the end of the match is "
            "not enforced under full-match semantics (write the text it checks into the pattern)"
        )
    try:
        return interegular.parse_pattern(body).to_fsm()
    except Exception as e:  # interegular raises bare Exception subclasses
        raise ValueError(f"invalid or unsupported regex {regex!r}: {type(e).__name__}: {e}") from e


def _lookahead_past_the_end(regex: str) -> bool:
    """Whether a lookahead of `regex` may read past the end of the match: its longest text is
    longer than the shortest rest of the pattern after it. interegular reads a lookahead as "the
    text goes on with this", a lexer's view, so such a lookahead lets the text run on (a(?=bc)b
    would accept "abc", b(?!c) "bu" but not "b"); one that ends within the match is exact."""
    import re._constants as C
    import re._parser as P

    def min_width(items: list[Any]) -> int:
        return int(P.SubPattern(P.State(), list(items)).getwidth()[0])

    def scan(items: list[Any], tail_min: int) -> bool:
        for i, (op, av) in enumerate(items):
            rest_min = min_width(items[i + 1 :]) + tail_min
            if op in (C.ASSERT, C.ASSERT_NOT) and av[0] == 1:
                if P.SubPattern(P.State(), list(av[1])).getwidth()[1] > rest_min:
                    return True
            subs: list[Any] = []
            if op is C.SUBPATTERN:
                subs = [av[-1]]
            elif op is C.BRANCH:
                subs = list(av[1])
            elif op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
                subs = [av[2]]
            elif op is C.ATOMIC_GROUP:
                subs = [av]
            if any(scan(list(sub), rest_min) for sub in subs):
                return True
        return False

    try:
        return scan(list(P.parse(regex)), 0)
    except Exception:  # noqa: BLE001 - what Python cannot parse, interegular then decides
        return False


def estimate_states(regex: str) -> int:
    """A lower bound on the DFA's states from Python's own parse (counted repetitions multiply);
    0 when Python cannot parse the regex (interegular then decides)."""
    import re._constants as C
    import re._parser as P

    def size(items: list[tuple[Any, Any]]) -> int:
        total = 0
        for op, av in items:
            if op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
                lo, hi, sub = av
                total += (max(lo, 1) + 1 if hi == C.MAXREPEAT else hi) * size(list(sub))
            elif op is C.SUBPATTERN:
                total += size(list(av[-1]))
            elif op is C.BRANCH:
                total += sum(size(list(b)) for b in av[1])
            else:
                total += 1
        return total

    try:
        return size(list(P.parse(regex)))
    except Exception:
        return 0


def regex_to_byte_dfa(regex: str, timeout_s: float = 30.0, max_states: int = 10_000) -> ByteDFA:
    deadline = time.monotonic() + timeout_s

    def check() -> None:
        if time.monotonic() > deadline:
            raise ValueError(f"grammar compile timeout after {timeout_s:.0f} s")

    if (estimate := estimate_states(regex)) > max_states:
        raise ValueError(f"grammar too large: about {estimate} states > {max_states}")
    fsm = parse_regex(regex)
    states, key_ranges = _char_transitions(fsm)
    if len(states) > max_states:
        raise ValueError(f"grammar too large: {len(states)} states > {max_states}")
    sid = {s: i for i, s in enumerate(states)}
    builder = _Builder(len(states), check, max_states)
    for s in states:
        by_target: dict[int, Ranges] = {}
        for key, t in fsm.map.get(s, {}).items():
            by_target.setdefault(sid[t], []).extend(key_ranges[key])
        builder.add_char_state(sid[s], {t: sorted(r) for t, r in by_target.items()})
    trans = np.stack(builder.rows)
    accepting = np.zeros(len(builder.rows), dtype=bool)
    accepting[[sid[s] for s in fsm.finals]] = True
    return _prune(trans, accepting)
