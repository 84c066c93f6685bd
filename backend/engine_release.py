"""What Engine.shutdown uses when something outside the engine still holds its model: empty the
model's tensors in place (the device memory is freed whoever holds the module) and name the
holders in the log, so the reference can be found."""

from __future__ import annotations

import gc

import torch


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
