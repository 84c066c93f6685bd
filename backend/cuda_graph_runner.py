"""CudaGraphRunner: captures the model's decode forward as CUDA graphs, one per batch size of a
bucket list (largest first, one shared memory pool), and replays the smallest graph that fits a
decode batch; rows past the real batch are padding (token 0 at position 0 writing KV slot 0,
attending to one slot through a reserved req_to_token row). With cascade on, cascade graphs of each
kind in CASCADE_GRAPH_SHAPES (a few groups of any size at every size; many small groups at a few
large sizes) hold their plan in static buffers; their host sizes are upper bounds, extra programs
exit at once. Promises: the eager forward's logits up to split-K rounding, no host sync inside a
replay, and never a crash: a failed capture logs a warning and leaves the engine decoding eagerly."""

from __future__ import annotations

import bisect
import functools
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.kernels.cascade_attention import CascadePlan, fused_layout, resolve_config
from radixlm.kernels.decode_splits import choose_decode_splits, choose_num_splits

from .cuda_graph_inputs import (
    CASCADE_GRAPH_SHAPES,
    CascadeGraphShape,
    GraphTarget,
    StaticCascadePlan,
    StaticDecodeInputs,
    cascade_plan_shape,
    sync_host_lists,
)
from .forward_batch import ForwardBatch

if TYPE_CHECKING:
    from .model_config import ModelConfig

__all__ = [
    "CASCADE_GRAPH_SHAPES",
    "CascadeGraphs",
    "CudaGraphCapture",
    "CudaGraphRunner",
    "GraphTarget",
    "StaticCascadePlan",
    "StaticDecodeInputs",
    "activation_bytes_per_row",
    "bucket_for",
    "capture_batch_sizes",
    "fit_max_bs",
    "fit_to_free_memory",
    "release_graph_memory",
    "sync_host_lists",
    "try_create",
    "warn_capture_failed",
]

logger = logging.getLogger(__name__)

CAPTURE_RESERVE_BYTES = 512 << 20  # cuBLAS workspaces, Triton modules, allocator slack
ROW_SAFETY = 2  # the per-row activation estimate is doubled before it is trusted

Replay = Callable[[], None]
# capture(fn) runs fn (the forward over the static inputs) and returns (replay, output): after
# replay() the output tensor holds fn's result for the static inputs' current contents.
CaptureFn = Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Ascending bucket sizes: 1, 2, 4, multiples of 8 up to 256, multiples of 32 beyond (padding
    costs little there, and each size is a capture at start-up), then max_bs itself."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1, got {max_bs}")
    steps = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, min(max_bs, 257), 8))
    return [s for s in steps if s < max_bs] + list(range(288, max_bs, 32)) + [max_bs]


