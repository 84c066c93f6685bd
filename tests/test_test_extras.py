"""Every package a test skips without (`pytest.importorskip`) is a dependency or a test extra, so
the README's test command installs it and CI runs those tests instead of skipping them."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_TARGET = re.compile(r"importorskip\(\s*[\"']([A-Za-z_][\w.]*)[\"']")


def requirement_names(reqs: list[str]) -> set[str]:
    """Distribution names of PEP 508 requirement strings, as importable names ("a-b" -> "a_b")."""
    return {re.split(r"[\s;<>=!~\[]", r, maxsplit=1)[0].lower().replace("-", "_") for r in reqs}


def skip_targets(paths: list[Path]) -> dict[str, Path]:
    """Top-level module each importorskip names, with a file that names it."""
    return {m.group(1).split(".")[0]: p for p in paths for m in SKIP_TARGET.finditer(p.read_text())}


def test_every_importorskip_target_is_installed_by_the_test_command() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = requirement_names(project["dependencies"] + project["optional-dependencies"]["test"])
    targets = skip_targets(sorted(p for p in (ROOT / "tests").glob("*.py") if p.name != Path(__file__).name))
    assert "scipy" in targets  # the scan finds what it looks for
    missing = {name: str(path.relative_to(ROOT)) for name, path in targets.items() if name not in installed}
    assert not missing, f"add to pyproject's test extras (or dependencies): {missing}"


def test_the_scan_reads_requirements_and_skip_calls() -> None:
    assert requirement_names(["scipy", "sglang-router; platform_system == 'Linux'", "ruff==0.17.6"]) == {
        "scipy",
        "sglang_router",
        "ruff",
    }
    assert SKIP_TARGET.findall("pytest.importorskip(\"scipy.stats\")\nimportorskip( 'uvloop' )") == [
        "scipy.stats",
        "uvloop",
    ]
