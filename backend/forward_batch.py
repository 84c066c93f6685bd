"""ForwardBatch: everything one model forward needs, as device tensors plus host copies of the
lengths. One shape serves every step: each request contributes extend_len new tokens that
attend to its prefix_len cached tokens and causally to themselves (decode = extend_len 1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from radixlm.kernels.cascade_plan import CascadePlan

    from .kv_pool import KVPool


def to_device(
    values: Sequence[float], device: torch.device | str, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """A host list as a device tensor without a host sync (torch.tensor(..., device=cuda) waits for
    the stream; a non-blocking copy from a fresh host tensor does not)."""
    t = torch.tensor(values, dtype=dtype)
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)


PACK_ALIGN = 2  # int64 elements per 16 bytes


def to_device_packed(parts: list[list[int] | torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Several int64 host lists/tensors as device tensors through ONE host→device copy (each copy
    on the stream costs a few µs of device time at decode sizes); the results are views."""
    host = [
        torch.tensor(p, dtype=torch.int64) if isinstance(p, list) else p.to("cpu", torch.int64).flatten()
        for p in parts
    ]
    # Each view starts on a 16-byte boundary: Triton specializes kernels on pointer alignment, so
    # views at varying offsets would compile new kernel variants on the request path.
    padded = [torch.nn.functional.pad(h, (0, -h.numel() % PACK_ALIGN)) for h in host]
    flat = torch.cat(padded) if padded else torch.empty(0, dtype=torch.int64)
    if torch.device(device).type != "cpu":
        flat = flat.to(device, non_blocking=True)
    views = flat.split([p.numel() for p in padded])
    return [v[: h.numel()] for v, h in zip(views, host)]


@dataclass
class MixedStepSplit:
    """A mixed step's attention in two parts: its first `decode_rows` items (one new token each)
    through decode attention with `num_splits` splits, the rest through extend attention over
    their own device copies of the per-item tensors (fresh, so each starts 16-byte aligned as the
    kernels were compiled for; extend_start_loc counted from the first extend row) with
    `max_extend_len` sizing its grid."""

    decode_rows: int
    num_splits: int
    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start_loc: torch.Tensor
    max_extend_len: int


class AttentionBackend(Protocol):
    """Stores the step's new K/V into the pool and attends through the request→token table. Its
    capabilities are attributes the model runner and the model read (never its class name)."""

    supports_cascade: bool  # runs ForwardBatch.cascade_plan (else it attends per request, ignoring it)
    accepts_stored_kv: bool  # decode may pass k/v None: the model's fused rope kernel stored them
    supports_cuda_graphs: bool  # reads lengths only from device tensors, so a decode step can be captured

    def forward(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for the T new tokens → output [T, Hq * D]. k/v None: the
        caller already stored them in the pool (decode only, backends with accepts_stored_kv)."""
        ...


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    out_cache_loc: torch.Tensor  # [T] int64 KV slots the new tokens write, device
    req_pool_indices: torch.Tensor  # [B] int64 rows of req_to_token, device
    seq_lens: torch.Tensor  # [B] int64 total tokens after this step (prefix + extend), device
    prefix_lens: torch.Tensor  # [B] int64 tokens already in the KV pool, device
    extend_lens: torch.Tensor  # [B] int64 new tokens per request, device
    extend_start_loc: torch.Tensor  # [B] int64 offset of each request's first new token in T
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_pool_indices_cpu: list[int]
    extend_start_loc_cpu: list[int]
    logits_indices: torch.Tensor  # [N] positions in T whose logits the sampler needs
    req_to_token: torch.Tensor  # [max_requests, max_context] int64 slot table, device
    kv_pool: KVPool
    attn_backend: AttentionBackend
    is_decode: bool = False  # every extend_len == 1
    # Decode attention plans. None: the backend picks from the host-side lengths (the split count
    # is then memoized here for the step's other layers). A captured graph fixes them.
    decode_num_splits: int | None = None
    cascade_plan: CascadePlan | None = None  # groups sharing a cached prefix (backend/cascade_groups.py)
    cascade_shared_splits: int | None = None
    cascade_own_splits: int | None = None
    # A mixed step's split between decode and extend attention, decided by the backend at the
    # first layer and memoized for the others; None: undecided, or run as one extend.
    mixed_split: MixedStepSplit | None = None
    mixed_split_decided: bool = False
    # [N, vocab] float32 the forward writes its logits into and returns (None: a fresh tensor).
    # Every captured graph writes the runner's one buffer, so graphs hold no logits of their own.
    logits_out: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())
