"""JSON-schema grammars whose mask writes what a small model should write (declared property order, no
undeclared properties, bounded integers) while acceptance follows the schema's semantics.
Promises: every token sequence the mask allows is accepted; a document is accepted (EOS terminates)
exactly when it is valid against the prepared schema, in any property order, extra keys where allowed."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance as llg

from .base import allocate_token_bitmask
from .guard_mask import TokenFeatures, allowed_ids, prune_open_scalars, refine_mask, token_features
from .json_tracker import JsonTracker
from .llguidance_backend import LLGuidanceCompiled, LLGuidanceCompiler, LLGuidanceMatcher
from .schema_formats import format_checker
from .schema_guard import GuardPlan, verdict_validator
from .schema_policy import locate
from .xgrammar_backend import XGrammarCompiled, XGrammarMatcher, XGrammarRows

ModeGrammar = LLGuidanceCompiled | XGrammarCompiled
ModeMatcher = LLGuidanceMatcher | XGrammarMatcher


def _checked_ids(full: Any, checked: list[str]) -> dict[int, set[str]]:
    """id(schema object) -> keywords, from names 'keyword at #/pointer (why)'; a name whose object
    cannot be found is checked at the root, where the whole document is validated."""
    out: dict[int, set[str]] = {}
    for name in checked:
        keyword, node = locate(name, full)
        out.setdefault(id(node if isinstance(node, dict) else full), set()).add(keyword)
    return out


def _features(compiler: LLGuidanceCompiler) -> TokenFeatures:
    """The vocabulary's token features, computed once per compiler."""
    cached: TokenFeatures | None = getattr(compiler, "_guard_features", None)
    if cached is None:
        cached = token_features(
            [_token_bytes(compiler, i) for i in range(compiler.vocab_size)], compiler.stop_token_ids
        )
        compiler._guard_features = cached  # type: ignore[attr-defined]
    return cached


def _token_bytes(compiler: LLGuidanceCompiler, token: int) -> bytes:
    """A token's bytes; b'' for ids the tokenizer does not have (a model's padded vocabulary)."""
    try:
        return bytes(compiler.tokenizer.decode_bytes([token]))
    except (ValueError, IndexError, OverflowError):
        return b""


class SchemaGrammar:
    """Three ways to read a document, tried in order: the generation grammar (the mask while it can
    follow), the schema's own grammar (declared order, extra properties where allowed), then any JSON
    with the prepared schema checked by jsonschema at EOS (property orders llguidance cannot express).
    Keywords in checked_keywords are left out of the grammars and held by value checks (schema_guard)
    against full, the schema with them. The generation grammar may come compiled by xgrammar, where
    it holds the generation schema exactly (schema_exact): its masks cost microseconds."""

    engine = "llguidance"

    def __init__(
        self,
        compiler: LLGuidanceCompiler,
        schema: Any,
        generation: Any,
        dropped: list[str],
        coerce_one_of: bool = False,
        full: Any = None,
        checked: list[str] | None = None,
        generation_grammar: XGrammarCompiled | None = None,
    ) -> None:
        """generation_grammar: the generation schema already compiled (used instead of llguidance's)."""
        self.compiler = compiler
        self.schema = schema
        self.full = schema if full is None else full
        self.dropped_keywords = list(dropped)
        self.checked_keywords = list(checked or [])
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
        preferred: ModeGrammar | None = language
        if generation_grammar is not None:
            preferred = generation_grammar
        elif gen_text != text:
            try:
                preferred = compiler.compile("json_schema", gen_text, dropped, coerce_one_of)
            except ValueError:
                preferred = language  # e.g. an integer whose bounds lie beyond 16 digits
        if preferred is None:
            raise error or ValueError("invalid grammar")
        self.mask_engine = preferred.engine  # which engine fills the masks while generation follows
        self.modes: list[ModeGrammar] = [preferred]
        if language is not None and language is not preferred:
            self.modes.append(language)
        self.modes.append(compiler.any_json())
        self._validator: Any = None
        self.plan: GuardPlan | None = None
        self.features: TokenFeatures | None = None
        if self.checked_keywords:
            self.plan = GuardPlan(self.full, _checked_ids(self.full, self.checked_keywords), self.validator())
            self.features = _features(compiler)

    def new_matcher(self) -> SchemaMatcher:
        return SchemaMatcher(self)

    def validator(self) -> Any:
        """jsonschema's validator of the full schema (formats checked), for verdicts only."""
        if self._validator is None:
            cls = jsonschema.validators.validator_for(self.full, default=jsonschema.Draft202012Validator)
            self._validator = verdict_validator(cls)(self.full, format_checker=format_checker())
        return self._validator

    def is_valid(self, data: Any) -> bool:
        return bool(self.validator().is_valid(data))


