"""Sampler: turns one step's logits into next tokens — logit biases, penalties (kept
incrementally per request), min-token EOS masking, grammar masks, then greedy or temperature / top-k / top-p /
min-p sampling with per-request seeds. One host sync per step: the final token list."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from radixlm.kernels.argmax import argmax_rows

from .forward_batch import to_device
from .request import Req


def apply_penalties_(
    logits: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    """In place on [N, V] logits. counts: output-token counts; seen: tokens in prompt or output;
    frequency/presence/repetition: [N] per-row penalties (0, 0, 1 = off)."""
    rep = repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalized, logits))
    logits -= frequency.unsqueeze(1) * counts
    logits -= presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def init_penalty_state(req: Req, vocab_size: int, device: torch.device) -> None:
    """Build the request's counts/seen rows once, from its prompt and outputs so far."""
    req.penalty_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    req.penalty_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    ids = [i for i in req.all_ids if 0 <= i < vocab_size]
    if ids:
        req.penalty_seen[torch.tensor(ids, device=device)] = True
    outs = [i for i in req.output_ids if 0 <= i < vocab_size]
    if outs:
        req.penalty_counts.index_add_(
            0, torch.tensor(outs, device=device), torch.ones(len(outs), device=device)
        )


def record_token(req: Req, token: int) -> None:
    """Incremental penalty update after one sampled token (never rebuilt from history)."""
    if (
        req.penalty_counts is not None
        and req.penalty_seen is not None
        and 0 <= token < req.penalty_counts.numel()
    ):
        req.penalty_counts[token] += 1
        req.penalty_seen[token] = True


def forget_token(req: Req, token: int) -> None:
    """Undo record_token for an output token that was taken back (call after removing it from
    req.output_ids): the count drops, and 'seen' stays only if the prompt or outputs still hold it."""
    if (
        req.penalty_counts is not None
        and req.penalty_seen is not None
        and 0 <= token < req.penalty_counts.numel()
    ):
        req.penalty_counts[token] -= 1
        req.penalty_seen[token] = bool(req.penalty_counts[token] > 0) or token in req.input_ids


