"""The one matcher interface the sampler/scheduler use, whichever engine compiled the grammar,
and the bitmask helpers. Promises: bitmask is int32 [B, ceil(V/32)] in xgrammar's layout (bit 1 =
allowed); apply_token_bitmask_ uses torch on CPU and the Triton kernel on CUDA, same result."""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch

GrammarKind = Literal["regex", "json_schema", "ebnf", "json"]
EngineName = Literal["fsm", "xgrammar", "auto"]


@runtime_checkable
class GrammarMatcher(Protocol):
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits for the next token into bitmask[row]."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the token is not allowed."""
        ...

    def find_jump_forward_string(self) -> str:
        """The string every valid continuation starts with ('' if nothing is forced)."""
        ...

    def accept_string(self, text: str) -> bool:
        """Advance over text as one rollback step; False (state unchanged) if not allowed."""
        ...

    def is_terminated(self) -> bool:
        """True once a stop token was accepted in an accepting state."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accept_token/accept_string steps."""
        ...


class CompiledGrammar(Protocol):
    engine: str

    def new_matcher(self) -> GrammarMatcher: ...


def allocate_token_bitmask(batch: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """All-allowed bitmask [batch, ceil(vocab_size/32)] int32 on the CPU (pinned: copied to the
    device without waiting for the stream). Filled by numpy, on the calling thread: torch would
    hand this small fill to its intra-op pool, which costs more than the fill on a busy host."""
    out = torch.empty((batch, (vocab_size + 31) // 32), dtype=torch.int32, pin_memory=pin_memory)
    out.numpy().fill(-1)
    return out


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None = None
) -> None:
    """In place: logits[i, t] = -inf where bitmask row i (or row j for logits[indices[j]]) forbids t."""
    from radixlm.kernels import bitmask as kb

    if logits.is_cuda:
        kb.apply_token_bitmask_triton_(
            logits,
            bitmask.to(logits.device, non_blocking=True),
            None if indices is None else indices.to(logits.device),
        )
    else:
        kb.apply_token_bitmask_cpu_(logits, bitmask, indices)
