"""transformers imports the HF hub-kernels package by its top-level name `kernels` when that
distribution is installed; from a radixlm checkout the name must not resolve to the checkout's
kernels/ folder or benchmarks/kernels.py (radixlm/_hub_kernels.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from radixlm._hub_kernels import hub_kernels_init

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(
    hub_kernels_init() is None, reason="the HF `kernels` distribution is not installed"
)


@pytest.mark.parametrize("cwd", [ROOT, ROOT / "benchmarks"])
def test_kernels_name_reaches_the_hub_package_from_a_checkout(cwd: Path) -> None:
    code = (
        "import sys; sys.path.insert(0, '.'); import radixlm.backend.tokenizer; "
        "import transformers.integrations.hub_kernels; import kernels; print(kernels.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert Path(out.stdout.strip()) == hub_kernels_init()


def test_without_the_route_the_checkout_shadows_the_hub_package() -> None:
    """The control: the same import with radixlm's route removed fails from the benchmarks folder."""
    code = (
        "import sys; sys.path.insert(0, '.'); import radixlm._hub_kernels as h; "
        "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, h.HubKernelsFinder)]; "
        "import kernels; print(kernels.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and Path(out.stdout.strip()) == ROOT / "benchmarks" / "kernels.py"


def test_a_users_own_kernels_module_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "kernels.py").write_text("MINE = True\n")
    code = "import sys; sys.path.insert(0, '.'); import radixlm; import kernels; print(kernels.MINE)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-800:]


def test_a_source_tree_beside_a_non_editable_install_is_routed_too(tmp_path: Path) -> None:
    """A benchmark run from another source tree of radixlm (its package installed elsewhere, not
    editable) finds that tree's benchmarks/kernels.py first, as it finds this checkout's."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "kernels.py").write_text("SHADOW = True\n")
    code = "import sys; sys.path.insert(0, '.'); import radixlm; import kernels; print(kernels.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path / "benchmarks", capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and Path(out.stdout.strip()) == hub_kernels_init(), out.stderr[-800:]
