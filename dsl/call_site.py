"""Where a program expression came from: the innermost frame outside radixlm's own code, kept
so an error raised later on a worker thread names the program line that added the expression."""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
from dataclasses import dataclass
from types import FrameType

_DSL_DIR = os.path.dirname(os.path.abspath(__file__))
_SKIP_FILES = {os.path.abspath(contextlib.__file__)}


@dataclass(frozen=True)
class CallSite:
    filename: str
    lineno: int
    function: str

    def describe(self) -> str:
        line = linecache.getline(self.filename, self.lineno).strip()
        return f'File "{self.filename}", line {self.lineno}, in {self.function}: {line}'


@functools.lru_cache(maxsize=4096)
def _program_file(co_filename: str) -> str | None:
    """The absolute path of a code object's file, or None when it is radixlm's own code.
    Memoized: every `s += ...` walks a few frames, and abspath is most of the walk's cost."""
    name = os.path.abspath(co_filename)
    if name.startswith(_DSL_DIR + os.sep) or name in _SKIP_FILES:
        return None
    return name


def call_site() -> CallSite | None:
    """The innermost frame outside radixlm's own code (the program line)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        name = _program_file(f.f_code.co_filename)
        if name is not None:
            return CallSite(name, f.f_lineno, f.f_code.co_name)
        f = f.f_back
    return None
