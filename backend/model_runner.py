"""ModelRunner: owns the device — the model weights, the KV pool and the request→token table —
and turns a scheduled list of (request, new-token range) into one ForwardBatch and logits."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from . import limits
from .attention import TorchAttentionBackend
from .cascade_groups import CascadeGroups, make_cascade_plan
from .cuda_graph_inputs import GraphTarget
from .cuda_graph_runner import CudaGraphRunner, try_create
from .forward_batch import AttentionBackend, ForwardBatch, to_device_packed
from .kv_pool import KVPool, ReqToTokenTable, TokenSlotAllocator, resolve_kv_cache_dtype
from .loader import iter_weights, quantization_method
from .model_config import ModelConfig
from .models.llama import LlamaForCausalLM, materialize
from .piecewise_graphs import PiecewiseGraphs
from .piecewise_graphs import try_create as try_create_piecewise
from .quant_linear import fast_rows_limit
from .tensor_parallel import TPShard, local_config, shard_weights
from .weight_quant import ON_LOAD, quantize_linears

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_TOKENS = 32768
# Decode rows: each row reads its request's whole KV, where one extend reads it about once. Items
# of up to DECODE_ROWS_MAX_PER_ITEM new tokens always take them; longer ones while the rows' extra
# KV reads stay under DECODE_ROWS_MAX_EXTRA_KV_BYTES per layer: 16k rows at Llama-3-8B's 4 KiB
# per token and layer (one fresh prompt of up to ~180 tokens), about 16 us of HBM per layer on an
# H200, against about 470 us of host time per layer for an eager extend measured there.
DECODE_ROWS_MAX_PER_ITEM = 16
DECODE_ROWS_MAX_EXTRA_KV_BYTES = 64 * 2**20


@dataclass
class ScheduledItem:
    """One request's share of a step: tokens [start, start + length) of its sequence are new;
    logit_offsets are the positions (relative to start) whose logits the step must return."""

    req_pool_idx: int
    token_ids: list[int]
    start: int
    logit_offsets: list[int]


def decode_rows(items: list[ScheduledItem]) -> list[ScheduledItem]:
    """Each new token of each item as its own decode row: token j of an item starting at s sits at
    position s + j and attends to its request's first s + j + 1 slots. Since a layer stores every
    row's K/V before any row attends, this is the causal attention of the item's extend; logits
    rows keep their order."""
    rows: list[ScheduledItem] = []
    for it in items:
        wanted = set(it.logit_offsets)
        rows.extend(
            ScheduledItem(it.req_pool_idx, [tok], it.start + j, [0] if j in wanted else [])
            for j, tok in enumerate(it.token_ids)
        )
    return rows


def _extra_row_reads(items: list[ScheduledItem]) -> int:
    """KV rows (per layer) that decode rows read beyond one pass over each item's KV: row j of an
    item of n new tokens from start s reads s + j + 1 rows, one extend about s + n."""
    return sum(
        (len(it.token_ids) - 1) * it.start + len(it.token_ids) * (len(it.token_ids) - 1) // 2 for it in items
    )


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        model_dir: Path | None,
        device: torch.device,
        dtype: torch.dtype,
        max_total_tokens: int | None,
        mem_fraction_static: float,
        max_running_requests: int | None,
        random_weights: bool = False,
        seed: int = 0,
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
        cascade_graphs: bool = False,
        quantization: str | None = None,
        tp: TPShard | None = None,
        kv_cache_dtype: str | None = None,
        piecewise_max_tokens: int | None = None,
    ) -> None:
        """tp: this rank's share of a tensor-parallel model (the default process group is the
        tensor-parallel group); its config, model and KV pool then hold this rank's heads.
        kv_cache_dtype: "auto"/None = the model dtype, "fp8_e4m3" = an fp8 pool (half the bytes
        of bf16 per token, so the same memory holds twice the tokens). piecewise_max_tokens: the
        largest extend step run through piecewise CUDA graphs (None: limits.piecewise_max_tokens;
        0: none)."""
        self.kv_cache_dtype = kv_cache_dtype or "auto"
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
        self.full_config = config
        self.tp = tp
        self.config = local_config(config, tp) if tp is not None else config
        config = self.config
        self.quantization = quantization  # GGUF weights: kept as blocks or dequantized (loader.py)
        self.device = device
        self.dtype = dtype
        self.model = self._load_model(model_dir, random_weights, seed)
        # rows a forward takes at the decode kernels' per-row cost (None: no such cliff)
        self.fast_rows: int | None = fast_rows_limit(self.model)
        kv_tokens = self._kv_budget(max_total_tokens, mem_fraction_static)
        self.kv_pool = KVPool(
            config.num_layers, kv_tokens, config.num_kv_heads, config.head_dim, self.kv_dtype, device
        )
        self.allocator = TokenSlotAllocator(kv_tokens)
        if max_running_requests is None:
            max_running_requests = limits.max_running_requests(device, kv_tokens)
        if cuda_graph_max_bs is None:
            cuda_graph_max_bs = limits.cuda_graph_max_bs(device, max_running_requests)
        self.max_running_requests = max_running_requests
        self.req_table = ReqToTokenTable(max_running_requests + 8, config.context_len + 8, device)
        self.attn_backend: AttentionBackend = self._attention_backend()
        logger.info("KV pool: %d token slots (%s, %s)", kv_tokens, self.kv_dtype, device)
        self.graph_runner: CudaGraphRunner | None = None  # decode CUDA graphs (CUDA only)
        self._graph_args = (min(cuda_graph_max_bs, max_running_requests), cascade_graphs)
        self.piecewise: PiecewiseGraphs | None = None  # extend steps' dense work (CUDA only)
        if device.type == "cuda" and not disable_cuda_graph:
            self.graph_runner = try_create(self.graph_target(), *self._graph_args)
            if piecewise_max_tokens is None:
                piecewise_max_tokens = limits.piecewise_max_tokens(device)
            self.piecewise = try_create_piecewise(self.graph_target(), self.model, piecewise_max_tokens)

    def set_kv_scales(self, k_scales: torch.Tensor | float, v_scales: torch.Tensor | float) -> None:
        """An fp8 pool's per-layer, per-KV-head scales (KVPool.set_scales), e.g. from calibration;
        set them before the pool holds K/V a request will read (stored rows are not rescaled).
        Call on the engine's scheduler thread (Engine._call). Decode graphs bake in whether the
        scale work runs, so they are captured again when that switches."""
        was_unit = self.kv_pool.unit_scales
        self.kv_pool.set_scales(k_scales, v_scales)
        if self.graph_runner is not None and was_unit != self.kv_pool.unit_scales:
            self.recapture_decode_graphs()

    def recapture_decode_graphs(self) -> None:
        """Capture the decode graphs again (after a change they bake in); on the scheduler
        thread. graph_runner is None afterwards where capture failed (the reason logged)."""
        self.graph_runner = None  # drop the old graphs' memory before capturing anew
        self.graph_runner = try_create(self.graph_target(), *self._graph_args)

    def _load_model(self, model_dir: Path | None, random_weights: bool, seed: int) -> LlamaForCausalLM:
        with torch.device("meta"):
            model = LlamaForCausalLM(self.config)
        model = cast(LlamaForCausalLM, materialize(model, self.dtype, self.device))
        model.tie_weights()
        model.model.rotary.build(self.device)
        if random_weights or model_dir is None:
            gen = torch.Generator(device=self.device).manual_seed(seed)
            for name, p in model.named_parameters():
                with torch.no_grad():
                    if name.endswith("norm.weight"):
                        p.fill_(1.0)
                    elif p.dim() == 1:
                        p.zero_()
                    else:
                        p.normal_(0.0, 0.02, generator=gen)
        else:
            weights = iter_weights(model_dir, self.quantization, self.device)
            if self.tp is not None:
                weights = shard_weights(weights, self.full_config, self.tp)
            model.load_weights(weights)
        method = quantization_method(self.quantization)
        if method in ON_LOAD:
            quantize_linears(model, method)
            if self.device.type == "cuda":  # the float weights' blocks, else counted as used by the KV budget
                torch.cuda.empty_cache()
        if self.tp is not None and self.tp.size > 1:
            model.tp = self.tp
            for layer in model.model.layers:
                layer.tp_size = self.tp.size  # type: ignore[assignment]
        return model.eval()

    def _kv_budget(self, max_total_tokens: int | None, mem_fraction: float) -> int:
        c = self.config
        per_token = KVPool.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_dtype)
        if self.device.type != "cuda":
            return max_total_tokens or CPU_DEFAULT_KV_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * mem_fraction) - (total - free)
        fit = budget // per_token
        if fit <= 0:
            raise ValueError(f"no GPU memory left for the KV pool (mem_fraction_static={mem_fraction})")
        return min(fit, max_total_tokens) if max_total_tokens else fit

    def _attention_backend(self) -> AttentionBackend:
        if self.device.type == "cuda":
            try:
                from .attention_triton import TritonAttentionBackend

                return TritonAttentionBackend()
            except ImportError:
                logger.warning("Triton attention unavailable; using the torch reference path")
        return TorchAttentionBackend()

    @property
    def supports_cascade(self) -> bool:
        """Whether the attention backend runs cascade plans (the torch reference ignores them)."""
        return self.attn_backend.supports_cascade

    def graph_target(self) -> GraphTarget:
        """What the CUDA graph runner captures and reads: the eager forward and the device state."""
        return GraphTarget(
            self.model, self.config, self.dtype, self.device, self.kv_pool, self.req_table, self.attn_backend
        )

    def build_batch(
        self,
        items: list[ScheduledItem],
        out_cache_loc: torch.Tensor,
        future_tokens: torch.Tensor | None = None,
        cascade: CascadeGroups | None = None,
        num_decode: int = 0,
        keep_extend: bool = False,
    ) -> ForwardBatch:
        """One ForwardBatch for the step. A negative token id -1-k stands for future_tokens[k] (a
        token the in-flight step samples) and is resolved on the device, without a sync. cascade:
        CascadeGroups over the first num_decode items (already in group order). keep_extend: never
        turn the items into decode rows (the warm-up compiles the extend kernels this way)."""
        if not keep_extend and self._runs_as_decode_rows(items):
            items, cascade = decode_rows(items), None
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        starts, prefix, extend, seq = [], [], [], []
        for it in items:
            n = len(it.token_ids)
            starts.append(len(ids))
            logit_rows.extend(len(ids) + o for o in it.logit_offsets)
            ids.extend(it.token_ids)
            positions.extend(range(it.start, it.start + n))
            prefix.append(it.start)
            extend.append(n)
            seq.append(it.start + n)
        dev = self.device
        rows = [it.req_pool_idx for it in items]
        (ids_d, pos_d, loc_d, rows_d, seq_d, prefix_d, extend_d, starts_d, logit_d) = to_device_packed(
            [ids, positions, out_cache_loc, rows, seq, prefix, extend, starts, logit_rows], dev
        )
        fb = ForwardBatch(
            input_ids=self._resolve_ids(ids_d, future_tokens if ids and min(ids) < 0 else None),
            positions=pos_d,
            out_cache_loc=loc_d,
            req_pool_indices=rows_d,
            seq_lens=seq_d,
            prefix_lens=prefix_d,
            extend_lens=extend_d,
            extend_start_loc=starts_d,
            seq_lens_cpu=seq,
            prefix_lens_cpu=prefix,
            extend_lens_cpu=extend,
            req_pool_indices_cpu=rows,
            extend_start_loc_cpu=starts,
            logits_indices=logit_d,
            req_to_token=self.req_table.table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            is_decode=all(n == 1 for n in extend),
        )
        if cascade is not None and fb.is_decode and num_decode == len(items):
            fb.cascade_plan = make_cascade_plan(cascade.group_sizes, cascade.shared_lens, seq, dev)
        return fb

    def _runs_as_decode_rows(self, items: list[ScheduledItem]) -> bool:
        """A step of few new tokens (a verify step's token and drafts, jump-forward's forced
        tokens beside decodes, a short fresh prompt) runs as decode rows when a captured graph
        holds them all: one graph replay instead of an eager extend forward, whose host time
        costs several decode steps."""
        graphs = self.graph_runner
        if graphs is None or not graphs.enabled or not items:
            return False
        sizes = [len(it.token_ids) for it in items]
        if not 1 < max(sizes) or sum(sizes) > graphs.max_bs:
            return False
        if max(sizes) <= DECODE_ROWS_MAX_PER_ITEM:
            return True
        pool = self.kv_pool
        row_bytes = KVPool.bytes_per_token(1, pool.num_kv_heads, pool.head_dim, pool.dtype)
        return _extra_row_reads(items) * row_bytes <= DECODE_ROWS_MAX_EXTRA_KV_BYTES

    @staticmethod
    def _resolve_ids(ids: torch.Tensor, future_tokens: torch.Tensor | None) -> torch.Tensor:
        if future_tokens is None:
            return ids
        return torch.where(ids >= 0, ids, future_tokens[(-1 - ids).clamp(min=0)])

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            return self.graph_runner.replay(fb)
        if self.piecewise is not None and self.piecewise.can_run(fb):
            return self.piecewise.forward(fb)
        return self.model(fb)
