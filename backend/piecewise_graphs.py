"""PiecewiseGraphs: extend steps (prompt chunks, mixed steps) of up to max_tokens tokens replay each
layer's dense work (norms, projections, rope, MLP) from CUDA graphs captured per token bucket at
start-up, and run attention eagerly between the pieces: the KV store and the extend and decode
kernels, whose grids follow the step's items. An eager extend forward pays a host launch for every
op of every layer; here a step pays L + 1 graph replays and L attention calls. Promises: the eager
forward's logits up to matmul rounding (rows are padded to the bucket; padding rows never reach
attention or the KV pool), nothing captured after start-up, and never a crash: a failed capture
logs a warning and leaves extend steps eager."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass

import torch

from .cuda_graph_runner import (
    CaptureFn,
    CudaGraphCapture,
    GraphTarget,
    Replay,
    bucket_for,
    fit_to_free_memory,
    release_graph_memory,
    warn_capture_failed,
)
from .forward_batch import ForwardBatch
from .models.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """Ascending token counts to capture: 16, 32, 64, 96, multiples of 64 up to 512, of 128 beyond,
    and max_tokens itself; from 64 tokens up a step pads at most a third of its rows."""
    if max_tokens < 1:
        raise ValueError(f"piecewise graphs need max_tokens >= 1, got {max_tokens}")
    steps = [16, 32, 64, 96, *range(128, 513, 64), *range(640, max_tokens, 128)]
    return [s for s in steps if s < max_tokens] + [max_tokens]


def activation_bytes_per_token(layer: LlamaDecoderLayer, hidden: int, dtype: torch.dtype) -> int:
    """Upper estimate of one token's memory in a piece (its temporaries in the graph pool) and in
    the static buffers: q/k/v and their rotated copies, the attention output, the MLP's gate/up,
    activation and output, the norms and residual streams."""
    attn, mlp = layer.self_attn, layer.mlp.gate_up_proj
    size = torch.tensor([], dtype=dtype).element_size()
    qkv = attn.q_size + 2 * attn.kv_size
    return (3 * qkv + 2 * attn.q_size + 2 * mlp.out_features + 8 * hidden) * size + 16


@dataclass
class _StaticBuffers:
    """What the pieces read and write, max_tokens rows each, allocated once outside the graph pool:
    step inputs, one layer's q/k/v (rotated) and attention output, the residual stream and the
    last layer's output."""

    ids: torch.Tensor
    positions: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn: torch.Tensor
    residual: torch.Tensor
    out: torch.Tensor

    @staticmethod
    def allocate(
        model: LlamaForCausalLM, rows: int, dtype: torch.dtype, device: torch.device
    ) -> _StaticBuffers:
        c = model.config

        def zeros(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(rows, *shape, dtype=kind, device=device)

        return _StaticBuffers(
            zeros(kind=torch.int64),
            zeros(kind=torch.int64),
            zeros(c.num_heads, c.head_dim),
            zeros(c.num_kv_heads, c.head_dim),
            zeros(c.num_kv_heads, c.head_dim),
            zeros(c.num_heads * c.head_dim),
            zeros(c.hidden_size),
            zeros(c.hidden_size),
        )


class PiecewiseGraphs:
    """One list of L + 1 replays per bucket: piece 0 embeds and runs layer 0 up to attention, piece
    i runs layer i-1 after attention and layer i up to it, piece L finishes the last layer.
    ModelRunner.forward asks can_run, then forward, for each step the decode graphs do not take."""

    def __init__(
        self,
        target: GraphTarget,
        model: LlamaForCausalLM,
        max_tokens: int,
        capture: CaptureFn,
    ) -> None:
        self.model, self.kv_pool, self.backend = model, target.kv_pool, target.attn_backend
        self.layers = decoder_layers(model)
        self.sizes = token_buckets(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.buf = _StaticBuffers.allocate(model, self.max_tokens, target.dtype, target.device)
        self.graphs: dict[int, list[Replay]] = {}
        self.bucket_hits: Counter[int] = Counter()
        self.enabled = False
        self._capture = capture

    def capture_all(self) -> bool:
        """Capture every bucket, largest first. On any error: warn, drop the graphs, stay disabled
        (eager extend steps) and return False."""
        tokens = 0
        try:
            with torch.inference_mode():
                for tokens in reversed(self.sizes):
                    self.graphs[tokens] = [
                        self._capture(functools.partial(self._piece, i, tokens))[0]
                        for i in range(len(self.layers) + 1)
                    ]
        except Exception as e:  # OOM, an op that cannot be captured, a kernel that syncs
            warn_capture_failed("piecewise CUDA graph", f"{tokens} tokens", "extend steps run eagerly", e)
            self.disable()
            return False
        self.enabled = True
        logger.info("captured piecewise CUDA graphs for extend steps of %s tokens", self.sizes)
        return True

    def disable(self) -> None:
        self.enabled = False
        self.graphs.clear()
        release_graph_memory(self.buf.ids.device)

    def _piece(self, i: int, t: int) -> torch.Tensor:
        """Piece i over the first t rows of the static buffers (what a graph records)."""
        b, layers = self.buf, self.layers
        if i == 0:
            h: torch.Tensor = self.model.model.embed_tokens(b.ids[:t])
            residual = None
        else:
            h, residual = layers[i - 1].after_attention(b.attn[:t], b.residual[:t])
            if i == len(layers):
                b.out[:t].copy_(h)
                b.residual[:t].copy_(residual)
                return b.out[:t]
        q, k, v, residual = layers[i].before_attention(b.positions[:t], h, residual)
        for dst, src in ((b.q, q), (b.k, k), (b.v, v), (b.residual, residual)):
            dst[:t].copy_(src)
        return b.q[:t]

    def can_run(self, fb: ForwardBatch) -> bool:
        """Host-side facts only (flags, sizes, identities): no sync."""
        return (
            self.enabled
            and 0 < fb.num_tokens <= self.max_tokens
            and fb.attn_backend is self.backend
            and fb.kv_pool is self.kv_pool
        )

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """The model's forward (logits float32 of the rows fb.logits_indices) for a step can_run
        accepted: the step's tokens padded to its bucket through the pieces, its own rows only
        through attention."""
        n = fb.num_tokens
        t = bucket_for(n, self.sizes)
        if t is None or not self.enabled:
            raise ValueError(f"no piecewise graphs for an extend step of {n} tokens")
        b, pieces = self.buf, self.graphs[t]
        with torch.inference_mode():
            b.ids[:n].copy_(fb.input_ids)
            b.positions[:n].copy_(fb.positions)
            for i, layer in enumerate(self.layers):
                pieces[i]()
                b.attn[:n].copy_(
                    self.backend.forward(b.q[:n], b.k[:n], b.v[:n], layer.self_attn.layer_id, fb)
                )
            pieces[-1]()
            logits = self.model.logits_after_layers(b.out[:n], b.residual[:n], fb)
        self.bucket_hits[t] += 1
        return logits


def decoder_layers(model: LlamaForCausalLM) -> list[LlamaDecoderLayer]:
    return [m for m in model.model.layers if isinstance(m, LlamaDecoderLayer)]


def try_create(target: GraphTarget, model: LlamaForCausalLM, max_tokens: int) -> PiecewiseGraphs | None:
    """Captured piecewise graphs for a single-rank CUDA model, max_tokens cut to what free memory
    holds, or None with the reason logged; never raises."""
    layers = decoder_layers(model)
    if max_tokens < 1 or model.tp is not None or model.tp_driver is not None or not layers:
        return None
    if len(layers) != len(model.model.layers) or not target.attn_backend.supports_cuda_graphs:
        return None
    try:
        per_token = activation_bytes_per_token(layers[0], target.config.hidden_size, target.dtype)
        fitted = fit_to_free_memory(target.device, max_tokens, per_token, "piecewise CUDA graphs: max tokens")
        if fitted < 16:
            return None
        graphs = PiecewiseGraphs(target, model, fitted, CudaGraphCapture(target.device))
    except Exception as e:
        logger.warning(
            "piecewise CUDA graphs off (%s: %s); extend steps run eagerly", type(e).__name__, str(e)
        )
        return None
    return graphs if graphs.capture_all() else None