def bucket_for(bs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= bs, or None when bs exceeds them all (or is not positive)."""
    if bs < 1:
        return None
    i = bisect.bisect_left(sizes, bs)
    return sizes[i] if i < len(sizes) else None


def activation_bytes_per_row(config: ModelConfig, dtype: torch.dtype, num_splits: int) -> int:
    """Upper estimate of one decode row's live memory in a captured forward: hidden/residual,
    q/k/v, attention output, MLP gate/up/act, split-K partial states, logits (model dtype and
    float32) and the float32 copy handed to the sampler."""
    c, size = config, torch.tensor([], dtype=dtype).element_size()
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    in_dtype = 3 * c.hidden_size + qkv + c.num_heads * c.head_dim + 3 * c.intermediate_size + c.vocab_size
    fp32 = c.num_heads * (num_splits * (c.head_dim + 1) + 1) + 2 * c.vocab_size
    return in_dtype * size + 4 * fp32


def fit_max_bs(
    requested: int, bytes_per_row: int, free_bytes: int, reserve_bytes: int = CAPTURE_RESERVE_BYTES
) -> int:
    """The largest batch size <= requested whose (safety-doubled) activations fit in free memory
    after the reserve; 0 when not even one row fits."""
    room = free_bytes - reserve_bytes
    if room <= 0 or bytes_per_row <= 0:
        return 0
    return max(0, min(requested, room // (bytes_per_row * ROW_SAFETY)))


def fit_to_free_memory(device: torch.device, requested: int, bytes_per_unit: int, what: str) -> int:
    """fit_max_bs against the device's free memory now, logging a cut ("<what> N -> M")."""
    free, _ = torch.cuda.mem_get_info(device)
    fitted = fit_max_bs(requested, bytes_per_unit, free)
    if fitted < requested:
        logger.warning("%s %d -> %d to fit in %d free bytes", what, requested, fitted, free)
    return fitted


class CudaGraphCapture:
    """The CUDA capture: two eager warm-up runs (Triton JIT, cuBLAS handle and workspace) on the
    capture stream, then one capture into a memory pool shared by every graph of this runner."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def __call__(self, fn: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        torch.cuda.synchronize(self.device)  # static inputs / KV pool were written on another stream
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another engine's scheduler thread allocating meanwhile is not an error
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        torch.cuda.synchronize(self.device)
        return graph.replay, out


@dataclass
class CapturedGraph:
    fb: ForwardBatch  # static batch the graph reads
    replay: Replay
    out: torch.Tensor  # [gbs, vocab] float32 logits, rewritten by each replay


def _is_power_of_four(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0 and n.bit_length() % 2 == 1


@dataclass
class CascadeGraphs:
    """One kind of cascade graph: its static plan buffers and a graph per captured size."""

    inputs: StaticCascadePlan
    sizes: list[int]  # ascending batch sizes to capture
    graphs: dict[int, CapturedGraph]
    hits: int = 0

    @staticmethod
    def sizes_for(shape: CascadeGraphShape, sizes: list[int]) -> list[int]:
        """A few-groups kind at every size; a many-groups kind at powers of four and the largest
        size only: its batches are large, where a decode step reads the same weights at any row
        count, and each size is one more capture at start-up."""
        if shape.members is None:
            return [s for s in sizes if s >= shape.min_bs]
        return [s for s in sizes if s >= shape.min_bs and (_is_power_of_four(s) or s == sizes[-1])]

    def bucket(self, bs: int, shared_groups: int, max_members: int) -> int | None:
        """The captured size a batch with this plan shape replays at, or None."""
        if not self.inputs.shape.fits(shared_groups, max_members):
            return None
        gbs = bucket_for(bs, self.sizes)
        return gbs if gbs is not None and gbs in self.graphs else None


class CudaGraphRunner:
    """Owns the static inputs and one graph per bucket size; ModelRunner.forward asks can_run and
    then replay for each decode batch."""

    def __init__(self, target: GraphTarget, max_bs: int, capture: CaptureFn, cascade: bool = False) -> None:
        self.target = target
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.backend = target.attn_backend
        self.graphs: dict[int, CapturedGraph] = {}
        self.bucket_hits: Counter[int] = Counter()
        self.enabled = False
        pad_row = target.req_table.alloc()
        if pad_row is None:
            raise RuntimeError("no free req_to_token row to reserve for padding")
        self.pad_row: int | None = pad_row
        target.req_table.clear_row(pad_row)  # column 0 → KV slot 0, the padding slot
        self.inputs = StaticDecodeInputs(self.max_bs, pad_row, target.device, target.config.vocab_size)
        self.cascade: list[CascadeGraphs] = (
            [
                CascadeGraphs(StaticCascadePlan(self.max_bs, target.device, shape), sizes, {})
                for shape in CASCADE_GRAPH_SHAPES
                if (sizes := CascadeGraphs.sizes_for(shape, self.sizes))
            ]
            if cascade
            else []
        )
        self._capture = capture

    @property
    def cascade_hits(self) -> int:
        """Replays of any cascade graph."""
        return sum(kind.hits for kind in self.cascade)

    def num_splits(self, gbs: int) -> int:
        """Fixed per graph: sized for the context limit, so any live length is covered."""
        c = self.target.config
        return choose_decode_splits(
            gbs, c.num_kv_heads, c.context_len, self._num_sms(), self.target.kv_pool.dtype
        )

    def _num_sms(self) -> int:
        num_sms = getattr(self.backend, "num_sms", None)  # a Triton backend's; 4 stands in on CPU
        return num_sms(self.target.device) if num_sms is not None else 4

    def capture_all(self) -> bool:
        """Capture every size, largest first. On any error: warn, drop the graphs, release the
        pad row, stay disabled (eager decoding) and return False."""
        gbs = 0
        try:
            with torch.inference_mode():
                for gbs in reversed(self.sizes):
                    sfb = self.inputs.forward_batch(gbs, self.target, self.num_splits(gbs))
                    replay, out = self._capture(functools.partial(self.target.forward, sfb))
                    self.graphs[gbs] = CapturedGraph(sfb, replay, out)
                    for kind in list(self.cascade):
                        if gbs in kind.sizes:
                            self._try_capture_cascade(kind, gbs)
        except Exception as e:  # OOM, an op that cannot be captured, a kernel that syncs
            warn_capture_failed("CUDA graph", f"batch size {gbs}", "decoding eagerly", e)
            self.disable()
            return False
        self.enabled = True
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)
        return True

    def _try_capture_cascade(self, kind: CascadeGraphs, gbs: int) -> None:
        """A failed cascade capture drops only that kind's graphs (its steps then run eagerly)."""
        try:
            kind.graphs[gbs] = self._capture_cascade(kind.inputs, gbs)
        except Exception as e:
            warn_capture_failed(
                f"cascade CUDA graph ({kind.inputs.shape.groups} groups)",
                f"batch size {gbs}",
                "such cascade decode steps run eagerly",
                e,
            )
            self.cascade.remove(kind)

    def _capture_cascade(self, inputs: StaticCascadePlan, gbs: int) -> CapturedGraph:
        """The decode graph with a static cascade plan. Its shared-prefix split count is the one an
        eager launch would pick for the kind's typical plan (more groups add programs)."""
        c = self.target.config
        sfb = self.inputs.forward_batch(gbs, self.target, self.num_splits(gbs))
        plan = inputs.plan(gbs, c.context_len)
        typical = inputs.typical_plan(gbs, c.context_len)
        lay = fused_layout(gbs, c.num_heads, c.num_kv_heads, typical, resolve_config(), self._num_sms())
        sfb.cascade_plan, sfb.cascade_shared_splits, sfb.cascade_own_splits = plan, lay.s_sh, lay.s_own
        replay, out = self._capture(lambda: self.target.forward(sfb))
        return CapturedGraph(sfb, replay, out)

    def disable(self) -> None:
        self.enabled = False
        self.graphs.clear()
        self.cascade = []
        if self.pad_row is not None:
            self.target.req_table.free(self.pad_row)
            self.pad_row = None
        release_graph_memory(self.target.device)

    def cascade_fits(self, bs: int, shared_groups: int, max_members: int) -> bool:
        """Whether a cascade decode batch of this shape would replay a graph (host ints only)."""
        return self.enabled and self._cascade_graph(bs, shared_groups, max_members) is not None

    def _cascade_graph(
        self, bs: int, shared_groups: int, max_members: int
    ) -> tuple[CascadeGraphs, int] | None:
        for kind in self.cascade:
            gbs = kind.bucket(bs, shared_groups, max_members)
            if gbs is not None:
                return kind, gbs
        return None

    def _cascade_graph_of(self, plan: CascadePlan, bs: int) -> tuple[CascadeGraphs, int] | None:
        shape = cascade_plan_shape(plan)
        return None if shape is None else self._cascade_graph(bs, *shape)

    def can_run(self, fb: ForwardBatch) -> bool:
        """Host-side facts only (flags, lengths of host lists, identities, shapes): no sync."""
        bs = fb.batch_size
        plan = fb.cascade_plan
        return (
            self.enabled
            and fb.is_decode
            and 0 < bs <= self.max_bs
            and (plan is None or self._cascade_graph_of(plan, bs) is not None)
            and fb.num_tokens == bs
            and int(fb.logits_indices.numel()) <= bs
            and fb.attn_backend is self.backend
            and fb.kv_pool is self.target.kv_pool
            and fb.req_to_token is self.target.req_table.table
        )

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits float32 of the rows fb.logits_indices names, for a batch can_run accepted (a
        fresh tensor, like eager; the graph computes every row's)."""
        bs, plan = fb.batch_size, fb.cascade_plan
        found = None if plan is None else self._cascade_graph_of(plan, bs)
        gbs = bucket_for(bs, self.sizes) if plan is None else (found[1] if found else None)
        if gbs is None or not self.enabled:
            raise ValueError(f"no captured graph for a decode batch of {bs}")
        graph = self.graphs[gbs] if found is None else found[0].graphs[gbs]
        with torch.inference_mode():
            self.inputs.load(fb)
            if found is not None and plan is not None:
                found[0].inputs.load(plan, bs)
                found[0].hits += 1
            sync_host_lists(graph.fb, fb, self.inputs.pad_row)
            graph.replay()
            # logit rows are increasing and distinct, so as many as rows means all of them
            every_row = int(fb.logits_indices.numel()) == bs
            out = graph.out[:bs].clone() if every_row else graph.out[fb.logits_indices]
        self.bucket_hits[gbs] += 1
        return out


def warn_capture_failed(what: str, where: str, fallback: str, e: Exception) -> None:
    """Log a failed capture by its message, not the exception: a kept log record would keep its
    traceback's frames, and with them the runner and the model, alive after the engine shuts down."""
    logger.warning("%s capture failed at %s (%s: %s); %s", what, where, type(e).__name__, str(e), fallback)


def release_graph_memory(device: torch.device) -> None:
    """After dropping graphs: wait for the device and hand their pool back. A broken context must
    not turn a fallback into a crash, so an error is only logged."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    except Exception:
        logger.exception("cleanup after a failed CUDA graph capture")


def try_create(target: GraphTarget, max_bs: int, cascade: bool = False) -> CudaGraphRunner | None:
    """A captured runner for a CUDA model whose attention backend supports CUDA graphs (it reads
    lengths from device tensors), or None with the reason logged; never raises."""
    if not target.attn_backend.supports_cuda_graphs:
        logger.info("CUDA graphs off: the attention backend reads host-side lengths")
        return None
    try:
        per_row = activation_bytes_per_row(target.config, target.dtype, choose_num_splits(1, 1, 1 << 30))
        fitted = fit_to_free_memory(target.device, max_bs, per_row, "CUDA graphs: max batch size")
        if fitted < 1:
            return None
        graphs = CudaGraphRunner(target, fitted, CudaGraphCapture(target.device), cascade)
    except Exception as e:
        logger.warning("CUDA graphs off (%s: %s); decoding eagerly", type(e).__name__, str(e))
        return None
    return graphs if graphs.capture_all() else None
