"""Keeps the top-level name `kernels` for the HF hub-kernels package. transformers imports it by
that name whenever its distribution is installed (transformers >= 5.25 depends on it); run from a
radixlm checkout, the name would first find the checkout's kernels/ folder (the repository root on
sys.path) or benchmarks/kernels.py (a benchmark script's folder), and importing transformers would
fail. Promises: once this module is imported (radixlm's first import does it), an `import kernels`
that would load a file of a radixlm checkout (this one, or a source tree beside a non-editable
install: its pyproject names radixlm) loads the distribution's own package instead; any other
`kernels` (the user's own) resolves as before, and nothing changes where that distribution is not
installed."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

HUB_KERNELS = "kernels"


CHECKOUT = Path(__file__).resolve().parents[1]  # the folder holding dsl/, kernels/, benchmarks/


class HubKernelsFinder(importlib.abc.MetaPathFinder):
    """Resolves the top-level name `kernels` to one package folder where sys.path would resolve it
    to a file of this checkout."""

    def __init__(self, init_file: Path) -> None:
        self.init_file = init_file

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != HUB_KERNELS:
            return None
        found = importlib.machinery.PathFinder.find_spec(fullname, path)
        if found is None or found.origin is None or not in_a_checkout(Path(found.origin).resolve()):
            return None  # resolves as it would without radixlm
        return importlib.util.spec_from_file_location(
            HUB_KERNELS, self.init_file, submodule_search_locations=[str(self.init_file.parent)]
        )


def in_a_checkout(origin: Path) -> bool:
    """Whether `origin` (kernels/__init__.py or benchmarks/kernels.py) is a file of a radixlm
    source tree: this one, or one whose pyproject.toml, two folders up, names radixlm."""
    if origin.is_relative_to(CHECKOUT):
        return True
    try:
        project = tomllib.loads((origin.parent.parent / "pyproject.toml").read_text())["project"]
    except (OSError, ValueError, KeyError):
        return False
    return isinstance(project, dict) and project.get("name") == "radixlm"


def hub_kernels_init() -> Path | None:
    """kernels/__init__.py of the installed `kernels` distribution, or None."""
    try:
        dist = importlib.metadata.distribution(HUB_KERNELS)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.as_posix() == f"{HUB_KERNELS}/__init__.py":
            return Path(str(dist.locate_file(f)))
    return None


def route_hub_kernels() -> None:
    """Install the finder once, where the distribution is installed and `kernels` not yet loaded."""
    if HUB_KERNELS in sys.modules or any(isinstance(f, HubKernelsFinder) for f in sys.meta_path):
        return
    init = hub_kernels_init()
    if init is not None and init.exists():
        sys.meta_path.insert(0, HubKernelsFinder(init))


route_hub_kernels()
