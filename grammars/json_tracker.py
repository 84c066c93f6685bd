"""Incremental reader of a JSON document's bytes for the value checks of schema_guard: which value is
open at which instance location, and when a value or an object key completes. Promises: a value is
reported complete on the byte that ends it (the closing quote or bracket; for numbers and literals
the byte after them, or finish()), with its exact text; the reader never judges JSON syntax (the
grammar does), and copy() is O(depth), so a candidate token can be tried without touching the
original."""

from __future__ import annotations

import json
from typing import Protocol

_WS = frozenset(b" \t\n\r")
_SCALAR_END = frozenset(b",}] \t\n\r")


class Location(Protocol):
    """The schema side of one instance location (schema_guard.Location)."""

    def child(self, key: str | int) -> Location: ...

    def check_value(self, text: bytes) -> bool: ...

    def check_key(self, text: bytes) -> bool: ...

    def check_unique(self, earlier: tuple[bytes, ...], last: bytes) -> bool: ...

    checked: bool  # its values are checked when they complete
    checks_keys: bool  # its object keys are checked when they complete
    live: bool  # it or a location below it is checked
    unique_items: bool  # its array items are checked for duplicates as each one completes


# a container frame: (is_object, start offset, location, last key, items started, expecting a key,
# the texts of the completed items where the location checks them for duplicates)
Frame = tuple[bool, int, Location, str, int, bool, tuple[bytes, ...]]


