"""Choice-scoring methods for `select`: given each choice's own token logprobs (conditioned
on the program's prefix, and optionally unconditioned), pick one choice and report the
meta info SGLang reports. Pure functions on lists: no model, no backend."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# A logprob entry as the engine returns it: (logprob, token_id, text-or-None); an OpenAI-compatible
# server gives text only, so its entries carry no token id.
LogprobEntry = tuple[float | None, int | None, Any]


@dataclass
class ChoicesDecision:
    decision: str
    meta_info: dict[str, Any]


def _values(entries: list[LogprobEntry], first_none_as: float | None = None) -> list[float]:
    out = []
    for i, e in enumerate(entries):
        lp = e[0]
        if lp is None:
            if i == 0 and first_none_as is not None:
                lp = first_none_as
            else:
                raise ValueError(f"missing logprob at position {i} of a choice")
        out.append(float(lp))
    return out


def _mean(xs: list[float]) -> float:
    if not xs:
        raise ValueError("a choice must have at least one token")
    return sum(xs) / len(xs)


def _argmax_first(xs: list[float]) -> int:
    return max(range(len(xs)), key=lambda i: (xs[i], -i))


def normalized_logprobs(input_token_logprobs: list[list[LogprobEntry]]) -> list[float]:
    """Mean logprob of each choice's tokens (SGLang's normalized_prompt_logprobs)."""
    return [_mean(_values(entries)) for entries in input_token_logprobs]


class ChoicesSamplingMethod:
    """Base: subclasses implement `decide`. Instances are callables used as `choices_method`."""

    requires_unconditional_logprobs = False

    def __call__(
        self,
        *,
        choices: list[str],
        input_token_logprobs: list[list[LogprobEntry]],
        unconditional_token_logprobs: list[list[LogprobEntry]] | None = None,
        normalized_prompt_logprobs: list[float] | None = None,
        output_token_logprobs: list[list[LogprobEntry]] | None = None,
    ) -> ChoicesDecision:
        if len(choices) != len(input_token_logprobs) or not choices:
            raise ValueError("choices and input_token_logprobs must be non-empty and of equal length")
        if normalized_prompt_logprobs is None:
            normalized_prompt_logprobs = normalized_logprobs(input_token_logprobs)
        meta: dict[str, Any] = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs or [[] for _ in choices],
        }
        index = self.decide(
            input_token_logprobs, normalized_prompt_logprobs, unconditional_token_logprobs, meta
        )
        return ChoicesDecision(decision=choices[index], meta_info=meta)

    def decide(
        self,
        input_token_logprobs: list[list[LogprobEntry]],
        normalized: list[float],
        unconditional: list[list[LogprobEntry]] | None,
        meta: dict[str, Any],
    ) -> int:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class TokenLengthNormalized(ChoicesSamplingMethod):
    """Highest mean logprob over the choice's tokens (the default)."""

    def decide(self, input_token_logprobs, normalized, unconditional, meta) -> int:
        return _argmax_first(normalized)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare token by token: keep the choices with the best logprob at position j, move
    on to j+1 among the tied ones. A shorter choice is padded with its own mean logprob."""

    def decide(self, input_token_logprobs, normalized, unconditional, meta) -> int:
        rows = [_values(e) for e in input_token_logprobs]
        width = max(len(r) for r in rows)
        matrix = [r + [_mean(r)] * (width - len(r)) for r in rows]
        meta["greedy_logprob_matrix"] = matrix
        remaining = list(range(len(rows)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return remaining[0]


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """Highest mean of (conditional − unconditional) logprob per token: discounts choices
    that are likely anywhere. The unconditional first token has no context; it counts 0."""

    requires_unconditional_logprobs = True

    def decide(self, input_token_logprobs, normalized, unconditional, meta) -> int:
        if unconditional is None:
            raise ValueError("unconditional_likelihood_normalized needs unconditional token logprobs")
        scores = []
        for cond, uncond in zip(input_token_logprobs, unconditional, strict=True):
            c, u = _values(cond), _values(uncond, first_none_as=0.0)
            if len(c) != len(u):
                raise ValueError("conditional and unconditional logprobs differ in length")
            scores.append(_mean([a - b for a, b in zip(c, u)]))
        meta["unconditional_token_logprobs"] = unconditional
        meta["normalized_unconditional_prompt_logprobs"] = scores
        return _argmax_first([s if not math.isnan(s) else -math.inf for s in scores])


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()


def needs_unconditional(method: ChoicesSamplingMethod) -> bool:
    """Whether `method` asks for unconditional logprobs (False for a plain callable)."""
    return bool(getattr(method, "requires_unconditional_logprobs", False))


def call_method(
    method: ChoicesSamplingMethod,
    choices: list[str],
    input_token_logprobs: list[list[LogprobEntry]],
    unconditional_token_logprobs: list[list[LogprobEntry]] | None,
) -> ChoicesDecision:
    """`method` called as SGLang calls a choices method: all five keyword arguments (no tokens are
    generated when scoring, so each choice's output_token_logprobs is empty)."""
    return method(
        choices=choices,
        normalized_prompt_logprobs=normalized_logprobs(input_token_logprobs),
        input_token_logprobs=input_token_logprobs,
        output_token_logprobs=[[] for _ in choices],
        unconditional_token_logprobs=unconditional_token_logprobs,
    )
