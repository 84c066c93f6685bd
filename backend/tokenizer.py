"""Tokenizer loading (real HF tokenizers and chat templates, from an HF folder or a converted
GGUF) and incremental detokenization for streaming that never splits a UTF-8 character."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .loader import resolve_model_dir


def load_tokenizer(model_path: str | Path | None = None) -> Any:
    """The HF tokenizer of a model folder or GGUF file (None = the default model)."""
    model_dir = Path(model_path) if model_path and Path(model_path).is_dir() else None
    model_dir = model_dir or resolve_model_dir(str(model_path) if model_path else None)
    if (model_dir / "tokenizer.json").exists():
        # The fast class directly: AutoTokenizer's model registry import costs seconds.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window (prefix_offset..end) and emits only text that is complete: a
    trailing U+FFFD means a multi-byte character is still split across tokens, so we wait.
    Ids outside the tokenizer (random-weight models with a larger vocab) decode as nothing."""

    tokenizer: Any
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    def _decode(self, ids: list[int]) -> str:
        n = len(self.tokenizer)
        ids = [i for i in ids if 0 <= i < n]
        text: str = self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        return text

    def text_of(self, ids: list[int]) -> str:
        """`ids` decoded on their own, with this detokenizer's options."""
        return self._decode(ids)

    def add(self, new_ids: list[int]) -> str:
        """Append ids; return the newly completed text (possibly "")."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a request: emit whatever is left, even an incomplete character."""
        full = self._decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        self.prefix_offset = self.read_offset = len(self.ids)
        return delta
