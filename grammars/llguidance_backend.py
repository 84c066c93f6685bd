"""llguidance adapter: JSON schemas (and regex / Lark) compiled by llguidance behind our GrammarMatcher
interface. Promises: a token the grammar forbids is refused without changing state; rollback counts
accept_token/accept_string steps; compile errors and over-budget compiles become ValueError."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance as llg
import llguidance.hf
import torch

from .schema_false_refs import refs_to_false, unsatisfiable_pointer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# The whitespace policy of every JSON grammar we build: the compact form with one space after each
# separator, like xgrammar's any_whitespace=False, and no whitespace anywhere else, so a small model
# can never loop on blanks.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_GRAMMAR_SIZE = 2_000_000
MAX_FALSE_REFS = 8  # unsatisfiable definitions rewritten to `false` before a schema is refused


def stop_mask(vocab_size: int, stop_token_ids: list[int]) -> torch.Tensor:
    """One bitmask row (int32 [ceil(V/32)]) that allows exactly the stop tokens."""
    words = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.bool)
    words[stop_token_ids] = True
    packed = (words.view(-1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


class LLGuidanceCompiled:
    engine = "llguidance"

    def __init__(self, grammar: str, compiler: LLGuidanceCompiler, dropped: list[str] | None = None) -> None:
        self.grammar = grammar
        self.compiler = compiler
        self.dropped_keywords = list(dropped or [])
        self._template = llg.LLMatcher(compiler.tokenizer, grammar, log_level=0, limits=compiler.limits)
        if self._template.is_error():
            err = self._template.get_error()
            if "Unsatisfiable" in err:
                raise ValueError(f"invalid JSON schema: it matches nothing ({err})")
            raise ValueError(f"invalid grammar: {err}")

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self.compiler)


class LLGuidanceMatcher:
    """A stop token ends the match (llguidance itself may stop earlier, when nothing can follow);
    after the end the mask allows only the stop tokens, as the other engines do."""

    EOS_STEP = -1  # a step entry that consumed no llguidance token: the stop token

    def __init__(self, matcher: llg.LLMatcher, compiler: LLGuidanceCompiler) -> None:
        self._m = matcher
        self._c = compiler
        self._steps: list[int] = []  # tokens consumed by each accept step, for rollback
        self._ended = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._ended or self._m.is_stopped():
            if self._ended or self._m.is_accepting():
                bitmask[row].copy_(self._c.eos_mask)
            else:
                bitmask[row].zero_()
            return
        target = bitmask[row]
        assert target.is_contiguous() and target.dtype == torch.int32 and not target.is_cuda
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)

    def parallel_mask_matcher(self) -> llg.LLMatcher | None:
        """The llguidance matcher whose mask fill_next_token_bitmask would compute, for a batched
        fill (grammars/masking.py); None where the row is the stop-token row or all zeros."""
        return None if self._ended or self._m.is_stopped() else self._m

    def accept_token(self, token_id: int) -> bool:
        tok = int(token_id)
        if self._ended:
            return False
        if tok in self._c.stop_token_ids:
            if not self._m.is_accepting():
                return False
            self._ended = True
            self._steps.append(self.EOS_STEP)
            return True
        if self._m.is_stopped() or self._m.validate_tokens([tok]) != 1 or not self._m.consume_token(tok):
            return False
        self._steps.append(1)
        return True

    def accept_string(self, text: str) -> bool:
        ids = self._c.tokenizer.tokenize_str(text)
        if self._ended or not ids or self._m.validate_tokens(ids) != len(ids):
            return False
        if not self._m.consume_tokens(ids):
            return False
        self._steps.append(len(ids))
        return True

    def is_accepting(self) -> bool:
        """Whether the text so far is a complete match (a stop token may come now)."""
        return self._ended or self._m.is_accepting()

    def find_jump_forward_string(self) -> str:
        if self._ended or self._m.is_stopped():
            return ""
        data = self._m.compute_ff_bytes()
        for cut in range(len(data), max(len(data) - 4, -1), -1):  # drop a partial UTF-8 character
            try:
                return data[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""

    def is_terminated(self) -> bool:
        return self._ended

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        undone = self._steps[-num_tokens:]
        del self._steps[-num_tokens:]
        if self.EOS_STEP in undone:
            self._ended = False
        n = sum(k for k in undone if k > 0)
        if n:
            self._m.rollback(n)

    def reset(self) -> None:
        self._m.reset()
        self._steps.clear()
        self._ended = False


class LLGuidanceCompiler:
    """One llguidance tokenizer (built once, ~0.5 s) shared by every grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        # llguidance only knows ids of the tokenizer's own vocabulary; stop ids beyond it (a model
        # whose config names an EOS its tokenizer lacks) are handled here, through eos_mask
        known = [t for t in stop_token_ids if t < len(tokenizer)] or [tokenizer.eos_token_id]
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=known)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.eos_mask = stop_mask(vocab_size, self.stop_token_ids)
        self.limits = llg.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SIZE)
        self._any_json: LLGuidanceCompiled | None = None

    def any_json(self) -> LLGuidanceCompiled:
        """Any JSON value in the whitespace policy, compiled once."""
        if self._any_json is None:
            self._any_json = self.compile("json", "")
        return self._any_json

    def compile(
        self, kind: str, spec: str, dropped: list[str] | None = None, coerce_one_of: bool = False
    ) -> LLGuidanceCompiled:
        """coerce_one_of: a oneOf llguidance cannot prove exclusive is enforced as anyOf."""
        if kind == "json_schema":
            options: JsonCompileOptions = {**JSON_OPTIONS, "coerce_one_of": coerce_one_of}
            for _ in range(MAX_FALSE_REFS):
                try:
                    grammar = llg.LLMatcher.grammar_from_json_schema(spec, overrides=options)
                    return LLGuidanceCompiled(grammar, self, dropped)
                except ValueError as e:
                    where = unsatisfiable_pointer(str(e))
                    rewritten = refs_to_false(spec, *where) if where else None
                    if rewritten is None:
                        raise
                    spec = rewritten
            raise ValueError(f"invalid JSON schema: over {MAX_FALSE_REFS} definitions match nothing")
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps({}), overrides=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "ebnf":
            grammar = llg.LLMatcher.grammar_from_lark(spec)
        else:
            raise ValueError(f"unknown grammar kind {kind!r}")
        return LLGuidanceCompiled(grammar, self, dropped)

    def json_schema_error(self, schema: dict[str, Any]) -> str:
        """llguidance's reason for refusing the schema ('' if it compiles), without building a matcher."""
        grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer, limits=self.limits
        )
        return msgs[0] if is_error and msgs else ""
