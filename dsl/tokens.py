"""Token bookkeeping for program states. Appended text stays pending until the next model
call needs ids; then the pending text (everything since the last model output) is tokenized
as one piece — the safe boundary is the end of the last model output, so constants join as
`apply_chat_template` would and the tokens the model saw or produced are never re-tokenized.
A generation's (text, output_ids) is reconciled so the state's ids always decode to its text."""

from __future__ import annotations

from typing import Any


class TokenCodec:
    """Wraps an HF tokenizer. `encode` never adds BOS/EOS; special-token text such as
    `<|im_start|>` becomes its special id (as `apply_chat_template(tokenize=True)` does)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        # SentencePiece tokenizers prepend "▁" to a standalone piece; detect it once.
        probe = "x"
        self._adds_prefix_space = self.decode(self._raw_encode(probe)) != probe
        self._anchor = self._raw_encode("\n") if self._adds_prefix_space else []

    def _raw_encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        """Tokens of `text` as a continuation (tokenized on its own, no special tokens added)."""
        if not text:
            return []
        if not self._adds_prefix_space:
            return self._raw_encode(text)
        ids = self._raw_encode("\n" + text)
        n = len(self._anchor)
        if ids[:n] == self._anchor and self.decode(ids[n:]) == text:
            return ids[n:]
        return self._raw_encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_each(self, ids: list[int]) -> list[str]:
        """Each token's own text (one tokenizer call)."""
        return list(self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False))

    def consistent_prefix(self, ids: list[int], text: str) -> tuple[int, str]:
        """Longest k such that decode(ids[:k]) is a prefix of `text`; returns (k, decoded).

        A generation's ids may run past its text (a trimmed stop string, an EOS that the
        text skips, a stop inside a token): those tail tokens are dropped and the rest of
        the text is tokenized afresh, so ids and text agree."""
        decoded = self.decode(ids)
        if decoded == text:
            return len(ids), decoded
        for k in range(len(ids) - 1, -1, -1):
            decoded = self.decode(ids[:k])
            if text.startswith(decoded) and not decoded.endswith("\ufffd"):
                return k, decoded
        return 0, ""
