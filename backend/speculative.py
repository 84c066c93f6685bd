"""Speculator: speculative decoding inside the scheduler. Asks the proposer for each decoding
request's drafts (capped by max_new_tokens, the context, and its grammar: drafts stop before a
token the grammar forbids or a point where it would jump forward), lets the policy trim them,
verifies a step's drafts from its logits, and frees the KV slots of rejected drafts (a step the
policy has backed off from asks the proposer nothing and runs as plain decode). Promises:
what a request emits is what plain decoding would emit (greedy) or a sample of the same
distribution (T > 0); a verify step (its tokens as decode rows, so the decode CUDA graphs run
it) is processed before the next step is planned (never overlapped)."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

import torch

from radixlm.grammars import allocate_token_bitmask

from .request import Req
from .sampler import Sampler
from .scheduler_config import SchedulerStats, SpeculativeConfig
from .speculative_policy import SpecPolicy
from .speculative_proposer import NgramProposer, Proposer
from .speculative_verify import Verdict, verify


@dataclass
class DraftPlan:
    """A step's drafts by decode item, and the grammar masks of each draft position."""

    drafts: list[list[int]]
    masks: list[list[torch.Tensor] | None] = field(default_factory=list)


class Speculator:
    def __init__(
        self,
        cfg: SpeculativeConfig,
        sampler: Sampler,
        stats: SchedulerStats,
        context_len: int,
        fast_rows: int | None = None,
    ) -> None:
        self.cfg = cfg
        self.sampler = sampler
        self.stats = stats
        self.context_len = context_len
        self.proposers: dict[str, Proposer] = {"ngram": NgramProposer()}  # by algorithm
        self.policy = SpecPolicy(adaptive=cfg.policy == "auto", fast_rows=fast_rows)

    # ---- which requests speculate ------------------------------------------------------
    def algorithm(self, req: Req) -> str | None:
        """The request's proposer name (None: it does not speculate)."""
        algorithm = req.params.speculative_algorithm or self.cfg.algorithm
        return algorithm if algorithm in self.proposers else None

    def budget(self, req: Req, last_token_known: bool = True) -> int:
        """Most drafts worth verifying for req now (0: it decodes plainly). Drafts follow the
        last token, so a request whose last token is still in flight does not speculate."""
        p = req.params
        algorithm = self.algorithm(req)
        if algorithm is None or not last_token_known:
            return 0
        k = p.speculative_num_draft_tokens or self.cfg.draft_tokens(algorithm)
        room_out = p.max_new_tokens - len(req.output_ids) - 1  # a+1 tokens come out of a drafts
        room_ctx = self.context_len - req.seq_len - 1
        return max(min(k, room_out, room_ctx), 0)

    def wants_settled(self, reqs: list[Req]) -> bool:
        """True when the next step will likely speculate for one of reqs (drafts need their last
        tokens, so an overlapped step must be processed first)."""
        n = sum(1 for r in reqs if self._enabled(r))
        return n > 0 and self.policy.expects_speculation(len(reqs))

    def _enabled(self, req: Req) -> bool:
        return self.algorithm(req) is not None

    # ---- planning ---------------------------------------------------------------------
    def draft(self, batch: list[Req], in_flight: Container[int] = frozenset()) -> DraftPlan | None:
        """Drafts for a decode batch (None: nobody speculates this step); in_flight: id() of the
        requests whose last token is not on the host yet. While the policy has backed off, the
        proposer is not asked at all: the step is plain decode at no extra cost."""
        budgets = [
            k if (k := self.budget(req, id(req) not in in_flight)) > 0 and not self.policy.paused(req) else 0
            for req in batch
        ]
        if not any(budgets) or not self.policy.worth_proposing(batch, budgets):
            return None
        proposals = self._propose_all(batch, budgets, self.policy.proposal_limit(len(batch)))
        self.policy.proposals_found(any(proposals))
        if not any(proposals):
            return None
        proposals = self.policy.choose(batch, proposals)
        masks: list[list[torch.Tensor] | None] = []
        for i, req in enumerate(batch):
            if req.grammar is not None and proposals[i]:
                proposals[i], m = self._walk_grammar(req, proposals[i])
                masks.append(m)
            else:
                masks.append(None)
        return DraftPlan(proposals, masks) if any(proposals) else None

    def _propose_all(self, batch: list[Req], budgets: list[int], limit: int | None = None) -> list[list[int]]:
        """Each request's proposal from its algorithm's proposer; a proposer with propose_batch
        (a draft model) answers all of its requests in one call. With a limit, requests are asked
        in order until that many drafts are found (a batch proposer is given the first `limit`)."""
        out: list[list[int]] = [[] for _ in batch]
        by_algorithm: dict[str, list[int]] = {}
        for i, (req, k) in enumerate(zip(batch, budgets)):
            algorithm = self.algorithm(req) if k else None
            if algorithm is not None:
                by_algorithm.setdefault(algorithm, []).append(i)
        found_total = 0
        for algorithm, rows in by_algorithm.items():
            if limit is not None and found_total >= limit:
                break
            proposer = self.proposers[algorithm]
            together = getattr(proposer, "propose_batch", None)
            if together is not None:
                rows = rows if limit is None else rows[:limit]
                for i, proposal in zip(rows, together([batch[i] for i in rows], [budgets[i] for i in rows])):
                    out[i] = proposal
                    found_total += len(proposal)
                continue
            for i in rows:
                out[i] = proposer.propose(batch[i], budgets[i])
                found_total += len(out[i])
                if limit is not None and found_total >= limit:
                    break
        return out

    def _walk_grammar(self, req: Req, drafts: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """Cut drafts where the mask forbids one, or where, after one, it would terminate or
        jump forward (plain decoding would append forced tokens there); the masks of the rows
        kept. The matcher is left as it was."""
        grammar = req.grammar
        matcher = getattr(grammar, "matcher", None)
        assert grammar is not None and matcher is not None, "grammar resolved before scheduling"
        vocab = self.sampler.vocab_size
        masks: list[torch.Tensor] = []
        accepted = 0
        kept = len(drafts)
        for j, tok in enumerate(drafts):
            bits = allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(bits, 0)
            masks.append(bits)
            # a draft outside the mask is refused here, not by the matcher: a schema matcher would
            # accept it in a wider reading, and verification rejects it anyway
            if not int(bits[0, tok >> 5]) >> (tok & 31) & 1 or not matcher.accept_token(tok):
                kept = j
                break
            accepted += 1
            if matcher.is_terminated() or (grammar.jump_forward and matcher.find_jump_forward_string()):
                kept = j  # d_j may still be the step's own token: plain decoding then jumps after it
                break
        if kept == len(drafts):
            bits = allocate_token_bitmask(1, vocab)
            matcher.fill_next_token_bitmask(bits, 0)
            masks.append(bits)
        if accepted:
            matcher.rollback(accepted)
        return drafts[:kept], masks[: kept + 1]

    # ---- verification -----------------------------------------------------------------
    def verify(
        self,
        logits: torch.Tensor,
        reqs: list[Req],
        drafts: list[list[int]],
        masks: list[list[torch.Tensor] | None],
    ) -> list[Verdict]:
        verdicts = verify(self.sampler, logits, reqs, drafts, masks)
        ex = self.stats.extra
        with_drafts = [(d, v) for d, v in zip(drafts, verdicts) if d]
        ex["spec_verify_steps"] = ex.get("spec_verify_steps", 0) + 1
        ex["spec_verify_requests"] = ex.get("spec_verify_requests", 0) + len(with_drafts)
        ex["spec_draft_tokens"] = ex.get("spec_draft_tokens", 0) + sum(len(d) for d, _ in with_drafts)
        ex["spec_accepted_tokens"] = ex.get("spec_accepted_tokens", 0) + sum(
            v.accepted for _, v in with_drafts
        )
        return verdicts

    def observe(self, req: Req, drafted: int, accepted: int) -> None:
        if drafted:
            self.policy.observe(req, drafted, accepted)

    def record_step(self, verify_step: bool, batch: int, drafts: int, seconds: float) -> None:
        """A decode-only step's wall time (plain, or verifying drafts)."""
        self.policy.record(verify_step, batch, drafts, seconds)

    def finished(self, req: Req) -> None:
        for proposer in self.proposers.values():
            proposer.observe_finished(req)


def acceptance_length(extra: dict[str, int]) -> float:
    """Tokens a request gained per verify step on average (accepted drafts + its own token)."""
    n = extra.get("spec_verify_requests", 0)
    return (extra.get("spec_accepted_tokens", 0) + n) / n if n else 0.0
