"""Two code versions' suite results, side by side, where the workers did not all fit one device
call: `benchmarks/h200/suite_ab.sh` runs each version's own suite.py, alternating, and a long A/B
is split over calls by workers (`--workers engine`, then `--workers radix_off,hf,server`, then
again `--engine-steps` for noisy rows). This merges each version's results into rounds, computes
the ratios with that version's own suite_report.py (read from .ab/<version>.tar, as packed), and
prints new / old for every ratio both versions report, in the ratio's better direction.

    python benchmarks/suite_ab_report.py DIR [DIR ...]   # each call's ab_<v>_*.json, in call order
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import tarfile
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

VERSIONS = ("old", "new")


def merge_rounds(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One version's suite results (in run order) as rounds: round 1 holds each worker's first
    result; round k replaces, in round 1, the steps of each worker's k-th result (a repeat with
    --engine-steps replaces only the steps it ran). Failed workers (no steps) count nowhere."""
    per_worker: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        for name, worker in result["workers"].items():
            steps = {k: v for k, v in worker.items() if not k.startswith("_")}
            if steps:
                per_worker.setdefault(name, []).append(steps)
    if not per_worker:
        return []
    base = {**results[0], "workers": {name: runs[0] for name, runs in per_worker.items()}}
    rounds = [base]
    for k in range(1, max(len(runs) for runs in per_worker.values())):
        merged = copy.deepcopy(base)
        for name, runs in per_worker.items():
            if k < len(runs):
                merged["workers"][name].update(runs[k])
        rounds.append(merged)
    return rounds


def own_report(version: str, tar: Path) -> ModuleType:
    """The suite_report module of the packed version."""
    name = f"suite_report_{version}"
    with tempfile.TemporaryDirectory() as folder, tarfile.open(tar) as t:
        t.extract("benchmarks/suite_report.py", folder, filter="data")
        spec = importlib.util.spec_from_file_location(name, Path(folder) / "benchmarks" / "suite_report.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return module


def side_by_side(
    ratios: dict[str, list[dict[str, Any]]], versions: tuple[str, str] = VERSIONS
) -> dict[str, dict[str, Any]]:
    """Per ratio both versions (old, new) report: each round's value and new / old of the round
    means, in the better direction (above 1: the new version is better)."""
    first, second = versions
    out: dict[str, dict[str, Any]] = {}
    for key in ratios[second][0] if ratios[second] else {}:
        values = {v: [r[key]["value"] for r in ratios[v] if key in r] for v in versions}
        if not values[first] or not values[second]:
            continue
        old, new = (sum(values[v]) / len(values[v]) for v in versions)
        higher = ratios[second][0][key]["higher_is_better"]
        better = (new / old if higher else old / new) if old and new else None
        out[key] = {**values, "new_vs_old": better, "what": ratios[second][0][key]["what"]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--packs", type=Path, default=Path(".ab"), help="folder of the versions' tars")
    p.add_argument(
        "--versions", nargs=2, default=list(VERSIONS), metavar=("OLD", "NEW"), help="names run with VERSIONS="
    )
    p.add_argument("--tolerance", type=float, default=0.03, help="flag a ratio worse by more than this")
    p.add_argument("--out", type=Path, default=None, help="write the comparison as JSON here")
    args = p.parse_args()
    versions = (args.versions[0], args.versions[1])
    ratios: dict[str, list[dict[str, Any]]] = {}
    for v in versions:
        files = [f for d in args.dirs for f in sorted(d.glob(f"ab_{v}_*.json"))]  # calls in the order given
        report = own_report(v, args.packs / f"{v}.tar")
        ratios[v] = [report.ratios(r) for r in merge_rounds([json.loads(f.read_text()) for f in files])]
    rows = side_by_side(ratios, versions)
    worse = 0
    for key, row in rows.items():
        rel = row["new_vs_old"]
        flag = rel is not None and rel < 1 - args.tolerance
        worse += flag
        shown = " / ".join(", ".join(f"{x:.4g}" for x in row[v]) for v in versions)
        print(
            f"{key:24s} old / new: {shown:40s} new vs old {rel or float('nan'):.3f}{'  WORSE' if flag else ''}"
        )
    reported = {key for v in versions for r in ratios[v] for key in r}
    if reported - set(rows):  # a worker failed on one side: say so, never a silent pass
        print("not compared (a version lacks them):", ", ".join(sorted(reported - set(rows))))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 1 if worse or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
