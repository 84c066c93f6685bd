"""Engine limits that fit the machine, derived the way SGLang derives them: from the device's
memory and the KV pool's size, unless the user set them. Promises: every limit is >= 1, and the
CUDA-graph batch limit never exceeds the running-request limit."""

from __future__ import annotations

import torch

GIB = 1 << 30
# Memory classes by the card's marketing size: an "80 GB" H100 or A100 reports 79.3-79.7 GiB and a
# "40 GB" A100 39.4 GiB, so each class starts well below its name.
CLASS_80GB = 60 * GIB
CLASS_40GB = 30 * GIB


def device_memory(device: torch.device) -> int:
    """Total memory of a CUDA device in bytes (0 elsewhere)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def chunked_prefill_size(device: torch.device) -> int:
    """Prompt tokens per step: large GPUs fill their matrix units with bigger chunks."""
    mem = device_memory(device)
    return 8192 if mem >= CLASS_80GB else 4096 if mem >= CLASS_40GB else 2048


def max_running_requests(device: torch.device, kv_slots: int) -> int:
    """As many decoders as the KV pool holds at about 1,024 tokens each (256 at least, 4,096 at
    most on a GPU; the CPU keeps 256: its steps are too slow to gain from wider batches)."""
    if device.type != "cuda":
        return 256
    return max(256, min(4096, kv_slots // 1024))


def cuda_graph_max_bs(device: torch.device, max_running: int) -> int:
    """Largest decode batch captured as a CUDA graph: every batch the scheduler may run, up to 1,024
    on 80 GB GPUs (an eager step of hundreds of requests costs ~10 ms of host time), 256 on 40 GB,
    else 160."""
    mem = device_memory(device)
    cap = 1024 if mem >= CLASS_80GB else 256 if mem >= CLASS_40GB else 160
    return max(1, min(cap, max_running))


def piecewise_max_tokens(device: torch.device) -> int:
    """Largest extend step whose dense work replays from piecewise CUDA graphs: 1,024 tokens on a
    GPU (past that an 8B model's matmuls take longer than an eager forward's launches, which then
    hide behind them), none elsewhere."""
    return 1024 if device.type == "cuda" else 0