class JsonTracker:
    """Feed bytes; feed() returns False when a completed value (or key) fails its location's check."""

    def __init__(self, root: Location) -> None:
        self.root = root
        self.stack: list[Frame] = []
        self.offset = 0  # bytes consumed so far
        self.mode = 0  # 0 between tokens, 1 inside a string, 2 inside a number or literal
        self.escape = False
        self.is_key = False
        self.value_start = 0  # the open string's or scalar's first byte
        self.value_loc: Location = root
        self.done = False  # the root value has completed

    def copy(self) -> JsonTracker:
        other = JsonTracker.__new__(JsonTracker)
        other.__dict__.update(self.__dict__)
        other.stack = list(self.stack)
        return other

    def feed(self, data: bytes, buf: bytes | bytearray) -> bool:
        """Consume data, which follows buf (every byte consumed before); the values' texts are read
        from buf + data. Stops at the first failed check (the state is then meaningless). Bytes that
        are not JSON (a token the grammar is about to refuse) are refused too, never raised."""
        try:
            return self._feed(data, buf)
        except (IndexError, ValueError):  # a close with nothing open, a key that is not a string
            return False

    def _feed(self, data: bytes, buf: bytes | bytearray) -> bool:
        base = self.offset
        for i, b in enumerate(data):
            self.offset = base + i
            if self.mode == 1:
                if self.escape:
                    self.escape = False
                elif b == 0x5C:  # backslash
                    self.escape = True
                elif b == 0x22 and not self._end_string(buf, data, base):
                    return False
                continue
            if self.mode == 2:
                if b not in _SCALAR_END:
                    continue
                self.mode = 0
                if not self._complete(self.value_loc, self.value_start, self.offset, buf, data, base):
                    return False
            if not self._structural(b, buf, data, base):
                return False
        self.offset = base + len(data)
        return True

    def finish(self, buf: bytes | bytearray) -> bool:
        """The document ended (a stop token): a root number or literal completes here."""
        if self.mode == 2:
            self.mode = 0
            self.offset = len(buf)
            return self._complete(self.value_loc, self.value_start, len(buf), buf, b"", len(buf))
        return True

    def live_depth(self) -> int:
        """How many brackets a token must close before a check can fire: 0 when the open value, the
        open key or the innermost container may hold a checked location, -1 when nothing can."""
        if self.done:
            return -1
        if self.mode == 1 and (self.stack[-1][2].checks_keys if self.is_key else self.value_loc.live):
            return 0
        if self.mode == 2 and self.value_loc.live:
            return 0
        for depth, frame in enumerate(reversed(self.stack)):
            if frame[2].live:
                return depth
        return 0 if not self.stack and self.mode == 0 and self.root.live else -1

    def fire_profile(self) -> tuple[bool, int, bool]:
        """(completing the open value or key fires a check, how many brackets close the first
        container whose completion fires one (0: none), a container may hold a checked location)."""
        if self.done:
            return False, 0, False
        fires_now = False
        if self.mode == 1 and self.is_key:
            fires_now = self.stack[-1][2].checks_keys
        elif self.mode:
            fires_now = self.value_loc.checked or self._unique_parent(len(self.stack))
        close_at = 0
        for depth in range(len(self.stack), 0, -1):
            if self.stack[depth - 1][2].checked or self._unique_parent(depth - 1):
                close_at = len(self.stack) - depth + 1
                break
        live = any(f[2].live for f in self.stack) or (not self.stack and self.root.live)
        return fires_now, close_at, live

    def _unique_parent(self, depth: int) -> bool:
        """The container at stack index depth - 1 is an array whose items are checked for duplicates."""
        return depth > 0 and not self.stack[depth - 1][0] and self.stack[depth - 1][2].unique_items

    def open_scalar_checked(self) -> bool:
        """A number or literal is open and its end is checked (its location, or duplicates)."""
        if self.mode != 2:
            return False
        parent = self.stack[-1] if self.stack else None
        return self.value_loc.checked or (parent is not None and not parent[0] and parent[2].unique_items)

    @staticmethod
    def _text(start: int, end: int, buf: bytes | bytearray, data: bytes, base: int) -> bytes:
        """Bytes [start, end) of buf + data (data begins at offset base)."""
        if start >= base:
            return data[start - base : end - base]
        return bytes(buf[start:]) + data[: end - base]

    def _complete(
        self, loc: Location, start: int, end: int, buf: bytes | bytearray, data: bytes, base: int
    ) -> bool:
        top = self.stack[-1] if self.stack else None
        unique = top is not None and not top[0] and top[2].unique_items
        text = self._text(start, end, buf, data, base) if loc.checked or unique else b""
        if top is None:
            self.done = True
        elif unique:
            self.stack[-1] = (*top[:6], (*top[6], text))
        return self._verdict(loc, text, top)

    @staticmethod
    def _verdict(loc: Location, text: bytes, top: Frame | None) -> bool:
        """Whether a value completing at loc (its JSON text; only read when checked) passes its
        location's checks and, inside an array with uniqueItems checked, the items before it."""
        if loc.checked and not loc.check_value(text):
            return False
        return top is None or top[0] or not top[2].unique_items or top[2].check_unique(top[6], text)

    def string_end_verdict(self, head: bytes, buf: bytes | bytearray) -> bool:
        """What feed(head + '"' + tail, buf) returns, without changing this reader, for bytes that
        close the open string (a value or a key) after head and complete no value in tail. The
        caller checks their shape (no backslash in head; nothing in tail that can complete a value)."""
        assert self.mode == 1 and not self.escape
        base = self.offset
        text = self._text(self.value_start, base + len(head) + 1, buf, head + b'"', base)
        if self.is_key:
            return self._key_verdict(text)
        return self._verdict(self.value_loc, text, self.stack[-1] if self.stack else None)

    def _key_verdict(self, text: bytes) -> bool:
        """Whether the object key (its JSON text) passes the innermost object's key checks."""
        location = self.stack[-1][2]
        return not location.checks_keys or location.check_key(text)

    def _end_string(self, buf: bytes | bytearray, data: bytes, base: int) -> bool:
        self.mode = 0
        end = self.offset + 1
        if self.is_key:
            text = self._text(self.value_start, end, buf, data, base)
            top = self.stack[-1]
            self.stack[-1] = (top[0], top[1], top[2], json.loads(text), top[4], False, top[6])
            return self._key_verdict(text)
        return self._complete(self.value_loc, self.value_start, end, buf, data, base)

    def _open_value(self) -> Location:
        if not self.stack:
            return self.root
        is_obj, start, loc, key, count = self.stack[-1][:5]
        if is_obj:
            return loc.child(key)
        self.stack[-1] = (is_obj, start, loc, key, count + 1, False, self.stack[-1][6])
        return loc.child(count)

    def _structural(self, b: int, buf: bytes | bytearray, data: bytes, base: int) -> bool:
        if b in _WS or b == 0x3A:  # whitespace, ':'
            return True
        if b == 0x2C:  # ',': an object expects its next key
            if self.stack and self.stack[-1][0]:
                top = self.stack[-1]
                self.stack[-1] = (*top[:5], True, top[6])
            return True
        if b in b"{[":
            loc = self._open_value()
            self.stack.append((b == 0x7B, self.offset, loc, "", 0, b == 0x7B, ()))
            return True
        if b in b"}]":
            frame = self.stack.pop()
            return self._complete(frame[2], frame[1], self.offset + 1, buf, data, base)
        self.value_start = self.offset
        if b == 0x22 and self.stack and self.stack[-1][0] and self.stack[-1][5]:
            self.mode, self.is_key, self.escape = 1, True, False
            return True
        self.value_loc = self._open_value()
        self.mode, self.is_key, self.escape = (1 if b == 0x22 else 2), False, False
        return True
