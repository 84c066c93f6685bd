"""Engine limits derived from the device (backend/limits.py): the memory classes follow what
cards report (an "80 GB" H100 reports 79.65 GiB, an "80 GB" A100 79.3, a "40 GB" A100 39.4), and
the graph limit never exceeds the running-request limit."""

from __future__ import annotations

import pytest
import torch

from radixlm.backend import limits

GIB = 1 << 30
CUDA = torch.device("cuda")


@pytest.mark.parametrize(
    ("total_gib", "chunk", "graph_cap"),
    [(139.8, 8192, 1024), (79.65, 8192, 1024), (79.3, 8192, 1024), (39.4, 4096, 256), (23.6, 2048, 160)],
)
def test_memory_classes_follow_what_cards_report(monkeypatch, total_gib, chunk, graph_cap) -> None:
    monkeypatch.setattr(limits, "device_memory", lambda device: int(total_gib * GIB))
    assert limits.chunked_prefill_size(CUDA) == chunk
    assert limits.cuda_graph_max_bs(CUDA, 4096) == graph_cap
    assert limits.cuda_graph_max_bs(CUDA, 413) == min(graph_cap, 413)


def test_cpu_limits() -> None:
    cpu = torch.device("cpu")
    assert limits.chunked_prefill_size(cpu) == 2048 and limits.max_running_requests(cpu, 10**6) == 256
    assert limits.max_running_requests(CUDA, 100) == 256 and limits.max_running_requests(CUDA, 10**8) == 4096
