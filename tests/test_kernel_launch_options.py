"""Every Triton launch in `kernels/` names `enable_fp_fusion`: Triton 3.10 turns the default off,
so a kernel that relies on contracted multiply-adds for speed (or must round as torch does, with
them off) says which, and behaves alike on every Triton radixlm supports."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def launches_without_fp_fusion(source: str) -> list[int]:
    """Lines of the `kernel[grid](...)` calls in source that leave enable_fp_fusion unnamed."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and "enable_fp_fusion" not in [k.arg for k in node.keywords]
    ]


def test_the_check_finds_an_unnamed_launch() -> None:
    assert launches_without_fp_fusion("k[(1,)](x, BLOCK=4)\nk[(1,)](x, enable_fp_fusion=False)\n") == [1]


def test_every_launch_names_fp_fusion() -> None:
    files = sorted(KERNELS.glob("*.py"))
    assert len(files) > 10
    missing = {p.name: lines for p in files if (lines := launches_without_fp_fusion(p.read_text()))}
    assert not missing, f"launches without enable_fp_fusion (file: lines): {missing}"
