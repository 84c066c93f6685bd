"""Shared pieces of the kernel benchmarks (benchmarks/kernels.py, benchmarks/kernels_cascade.py,
benchmarks/decode_split_counts.py): the shape constants, the split count a decode graph runs with, CUDA-graph timing with launch cost hidden and cold L2, paged tables laid out
in whole 16-token pages (the bytes FlashInfer reads), K/V buffer sets, FlashInfer plain decode."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

HQ, HKV, D, PAGE = 32, 8, 128, 16
DT = torch.bfloat16
DEV = "cuda"
L2_BYTES = 60e6
GRAPH_CONTEXT = 16384  # the suite engine's context limit, which sizes its decode graphs' splits


def log(*a: object, **kw: object) -> None:
    print(*a, **kw, flush=True)


GRAPH_FAILURES: list[str] = []


def graph_splits(bsz: int) -> int:
    """The split count a decode CUDA graph of bsz rows runs with: sized for the context limit."""
    from radixlm.kernels.decode_splits import choose_num_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return choose_num_splits(bsz, HKV, GRAPH_CONTEXT, sms)


def time_fn(
    fns: list[Callable[[], object]], reps: int = 40, trials: int = 7, graph: bool = True, label: str = ""
) -> float:
    """Median seconds per call. Each trial replays a CUDA graph of `reps` calls rotating over `fns`
    (launch cost hidden); if capture fails, the same calls are queued eagerly between events."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    run = None
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for f in fns:
                    f()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(reps):
                    fns[i % len(fns)]()
            run = g.replay
        except Exception as exc:
            GRAPH_FAILURES.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            torch.cuda.synchronize()
    if run is None:

        def run() -> None:
            for i in range(reps):
                fns[i % len(fns)]()

    run()
    out = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / reps)
    return statistics.median(out)


def n_sets(bytes_per_set: float) -> int:
    return max(2, math.ceil(3 * L2_BYTES / bytes_per_set))


def paged_table(seq_lens: list[int], scattered: bool = False, shared: int = 0) -> tuple[torch.Tensor, int]:
    """req_to_token whose rows map to whole 16-token pages (page p = slots 1+16p..16p+16) in a
    random page order — the same bytes FlashInfer reads at page size 16 — or to scattered single
    slots. With shared > 0 every row starts with the same `shared` slots."""
    pages_per = [math.ceil((L - shared) / PAGE) for L in seq_lens]
    shared_pages = math.ceil(shared / PAGE)
    n_pages = sum(pages_per) + shared_pages
    order = torch.randperm(n_pages, device=DEV)
    slots_all = (order[:, None] * PAGE + 1 + torch.arange(PAGE, device=DEV)).flatten()
    if scattered:
        slots_all = slots_all[torch.randperm(slots_all.numel(), device=DEV)]
    table = torch.zeros(len(seq_lens), max(seq_lens) + PAGE, dtype=torch.int64, device=DEV)
    pre = slots_all[: shared_pages * PAGE]
    used = shared_pages * PAGE
    for b in range(len(seq_lens)):
        own = pages_per[b] * PAGE
        table[b, :shared] = pre[:shared]
        table[b, shared : shared + own] = slots_all[used : used + own]
        used += own
    return table, n_pages * PAGE + 1


def fi_pages(table: torch.Tensor, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer page table (indptr, indices, last_page_len) for a paged_table (whole pages)."""
    idx, ptr, last = [], [0], []
    for b, L in enumerate(seq_lens):
        n = math.ceil(L / PAGE)
        idx.append((table[b, : n * PAGE : PAGE] - 1) // PAGE)
        ptr.append(ptr[-1] + n)
        last.append(L - (n - 1) * PAGE)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=DEV)  # noqa: E731
    return i32(ptr), torch.cat(idx).to(torch.int32), i32(last)


def kv_sets(n_slots: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            torch.randn(n_slots, HKV, D, dtype=DT, device=DEV),
            torch.randn(n_slots, HKV, D, dtype=DT, device=DEV),
        )
        for _ in range(count)
    ]


def fi_view(buf: torch.Tensor) -> torch.Tensor:
    return buf[1:].view(-1, PAGE, HKV, D)


def fi_decode(fi, table, seq, sets, qs, graph: bool = True) -> float:
    ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=DEV)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    ptr, idx, last = fi_pages(table, seq)
    w.plan(ptr, idx, last, HQ, HKV, D, PAGE, q_data_type=DT, kv_data_type=DT)
    return (
        time_fn(
            [lambda i=i: w.run(qs[i], (fi_view(sets[i][0]), fi_view(sets[i][1]))) for i in range(len(sets))],
            graph=graph,
            label="flashinfer decode",
        )
        * 1e6
    )
