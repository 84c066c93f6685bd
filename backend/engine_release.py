"""How Engine.shutdown frees the device memory it owns once it has dropped its own references:
cycles collected, and when something outside the engine still holds its model, the model's tensors
emptied in place (the device memory is freed whoever holds the module) and the holders named in the
log, so the reference can be found; the KV pool is emptied whoever holds it."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from . import collector

logger = logging.getLogger(__name__)


def release_tensors(model: torch.nn.Module) -> None:
    """Empty every parameter and buffer in place: whoever still holds the module keeps no memory."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def holders(obj: object) -> list[str]:
    """Type names of what references obj (an instance dict is named by its owner's type)."""
    names: set[str] = set()
    for ref in gc.get_referrers(obj):
        if isinstance(ref, dict):
            owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
            names.update(f"{type(o).__name__}.__dict__" for o in owners)
        elif not isinstance(ref, list):  # the referrer list of this very call
            names.add(type(ref).__name__)
    return sorted(names)


def release_device(
    model: Callable[[], torch.nn.Module | None],
    pool: Callable[[], Any],
    device: torch.device,
    others_running: bool,
) -> None:
    """Free the weights and KV buffers the engine owned (given as weak references: the engine has
    already let go of them), and on CUDA return the cached blocks to the driver."""
    collector.thaw_and_collect()  # the model runner and its graph runner / attention backend form cycles
    held = model()
    if held is not None:  # free the weights anyway, and say who keeps the module alive
        logger.warning(
            "engine shut down but its model is still referenced (by %s); its weights are released",
            ", ".join(holders(held)) or "unknown",
        )
        release_tensors(held)
        del held
    kv = pool()
    if kv is not None:  # the largest allocation: never left to whoever holds the runner
        kv.k_buffers.clear()
        kv.v_buffers.clear()
        del kv
    collector.engine_stopped(others_running=others_running)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
