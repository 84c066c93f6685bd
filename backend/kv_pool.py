"""KV memory: the slot allocator, the per-layer K/V buffers indexed by slot (model dtype, or fp8
e4m3 with per-layer, per-KV-head scales), and the request→token table. The allocator owns which
slots are free; it never frees a slot twice and never hands out slot 0, which is the padding slot
that dummy tokens write into."""

from __future__ import annotations

import torch

from radixlm.kernels.kv_quant import FP8_KV_DTYPE, quantize_kv

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype: "auto" (or None) = the model dtype, "fp8_e4m3" = float8_e4m3fn."""
    if kv_cache_dtype in (None, "auto"):
        return model_dtype
    if kv_cache_dtype == "fp8_e4m3":
        return FP8_KV_DTYPE
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose from {', '.join(KV_CACHE_DTYPES)}")


class TokenSlotAllocator:
    """Free list of KV slots 1..size (slot 0 is reserved for padding).

    Indices are int64 CPU tensors: bookkeeping stays on the host, the model runner moves
    the batch's indices to the device once per step."""

    def __init__(self, size: int, debug_checks: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"KV pool size must be positive, got {size}")
        self.size = size
        self.debug_checks = debug_checks
        self._free = torch.arange(1, size + 1, dtype=torch.int64)
        self._num_free = size
        # is_free[i] mirrors the free list so double frees and leaks are caught at once.
        self._is_free = torch.ones(size + 1, dtype=torch.bool)
        self._is_free[0] = False

    def available_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take n free slots, or return None (and take nothing) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        if n > self._num_free:
            return None
        out = self._free[self._num_free - n : self._num_free].clone()
        self._num_free -= n
        if self.debug_checks:
            self._is_free[out] = False
        return out

    def free(self, indices: torch.Tensor) -> None:
        """Return slots to the free list. Freeing a free slot or slot 0 raises."""
        n = int(indices.numel())
        if n == 0:
            return
        indices = indices.to(device="cpu", dtype=torch.int64).flatten()
        if self.debug_checks:
            if bool((indices <= 0).any()) or bool((indices > self.size).any()):
                raise RuntimeError(f"freeing out-of-range KV slots: {indices.tolist()[:8]}")
            if bool(self._is_free[indices].any()) or indices.unique().numel() != n:
                raise RuntimeError("double free of KV slots")
            self._is_free[indices] = True
        self._free[self._num_free : self._num_free + n] = indices
        self._num_free += n

    def is_free_mask(self) -> torch.Tensor:
        """Bool mask over slots 0..size (slot 0 is never free). For invariant checks."""
        return self._is_free.clone()


class KVPool:
    """Per-layer K and V buffers of shape [size + 1, num_kv_heads, head_dim]; row = slot.

    An fp8 pool stores clamp(x / scale, ±448) as e4m3, scale = k_scales[layer, kv_head] (or
    v_scales), fp32 on the device, 1.0 unless set_scales says otherwise; readers multiply back."""

    def __init__(
        self,
        num_layers: int,
        size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.size = size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.quantized = dtype == FP8_KV_DTYPE
        self.k_scales = torch.ones((num_layers, num_kv_heads), dtype=torch.float32, device=device)
        self.v_scales = torch.ones((num_layers, num_kv_heads), dtype=torch.float32, device=device)
        self._unit_scales = True  # host-side: lets readers skip the scale work without a sync

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def set_scales(self, k_scales: torch.Tensor | float, v_scales: torch.Tensor | float) -> None:
        """Per-layer, per-KV-head dequantization scales (e.g. from calibration): a number, [Hkv]
        (every layer) or [num_layers, Hkv]; finite and positive. Written in place, so kernels and
        CUDA graphs keep their pointers; a captured graph bakes in whether the scales are all 1
        (the scale work is then skipped): ModelRunner.set_kv_scales captures again if that flips."""
        if not self.quantized:
            raise ValueError(f"KV scales apply to an fp8 pool only; this pool holds {self.dtype}")
        host = []
        for dst, given in ((self.k_scales, k_scales), (self.v_scales, v_scales)):
            t = torch.as_tensor(given, dtype=torch.float32).cpu().expand(dst.shape)
            if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
                raise ValueError("KV scales must be finite and positive")
            dst.copy_(t)
            host.append(t)
        self._unit_scales = all(bool((t == 1.0).all()) for t in host)

    @property
    def unit_scales(self) -> bool:
        """Whether every scale is 1 (readers then skip the scale work); known on the host."""
        return self._unit_scales

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K scale [Hkv], V scale [Hkv]) of a layer for readers, or (None, None) when the pool
        is not fp8 or every scale is 1 (nothing to multiply)."""
        if not self.quantized or self._unit_scales:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    def store_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K scale [Hkv], V scale [Hkv]) of a layer for writers (an fp8 store always divides,
        whatever the values), or (None, None) for a pool in the model dtype."""
        if not self.quantized:
            return None, None
        return self.k_scales[layer], self.v_scales[layer]

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([T, Hkv, D]) into slots loc ([T]) (quantized for an fp8 pool)."""
        if self.quantized:
            self.k_buffers[layer][loc] = quantize_kv(k, self.k_scales[layer])
            self.v_buffers[layer][loc] = quantize_kv(v, self.v_scales[layer])
            return
        self.k_buffers[layer][loc] = k.to(self.dtype)
        self.v_buffers[layer][loc] = v.to(self.dtype)


class ReqToTokenTable:
    """[max_requests, max_context_len] int64 map: row r, column i → KV slot of token i of the
    request holding row r. Rows are handed out and returned like slots. A host mirror answers
    every read the scheduler makes, so reading a row never waits for the device."""

    def __init__(self, max_requests: int, max_context_len: int, device: torch.device | str) -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int64, device=device)
        self.host = (
            self.table if self.table.device.type == "cpu" else torch.zeros_like(self.table, device="cpu")
        )
        self._free_rows = list(range(max_requests - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"request row {row} freed twice")
        self._free_rows.append(row)

    def read(self, row: int, start: int, stop: int) -> torch.Tensor:
        """Slots of tokens [start, stop) of a row, as a CPU tensor (from the mirror: no sync)."""
        return self.host[row, start:stop].clone()

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        slots = slots.to("cpu")
        self.host[row, start : start + slots.numel()] = slots
        if self.table is not self.host:
            self.table[row, start : start + slots.numel()] = slots.to(self.table.device, non_blocking=True)

    def write_many(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i] for a whole decode batch, in one scatter."""
        slots = slots.to("cpu")
        r = torch.tensor(rows, dtype=torch.int64)
        c = torch.tensor(cols, dtype=torch.int64)
        self.host[r, c] = slots
        if self.table is not self.host:
            packed = torch.cat([r, c, slots.to(torch.int64)]).to(self.table.device, non_blocking=True)
            r_d, c_d, s_d = packed.split([r.numel(), c.numel(), slots.numel()])
            self.table[r_d, c_d] = s_d  # one host→device copy for the whole scatter

    def clear_row(self, row: int) -> None:
        """Point a whole row at slot 0 (the padding slot)."""
        self.host[row].zero_()
        if self.table is not self.host:
            self.table[row].zero_()
