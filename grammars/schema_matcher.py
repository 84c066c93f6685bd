"""JSON-schema grammars whose mask writes what a small model should write (declared property order, no
undeclared properties, bounded integers) while acceptance follows the schema's semantics.
Promises: every token sequence the mask allows is accepted; a document is accepted (EOS terminates)
exactly when it is valid against the prepared schema, in any property order, extra keys where allowed."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import llguidance as llg

from .llguidance_backend import LLGuidanceCompiled, LLGuidanceCompiler, LLGuidanceMatcher

# Formats llguidance enforces that jsonschema's checker lacks here (no optional packages installed).
_EXTRA_FORMATS = {
    "hostname": re.compile(
        r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z"
    ),
    "uri": re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:[^\s\"<>\\^`{|}]*\Z"),
    "duration": re.compile(r"P(?!\Z)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?\Z"),
}


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()
    for name, rx in _EXTRA_FORMATS.items():
        checker.checks(name)(lambda value, rx=rx: not isinstance(value, str) or bool(rx.match(value)))
    return checker


class SchemaGrammar:
    """Three ways to read a document, tried in order: the generation grammar (the mask while it can
    follow), the schema's own grammar (declared order, extra properties where allowed), then any JSON
    with the prepared schema checked by jsonschema at EOS (property orders llguidance cannot express)."""

    engine = "llguidance"

    def __init__(
        self,
        compiler: LLGuidanceCompiler,
        schema: Any,
        generation: Any,
        dropped: list[str],
        coerce_one_of: bool = False,
        fallback: Any = None,
    ) -> None:
        """fallback: a narrower generation schema, compiled only when both others are refused."""
        self.compiler = compiler
        self.schema = schema
        self.dropped_keywords = list(dropped)
        text = json.dumps(schema, ensure_ascii=False)
        gen_text = json.dumps(generation, ensure_ascii=False)
        language: LLGuidanceCompiled | None = None
        error: ValueError | None = None
        try:
            language = compiler.compile("json_schema", text, dropped, coerce_one_of)
        except ValueError as e:
            if "matches nothing" in str(e):
                raise
            error = e  # forced text is then checked as JSON + jsonschema
        preferred = language
        if gen_text != text:
            try:
                preferred = compiler.compile("json_schema", gen_text, dropped, coerce_one_of)
            except ValueError:
                preferred = language  # e.g. an integer whose bounds lie beyond 16 digits
        if preferred is None and fallback is not None:
            try:
                preferred = compiler.compile("json_schema", json.dumps(fallback), dropped, coerce_one_of)
            except ValueError:
                preferred = None
        if preferred is None:
            raise error or ValueError("invalid grammar")
        self.modes: list[LLGuidanceCompiled] = [preferred]
        if language is not None and language is not preferred:
            self.modes.append(language)
        self.modes.append(compiler.any_json())
        self._validator: Any = None

    def new_matcher(self) -> SchemaMatcher:
        return SchemaMatcher(self)

    def is_valid(self, data: Any) -> bool:
        if self._validator is None:
            cls = jsonschema.validators.validator_for(self.schema, default=jsonschema.Draft202012Validator)
            self._validator = cls(self.schema, format_checker=_format_checker())
        return bool(self._validator.is_valid(data))


class SchemaMatcher:
    """Follows the first mode that accepts everything so far; a step the current mode refuses replays
    the steps into the next mode. Rollback counts the same steps whatever the mode."""

    def __init__(self, grammar: SchemaGrammar) -> None:
        self._g = grammar
        self._mode = 0
        self._m: LLGuidanceMatcher = grammar.modes[0].new_matcher()
        self._steps: list[int | str] = []  # one per accept step: a token id or an accepted string

    def _last_mode(self, mode: int) -> bool:
        return mode == len(self._g.modes) - 1

    def _text(self) -> str:
        tok = self._g.compiler.tokenizer
        parts = [s.encode() if isinstance(s, str) else tok.decode_bytes([s]) for s in self._steps]
        return b"".join(parts).decode("utf-8", errors="replace")

    def _step(self, m: LLGuidanceMatcher, step: int | str, mode: int) -> bool:
        if isinstance(step, str):
            return m.accept_string(step)
        if self._last_mode(mode) and step in self._g.compiler.stop_token_ids and not m.is_terminated():
            try:
                data = json.loads(self._text())
            except ValueError:
                return False
            if not self._g.is_valid(data):
                return False
        return m.accept_token(step)

    def _advance(self, step: int | str) -> bool:
        if self._step(self._m, step, self._mode):
            self._steps.append(step)
            return True
        for mode in range(self._mode + 1, len(self._g.modes)):
            m = self._g.modes[mode].new_matcher()
            saved, self._steps = self._steps, []
            ok = True
            for s in saved:  # _text() in the last mode reads the steps replayed so far
                if not self._step(m, s, mode):
                    ok = False
                    break
                self._steps.append(s)
            self._steps = saved
            if ok and self._step(m, step, mode):
                self._m, self._mode = m, mode
                self._steps.append(step)
                return True
        return False

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def parallel_mask_matcher(self) -> llg.LLMatcher | None:
        return self._m.parallel_mask_matcher()

    def accept_token(self, token_id: int) -> bool:
        return self._advance(int(token_id))

    def accept_string(self, text: str) -> bool:
        return bool(text) and self._advance(text)

    def find_jump_forward_string(self) -> str:
        return self._m.find_jump_forward_string()

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    @property
    def mode(self) -> str:
        """Which reading holds: 'generation', 'schema' or 'json+check'."""
        if self._mode == 0:
            return "generation"
        return "json+check" if self._last_mode(self._mode) else "schema"

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        del self._steps[-num_tokens:]
        self._m.rollback(num_tokens)

    def reset(self) -> None:
        self._mode = 0
        self._m = self._g.modes[0].new_matcher()
        self._steps.clear()
