"""The scheduler's configuration (fixed limits, and switches the engine may flip between steps)
and its counters (what get_stats reports). Promises: plain data; every scheduler part shares the
same two objects, so a switch flipped on the config is seen by all of them at the next step."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cascade_cost import CascadeCostModel
from .sampling_params import MAX_DRAFT_TOKENS, check_speculative_algorithm

# Most drafts per request per step unless set. n-gram drafts cost no forward and the automatic
# policy verifies only the likeliest that pay, so the budget is generous: 7 drafts are 8 rows in a
# batch-1 verify step, the CPU block kernel's limit. Each draft-model draft costs a draft forward.
DEFAULT_DRAFT_TOKENS = {"ngram": 7, "draft": 4}


@dataclass
class SpeculativeConfig:
    """Engine-wide speculation defaults; a request may override algorithm and draft count."""

    algorithm: str | None = None  # "ngram" for requests that do not say; None: off unless asked
    num_draft_tokens: int | None = None  # most drafts verified per request per step (None: by algorithm)
    policy: str = "auto"  # "auto": back off on low acceptance or costly verify steps; "always"
    draft_model_path: str | None = None  # the draft model "draft" requests speculate with

    def __post_init__(self) -> None:
        """ValueError before any model work for a switch this build cannot honour."""
        if self.algorithm is not None:
            check_speculative_algorithm("speculative_algorithm", self.algorithm)
        if self.algorithm == "draft" and not self.draft_model_path:
            raise ValueError(
                "speculative_algorithm='draft' needs speculative_draft_model_path (the draft model)"
            )
        if self.num_draft_tokens is not None and not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"speculative_num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], got {self.num_draft_tokens}"
            )
        if self.policy not in ("auto", "always"):
            raise ValueError(f"speculative_policy must be 'auto' or 'always', got {self.policy!r}")

    def draft_tokens(self, algorithm: str) -> int:
        """The engine's most drafts per request per step for algorithm."""
        return self.num_draft_tokens or DEFAULT_DRAFT_TOKENS[algorithm]


@dataclass
class SchedulerConfig:
    context_len: int
    chunked_prefill_size: int = 2048
    max_running_requests: int = 256
    decode_reserve: int = 8  # slots per running request kept free before admitting new prompts
    overlap: bool = False  # process step t after launching step t+1
    enable_cascade: bool = False  # decode batches sharing long prefixes use cascade attention
    cascade_cost: CascadeCostModel | None = None  # measured per-step decision (None: fixed thresholds)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)


# upper edges of the engine's first-token histogram in ms (the server's latency histograms use them too)
FIRST_TOKEN_EDGES_MS = (5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 60000, 120000)


def first_token_key(edge_ms: int) -> str:
    return f"first_token_within_{edge_ms}ms"


@dataclass
class SchedulerStats:
    cached_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    generated_tokens: int = 0
    num_retractions: int = 0
    forward_passes: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Every counter back to zero, in place (the scheduler's parts hold this object)."""
        for name in ("cached_prompt_tokens", "computed_prompt_tokens", "generated_tokens"):
            setattr(self, name, 0)
        self.num_retractions = self.forward_passes = self.num_finished = self.num_aborted = 0
        self.extra.clear()

    def observe_first_token(self, seconds: float) -> None:
        """A request's first output token, `seconds` after the engine took the request: counted
        in cumulative buckets (`first_token_within_<ms>ms`), with `first_token_count` and
        `first_token_sum_us`, so a delta of two readings is the histogram of the requests between
        them."""
        extra = self.extra
        extra["first_token_count"] = extra.get("first_token_count", 0) + 1
        extra["first_token_sum_us"] = extra.get("first_token_sum_us", 0) + int(seconds * 1e6)
        for edge in FIRST_TOKEN_EDGES_MS:
            if seconds * 1000 <= edge:
                key = first_token_key(edge)
                extra[key] = extra.get(key, 0) + 1
