"""GPU test helpers: memory fractions on top of what the process already holds, so one test's
engine (a module fixture still alive, a leak under investigation) cannot starve the next."""

from __future__ import annotations

import gc

import torch


def mem_fraction(extra: float) -> float:
    """mem_fraction_static that leaves `extra` of the GPU to a new engine after what is in use now."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return min(0.95, extra + (total - free) / total)
