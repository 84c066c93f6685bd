"""The draft-model proposer: a second, smaller model (same tokenizer) guesses the next k tokens by
greedy decoding on its own ModelRunner and KV pool. Per request it keeps the KV of the tokens it
has read; a later call keeps the part that still matches the request's tokens (a rejected draft's
KV is dropped) and reads only what is new. Promises: drafts are a deterministic function of the
request's tokens (greedy), so verification stays exact; every slot and table row it holds is
freed when its request ends or when a newer request needs the room."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .loader import load_config, resolve_model_dir
from .model_runner import ModelRunner, ScheduledItem
from .request import Req

logger = logging.getLogger(__name__)


@dataclass
class _DraftKV:
    """One request's rows on the draft model: `ids` are the tokens whose KV is in `slots`."""

    row: int
    ids: list[int] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)  # one tensor per forward, in order


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._held: OrderedDict[str, _DraftKV] = OrderedDict()  # by rid, least recently used first
        self.evictions = 0  # requests whose draft KV was dropped to make room for another's
        self._reserved = 0  # free slots promised to this call's requests, not yet taken

    @property
    def free_slots(self) -> int:
        return self.runner.allocator.available_size()

    def propose(self, req: Req, k: int) -> list[int]:
        return self.propose_batch([req], [k])[0]

    def propose_batch(self, reqs: list[Req], ks: list[int]) -> list[list[int]]:
        """Up to k greedy tokens of the draft model after each request's tokens (empty where its
        context or the draft pool has no room; earlier requests of the batch go first): every
        request's new tokens are read in one forward, then each further draft position is one
        decode forward for all of them."""
        drafts: list[list[int]] = [[] for _ in reqs]
        live: list[tuple[int, _DraftKV, list[int]]] = []  # (index, its KV, tokens still to read)
        keep = {req.rid for req in reqs}  # room comes from requests outside this batch only
        self._reserved = 0
        for i, (req, k) in enumerate(zip(reqs, ks)):
            ids = req.all_ids
            if k <= 0 or not ids or len(ids) + k > self.runner.config.context_len:
                continue
            kv = self._state(req.rid, keep)
            if kv is None:
                continue
            self._keep_prefix(kv, ids)
            new = ids[len(kv.ids) :]
            if self._reserve(len(new) + k - 1, keep):
                live.append((i, kv, new))
        if not live:
            return drafts
        firsts = self._step([kv for _, kv, _ in live], [new for _, _, new in live])
        for (i, _, _), token in zip(live, firsts):
            drafts[i].append(token)
        for j in range(1, max(ks[i] for i, _, _ in live)):
            going = [(i, kv) for i, kv, _ in live if ks[i] > j]
            tokens = self._step([kv for _, kv in going], [[drafts[i][-1]] for i, _ in going])
            for (i, _), token in zip(going, tokens):
                drafts[i].append(token)
        return drafts

    def observe_finished(self, req: Req) -> None:
        kv = self._held.pop(req.rid, None)
        if kv is not None:
            self._release(kv)

    # ---- the draft model's KV -----------------------------------------------------------
    def _state(self, rid: str, keep: set[str]) -> _DraftKV | None:
        kv = self._held.get(rid)
        if kv is not None:
            self._held.move_to_end(rid)
            return kv
        row = self.runner.req_table.alloc()
        while row is None and self._evict_one(keep):
            row = self.runner.req_table.alloc()
        if row is None:
            return None
        kv = self._held[rid] = _DraftKV(row)
        return kv

    def _keep_prefix(self, kv: _DraftKV, ids: list[int]) -> None:
        """Drop the KV past the longest prefix kv.ids shares with ids, and never keep the last
        token's: its logits are what the next draft needs."""
        n = min(len(kv.ids), len(ids) - 1)
        if kv.ids[:n] != ids[:n]:  # compared in C: a rejection changes only the last few tokens
            n = next(i for i, (a, b) in enumerate(zip(kv.ids, ids)) if a != b)
        if n == len(kv.ids):
            return
        flat = torch.cat(kv.slots) if kv.slots else torch.empty(0, dtype=torch.int64)
        self.runner.allocator.free(flat[n:])
        kv.slots = [flat[:n]] if n else []
        kv.ids = kv.ids[:n]

    def _reserve(self, n: int, keep: set[str]) -> bool:
        """n more free slots beyond those already reserved this call, evicting the draft KV of
        requests not in `keep` (least recently used first)."""
        while self.runner.allocator.available_size() < self._reserved + n:
            if not self._evict_one(keep):
                return False
        self._reserved += n
        return True

    def _evict_one(self, keep: set[str]) -> bool:
        for rid in self._held:
            if rid not in keep:
                self._release(self._held.pop(rid))
                self.evictions += 1
                return True
        return False

    def _release(self, kv: _DraftKV) -> None:
        if kv.slots:
            self.runner.allocator.free(torch.cat(kv.slots))
        self.runner.req_table.free(kv.row)

    def _step(self, kvs: list[_DraftKV], tokens: list[list[int]]) -> list[int]:
        """One forward reading tokens[i] into kvs[i] (at its end); each one's greedy next token."""
        slots = self.runner.allocator.alloc(sum(len(t) for t in tokens))
        assert slots is not None, "reserved before the forward"
        self._reserved -= slots.numel()
        items, at = [], 0
        for kv, toks in zip(kvs, tokens):
            mine = slots[at : at + len(toks)]
            at += len(toks)
            self.runner.req_table.write(kv.row, len(kv.ids), mine)
            items.append(ScheduledItem(kv.row, toks, len(kv.ids), [len(toks) - 1]))
            kv.ids.extend(toks)
            kv.slots.append(mine.to("cpu"))
        with torch.inference_mode():
            logits = self.runner.forward(self.runner.build_batch(items, slots))
        return [int(t) for t in logits.argmax(dim=-1).tolist()]


def load_draft_runner(path: str, target: ModelRunner) -> ModelRunner:
    """The draft model's runner, on the target's device and dtype: its own weights (a GGUF file's
    blocks kept where the device's default keeps them: a draft is for speed, and verification is
    exact whatever it proposes) and a KV pool as large as the target's (on CUDA, at most half of
    the memory left after it). Refused with a reason where its vocabulary is not the target's."""
    model_dir = resolve_model_dir(path)
    config = load_config(model_dir)
    vocab = target.config.vocab_size
    if config.vocab_size != vocab:
        raise ValueError(
            f"speculative_draft_model_path {path!r}: its vocabulary has {config.vocab_size} tokens, "
            f"the target's {vocab}; a draft model must share the target's tokenizer"
        )
    config.max_position_embeddings = min(config.max_position_embeddings, target.config.context_len)
    device, fraction = target.device, 1.0
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        fraction = (total - free / 2) / total
    runner = ModelRunner(
        config,
        model_dir,
        device,
        target.dtype,
        target.allocator.size,
        fraction,
        None,
        disable_cuda_graph=True,
        kv_cache_dtype=target.kv_cache_dtype,  # as many tokens as the target's pool, in its dtype
    )
    logger.info("draft model %s: %d KV slots", path, runner.allocator.available_size())
    return runner
