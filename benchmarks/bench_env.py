"""Environment facts recorded beside every benchmark result: GPU, versions, date, load."""

from __future__ import annotations

import datetime as dt
import importlib.metadata as md
import json
import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name and last-level cache (CPU results depend on whether weights fit it)."""
    name = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"))
    last = caches[-1].read_text().strip() if caches else "?"
    return f"{name}, last-level cache {last}"


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "load_average_1_5_15": os.getloadavg(),
        "gpu": "none",
    }
    for pkg in ("radixlm", "torch", "transformers", "triton", "xgrammar"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            env[pkg] = None
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name()
    except ImportError:
        pass
    return env


def device_tag(env: dict[str, Any]) -> str:
    """The suffix of a result file's name: cpu, h200 or gpu."""
    gpu = env.get("gpu", "none")
    return "cpu" if gpu == "none" else "h200" if "H200" in gpu else "gpu"


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")
