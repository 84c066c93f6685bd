"""argparse types for the command lines (server, trace client): each parses its text and checks
the value, so a bad option is one line naming what it must be. No server imports: a client CLI
uses them too."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def checked(parse: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: `parse` the text, then require `ok` of the value, else say `what` it must be."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return convert


# a count or size (its default stands for 'derived'), a timeout, a memory fraction, --port (0: any)
positive_int = checked(int, lambda v: v >= 1, "a positive integer")
non_negative_int = checked(int, lambda v: v >= 0, "an integer ≥ 0")  # a size whose 0 turns it off
non_negative_float = checked(float, lambda v: v >= 0, "a number ≥ 0")  # NaN fails too
positive_seconds = checked(float, lambda v: v > 0, "a positive number of seconds")  # NaN fails too
fraction = checked(float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
port_number = checked(int, lambda v: 0 <= v <= 65535, "an integer in [0, 65535]")
