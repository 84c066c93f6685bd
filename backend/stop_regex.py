"""Stop regexes (SGLang's `stop_regex`): a request's patterns, searched in its decoded output after
each token. What it owns: compiling and checking the patterns, and each pattern's scan start.
What it promises: a match is found at the first step whose text contains it (leftmost start
first); each step searches only from where a match could still begin (the start of the previous
step's partial match, found with the `regex` module's partial matching), so `hold_from` bounds
the text that may be streamed without streaming the start of a match later tokens complete; a
search that runs past SEARCH_TIMEOUT_S raises StopRegexTimeout instead of stalling the step."""

from __future__ import annotations

from typing import Any

import regex

MAX_STOP_REGEXES = 16
MAX_STOP_REGEX_CHARS = 1000
# The search runs on the scheduler thread, between two forward passes of every running request:
# a pattern that backtracks for longer than this ends its own request rather than stall the batch.
SEARCH_TIMEOUT_S = 0.05


class StopRegexTimeout(Exception):
    """A stop regex took longer than SEARCH_TIMEOUT_S to search a request's output."""


def compile_stop_regex(pattern: str) -> regex.Pattern[str]:
    """The compiled pattern, or ValueError saying why it cannot be a stop regex."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("stop_regex must be a non-empty string or a list of non-empty strings")
    if len(pattern) > MAX_STOP_REGEX_CHARS:
        raise ValueError(f"a stop_regex pattern is limited to {MAX_STOP_REGEX_CHARS} characters")
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from e
    if compiled.search("") is not None:
        raise ValueError(
            f"stop_regex {pattern!r} matches the empty string, so it would stop before any output"
        )
    return compiled


def check_stop_regexes(name: str, value: Any) -> None:
    """The sampling-parameter check: a list of at most MAX_STOP_REGEXES valid patterns."""
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings")
    if len(value) > MAX_STOP_REGEXES:
        raise ValueError(f"{name} takes at most {MAX_STOP_REGEXES} patterns, got {len(value)}")
    for pattern in value:
        compile_stop_regex(pattern)


class StopRegexScan:
    """One request's stop regexes and, for each, the first text position a match may start at."""

    def __init__(self, patterns: list[str]) -> None:
        self._patterns = [compile_stop_regex(p) for p in patterns]
        self._scan_from = [0] * len(self._patterns)

    def skip_to(self, end: int) -> None:
        """No match may start before `end` (the text of the first min_new_tokens tokens)."""
        self._scan_from = [max(start, end) for start in self._scan_from]

    def search(self, text: str) -> tuple[int, str] | None:
        """(start, pattern) of the leftmost match in `text`, or None, moving each pattern's scan
        start to its partial match at the end of `text` (or past the text when there is none)."""
        hits = []
        for i, pattern in enumerate(self._patterns):
            start = self._scan_from[i]
            try:
                found = pattern.search(text, start, timeout=SEARCH_TIMEOUT_S)
                partial = (
                    None if found else pattern.search(text, start, partial=True, timeout=SEARCH_TIMEOUT_S)
                )
            except TimeoutError as e:
                raise StopRegexTimeout(
                    f"stop_regex {pattern.pattern!r} took over {SEARCH_TIMEOUT_S * 1000:.0f} ms to search "
                    "the output; simplify the pattern"
                ) from e
            if found is not None:
                hits.append((found.start(), pattern.pattern))
            else:
                self._scan_from[i] = partial.start() if partial is not None else len(text)
        return min(hits) if hits else None

    def hold_from(self, text_len: int) -> int:
        """Text from here on may still begin a match: it is held back from a stream."""
        return min(self._scan_from, default=text_len)