def filter_probs(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort [N, V] probs descending and zero what top-k / top-p / min-p exclude.
    Returns (filtered sorted probs, their token ids)."""
    sorted_p, sorted_ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).unsqueeze(0)
    cum = sorted_p.cumsum(dim=-1)
    drop = (ranks >= top_k.unsqueeze(1)) | ((cum - sorted_p) > top_p.unsqueeze(1))
    drop |= sorted_p < (min_p.unsqueeze(1) * sorted_p[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    return sorted_p.masked_fill(drop, 0.0), sorted_ids


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def prepare(self, req: Req) -> None:
        """Per-request state, once at first admission."""
        if req.params.has_penalties and req.penalty_counts is None:
            init_penalty_state(req, self.vocab_size, self.device)
        if req.params.seed is not None and req.rng is None:
            req.rng = random.Random(req.params.seed % 2**64)  # Random(-s) would equal Random(s)

    def sample(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """[N, V] float32 logits (one row per request, in order) → [N] int64 tokens (device).
        Modifies logits in place."""
        self.process_(logits, reqs)
        greedy = [r.params.is_greedy for r in reqs]
        if all(greedy):
            return argmax_rows(logits)
        return self._sample_random(logits, reqs, greedy)

    def process_(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        """In place: logit biases, penalties, the min_new_tokens EOS mask and grammar masks (what
        every sampled row gets before temperature; speculative verification applies it per draft
        position)."""
        self._apply_logit_bias(logits, reqs)
        self._apply_penalties(logits, reqs)
        early = self._mask_early_stop(logits, reqs)
        if any(r.grammar is not None for r in reqs):
            from radixlm.grammars.masking import apply_grammar_masks

            apply_grammar_masks(logits, reqs, others_masked=early)

    def target_probs(self, logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
        """[N, V] processed logits (process_ done) → the distribution sample() draws from, in vocab
        order and normalized: temperature, then top-k / top-p / min-p."""
        dev, f32 = logits.device, torch.float32
        temps = to_device([r.params.temperature for r in reqs], dev, f32)
        top_k = to_device([r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in reqs], dev)
        top_p = to_device([r.params.top_p for r in reqs], dev, f32)
        min_p = to_device([r.params.min_p for r in reqs], dev, f32)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        kept, ids = filter_probs(probs, top_k, top_p, min_p)
        out = torch.zeros_like(probs).scatter_(1, ids, kept)
        return out / out.sum(dim=-1, keepdim=True)

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        if not rows:
            return
        idx = to_device(rows, logits.device)
        block = logits[idx]  # a copy: the forward's output is an inference tensor
        for k, i in enumerate(rows):
            bias = reqs[i].params.logit_bias
            ids = to_device(list(bias), logits.device)
            block[k, ids] += to_device(list(bias.values()), logits.device, logits.dtype)
        logits[idx] = block

    def _apply_penalties(self, logits: torch.Tensor, reqs: Sequence[Req]) -> None:
        rows = [i for i, r in enumerate(reqs) if r.penalty_counts is not None]
        if not rows:
            return
        sub = [reqs[i] for i in rows]
        dev, f32 = logits.device, torch.float32
        idx = to_device(rows, dev)
        block = logits[idx]
        apply_penalties_(
            block,
            torch.stack([r.penalty_counts for r in sub]),  # type: ignore[misc]
            torch.stack([r.penalty_seen for r in sub]),  # type: ignore[misc]
            to_device([r.params.frequency_penalty for r in sub], dev, f32),
            to_device([r.params.presence_penalty for r in sub], dev, f32),
            to_device([r.params.repetition_penalty for r in sub], dev, f32),
        )
        logits[idx] = block

    def _mask_early_stop(self, logits: torch.Tensor, reqs: Sequence[Req]) -> bool:
        """Stop tokens to -inf for requests below min_new_tokens; whether any row was masked."""
        masked = False
        for i, r in enumerate(reqs):
            if len(r.output_ids) < r.params.min_new_tokens:
                ids = [t for t in r.stop_tokens() if 0 <= t < logits.shape[1]]
                if ids:
                    logits[i, ids] = float("-inf")
                    masked = True
        return masked

    def _sample_random(self, logits: torch.Tensor, reqs: Sequence[Req], greedy: list[bool]) -> torch.Tensor:
        dev, f32 = logits.device, torch.float32
        temps = to_device([1.0 if g else r.params.temperature for r, g in zip(reqs, greedy)], dev, f32)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        filtered = [_filters(r) for r in reqs]
        if any(filtered):  # the sort a filter needs costs more than the rest of sampling together
            top_k = to_device([r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in reqs], dev)
            top_p = to_device([r.params.top_p for r in reqs], dev, f32)
            min_p = to_device([r.params.min_p for r in reqs], dev, f32)
            kept, ids = filter_probs(probs, top_k, top_p, min_p)
        else:
            kept, ids = probs, None
        choice = torch.zeros(len(reqs), dtype=torch.int64, device=logits.device)  # a valid column
        shared = [i for i, r in enumerate(reqs) if r.rng is None]
        if shared:
            idx = to_device(shared, dev)
            choice[idx] = torch.multinomial(kept[idx], 1, generator=self.generator).squeeze(1)
        tokens = choice if ids is None else ids.gather(1, choice.unsqueeze(1)).squeeze(1)
        seeded = [i for i, r in enumerate(reqs) if r.rng is not None]
        if seeded:
            # a seeded row inverts its own CDF: in sorted order when it filters, in vocabulary
            # order when it does not, whatever the other rows of its batch ask
            sorted_rows = [i for i in seeded if filtered[i]]
            plain_rows = [i for i in seeded if not filtered[i]]
            if sorted_rows:
                assert ids is not None
                picks = self._sample_seeded(kept, reqs, sorted_rows)
                where = to_device(sorted_rows, dev)
                tokens[where] = ids[where].gather(1, picks.unsqueeze(1)).squeeze(1)
            if plain_rows:
                tokens[to_device(plain_rows, dev)] = self._sample_seeded(probs, reqs, plain_rows)
        if any(greedy):
            g = to_device(greedy, dev, torch.bool)
            tokens = torch.where(g, argmax_rows(logits), tokens)
        return tokens

    @staticmethod
    def _sample_seeded(dist: torch.Tensor, reqs: Sequence[Req], rows: list[int]) -> torch.Tensor:
        """Column picks for the given rows of dist [N, V], all at once: one uniform draw per token
        from each request's own host RNG (so its samples never depend on the batch it runs in),
        inverted through the row's cumulative distribution on the device."""
        dev = dist.device
        u = to_device([reqs[i].rng.random() for i in rows], dev, torch.float32)  # type: ignore[union-attr]
        cdf = dist[to_device(rows, dev)].cumsum(dim=-1)
        target = (u * cdf[:, -1]).unsqueeze(1)
        return torch.searchsorted(cdf, target).squeeze(1).clamp(max=dist.shape[1] - 1)


def _filters(req: Req) -> bool:
    """Whether top-k, top-p or min-p removes anything for this request."""
    p = req.params
    return p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
