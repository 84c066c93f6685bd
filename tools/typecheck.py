"""mypy over radixlm as it is installed: pyproject's package-dir maps dsl/ to `radixlm` and the
runtime folders beside it, so the package layout is rebuilt from symlinks in a temporary folder
and mypy checks that (run from the repo: `python tools/typecheck.py`; exit status is mypy's)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_layout(dest: Path) -> None:
    """One folder per package, holding links to its source files."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package, source in config["tool"]["setuptools"]["package-dir"].items():
        folder = dest.joinpath(*package.split("."))
        folder.mkdir(parents=True, exist_ok=True)
        for file in (ROOT / source).glob("*.py"):
            (folder / file.name).symlink_to(file)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        build_layout(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "radixlm"]
        return subprocess.call(cmd, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