class SchemaMatcher:
    """Follows the first mode that accepts everything so far; a step the current mode refuses replays
    the steps into the next mode. Rollback counts the same steps whatever the mode, and undoing the
    step that moved to a wider mode returns to the narrower one (a speculative draft walk accepts
    and rolls back tokens the generation mask forbids; its mode must not outlive the walk)."""

    def __init__(self, grammar: SchemaGrammar) -> None:
        self._g = grammar
        self._mode = 0
        self._m: ModeMatcher = grammar.modes[0].new_matcher()
        self._steps: list[int | str] = []  # one per accept step: a token id or an accepted string
        # per move to a wider mode: the steps before the one that moved, the mode and matcher left
        self._narrower: list[tuple[int, int, ModeMatcher]] = []
        # value checks (schema_guard): the reader of the bytes so far, and its state before each step
        self._tracker = JsonTracker(grammar.plan.root) if grammar.plan is not None else None
        self._buf = bytearray()
        self._before: list[tuple[JsonTracker, int]] = []

    def _checked(self, step: int | str, data: bytes) -> JsonTracker | None:
        """The reader after step (its bytes: data), or None when a value check refuses what it completes."""
        assert self._tracker is not None
        after = self._tracker.copy()
        if isinstance(step, int) and step in self._g.compiler.stop_token_ids:
            return after if after.finish(self._buf) else None
        return after if after.feed(data, self._buf) else None

    def _last_mode(self, mode: int) -> bool:
        return mode == len(self._g.modes) - 1

    def _text(self) -> str:
        tok = self._g.compiler.tokenizer
        parts = [s.encode() if isinstance(s, str) else tok.decode_bytes([s]) for s in self._steps]
        return b"".join(parts).decode("utf-8", errors="replace")

    def _step(self, m: ModeMatcher, step: int | str, mode: int) -> bool:
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
        if self._tracker is None:
            return self._advance_grammar(step)
        data = self._step_bytes(step)
        after = self._checked(step, data)
        if after is None or not self._advance_grammar(step):
            return False
        self._before.append((self._tracker, len(self._buf)))
        self._buf.extend(data)
        self._tracker = after
        return True

    def _step_bytes(self, step: int | str) -> bytes:
        if isinstance(step, str):
            return step.encode()
        if step in self._g.compiler.stop_token_ids:
            return b""
        features = self._g.features
        if features is not None and 0 <= step < len(features.token_bytes):
            return features.token_bytes[step]  # decoded once per vocabulary
        return _token_bytes(self._g.compiler, step)

    def _advance_grammar(self, step: int | str) -> bool:
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
                self._narrower.append((len(self._steps), self._mode, self._m))
                self._m, self._mode = m, mode
                self._steps.append(step)
                return True
        return False

    def fill_next_token_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._tracker is not None and self._g.features is not None:
            refine_mask(bitmask[row], self._tracker, self._buf, self._g.features)
            prune_open_scalars(bitmask[row], self._tracker, self._buf, self._g.features, self._allowed_after)

    def _allowed_after(self, token: int) -> Any:
        """The ids the current grammar allows after token (the matcher is left as it was)."""
        if not self._m.accept_token(token):
            return []
        probe = allocate_token_bitmask(1, self._g.compiler.vocab_size)
        self._m.fill_next_token_bitmask(probe, 0)
        self._m.rollback(1)
        return allowed_ids(probe[0], self._g.compiler.vocab_size)

    def parallel_mask_matcher(self) -> llg.LLMatcher | XGrammarRows | None:
        """The engine matcher for a batched fill (grammars/masking.py); None while a value check
        may refine the mask (the row is then filled on its own)."""
        if self._tracker is not None and self._tracker.live_depth() >= 0:
            return None
        return self._m.parallel_mask_matcher()

    def accept_token(self, token_id: int) -> bool:
        return self._advance(int(token_id))

    def accept_string(self, text: str) -> bool:
        return bool(text) and self._advance(text)

    def find_jump_forward_string(self) -> str:
        return self._m.find_jump_forward_string()

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def is_accepting(self) -> bool:
        """The grammar's verdict (a value check may still refuse the document's end)."""
        return self._m.is_accepting()

    @property
    def mode(self) -> str:
        """Which reading holds: 'generation', 'schema' or 'json+check'."""
        if self._mode == 0:
            return "generation"
        return "json+check" if self._last_mode(self._mode) else "schema"

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        kept = max(len(self._steps) - num_tokens, 0)
        del self._steps[kept:]
        left: tuple[int, int, ModeMatcher] | None = None
        while self._narrower and self._narrower[-1][0] >= kept:
            left = self._narrower.pop()  # the step that moved to a wider mode is undone
        if left is None:
            self._m.rollback(num_tokens)
        else:
            at, self._mode, self._m = left
            self._m.rollback(at - kept)  # that matcher stopped at the step it refused
        if self._tracker is not None:
            self._tracker, size = self._before[-num_tokens]
            del self._before[-num_tokens:]
            del self._buf[size:]

    def reset(self) -> None:
        self._mode = 0
        self._m = self._g.modes[0].new_matcher()
        self._steps.clear()
        self._narrower.clear()
        if self._g.plan is not None:
            self._tracker = JsonTracker(self._g.plan.root)
            self._buf.clear()
            self._before.clear()
