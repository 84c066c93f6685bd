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
    """One version's suite results (in run order) as rounds, paired by step: round k holds each
    (worker, step)'s k-th measurement, or its first where that step ran fewer times. So steps
    split over calls pair run by run (the k-th `serving` with the k-th `server`), and a repeat
    with --engine-steps adds rounds only to the steps it ran. Failed workers count nowhere."""
    per_step: dict[tuple[str, str], list[Any]] = {}
    for result in results:
        for name, worker in result["workers"].items():
            for step, value in worker.items():
                if not step.startswith("_"):
                    per_step.setdefault((name, step), []).append(value)
    if not per_step:
        return []
    rounds = []
    for k in range(max(len(runs) for runs in per_step.values())):
        workers: dict[str, dict[str, Any]] = {}
        for (name, step), runs in per_step.items():
            workers.setdefault(name, {})[step] = copy.deepcopy(runs[k] if k < len(runs) else runs[0])
        rounds.append({**results[0], "workers": workers})
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
    """Per ratio both versions (old, new) report: each distinct round value and new / old of
    their means, in the better direction (above 1: the new version is better). A value equal to
    an earlier round's reuses the same measurements (a round that re-ran other steps only), so it
    counts once."""
    first, second = versions
    out: dict[str, dict[str, Any]] = {}
    keys = dict.fromkeys(key for r in ratios[second] for key in r)
    for key in keys:
        values = {v: list(dict.fromkeys(r[key]["value"] for r in ratios[v] if key in r)) for v in versions}
        if not values[first] or not values[second]:
            continue
        old, new = (sum(values[v]) / len(values[v]) for v in versions)
        row = next(r[key] for r in ratios[second] if key in r)
        better = (new / old if row["higher_is_better"] else old / new) if old and new else None
        out[key] = {**values, "new_vs_old": better, "what": row["what"]}
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
